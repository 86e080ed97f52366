"""Fault-injection soak: seeded random failure scenarios at 8 and 16 ranks, 4 ranks per node.

Each scenario is one ``mpirun --with-ft ulfm`` job of the trainer (``--on-failure shrink``,
digits, LSGD unless the scenario says otherwise) in which ranks are SIGKILLed *from outside*,
as a dead node or a crashed process would be: the driver finds each rank's process by its
``OMPI_COMM_WORLD_RANK`` and kills it a few seconds after the job's first progress line
(events a few seconds apart are killed in turn). Kinds of scenario, drawn with a seed:

* ``rank``: one random rank; ``node``: the 4 ranks of a random node; ``rank+node``: a rank,
  then another node 2-4 s later; ``rank0``: rank 0; ``leader``: the global leader of the last
  election (read from the run's log); ``checkpoint``: a rank killed while a checkpoint is
  written (``--inject-failure RANK:STEP:save``, the testing hook).

For each: the ranks expected to survive against those that finished (a rank finished when its
metrics file's last row is the step budget), the innocent deaths (ranks not killed that did not
finish), the steps the survivors finished, the largest recovery seconds of the /faults rows,
the job's exit status, and whether the run recorded its completion (RUN_DIR/complete.json).
A scenario passes when every survivor reaches the budget, nobody innocent dies, the run is
recorded complete and mpirun exits 0.

    python benchmarks/ft_soak.py --out ft_soak.json [--quick] [--scenarios 20] [--seed 0]
    python benchmarks/run_all.py --only ft_soak
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from lsgd_hpc.testing import kill_session, mpi_env, mpirun_cmd, rank_pids  # noqa: E402

RANKS_PER_NODE = 4
KINDS = ("rank", "node", "rank+node", "rank0", "leader", "checkpoint")


@dataclass
class Scenario:
    """One job: ``events`` are (seconds after the first progress line, [ranks]) to SIGKILL;
    ``inject`` an ``--inject-failure`` spec (the checkpoint case)."""

    name: str
    ranks: int
    steps: int
    events: List[tuple] = field(default_factory=list)
    inject: str = ""
    leader_at: Optional[float] = None      # kill the last elected global leader at this time
    algorithm: str = "lsgd"
    #: seconds between the kills of one event (a node going down process by process)
    gap: float = 0.0
    #: trainer options in place of the soak's own (the budget is then read from ``steps``)
    options: Optional[List[str]] = None

    def killed(self) -> set:
        out = {r for _, ranks in self.events for r in ranks}
        if self.inject:
            out |= {int(s.split(":")[0]) for s in self.inject.split(",")}
        return out


def draw(kind: str, ranks: int, steps: int, rng: random.Random, index: int) -> Scenario:
    """A scenario of ``kind`` at ``ranks`` ranks (4 per node), drawn from ``rng``."""
    nodes = ranks // RANKS_PER_NODE
    node_ranks = lambda n: list(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE))  # noqa
    t = round(rng.uniform(1.0, 3.0), 2)
    name = f"{index:02d} {kind} @{ranks}"
    if kind == "rank":
        return Scenario(name, ranks, steps, [(t, [rng.randrange(1, ranks)])])
    if kind == "node":
        return Scenario(name, ranks, steps, [(t, node_ranks(rng.randrange(1, nodes)))])
    if kind == "rank+node":
        node = rng.randrange(1, nodes)
        rank = rng.choice([r for r in range(1, ranks) if r // RANKS_PER_NODE != node])
        return Scenario(name, ranks, steps, [(t, [rank]),
                                             (t + round(rng.uniform(2.0, 4.0), 2),
                                              node_ranks(node))])
    if kind == "rank0":
        return Scenario(name, ranks, steps, [(t, [0])])
    if kind == "leader":
        return Scenario(name, ranks, steps, leader_at=t)
    if kind == "checkpoint":
        rank = rng.randrange(1, ranks)
        return Scenario(name, ranks, steps, inject=f"{rank}:{rng.randrange(2, 5) * 10}:save")
    raise ValueError(f"unknown scenario kind {kind!r}")


def scenarios(count: int, seed: int, steps: int, sizes=(8, 16)) -> List[Scenario]:
    """``count`` scenarios per size: every kind in turn, the details drawn with ``seed``."""
    rng = random.Random(seed)
    out = []
    for ranks in sizes:
        for i in range(count):
            out.append(draw(KINDS[i % len(KINDS)], ranks, steps, rng, i))
    return out


_LEADER = re.compile(r"\| leader (\d+) ")


def _last_leader(lines: List[str]) -> Optional[int]:
    """The global leader named by the job's last progress line (initial numbering), or None."""
    for line in reversed(lines):
        m = _LEADER.search(line) if line.startswith("step") else None
        if m:
            return int(m.group(1))
    return None


