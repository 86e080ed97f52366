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
