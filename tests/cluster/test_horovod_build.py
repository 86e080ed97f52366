"""The Horovod install script and the backend's behaviour without / with Horovod (one process).

The collective semantics over several ranks are covered by the comm tests parametrized over
both backends; these checks need no mpirun.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "install_horovod.sh"


def _horovod_importable() -> bool:
    code = "from mpi4py import MPI; import horovod.torch"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


HAVE_HOROVOD = _horovod_importable()


def test_install_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    text = SCRIPT.read_text()
    assert "set -euo pipefail" in text
    assert "horovod==$HOROVOD_VERSION" in text and "HOROVOD_VERSION=0.28.1" in text


def test_missing_horovod_is_one_clear_error():
    code = (
        "import sys; sys.modules['horovod'] = None\n"
        "from lsgd_hpc.comm import CommError, make_world\n"
        "try:\n"
        "    make_world('horovod')\n"
        "except CommError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    sys.exit('no CommError')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == ("--backend horovod: Horovod is not installed in this environment; run "
                   "`make horovod` (builds Horovod 0.28.1 against this torch, about 5 minutes)")


@pytest.mark.skipif(not HAVE_HOROVOD, reason="Horovod not installed (make horovod)")
def test_install_script_is_idempotent_when_installed():
    venv = Path(sys.executable).parent.parent
    res = subprocess.run(["bash", str(SCRIPT), str(venv)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "nothing to do" in res.stdout


@pytest.mark.skipif(not HAVE_HOROVOD, reason="Horovod not installed (make horovod)")
def test_single_rank_horovod_world():
    # In a subprocess: hvd.init() starts a background thread that should not outlive a test.
    code = (
        "import math, torch\n"
        "from lsgd_hpc.comm import make_world, CommError\n"
        "w = make_world('horovod')\n"
        "assert (w.rank, w.size, tuple(w.world_ranks)) == (0, 1, (0,))\n"
        "t = torch.arange(4.0)\n"
        "assert w.allreduce_(t, 'mean') is t and torch.equal(t, torch.arange(4.0))\n"
        "assert w.broadcast_(t, 0) is t\n"
        "assert w.stats.calls == 0 and w.stats.bytes_sent == 0\n"
        "e = w.elect(math.nan)\n"
        "assert (e.rank, e.world_rank, e.score) == (0, 0, math.inf)\n"
        "for bad in (lambda: w.allreduce_(torch.zeros(2, 2).t()),\n"
        "            lambda: w.allreduce_(torch.zeros(2, dtype=torch.float16)),\n"
        "            lambda: w.broadcast_(t, 1)):\n"
        "    try:\n"
        "        bad()\n"
        "    except CommError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit('no CommError')\n"
        "assert w.split(-1) is None\n"
        "sub = w.split(3)\n"
        "assert sub.size == 1 and sub.stats is w.stats\n"
        "print('ok')\n"
    )
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=180)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
