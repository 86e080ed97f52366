"""Multi-leader LSGD between workers smaller than a node, under mpirun: 6 ranks on nodes of 4
and 2 ranks (--ranks-per-node 4), workers of 2 ranks: two workers on the first node, one on
the second. Local elections run between the workers of a node, global ones between all
workers; leaders are named by their workers' first ranks; a worker stays one replica."""

import sys

import pytest

from mpi_util import run_mpi

SCRIPT = r"""
import hashlib, torch
from torch import nn
import lsgd_hpc
comm = lsgd_hpc.init(backend=BACKEND, ranks_per_node=4, device="cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
rows = []
sink = type("Sink", (), {"log": staticmethod(lambda g, **row: rows.append((g, row)))})
method = lsgd_hpc.LeaderSGD(model, opt, comm, tau_local=2, tau_global=4, worker_ranks=2,
                            consensus_every=2, metrics=sink, pull_delay=PULL_DELAY)
assert method.rule.multi_level and method.world.size == 3 and method.groups.n_nodes == 2
g = torch.Generator().manual_seed(comm.rank)
for step in range(8):
    x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    method.step(loss)
method.drain()
h = hashlib.md5(b"".join(t.detach().numpy().tobytes() for t in model.state_dict().values()
                         if t.is_floating_point())).hexdigest()
seen = comm.allgather_object((h, [(r["step"], r["scope"], r["leader_rank"])
                                  for g_, r in rows if g_ == "leader"]))
worker = [0, 0, 1, 1, 2, 2]
for r, (hr, el) in enumerate(seen):
    assert hr == seen[r - r % 2][0], ("worker", r)          # one replica per worker
    assert el == seen[r - r % 2][1], ("elections", r)
    local = [l for s, sc, l in el if sc == 1]
    glob = [l for s, sc, l in el if sc == 0]
    assert len(local) == 4 and len(glob) == 2, el
    assert all(l in (0, 2, 4) for l in local + glob), el        # first ranks of workers
    node = 0 if r < 4 else 1
    assert all((l < 4) == (node == 0) for l in local), el      # a leader of its own node
assert len({h for h, _ in seen}) > 1                          # workers are not one model
if comm.rank == 0:
    print("MULTI_OK", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("backend,pull_delay", [("mpi", 0), ("torch", 1)])
def test_multi_leader_lsgd_between_the_workers_of_a_node_and_across_nodes(tmp_path, backend,
                                                                          pull_delay):
    """(with the torch backend, the leader's broadcasts land one step late: --pull-delay 1,
    posted stage by stage through the workers' node hierarchy)"""
    script = tmp_path / "multi.py"
    script.write_text(SCRIPT.replace("BACKEND", repr(backend))
                      .replace("PULL_DELAY", str(pull_delay)))
    proc = run_mpi(6, [sys.executable, str(script)], timeout=300)
    assert "MULTI_OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
