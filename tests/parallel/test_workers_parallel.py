"""Workers that span ranks (worker_ranks = K or "node"), at any world size and node layout
(size 1 under plain pytest; 2, 4 and 5 ranks under mpirun through tests/test_parallel_mpi.py,
ranks grouped K per node). A body that needs a layout it does not have skips.

Each rank trains on its own data (seeded by rank): anything not averaged inside a worker shows
up as a difference between the ranks of a worker.
"""

import hashlib

import pytest
import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.comm.workers import worker_layout, worker_layout_problem

CASES = {
    "lsgd": ("lsgd", dict(tau_local=2, tau_global=4)),
    "lsgd-pull-delay": ("lsgd", dict(tau_local=2, tau_global=4, pull_delay=1)),
    "easgd": ("easgd", dict(easgd_tau=2)),
    "local-sgd": ("local-sgd", dict(local_steps=3)),
    "diloco": ("diloco", dict(local_steps=3)),
    "streaming-diloco": ("diloco", dict(local_steps=4, fragments=2, fragment_sync_delay=1)),
    "slowmo": ("slowmo", dict(local_steps=2, slowmo_every=4)),
    "gossip": ("gossip", dict(topology="ring")),
    "allreduce": ("allreduce", dict()),
}


def digest(model: nn.Module) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in list(model.parameters()) + list(model.buffers()):
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def net(batchnorm: bool = True) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(10, 16)] + ([nn.BatchNorm1d(16)] if batchnorm else []) + \
        [nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*layers)


def batches(rank: int, n: int, size: int = 8):
    g = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randn(size, 10, generator=g), torch.randint(0, 4, (size,), generator=g))
            for _ in range(n)]


def layout_or_skip(comm, worker_ranks):
    problem = worker_layout_problem(comm.groups.node_of, worker_ranks)
    if problem:
        pytest.skip(f"worker_ranks={worker_ranks} does not fit this layout: {problem}")
    return worker_layout(comm.groups.node_of, worker_ranks)


def train(method, model, opt, data, zero_to_none=True):
    for x, y in data:
        if zero_to_none:
            opt.zero_grad()             # .grad to None: backward makes new tensors
        else:
            method.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        method.step(loss)


def by_worker(comm, layout, value):
    """{worker: [value of each of its ranks]} from every rank's value."""
    out = {}
    for r, v in enumerate(comm.allgather_object(value)):
        out.setdefault(layout.worker_of[r], []).append(v)
    return out


@pytest.mark.parametrize("worker_ranks", ["node", 2])
@pytest.mark.parametrize("case", list(CASES))
def test_every_method_trains_between_workers_and_a_worker_stays_one_replica(comm, case,
                                                                           worker_ranks):
    layout = layout_or_skip(comm, worker_ranks)
    name, options = CASES[case]
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    method = lsgd_hpc.METHODS[name](model, opt, comm, worker_ranks=worker_ranks,
                                    consensus_every=3, **options)
    train(method, model, opt, batches(comm.rank, 8))
    assert method.steps == 8
    method.drain()
    for worker, digests in by_worker(comm, layout, digest(model)).items():
        assert len(set(digests)) == 1, (case, worker, digests)
    if name == "allreduce":             # one replica over every rank: a no-op grouping
        assert method.workers is None and method.worker_stats is None
    else:
        assert method.workers.n_workers == layout.n_workers
        assert method.world.size == layout.n_workers
    method.close()


