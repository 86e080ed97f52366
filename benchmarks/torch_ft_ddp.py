"""One replica group of torchft's own DDP: the reference side of ``torch_ft_recovery``.

    REPLICA_GROUP_ID=r NUM_REPLICA_GROUPS=N TORCHFT_LIGHTHOUSE=http://HOST:PORT \\
        python benchmarks/torch_ft_ddp.py --steps 300 --failure-timeout 3 --out times_r.json

What a torchft user writes (torchft's manager_integ_test ``ddp_train_loop``, its README's
DDP example): a :class:`torchft.process_group.ProcessGroupGloo`, a
:class:`torchft.manager.Manager` reporting to the lighthouse, the model wrapped in
:class:`torchft.ddp.DistributedDataParallel`, the optimizer in
:class:`torchft.optim.OptimizerWrapper` (``zero_grad`` starts the step's quorum, ``step``
commits only if ``manager.should_commit()``). torchft's defaults (async quorum, heartbeat
every 100 ms) except the timeouts: the process group's and the manager's collective timeout
are ``--failure-timeout`` (the figure lsgd_hpc's ``--failure-timeout`` gives its collectives
between workers), the lighthouse's heartbeat timeout too (the benchmark starts it).

The same model and data as lsgd_hpc's trainer run of the benchmark: the zoo's digits CNN
(``--model``), the embedded digits, this replica group's shard (lsgd_hpc.data.ShardedBatches,
``--batch-size`` per worker), SGD with momentum, every replica initialised from the same seed
(``init_sync=False``, as lsgd_hpc's workers). The replica groups wait until all N are in one
quorum before the first timed step (as lsgd_hpc's do).

``--device cuda --pg baby-nccl`` (or ``nccl``) runs the same over NCCL on the GPUs, replica
group r on GPU r modulo the GPUs (with fewer GPUs than replica groups, each its own
NCCL_HOSTID: NCCL refuses two ranks on one GPU otherwise); scripts/gpu_check.sh runs it
through benchmarks/torch_ft_kill_check.py.

Prints ``step K of P`` (K = torchft's committed step count, P the participants of the step's
quorum) after every step, for the harness
that kills a worker at a given step, and writes ``--out``: JSON with ``times`` (the
perf_counter seconds at the end of every loop iteration, relative to the first),
``steps`` (manager.current_step() after it), ``committed``, ``participants``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: --pg: torchft's process groups between replica groups
PGS = {"gloo": "ProcessGroupGloo", "baby-gloo": "ProcessGroupBabyGloo",
       "nccl": "ProcessGroupNCCL", "baby-nccl": "ProcessGroupBabyNCCL"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True, help="committed steps to train")
    p.add_argument("--failure-timeout", type=float, required=True,
                   help="seconds: torchft's collective timeout (process group and manager)")
    p.add_argument("--out", required=True, help="JSON file of per-step times")
    p.add_argument("--model", default="digits_cnn")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: GPU REPLICA_GROUP_ID modulo the GPUs of this machine")
    p.add_argument("--pg", choices=tuple(PGS), default="gloo",
                   help="torchft's process group between the replica groups (baby-*: run in "
                        "a subprocess of torchft's; nccl needs --device cuda)")
    args = p.parse_args(argv)
    if "nccl" in args.pg and args.device != "cuda":
        p.error(f"--pg {args.pg} needs --device cuda")

    import logging

    import torch
    from torch import nn
    from torch.distributed import TCPStore
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    import torchft.process_group as tpg

    from lsgd_hpc.data import ShardedBatches, load_dataset
    from lsgd_hpc.models.zoo import build_model

    logging.getLogger("torchft").setLevel(logging.WARNING)
    torch.set_num_threads(1)
    rid, n = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    timeout = timedelta(seconds=args.failure_timeout)

    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rid % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if "nccl" in args.pg and torch.cuda.device_count() < n:
            # NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU
            # detected"); a host id of each replica group's own makes them separate hosts to
            # NCCL (its network transport between them), as on a machine of one GPU
            os.environ.setdefault("NCCL_HOSTID", f"lsgd-torchft-replica-{rid}")
    ds = load_dataset("digits", None, args.seed)
    sampler = ShardedBatches(ds, rid, n, args.batch_size, args.seed)
    torch.manual_seed(args.seed)
    model = build_model(args.model, ds.num_classes, ds.input_shape).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    # the replica group's store (torchrun's, when there is one; here one of its own)
    store = TCPStore(socket.gethostname(), 0, is_master=True, wait_for_workers=False)
    pg = getattr(tpg, PGS[args.pg])(timeout=timeout)
    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=1, timeout=timeout, rank=0, world_size=1,
                      store_addr=socket.gethostname(), store_port=store.port,
                      replica_id=f"ddp_{rid}", init_sync=False)
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, inner)
    loss_fn = nn.CrossEntropyLoss()

    # all N replica groups in one quorum before the first step (they start seconds apart)
    deadline = time.monotonic() + 120
    while True:
        manager.start_quorum(allow_heal=False)
        manager.wait_quorum()
        if manager.errored() is None and manager.num_participants() == n:
            break
        if time.monotonic() > deadline:
            print(f"only {manager.num_participants()} of {n} replica groups joined",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)

    times, steps, committed, participants = [], [], [], []
    epoch, t0 = 0, time.perf_counter()
    model.train()
    while manager.current_step() < args.steps:
        for xb, yb in sampler.batches(epoch):
            xb, yb = xb.to(device, non_blocking=True), yb.to(device, non_blocking=True)
            opt.zero_grad()                      # the step's quorum (async)
            loss = loss_fn(ddp(xb), yb)
            loss.backward()                      # allreduce through the managed group
            before = manager.current_step()
            opt.step()                           # applied only if should_commit()
            now = manager.current_step()
            times.append(time.perf_counter() - t0)
            steps.append(now)
            committed.append(now > before)
            participants.append(manager.num_participants())
            print(f"step {now} of {participants[-1]}", flush=True)
            if now >= args.steps:
                break
        epoch += 1
    tmp = args.out + ".tmp"
    with open(tmp, "w") as fh:
        json.dump({"replica": rid, "times": times, "steps": steps, "committed": committed,
                   "participants": participants}, fh)
    os.replace(tmp, args.out)
    manager.shutdown(wait=False)
    try:
        pg.shutdown()                            # (a baby group's subprocess)
    except Exception:                            # noqa: BLE001 - leaving anyway
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
