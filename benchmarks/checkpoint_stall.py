"""The training stall of an asynchronous checkpoint against a synchronous one (1 rank).

    mpirun -np 1 python benchmarks/checkpoint_stall.py --out checkpoint_stall.json [--quick]

What the trainer checkpoints (lsgd_hpc.Checkpointer over model, optimizer, method, sampler
and metrics writer): the zoo's mlp_wide on the synthetic set's input shape (the model's
parameters and SGD momentum: 33.7 MB), trained by AllreduceSGD on one rank. Each round takes
a few training steps, then saves once synchronously (``sync=True``: the files are written,
fsynced and committed before ``save`` returns) and once asynchronously (``save`` returns
once the state is copied to host memory; a thread writes), order alternating, each into a
run folder of its own. The stall is the time ``save`` takes, what the step sees (the trainer
books it as ``checkpoint_seconds``); the asynchronous write is waited for (``wait()``)
before the next save, outside the timing, and its duration reported beside. The key is the
median of the per-round ratios async stall / sync save (target <= 0.25).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from _common import fmt_bytes, fmt_s, parse_args, row, spread, write_result

MODEL, DATASET, BATCH, LR, SEED = "mlp_wide", "synthetic", 32, 0.05, 0
#: rounds (each: one synchronous and one asynchronous save) and training steps between saves
PLAN = {"full": (9, 3), "quick": (3, 3)}


def _setup(comm, tmp: Path):
    """The model, optimizer, method, sampler and metrics writer a 1-rank trainer holds,
    after a few steps (the momentum buffers exist), and a step function."""
    import torch

    import lsgd_hpc
    from lsgd_hpc.data import ShardedBatches, load_dataset
    from lsgd_hpc.models.zoo import build_model
    ds = load_dataset(DATASET, None, SEED)
    batches = ShardedBatches(ds, 0, 1, BATCH, SEED)
    torch.manual_seed(SEED)
    model = build_model(MODEL, ds.num_classes, ds.input_shape)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    method = lsgd_hpc.AllreduceSGD(model, opt, comm)
    metrics = lsgd_hpc.open_metrics(str(tmp / "metrics-run"), comm, method)
    loss_fn = torch.nn.CrossEntropyLoss()
    stream = iter(())

    def step():
        nonlocal stream
        try:
            xb, yb = next(stream)
        except StopIteration:
            stream = iter(batches.from_step(method.steps))
            xb, yb = next(stream)
        loss = loss_fn(model(xb), yb)
        method.zero_grad()
        loss.backward()
        method.step(loss)
        metrics.log_step(method.steps, float(loss.detach()), lr=LR)
    objects = dict(model=model, optimizer=opt, method=method, sampler=batches.sampler,
                   metrics=metrics)
    return objects, step


def _state_bytes(objects) -> int:
    import torch
    total = 0

    def walk(v):
        nonlocal total
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
    for name in ("model", "optimizer"):
        walk(objects[name].state_dict())
    return total


def measure(rounds: int, steps: int, tmp: Path) -> dict:
    import lsgd_hpc
    comm = lsgd_hpc.init(backend="mpi", device="cpu")
    objects, step = _setup(comm, tmp)
    for _ in range(steps):
        step()
    savers = {"sync": lsgd_hpc.Checkpointer(str(tmp / "sync"), comm, sync=True, **objects),
              "async": lsgd_hpc.Checkpointer(str(tmp / "async"), comm, **objects)}
    samples = {"sync": [], "async": [], "async_write": []}
    for name in ("sync", "async"):                       # warm-up: first-touch allocations
        savers[name].save()
        savers[name].wait()
    for r in range(rounds):
        order = ("sync", "async") if r % 2 == 0 else ("async", "sync")
        for name in order:
            for _ in range(steps):
                step()
            t0 = time.perf_counter()
            savers[name].save()
            samples[name].append(time.perf_counter() - t0)
            savers[name].wait()
            if name == "async":
                samples["async_write"].append(time.perf_counter() - t0)
    size = sum(f.stat().st_size for f in (tmp / "sync" / "checkpoints").rglob("step*/*.pt"))
    size //= max(1, len(list((tmp / "sync" / "checkpoints").glob("step*"))))
    objects["metrics"].close()
    objects["method"].close()
    return {"samples": samples, "state_bytes": _state_bytes(objects), "set_bytes": size}


def main(argv=None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    import torch
    from mpi4py import MPI
    if MPI.COMM_WORLD.Get_size() != 1:
        raise SystemExit("checkpoint_stall runs on one rank")
    torch.set_num_threads(1)
    rounds, steps = PLAN["quick" if args.quick else "full"]
    tmp = Path(tempfile.mkdtemp(prefix="lsgd_bench_ckpt_"))
    try:
        got = measure(rounds, steps, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    s = got["samples"]
    if got["state_bytes"] < 10e6:
        raise SystemExit(f"checkpoint_stall: the model's state is {got['state_bytes']} bytes, "
                         "under the 10 MB the benchmark is about")
    ratios = [a / b for a, b in zip(s["async"], s["sync"])]
    st = {k: spread(v) for k, v in s.items()}
    rs = spread(ratios)
    sync_s, stall_s, write_s = (st[k]["median"] for k in ("sync", "async", "async_write"))
    write_result(args.out, {
        "name": "checkpoint_stall", "doc": __doc__.strip(), "np": 1, "model": MODEL,
        "dataset": DATASET, "rounds": rounds, "steps_between": steps,
        "state_bytes": got["state_bytes"], "set_bytes": got["set_bytes"],
        "seconds": st, "samples": s, "paired_ratios": ratios, "ratio_spread": rs,
        "ratio": rs["median"], "target": "<= 0.25",
        "rows": [row("checkpoint_stall",
                     f"the step's stall of an asynchronous save vs a synchronous save, "
                     f"{MODEL} ({fmt_bytes(got['state_bytes'])} of model and optimizer "
                     f"state, a set of {fmt_bytes(got['set_bytes'])}) on 1 rank",
                     f"async stall {fmt_s(stall_s)}, sync save {fmt_s(sync_s)} (the async "
                     f"write done {fmt_s(write_s)} after save); quartiles "
                     f"{rs['q1']:.3f}-{rs['q3']:.3f} over {rounds} rounds",
                     rs["median"],
                     "async stall / sync save seconds, median of paired ratios "
                     "(target <= 0.25)")],
        "notes": ["checkpoint_stall: Checkpointer.save timed as the training loop sees it "
                  "(metrics flush included in both); the asynchronous write is waited for "
                  "before the next save, outside the timing; saves alternate in order."],
    })
    print(f"checkpoint_stall: async {fmt_s(stall_s)} / sync {fmt_s(sync_s)} = "
          f"{rs['median']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
