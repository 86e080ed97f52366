"""`python -m lsgd_hpc.train` for the tables of usage errors, without an interpreter start
(torch's import) per case: one helper process imports the CLI once and forks a fresh process
per run (tests/drivers/cli_forks.py). Each run is still its own process, with its own exit
status, stdout and stderr; what the CLI does with MPI it does in that process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

from mpi_util import REPO, mpi_env

DRIVER = REPO / "tests" / "drivers" / "cli_forks.py"


class ForkedCLI:
    """``run(args, env=None, cwd=None)`` -> CompletedProcess, one run at a time."""

    def __init__(self):
        env = mpi_env(None)
        self.proc = subprocess.Popen([sys.executable, str(DRIVER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self.lock = threading.Lock()

    def run(self, args, env=None, cwd=None, timeout=120) -> subprocess.CompletedProcess:
        req = dict(argv=[str(a) for a in args], env=mpi_env(env), cwd=str(cwd or REPO))
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            timer = threading.Timer(timeout, self.proc.kill)   # a hang fails, not stalls
            timer.start()
            try:
                line = self.proc.stdout.readline()
            finally:
                timer.cancel()
        if not line:
            raise RuntimeError(f"the CLI fork helper ended (status {self.proc.poll()}) on "
                               f"{args}")
        ans = json.loads(line)
        return subprocess.CompletedProcess(["python", "-m", "lsgd_hpc.train", *args],
                                           ans["returncode"], ans["stdout"], ans["stderr"])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

