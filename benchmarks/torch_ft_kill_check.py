"""A worker killed and the survivors going on, through one of torchft's process groups: the
NCCL check of scripts/gpu_check.sh (``--device cuda --pg baby-nccl``), also runnable on CPU.

    python benchmarks/torch_ft_kill_check.py --device cuda --pg baby-nccl --out check.json
    python benchmarks/torch_ft_kill_check.py --pg gloo --steps 60 --kill-at 20   # CPU

Starts a lighthouse (``python -m lsgd_hpc.lighthouse``, heartbeat timeout = the failure
timeout) and ``--workers`` replica groups of torchft's own DDP (benchmarks/torch_ft_ddp.py:
torchft's Manager, DDP and OptimizerWrapper over ``--pg``; on cuda, worker r on GPU r modulo
the GPUs), SIGKILLs the last worker from outside once worker 0 reports step ``--kill-at``,
and checks that every survivor finishes the ``--steps`` committed steps (exit 0), that the
killed one's status is -9 and that the survivors' quorum shrank to the others after the
kill. Writes ``--out`` (JSON: ok, exit statuses, the survivors' stall and last
participants, a reason when not ok) and exits 0 when ok, 1 when not.

torchft's process groups between workers are checked here with torchft's own training loop
(kill and shrink); lsgd_hpc's own trainer talks between workers over torchft's
ProcessGroupGloo (``--trainer ALGORITHM``: the same kill with ``python -m lsgd_hpc.train
--backend torch --on-failure shrink --device DEVICE``; the survivors must reach
``--max-steps`` and record the recovery in /faults; with ``--heal``, ``--on-failure heal`` and
the killed worker started again at once, as torchrun --max-restarts does: it must join, every
worker must reach ``--max-steps`` and record the heal).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import write_result  # noqa: E402
from torch_ft_common import (PY, Lighthouse, Workers, torchft_missing,  # noqa: E402
                             train_argv, train_rows)


def check_trainer(device: str, algorithm: str, workers: int, steps: int, kill_at: int,
                  failure_timeout: float, timeout: float, folder: Path,
                  heal: bool = False, straggler_s: float = 0.0) -> dict:
    """The same with lsgd_hpc's own trainer (``--backend torch --on-failure shrink``, its
    groups between workers torchft's ProcessGroupGloo, the model on ``device``); ``heal``:
    ``--on-failure heal``, the killed worker started again at once, joining."""
    run_dir = folder / "run"
    killed = workers - 1
    policy = "heal" if heal else "shrink"
    res = {"device": device, "trainer": algorithm, "workers": workers, "steps": steps,
           "kill_at": kill_at, "failure_timeout_s": failure_timeout, "killed": killed,
           "policy": policy}
    t0 = time.perf_counter()
    argv = train_argv(run_dir, [
        "--on-failure", policy, "--failure-timeout", str(failure_timeout),
        "--device", device, "--algorithm", algorithm, "--ranks-per-node", "1",
        "--max-steps", str(steps), "--eval-every", str(kill_at),
        *(["--straggler", f"0:{straggler_s:g}"] if straggler_s else [])])
    killed_status = None
    with Lighthouse(folder, failure_timeout) as lh:
        w = Workers(folder, lh.address, workers, lambda r: argv)
        seen = w.wait_for(0, rf"step\s+{kill_at}/", timeout)
        if seen:
            w.kill(killed)
            if heal:                              # torchrun --max-restarts: start it again
                killed_status = w.procs[killed].wait()
                w.restart(killed, argv, lh.address, workers)
        codes = w.wait(max(1.0, timeout - (time.perf_counter() - t0)))
    if killed_status is not None:
        codes = codes + [killed_status]           # (the first run's status last)
    res.update(exit_statuses=codes, killed_at_step=kill_at if seen else None,
               seconds=time.perf_counter() - t0)
    why = [] if seen else [f"worker 0 never reported step {kill_at}"]
    if seen and codes[-1] != -9:
        why.append(f"the killed worker's status is {codes[-1]}, not -9")
    survivors = [r for r in range(workers) if r != killed or heal]
    if heal and seen and "joined" not in w.outs[0].read_text():
        why.append("the restarted worker did not join")
    recovery = []
    for r in survivors:
        if codes[r] != 0:
            why.append(f"survivor {r} exited {codes[r]}: {w.tail(r)}")
            continue
        rows = train_rows(run_dir, r)
        if rows["step"][-1] != steps:
            why.append(f"survivor {r} ended at step {rows['step'][-1]} of {steps}")
        if not rows["fault_steps"]:
            why.append(f"worker {r} recorded no recovery in /faults")
        recovery += rows["recovery_seconds"] if r != killed else []
    res.update(ok=not why, why="; ".join(why), recovery_seconds=recovery)
    return res


def check(device: str, pg: str, workers: int, steps: int, kill_at: int, failure_timeout: float,
          timeout: float, folder: Path) -> dict:
    outs = [folder / f"times{r}.json" for r in range(workers)]
    killed = workers - 1
    res = {"device": device, "pg": pg, "workers": workers, "steps": steps, "kill_at": kill_at,
           "failure_timeout_s": failure_timeout, "killed": killed}
    t0 = time.perf_counter()
    with Lighthouse(folder, failure_timeout) as lh:
        w = Workers(folder, lh.address, workers, lambda r: [
            PY, str(HERE / "torch_ft_ddp.py"), "--steps", str(steps), "--failure-timeout",
            str(failure_timeout), "--device", device, "--pg", pg, "--out", str(outs[r])])
        seen = w.wait_for(0, rf"^step {kill_at} of {workers}$", timeout)
        if seen:
            w.kill(killed)
        codes = w.wait(max(1.0, timeout - (time.perf_counter() - t0)))
    res.update(exit_statuses=codes, killed_at_step=kill_at if seen else None,
               seconds=time.perf_counter() - t0)
    survivors = [r for r in range(workers) if r != killed]
    why = []
    if not seen:
        why.append(f"worker 0 never reported step {kill_at} with all {workers} workers")
    if codes[killed] != -9 and seen:
        why.append(f"the killed worker's status is {codes[killed]}, not -9")
    stalls, last_participants = [], []
    for r in survivors:
        if codes[r] != 0:
            why.append(f"survivor {r} exited {codes[r]}: {w.tail(r)}")
            continue
        d = json.loads(outs[r].read_text())
        if d["steps"][-1] != steps:
            why.append(f"survivor {r} ended at step {d['steps'][-1]} of {steps}")
        if d["participants"][-1] != len(survivors):
            why.append(f"survivor {r}'s last quorum held {d['participants'][-1]} workers, not "
                       f"{len(survivors)}")
        done = [t for t, c, s in zip(d["times"], d["committed"], d["steps"])
                if c and s >= kill_at - 5]
        stalls.append(max((b - a for a, b in zip(done, done[1:])), default=float("nan")))
        last_participants.append(d["participants"][-1])
    res.update(ok=not why, why="; ".join(why), stall_s=stalls,
               last_participants=last_participants)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pg", default="gloo", choices=("gloo", "baby-gloo", "nccl", "baby-nccl"))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-at", type=int, default=100)
    p.add_argument("--failure-timeout", type=float, default=5.0)
    p.add_argument("--timeout", type=float, default=240.0, help="seconds for the whole check")
    p.add_argument("--trainer", metavar="ALGORITHM", default=None,
                   help="run lsgd_hpc's trainer with this --algorithm (--backend torch "
                        "--on-failure shrink) in place of torchft's DDP; --pg is then unused")
    p.add_argument("--heal", action="store_true",
                   help="with --trainer: --on-failure heal, the killed worker started again "
                        "(as torchrun --max-restarts) and joining")
    p.add_argument("--straggler-s", type=float, default=0.0,
                   help="with --trainer: worker 0 sleeps this long every step (--straggler), "
                        "so that a restarted worker's start-up fits in the budget")
    p.add_argument("--out", default=None, help="JSON result (default: stdout only)")
    args = p.parse_args(argv)
    if args.workers < 2 or not 0 < args.kill_at < args.steps:
        p.error("--workers >= 2 and 0 < --kill-at < --steps")
    why = torchft_missing()
    if why:
        res = {"ok": False, "why": why}
    else:
        with tempfile.TemporaryDirectory(prefix="torch_ft_kill_check_") as tmp:
            if args.trainer:
                res = check_trainer(args.device, args.trainer, args.workers, args.steps,
                                    args.kill_at, args.failure_timeout, args.timeout, Path(tmp),
                                    heal=args.heal, straggler_s=args.straggler_s)
            else:
                res = check(args.device, args.pg, args.workers, args.steps, args.kill_at,
                            args.failure_timeout, args.timeout, Path(tmp))
    if args.out:
        write_result(args.out, res)
    print(json.dumps(res, sort_keys=True))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
