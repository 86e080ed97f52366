"""The synthetic data set end to end (2 ranks, allreduce, the MLP), with the cosine learning
rate schedule checked row by row against its formula."""

import json
import math
import sys

import h5py
import numpy as np
import pytest

from mpi_util import run_mpi

LR = 0.05


@pytest.mark.mpi
def test_synthetic_allreduce_with_cosine_schedule(tmp_path):
    run = tmp_path / "syn"
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--dataset", "synthetic",
                       "--algorithm", "allreduce", "--synthetic-size", "2048", "--epochs", "2",
                       "--lr", str(LR), "--lr-schedule", "cosine", "--eval-every", "8",
                       "--run-dir", str(run)], timeout=400)
    # 2048 images / 2 ranks / batch 64 = 16 steps per epoch, 2 epochs
    total = 32
    assert f"{total} steps (16/epoch)" in proc.stdout
    files = []
    for r in range(2):
        with h5py.File(run / "metrics" / f"rank{r:05d}.h5", "r") as f:
            files.append({"attrs": dict(f.attrs),
                          **{g: {c: f[g][c][()] for c in f[g]} for g in f}})
    for f in files:
        cfg = json.loads(f["attrs"]["config"])
        assert (cfg["dataset"], cfg["model"]) == ("synthetic", "mlp")
        t = f["train"]
        assert list(t["step"]) == list(range(1, total + 1))
        # the rate used for step s is set before it, at s - 1 steps done
        want = [0.5 * LR * (1 + math.cos(math.pi * (s - 1) / total)) for s in t["step"]]
        assert np.allclose(t["lr"], want, rtol=1e-12, atol=0)
        assert t["lr"][0] == LR and t["lr"][-1] < 0.01 * LR
        assert list(f["eval"]["step"]) == [8, 16, 24, 32]
    # it learns: ten classes, chance is 10 %
    acc = files[0]["eval"]["test_accuracy"]
    assert acc[-1] >= 0.5 and acc[-1] > acc[0], acc
    # allreduce keeps the replicas identical, so both ranks evaluate the same model
    assert np.array_equal(files[0]["eval"]["test_loss"], files[1]["eval"]["test_loss"])
