"""The CLI's training loop written with the public library API only (tests/cli/test_library_cli.py
compares its per-step losses and elections with `python -m lsgd_hpc.train`'s).

    mpirun -np N python tests/drivers/library_vs_cli.py OUT.json ALGORITHM STEPS RANKS_PER_NODE
"""

import json
import sys

import torch

import lsgd_hpc
from lsgd_hpc.data.loaders import load_dataset
from lsgd_hpc.data.sampler import ShardedBatches
from lsgd_hpc.models import zoo as models

out, algorithm, steps, rpn = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
seed, lr, batch = 0, 0.05, 32
torch.set_num_threads(1)
comm = lsgd_hpc.init(backend="mpi", ranks_per_node=rpn, device="cpu")
ds = load_dataset("digits", None, seed)
batches = ShardedBatches(ds, comm.rank, comm.size, batch, seed)
torch.manual_seed(seed)
model = models.build_model("digits_cnn", ds.num_classes, ds.input_shape)
torch.manual_seed(seed * 100003 + comm.rank)
opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=1e-4)
options = {"lsgd": dict(tau_local=4, tau_global=8), "easgd": dict(easgd_tau=4),
           "local-sgd": dict(local_steps=8), "allreduce": dict(bucket_mb=1.0),
           "gossip": dict(topology="ring")}[algorithm]


class Rows:
    def __init__(self):
        self.leader = []

    def log(self, group, **row):
        if group == "leader":
            self.leader.append([row["step"], row["scope"], row["leader_rank"]])


rows = Rows()
method = lsgd_hpc.METHODS[algorithm](model, opt, comm, max_steps=steps, metrics=rows, **options)
losses = []
while not method.done:
    for x, y in batches.batches(method.steps // batches.steps_per_epoch,
                                method.steps % batches.steps_per_epoch):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        method.step(loss)
        losses.append(float(loss))
        if method.done:
            break
everything = comm.allgather_object({"losses": losses, "leader": rows.leader})
if comm.rank == 0:
    with open(out, "w") as fh:
        json.dump(everything, fh)
