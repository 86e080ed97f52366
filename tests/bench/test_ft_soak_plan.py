"""benchmarks/ft_soak.py's scenarios, in-process: what is killed, drawn with a seed."""

import sys

from mpi_util import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import ft_soak  # noqa: E402


def test_scenarios_are_seeded_and_cover_every_kind():
    a = ft_soak.scenarios(20, seed=3, steps=100, sizes=(8, 16))
    b = ft_soak.scenarios(20, seed=3, steps=100, sizes=(8, 16))
    assert [(s.name, s.events, s.inject, s.leader_at) for s in a] == \
        [(s.name, s.events, s.inject, s.leader_at) for s in b]
    assert len(a) == 40
    at16 = [s for s in a if s.ranks == 16]
    kinds = {s.name.split()[1] for s in at16}
    assert kinds == set(ft_soak.KINDS)
    c = ft_soak.scenarios(20, seed=4, steps=100, sizes=(16,))
    assert [s.events for s in c] != [s.events for s in at16]


def test_a_node_is_four_ranks_and_the_second_event_comes_later():
    for sc in ft_soak.scenarios(30, seed=0, steps=100, sizes=(16,)):
        kind = sc.name.split()[1]
        killed = sc.killed()
        assert all(0 <= r < 16 for r in killed)
        if kind == "node":
            (t, ranks), = sc.events
            assert len(ranks) == 4 and ranks[0] % 4 == 0 and ranks[0] > 0
            assert ranks == list(range(ranks[0], ranks[0] + 4))
        elif kind == "rank+node":
            (t1, [rank]), (t2, node) = sc.events
            assert 2.0 <= t2 - t1 <= 4.0
            assert rank // 4 != node[0] // 4
        elif kind == "rank0":
            assert killed == {0}
        elif kind == "checkpoint":
            assert sc.inject.endswith(":save") and len(killed) == 1
        elif kind == "leader":
            assert sc.leader_at is not None and not sc.events


def test_the_leader_is_read_from_the_last_progress_line():
    lines = ["[lsgd_hpc] lsgd on 16 ranks\n",
             "step      30/300 | epoch  15.00 | loss 1.0 | test acc 92.78% | leader 7 (0.294) | "
             "15,075 samples/s | ETA 0:00:09\n",
             "step      60/300 | epoch  30.00 | loss 0.1 | test acc 97.78% | leader 11 (0.047) | "
             "13,886 samples/s | ETA 0:00:08\n",
             "[lsgd_hpc] lost rank(s) 3\n"]
    assert ft_soak._last_leader(lines) == 11
    assert ft_soak._last_leader(lines[:1]) is None