def outcome(run_dir: Path, ranks: int) -> Dict[int, int]:
    """rank -> the last step in its metrics file (-1 without a row)."""
    import h5py  # noqa: F401 - the venv's
    out = {}
    for r in range(ranks):
        try:
            with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r", locking=False) as f:
                steps = f["train/step"][:]
                out[r] = int(steps[-1]) if len(steps) else -1
        except Exception:  # noqa: BLE001 - a rank that died before its first flush
            out[r] = -1
    return out


def recovery_seconds(run_dir: Path, ranks: int) -> float:
    import h5py  # noqa: F401 - the venv's
    worst = 0.0
    for r in range(ranks):
        try:
            with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r", locking=False) as f:
                if "faults" in f:
                    for name in f["faults"]:
                        if name.startswith("recovery_seconds"):
                            worst = max(worst, float(max(f["faults"][name][:], default=0)))
        except Exception:  # noqa: BLE001
            pass
    return worst


def run_scenario(sc: Scenario, workdir: Path, timeout: float, log=print) -> dict:
    run_dir = workdir / sc.name.replace(" ", "_").replace("@", "n")
    shutil.rmtree(run_dir, ignore_errors=True)
    opts = sc.options if sc.options is not None else [
        "--algorithm", sc.algorithm, "--max-steps", str(sc.steps), "--epochs", "1000",
        "--eval-every", str(max(1, sc.steps // 10)), "--consensus-every", "0", "--seed", "9",
        "--checkpoint-every", "10"]
    args = [sys.executable, "-m", "lsgd_hpc.train", "--on-failure", "shrink",
            "--ranks-per-node", str(RANKS_PER_NODE), "--run-dir", str(run_dir), *opts]
    if sc.inject:
        args += ["--inject-failure", sc.inject]
    cmd = mpirun_cmd(sc.ranks, args, ["--with-ft", "ulfm"])
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: List[str] = []
    started = threading.Event()

    def reader():
        for line in p.stdout:
            lines.append(line)
            if not started.is_set() and re.match(r"step\s+\d+/", line):
                started.set()
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    killed_at: Dict[int, float] = {}
    if sc.events or sc.leader_at is not None:
        started.wait(timeout / 2)
        t_start = time.perf_counter()
        plan = list(sc.events)
        if sc.leader_at is not None:
            plan.append((sc.leader_at, None))
        for when, ranks in sorted(plan, key=lambda e: e[0]):
            time.sleep(max(0.0, when - (time.perf_counter() - t_start)))
            if ranks is None:
                leader = _last_leader(lines)
                ranks = [leader if leader is not None else 1]
                sc.events.append((when, ranks))
            pids = rank_pids(p.pid)
            for i, r in enumerate(ranks):
                if i and sc.gap:
                    time.sleep(sc.gap)
                if r in pids:
                    try:
                        os.kill(pids[r], signal.SIGKILL)
                        killed_at[r] = time.perf_counter() - t0
                    except ProcessLookupError:
                        pass
    try:
        rc = p.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        kill_session(p.pid)
        p.wait()
        rc = None
    th.join(5)
    seconds = time.perf_counter() - t0
    last = outcome(run_dir, sc.ranks)
    killed = sc.killed()
    survivors = [r for r in range(sc.ranks) if r not in killed]
    finished = [r for r in survivors if last[r] >= sc.steps]
    innocent = [r for r in survivors if last[r] < sc.steps]
    complete = (run_dir / "complete.json").exists()
    text = "".join(lines)
    res = {
        "scenario": sc.name, "ranks": sc.ranks, "killed": sorted(killed),
        # the ranks the driver found alive and SIGKILLed (a kill planned after the end of the
        # run finds nobody)
        "killed_from_outside": sorted(killed_at),
        "expected_survivors": len(survivors), "finished": len(finished),
        "innocent_deaths": innocent, "min_survivor_step": min(
            (last[r] for r in survivors), default=-1),
        "recovery_s": round(recovery_seconds(run_dir, sc.ranks), 3),
        "exit": rc, "complete": complete, "seconds": round(seconds, 1),
        "segfaults": text.count("Segmentation fault"),
    }
    res["ok"] = (not innocent and rc == 0 and complete)
    log(f"  ft_soak: {sc.name}: killed {sorted(killed)}; {len(finished)}/{len(survivors)} "
        f"survivors at step {sc.steps}; innocent deaths {innocent or 'none'}; exit {rc}; "
        f"complete {complete}; recovery {res['recovery_s']} s; {seconds:.0f} s")
    if not res["ok"]:
        (workdir / f"{run_dir.name}.log").write_text(text)
    return res


def run(quick: bool = False, timeout: float = 240.0, log=print, count: Optional[int] = None,
        seed: int = 0, steps: Optional[int] = None, sizes=(8, 16), keep: Optional[str] = None,
        only=()):
    """The run_all driver: ``count`` scenarios per size (20 at 16 ranks for the target)."""
    count = count if count is not None else (3 if quick else 20)
    steps = steps if steps is not None else (200 if quick else 300)
    sizes = sizes if not quick else (16,)
    work = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="ft_soak-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, results = [], []
    try:
        for sc in scenarios(count, seed, steps, sizes):
            if only and int(sc.name.split()[0]) not in only:
                continue
            res = run_scenario(sc, work, timeout, log)
            results.append(res)
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    at16 = [r for r in results if r["ranks"] == 16]
    bad = [r for r in results if not r["ok"]]
    from _common import row
    for r in results:
        rows.append(row(r["scenario"], f"killed {','.join(map(str, r['killed'])) or '-'}",
                        f"{r['finished']}/{r['expected_survivors']} survivors at the budget, "
                        f"innocent deaths: {','.join(map(str, r['innocent_deaths'])) or 'none'}, "
                        f"exit {r['exit']}, complete {r['complete']}, "
                        f"recovery {r['recovery_s']} s", 1.0 if r["ok"] else 0.0, "ok",
                        killed=",".join(map(str, r["killed"])),
                        survivors=f"{r['finished']}/{r['expected_survivors']}",
                        innocent_deaths=",".join(map(str, r["innocent_deaths"])) or "none",
                        exit=r["exit"], complete=r["complete"]))
    return {
        "rows": rows, "scenarios": results,
        "ratio": (sum(r["ok"] for r in at16) / len(at16)) if at16 else float("nan"),
        "target": ">= 1.0",
        "notes": [f"{len(results)} scenarios (seed {seed}, {steps} steps, 4 ranks per node); "
                  f"ratio = the share of the {len(at16)} 16-rank scenarios in which every "
                  f"survivor reached the budget, nobody else died, the run recorded its "
                  f"completion and mpirun exited 0; {len(bad)} scenario(s) failed in all."],
    }


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--scenarios", type=int, default=None, help="per size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--sizes", default="8,16")
    ap.add_argument("--kinds", default="", help="only these kinds (comma-separated)")
    ap.add_argument("--timeout", type=float, default=240.0)
    ap.add_argument("--keep", default=None, help="keep the run folders here")
    ap.add_argument("--only", default="", help="only these scenario numbers (comma-separated)")
    a = ap.parse_args(argv)
    global KINDS
    if a.kinds:
        KINDS = tuple(a.kinds.split(","))
    res = run(a.quick, a.timeout, count=a.scenarios, seed=a.seed, steps=a.steps,
              sizes=tuple(int(s) for s in a.sizes.split(",")), keep=a.keep,
              only={int(i) for i in a.only.split(",") if i})
    Path(a.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
