"""--worker-ranks through the command line, under mpirun at 4 ranks as 2 nodes: refusals in
one line with exit 2, an exact resume with workers of 2 ranks, the metric files' worker
attributes and the two traffic columns, and summary/aggregate counting workers."""

import math
import sys

import h5py
import numpy as np
import pytest

from lsgd_hpc.runtime.metrics import TIME_COLUMNS
from mpi_util import run_mpi
from test_reliability import _check_one_line, _run_cli

WORLD, RPN = 4, 2


def read(run_dir, rank):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return {"attrs": dict(f.attrs), **{g: {c: f[g][c][()] for c in f[g]} for g in f}}


@pytest.mark.parametrize("args,message", [
    (["--worker-ranks", "2"], "--worker-ranks: must divide the world size (worker_ranks=2, "
                              "1 ranks)"),
    (["--worker-ranks", "0"], "--worker-ranks: must be an integer >= 1 or node, got 0"),
    (["--worker-ranks", "nodes"], "--worker-ranks: must be an integer >= 1 or node"),
    (["--algorithm", "lsgd-async", "--worker-ranks", "node"],
     "--worker-ranks: is not supported by lsgd-async"),
], ids=["not-dividing", "zero", "word", "lsgd-async"])
def test_refused_in_one_line_with_exit_2(tmp_path, args, message):
    proc = _run_cli(["--run-dir", str(tmp_path / "never"), *args])
    _check_one_line(proc, "--worker-ranks")
    assert message in proc.stderr


@pytest.mark.mpi
def test_a_k_that_does_not_divide_a_node_stops_every_rank_with_exit_2(tmp_path):
    proc = run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir",
                           str(tmp_path / "never"), "--ranks-per-node", str(RPN),
                           "--worker-ranks", "4"], timeout=240, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lsgd_hpc.train")]
    assert lines == ["lsgd_hpc.train: error: --worker-ranks: must divide the ranks of every "
                     "node (worker_ranks=4; the nodes hold 2, 2 ranks)"], lines
    assert "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_diloco_with_workers_of_2_resumes_exactly_and_records_its_workers(tmp_path):
    """A run resumed from step 20 (mid-period: the outer step at 24 needs x_prev and the outer
    momentum of step 16, and the counters inside the workers) ends with exactly the rows of
    the uninterrupted run. The files record the worker of every rank; worker_bytes_sent is
    the gradient every step (plus, on a worker's first rank, the buffers' broadcast and the
    outer step's result spread to its other rank), comm_bytes_sent the outer allreduce on
    the first ranks only."""
    from lsgd_hpc.analysis.aggregate import aggregate
    from lsgd_hpc.analysis.rundir import read_run
    from lsgd_hpc.analysis.summary import format_summary
    from lsgd_hpc.models.zoo import build_model
    from lsgd_hpc.runtime import checkpoint as ck

    run = tmp_path / "run"
    H = 8
    args = ["--algorithm", "diloco", "--local-steps", str(H), "--max-steps", "24",
            "--checkpoint-every", "10", "--eval-every", "8", "--seed", "7",
            "--lr-schedule", "step", "--consensus-every", "4", "--ranks-per-node", str(RPN),
            "--worker-ranks", "2"]
    proc = run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                           *args], timeout=400)
    assert "done: 24 steps" in proc.stdout
    reference = [read(run, r) for r in range(WORLD)]
    f = run / "checkpoints" / "step000000024" / "rank00002.pt"
    f.write_bytes(f.read_bytes()[:100])
    proc = run_mpi(WORLD, [sys.executable, "-m", "lsgd_hpc.train", "--run-dir", str(run),
                           "--resume", *args], timeout=400)
    assert "resumed at step 20" in proc.stdout
    assert ck.latest_checkpoint(str(run))["step"] == 24
    for r in range(WORLD):
        again = read(run, r)
        for g in ("train", "eval", "consensus"):
            assert again[g].keys() == reference[r][g].keys()
            for c in reference[r][g]:
                if c in TIME_COLUMNS:
                    assert len(again[g][c]) == len(reference[r][g][c])
                else:
                    assert np.array_equal(again[g][c], reference[r][g][c], equal_nan=True), \
                        (r, g, c)

    model = build_model("digits_cnn", 10, (1, 8, 8))
    n_params = sum(p.numel() for p in model.parameters())
    n_buffers = sum(b.numel() for b in model.buffers() if b.is_floating_point())
    grad, flat, buffers = 4 * n_params, 4 * (n_params + n_buffers), 4 * n_buffers
    for r in range(WORLD):
        d = reference[r]
        a = d["attrs"]
        assert (a["worker_index"], a["worker_size"], a["n_workers"]) == (r // 2, 2, 2)
        assert a["schema_version"] == 1
        t = d["train"]
        steps = t["step"]
        first = r % 2 == 0
        outer = steps // H
        want_inside = steps * grad + (steps * buffers + outer * flat if first else 0)
        assert np.array_equal(t["worker_bytes_sent"], want_inside), r
        assert np.array_equal(t["comm_bytes_sent"], outer * flat if first else 0 * steps), r
        assert np.all(np.diff(t["worker_seconds"]) >= 0)
        # the replicas of a worker are one model: the same test accuracy
        assert np.array_equal(d["eval"]["test_accuracy"],
                              reference[r - r % 2]["eval"]["test_accuracy"])

    text = format_summary(read_run(run))
    assert "4 ranks on 2 node(s), 2 workers" in text
    assert " worker " in text.splitlines()[2] and "over 2 workers (4 ranks)" in text
    result = aggregate([run], out_dir=tmp_path / "agg")
    row = result["summary"][0]
    assert row["n_workers"] == 2
    assert row["total_worker_bytes_sent"] == sum(int(reference[r]["train"]
                                                     ["worker_bytes_sent"][-1])
                                                 for r in range(WORLD))
    assert row["total_bytes_sent"] == 2 * 3 * flat
    accs = [reference[r]["eval"]["test_accuracy"][-1] for r in (0, 2)]
    assert math.isclose(row["final_test_acc_mean"], float(np.mean(accs)))
    header = (tmp_path / "agg" / "summary.csv").read_text().splitlines()[0].split(",")
    assert header[-2:] == ["n_workers", "total_worker_bytes_sent"]
