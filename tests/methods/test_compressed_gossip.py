"""Compressed gossip (CHOCO-SGD, lsgd_hpc.methods.rules.gossip): the rule's maths in one
process, n ranks as threads over an in-memory neighbour exchange; and one short 4-rank
training job over MPI.

In one process: the public copies of a rank are the same bits on every rank that holds them;
the mean of x is kept (W doubly stochastic); the consensus distance shrinks on a ring and on
a time-varying graph; an exact C with gamma 1 is plain gossip; each exchange counts the
codec's payload per neighbour; a checkpoint of the copies resumes bit for bit, one of another
graph restarts them; the options are refused where they mean nothing."""

import sys
import threading
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch

from lsgd_hpc.comm.base import CommStats
from lsgd_hpc.comm.flat import FlatParams
from lsgd_hpc.comm.quantized import layout
from lsgd_hpc.comm.sparse import sparse_layout
from lsgd_hpc.methods import METHODS
from lsgd_hpc.methods.rules.gossip import ChocoCodec, GossipRule, choco_gamma
from lsgd_hpc.methods.spec import OptionError, comm_dtype_problem, topk_problem
from lsgd_hpc.topology import build_topology
from mpi_util import REPO, run_mpi

N = 5000          # elements per rank: two blocks of the dense codec, two chunks of top-k


class Exchange:
    """An in-memory neighbour allgather between threads (one per rank)."""

    def __init__(self, n: int):
        self.n, self.box, self.barrier = n, [None] * n, threading.Barrier(n)


class ThreadWorld:
    """The part of a communicator a GossipRule uses: rank, size, stats, neighbor_allgather."""

    def __init__(self, hub: Exchange, rank: int):
        self.hub, self.rank, self.size, self.stats = hub, rank, hub.n, CommStats()
        self.calls = []

    def agree_buffers(self, *tensors):
        pass

    def neighbor_allgather(self, tensor, sources, destinations, out=None, graph_key=None):
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.bytes_sent += nbytes * len(destinations)
        self.stats.bytes_recv += nbytes * len(sources)
        self.calls.append((tensor.dtype, graph_key))
        self.hub.box[self.rank] = tensor.clone()
        self.hub.barrier.wait()
        for k, j in enumerate(sources):
            out[k].copy_(self.hub.box[j])
        self.hub.barrier.wait()
        return out


def vectors(n: int, seed: int = 0) -> torch.Tensor:
    """n different starting points, magnitudes varying along the vector."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, N, generator=g) * torch.linspace(0.1, 3.0, N)


def make_rules(x0: torch.Tensor, topology: str, **kw):
    n = x0.shape[0]
    hub = Exchange(n)
    rules = []
    for r in range(n):
        model = torch.nn.Linear(N, 1, bias=False)
        flat = FlatParams(model)
        flat.flat.copy_(x0[r])
        groups = SimpleNamespace(world=ThreadWorld(hub, r), node_of=[0] * n)
        rules.append(GossipRule(groups, flat, build_topology(topology, n), **kw))
    return rules


def run(rules, steps: int, first: int = 1, each=None) -> torch.Tensor:
    """``steps`` combines on every rank (threads), steps first..; returns the stacked x."""
    errors = []

    def go(rule):
        try:
            for s in range(first, first + steps):
                rule.after_step(s, 0.0)
                if each is not None:
                    each(rule, s)
        except BaseException as exc:           # noqa: BLE001 (reported below)
            errors.append(exc)
            rule.world.hub.barrier.abort()
    threads = [threading.Thread(target=go, args=(r,)) for r in rules]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return torch.stack([r.flat.flat.detach().clone() for r in rules])


def consensus(x: torch.Tensor) -> float:
    return float((x.double() - x.double().mean(0)).pow(2).sum(1).mean())


def assert_copies_agree(rules):
    """Rank i's copy of x^_j is rank j's own x^_j, bit for bit."""
    for r in rules:
        for k, j in enumerate(r.sources):
            assert torch.equal(r.copies[k], rules[j].public), (r.world.rank, j)


COMPRESSORS = [("int8", 1.0), ("fp8", 1.0), ("int4", 1.0), ("int2", 1.0), ("fp32", 0.1),
               ("bf16", 0.1), ("int8", 0.05)]


@pytest.mark.parametrize("kind,topk", COMPRESSORS,
                         ids=[f"{k}-topk{t:g}" for k, t in COMPRESSORS])
def test_consensus_shrinks_on_a_ring_and_keeps_the_mean(kind, topk):
    x0 = vectors(8)
    rules = make_rules(x0, "ring", comm_dtype=kind, topk=topk)
    x = run(rules, 60)
    assert consensus(x) < 0.02 * consensus(x0)
    assert torch.allclose(x.double().mean(0), x0.double().mean(0), atol=1e-5)
    assert_copies_agree(rules)


def test_time_varying_topology_exchanges_over_the_union():
    """one-peer-exponential at 8 ranks: one peer a step (period 3), copies of the union (3
    peers), every one advanced every step, the step's peer mixed in."""
    x0 = vectors(8, seed=1)
    rules = make_rules(x0, "one-peer-exponential", comm_dtype="int8")
    topo = rules[0].topology
    assert topo.period == 3 and len(rules[0].sources) == 3
    x = run(rules, 30)
    assert consensus(x) < 0.02 * consensus(x0)
    assert torch.allclose(x.double().mean(0), x0.double().mean(0), atol=1e-5)
    assert_copies_agree(rules)


