"""A results/ experiment runs end to end as its own command: real MPI trainings, the CSV table
with its columns and one row per (slowdown, method, seed), and the figure."""

import csv
import subprocess
import sys

from mpi_util import REPO, mpi_env


def test_stragglers_experiment_writes_its_table_and_figure(tmp_path):
    out, raw = tmp_path / "out", tmp_path / "raw"
    cmd = [sys.executable, str(REPO / "results" / "experiments" / "stragglers.py"),
           "--out", str(out), "--raw", str(raw), "--quick", "--steps", "20", "--slowdowns", "3"]
    p = subprocess.run(cmd, cwd=REPO, env=mpi_env(), capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(out / "stragglers.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {"ranks", "slowdown", "method", "seed", "fast_steps_per_s", "slow_steps_per_s",
            "retention", "time_to_target_s", "final_acc"} <= set(rows[0])
    assert sorted((r["slowdown"], r["method"], r["seed"]) for r in rows) == [
        ("1", "async LSGD", "1"), ("1", "sync LSGD", "1"),
        ("3", "async LSGD", "1"), ("3", "sync LSGD", "1")]
    for r in rows:
        assert float(r["fast_steps_per_s"]) > 0 and 0 <= float(r["final_acc"]) <= 1
        # without a straggler the run is its own reference; with one, the slow rank is slower
        if r["slowdown"] == "1":
            assert float(r["retention"]) == 1.0 and r["slow_steps_per_s"] == ""
        else:
            assert float(r["slow_steps_per_s"]) < float(r["fast_steps_per_s"])
    png = (out / "stragglers.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert "One rank 3x slower" in p.stdout
    # every training left its rank files under --raw, none under the repository's runs/
    assert len(list(raw.glob("seed1/*/metrics/rank00003.h5"))) == 4
