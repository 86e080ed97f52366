"""Fault tolerance at 16 ranks (4 nodes of 4), killed from outside, as a user scaling up would
see it: the scenarios of benchmarks/ft_soak.py, a few of them, each one real mpirun job under
``--with-ft ulfm`` with a timeout.

* 16 ranks: rank 5 SIGKILLed, then the whole of node 3 (ranks 12-15) two seconds later. Every
  other rank reaches the step budget, nobody else dies, mpirun exits 0 and the run records
  its completion.
* 8 ranks: a rank killed while a checkpoint is written (the survivors recover inside the save).
"""

import sys

import pytest

from mpi_util import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import ft_soak  # noqa: E402

pytestmark = pytest.mark.mpi


def _check(res, steps):
    assert res["innocent_deaths"] == [], res
    assert res["segfaults"] == 0, res
    assert res["finished"] == res["expected_survivors"], res
    assert res["min_survivor_step"] == steps, res
    assert res["exit"] == 0, res
    assert res["complete"], res


def test_sixteen_ranks_survive_a_rank_then_a_node(tmp_path):
    # the kills come 0.5 s and 2.5 s after the first progress line: 120 steps still train
    # for several seconds after them (16 ranks on 2 cores: ~0.1 s a step)
    steps = 120
    sc = ft_soak.Scenario("rank5 then node3", 16, steps, [(0.5, [5]), (2.5, [12, 13, 14, 15])],
                          gap=0.02)
    res = ft_soak.run_scenario(sc, tmp_path, timeout=420, log=print)
    _check(res, steps)
    assert res["killed"] == res["killed_from_outside"] == [5, 12, 13, 14, 15], res
    assert 0 < res["recovery_s"] < 10, res


def test_eight_ranks_survive_a_kill_during_a_checkpoint(tmp_path):
    steps = 40          # checkpoints every 10 steps: rank 6 dies in the save of step 30
    sc = ft_soak.Scenario("checkpoint", 8, steps, inject="6:30:save")
    res = ft_soak.run_scenario(sc, tmp_path, timeout=300, log=print)
    _check(res, steps)
    assert res["killed"] == [6]