def test_dilocos_worker_of_a_node_is_one_rank_with_the_nodes_batches_together(comm):
    """DiLoCo with one worker per node of 2 ranks equals, bit for bit, DiLoCo on one rank
    per node whose minibatch is the node's two minibatches together (its gradient the mean of
    the two minibatch gradients, summed in the same order), after several outer steps."""
    sizes = [comm.groups.node_of.count(n) for n in range(comm.n_nodes)]
    if set(sizes) != {2}:
        pytest.skip("needs nodes of 2 ranks")
    steps, H = 9, 3

    def build(c, wr):
        model = net(batchnorm=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
        return model, opt, lsgd_hpc.DiLoCo(model, opt, c, local_steps=H, outer_lr=0.7,
                                          worker_ranks=wr)

    model, opt, method = build(comm, "node")
    data = batches(comm.rank, steps)
    train(method, model, opt, data)
    mine = torch.cat([p.detach().view(-1) for p in model.parameters()])
    method.close()
    # the reference: the nodes' first ranks, one rank per node, each with its node's batches
    first = comm.groups.local_rank == 0
    # (Horovod cannot form process sets inside a sub-communicator: the reference runs on
    # the MPI side of Horovod's world there; two workers' sums are the same either way)
    world, backend = ((comm.world._mpi, "mpi") if comm.backend == "horovod"
                      else (comm.world, comm.backend))
    sub = world.split(0 if first else -1)
    if first:
        from lsgd_hpc.comm import NodeGroups
        from lsgd_hpc.session import Comm
        ref_comm = Comm(sub, NodeGroups.build(sub, 1), comm.device, backend)
        model, opt, ref = build(ref_comm, 1)
        ours, mate = data, batches(comm.rank + 1, steps)
        for (x0, y0), (x1, y1) in zip(ours, mate):
            opt.zero_grad()
            loss0 = nn.functional.cross_entropy(model(x0), y0)
            loss0.backward()
            nn.functional.cross_entropy(model(x1), y1).backward()     # accumulates g0 + g1
            for p in model.parameters():
                p.grad.div_(2)
            ref.step(loss0)
        theirs = torch.cat([p.detach().view(-1) for p in model.parameters()])
        ref.close()
        assert ref.rule.outer_steps == steps // H
        assert torch.equal(mine, theirs), (mine - theirs).abs().max()
    comm.barrier()


def test_worker_traffic_is_the_gradient_every_step_and_the_methods_apart(comm):
    """worker_bytes: the gradient's allreduce every step, plus the outer step's result spread
    by the representative; comm bytes: the outer step's allreduce, on representatives only."""
    layout = layout_or_skip(comm, "node")
    model = net(batchnorm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    flat_bytes = sum(p.numel() for p in model.parameters()) * 4
    s0, steps, H = comm.stats.snapshot(), 8, 4
    method = lsgd_hpc.DiLoCo(model, opt, comm, local_steps=H, worker_ranks="node")
    w0 = method.worker_stats.snapshot()
    train(method, model, opt, batches(comm.rank, steps))
    ws, k = method.worker_stats, method.workers.size
    rep, outer, many = method.workers.is_representative, steps // H, layout.n_workers > 1
    grads = steps * flat_bytes if k > 1 else 0        # (no buffers: gradient = flat bytes)
    spread = outer * flat_bytes if k > 1 and many else 0
    assert ws.bytes_sent - w0.bytes_sent == grads + (spread if rep else 0)
    assert ws.bytes_recv - w0.bytes_recv == grads + (0 if rep else spread)
    between = outer * flat_bytes if rep and many else 0
    assert comm.stats.bytes_sent - s0.bytes_sent == between
    assert comm.stats.bytes_recv - s0.bytes_recv == between
    cols = method.rule.train_columns()
    assert cols["worker_bytes_sent"] == ws.bytes_sent
    attrs = method.rule.file_attrs
    assert attrs == {"worker_index": layout.worker_of[comm.rank], "worker_size": k,
                     "n_workers": layout.n_workers}
    assert {"worker_bytes_sent", "worker_bytes_recv", "worker_seconds"} <= \
        set(method.rule.extra_columns["train"])
    method.close()


def test_replicas_stay_identical_with_bf16_clipping_accumulation_and_checks(comm):
    """Inside a worker: zero_grad to None, accumulation through no_sync, clipping after
    synchronize, bf16 between workers, the periodic digest check: one replica per worker."""
    layout = layout_or_skip(comm, "node")
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    method = lsgd_hpc.SlowMo(model, opt, comm, local_steps=2, slowmo_every=4,
                             worker_ranks="node", comm_dtype="bf16")
    method.rule.check_every = 3
    data = batches(comm.rank, 12)
    for i in range(6):
        opt.zero_grad()
        with method.no_sync():
            nn.functional.cross_entropy(model(data[2 * i][0]), data[2 * i][1]).backward()
        loss = nn.functional.cross_entropy(model(data[2 * i + 1][0]), data[2 * i + 1][1])
        loss.backward()
        method.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        method.step(loss)
    for digests in by_worker(comm, layout, digest(model)).values():
        assert len(set(digests)) == 1
    method.close()


def test_a_diverged_rank_is_caught_inside_its_worker(comm):
    layout = layout_or_skip(comm, "node")
    big = [w for w in range(layout.n_workers) if len(layout.members(w)) > 1]
    if not big:
        pytest.skip("needs a worker of two ranks")
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    method = lsgd_hpc.LocalSGD(model, opt, comm, local_steps=4, worker_ranks="node")
    train(method, model, opt, batches(comm.rank, 2))
    victim = layout.members(big[0])[-1]
    if comm.rank == victim:
        with torch.no_grad():
            model[0].weight.add_(1.0)               # a user's mistake on one rank
    if layout.worker_of[comm.rank] == big[0]:
        with pytest.raises(RuntimeError, match=f"worker {big[0]}: its replicas diverged"):
            method.rule.check_replicas(2)
    else:
        method.rule.check_replicas(2)
    method.close()
    comm.barrier()


def test_a_workers_score_is_the_mean_of_its_ranks(comm):
    """LSGD between workers: rank 0 has the lowest loss of all, but its worker's mean is
    not the lowest: the leader is the worker with the lowest mean, named by its first rank."""
    layout = layout_or_skip(comm, "node")
    if layout.n_workers < 2 or len(layout.members(0)) < 2:
        pytest.skip("needs two workers, the first of two ranks")
    losses = [5.0] * comm.size
    losses[0] = 0.1                         # the best rank, in a bad worker
    for r in layout.members(1):
        losses[r] = 1.0                     # the best worker
    rows = []
    model = net(batchnorm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    method = lsgd_hpc.LeaderSGD(model, opt, comm, tau_local=2, tau_global=2,
                                worker_ranks="node")
    method.set_metrics(type("M", (), {"log": staticmethod(lambda g, **row: rows.append(row))}))
    for _ in range(2):
        method.zero_grad()
        method.step(losses[comm.rank])
    assert [r["leader_rank"] for r in rows] == [layout.first[1]]
    assert method.rule.last_global.world_rank == layout.first[1]
    assert method.rule.last_global.score == pytest.approx(1.0)
    with method.reported_model():
        pass
    method.close()


def test_gossip_runs_over_the_workers_graph(comm):
    layout = layout_or_skip(comm, "node")
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    method = lsgd_hpc.GossipSGD(model, opt, comm, topology="ring", worker_ranks="node")
    assert method.rule.topology.n == layout.n_workers
    method.close()


def test_a_grouping_that_does_not_fit_is_refused_alike_everywhere(comm):
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    bad = next(k for k in range(2, 64) if worker_layout_problem(comm.groups.node_of, k))
    with pytest.raises(ValueError, match=f"worker_ranks must divide .*worker_ranks={bad}"):
        lsgd_hpc.DiLoCo(model, opt, comm, worker_ranks=bad)
    for wrong in (0, "nodes", 1.5, True):
        with pytest.raises(ValueError, match="worker_ranks must be an integer >= 1 or node"):
            lsgd_hpc.LocalSGD(model, opt, comm, worker_ranks=wrong)
    with pytest.raises(ValueError, match="worker_ranks is not supported by lsgd-async"):
        lsgd_hpc.AsyncLeaderSGD(model, opt, comm, max_steps=4, worker_ranks="node")
    comm.barrier()                          # nobody was left in a collective


def test_allreduce_with_workers_is_plain_allreduce(comm):
    """A no-op grouping: the same bits as worker_ranks=1."""
    out = []
    for wr in (1, "node"):
        model = net()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        method = lsgd_hpc.AllreduceSGD(model, opt, comm, worker_ranks=wr)
        train(method, model, opt, batches(comm.rank, 4))
        out.append(digest(model))
        method.close()
    assert out[0] == out[1]
