"""Your own model and training loop on digits, with any method of lsgd_hpc.

    mpirun -np 4 python examples/own_loop.py --method lsgd --ranks-per-node 2
    mpirun -np 4 python examples/own_loop.py --method local-sgd -o local_steps=4
    mpirun -np 4 python examples/own_loop.py --method all      # each method in turn

Each rank trains a small MLP (defined here) with AdamW on its shard of scikit-learn's digits
(1437 training, 360 test images); the method does the communication. Metrics of method NAME
go to RUN_DIR/NAME/metrics/rankNNNNN.h5 and rank 0 aggregates the runs of the job into
RUN_DIR/aggregate/summary.csv (one row per method) at the end. SIGUSR1/SIGTERM stop the run
at an agreed step with a checkpoint (exit 143); started again on the same --run-dir it
resumes exactly where it stopped (tests/library/test_library_resume.py checks it).
"""

import argparse
import ast
import sys
import time

import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.data import load_dataset


class Net(nn.Module):
    def __init__(self, hidden=128):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def forward(self, x):
        return self.body(x)


def option(text):
    key, _, value = text.partition("=")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value               # a string, e.g. topology=torus


def wait_for_signal(stop, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not stop.raised and time.monotonic() < deadline:
        time.sleep(0.05)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", default="lsgd", choices=["all", *lsgd_hpc.METHODS])
    p.add_argument("-o", "--option", type=option, action="append", default=[],
                   metavar="KEY=VALUE", help="a method option, e.g. -o tau_local=4")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=150)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--run-dir", default="runs/own_loop")
    p.add_argument("--ready-at", type=int, default=0,
                   help="after step K print 'ready at step K' and wait up to 60 s for "
                        "SIGUSR1/SIGTERM (the resume test sends it then)")
    p.add_argument("--save-params", metavar="FILE", help="rank 0 saves the final parameters")
    args = p.parse_args()
    comm = lsgd_hpc.init(backend="mpi", ranks_per_node=args.ranks_per_node)
    ds = load_dataset("digits")
    names = list(lsgd_hpc.METHODS) if args.method == "all" else [args.method]
    for name in names:
        train(args, comm, ds, name, f"{args.run_dir}/{name}")
    if comm.rank == 0:
        from lsgd_hpc.analysis import aggregate
        aggregate.main([f"{args.run_dir}/{name}" for name in names]
                       + ["--out", f"{args.run_dir}/aggregate"])


def train(args, comm, ds, name, run_dir):
    torch.manual_seed(0)
    comm.stats.reset()                      # this run's bytes only (several runs per job)
    data = torch.utils.data.TensorDataset(ds.x_train, ds.y_train)
    sampler = lsgd_hpc.ShardedSampler(len(data), comm, batch_size=args.batch_size, seed=1)
    loader = torch.utils.data.DataLoader(data, batch_sampler=sampler)
    model = Net().to(comm.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    stop = lsgd_hpc.StopSignals()
    method = lsgd_hpc.METHODS[name](model, opt, comm, max_steps=args.max_steps,
                                     checkpoint_every=args.checkpoint_every, stop=stop,
                                     **dict(args.option))
    metrics = lsgd_hpc.open_metrics(run_dir, comm, method=method, config=vars(args))
    ckpt = lsgd_hpc.Checkpointer(run_dir, comm, model=model, optimizer=opt,
                                 method=method, sampler=sampler, metrics=metrics)
    resumed = ckpt.restore()
    if resumed is not None and comm.rank == 0:
        print(f"resumed from step {resumed}", flush=True)

    def evaluate():
        with metrics.measuring(), method.reported_model() as m, torch.no_grad():
            out = m(ds.x_test.to(comm.device))
            loss = float(nn.functional.cross_entropy(out, ds.y_test.to(comm.device)))
            acc = float((out.argmax(1).cpu() == ds.y_test).float().mean())
        metrics.log_eval(method.steps, loss, acc, epoch=method.steps / sampler.steps_per_epoch)
        return acc

    while not (method.done or method.stopping):
        for x, y in loader:
            x, y = x.to(comm.device), y.to(comm.device)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            method.step(loss)
            metrics.log_step(method.steps, loss.item(), lr=args.lr,
                             epoch=method.steps / sampler.steps_per_epoch)
            if args.ready_at and method.steps == args.ready_at:
                print(f"rank {comm.rank} ready at step {method.steps}", flush=True)
                wait_for_signal(stop)
            # async LSGD: ranks take uneven steps; a periodic evaluation is for the others
            if args.eval_every and method.steps % args.eval_every == 0 \
                    and name != "lsgd-async" and not method.done:
                evaluate()
            if method.checkpoint_due or method.stopping:
                ckpt.save()
            if method.done or method.stopping:
                break

    if method.stopping:                     # SIGUSR1/SIGTERM: checkpoint saved above
        if comm.rank == 0:
            print(f"stopped at step {method.steps}, checkpoint saved", flush=True)
        metrics.flush()
        if not lsgd_hpc.requeue(comm, stop):     # under SLURM: scontrol requeue
            sys.exit(143)
        sys.exit(0)

    acc = evaluate()
    metrics.flush()
    if args.save_params and comm.rank == 0:
        torch.save([t.detach().cpu() for t in model.state_dict().values()], args.save_params)
    steps = comm.allgather_object(method.steps)
    if comm.rank == 0:
        print(f"{name}: test accuracy of the reported model {acc:.2%} after {steps} steps "
              f"per rank, {metrics.training_time():.1f} s", flush=True)
    method.close()


if __name__ == "__main__":
    main()
