"""The composition matrix (issue 47): every method x wire format x error feedback x top-k x
worker shape x failure policy x backend x model, at 4 ranks, 2 a node, through the job's own
pre-flight check (``lsgd_hpc.check_config``: the config parser, the world's checks and the
checks ``Method.__init__`` runs before its first collective; lsgd_hpc/cli/preflight.py), in
this process, without MPI.

Every refusal left must be one of the rows of the table "Combinations that are refused" in
docs/library.md (each row: a short pattern matched against the one-line message, why the
refusal is necessary, and whether the combination is meaningless): lifting a refusal means
deleting its row; adding one means documenting it. The accepted share of the meaningful
combinations is a ratchet (``ACCEPTED_SHARE``); the goal is 95 %.

    python tests/methods/test_matrix.py     # the table of refusals left, with counts

Horovod need not be installed: the check of a ``--backend horovod`` combination is decided
by the configuration's checks alone (the pre-flight check's "is Horovod installed" is answered
yes here; whether it imports beside MPI is the job's node's to check anyway).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.machinery
import importlib.util
import itertools
import re
import sys
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:              # (run as a script)
    sys.path.insert(0, str(REPO))

import lsgd_hpc                                      # noqa: E402
from lsgd_hpc.methods.registry import SPECS          # noqa: E402
from lsgd_hpc.methods.spec import COMM_DTYPES        # noqa: E402

#: the grid of issue 47 (in this order: the key of a combination)
GRID = {
    "algorithm": tuple(SPECS),
    "comm_dtype": COMM_DTYPES,
    "error_feedback": (False, True),
    "topk": (1.0, 0.01),
    "worker_ranks": (1, 2, "node"),
    "on_failure": ("abort", "shrink", "heal"),
    "backend": ("mpi", "torch", "horovod"),
    "model": ("mlp", "digits_cnn"),
}
WORLD = dict(world_size=4, ranks_per_node=2)
#: the accepted share of the meaningful combinations, measured 2026-12-07 at the end of
#: issue 47's items 1d and 4: 6,698 of 9,774, then 6,062 (0.6202) once workers of several
#: ranks with heal on the torch backend were refused again (their heal's restore times out
#: over and over in tests; 636 combinations). A ratchet: it may only go up; the goal is
#: 0.95; at the issue's start it was 2,634, 0.27.
ACCEPTED_SHARE = 0.6202
GOAL = 0.95
#: the table in docs/library.md
DOC = REPO / "docs" / "library.md"
TABLE_TITLE = "### Combinations that are refused"


def combinations() -> Iterator[Dict[str, object]]:
    keys = list(GRID)
    for values in itertools.product(*GRID.values()):
        yield dict(zip(keys, values))


#: the methods whose bf16 traffic holds no allreduce (broadcasts, neighbour exchanges)
NO_ALLREDUCE = ("lsgd", "lsgd-async", "gossip")


def meaningless(c: Dict[str, object]) -> bool:
    """Error feedback with nothing to feed back: dense fp32 (nothing rounded, nothing left
    out: the residual would stay zero), or dense bf16 for a method whose bf16 traffic holds
    no allreduce (a broadcast's or a neighbour's copy is a new vector each time, not a term
    of a sum over rounds)."""
    if not c["error_feedback"] or c["topk"] < 1:
        return False
    return c["comm_dtype"] == "fp32" or (c["comm_dtype"] == "bf16"
                                         and c["algorithm"] in NO_ALLREDUCE)


@contextlib.contextmanager
def _installed_horovod():
    """The pre-flight check's ``find_spec("horovod")`` answered yes (a spec, nothing
    imported), so that a --backend horovod combination is judged by the configuration's
    checks, as on a node with Horovod."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "horovod":
            return importlib.machinery.ModuleSpec("horovod", None)
        return real(name, *args, **kwargs)
    importlib.util.find_spec = find_spec
    try:
        yield
    finally:
        importlib.util.find_spec = real


@contextlib.contextmanager
def _one_parser():
    """The trainer's argument parser built once for the whole grid (it is the same for every
    call: built from the option tables, nothing from the call), not 10,000 times."""
    from lsgd_hpc.cli import config
    real = config._parser
    config._parser = functools.lru_cache(maxsize=1)(real)
    try:
        yield
    finally:
        config._parser = real


def check(c: Dict[str, object]) -> Optional[str]:
    """The job's one-line refusal of combination ``c`` (None: accepted); a check that raises
    instead of answering is a bug, reported as ``CRASH: ...`` (no row of the table matches
    it)."""
    options = dict(c, run_dir=None, max_steps=10)
    try:
        return lsgd_hpc.check_config(options, **WORLD).error
    except Exception as exc:       # noqa: BLE001 (reported, never accepted)
        return f"CRASH: {type(exc).__name__}: {exc}"


