"""``python -m lsgd_hpc.comm.replacement PAYLOAD``: how a heal starts a replacement rank.

The survivors spawn this module (lsgd_hpc/comm/heal.py) with the program they run, its
arguments, working folder and environment. It restores the environment first (before MPI
starts: the settings MPI reads at MPI_Init), starts MPI at once (the survivors' spawn
returns then), and runs the program as ``__main__``: its ``lsgd_hpc.init`` joins the
survivors (``lsgd_hpc.comm.heal.join``) when the start-up is done.
"""

from __future__ import annotations

import base64
import json
import os
import runpy
import sys
import time

from lsgd_hpc.envvars import REPLACEMENT_STARTED


def main(argv=None) -> None:
    started = time.time()
    argv = sys.argv[1:] if argv is None else argv
    data = json.loads(base64.b64decode(argv[0]).decode())
    for key, value in data["env"].items():
        os.environ.setdefault(key, value)
    os.environ[REPLACEMENT_STARTED.name] = repr(started)
    os.chdir(data["cwd"])
    from lsgd_hpc.comm.ulfm import prepare_mpi_environment
    prepare_mpi_environment()
    from mpi4py import MPI  # noqa: F401 - MPI_Init now: the survivors' spawn returns
    if "module" in data:
        sys.argv = [data["module"]] + data["argv"]
        runpy.run_module(data["module"], run_name="__main__", alter_sys=True)
    else:
        sys.argv = [data["script"]] + data["argv"]
        sys.path.insert(0, os.path.dirname(data["script"]))
        runpy.run_path(data["script"], run_name="__main__")


if __name__ == "__main__":
    main()