class Exact(ChocoCodec):
    """C = identity: float32 bytes."""

    def __init__(self, n):
        self.n, self.wire, self.counted = n, 4 * n, 4 * n

    def encode(self, v, out):
        out.copy_(v.contiguous().view(torch.uint8))
        return out

    def decode(self, message):
        return message.view(torch.float32).clone()


def test_exact_compression_with_gamma_one_is_plain_gossip():
    x0 = vectors(6, seed=2)
    choco = make_rules(x0, "torus", comm_dtype="int8", gamma=1.0)
    for r in choco:
        r.codec = Exact(N)
        r._choco_graph()
    plain = make_rules(x0, "torus")
    assert not plain[0].compressed
    assert torch.allclose(run(choco, 10), run(plain, 10), rtol=0, atol=1e-5)


def test_counted_bytes_are_the_codecs_payload():
    """Step 1: one float32 exchange (the exact copies) and one message a neighbour; then the
    message only: ceil(n bits / 8) + 4 per block for int8, the top-k records for top-k."""
    for kind, topk, counted in (("int8", 1.0, layout(N, 1, kind="int8").counted),
                                ("int2", 0.1, sparse_layout(N, 0.1, "int2").counted)):
        rules = make_rules(vectors(4), "ring", comm_dtype=kind, topk=topk)
        per_step = []
        run(rules, 3, each=lambda r, s: per_step.append(
            (r.world.rank, s, r.world.stats.bytes_sent, r.world.stats.bytes_recv)))
        for rank, s, sent, recv in per_step:
            want = 2 * counted * s + (2 * 4 * N)          # ring: 2 neighbours
            assert (sent, recv) == (want, want), (kind, rank, s)
        assert counted < 0.26 * 4 * N      # about a quarter of float32's 4 N, or less
        assert rules[0].world.calls[0] == (torch.float32, ("ring", 0, "choco"))
        assert all(dt == torch.uint8 for dt, _ in rules[0].world.calls[1:])


def test_default_gamma():
    assert choco_gamma("int8") == choco_gamma("fp8") == 1.0
    assert choco_gamma("int2") < choco_gamma("int4") < 1.0
    assert choco_gamma("fp32", 0.01) == pytest.approx(0.04)
    assert make_rules(vectors(2), "ring", comm_dtype="int4", gamma=0.3)[0].gamma == 0.3


