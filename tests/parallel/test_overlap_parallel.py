"""Non-blocking allreduce and gradient buckets overlapped with backward, at any world size.

Run directly by pytest (size 1), and under `mpirun -np 2/4/5 python -m pytest` by
tests/test_parallel_mpi.py on each backend (LSGD_TEST_BACKEND).
"""

import hashlib
import os

import pytest
import torch

from lsgd_hpc.methods.rules import AllreduceRule
from lsgd_hpc.comm import CommError, FlatParams, GradBuckets, NodeGroups, make_world
from lsgd_hpc.comm.buckets import bucket_bounds
from lsgd_hpc.models.zoo import build_model


@pytest.fixture(scope="module")
def world():
    w = make_world(os.environ.get("LSGD_TEST_BACKEND", "mpi"))
    yield w
    w.barrier()


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def same_bits_everywhere(world, t: torch.Tensor) -> bool:
    return len(set(world.allgather_object(digest(t)))) == 1


# -- non-blocking allreduce ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_iallreduce_equals_allreduce(world, dtype):
    """Several in flight at once; each ends equal to the blocking allreduce, counted alike."""
    ts = [torch.arange(n, dtype=dtype) * (world.rank + 1) for n in (5, 1000, 3)]
    want = [t.clone() for t in ts]
    before = world.stats.snapshot()
    for w in want:
        world.allreduce_(w, "sum")
    mid = world.stats.snapshot()
    pending = [world.iallreduce_(t, "sum") for t in ts]
    for p in pending:
        p.test()                                       # progress, in any state
    outs = [p.wait() for p in pending]
    assert all(o is t for o, t in zip(outs, ts))
    assert all(torch.equal(t, w) for t, w in zip(ts, want))
    assert all(p.test() for p in pending)              # done stays done
    blocking = mid.bytes_sent - before.bytes_sent
    assert world.stats.bytes_sent - mid.bytes_sent == blocking
    assert world.stats.bytes_recv - mid.bytes_recv == mid.bytes_recv - before.bytes_recv
    assert world.stats.calls - mid.calls == mid.calls - before.calls
    if world.size > 1:
        assert blocking == sum(t.numel() * t.element_size() for t in ts)


def test_iallreduce_mean_is_sum_over_size(world):
    t = torch.arange(6, dtype=torch.float64) + world.rank
    world.iallreduce_(t, "mean").wait()
    assert torch.equal(t, torch.arange(6, dtype=torch.float64) + (world.size - 1) / 2)


def test_iallreduce_checks_arguments_and_sizes(world):
    with pytest.raises(CommError, match="contiguous"):
        world.iallreduce_(torch.zeros(4, 4).t())
    with pytest.raises(CommError, match="op"):
        world.iallreduce_(torch.zeros(3), "max")
    if world.size > 1:
        with pytest.raises(CommError, match="disagree"):
            world.iallreduce_(torch.zeros(4 + world.rank))
        ok = torch.ones(2)
        world.iallreduce_(ok).wait()                   # still usable afterwards
        assert ok.tolist() == [world.size] * 2


class _IallreduceSpy:
    """Forwards to an mpi4py communicator and records whether each Iallreduce ran in place."""

    def __init__(self, real):
        self.real, self.in_place = real, []

    def Iallreduce(self, send, recv, op):
        from mpi4py import MPI
        self.in_place.append(send is MPI.IN_PLACE)
        return self.real.Iallreduce(send, recv, op=op)

    def __getattr__(self, name):
        return getattr(self.real, name)


def _mpi_side(world):
    if os.environ.get("LSGD_TEST_BACKEND", "mpi") != "mpi" or world.size == 1:
        pytest.skip("the MPI backend's non-blocking allreduce, between two or more ranks")
    return world


def test_one_host_is_known_for_world_and_splits(world):
    """Launched by mpirun on this one host: world and every split of it share memory."""
    _mpi_side(world)
    assert world.one_host is True
    half = world.split(world.rank % 2)
    assert half.one_host is True
    assert len(set(world.allgather_object(world.one_host))) == 1


@pytest.mark.parametrize("one_host", [False, True])
def test_large_iallreduce_out_of_place_between_hosts(world, one_host):
    """Between hosts a large buffer goes out of place from a copy (Open MPI reduces in-place
    non-blocking allreduces through one rank), a small one and any on one host in place;
    the sum is exact either way, and a reused copy is refreshed every call."""
    from lsgd_hpc.comm.mpi import NB_SEND_COPY_MIN_BYTES
    _mpi_side(world)
    n = NB_SEND_COPY_MIN_BYTES // 4 + 3
    big, small = torch.zeros(n), torch.zeros(5)
    spy = _IallreduceSpy(world.comm)
    saved = world.comm, world.one_host
    world.comm, world.one_host = spy, one_host
    try:
        for k in range(1, 3):           # the second call reuses the kept send copy
            big.copy_(torch.arange(n, dtype=torch.float32) * (world.rank + k))
            small.fill_(world.rank + k)
            reqs = [world.iallreduce_(big, "sum", agreed=True),
                    world.iallreduce_(small, "sum", agreed=True)]
            for r in reqs:
                r.wait()
            s = sum(r + k for r in range(world.size))
            assert torch.equal(big, torch.arange(n, dtype=torch.float32) * s)
            assert small.tolist() == [s] * 5
    finally:
        world.comm, world.one_host = saved
    assert spy.in_place == [one_host, True] * 2
    if not one_host:                    # kept for the fixed buffer, not made per call
        from lsgd_hpc.comm.mpi import _buffer_key
        assert _buffer_key(big) in world._send_copies


