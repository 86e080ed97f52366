"""The public library API in a user's own loop, at any world size (size 1 under plain pytest,
2/4/5 ranks under mpirun through tests/test_parallel_mpi.py).

Each rank trains on its own data (seeded by rank), so gradients differ between ranks and
anything that is not averaged shows up as a difference between replicas.
"""

import hashlib
import math

import pytest
import torch
from torch import nn

import lsgd_hpc
from lsgd_hpc.methods import METHODS


def digest(model: nn.Module) -> str:
    h = hashlib.blake2b(digest_size=16)
    for t in list(model.parameters()) + list(model.buffers()):
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Net(nn.Module):
    """A small model with a frozen parameter, tied weights and BatchNorm."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(10, 16, bias=False)
        self.bn = nn.BatchNorm1d(16)
        self.hidden = nn.Linear(16, 16)
        self.frozen = nn.Parameter(torch.ones(16), requires_grad=False)

    def forward(self, x):
        h = torch.relu(self.bn(self.emb(x)) * self.frozen)
        h = torch.relu(self.hidden(h))
        return h @ self.emb.weight              # tied: the embedding decodes too


def rank_data(rank: int, n: int = 64):
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + 2 * (x[:, 3] > 0).long()
    return x, y


def test_allreduce_replicas_bit_identical_with_everything(comm):
    """zero_grad (to None), AdamW with two parameter groups, clipping after synchronize,
    accumulation over 3 microbatches and bf16 autocast: every replica stays bit-identical."""
    torch.manual_seed(comm.rank)           # different x_0 per rank: the method must broadcast
    model = Net()
    opt = torch.optim.AdamW([{"params": [model.emb.weight], "lr": 3e-3},
                             {"params": list(model.hidden.parameters()) +
                              list(model.bn.parameters()), "lr": 1e-3}], weight_decay=0.01)
    method = lsgd_hpc.AllreduceSGD(model, opt, comm, check_replicas_every=5)
    x, y = rank_data(comm.rank)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(12):
        opt.zero_grad()                    # set_to_none: backward makes new .grad tensors
        for k in range(3):                 # accumulation
            xb, yb = x[k * 16:(k + 1) * 16], y[k * 16:(k + 1) * 16]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_fn(model(xb), yb) / 3
            loss.backward()
        method.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        method.step(loss)
    assert model.frozen.grad is None and torch.equal(model.frozen, torch.ones(16))
    digests = comm.allgather_object(digest(model))
    assert len(set(digests)) == 1, digests
    assert method.steps == 12


def test_allreduce_buckets_with_no_sync_and_fresh_grads(comm):
    """Overlapped buckets: accumulation through no_sync(), zero_grad to None; replicas equal
    and equal to the unbucketed run."""
    results = []
    for bucket_mb in (0.0, 0.0005):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                              nn.Linear(32, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        method = lsgd_hpc.AllreduceSGD(model, opt, comm, bucket_mb=bucket_mb)
        x, y = rank_data(comm.rank)
        for step in range(6):
            opt.zero_grad()
            with method.no_sync():
                nn.functional.cross_entropy(model(x[:32]), y[:32]).backward()
            loss = nn.functional.cross_entropy(model(x[32:]), y[32:])
            loss.backward()
            method.step(loss)
        method.check_replicas()
        method.close()
        results.append(torch.cat([p.detach().view(-1) for p in model.parameters()]))
    # bucketed and unbucketed means differ at most in summation order of the same floats
    assert torch.allclose(results[0], results[1], atol=1e-6)


def test_replica_divergence_is_caught_on_every_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to diverge")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    method = lsgd_hpc.AllreduceSGD(model, opt, comm, check_replicas_every=2)
    for step in range(2):
        opt.zero_grad()
        loss = model(torch.ones(3, 4)).sum()
        loss.backward()
        if step == 1 and comm.rank == comm.size - 1:
            with torch.no_grad():
                model.weight.add_(1.0)     # a user's mistake on one rank
        if step == 1:
            with pytest.raises(RuntimeError, match="replicas diverged by step 2"):
                method.step(loss)
        else:
            method.step(loss)


def test_model_on_two_dtypes_refused_on_every_rank(comm):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if comm.rank == comm.size - 1:         # only one rank's model is wrong
        model[1].double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as info:
        lsgd_hpc.LeaderSGD(model, opt, comm, tau_local=2, tau_global=2)
    msg = str(info.value)
    assert "mixes parameter/buffer dtypes" in msg
    assert comm.allgather_object(msg) == [msg] * comm.size   # the same one line everywhere


def test_bad_option_raises_naming_it(comm):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="tau_global must be a multiple of tau_local"):
        lsgd_hpc.LeaderSGD(model, opt, comm, tau_local=4, tau_global=6)
    with pytest.raises(ValueError, match="pull_global"):
        lsgd_hpc.LeaderSGD(model, opt, comm, pull_global=2.0)
    with pytest.raises(ValueError, match="unknown option"):
        lsgd_hpc.LocalSGD(model, opt, comm, tau=3)
    with pytest.raises(ValueError, match="optimizer holds 1 tensor"):
        lsgd_hpc.EASGD(model, torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1), comm)
    with pytest.raises(ValueError, match="max_steps is required"):
        lsgd_hpc.AsyncLeaderSGD(model, opt, comm)


OPTIONS = {"lsgd": dict(tau_local=2, tau_global=4), "lsgd-async": dict(tau_local=2, tau_global=4),
           "allreduce": {}, "easgd": dict(easgd_tau=2), "local-sgd": dict(local_steps=4),
           "gossip": dict(topology="ring"), "diloco": dict(local_steps=4, outer_lr=0.7),
           "slowmo": dict(local_steps=2, slowmo_every=8)}


def heavy(comm) -> None:
    """Training bodies run at 1 rank (plain pytest) and at 4 ranks as 2 nodes, the layout the
    library is tested on; at 2 and 5 ranks the cheaper bodies cover the collectives."""
    if comm.size not in (1, 4):
        pytest.skip("training bodies run at 1 and 4 ranks (suite time); this is "
                    f"{comm.size}")


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_method_trains_the_users_model(comm, name):
    """The same user loop for every method: it ends when ``method.done`` says so (the
    asynchronous method's ranks take uneven steps) and the reported model learns the task."""
    heavy(comm)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    method = METHODS[name](model, opt, comm, max_steps=60, consensus_every=10, **OPTIONS[name])
    x, y = rank_data(comm.rank, 256)
    while not method.done:
        for i in range(0, 256, 32):
            loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            opt.zero_grad()
            loss.backward()
            method.step(loss)
            if method.done:
                break
    xt, yt = rank_data(10_000, 512)       # held-out data, the same on every rank
    with method.reported_model() as m, torch.no_grad():
        acc = float((m(xt).argmax(1) == yt).float().mean())
    assert acc > 0.8, (name, acc)
    steps = comm.allgather_object(method.steps)
    if name == "lsgd-async":
        assert sum(steps) >= 60 * comm.size
    else:
        assert steps == [60] * comm.size


@pytest.mark.parametrize("name", ["lsgd", "easgd", "local-sgd", "diloco", "slowmo"])
def test_state_dict_resumes_exactly(comm, name):
    """Training 8 steps, saving, training 8 more equals restoring the saved state into a
    fresh model/optimizer/method and training the same 8 steps."""
    def fresh():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        return model, opt, METHODS[name](model, opt, comm, **OPTIONS[name])

    x, y = rank_data(comm.rank, 128)

    def train(model, opt, method, steps):
        for i in range(steps):
            s = (method.steps % 8) * 16
            loss = nn.functional.cross_entropy(model(x[s:s + 16]), y[s:s + 16])
            opt.zero_grad()
            loss.backward()
            method.step(loss)

    model, opt, method = fresh()
    train(model, opt, method, 7)
    saved = {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
             if k == "model" else v
             for k, v in (("model", model.state_dict()), ("opt", opt.state_dict()),
                          ("method", method.state_dict()))}
    import copy
    saved = copy.deepcopy(saved)
    train(model, opt, method, 9)
    model2, opt2, method2 = fresh()
    model2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    method2.load_state_dict(saved["method"])
    train(model2, opt2, method2, 9)
    assert method2.steps == method.steps == 16
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_fp16_grad_scaler_skipped_steps_counted(comm):
    """fp16 with a GradScaler through method.step(loss, scaler=...): an overflow step is
    skipped on every rank alike (the averaged gradient holds the inf) and counted."""
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # the test writes a gradient after backward: without buckets (with them that write
    # would race the averaging in flight; see test_allreduce_replicas_bit_identical...)
    method = lsgd_hpc.AllreduceSGD(model, opt, comm, bucket_mb=0.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    loss = model(torch.ones(2, 4)).sum()
    scaler.scale(loss).backward()
    if comm.rank == 0:
        model.weight.grad[0, 0] = math.inf        # overflow on one rank only
    method.step(loss, scaler=scaler)
    assert method.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    opt.zero_grad()
    loss = model(torch.ones(2, 4)).sum()
    scaler.scale(loss).backward()
    method.step(loss, scaler=scaler)
    assert method.skipped_steps == 1
    assert not torch.equal(before[0], model.weight)
    assert len(set(comm.allgather_object(digest(model)))) == 1


def test_bfloat16_allreduce_and_broadcast(comm):
    """A bfloat16 sum is the same bits on every rank and within bfloat16 rounding of the
    float32 sum (the MPI backend's own sum: MPI has no bfloat16; Horovod's reduce-scatter
    and allgather of the words, summed in rank order)."""
    world = comm.world
    g = torch.Generator().manual_seed(world.rank)
    x = torch.randn(1000, generator=g)
    exact = x.clone()
    world.allreduce_(exact, "sum")
    low = x.to(torch.bfloat16)
    before = world.stats.bytes_sent
    world.allreduce_(low, "sum")
    if world.size > 1:
        assert world.stats.bytes_sent - before == 2000
    assert len(set(comm.allgather_object(digest_tensor(low)))) == 1
    # each of the size-1 additions rounds once (relative 2^-8)
    tol = 2 ** -8 * world.size * exact.abs().max().item() + 1e-6
    assert (low.float() - exact).abs().max().item() <= tol
    b = torch.full((300,), float(world.rank) + 0.123, dtype=torch.bfloat16)
    world.broadcast_(b, 0)
    assert torch.equal(b, torch.full((300,), 0.123, dtype=torch.bfloat16))


def digest_tensor(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


@pytest.mark.parametrize("name", ["lsgd", "allreduce", "easgd", "local-sgd", "diloco", "gossip"])
def test_comm_dtype_bf16_halves_the_bytes_and_still_trains(comm, name):
    if comm.size == 1:
        pytest.skip("needs two ranks to send anything")
    heavy(comm)
    sent = {}
    for dtype in ("fp32", "bf16"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        method = METHODS[name](model, opt, comm, max_steps=40, comm_dtype=dtype,
                               **OPTIONS[name])
        x, y = rank_data(comm.rank, 256)
        s0 = comm.stats.bytes_sent
        while not method.done:
            i = (method.steps % 8) * 32
            loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
            opt.zero_grad()
            loss.backward()
            method.step(loss)
        sent[dtype] = comm.stats.bytes_sent - s0
        xt, yt = rank_data(10_000, 512)
        with method.reported_model() as m, torch.no_grad():
            acc = float((m(xt).argmax(1) == yt).float().mean())
        assert acc > 0.75, (name, dtype, acc)
        method.close()
    total = comm.allgather_object(sent)
    fp32, bf16 = sum(t["fp32"] for t in total), sum(t["bf16"] for t in total)
    # model traffic halves; elections and scalars (a few bytes) do not
    assert 0.45 <= bf16 / fp32 <= 0.56, (name, fp32, bf16)
