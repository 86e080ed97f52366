"""The trainer's start and end as a job: which world to join before the options are agreed
on, the one start-up agreement, and leaving together (exit status, torch's process group)."""

from __future__ import annotations

import os
import re
import socket
import sys
from typing import Optional, Sequence

__all__ = ["PROG", "EXIT_USAGE", "EXIT_STOPPED", "env_rank", "usage_error", "boot_backend",
           "agree_on_start", "exit_together", "close_torch_world"]

PROG = "lsgd_hpc.train"
EXIT_USAGE = 2        # a user's mistake, found before any collective
EXIT_STOPPED = 143    # stopped by SIGTERM/SIGUSR1 after a complete checkpoint (not requeued)


def env_rank(env: Optional[dict] = None) -> int:
    """This process's rank as its launcher set it, readable before MPI starts (to print a
    message once; with ``srun --mpi=pmi2`` under Open MPI every process is rank 0 of a world
    of its own, and only this tells them apart)."""
    from lsgd_hpc.comm.launcher import env_rank as rank
    return rank(env)


def usage_error(message: str) -> int:
    if env_rank() == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


#: ``name='value'``, ``name="value"`` or ``name=NUMBER``: an argument as the library names it
_LIBRARY_ARGUMENT = re.compile(r"\b([a-z][a-z0-9_]*)=(?:'([^']*)'|\"([^\"]*)\"|(\d[\d.]*))")


def option_spelling(message: str) -> str:
    """A library message in the trainer's words: an argument of the library written as
    ``name='value'`` that is also an option of the trainer becomes ``--name value``
    (``on_failure='heal' needs ...`` -> ``--on-failure heal needs ...``); the rest stays."""
    from lsgd_hpc.cli.config import cli_options
    options = cli_options()

    def flag(m):
        o = options.get(m.group(1))
        if o is None:
            return m.group(0)
        value = next(v for v in m.groups()[1:] if v is not None)
        return f"{o.flag} {value}"
    return _LIBRARY_ARGUMENT.sub(flag, message)


def boot_backend(cfg, argv: Optional[Sequence[str]], env: dict) -> str:
    """'torch' or 'mpi': the world the start-up agreement runs over. Every rank must choose
    alike, also one whose options failed to parse: under torchrun always torch; else the
    parsed --backend, or (parse failed) the --backend written on the command line. Horovod
    starts over MPI and joins Horovod once every rank agreed to go on."""
    from lsgd_hpc.comm.launcher import detect
    if detect(env).launcher == "torchrun":
        return "torch"
    backend = cfg.backend if cfg is not None else None
    if backend is None:
        args = list(sys.argv[1:] if argv is None else argv)
        for i, arg in enumerate(args):
            if arg == "--backend" and i + 1 < len(args):
                backend = args[i + 1]
            elif arg.startswith("--backend="):
                backend = arg.split("=", 1)[1]
    return "torch" if backend == "torch" else "mpi"


def agree_on_start(comm, error: Optional[str], code: int, signum: Optional[int]):
    """The one start-up collective: every rank says whether its checks failed (why, and the
    exit status that goes with it) and whether a stop signal came. Checks that can differ
    between ranks (a data folder missing on one node, a per-node environment, a model that
    fails to build there) would otherwise leave the good ranks waiting forever in their first
    collective.

    Returns ``(message, code, signals)``: the first failing rank's message (saying where it
    failed when not every rank did) and exit status, or ``(None, 0, ...)``; and the set of
    signals the ranks got."""
    votes = comm.allgather_object((error, code, signum, socket.gethostname()))
    failed = [r for r, vote in enumerate(votes) if vote[0]]
    stopped = {vote[2] for vote in votes if vote[2] is not None}
    if not failed:
        return None, 0, stopped
    message, code = votes[failed[0]][:2]
    if len(failed) < len(votes):
        hosts = sorted({votes[r][3] for r in failed})
        message += (f" (on {len(failed)} of {len(votes)} ranks, from rank {failed[0]}; "
                    f"host {', '.join(hosts)})")
    return message, code, stopped


def exit_together(code: int) -> None:
    """Leave at once after an agreed usage error: every rank has the same status, but under
    ``srun --kill-on-bad-exit`` the first rank to exit with it gets the others killed while
    they still tear down the interpreter, and the step then reports the kill (143), not 2."""
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.Finalize()
        os._exit(code)


def close_torch_world(code: int) -> None:
    """--backend torch: leave the process group together (a barrier, then destroy it), so that
    no rank's gloo threads see a peer's connections close under them while the interpreter
    tears down (they abort the process: SIGABRT instead of the agreed status)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from lsgd_hpc.comm.torchdist import _leave_world
    _leave_world()          # a barrier, destroy; rank 0 (the TCP store's server) leaves last
    if "mpi4py.MPI" not in sys.modules:
        # Everything is on disk (metrics flushed, checkpoints committed): leave now. The
        # interpreter's teardown can still destroy a c10d thread that is joinable, which
        # aborts the process ("terminate called without an active exception", SIGABRT; seen
        # once in CI on the emulated cluster) and turns a finished job into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
