"""Fixtures shared by the parallel test bodies: the world communicator of the backend under test
(LSGD_TEST_BACKEND) and its node groups (LSGD_TEST_RPN ranks per node; unset: by host name)."""

import os

import pytest

from lsgd_hpc.comm import NodeGroups, make_world

RPN = int(os.environ.get("LSGD_TEST_RPN", "0")) or None


@pytest.fixture(scope="module")
def world():
    return make_world(os.environ.get("LSGD_TEST_BACKEND", "mpi"))


@pytest.fixture(scope="module")
def groups(world):
    return NodeGroups.build(world, RPN)


@pytest.fixture(scope="module")
def comm(world, groups):
    """The library's handle (what lsgd_hpc.init returns) over the same world and groups."""
    import torch

    from lsgd_hpc.session import Comm
    return Comm(world, groups, torch.device("cpu"), os.environ.get("LSGD_TEST_BACKEND", "mpi"))


def pytest_runtest_logreport(report):
    """A body that fails on one rank ends the whole job at once, with that rank's message:
    the ranks where it passed would otherwise go on into the next body's collectives and
    wait there until the suite's timeout, which then names a hang, not the assertion."""
    if not report.failed:
        return
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) == 1:
        return
    import sys
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "?")
    print(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when}):\n{report.longreprtext}",
          file=sys.stderr, flush=True)
    print(f"[rank {rank}] {report.nodeid} failed", flush=True)
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.COMM_WORLD.Abort(1)
    os._exit(1)       # (a world without MPI: the launcher ends the others)
