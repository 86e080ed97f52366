"""Every ``LSGD_HPC_*`` environment variable the package reads, in one place: its name,
default, parser and one-line meaning, and :meth:`EnvVar.read` to read it.

A read looks at ``os.environ`` when it is called (or at the mapping it is given: the
trainer's checks take the job's environment as a dict), never at import time: tests set
the variables per process. docs/cluster.md's "Environment variables" table lists them all
(tests/library/test_envvars.py checks the table against :data:`VARIABLES`, and that no
other ``LSGD_HPC_*`` name is read under lsgd_hpc/).

This module imports nothing of the package, so that every sub-package may import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

__all__ = ["EnvVar", "VARIABLES", "markdown_table", "RANKS_PER_NODE", "COMM_VALIDATE", "ULFM",
           "FT_SETTLE_SECONDS", "HEAL_TIMEOUT", "HEAL_JOIN_TIMEOUT", "HEAL_BLOCKING",
           "REPLACEMENT_STARTED", "TEST_REPLACEMENT_DIES"]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable. ``parse`` turns its value (None when it is not set) into
    what the package uses, ``default`` included; ``default`` is for the docs' table;
    ``use`` is "user" (a setting), "internal" (the package sets it for a process it starts)
    or "testing only"."""

    name: str
    default: str
    parse: Callable[[Optional[str]], Any]
    meaning: str
    use: str = "user"

    def raw(self, env: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The value as set (None when unset), from ``env`` or else ``os.environ``."""
        return (os.environ if env is None else env).get(self.name)

    def read(self, env: Optional[Mapping[str, str]] = None) -> Any:
        """The parsed value, from ``env`` or else ``os.environ`` (read now)."""
        return self.parse(self.raw(env))


def _int_or_none(raw: Optional[str]) -> Optional[int]:
    """int(raw), or None when unset or empty (a bad value raises ValueError; the trainer's
    option check says so first, lsgd_hpc/cli/config.py)."""
    return int(raw) if raw else None


def _seconds(default: float, at_least_zero: bool = False, strip: bool = False):
    def parse(raw: Optional[str]) -> float:
        raw = (raw or "").strip() if strip else raw
        try:
            if not raw:
                return default
            return max(0.0, float(raw)) if at_least_zero else float(raw)
        except ValueError:
            return default
    return parse


def _is_one(raw: Optional[str]) -> bool:
    return (raw or "").strip() == "1"


def _float_or_none(raw: Optional[str]) -> Optional[float]:
    return None if raw is None else float(raw)


RANKS_PER_NODE = EnvVar(
    "LSGD_HPC_RANKS_PER_NODE", "(by host name)", _int_or_none,
    "group K consecutive ranks as one node, as --ranks-per-node K (read when that is not given)")
COMM_VALIDATE = EnvVar(
    "LSGD_HPC_COMM_VALIDATE", "1", lambda raw: raw != "0",
    "0 turns off the MPI and torch backends' agreement check (one small allreduce) before "
    "every collective")
ULFM = EnvVar(
    "LSGD_HPC_ULFM", "(unset)", _is_one,
    "1 asserts that an MPI other than Open MPI has ULFM active (MPICH: mpiexec "
    "-disable-auto-cleanup)")
FT_SETTLE_SECONDS = EnvVar(
    "LSGD_HPC_FT_SETTLE_SECONDS", "0.5", _seconds(0.5, at_least_zero=True, strip=True),
    "seconds of quiet (no new failure noticed) a shrink waits for; 0 turns the wait off")
HEAL_TIMEOUT = EnvVar(
    "LSGD_HPC_HEAL_TIMEOUT", "600", _seconds(600.0),
    "seconds a heal's replacement may take from its spawn to ready before it is taken for "
    "dead and spawned again")
HEAL_JOIN_TIMEOUT = EnvVar(
    "LSGD_HPC_HEAL_JOIN_TIMEOUT", "120", _seconds(120.0),
    "seconds the heal's join may take before every process in it ends itself (status 3)")
HEAL_BLOCKING = EnvVar(
    "LSGD_HPC_HEAL_BLOCKING", "(unset)", _is_one,
    "1 makes the survivors wait for their replacements at the first step boundary after a "
    "spawn (a machine with no core to spare for the replacement's start-up)", "testing only")
REPLACEMENT_STARTED = EnvVar(
    "LSGD_HPC_REPLACEMENT_STARTED", "(unset)", _float_or_none,
    "set by python -m lsgd_hpc.comm.replacement in a heal's replacement: when it started "
    "(time.time()); a process with it set joins the survivors", "internal")
TEST_REPLACEMENT_DIES = EnvVar(
    "LSGD_HPC_TEST_REPLACEMENT_DIES", "(unset)", lambda raw: raw or None,
    "set by --inject-failure's plan in a replacement that must die: join or resume:RANK",
    "testing only")

#: every variable, in the docs table's order
VARIABLES = (RANKS_PER_NODE, COMM_VALIDATE, ULFM, FT_SETTLE_SECONDS, HEAL_TIMEOUT,
             HEAL_JOIN_TIMEOUT, HEAL_BLOCKING, REPLACEMENT_STARTED, TEST_REPLACEMENT_DIES)


def markdown_table() -> str:
    """docs/cluster.md's table of the variables, as it is there (a test compares them)."""
    rows = ["| Variable | Default | Use | Meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.default} | {v.use} | {v.meaning} |" for v in VARIABLES]
    return "\n".join(rows)
