"""A preempted library loop resumes and ends equal to an uninterrupted one.

examples/own_loop.py (LSGD, 4 ranks as 2 nodes) runs 48 steps uninterrupted (A). Run B
stops at step 20 and waits; SIGUSR1 sent to mpirun (Open MPI forwards it to the ranks)
reaches ``StopSignals``, the ranks agree on it through ``stop=`` (``method.stopping``),
save a checkpoint and exit 143; B started again on the same run dir restores it and runs to
the end. B's final parameters and its per-step training losses (HDF5 /train) equal A's
bit for bit.
"""

import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch

from mpi_util import REPO, kill_session, mpi_env, mpirun_cmd, run_mpi

EXAMPLE = str(REPO / "examples" / "own_loop.py")
STEPS = 48


def args(run_dir, params, *extra):
    return [sys.executable, EXAMPLE, "--method", "lsgd", "--ranks-per-node", "2",
            "-o", "tau_local=2", "-o", "tau_global=8", "--max-steps", str(STEPS),
            "--eval-every", "24", "--run-dir", str(run_dir), "--save-params", str(params),
            *extra]


def run_until_signalled(cmd, timeout=180):
    """Start ``cmd``; once all 4 ranks print 'ready', send SIGUSR1 to mpirun; wait."""
    p = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, ready, t0 = [], 0, time.monotonic()
    try:
        for line in p.stdout:
            lines.append(line)
            if "ready at step" in line:
                ready += 1
                if ready == 4:
                    p.send_signal(signal.SIGUSR1)
            if time.monotonic() - t0 > timeout:
                break
        p.wait(timeout=max(1, timeout - (time.monotonic() - t0)))
    except subprocess.TimeoutExpired:
        pass
    finally:
        if p.poll() is None:
            kill_session(p.pid)
            p.wait()
            pytest.fail("run B hung:\n" + "".join(lines[-60:]))
    return p.returncode, "".join(lines)


def losses(run_dir):
    out = []
    for r in range(4):
        with h5py.File(run_dir / "lsgd" / "metrics" / f"rank{r:05d}.h5", "r") as f:
            out.append((f["train"]["step"][:], f["train"]["loss"][:]))
    return out


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_preempted_library_loop_resumes_exactly(tmp_path):
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    run_mpi(4, args(a_dir, tmp_path / "a.pt"), timeout=240)

    rc, out = run_until_signalled(mpirun_cmd(4, args(b_dir, tmp_path / "b.pt",
                                                      "--ready-at", "20")))
    assert rc != 0, out                     # exit 143 on every rank outside SLURM
    assert "stopped at step" in out and "checkpoint saved" in out, out
    stopped = int(out.split("stopped at step ")[1].split()[0].rstrip(","))
    assert 20 <= stopped < STEPS, out
    assert not (tmp_path / "b.pt").exists()

    res = run_mpi(4, args(b_dir, tmp_path / "b.pt"), timeout=240)
    assert f"resumed from step {stopped}" in res.stdout, res.stdout

    a = torch.load(tmp_path / "a.pt")
    b = torch.load(tmp_path / "b.pt")
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    for (sa, la), (sb, lb) in zip(losses(a_dir), losses(b_dir)):
        assert np.array_equal(sa, np.arange(1, STEPS + 1)) and np.array_equal(sa, sb)
        assert np.array_equal(la, lb)