# -- bucket plan ---------------------------------------------------------------------------
def test_bucket_bounds_cover_backwards_without_splitting():
    sizes = [10, 3, 7, 100, 2, 5]
    b = bucket_bounds(sizes, 4, 40)             # 40 bytes = 10 floats
    assert b == [(20, 127), (10, 20), (0, 10)]     # 28 bytes < 40: joined to the next
    assert bucket_bounds(sizes, 4, 1 << 30) == [(0, 127)]
    assert bucket_bounds(sizes, 4, 1) == [(122, 127), (120, 122), (20, 120), (13, 20),
                                          (10, 13), (0, 10)]
    with pytest.raises(ValueError):
        bucket_bounds(sizes, 4, 0)


def test_bucket_plan_disagreement_raises_everywhere(world):
    if world.size == 1:
        pytest.skip("needs two ranks to disagree")
    flat = FlatParams(build_model("digits_cnn", 10, (1, 8, 8)))
    with pytest.raises(CommError, match="bucket plan"):
        GradBuckets(world, flat, 2048 if world.rank == 0 else 1 << 20)


# -- overlapped allreduce SGD --------------------------------------------------------------
def _replica(seed: int = 0):
    torch.manual_seed(seed)
    model = build_model("digits_cnn", 10, (1, 8, 8))
    flat = FlatParams(model)
    opt = torch.optim.SGD([torch.nn.Parameter(flat.params)], lr=0.1, momentum=0.9)
    opt.param_groups[0]["params"][0].grad = flat.grad
    return model, flat, opt


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)


def test_overlapped_allreduce_matches_blocking_and_keeps_replicas_identical(world):
    groups = NodeGroups.build(world, None)
    models, flats, opts, algos = [], [], [], []
    for bucket_bytes in (64, 0):                # overlapped (7 buckets), then the reference
        m, f, o = _replica()
        models.append(m), flats.append(f), opts.append(o)
        algos.append(AllreduceRule(groups, f, bucket_bytes=bucket_bytes))
    over, ref = algos
    assert over.buckets.n_buckets >= 4 and ref.buckets is None
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(1, 5):
        x, y = _batch(world.rank, step)
        for k in (0, 1):
            before = world.stats.snapshot()     # overlapped buckets are counted as they start
            flats[k].zero_grad()
            loss_fn(models[k](x), y).backward()
            if k == 0 and world.size > 1:
                # every bucket was started from the hooks during backward
                assert len(over.buckets.pending) == over.buckets.n_buckets
            algos[k].before_step(step)
            if world.size > 1:
                assert world.stats.bytes_sent - before.bytes_sent == flats[k].grad.numel() * 4
        # the same mean gradient as the one-allreduce reference, and the same bits everywhere
        assert torch.allclose(flats[0].grad, flats[1].grad, rtol=1e-5, atol=1e-6)
        assert same_bits_everywhere(world, flats[0].grad)
        for k in (0, 1):
            opts[k].step()
            algos[k].after_step(step, 0.0)
    assert same_bits_everywhere(world, flats[0].flat)
    assert torch.allclose(flats[0].flat, flats[1].flat, rtol=1e-4, atol=1e-5)


def test_second_backward_before_step_averages_the_sum(world):
    """Accumulation without no_sync (DDP's semantics): the second backward waits for the
    first one's buckets, and the step sees mean_i(g1_i + g2_i), the same bits everywhere,
    equal to one unbucketed allreduce of the summed gradients."""
    if world.size == 1:
        pytest.skip("no buckets on one rank")
    groups = NodeGroups.build(world, None)
    model, flat, _ = _replica()
    algo = AllreduceRule(groups, flat, bucket_bytes=64)
    x, y = _batch(world.rank, 1)
    x2, y2 = _batch(world.rank + 7, 1)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    torch.nn.functional.cross_entropy(model(x2), y2).backward()
    algo.before_step(1)
    assert same_bits_everywhere(world, flat.grad)
    # reference: the local sum of both gradients, averaged in one blocking allreduce
    ref_model, ref_flat, _ = _replica()          # (no hooks: plain local gradients)
    torch.nn.functional.cross_entropy(ref_model(x), y).backward()
    torch.nn.functional.cross_entropy(ref_model(x2), y2).backward()
    world.allreduce_(ref_flat.grad, "mean")
    assert torch.allclose(flat.grad, ref_flat.grad, rtol=1e-5, atol=1e-6)
    flat.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    algo.before_step(2)
    assert same_bits_everywhere(world, flat.grad)
    algo.buckets.remove()