def test_checkpoint_resumes_bit_for_bit_and_another_graph_restarts():
    x0 = vectors(4, seed=3)
    straight = run(make_rules(x0, "ring", comm_dtype="int4"), 8)
    first = make_rules(x0, "ring", comm_dtype="int4")
    run(first, 4)
    saved = [(r.flat.flat.clone(), r.state_dict()) for r in first]
    again = make_rules(x0, "ring", comm_dtype="int4")
    for r, (x, state) in zip(again, saved):
        r.flat.flat.copy_(x)
        r.load_state_dict(state)
        assert r.public is not None
    assert torch.equal(run(again, 4, first=5), straight)
    other = make_rules(x0, "complete", comm_dtype="int4")      # other graph: restart
    for r, (x, state) in zip(other, saved):
        r.load_state_dict(state)
        assert r.public is None
    plain = make_rules(x0, "ring")
    assert plain[0].state_dict() == {}


def test_plain_gossip_sends_float32_parameters():
    rules = make_rules(vectors(4), "ring", comm_dtype="bf16")
    assert not rules[0].compressed
    run(rules, 2)
    assert all(dt == torch.float32 and key == ("ring", 0) for dt, key in rules[0].world.calls)


def test_options_accepted_and_refused():
    assert comm_dtype_problem("int8", "mpi", "gossip") is None
    assert topk_problem(0.01, "fp32", "mpi", "gossip") is None
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gossip = METHODS["gossip"]
    opts = gossip.check(model, opt, world_size=4, comm_dtype="int2", gossip_gamma=0.3)
    assert opts["gossip_gamma"] == 0.3
    gossip.check(model, opt, world_size=4, comm_dtype="int8", error_feedback=True)
    with pytest.raises(OptionError, match="gossip_gamma needs --comm-dtype int8"):
        gossip.check(model, opt, world_size=4, gossip_gamma=0.5)
    with pytest.raises(OptionError, match="gossip_gamma must be in"):
        gossip.check(model, opt, world_size=4, comm_dtype="int8", gossip_gamma=1.5)
    with pytest.raises(OptionError, match="CHOCO's public copies"):
        gossip.check(model, opt, world_size=4, comm_dtype="int8", error_feedback=True,
                     error_feedback_decay=0.5)


# -- four ranks over MPI ----------------------------------------------------------------------
#: one training job per wire format, then the mean of x before and after one more combine
DRIVER = r'''
import json, sys
import torch
import torch.nn.functional as F
import lsgd_hpc

torch.set_num_threads(1)
torch.manual_seed(0)
kind, topk, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
comm = lsgd_hpc.init(device="cpu")
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
method = lsgd_hpc.GossipSGD(model, opt, comm, topology="ring", comm_dtype=kind, topk=topk,
                            max_steps=20)
g = torch.Generator().manual_seed(comm.rank)
x, y = torch.randn(640, 64, generator=g), torch.randint(0, 10, (640,), generator=g)
losses = []
while not method.done:
    i = method.steps % 20
    loss = F.cross_entropy(model(x[32 * i:32 * i + 32]), y[32 * i:32 * i + 32])
    opt.zero_grad()
    loss.backward()
    method.step(loss)
    losses.append(loss.item())
sent = comm.stats.bytes_sent
flat = method.flat.flat
mean0 = flat.detach().clone().double()
comm.world.allreduce_(mean0, "mean")
method.rule.combine(method.steps + 1)              # one more exchange: the mean is kept
mean1 = flat.detach().clone().double()
comm.world.allreduce_(mean1, "mean")
if comm.rank == 0:
    json.dump({"losses": losses, "sent": sent, "n": flat.numel(),
               "mean_change": float((mean1 - mean0).abs().max()),
               "mean_scale": float(mean0.abs().max())}, open(out, "w"))
'''


@pytest.fixture(scope="module")
def mpi_runs(tmp_path_factory):
    import json
    base = tmp_path_factory.mktemp("choco")
    (base / "driver.py").write_text(DRIVER)
    out = {}
    for kind, topk in (("fp32", 1.0), ("int8", 1.0), ("int4", 0.1)):
        path = base / f"{kind}-{topk:g}.json"
        run_mpi(4, [sys.executable, str(base / "driver.py"), kind, str(topk), str(path)],
                timeout=300)
        out[(kind, topk)] = json.loads(path.read_text())
    return out


