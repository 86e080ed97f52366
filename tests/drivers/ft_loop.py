"""A library loop under on_failure="shrink" (tests/comm/test_faults_mpi.py runs it under
``mpirun --with-ft ulfm``): a tiny MLP, one method, ranks killed by the testing hook or from
outside, then every survivor prints one ``FTRESULT {json}`` line with what the test checks.

    mpirun --with-ft ulfm -np 4 python tests/drivers/ft_loop.py METHOD RUN_DIR [options]

--kill SPEC       lsgd_hpc.comm.injection.inject_failures SPEC ("1:5,2:9", "leader:8")
--park R:S        rank R (initial) writes RUN_DIR/park.R with its pid at step S and sleeps
                  there (the test SIGKILLs it from outside)
--steps N         the step budget (max_steps)
--rpn K           ranks per node
--hidden H        the MLP's hidden width (16: 244 values, under the 256 from which
                  comm_dtype bf16/int8/fp8 applies; 64 or more to exercise it)
--resume          restore the newest checkpoint set of RUN_DIR first (a full-size resume of a
                  survivors' set: the lost ranks rejoin); FTRESULT then also holds what each
                  rank held right after it ("after_restore"). METHOD and RUN_DIR may then be
                  comma-separated lists: one job resumes each run in turn, one FTRESULT line
                  per run and rank
"""

import argparse
import json
import math
import os
import sys
import time

import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.comm import injection
from lsgd_hpc.methods.rules.state import digest as _digest

OPTIONS = {"lsgd": dict(tau_local=2, tau_global=4), "easgd": dict(easgd_tau=2),
           "local-sgd": dict(local_steps=3), "allreduce": dict(bucket_mb=0.0005),
           "diloco": dict(local_steps=3), "slowmo": dict(local_steps=2, slowmo_every=4),
           "gossip": dict(topology="ring"), "lsgd-async": dict(tau_local=2, tau_global=4)}


def options(name, pairs):
    opts = dict(OPTIONS.get(name, {}))
    for kv in pairs:
        k, v = kv.split("=", 1)
        try:
            opts[k] = json.loads(v)
        except ValueError:
            opts[k] = v
    return opts


def shared_state(name, method, opt):
    """What must hold equal on every rank, by method."""
    rule = method.rule
    if name == "allreduce":
        return {"flat": method.flat.flat, "opt": opt.state_dict()["state"]}
    if name == "easgd":
        return {"center": rule.center}
    if name == "diloco":
        outer = ([fr.opt.state_dict()["state"] for fr in rule.fragments] if rule.streaming
                 else rule.outer_opt.state_dict()["state"])
        return {"prev": rule.prev.data, "outer": outer, "outer_steps": rule.outer_steps}
    if name == "slowmo":
        return {"old": rule.old, "u": rule.u}
    if name == "local-sgd":
        return {"T": rule.T, "since": rule.since_avg}
    if name == "lsgd" and rule.compressed:       # the compressed pull's reference
        return {"reference": rule.reference}
    return {}


def restored(name, method, opt, ckpt):
    """What this rank holds right after a restore."""
    rule = method.rule
    out = {"step": ckpt.restore(), "rejoined": ckpt.rejoined,
           "flat": _digest(method.flat.flat), "params": _digest(method.flat.params),
           "opt_state": len(opt.state_dict()["state"])}
    if name == "easgd":
        out["center"] = _digest(rule.center)
    elif name == "diloco":
        out["prev"] = _digest(rule.prev.data)
    elif name == "slowmo":
        out["old"] = _digest(rule.old)
    elif name in ("lsgd", "lsgd-async"):
        out["leader"] = rule.last_global.world_rank
    return out


