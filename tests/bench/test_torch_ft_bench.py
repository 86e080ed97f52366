"""The torch_ft_* benchmarks' drivers at a tiny size (CPU, gloo): torchft's own DDP
(benchmarks/torch_ft_ddp.py) and lsgd_hpc's trainer, each with a worker SIGKILLed from outside
and the survivor finishing (benchmarks/torch_ft_kill_check.py, what scripts/gpu_check.sh runs
over NCCL); the stall and steps/s readers on made-up rows. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mpi_util import REPO

pytest.importorskip("torchft", reason="torchft is not installed (make venv installs "
                                      "torchft-nightly)")

BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))


def kill_check(*args, timeout=150):
    p = subprocess.run([sys.executable, str(BENCH / "torch_ft_kill_check.py"), "--workers", "2",
                        "--steps", "60", "--kill-at", "20", "--failure-timeout", "2",
                        "--timeout", str(timeout - 30), *args],
                       capture_output=True, text=True, cwd=REPO, timeout=timeout)
    res = json.loads(p.stdout.strip().splitlines()[-1])
    return p.returncode, res, p.stderr


@pytest.mark.replicas
@pytest.mark.timeout(180)
def test_torchft_ddp_driver_survives_a_kill():
    code, res, err = kill_check("--pg", "gloo")
    assert code == 0 and res["ok"], (res, err[-2000:])
    assert res["exit_statuses"] == [0, -9] and res["last_participants"] == [1]
    assert res["stall_s"][0] > 0


@pytest.mark.replicas
@pytest.mark.timeout(180)
def test_trainer_survives_a_kill_in_the_kill_check():
    code, res, err = kill_check("--trainer", "allreduce")
    assert code == 0 and res["ok"], (res, err[-2000:])
    assert res["exit_statuses"] == [0, -9] and len(res["recovery_seconds"]) == 1


@pytest.mark.replicas
@pytest.mark.timeout(240)
def test_trainer_heals_a_kill_in_the_kill_check():
    """What scripts/gpu_check.sh runs on a GPU, here on the CPU: the killed worker started
    again joins, both end at the last step (statuses: the two finishers, then the kill)."""
    code, res, err = kill_check("--trainer", "allreduce", "--heal", "--steps", "400",
                                "--straggler-s", "0.03", timeout=210)
    assert code == 0 and res["ok"], (res, err[-2000:])
    assert res["exit_statuses"] == [0, 0, -9] and res["policy"] == "heal"


def test_stall_and_steps_per_second_readers():
    from torch_ft_common import steady_steps_per_s, typical_steps_per_s
    from torch_ft_recovery import _stall
    steps = list(range(1, 201))
    times = [0.01 * s + (3.0 if s > 120 else 0.0) for s in steps]     # a 3 s gap after 120
    assert _stall(steps, times, 100) == pytest.approx(3.01)
    assert _stall(steps, times, 150) == pytest.approx(0.01)          # before the window
    rows = {"step": steps, "training_time": times}
    assert typical_steps_per_s(rows, 40, 40) == pytest.approx(100.0)  # the gap's block is out
    assert steady_steps_per_s(rows, 40) == pytest.approx(160 / 4.6)
