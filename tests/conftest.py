import os
import sys
from pathlib import Path

# Ranks (and this process) share two cores: one thread each.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