def run(name, run_dir, comm, args, park):
    me = comm.initial_rank
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(100 + me)
    data_x = torch.randn(256, 10, generator=g)
    data_y = (data_x[:, :2].sum(1) > 0).long() + 2 * (data_x[:, 2] > 0).long()
    loss_fn = nn.CrossEntropyLoss()

    try:
        method = lsgd_hpc.METHODS[name](model, opt, comm, max_steps=args.steps,
                                        checkpoint_every=args.checkpoint_every,
                                        **options(name, args.option))
    except ValueError as exc:
        print(f"method refused: {exc}", flush=True)
        sys.exit(2)
    metrics = lsgd_hpc.open_metrics(run_dir, comm, method=method, flush_every=4)
    events = []

    @comm.on_failure
    def heard(event):
        events.append({"lost": list(event.lost_ranks), "size": event.world_size_after,
                       "step": event.step, "rank": comm.rank, "seconds": event.recovery_seconds})

    ckpt = lsgd_hpc.Checkpointer(run_dir, comm, model=model, optimizer=opt, method=method,
                                 metrics=metrics) \
        if args.checkpoint_every or args.resume else None
    after_restore = restored(name, method, opt, ckpt) if args.resume else None
    batch = 16
    i = 0
    while not method.done:
        lo = (i * batch) % 256
        x, y = data_x[lo:lo + batch], data_y[lo:lo + batch]
        i += 1
        if park and me == park[0] and method.steps + 1 == park[1]:
            with open(os.path.join(run_dir, f"park.{me}.tmp"), "w") as fh:
                fh.write(str(os.getpid()))
            os.replace(os.path.join(run_dir, f"park.{me}.tmp"),
                       os.path.join(run_dir, f"park.{me}"))
            time.sleep(600)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        method.step(loss)
        metrics.log_step(method.steps, loss.item(), lr=0.05)
        if ckpt is not None and method.checkpoint_due:
            ckpt.save()

    # what must hold on every survivor
    rule = method.rule
    shared = shared_state(name, method, opt)
    info = {"method": name, "initial_rank": me, "rank": comm.rank, "size": comm.size,
            "steps": method.steps, "local_rank": comm.local_rank,
            "node_index": comm.node_index, "n_nodes": comm.n_nodes,
            "digest": _digest(shared) if shared else "", "events": events,
            "lost": list(comm.lost_ranks), "after_restore": after_restore,
            "finite": bool(torch.isfinite(method.flat.flat).all()),
            "loss": float(loss.item()) if math.isfinite(loss.item()) else None}
    if method.workers is not None:    # workers that span ranks: which, and its replica
        info["worker"] = method.workers.index
        info["n_workers"] = method.workers.n_workers
        info["worker_size"] = method.workers.size
        info["replica"] = _digest({"flat": method.flat.flat, "opt": opt.state_dict()["state"]})
    if method.wire is not None and method.error_feedback:
        info["residual_norm"] = sum(float(e.norm()) for e in
                                    method.wire.world.shared.residuals.values())
    if name == "diloco":
        info["outer_steps"] = rule.outer_steps
    if name == "lsgd-async":
        info["rounds"] = {str(lv.scope): lv.rounds for lv in rule.levels}
    if name == "gossip":
        info["topology_n"] = rule.topology.n
    if name == "lsgd":
        info["multi_level"] = rule.multi_level
        info["last_global"] = None if rule.last_global is None else rule.last_global.world_rank
        info["pulls_done"] = {str(k): v for k, v in rule.pulls_done.items()}
        info["have_copy"] = {str(k): v for k, v in rule.have_copy.items()}
    all_info = comm.allgather_object(info)
    metrics.close()
    method.close()
    print("FTRESULT " + json.dumps(info), flush=True)
    return all_info


def main():
    p = argparse.ArgumentParser()
    p.add_argument("method")
    p.add_argument("run_dir")
    p.add_argument("--kill", default="")
    p.add_argument("--park", default="")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--rpn", type=int, default=2)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--min-ranks", type=int, default=1)
    p.add_argument("--option", "-o", action="append", default=[])
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    args = p.parse_args()

    torch.set_num_threads(1)
    if os.environ.get("FT_DUMP_ON_USR2"):           # debugging a hang: kill -USR2 each rank
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    try:
        comm = lsgd_hpc.init(backend="mpi", ranks_per_node=args.rpn, device="cpu",
                             on_failure="shrink", min_ranks=args.min_ranks)
    except ValueError as exc:
        print(f"rank refused: {exc}", flush=True)
        sys.exit(2)
    if args.kill:
        injection.inject_failures(args.kill, comm)
    park = tuple(int(v) for v in args.park.split(":")) if args.park else None
    for name, run_dir in zip(args.method.split(","), args.run_dir.split(",")):
        all_info = run(name, run_dir, comm, args, park)
    if os.environ.get("FT_DEBUG_EXIT"):
        import faulthandler
        faulthandler.dump_traceback_later(float(os.environ["FT_DEBUG_EXIT"]), exit=True)
    if comm.rank == 0:
        print("FTALL " + json.dumps(all_info), flush=True)


if __name__ == "__main__":
    main()
    # as the trainer leaves (lsgd_hpc.cli.train.run_as_main): exit handlers, MPI_Finalize,
    # then no interpreter teardown (a CPU-second a rank with torch loaded)
    from lsgd_hpc.session import exit_as_interpreter
    exit_as_interpreter(0)
