"""--comm-dtype int8/fp8, --topk and --error-feedback through the trainer, under mpirun -np 2:
every periodic method trains on digits in a quarter of fp32's bytes, a run with error
feedback (int8, or top-k: EASGD, SlowMo) resumes exactly from a checkpoint, and the
combinations that cannot work are refused with one line (exit 2)."""

import sys

import h5py
import numpy as np
import pytest

from mpi_util import REPO, run_mpi
from test_checkpoint import read, resumes_like_the_uninterrupted_run
from test_reliability import _check_one_line, _run_cli

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
WORLD = 2
METHODS = ["lsgd", "easgd", "local-sgd", "diloco", "slowmo"]
COMMON = ["--max-steps", "40", "--eval-every", "20", "--consensus-every", "0", "--seed", "1",
          "--local-steps", "4", "--tau-local", "4", "--tau-global", "8", "--slowmo-every", "8"]


def last(run_dir, rank, group, column):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return f[group][column][()]


@pytest.mark.mpi
def test_periodic_methods_train_in_a_quarter_of_the_bytes(tmp_path):
    """fp32, int8, and fp8 with error feedback, 40 steps each: the loss falls, the test
    accuracy ends within reach of fp32's, and the bytes sent are 0.25 of fp32's plus the
    scales (digits_cnn: 2 scales a collective)."""
    runs = {"fp32": [], "int8": ["--comm-dtype", "int8"],
            "fp8ef": ["--comm-dtype", "fp8", "--error-feedback"]}
    for name, extra in runs.items():
        run_mpi(WORLD, [sys.executable, DRIVER, str(tmp_path / name), ",".join(METHODS), "--",
                        *COMMON, *extra], timeout=400)
    for m in METHODS:
        sent = {name: sum(int(last(tmp_path / f"{name}-{m}", r, "train", "comm_bytes_sent")[-1])
                          for r in range(WORLD)) for name in runs}
        for name in ("int8", "fp8ef"):
            assert 0.24 <= sent[name] / sent["fp32"] <= 0.27, (m, name, sent)
            for r in range(WORLD):
                loss = last(tmp_path / f"{name}-{m}", r, "train", "loss")
                assert loss[-8:].mean() < 0.5 * loss[:8].mean(), (m, name, r, loss)
            acc = last(tmp_path / f"{name}-{m}", 0, "eval", "test_accuracy")[-1]
            ref = last(tmp_path / f"fp32-{m}", 0, "eval", "test_accuracy")[-1]
            assert acc >= ref - 0.1, (m, name, acc, ref)


@pytest.mark.mpi
def test_error_feedback_resumes_exactly(tmp_path):
    """DiLoCo with int8 and error feedback, resumed from step 20 (mid-period: the residual
    of the outer step at 16 feeds the one at 24), ends with exactly the rows of the
    uninterrupted run."""
    run = tmp_path / "run"
    args = ["--algorithm", "diloco", "--local-steps", "8", "--comm-dtype", "int8",
            "--error-feedback", "--max-steps", "24", "--checkpoint-every", "10",
            "--eval-every", "8", "--seed", "7", "--consensus-every", "4"]
    reference = resumes_like_the_uninterrupted_run(run, args,
                                                   ["step000000020", "step000000024"])
    assert np.isfinite(reference[0]["train"]["outer_grad_norm"][-1])


#: top-k with error feedback through the trainer, each resumed from the checkpoint of step 20
#: (local SGD shares SlowMo's averaging round: its resume is a parallel body's,
#: tests/parallel/test_quantized_parallel.py)
TOPK_RUNS = {
    "easgd": ["--algorithm", "easgd", "--easgd-tau", "4", "--topk", "0.05", "--comm-dtype",
              "int2"],
    # averages every 3 steps, slow steps at 12 and 24: at 20 the reference (the average of
    # 18) is neither the model nor x_old (the slow step of 12)
    "slowmo": ["--algorithm", "slowmo", "--local-steps", "3", "--slowmo-every", "12",
               "--topk", "0.1", "--comm-dtype", "int2"],
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", sorted(TOPK_RUNS))
def test_topk_error_feedback_resumes_exactly(tmp_path, name):
    """EASGD with --topk 0.05 and int2 values, SlowMo with --topk 0.1 and int2 values, both
    with error feedback (the residuals, and SlowMo's reference, in the checkpoint): the loss
    falls on digits, and a run resumed from step 20 ends with exactly the rows of the
    uninterrupted run."""
    run = tmp_path / "run"
    args = [*TOPK_RUNS[name], "--error-feedback", "--max-steps", "24", "--checkpoint-every",
            "10", "--eval-every", "8", "--seed", "7", "--consensus-every", "4"]
    reference = resumes_like_the_uninterrupted_run(run, args)
    for r, rows in enumerate(reference):
        loss = rows["train"]["loss"]
        assert loss[-6:].mean() < 0.7 * loss[:6].mean(), (name, r, loss)


BAD = [
    (["--algorithm", "lsgd-async", "--comm-dtype", "int8"], "--comm-dtype"),
    (["--algorithm", "gossip", "--gossip-gamma", "0.5"], "gossip_gamma needs --comm-dtype"),
    (["--algorithm", "diloco", "--error-feedback"], "--error-feedback"),
    (["--algorithm", "diloco", "--topk", "0"], "--topk"),
    (["--algorithm", "gossip", "--topk", "0.01", "--gossip-gamma", "2"], "--gossip-gamma"),
    (["--algorithm", "lsgd", "--topk", "0.1", "--pull-delay", "2", "--on-failure", "shrink"],
     "--on-failure"),
]


@pytest.mark.slow
@pytest.mark.parametrize("args,option", BAD, ids=["lsgd-async", "gossip-gamma-fp32",
                                                  "ef-alone", "topk-zero", "gossip-gamma-range",
                                                  "topk-delay-shrink"])
def test_refused_with_one_line_exit_2(tmp_path, args, option):
    _check_one_line(_run_cli(["--run-dir", str(tmp_path / "never"), *args]), option)
