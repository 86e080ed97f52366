"""Goodput under failures: one kill per policy, then seeded Poisson kills beside the model.

**One kill.** 4 ranks as 2 nodes, one rank SIGKILLed at 30 % of the step budget. For LSGD and
allreduce SGD (digits, the trainer's defaults otherwise), the ways to finish the same step
budget, each its own job, interleaved per method:

* ``no failure``: ``mpirun --with-ft ulfm ... --on-failure shrink``, nothing killed (the
  reference: the same launch and checkpoints as the shrink run);
* ``shrink``: the same with ``--inject-failure 1:K`` (K = 30 % of the budget): the survivors
  shrink the world and finish the budget at 3 ranks;
* ``abort + resume``: ``--inject-failure 1:K`` under plain mpirun (``--on-failure abort``,
  today's behaviour): the job ends; a second job at full size resumes from the last complete
  checkpoint (``--resume``) and finishes. The queue wait of a real requeue is left out;
* ``heal`` (when ``python -m lsgd_hpc.train --help`` lists it; "not available" otherwise):
  as shrink with ``--on-failure heal``: a replacement is spawned and joins;
* ``torch shrink``: the shrink run on the torch backend (``--backend torch --on-failure
  shrink``, torchft as the engine): a lighthouse (``python -m lsgd_hpc.lighthouse``) and one
  process per replica group (benchmarks/torch_ft_common.py), the same model, budget,
  checkpoints, ``--ranks-per-node`` and ``--inject-failure 1:K``, failure timeout
  3 s; its goodput beside MPI's shrink (skipped without torchft); and ``torch heal``: the
  same with ``--on-failure heal``, the killed worker started again at once (as torchrun
  --max-restarts) and joining the running job.

Checkpoints every 10 % of the budget in all of them. Time to finish = wall seconds of the
mpirun job(s), start-up included (a restart pays it again; torch: the workers' launch to
their last exit, the lighthouse started before). Recovery seconds = the largest
``recovery_seconds`` of the survivors' ``/faults`` rows.

``ratio`` = shrink's time to finish over abort + resume's (target < 1: shrink finishes
first); ``recovery_s`` is checked against the target of at most 5 s; heal's time to do the
budget's work against shrink's (target <= 1).

**Poisson kills.** Allreduce SGD, 4 ranks, a longer budget: a clean run, then one run per
policy (abort + resume, shrink, heal) under ranks SIGKILLed from outside at seeded random
times (a Poisson process, about three kills per run), checkpoints at the Daly interval.
Each run's measured goodput (useful training time over wall time) stands beside
lsgd_hpc.planning.goodput's prediction fed with the costs measured in that run; target:
within 25 % (``goodput_model_error``). The notes of the result define every figure.
"""

from __future__ import annotations

import math
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
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch_ft_common as tfc
from _common import row, write_result

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from lsgd_hpc.comm.ulfm import RECOVERABLE_SPAWNS  # noqa: E402
from lsgd_hpc.planning import goodput as gp  # noqa: E402
from lsgd_hpc.testing import (kill_session, mpi_env, mpirun_cmd, run_group,  # noqa: E402
                              session_pids)

NP = 4
RANKS_PER_NODE = 2
KILLED = 1
#: the budget: about 40 s of training at 4 ranks here, so that a heal's replacement (start-up
#: about 10 s beside 3 training ranks) joins well before the end, as it would in a long job
FULL_STEPS, QUICK_STEPS = 4000, 60
METHODS = [("lsgd", ["--algorithm", "lsgd"]), ("allreduce", ["--algorithm", "allreduce"])]
ULFM = ["--with-ft", "ulfm", *RECOVERABLE_SPAWNS]   # (replacements: docs/cluster.md)
RECOVERY_TARGET_S = 5.0
#: the torch rows' --failure-timeout (and the lighthouse's): as tests/comm/test_replicas.py and
#: torch_ft_recovery use it, short so that a recovery costs seconds here
TORCH_FAILURE_TIMEOUT_S = 3.0
TORCH_HEAL_WHY = "the trainer's --help has no --on-failure heal"


def _one_kill(policy: str, run_dir: Path, steps: int, opts, inject, survivors, log,
              label: str, timeout: float) -> dict:
    """The one-kill run under --on-failure ``policy`` (shrink, heal): its seconds (launch to
    exit, or to its done line when the job hangs after it: ``POLICY_exit_hung``), its time to
    do the budget's work (_work_time) and its goodput (_measure: useful over the seconds from
    its start line to its last step); or ``POLICY_error`` (a run is cut off at ``timeout``)."""
    job = _Job(mpirun_cmd(NP, _argv(steps, run_dir, [*opts, "--on-failure", policy,
                                                      *inject]), ULFM))
    deadline = job.launched + timeout
    while not job.over() and time.perf_counter() < deadline:
        time.sleep(0.05)
    rc = job.end(min(deadline, time.perf_counter() + EXIT_GRACE_S))
    hung = rc is None and job.done is not None
    seconds = (job.done if hung else time.perf_counter()) - job.launched
    log(f"  goodput_under_failure: {label} {policy}: {seconds:.1f} s, "
        f"{'hung after its done line' if hung else f'exit {rc}'}")
    try:
        if (rc != 0 and not hung) or job.done is None or job.started is None \
                or _last_step(run_dir, survivors) != steps:
            raise RuntimeError(f"exit {rc}, the survivors did not finish")
        res = {"span_s": job.done - job.started, "done_at_s": job.done_at_s, "kills": 1}
        meas = _measure(policy, res, steps, run_dir)
        return {f"{policy}_s": seconds, f"{policy}_exit_hung": hung,
                f"{policy}_work_s": _work_time(run_dir, steps, seconds)[0],
                f"{policy}_goodput": meas["measured"]}
    except Exception as exc:
        tail = " ".join("".join(job.lines).split())[-400:]
        return {f"{policy}_error": f"{type(exc).__name__}: {exc} after {seconds:.0f} s: "
                                   f"{tail}"}


