"""The record of the communicators a process made (lsgd_hpc/comm/lifetime.py): freed ones
are dropped from it, so it holds the live ones only however many a long run makes and frees
(a gossip graph rebuilt every period, say)."""

from mpi4py import MPI

from lsgd_hpc.comm import lifetime


def test_the_record_keeps_the_live_communicators_only():
    before = [c for c in lifetime._CREATED if c != MPI.COMM_NULL]
    for _ in range(1000):
        lifetime.track(MPI.COMM_WORLD.Dup()).Free()
    live = [lifetime.track(MPI.COMM_WORLD.Dup()) for _ in range(3)]
    try:
        assert len(lifetime._CREATED) <= lifetime._PRUNE_AT + len(before) + 3
        assert all(any(c is x for x in lifetime._CREATED) for c in live)
        assert lifetime.track(MPI.COMM_NULL) is MPI.COMM_NULL       # not recorded
    finally:
        for c in live:
            c.Free()
