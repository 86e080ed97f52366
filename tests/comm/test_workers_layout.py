"""Which worker every rank is in (lsgd_hpc.comm.workers.worker_layout): pure, no MPI."""

import pytest

from lsgd_hpc.comm.workers import worker_layout, worker_layout_problem


def test_node_workers_follow_the_nodes_even_when_uneven():
    lay = worker_layout([0, 0, 1, 1, 2], "node")
    assert lay.worker_of == [0, 0, 1, 1, 2]
    assert lay.first == [0, 2, 4] and lay.node_of_worker == [0, 1, 2]
    assert lay.members(1) == [2, 3] and lay.n_workers == 3


def test_k_ranks_of_a_node_in_rank_order_numbered_by_first_rank():
    assert worker_layout([0] * 4 + [1] * 4, 2).worker_of == [0, 0, 1, 1, 2, 2, 3, 3]
    # ranks placed round-robin over two hosts: workers never span a node
    lay = worker_layout([0, 1, 0, 1, 0, 1, 0, 1], 2)
    assert lay.worker_of == [0, 1, 0, 1, 2, 3, 2, 3]
    assert lay.first == [0, 1, 4, 5] and lay.node_of_worker == [0, 1, 0, 1]
    assert worker_layout([0, 0, 0], 1).worker_of == [0, 1, 2]


@pytest.mark.parametrize("node_of,k,why", [
    ([0, 0, 1, 1, 2], 2, "must divide the ranks of every node (worker_ranks=2; the nodes "
                         "hold 2, 2, 1 ranks)"),
    ([0] * 6, 4, "must divide the world size (worker_ranks=4, 6 ranks)"),
])
def test_a_k_that_does_not_fit_is_refused(node_of, k, why):
    assert worker_layout_problem(node_of, k) == why
    with pytest.raises(ValueError, match=r"worker_ranks must divide"):
        worker_layout(node_of, k)
    assert worker_layout_problem(node_of, "node") is None
