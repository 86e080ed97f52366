"""Never a silent success: under ``mpirun --with-ft ulfm`` (``--on-failure shrink``) mpirun
exits 0 even when every rank was SIGKILLed. Such a run leaves no completion record
(RUN_DIR/complete.json), and ``python -m lsgd_hpc.summary RUN_DIR --check`` says it did not
complete (exit 1). A run that completes writes the record: tests/cli/test_train.py
(test_lsgd_default_run_and_determinism) and tests/cli/test_measurement.py (a stop on purpose,
then its resume) check it on their runs."""

import subprocess
import sys

import pytest

from mpi_util import REPO, run_mpi


@pytest.mark.mpi
@pytest.mark.fast
def test_every_rank_killed_leaves_no_record_and_check_fails(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "complete.json").write_text('{"status": "complete"}')   # an earlier attempt's
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", "40",
                       "--eval-every", "20", "--flush-every", "1", "--run-dir", str(run_dir),
                       "--on-failure", "shrink", "--inject-failure", "0:3,1:3"],
                   timeout=240, mpi_args=["--with-ft", "ulfm"], check=False, cwd=tmp_path)
    out = proc.stdout + proc.stderr[-3000:]
    assert "done: 40 steps" not in proc.stdout, out
    assert "rank 0 kills itself at step 3" in out and "rank 1 kills itself at step 3" in out
    # (mpirun's exit status is not asserted: ULFM's mpirun says 0, which is the problem)
    assert not (run_dir / "complete.json").exists(), out
    check = subprocess.run([sys.executable, "-m", "lsgd_hpc.summary", str(run_dir), "--check"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert check.returncode == 1, check.stdout + check.stderr
    errors = check.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("lsgd_hpc.summary: error: "), errors
    assert "NOT COMPLETE: no completion record" in errors[0] and "of 40" in errors[0]
    assert "completion: NOT COMPLETE" in check.stdout
