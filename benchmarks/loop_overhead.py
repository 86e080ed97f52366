"""The library loop and the trainer with communication off (1 rank) against a plain PyTorch loop.

    mpirun -np 1 python benchmarks/loop_overhead.py --out loop_overhead.json [--quick]

Three loops train the digits CNN on the embedded digits (batch 32, SGD with momentum) from
the same initial weights over the same batches (lsgd_hpc.data.ShardedBatches):
- plain: what one writes by hand: forward, loss, zero_grad, backward, step, loss.item().
- library (``library_overhead``): the same loop through the public API as a user writes it:
  ``lsgd_hpc.init``, ``lsgd_hpc.AllreduceSGD(model, opt, comm)``, ``method.step(loss)`` in
  place of ``opt.step()``, and a metrics row every step (``open_metrics(...).log_step``).
- trainer (``loop_overhead``): ``python -m lsgd_hpc.train --algorithm allreduce`` on one rank
  (lsgd_hpc.train.main in this process): its /train row every step, its metric flush every
  1000 steps (the default --flush-every), the stop-flag check, its learning-rate schedule.
A small model makes the per-step bookkeeping visible (a step is a few milliseconds). Each
round times the three back to back (order rotated); a ratio is a loop's seconds per step
over the plain loop's in the same round, and the key is the median of those paired ratios,
with their quartiles, because the machine's speed drifts between rounds by more than the
3 % the targets resolve.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import parse_args, row, spread, write_result

MODEL, DATASET, BATCH, LR, SEED = "digits_cnn", "digits", 32, 0.05, 0
#: (first timed step, last step, rounds) per mode; the timed steps hold the metric flush
#: at step 1000 (the default --flush-every)
PLAN = {"full": (10, 1010, 9), "quick": (10, 1010, 3)}


def plain_loop(skip: int, steps: int) -> float:
    """Seconds of steps skip+1..steps of a hand-written PyTorch loop."""
    import torch

    from lsgd_hpc.data import ShardedBatches, load_dataset
    from lsgd_hpc.models.zoo import build_model
    ds = load_dataset(DATASET, None, SEED)
    sampler = ShardedBatches(ds, 0, 1, BATCH, SEED)
    torch.manual_seed(SEED)
    model = build_model(MODEL, ds.num_classes, ds.input_shape)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses = []
    model.train()
    step, epoch, t0 = 0, 0, 0.0
    while step < steps:
        for xb, yb in sampler.batches(epoch):
            if step == skip:
                t0 = time.perf_counter()
            loss = loss_fn(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if step == steps:
                break
        epoch += 1
    return time.perf_counter() - t0


def trainer_loop(skip: int, steps: int, run_dir: str) -> float:
    """Seconds of steps skip+1..steps of lsgd_hpc.train on one rank (its /train wall_time)."""
    import h5py

    from lsgd_hpc.cli import train
    code = train.main(["--algorithm", "allreduce", "--dataset", DATASET, "--model", MODEL,
                       "--batch-size", str(BATCH), "--lr", str(LR), "--seed", str(SEED),
                       "--epochs", "1000", "--max-steps", str(steps),
                       "--eval-every", str(steps), "--run-dir", run_dir])
    if code != 0:
        raise RuntimeError(f"lsgd_hpc.train exited {code}")
    with h5py.File(Path(run_dir) / "metrics" / "rank00000.h5", "r", locking=False) as f:
        at = dict(zip(f["train"]["step"][()].tolist(), f["train"]["wall_time"][()].tolist()))
    return at[steps] - at[skip]


def library_loop(skip: int, steps: int, run_dir: str) -> float:
    """Seconds of steps skip+1..steps of the same loop through the public library API."""
    import torch

    import lsgd_hpc
    from lsgd_hpc.data import ShardedBatches, load_dataset
    from lsgd_hpc.models.zoo import build_model
    comm = _COMM["comm"] or lsgd_hpc.init(backend="mpi", device="cpu")
    _COMM["comm"] = comm
    ds = load_dataset(DATASET, None, SEED)
    sampler = ShardedBatches(ds, 0, 1, BATCH, SEED)
    torch.manual_seed(SEED)
    model = build_model(MODEL, ds.num_classes, ds.input_shape)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    method = lsgd_hpc.AllreduceSGD(model, opt, comm)
    metrics = lsgd_hpc.open_metrics(run_dir, comm, method)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    step, epoch, t0 = 0, 0, 0.0
    while step < steps:
        for xb, yb in sampler.batches(epoch):
            if step == skip:
                t0 = time.perf_counter()
            loss = loss_fn(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            method.step(loss)
            step += 1
            metrics.log_step(step, loss.item(), lr=LR)
            if step == steps:
                break
        epoch += 1
    seconds = time.perf_counter() - t0
    metrics.flush()
    method.close()
    return seconds


_COMM = {"comm": None}


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() != 1:
        raise SystemExit("loop_overhead runs on one rank (communication off)")
    torch.set_num_threads(1)
    skip, steps, rounds = PLAN["quick" if args.quick else "full"]
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_loop_"))
    samples = {"trainer": [], "library": [], "plain": []}
    loops = {"trainer": lambda r: trainer_loop(skip, steps, str(tmp / f"run{r}")),
             "library": lambda r: library_loop(skip, steps, str(tmp / f"lib{r}")),
             "plain": lambda r: plain_loop(skip, steps)}
    try:
        trainer_loop(2, 12, str(tmp / "warmup"))     # imports, first-touch allocations
        library_loop(2, 12, str(tmp / "libwarmup"))
        names = list(loops)
        for r in range(rounds):
            for name in names[r % 3:] + names[:r % 3]:     # rotate the order
                samples[name].append(loops[name](r) / (steps - skip))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    st = {k: spread(v) for k, v in samples.items()}
    ratios = {k: [a / p for a, p in zip(samples[k], samples["plain"])]
              for k in ("trainer", "library")}
    rs = {k: spread(v) for k, v in ratios.items()}
    t, lib, p = (st[k]["median"] for k in ("trainer", "library", "plain"))

    def q(k):
        return f"quartiles {rs[k]['q1']:.3f}-{rs[k]['q3']:.3f} over {rounds} rounds"

    write_result(args.out, {
        "name": "loop_overhead", "doc": __doc__.strip(), "np": 1, "model": MODEL,
        "dataset": DATASET, "batch_size": BATCH, "skip": skip, "steps": steps,
        "rounds": rounds, "seconds_per_step": st, "samples": samples,
        "paired_ratios": ratios, "ratio_spread": rs, "ratio": rs["trainer"]["median"],
        "library_ratio": rs["library"]["median"], "target": "<= 1.03",
        "rows": [row("loop_overhead",
                     f"lsgd_hpc.train on 1 rank (metrics written) vs a plain PyTorch loop, "
                     f"{MODEL} on {DATASET}, batch {BATCH}",
                     f"trainer {t * 1e3:.3f} ms/step, plain {p * 1e3:.3f} ms/step; {q('trainer')}",
                     rs["trainer"]["median"],
                     "trainer / plain seconds per step, median of paired ratios (target <= 1.03)"),
                 row("library_overhead",
                     f"the public API's loop (AllreduceSGD.step, a metrics row per step) on 1 "
                     f"rank vs a plain PyTorch loop, {MODEL} on {DATASET}, batch {BATCH}",
                     f"library {lib * 1e3:.3f} ms/step, plain {p * 1e3:.3f} ms/step; {q('library')}",
                     rs["library"]["median"],
                     "library / plain seconds per step, median of paired ratios (target <= 1.03)")],
        "notes": [f"loop_overhead, library_overhead: steps {skip + 1}..{steps} timed, three "
                  "loops back to back per round (order rotated), ratios paired within a round; "
                  "the trainer's time from the wall_time of its /train rows, so everything "
                  "between those rows counts (metric rows and flushes, learning-rate update, "
                  "stop-flag check)."],
    })
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