def _torch_one_kill(run_dir: Path, steps: int, opts, inject, survivors, log, label: str,
                    timeout: float, policy: str = "shrink") -> dict:
    """The shrink (or heal) run on the torch backend: a lighthouse, NP workers (replica
    groups of one process each) with the MPI shrink run's options and --inject-failure; under
    heal the killed worker is started again as soon as it is gone (as torchrun
    --max-restarts does) and joins. Its seconds (the workers' launch to the last exit, or to
    the done line when a survivor hangs after it: ``torch_<policy>_exit_hung``), its time to
    do the budget's work, its recovery (the survivors' /faults rows) and goodput (_measure,
    as for the MPI runs); or ``torch_<policy>_error`` (a run is cut off at ``timeout``)."""
    key = f"torch_{policy}"
    why = tfc.torchft_missing()
    if why:
        return {f"{key}_error": f"not run: {why}"}
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = _argv(steps, run_dir / "run",
                 [*opts, "--backend", "torch", "--on-failure", policy, "--failure-timeout",
                  f"{TORCH_FAILURE_TIMEOUT_S:g}", *inject])
    start_rx = re.compile(START_LINE.pattern, re.M)
    done_rx = re.compile(DONE_LINE.pattern, re.M)
    rc, hung, seconds, started, done, done_at = None, False, 0.0, None, None, None
    restarted = policy != "heal"
    try:
        with tfc.Lighthouse(run_dir, TORCH_FAILURE_TIMEOUT_S) as lh:
            launched = time.perf_counter()
            w = tfc.Workers(run_dir, lh.address, NP, lambda r: argv)
            deadline = launched + timeout
            # the start and done lines of worker 0 (a survivor), timestamped when they appear
            while time.perf_counter() < deadline:
                text = w.outs[0].read_text(errors="replace")
                now = time.perf_counter()
                if started is None and start_rx.search(text):
                    started = now
                m = done_rx.search(text)
                if m:
                    done, done_at = now, float(m.group(1))
                    break
                if not restarted and w.procs[KILLED].poll() is not None:
                    w.restart(KILLED, argv, lh.address, NP)       # heal: torchrun's restart
                    restarted = True
                if all(p.poll() is not None for p in w.procs):
                    break
                time.sleep(0.02)
            # under heal, a worker restarted too late for the budget (its start-up longer than
            # what was left) waits for a quorum that never comes: it is ended with the job
            joined = policy == "heal" and \
                re.search(r"heal: rank\(s\) [\d,]+ joined", w.outs[0].read_text()) is not None
            if policy == "heal" and not joined and done is not None:
                w.kill(KILLED)
            codes = w.wait(EXIT_GRACE_S if done is not None else 1.0)
            end = time.perf_counter()
            finishers = list(range(NP)) if joined else list(survivors)
            rc = [codes[r] for r in finishers]
            hung = done is not None and any(c is None for c in rc)
            seconds = (done if hung else end) - launched
            log(f"  goodput_under_failure: {label} torch {policy}: {seconds:.1f} s, "
                f"{'hung after its done line' if hung else f'exit {codes}'}")
            if (any(c != 0 for c in rc) and not hung) or done is None or started is None \
                    or _last_step(run_dir / "run", finishers) != steps:
                raise RuntimeError(f"exit {codes}, the workers did not finish")
            res = {"span_s": done - started, "done_at_s": done_at, "kills": 1}
            meas = _measure(policy, res, steps, run_dir / "run")
            out = {f"{key}_s": seconds, f"{key}_exit_hung": hung,
                   f"{key}_work_s": _work_time(run_dir / "run", steps, seconds)[0],
                   f"{key}_goodput": meas["measured"]}
            if policy == "shrink":
                out["torch_recovery_s"] = _recovery(run_dir / "run", survivors)
            else:
                out["torch_heal_joined"] = joined
            return out
    except Exception as exc:
        tail = ""
        if (run_dir / "worker0.out").exists():
            tail = " ".join(line for line in (run_dir / "worker0.out").read_text(
                errors="replace").splitlines() if not line.startswith("step "))[-400:]
        return {f"{key}_error": f"{type(exc).__name__}: {exc} after {seconds:.0f} s: "
                                f"{tail}"}


