"""The trainer's --tracker: a real 2-rank run mirrors rank 0's rows to TensorBoard (read back
with TensorBoard's own reader), and a tracker whose package is missing stops every rank before
training with one line and exit status 2."""

import subprocess
import sys

import h5py
import pytest

from mpi_util import REPO, mpi_env, run_mpi
from test_trackers import read_tensorboard


@pytest.mark.mpi
def test_trainer_mirrors_rank_0_to_tensorboard(tmp_path):
    run = tmp_path / "run"
    out = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", "16",
                      "--eval-every", "8", "--tracker", "tensorboard", "--run-dir", str(run)],
                  timeout=300)
    assert "done: 16 steps" in out.stdout
    got, files = read_tensorboard(str(run))
    assert len(files) == 1, files
    with h5py.File(run / "metrics" / "rank00000.h5", "r") as f:
        loss, steps = f["train"]["loss"][()], f["train"]["step"][()]
        glob_rows = f["leader"]["scope"][()] == 0
        leaders = f["leader"]["leader_rank"][()][glob_rows]
        assert "end_time" in f.attrs                      # the trainer closed its writer
    assert [s for s, _ in got["train/loss"]] == list(steps)
    assert [v for _, v in got["train/loss"]] == pytest.approx(list(loss), rel=1e-6)
    assert [v for _, v in got["leader/rank"]] == [float(r) for r in leaders]
    assert len(got["leader/score"]) == len(leaders)       # the elected leader's score
    assert [s for s, _ in got["eval/test_accuracy"]] == [8, 16]


def test_a_missing_tracker_is_one_line_exit_2(tmp_path):
    # the package made unimportable in the trainer's process (as if not installed)
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    env = mpi_env({"PYTHONPATH": f"{tmp_path}:{REPO}"})
    proc = subprocess.run([sys.executable, "-m", "lsgd_hpc.train", "--tracker", "wandb",
                           "--run-dir", str(tmp_path / "never")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "lsgd_hpc.train: error: --tracker: tracker wandb: the wandb package is not installed; "
        "install it with: pip install lsgd_hpc[wandb]"]
    assert not (tmp_path / "never").exists()
