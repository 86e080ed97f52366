"""LSGD's compressed global pull (--topk < 1) in flight (--pull-delay d > 0) when a rank is
lost, under ``mpirun --with-ft ulfm`` at 4 ranks as 2 nodes (tests/drivers/ft_loop.py): the
message in flight is dropped on every survivor alike, and the reference r every rank keeps
for the compressed pull (shared state) is the source's on every survivor, so the recovery's
own digest check passes, the survivors finish their budget with finite parameters, the
same r (the driver's digest) and the same count of landed global pulls, and the compressed
pulls go on after the recovery."""

import re

import pytest

from test_faults_mpi import check_survivors, run_ft

STEPS = 24


@pytest.mark.mpi
@pytest.mark.parametrize("elected", [12, 18])
def test_lsgd_compressed_pull_in_flight_survives_a_lost_rank(tmp_path, elected):
    """Global elections at 6, 12, 18, 24 (tau_local 3, tau_global 6), each message landing
    2 steps later (24's would land at 26, after the budget): the global leader of step 12
    (or 18) dies after its election, before its message went out, and the survivors find it
    when they wait for the message at its landing step: the pull is dropped on every one of
    them, so each has landed exactly the other pulls before the end (6's, and 18's or 12's:
    2), the pulls after the recovery landing as before."""
    kill = f"leader:{elected}"
    proc, res, run_dir = run_ft(tmp_path, "lsgd", "--kill", kill, "--hidden", "64",
                                "--steps", str(STEPS), "-o", "topk=0.05", "-o", "pull_delay=2",
                                "-o", "tau_local=3", "-o", "tau_global=6")
    died = [int(re.search(r"inject_failures: rank (\d+) ", line).group(1))
            for line in proc.stderr.splitlines() if "inject_failures: rank" in line]
    assert len(died) == 1, proc.stderr[-3000:]
    check_survivors(proc, res, died, steps=STEPS)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(r["digest"] for r in res), out                   # r is in it
    assert len({r["digest"] for r in res}) == 1, out
    assert len({r["pulls_done"]["0"] for r in res}) == 1, out
    step = res[0]["events"][0]["step"]
    assert elected <= step <= elected + 2, (step, res[0])
    assert {r["pulls_done"]["0"] for r in res} == {2}, out