def _argv(steps: int, run_dir: Path, opts) -> list:
    return [sys.executable, "-m", "lsgd_hpc.train", *opts, "--max-steps", str(steps),
            "--epochs", "1000", "--eval-every", str(steps), "--consensus-every", "0",
            "--ranks-per-node", str(RANKS_PER_NODE), "--checkpoint-every",
            str(max(1, steps // 10)), "--run-dir", str(run_dir)]


def _job(cmd, timeout, log, what):
    t0 = time.perf_counter()
    p = run_group(cmd, env=mpi_env(), cwd=REPO, timeout=timeout)
    seconds = time.perf_counter() - t0
    rc = "timed out" if p.returncode is None else f"exit {p.returncode}"
    log(f"  goodput_under_failure: {what}: {seconds:.1f} s, {rc}")
    return p, seconds


def _last_step(run_dir: Path, ranks) -> int:
    import h5py
    last = []
    for r in ranks:
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r", locking=False) as f:
            last.append(int(f["train"]["step"][-1]))
    return min(last)


def _recovery(run_dir: Path, ranks) -> float:
    import h5py
    worst = 0.0
    for r in ranks:
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r", locking=False) as f:
            if "faults" not in f:
                raise RuntimeError(f"rank {r} has no /faults row: no failure was recovered")
            worst = max(worst, float(f["faults"]["recovery_seconds"][:].max()))
    return worst


def run(quick: bool = False, timeout: float = 300, log=print, poisson_part: bool = True
        ) -> dict:
    steps = QUICK_STEPS if quick else FULL_STEPS
    kill_at = max(2, round(0.3 * steps))
    inject = ["--inject-failure", f"{KILLED}:{kill_at}"]
    survivors = [r for r in range(NP) if r != KILLED]
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_goodput_"))
    rows, runs, errors = [], {}, {}
    heal = heal_available()
    log(f"  goodput_under_failure: --on-failure heal {'available' if heal else 'not available'}")
    try:
        for label, opts in METHODS:
            d = tmp / label
            res = {}
            try:
                # the reference: nothing killed
                p, res["no_failure_s"] = _job(
                    mpirun_cmd(NP, _argv(steps, d / "ref", [*opts, "--on-failure", "shrink"]),
                               ULFM), timeout, log, f"{label} no failure")
                if p.returncode != 0:
                    raise RuntimeError(f"no-failure run: exit {p.returncode}: {p.stderr[-300:]}")
                # shrink and go on
                res.update(_one_kill("shrink", d / "shrink", steps, opts, inject, survivors,
                                     log, label, timeout))
                if "shrink_error" in res:
                    raise RuntimeError(f"shrink run: {res['shrink_error']}")
                res["recovery_s"] = _recovery(d / "shrink", survivors)
                # abort, then resume at full size from the last complete checkpoint
                p, first = _job(mpirun_cmd(NP, _argv(steps, d / "abort", [*opts, *inject])),
                                timeout, log, f"{label} abort")
                if p.returncode in (0, None):
                    raise RuntimeError(f"abort run: expected the job to end, got "
                                       f"{'a timeout' if p.returncode is None else 'exit 0'}")
                p, second = _job(mpirun_cmd(NP, [*_argv(steps, d / "abort", opts), "--resume"]),
                                 timeout, log, f"{label} resume")
                if p.returncode != 0:
                    raise RuntimeError(f"resume run: exit {p.returncode}: {p.stderr[-300:]}")
                if _last_step(d / "abort", range(NP)) != steps:
                    raise RuntimeError("resume run: the ranks did not finish the budget")
                res.update(abort_s=first, resume_s=second, abort_resume_s=first + second)
                runs[label] = res
                if heal:          # its own failure leaves the others' figures standing
                    res.update(_one_kill("heal", d / "heal", steps, opts, inject, survivors,
                                         log, label, min(timeout, 3 * res["no_failure_s"] + 60)))
                # the torch backend's shrink (torchft); its failure leaves the others standing
                res.update(_torch_one_kill(d / "torch", steps, opts, inject, survivors, log,
                                           label, timeout))
                if heal:          # and its heal: the killed worker started again, joining
                    res.update(_torch_one_kill(d / "torch_heal", steps, opts, inject,
                                               survivors, log, label, timeout, "heal"))
            except Exception as exc:              # report it, go on with the next method
                errors[label] = f"{type(exc).__name__}: {exc}"
        pois = poisson(quick, tmp, timeout, log, heal) if poisson_part else \
            {"steps": POISSON_QUICK_STEPS if quick else POISSON_STEPS, "reference": None,
             "runs": {}, "errors": {}, "skipped": True}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    errors.update({f"poisson {k}": v for k, v in pois["errors"].items()})

    worst_ratio, worst_recovery = None, None
    for label, _ in METHODS:
        if label in errors:
            rows.append(row(f"goodput_under_failure: {label}", "", f"failed: {errors[label]}",
                            None, ""))
            continue
        r = runs[label]
        ratio = r["shrink_s"] / r["abort_resume_s"]
        worst_ratio = ratio if worst_ratio is None else max(worst_ratio, ratio)
        worst_recovery = r["recovery_s"] if worst_recovery is None else \
            max(worst_recovery, r["recovery_s"])
        heal_s = (f"heal {r['heal_s']:.1f} s (the budget's work: {r['heal_work_s']:.1f} s"
                  f"{'; to its done line: the job hung after it' if r['heal_exit_hung'] else ''}"
                  f"; goodput {_pct(r['heal_goodput'])}), "
                  if "heal_s" in r else f"heal failed ({r['heal_error']}), " if "heal_error"
                  in r else "heal not available, ")
        rows.append(row(
            f"goodput_under_failure: {label}",
            f"rank {KILLED} killed at step {kill_at} of {steps}: shrink vs abort + resume "
            "(vs heal, vs no failure)",
            f"recovery {r['recovery_s']:.2f} s; to finish: no failure {r['no_failure_s']:.1f} s, "
            f"shrink {r['shrink_s']:.1f} s (the budget's work: {r['shrink_work_s']:.1f} s; "
            f"goodput {_pct(r['shrink_goodput'])}), "
            f"{heal_s}abort + resume {r['abort_s']:.1f} + "
            f"{r['resume_s']:.1f} = {r['abort_resume_s']:.1f} s",
            ratio, "shrink / (abort + resume) seconds", **r))
        rows.append(_torch_row(label, r, steps, kill_at))
        rows.append(_torch_heal_row(label, r, steps, kill_at))
    # the torch backend's shrink goodput over MPI's, the lower of the methods (informational)
    torch_vs_mpi = min((r["torch_shrink_goodput"] / r["shrink_goodput"] for r in runs.values()
                        if "torch_shrink_goodput" in r), default=None)
    # heal's time to do the budget's work over shrink's, at one speed: shrink's goodput over
    # heal's (runs here are minutes apart on a shared machine: their speeds differ)
    heal_ratio = max((r["shrink_goodput"] / r["heal_goodput"] for r in runs.values()
                      if "heal_goodput" in r), default=None)
    rows += _poisson_rows(pois)
    model_error = max((abs(r["error"]) for r in pois["runs"].values() if "error" in r),
                      default=None)
    return {
        "name": "goodput_under_failure", "doc": __doc__.strip(), "np": NP,
        "ranks_per_node": RANKS_PER_NODE, "steps": steps, "kill_at": kill_at,
        "killed_rank": KILLED, "runs": runs, "errors": errors, "rows": rows,
        "ratio": worst_ratio, "target": "< 1", "recovery_s": worst_recovery,
        "poisson": pois, "heal_available": heal, "torch_heal_available": heal,
        "torch_failure_timeout_s": TORCH_FAILURE_TIMEOUT_S,
        "extra_targets": {"goodput_recovery_s": {"value": worst_recovery,
                                                 "target": f"<= {RECOVERY_TARGET_S:g}"},
                          "goodput_heal_vs_shrink": {"value": heal_ratio, "target": "<= 1"},
                          "goodput_model_error": {"value": model_error,
                                                  "target": f"<= {MODEL_ERROR_TARGET:g}"},
                          "goodput_torch_shrink_vs_mpi": {"value": torch_vs_mpi,
                                                          "target": "none (informational)"}},
        "notes": [
            f"digits, {NP} ranks = {NP // RANKS_PER_NODE} nodes x {RANKS_PER_NODE} "
            f"(--ranks-per-node), {steps} steps, checkpoints every {max(1, steps // 10)} "
            f"steps; rank {KILLED} SIGKILLs itself at step {kill_at} (--inject-failure).",
            "Seconds are the wall time of the mpirun job(s), start-up included; abort + resume "
            "leaves out the queue wait of a real requeue, so on a busy cluster shrink's lead "
            "is larger than shown.",
            "ratio = the largest shrink / (abort + resume) over the methods; recovery = the "
            "largest recovery_seconds of the survivors' /faults rows: from the failed "
            "collective to the methods restored; the failure detection before it (about a "
            "second with Open MPI's detector) is not in it.",
            "On a machine with fewer cores than ranks, 3 survivors step faster than 4 ranks, "
            "so shrink can finish before the run without a failure: compare shrink with "
            "abort + resume, not with the reference.",
            "The budget's work is NP x steps rank-steps: shrink's survivors finish the steps "
            "with fewer ranks, so its time to do the work adds the rank-steps it left out at "
            "its end rate (ranks alive, median step of its last fifth); heal's likewise for "
            "the steps its replacement missed. Goodput of shrink and heal: as in the Poisson "
            "runs below (useful rank-time over the seconds from the start line to the last "
            "step). goodput_heal_vs_shrink (targets table) = the largest shrink goodput / heal "
            "goodput over the methods = heal's time to do the budget's work over shrink's at "
            "one speed (separate runs on a shared machine step at different speeds, so their "
            "seconds do not compare), target <= 1 ('not available' without --on-failure "
            "heal). On these 2 cores a replacement's start-up (Python, torch, data) takes CPU "
            "from the training ranks, which a replacement on its own node would not.",
            "torch rows: the same runs' shrink on --backend torch --on-failure shrink "
            "(torchft: a lighthouse of python -m lsgd_hpc.lighthouse, started before the "
            f"workers and not counted, and {NP} processes, one replica group each, "
            f"--ranks-per-node {RANKS_PER_NODE}), --failure-timeout "
            f"{TORCH_FAILURE_TIMEOUT_S:g} s, the same --inject-failure; seconds from the "
            "workers' launch to their last exit. Its recovery (the survivors' /faults "
            "recovery_seconds) includes waiting for the quorum to leave the lost worker out "
            f"(the lighthouse drops it after {TORCH_FAILURE_TIMEOUT_S / 2:g} s without "
            "heartbeats), which MPI's recovery figure leaves out (its detector's second "
            "comes before it); it is not in goodput_recovery_s. goodput_torch_shrink_vs_mpi "
            "(targets table, informational, no target) = the lower over the methods of torch "
            "shrink goodput / MPI shrink goodput (separate runs on a shared machine). "
            "torch heal rows: the same with --on-failure heal, the killed worker started "
            "again as soon as it is gone (TORCHELASTIC_RESTART_COUNT=1, as torchrun "
            "--max-restarts) and joining at the survivors' next poll; value = torch shrink "
            "goodput / torch heal goodput (informational). The one-kill rows have no planner "
            "prediction (MPI's neither); the Poisson runs are MPI only.",
        ] + _poisson_notes(pois),
    }


def _torch_heal_row(label: str, r: dict, steps: int, kill_at: int) -> dict:
    """The torch backend's one-kill heal row of a method: its goodput beside torch shrink's."""
    name = f"goodput_under_failure: {label} torch heal"
    if "torch_heal_error" in r:
        return row(name, "", f"failed: {r['torch_heal_error']}", None, "")
    if "torch_heal_s" not in r:
        return row(name, "", f"not available: {TORCH_HEAL_WHY}", None, "")
    shrink = r.get("torch_shrink_goodput")
    late = "; the survivors finished before the restarted worker joined"
    return row(
        name, f"rank {KILLED} killed at step {kill_at} of {steps} and started again at once "
        "(as torchrun --max-restarts): --backend torch --on-failure heal",
        f"to finish: {r['torch_heal_s']:.1f} s (the budget's work: "
        f"{r['torch_heal_work_s']:.1f} s; goodput {_pct(r['torch_heal_goodput'])}"
        f"{'' if r['torch_heal_joined'] else late})"
        + (f"; torch shrink goodput {_pct(shrink)}" if shrink else ""),
        shrink / r["torch_heal_goodput"] if shrink else None,
        "torch shrink goodput / torch heal goodput")


def _torch_row(label: str, r: dict, steps: int, kill_at: int) -> dict:
    """The torch backend's one-kill shrink row of a method: its figures beside MPI's shrink."""
    name = f"goodput_under_failure: {label} torch shrink"
    if "torch_shrink_error" in r:
        return row(name, "", f"failed: {r['torch_shrink_error']}", None, "")
    return row(
        name, f"rank {KILLED} killed at step {kill_at} of {steps}: --backend torch "
        "--on-failure shrink (torchft) vs MPI's shrink",
        f"recovery {r['torch_recovery_s']:.2f} s (quorum wait included); to finish: "
        f"{r['torch_shrink_s']:.1f} s"
        f"{' (to its done line: a survivor hung after it)' if r['torch_shrink_exit_hung'] else ''}"
        f" (the budget's work: {r['torch_shrink_work_s']:.1f} s; goodput "
        f"{_pct(r['torch_shrink_goodput'])}); MPI shrink {r['shrink_s']:.1f} s (goodput "
        f"{_pct(r['shrink_goodput'])})",
        r["torch_shrink_goodput"] / r["shrink_goodput"], "torch / MPI shrink goodput")


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def _poisson_rows(pois: dict) -> list:
    """One row per policy of the Poisson runs: measured goodput / predicted at the run's own
    failure rate (the ratio), the prediction at the drawn rate beside it."""
    ref, rows = pois["reference"], []
    if pois.get("skipped"):
        return [row("goodput_under_failure: poisson", "", "not run (--one-kill-only)", None,
                    "")]
    if ref is None:
        return [row("goodput_under_failure: poisson", "", "failed: the clean reference: "
                    f"{pois['errors']['reference']}", None, "")]
    rows.append(row(
        "goodput_under_failure: poisson none", "no kill (the clean reference): measured vs "
        "predicted goodput (checkpoints only)",
        f"measured {_pct(ref['measured'])}, predicted {_pct(ref['predicted'])}; "
        f"{pois['steps']} steps in {ref['wall_s']:.1f} s ({1e3 * ref['step_s']:.2f} ms/step), "
        f"checkpoint {1e3 * ref['checkpoint_s']:.1f} ms every {ref['every']} steps",
        ref["measured"] / ref["predicted"], "measured / predicted goodput"))
    for policy in POLICIES:
        r = pois["runs"].get(policy)
        label = f"goodput_under_failure: poisson {policy}"
        if policy in pois["errors"]:
            rows.append(row(label, "", f"failed: {pois['errors'][policy]}", None, ""))
            continue
        if not r or not r.get("available", True):
            rows.append(row(label, "", "not available: python -m lsgd_hpc.train --help lists "
                            "no heal among --on-failure's choices", None, ""))
            continue
        costs = _poisson_costs(policy, r)
        own = r["own_rank_mtbf_s"] / NP
        rows.append(row(
            label, f"{r['kills']} seeded Poisson kill(s) (about {POISSON_KILLS:g} expected): "
            "measured vs predicted goodput",
            f"measured {_pct(r['measured'])}; predicted {_pct(r['predicted'])} at the run's own "
            f"rate (job MTBF {own:.1f} s), {_pct(r['predicted_drawn'])} at the drawn rate "
            f"({r['drawn_rank_mtbf_s'] / NP:.1f} s); wall {r['wall_s']:.1f} s in {r['jobs']} "
            f"job(s){' (the last hung after its done line)' if r['exit_hung'] else ''}, "
            f"useful {r['useful_s']:.1f} s; checkpoint {1e3 * r['checkpoint_s']:.1f} ms every "
            f"{pois['checkpoint_every']} steps, {costs}",
            r["measured"] / r["predicted"], "measured / predicted goodput"))
    return rows


def _poisson_costs(policy: str, r: dict) -> str:
    """The costs a Poisson run measured, as its row says them."""
    if policy == "abort":
        return f"restart wait {r['down_s']:.1f} s"
    text = f"pause {r['pause_s']:.2f} s per kill"
    if policy == "heal":
        text += (f", join {r.get('join_s', 0.0):.2f} s, {r['short_s']:.1f} s short of a "
                 "rank per kill")
    if r.get("failed_joins"):
        text += (f"; {r['failed_joins']} heal(s) that ended the job ("
                 f"{'; '.join(r.get('heal_failures', []))}): relaunched with --resume, "
                 f"{sum(r['down_s']):.1f} s down")
    return text


def _poisson_notes(pois: dict) -> list:
    ref = pois["reference"]
    if ref is None:
        return []
    return [
        f"Poisson runs: allreduce SGD, digits, {NP} ranks, {pois['steps']} steps each. Failures "
        f"are SIGKILLs from outside, drawn with seed {POISSON_SEED} in exposed seconds (each "
        "job's training: from its start line, after start-up and checkpoint load, to its done "
        "line), a Poisson process of rate (mortal ranks)/theta, each arrival SIGKILLing a "
        "random mortal rank: abort and heal NP/theta (the victim a rank of the training world; "
        "heal: a replacement once it joined), shrink (live ranks)/theta, the last rank "
        "spared (the model's floor). Job MTBF theta/NP = the clean "
        f"run's {ref['wall_s']:.1f} s / {POISSON_KILLS:g} = {pois['job_mtbf_s']:.1f} s for "
        "abort and heal; shrink, whose lost ranks are not replaced, draws theta = T / ln(NP / "
        f"(NP - {POISSON_KILLS:g})) (3 of its {NP} ranks lost in the clean run's T on "
        f"average): job MTBF {pois['rank_mtbf_s']['shrink'] / NP:.1f} s at the start. "
        f"Checkpoints every {pois['checkpoint_every']} steps (Daly's interval for "
        f"{pois['job_mtbf_s']:.1f} s and the measured checkpoint cost).",
        "Goodput = useful seconds / wall seconds, every rank counted as one accelerator (as "
        "on a GPU cluster; here ranks share 2 cores, and other jobs' load moves the step time "
        "within a run). Useful = the sum over the budget's steps of (ranks that took the step "
        "/ NP) x the step's training time (checkpoints, evaluations and flushes left out; a "
        "step within 2 rows of a failure or join counted at most at the median step). Wall = "
        "the first job's start line to the last step (the last job's done line less what "
        "followed its last row: final evaluation and checkpoint); the first job's start-up "
        "is left out, a clean run pays it too; abort's relaunches and lost work are in.",
        "Predicted = lsgd_hpc.planning.goodput fed with this run's own costs: the "
        "checkpoint's blocking seconds (increments of checkpoint_seconds), the interval (the "
        "steps between checkpoints x the mean step at full size), abort's wait from the kill "
        "to the relaunched job's start line (teardown, launch, checkpoint load), the pause per "
        "kill (what the steps within 2 rows of each /faults event or join took beyond the "
        "median step), heal's join per kill (the /faults heal rows' recovery_seconds: the "
        "checkpoint for the join, every object built again, the restore; off the rows' "
        "training clock) and seconds a rank short per kill (replacement start-up) and, "
        "when a kill cut a join short (the job then ends after the join's checkpoint, within "
        f"the join deadline, here {JOIN_TIMEOUT_S} s, and is relaunched with --resume), the "
        "seconds from that kill to the relaunched job's start line added to its wall, capacity "
        "(live ranks)/NP; shrink's over the run's own wall time. The ratio and "
        "goodput_model_error (targets table, target <= 25 %) use the run's own failure rate "
        "(exposed rank-seconds / kills): with one run of about three kills the count alone "
        "moves goodput by tens of percent (a Poisson count of mean 3 is 1 to 5 most of the "
        "time), which the prediction at the drawn rate shows.",
    ]


# -- Poisson kills: measured goodput beside the model's ----------------------------------------
#: The Poisson runs: allreduce SGD (synchronous data parallel: what the model describes), a
#: step budget of about 25 s of training here, about three kills per run.
POISSON_STEPS, POISSON_QUICK_STEPS = 3000, 800
#: seconds a job may take from its done line to its exit before it is ended (and reported)
EXIT_GRACE_S = 30.0
POISSON_KILLS = 3.0
POISSON_SEED = 0
POISSON_OPTS = ["--algorithm", "allreduce"]
POLICIES = ("abort", "shrink", "heal")
MODEL_ERROR_TARGET = 0.25
START_LINE = re.compile(r"^\[lsgd_hpc\] \S+ on \d+ ranks")
DONE_LINE = re.compile(r"^\[lsgd_hpc\] done: \d+ steps in ([0-9.]+) s")
JOIN_LINE = re.compile(r"^\[lsgd_hpc\] heal: replacement\(s\) ready at step \d+; joining")


def heal_available() -> bool:
    """Whether ``python -m lsgd_hpc.train --help`` lists heal among --on-failure's choices."""
    p = subprocess.run([sys.executable, "-m", "lsgd_hpc.train", "--help"], env=mpi_env(),
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    text = re.sub(r"\s+", " ", p.stdout)
    block = text.partition("--on-failure ON_FAILURE")[2].partition(" --")[0]
    return bool(re.search(r"\bheal\b", block))


#: seconds a heal's join may take before its processes end themselves (the library's default
#: is 120 s; a join takes about a second here): a kill during the merge then costs the run a
#: relaunch, not two minutes of a hung job
JOIN_TIMEOUT_S = 30
JOIN_FAILED = re.compile(r"^\[lsgd_hpc\] heal: the join did not end within")


class _Job:
    """One mpirun job whose output lines are read in a thread and timestamped: the trainer's
    start line (printed once the model and any checkpoint are loaded, before the first step)
    and its done line."""

    def __init__(self, cmd):
        self.launched = time.perf_counter()
        self.p = subprocess.Popen(cmd, env=mpi_env({"LSGD_HPC_HEAL_JOIN_TIMEOUT":
                                                    str(JOIN_TIMEOUT_S)}),
                                  cwd=REPO, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.lines: List[str] = []
        self.started: Optional[float] = None
        self.done: Optional[float] = None
        self.done_at_s: Optional[float] = None     # the run's own clock at its done line
        self.joins = 0                             # heal: replacements that joined
        self.join_failed = False                   # heal: a join ended the job (deadline)
        self.abandoned = False                     # no rank of the job is left
        self.th = threading.Thread(target=self._read, daemon=True)
        self.th.start()

    def _read(self):
        for line in self.p.stdout:
            now = time.perf_counter()
            self.lines.append(line)
            if self.started is None and START_LINE.match(line):
                self.started = now
            elif self.done is None and DONE_LINE.match(line):
                self.done, self.done_at_s = now, float(DONE_LINE.match(line).group(1))
            elif JOIN_LINE.match(line):
                self.joins += 1
            elif JOIN_FAILED.match(line):
                self.join_failed = True

    def over(self) -> bool:
        return self.done is not None or self.p.poll() is not None

    def wait_start(self, deadline: float) -> None:
        while self.started is None and self.p.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.02)
        time.sleep(0.05)                       # the reader may hold the last lines

    def end(self, deadline: float) -> Optional[int]:
        try:
            rc = self.p.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            kill_session(self.p.pid)
            self.p.wait()
            rc = None
        self.th.join(5)
        return rc

    def ranks(self) -> List[int]:
        """Pids of the job's ranks alive now (python processes with OMPI_COMM_WORLD_RANK:
        the started ranks and any replacement)."""
        out = []
        for pid in session_pids(self.p.pid):
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    env = fh.read()
                exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
                with open(f"/proc/{pid}/stat") as fh:
                    state = fh.read().rpartition(")")[2].split()[0]
            except OSError:
                continue
            if exe.startswith("python") and b"OMPI_COMM_WORLD_RANK=" in env and state != "Z":
                out.append(pid)
        return sorted(out)


def _policy_launch(policy: str, steps: int, every: int, run_dir: Path, resume: bool) -> list:
    args = _argv(steps, run_dir, POISSON_OPTS)
    args[args.index("--checkpoint-every") + 1] = str(every)
    if resume:
        args.append("--resume")
    if policy == "abort":
        return mpirun_cmd(NP, args)
    return mpirun_cmd(NP, args + ["--on-failure", policy], ULFM)


class _Killer:
    """The seeded failure process, in exposed seconds (training time of the jobs, from each
    start line to the done line or the job's end): a Poisson process whose rate is the
    mortal ranks over theta, each arrival killing a random one of them. abort and heal:
    NP/theta throughout (lost ranks are replaced: by the restart, or by the replacement;
    heal's victims are the ranks of the training world, a replacement once it has joined:
    the model leaves failures during a start-up out); shrink: the live ranks over theta,
    none once one is left (the model's floor of one)."""

    def __init__(self, policy: str, theta: float, seed: int):
        self.policy, self.theta = policy, theta
        self.rng = random.Random(f"{seed}:{policy}")
        self.next_at = self._draw(theta / NP)

    def _draw(self, mean: float) -> float:
        return math.inf if math.isinf(mean) else self.rng.expovariate(1 / mean)

    def due(self, pids: List[int]) -> Optional[float]:
        """The exposed second of the next kill, or None."""
        if self.policy == "shrink" and len(pids) <= 1:
            return None
        return self.next_at

    def victim(self, pids: List[int]) -> int:
        """A victim among ``pids``; draws the next arrival."""
        v = self.rng.choice(pids)
        mortal = NP if self.policy != "shrink" else len(pids) - 1
        self.next_at += self._draw(self.theta / mortal) if mortal > 1 else math.inf
        return v


def _expose(job: _Job, killer: _Killer, clock: Dict, deadline: float, log, label: str):
    """Run one job's exposed stretch: kill at the drawn moments until the job is done, or
    (abort) one kill has ended it. Adds to clock's exposure (and, for shrink, its
    rank-seconds of mortal ranks: every live rank while more than one lives)."""
    kills = []
    seg = last = job.started
    pids = job.ranks()
    eligible, joins = set(pids), 0
    seen = checked = time.perf_counter()
    while not job.over() and time.perf_counter() < deadline:
        if job.join_failed:            # the join deadline ends the job (heal): no more kills
            break
        if time.perf_counter() - checked > 1.0:        # every rank gone, mpirun still up
            checked = time.perf_counter()
            now = job.ranks()
            if job.joins > joins:
                eligible |= set(now)
                joins = job.joins
            # (a replacement that was never taken in does not count: it keeps mpirun up
            # after the ranks it was to join are gone)
            seen = checked if any(p in eligible for p in now) else seen
            if checked - seen > EXIT_GRACE_S:
                log(f"  goodput_under_failure: {label}: no rank left; the job is ended")
                job.abandoned = True
                break
        nxt = killer.due(pids)
        exposed = clock["exposure"] + time.perf_counter() - seg
        if nxt is None or exposed < nxt:
            time.sleep(0.02)
            continue
        pids = job.ranks()
        if job.joins > joins:          # the replacements started so far have joined
            eligible |= set(pids)
            joins = job.joins
        victims = [p for p in pids if p in eligible]
        if not victims:                # nobody to kill: the draw passes
            if pids:
                killer.victim(pids)
            time.sleep(0.02)
            continue
        victim = killer.victim(victims)
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            continue
        now = time.perf_counter()
        clock["mortal_s"] += (len(pids) if len(pids) > 1 else 0) * (now - last)
        last = now
        pids = [p for p in pids if p != victim]
        kills.append({"wall": now, "exposed": exposed})
        clock["kills"] = clock.get("kills", 0) + 1
        log(f"  goodput_under_failure: {label}: kill {clock['kills']} at {exposed:.1f} "
            "exposed s")
        if killer.policy == "abort":
            break
    end = job.done if job.done is not None else time.perf_counter()
    if killer.policy != "abort" or not kills:
        clock["mortal_s"] += (len(pids) if len(pids) > 1 else 0) * max(0.0, end - last)
    clock["exposure"] += max(0.0, (kills[-1]["wall"] if killer.policy == "abort" and kills
                                   else end) - seg)
    return kills


def _poisson_run(policy: str, steps: int, every: int, theta: float, run_dir: Path,
                 timeout: float, log) -> dict:
    """One policy's run under the seeded kills: abort relaunches with --resume after each
    (from scratch while no checkpoint is complete), shrink and heal go on. A heal whose join
    a kill cut short ends the job (the join deadline: Open MPI's merge does not report the
    failure) after a checkpoint: it is relaunched with --resume like abort, and counted
    (``failed_joins``, the wait in ``down_s``). Returns the driver's timings: first start
    line to the last done line, exposure, kills, the waits."""
    killer = _Killer(policy, theta, POISSON_SEED)
    clock = {"exposure": 0.0, "mortal_s": 0.0}
    kills, downs, jobs, first, resume, failed_joins = [], [], 0, None, False, 0
    errors_seen: List[str] = []
    relaunched_at = None
    deadline = time.perf_counter() + 3 * timeout
    while True:
        if not resume:
            shutil.rmtree(run_dir, ignore_errors=True)
        job = _Job(_policy_launch(policy, steps, every, run_dir, resume))
        jobs += 1
        job.wait_start(min(deadline, time.perf_counter() + timeout))
        if job.started is None:
            job.end(time.perf_counter() + 30)
            raise RuntimeError(f"{policy}: job {jobs} never started: "
                               f"{''.join(job.lines)[-300:]}")
        first = first if first is not None else job.started
        if kills and policy == "abort":
            downs.append(job.started - kills[-1]["wall"])
        elif relaunched_at is not None:
            downs.append(job.started - relaunched_at)
        relaunched_at = None
        new = _expose(job, killer, clock, deadline, log, policy)
        kills += new
        # done, or no rank left, or a join that ended the job (a replacement still waiting
        # to be taken in keeps mpirun up: the job is ended after the grace)
        grace = EXIT_GRACE_S if job.done is not None or job.join_failed or job.abandoned \
            or not job.ranks() else timeout
        rc = job.end(min(deadline, time.perf_counter() + grace))
        if policy == "abort" and new and job.done is None:
            resume = (run_dir / "checkpoints" / "latest.json").exists()
            continue
        if policy == "heal" and job.done is None and jobs < 10 and \
                (run_dir / "checkpoints" / "latest.json").exists():
            # the job ended during a heal (a join the deadline cut short, or survivors that
            # failed in it): as a requeue would, relaunched from its last checkpoint; counted
            failed_joins += 1
            relaunched_at = kills[-1]["wall"] if kills else time.perf_counter()
            resume = True
            why = "ended by the join deadline" if job.join_failed else \
                "ended without finishing: " + " ".join("".join(job.lines[-3:]).split())[-200:]
            log(f"  goodput_under_failure: heal: job {jobs} {why}; relaunched with --resume")
            errors_seen.append(f"job {jobs}: {why}")
            continue
        if job.done is None:
            raise RuntimeError(f"{policy}: the job did not finish (exit {rc}): "
                               f"{''.join(job.lines)[-400:]}")
        if rc is None:
            log(f"  goodput_under_failure: {policy}: the job hung after its done line; ended")
        return {"span_s": job.done - first, "done_at_s": job.done_at_s, "exit_hung": rc is None,
                "exposure_s": clock["exposure"],
                "mortal_rank_s": clock["mortal_s"], "kills": len(kills),
                "kills_exposed_s": [round(k["exposed"], 2) for k in kills],
                "down_s": downs, "jobs": jobs, "startup_s": job.started - job.launched,
                "failed_joins": failed_joins, "heal_failures": errors_seen}


# -- what the run's metrics say ----------------------------------------------------------------
def _ranges(text: str) -> List[int]:
    out = []
    for part in str(text).split(","):
        a, _, b = part.strip().partition("-")
        if a:
            out += list(range(int(a), int(b or a) + 1))
    return out


def _read_metrics(run_dir: Path) -> Dict[str, dict]:
    """Per metrics file: its steps, training_time, wall_time, checkpoint_seconds, and the
    (lost ranks, step) of its /faults rows."""
    import h5py
    out = {}
    for path in sorted((run_dir / "metrics").glob("rank*.h5")):
        with h5py.File(path, "r", locking=False) as f:
            t = f["train"]
            d = {k: t[k][:].tolist() for k in ("step", "training_time", "wall_time",
                                                "checkpoint_seconds")}
            d["faults"], d["heal_pauses"] = [], []
            if "faults" in f:
                g = f["faults"]
                for lost, step in zip(g["lost_ranks"][:], g["step"][:]):
                    lost = lost.decode() if isinstance(lost, bytes) else str(lost)
                    d["faults"].append((_ranges(lost), int(step)))
                if "replaced_ranks" in g:       # heal rows: this rank's pause for the join
                    d["heal_pauses"] = [float(p) for r, p in zip(g["replaced_ranks"][:],
                                                                 g["recovery_seconds"][:])
                                        if len(r)]
        out[path.stem] = d
    return out


def _alive_per_step(files: Dict[str, dict], steps: int) -> List[int]:
    """Ranks that did each step 1..steps: every file's steps (a replacement's rows go on in
    the dead rank's file), a lost rank's filled from its last row before each loss up to the
    step that loss was recovered at (its rows after its last flush died with it)."""
    lost: Dict[int, set] = {}
    for d in files.values():
        for ranks, step in d["faults"]:
            for r in ranks:
                lost.setdefault(r, set()).add(step)
    alive = [0] * (steps + 1)
    for name, d in files.items():
        done = {s for s in d["step"] if 1 <= s <= steps}
        for e in lost.get(int(name[4:]), ()):
            before = [s for s in done if s < e]
            if before:
                done |= set(range(max(before) + 1, min(steps, e - 1) + 1))
        for s in done:
            alive[s] += 1
    return alive[1:]


def _survivor(files: Dict[str, dict], steps: int) -> dict:
    """The file whose rows the run's clock is read from: of those that reach the budget, the
    one with the most of its steps (under heal every file reaches it, but a rank that was
    killed and replaced has a gap: the steps it missed would count nowhere); the lowest
    rank of those."""
    done = [d for _, d in sorted(files.items()) if d["step"] and d["step"][-1] >= steps]
    if not done:
        raise RuntimeError("no rank's metrics reach the step budget")
    return max(done, key=lambda d: len({s for s in d["step"] if 1 <= s <= steps}))


def _deltas(d: dict) -> List[float]:
    tt = d["training_time"]
    return [b - a for a, b in zip(tt, tt[1:])]


def _median(xs: List[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def _checkpoint_cost(d: dict) -> float:
    """Mean blocking seconds of one checkpoint (the increments of checkpoint_seconds)."""
    c = d["checkpoint_seconds"]
    inc = [b - a for a, b in zip(c, c[1:]) if b - a > 0]
    return sum(inc) / len(inc) if inc else 0.0


def _events(files: Dict[str, dict], alive: List[int]) -> set:
    """Steps where the world changed: /faults rows (a loss recovered), and steps where more
    ranks took part than in the one before (a replacement joined)."""
    ev = {step for d in files.values() for _, step in d["faults"]}
    ev |= {s + 1 for s in range(1, len(alive)) if alive[s] > alive[s - 1]}
    return ev


def _accounting(d: dict, alive: List[int], events: set) -> Dict[str, float]:
    """From a survivor's rows (training time per step: checkpoints, evaluations and flushes
    left out), every rank counted as one accelerator: ``useful`` = sum over the steps of
    (ranks that took the step / NP) x its training time, a step within 2 rows of an event
    counted at most at the median step; ``pause`` = what those steps took beyond the median;
    ``short`` = seconds of the steps fewer than NP ranks took; ``step`` = the mean step at
    full size away from the events."""
    steps, tt = d["step"], d["training_time"]
    near = {s for e in events for s in range(e - 2, e + 3)}
    # consecutive rows; a step logged twice is the step a failure cut short, done again
    pairs = [(s, b - a) for p, s, a, b in zip(steps, steps[1:], tt, tt[1:])
             if s in (p, p + 1) and 1 <= s <= len(alive) and b > a]
    if steps and steps[0] == 1 and tt[0] > 0:
        pairs.insert(0, (1, tt[0]))              # the first step: from the start
    med = _median([x for s, x in pairs if s not in near])
    out = {"useful": 0.0, "pause": 0.0, "short": 0.0}
    full = []
    for s, x in pairs:
        a = alive[s - 1]
        if s in near:
            out["pause"] += max(0.0, x - med)
            x = min(x, med)
        elif a == NP:
            full.append(x)
        out["useful"] += a / NP * x
        out["short"] += x if a < NP else 0.0
    out["step"] = sum(full) / len(full) if full else med
    return out


def _measure(policy: str, res: dict, steps: int, run_dir: Path) -> dict:
    """The costs a run measured in its own rows, and its goodput: useful seconds
    (_accounting) over the wall seconds from the first start line to the last step."""
    files = _read_metrics(run_dir)
    d = _survivor(files, steps)
    kills = res["kills"]
    full = policy in ("abort", "none")
    alive = [NP] * steps if full else _alive_per_step(files, steps)
    acc = _accounting(d, alive, set() if full else _events(files, alive))
    # the wall: to the last step (the done line less what came after the last row: the
    # final evaluation, checkpoint and completion, which a clean run pays too)
    res["wall_s"] = res["span_s"] - max(0.0, res["done_at_s"] - d["wall_time"][-1])
    out = {"checkpoint_s": _checkpoint_cost(d), "step_s": acc["step"],
           "rank_steps": sum(alive), "pause_s": acc["pause"] / kills if kills else 0.0,
           "short_s": acc["short"] / kills if kills else 0.0, "useful_s": acc["useful"],
           # heal: the joins (checkpoint, objects built again, restore), off the rows' clocks
           "join_s": sum(d.get("heal_pauses", [])) / kills if kills else 0.0}
    if policy == "abort":
        out["down_s"] = (sum(res["down_s"]) / len(res["down_s"]) if res["down_s"]
                         else res["startup_s"])
    out["measured"] = out["useful_s"] / res["wall_s"]
    return out


def _predict(policy: str, res: dict, meas: dict, every: int, theta: float) -> float:
    """The model's goodput for this run's costs at per-rank MTBF ``theta``."""
    tau = every * meas["step_s"]
    if policy in ("abort", "none"):
        return gp.abort_goodput(tau, meas["checkpoint_s"], theta / NP, 0.0,
                                meas.get("down_s", 0.0))
    m = gp.FailureModel(nodes=NP, node_mtbf_s=theta, checkpoint_s=meas["checkpoint_s"],
                        restart_s=0.0, shrink_pause_s=meas["pause_s"],
                        heal_pause_s=meas.get("join_s", 0.0) if policy == "heal" else 0.0,
                        replacement_s=meas["short_s"], checkpoint_interval_s=tau,
                        job_s=meas["useful_s"],
                        floor=1 if policy == "shrink" else 0)
    if policy == "shrink":
        return gp.shrink_goodput(m, window_s=res["wall_s"])
    g = gp.heal_goodput(m)
    # joins a kill cut short: the job ended after the join's checkpoint and was relaunched;
    # the model's heal has no such event, so the run's own waits are added to its wall
    waits = sum(res.get("down_s") or [])
    return g if not waits or g <= 0 else meas["useful_s"] / (meas["useful_s"] / g + waits)


def _reference(steps: int, tmp: Path, timeout: float, log) -> dict:
    """The clean run (nothing killed): its span sets the failure rate, its step and
    checkpoint the checkpoint interval; measured and predicted goodput as for the others."""
    every = max(1, steps // 40)
    ref = _poisson_run("shrink", steps, every, math.inf, tmp / "clean", timeout, log)
    ref.update(_measure("none", ref, steps, tmp / "clean"), every=every)
    ref["predicted"] = _predict("none", ref, ref, every, math.inf)
    return ref


def _work_time(run_dir: Path, steps: int, wall: float) -> Tuple[float, int]:
    """(seconds to do the budget's work of NP x steps rank-steps, rank-steps done): the wall
    seconds, plus the rank-steps the run did not do at the end's rate (the ranks alive at the
    end, a median step of the last fifth of a survivor's rows)."""
    files = _read_metrics(run_dir)
    alive = _alive_per_step(files, steps)
    d = _survivor(files, steps)
    tail = _deltas(d)[-max(1, len(d["step"]) // 5):]
    missing = NP * steps - sum(alive)
    return wall + missing * _median(tail) / max(1, alive[-1]), sum(alive)


def _own_theta(policy: str, res: dict) -> float:
    """The per-rank MTBF the run's own kills give: exposed rank-seconds over kills."""
    if not res["kills"]:
        return math.inf
    exposed = res["mortal_rank_s"] if policy == "shrink" else NP * res["exposure_s"]
    return exposed / res["kills"]


def poisson(quick: bool, tmp: Path, timeout: float, log, heal: bool) -> dict:
    """Every policy under about three seeded Poisson kills, measured and predicted."""
    steps = POISSON_QUICK_STEPS if quick else POISSON_STEPS
    try:
        ref = _reference(steps, tmp, timeout, log)
    except Exception as exc:
        return {"steps": steps, "reference": None, "runs": {},
                "errors": {"reference": f"{type(exc).__name__}: {exc}"}}
    mtbf = ref["wall_s"] / POISSON_KILLS            # job MTBF: ~3 kills in a clean run's time
    # per-rank MTBF: abort and heal replace lost ranks (rate NP/theta throughout); shrink
    # does not, so its ranks fail faster: NP (1 - e^{-T/theta}) = 3 in the clean run's T
    thetas = {"abort": NP * mtbf, "heal": NP * mtbf,
              "shrink": ref["wall_s"] / math.log(NP / (NP - POISSON_KILLS))}
    every = max(1, round(gp.daly_interval(ref["checkpoint_s"], mtbf) / ref["step_s"]))
    out = {"steps": steps, "reference": ref, "job_mtbf_s": mtbf, "rank_mtbf_s": thetas,
           "checkpoint_every": every, "runs": {}, "errors": {}}
    for policy in POLICIES:
        if policy == "heal" and not heal:
            out["runs"][policy] = {"available": False}
            continue
        try:
            theta = thetas[policy]
            res = _poisson_run(policy, steps, every, theta, tmp / f"poisson_{policy}",
                               timeout, log)
            meas = _measure(policy, res, steps, tmp / f"poisson_{policy}")
            own = _own_theta(policy, res)
            res.update(meas, own_rank_mtbf_s=own, drawn_rank_mtbf_s=theta,
                       predicted=_predict(policy, res, meas, every, own),
                       predicted_drawn=_predict(policy, res, meas, every, theta))
            res["error"] = res["measured"] / res["predicted"] - 1
            out["runs"][policy] = res
        except Exception as exc:                  # report it, go on with the next policy
            out["errors"][policy] = f"{type(exc).__name__}: {exc}"
    return out


def main(argv=None) -> int:
    """``--out FILE [--quick] [--one-kill-only]``: as _common.driver_main, and
    ``--one-kill-only`` leaves the Poisson part out."""
    import argparse
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--quick", action="store_true", help="a smaller budget")
    p.add_argument("--one-kill-only", action="store_true",
                   help="the one-kill part only (MPI and torch rows), no Poisson runs")
    args = p.parse_args(argv)
    result = run(args.quick, poisson_part=not args.one_kill_only)
    write_result(args.out, result)
    for r in result["rows"]:
        print(f"{r['label']}: {r['figures']}  ratio {r['ratio']}")
    return 0 if not result.get("errors") else 1


if __name__ == "__main__":
    sys.exit(main())