@pytest.mark.mpi
def test_four_ranks_train_in_a_fraction_of_the_bytes(mpi_runs):
    fp32 = mpi_runs[("fp32", 1.0)]
    n = fp32["n"]
    assert fp32["sent"] == 20 * 2 * 4 * n                 # ring: 2 neighbours, float32
    for (kind, topk), want in (((("int8", 1.0)), layout(n, 1, kind="int8").counted),
                               ((("int4", 0.1)), sparse_layout(n, 0.1, "int4").counted)):
        got = mpi_runs[(kind, topk)]
        assert all(np.isfinite(got["losses"]))
        assert np.mean(got["losses"][-5:]) < np.mean(got["losses"][:5])
        # step 1's exact exchange of the copies (float32), then the compressed messages
        assert got["sent"] == 2 * 4 * n + 20 * 2 * want
        assert got["sent"] < 0.4 * fp32["sent"]
        assert got["mean_change"] <= 1e-6 * max(1.0, got["mean_scale"]), (kind, got)


# -- a lost rank (on_failure="shrink", ULFM) and the full-size resume of the survivors' set ----
FT_DRIVER = str(REPO / "tests" / "drivers" / "ft_loop.py")
FT_N = 10 * 64 + 64 + 64 * 4 + 4          # the driver's MLP with --hidden 64


def ft_results(proc) -> list:
    import json
    return [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
            if line.startswith("FTRESULT ")]


def sent_per_step(run_dir, rank: int) -> dict:
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        t = f["train"]
        return dict(zip(t["step"][()].tolist(),
                        np.diff(np.concatenate([[0], t["comm_bytes_sent"][()]])).tolist()))


@pytest.mark.mpi
def test_lost_rank_and_rejoin_restart_the_copies_exactly(tmp_path):
    """int8 gossip on a ring of 4 loses rank 1 at step 5 (checkpoints every 4 steps): the 3
    survivors rebuild the ring, restart their copies by one float32 exchange at step 6 and
    finish; the full-size resume of the survivors' set at step 16 (rank 1 rejoins) restarts
    them again at step 17. Between restarts only the int8 messages travel."""
    run_dir = tmp_path / "run"
    common = [sys.executable, FT_DRIVER, "gossip", str(run_dir), "--hidden", "64",
              "--checkpoint-every", "4", "-o", "comm_dtype=int8"]
    ulfm = ["--with-ft", "ulfm"]
    res = ft_results(run_mpi(4, common + ["--steps", "16", "--kill", "1:5"], timeout=300,
                             mpi_args=ulfm))
    assert sorted(r["initial_rank"] for r in res) == [0, 2, 3]
    assert all(r["steps"] == 16 and r["finite"] and r["topology_n"] == 3 for r in res), res
    msg, exact = 2 * layout(FT_N, 1, kind="int8").counted, 2 * 4 * FT_N     # ring: 2 peers
    for r in (0, 2, 3):
        sent = sent_per_step(run_dir, r)
        assert {s for s, b in sent.items() if b > msg} == {1, 6}, (r, sent)
        assert sent[1] == sent[6] == exact + msg and sent[5] <= msg
        assert all(b == msg for s, b in sent.items() if s not in (1, 5, 6)), (r, sent)
    res = ft_results(run_mpi(4, common + ["--steps", "24", "--resume"], timeout=300,
                             mpi_args=ulfm))
    assert len(res) == 4 and all(r["after_restore"]["rejoined"] == [1] for r in res)
    assert all(r["steps"] == 24 and r["finite"] and r["topology_n"] == 4 for r in res), res
    for r in (2, 3):                 # (rank 0 also broadcasts its parameters to rank 1)
        sent = sent_per_step(run_dir, r)
        assert sent[17] == exact + msg, (r, sent)
        assert all(sent[s] == msg for s in range(18, 25)), (r, sent)