def run_grid() -> List[Tuple[Dict[str, object], Optional[str]]]:
    with _installed_horovod(), _one_parser():
        return [(c, check(c)) for c in combinations()]


# -- the documented refusals ---------------------------------------------------------------
Row = collections.namedtuple("Row", "pattern why kind")
#: a row's kind: meaningless, a dependency's stated limit, or not built yet
KINDS = ("meaningless", "dependency", "not yet built")


def documented() -> List[Row]:
    """The rows of docs/library.md's table: | `pattern` | why | kind |."""
    text = DOC.read_text()
    assert TABLE_TITLE in text, f"{DOC.name} has no section {TABLE_TITLE!r}"
    section = text.split(TABLE_TITLE, 1)[1].split("\n#", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [x.strip() for x in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or not cells[0].startswith("`"):
            continue
        rows.append(Row(cells[0].strip("`"), cells[1], cells[2].strip("*")))
    return rows


def classify(results, rows: List[Row]):
    """(count per row pattern, refusals matching no row: message -> count, rows matching a
    message two ways: message -> patterns)."""
    compiled = [(r, re.compile(r.pattern)) for r in rows]
    counts = collections.Counter()
    stray, double = collections.Counter(), {}
    memo: Dict[str, List[Row]] = {}
    for _, error in results:
        if error is None:
            continue
        hit = memo.get(error)
        if hit is None:
            hit = memo[error] = [r for r, rx in compiled if rx.search(error)]
        if not hit:
            stray[error] += 1
        elif len(hit) > 1:
            double[error] = [r.pattern for r in hit]
        else:
            counts[hit[0].pattern] += 1
    return counts, stray, double


def share(results) -> Tuple[int, int, int]:
    """(accepted, meaningful, all)."""
    meaningful = [e for c, e in results if not meaningless(c)]
    return sum(e is None for e in meaningful), len(meaningful), len(results)


# -- the tests --------------------------------------------------------------------------------
def test_the_grid_is_issue_47s():
    assert len(list(combinations())) == 8 * 6 * 2 * 2 * 3 * 3 * 3 * 2 == 10368
    # 432 with fp32, 54 with bf16 for each of the 3 methods without an allreduce
    assert sum(meaningless(c) for c in combinations()) == 432 + 3 * 54


def test_the_matrix():
    """The grid once (one test: workers of ``make test`` would each run it), then: every
    refusal is a documented one, the meaningless rows are the meaningless combinations, and
    the accepted share only goes up."""
    results = run_grid()
    every_refusal_left_is_a_documented_one(results)
    meaningless_combinations_are_refused_and_only_they_are_called_so(results)
    the_accepted_share_only_goes_up(results)


def every_refusal_left_is_a_documented_one(results):
    rows = documented()
    assert rows, "the table has no rows"
    assert all(r.kind in KINDS for r in rows), [r for r in rows if r.kind not in KINDS]
    counts, stray, double = classify(results, rows)
    assert not stray, "refusals not in docs/library.md's table:\n" + "\n".join(
        f"{n:6d}  {e}" for e, n in stray.most_common())
    assert not double, f"messages matching several rows: {double}"
    unused = [r.pattern for r in rows if counts[r.pattern] == 0]
    assert not unused, f"rows no combination is refused by (delete them): {unused}"


def meaningless_combinations_are_refused_and_only_they_are_called_so(results):
    compiled = [(re.compile(r.pattern), r) for r in documented()]
    for c, error in results:
        if meaningless(c):
            assert error is not None, c
        if error is not None:
            kinds = {r.kind for rx, r in compiled if rx.search(error)}
            if "meaningless" in kinds:
                assert meaningless(c), (c, error)


def the_accepted_share_only_goes_up(results):
    accepted, meaningful, _ = share(results)
    got = accepted / meaningful
    print(f"accepted {accepted} of {meaningful} meaningful combinations: {got:.1%} "
          f"(goal {GOAL:.0%})")
    assert got >= ACCEPTED_SHARE


def report(res=None) -> str:
    res = run_grid() if res is None else res
    accepted, meaningful, total = share(res)
    rows = documented() if TABLE_TITLE in DOC.read_text() else []
    counts, stray, _ = classify(res, rows)
    lines = [f"{total} combinations at {WORLD['world_size']} ranks, "
             f"{WORLD['ranks_per_node']} a node; {total - meaningful} meaningless; accepted "
             f"{accepted} of {meaningful} meaningful ({accepted / meaningful:.1%}; goal "
             f"{GOAL:.0%})", "", "refusals by documented row:"]
    for r in rows:
        lines.append(f"{counts[r.pattern]:6d}  [{r.kind}] {r.pattern}")
    if stray:
        lines += ["", "refusals matching no row:"]
        lines += [f"{n:6d}  {e}" for e, n in stray.most_common()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
