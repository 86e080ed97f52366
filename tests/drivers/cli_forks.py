"""Run `python -m lsgd_hpc.train` many times for the price of one interpreter start.

Started by tests/cli_fork.py. Imports torch, h5py and the CLI once (not mpi4py.MPI: MPI is
never initialised here), then for each request on stdin (one JSON object per line: argv,
env, cwd) forks a child that runs the CLI's `__main__` exactly as `python -m` would, with
its stdout and stderr in files, and answers one JSON line: returncode, stdout, stderr.
Each child is a fresh process for MPI (it initialises MPI itself, as a singleton)."""

import json
import os
import runpy
import shutil
import sys
import tempfile

import h5py  # noqa: F401 - the imports a CLI run pays for, paid once here
import numpy  # noqa: F401
import torch  # noqa: F401
import yaml  # noqa: F401

import lsgd_hpc.cli.config  # noqa: F401
import lsgd_hpc.cli.train  # noqa: F401
import lsgd_hpc.models.zoo  # noqa: F401 - the parser's help imports the zoo (~1.5 s)
import torch._dynamo  # noqa: F401 - the first torch.optim optimizer imports it (~2 s)
from lsgd_hpc.session import exit_as_interpreter

assert "mpi4py.MPI" not in sys.modules, "MPI must not be initialised before a fork"


def run_child(req: dict, out_path: str, err_path: str) -> None:
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    # as `python -m` starts: the working folder first, then PYTHONPATH's entries
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [req["cwd"], *extra]
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["lsgd_hpc.train", *req["argv"]]
    code = 0
    try:
        runpy.run_module("lsgd_hpc.train", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:                   # noqa: BLE001 - as the interpreter would
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_as_interpreter(code)       # the exit handlers (metrics, trackers), MPI_Finalize


def main() -> None:
    tmp = tempfile.mkdtemp(prefix="cli_forks_")
    out_path, err_path = os.path.join(tmp, "out"), os.path.join(tmp, "err")
    for line in sys.stdin:
        req = json.loads(line)
        for p in (out_path, err_path):
            open(p, "w").close()
        pid = os.fork()
        if pid == 0:
            run_child(req, out_path, err_path)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        with open(out_path) as o, open(err_path) as e:
            answer = dict(returncode=code, stdout=o.read(), stderr=e.read())
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
