"""A body that fails on the last rank only, then a body with a collective (run by
tests/test_parallel_mpi.py::test_one_rank_failure_ends_the_job_with_its_message; not collected
by the suite itself)."""


def test_fails_on_last_rank(world):
    assert world.rank != world.size - 1, "deliberate failure on the last rank"


def test_next_body_waits_in_a_collective(world):
    world.barrier()
