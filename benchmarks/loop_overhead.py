"""The trainer's loop with communication off (1 rank) against a plain PyTorch loop, same model and data.

    mpirun -np 1 python benchmarks/loop_overhead.py --out loop_overhead.json [--quick]

Both loops train the digits CNN on the embedded digits (batch 32, SGD with momentum) from
the same initial weights over the same batches (lsgd_hpc.data.ShardedBatches). The trainer
runs as users run it, `python -m lsgd_hpc.train --algorithm allreduce` on one rank
(lsgd_hpc.train.main in this process): its /train row every step, its metric flush every
1000 steps (the default --flush-every), the stop-flag check, its learning-rate schedule,
all included. The plain loop is what one writes by hand: forward, loss, zero_grad,
backward, step, loss.item(). A small model makes the per-step bookkeeping visible (a step
is a few milliseconds); the ratio is the trainer's seconds per step over the plain loop's,
median over interleaved rounds.
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
PLAN = {"full": (10, 1010, 5), "quick": (10, 1010, 2)}


def plain_loop(skip: int, steps: int) -> float:
    """Seconds of steps skip+1..steps of a hand-written PyTorch loop."""
    import torch

    from lsgd_hpc.data import ShardedBatches, load_dataset
    from lsgd_hpc.models import build_model
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

    from lsgd_hpc import train
    code = train.main(["--algorithm", "allreduce", "--dataset", DATASET, "--model", MODEL,
                       "--batch-size", str(BATCH), "--lr", str(LR), "--seed", str(SEED),
                       "--epochs", "1000", "--max-steps", str(steps),
                       "--eval-every", str(steps), "--run-dir", run_dir])
    if code != 0:
        raise RuntimeError(f"lsgd_hpc.train exited {code}")
    with h5py.File(Path(run_dir) / "metrics" / "rank00000.h5", "r", locking=False) as f:
        at = dict(zip(f["train"]["step"][()].tolist(), f["train"]["wall_time"][()].tolist()))
    return at[steps] - at[skip]


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() != 1:
        raise SystemExit("loop_overhead runs on one rank (communication off)")
    torch.set_num_threads(1)
    skip, steps, rounds = PLAN["quick" if args.quick else "full"]
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_loop_"))
    samples = {"trainer": [], "plain": []}
    try:
        trainer_loop(2, 12, str(tmp / "warmup"))     # imports, first-touch allocations
        for r in range(rounds):
            order = ["trainer", "plain"] if r % 2 == 0 else ["plain", "trainer"]
            for name in order:
                if name == "trainer":
                    s = trainer_loop(skip, steps, str(tmp / f"run{r}"))
                else:
                    s = plain_loop(skip, steps)
                samples[name].append(s / (steps - skip))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    st = {k: spread(v) for k, v in samples.items()}
    t, p = st["trainer"]["median"], st["plain"]["median"]
    ratio = t / p
    write_result(args.out, {
        "name": "loop_overhead", "doc": __doc__.strip(), "np": 1, "model": MODEL,
        "dataset": DATASET, "batch_size": BATCH, "skip": skip, "steps": steps,
        "rounds": rounds, "seconds_per_step": st, "samples": samples, "ratio": ratio,
        "target": "<= 1.03",
        "rows": [row("loop_overhead",
                     f"lsgd_hpc.train on 1 rank (metrics written) vs a plain PyTorch loop, "
                     f"{MODEL} on {DATASET}, batch {BATCH}",
                     f"trainer {t * 1e3:.3f} ms/step, plain {p * 1e3:.3f} ms/step "
                     f"(median of {rounds} rounds of {steps - skip} steps)",
                     ratio, "trainer / plain seconds per step (target <= 1.03)")],
        "notes": [f"loop_overhead: steps {skip + 1}..{steps} timed, rounds interleaved "
                  "(order alternated); the trainer's time from the wall_time of its /train "
                  "rows, so everything between those rows counts (metric rows and flushes, "
                  "learning-rate update, stop-flag check)."],
    })
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
