"""lsgd_hpc.aggregate / lsgd_hpc.summary on fake, schema-exact run directories."""
import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from lsgd_hpc.analysis import aggregate as agg
from lsgd_hpc.analysis import summary
from lsgd_hpc.runtime.completion import write_completion

REPO = Path(__file__).resolve().parents[2]

TRAIN_STEPS = np.arange(1, 21)            # 20 logged training steps
EVAL_STEPS = [0, 10, 20]
CONSENSUS_STEPS = [8, 16]

# test accuracy [rank][evaluation]
LSGD_S1_ACC = [[0.1, 0.5, 0.70],
               [0.1, 0.6, 0.80],
               [0.1, 0.4, 0.90],
               [0.1, 0.3, 0.55]]
LSGD_S2_ACC = [[0.1, 0.4, 0.60],
               [0.1, 0.5, 0.70],
               [0.1, 0.6, 0.80],
               [0.1, 0.2, 0.50]]
# global elections (step, leader); an election at step 20 counts for the evaluation at 20
LSGD_ELECTIONS = [(8, 1), (16, 2), (20, 3)]
LOCAL_ELECTIONS = [(4, 0), (12, 2)]       # scope 1: must not count as global leaders
EASGD_ACC = [[0.2, 0.5, 0.6],
             [0.3, 0.4, 0.7]]
EASGD_CENTRE = [0.15, 0.65, 0.62]
ALLREDUCE_ACC = [[0.1, 0.3, 0.45],
                 [0.1, 0.3, 0.45],
                 [0.1, 0.3, 0.45]]


def write_run(root, name, algorithm, seed, acc, elections=(), local_elections=(),
              centre=None, ranks_per_node=2, extra_train=False, completion="complete"):
    """A run directory exactly as the trainer writes it (schema_version 1); ``completion``:
    the status of its completion record (complete.json), None for no record (a run whose
    ranks were killed)."""
    run_dir = Path(root) / name
    world = len(acc)
    config = dict(algorithm=algorithm, dataset="synthetic", model="mlp", epochs=2,
                  batch_size=32, lr=0.1, seed=seed, world_size=world,
                  ranks_per_node=ranks_per_node, topology="ring", tau_local=4,
                  tau_global=8, run_dir=str(run_dir))
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "checkpoints").mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    n = len(TRAIN_STEPS)
    for r in range(world):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "w") as f:
            a = f.attrs
            a["schema_version"] = 1
            a["rank"] = r
            a["world_size"] = world
            a["local_rank"] = r % ranks_per_node
            a["node_index"] = r // ranks_per_node
            a["n_nodes"] = (world + ranks_per_node - 1) // ranks_per_node
            a["hostname"] = f"node{r // ranks_per_node}"
            a["algorithm"] = algorithm
            a["config"] = json.dumps(config)
            a["lsgd_hpc_version"] = "0.1.0"
            a["git_sha"] = "deadbeef"
            a["torch_version"] = "2.14.1"
            a["mpi_library"] = "Open MPI 5"
            a["slurm_job_id"] = ""
            a["start_time"] = "2024-01-01T00:00:00"
            t = f.create_group("train")
            t["step"] = TRAIN_STEPS.astype(np.int64)
            t["epoch"] = TRAIN_STEPS / 10.0
            t["wall_time"] = 0.5 * TRAIN_STEPS + 0.01 * r
            t["loss"] = 2.0 / TRAIN_STEPS + 0.1 * r
            t["accuracy"] = np.linspace(0.1, 0.9, n)
            t["lr"] = np.full(n, 0.1)
            t["comm_bytes_sent"] = (100 * (r + 1) * TRAIN_STEPS).astype(np.int64)
            t["comm_bytes_recv"] = (50 * TRAIN_STEPS).astype(np.int64)
            t["comm_seconds"] = 0.01 * TRAIN_STEPS
            t["compute_seconds"] = 0.4 * TRAIN_STEPS
            t["training_time"] = 0.45 * TRAIN_STEPS + 0.01 * r
            if extra_train:
                t["local_steps"] = np.full(n, 4, dtype=np.int64)
            e = f.create_group("eval")
            e["step"] = np.asarray(EVAL_STEPS, dtype=np.int64)
            e["epoch"] = np.asarray(EVAL_STEPS) / 10.0
            e["wall_time"] = 0.5 * np.asarray(EVAL_STEPS) + 0.2 + 0.01 * r
            e["training_time"] = 0.45 * np.asarray(EVAL_STEPS) + 0.01 * r
            e["test_loss"] = 1.0 - np.asarray(acc[r])
            e["test_accuracy"] = np.asarray(acc[r], dtype=np.float64)
            if centre is not None:
                e["center_test_loss"] = 1.0 - np.asarray(centre)
                e["center_test_accuracy"] = np.asarray(centre, dtype=np.float64)
            rows = [(s, 0, ldr) for s, ldr in elections] + \
                   [(s, 1, ldr) for s, ldr in local_elections]
            rows.sort()
            g = f.create_group("leader")
            g["step"] = np.asarray([x[0] for x in rows], dtype=np.int64)
            g["scope"] = np.asarray([x[1] for x in rows], dtype=np.int64)
            g["leader_rank"] = np.asarray([x[2] for x in rows], dtype=np.int64)
            g["score"] = np.full(len(rows), 0.5 + r)
            c = f.create_group("consensus")
            if algorithm == "allreduce":
                c["step"] = np.zeros(0, dtype=np.int64)
                c["distance"] = np.zeros(0)
            else:
                c["step"] = np.asarray(CONSENSUS_STEPS, dtype=np.int64)
                c["distance"] = np.asarray([0.25, 0.125]) * (r + 1)
    if completion is not None:
        write_completion(run_dir, status=completion, step=int(TRAIN_STEPS[-1]),
                         total_steps=int(TRAIN_STEPS[-1]), world_size=world)
    return run_dir


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_run(root, "lsgd_s1", "lsgd", 1, LSGD_S1_ACC, LSGD_ELECTIONS, LOCAL_ELECTIONS)
    write_run(root, "lsgd_s2", "lsgd", 2, LSGD_S2_ACC, LSGD_ELECTIONS, LOCAL_ELECTIONS)
    write_run(root, "easgd_s1", "easgd", 1, EASGD_ACC, centre=EASGD_CENTRE)
    write_run(root, "allreduce_s1", "allreduce", 1, ALLREDUCE_ACC, ranks_per_node=3,
              extra_train=True)
    return root


RUN_NAMES = ["lsgd_s1", "lsgd_s2", "easgd_s1", "allreduce_s1"]


@pytest.fixture(scope="module")
def aggregated(runs_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("agg")
    warnings = []
    res = agg.aggregate([runs_root / n for n in RUN_NAMES], out, warn=warnings.append)
    assert warnings == []
    return out, res


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def test_read_rank_file_schema(runs_root):
    d = agg.read_rank_file(runs_root / "lsgd_s1" / "metrics" / "rank00002.h5")
    assert d["rank"] == 2
    assert d["attrs"]["node_index"] == 1 and d["attrs"]["hostname"] == "node1"
    assert d["config"]["seed"] == 1
    assert d["train"]["comm_bytes_sent"].tolist()[-1] == 100 * 3 * 20
    assert d["eval"]["test_accuracy"].tolist() == LSGD_S1_ACC[2]
    assert d["leader"]["scope"].tolist() == [1, 0, 1, 0, 0]
    run = agg.read_run(runs_root / "allreduce_s1")
    assert sorted(run.ranks) == [0, 1, 2] and run.skipped == []
    assert run.algorithm == "allreduce" and run.n_nodes == 1 and run.seed == 1
    assert "local_steps" in run.ranks[0]["train"]          # extra datasets are kept
    assert len(run.ranks[0]["consensus"]["step"]) == 0     # empty groups are fine


def test_summary_csv_exact(aggregated):
    out, _ = aggregated
    rows = read_csv(out / "summary.csv")
    with open(out / "summary.csv") as fh:
        assert fh.readline().strip().split(",") == list(agg.SUMMARY_COLUMNS)
    assert [r["run"] for r in rows] == RUN_NAMES
    s1, s2, ea, ar = rows

    assert s1["algorithm"] == "lsgd" and s1["world_size"] == "4" and s1["n_nodes"] == "2"
    assert s1["epochs"] == "2" and s1["seed"] == "1" and s2["seed"] == "2"
    assert float(s1["wall_time"]) == pytest.approx(0.5 * 20 + 0.03)
    assert int(s1["total_bytes_sent"]) == 100 * 20 * (1 + 2 + 3 + 4)
    assert int(s1["total_bytes_recv"]) == 50 * 20 * 4
    assert int(s1["steps"]) == 20
    # leader at step 20 is rank 3 (election at 20 counts), at step 10 rank 1, at 0 rank 0
    assert float(s1["final_test_acc_leader"]) == 0.55
    assert float(s1["best_test_acc_leader"]) == 0.6
    assert float(s1["final_test_acc_mean"]) == pytest.approx((0.7 + 0.8 + 0.9 + 0.55) / 4)
    assert float(s1["best_test_acc_mean"]) == pytest.approx((0.7 + 0.8 + 0.9 + 0.55) / 4)
    assert float(s1["final_test_acc_best"]) == 0.9
    assert float(s1["best_test_acc_best"]) == 0.9
    assert float(s2["final_test_acc_leader"]) == 0.5
    assert float(s2["best_test_acc_leader"]) == 0.5
    assert float(s2["final_test_acc_best"]) == 0.8

    # EASGD: the centre is the model
    assert ea["world_size"] == "2" and ea["n_nodes"] == "1"
    assert float(ea["final_test_acc_leader"]) == 0.62
    assert float(ea["best_test_acc_leader"]) == 0.65
    assert float(ea["final_test_acc_mean"]) == pytest.approx(0.65)
    assert float(ea["best_test_acc_best"]) == 0.7
    assert int(ea["total_bytes_sent"]) == 100 * 20 * 3

    # allreduce: no elections -> rank 0
    assert float(ar["final_test_acc_leader"]) == 0.45
    assert int(ar["total_bytes_sent"]) == 100 * 20 * 6


def test_eval_table_leader_per_evaluation(runs_root):
    run = agg.read_run(runs_root / "lsgd_s1")
    tab = agg.eval_table(run)
    assert tab["step"].tolist() == EVAL_STEPS
    assert tab["leader_rank"].tolist() == [0, 1, 3]
    assert tab["acc_leader"].tolist() == [0.1, 0.6, 0.55]
    assert tab["acc_best"].tolist() == [0.1, 0.6, 0.9]
    assert tab["complete"].all() and tab["n_ranks"].tolist() == [4, 4, 4]
    # bytes sent by all ranks together at each evaluation (last train row <= step)
    assert tab["bytes_sent"].tolist() == [0.0, 10000.0, 20000.0]
    assert tab["wall_time"].tolist() == pytest.approx([0.23, 5.23, 10.23])
    assert agg.leader_rule(run) == "elected"
    assert agg.leader_counts(run) == {1: 1, 2: 1, 3: 1}
    assert agg.leader_rule(agg.read_run(runs_root / "easgd_s1")) == "centre"
    assert agg.leader_rule(agg.read_run(runs_root / "allreduce_s1")) == "rank0"


def test_curves_csv(aggregated):
    out, res = aggregated
    rows = read_csv(out / "curves.csv")
    with open(out / "curves.csv") as fh:
        assert fh.readline().strip().split(",") == list(agg.CURVE_COLUMNS)
    per_rank = 4 * 20 + 2 * 3 + 2                    # train x4, eval x2, consensus
    expected = 2 * 4 * per_rank + 2 * (per_rank + 2 * 3) + 3 * (4 * 20 + 2 * 3)
    assert len(rows) == expected == res["curve_rows"]
    metrics = {r["metric"] for r in rows if r["run"] == "lsgd_s1"}
    assert metrics == {"train_loss", "train_accuracy", "test_loss", "test_accuracy",
                       "comm_bytes_sent", "consensus_distance", "training_time"}
    pick = [r for r in rows if r["run"] == "lsgd_s1" and r["rank"] == "2"]
    ta = [r for r in pick if r["metric"] == "test_accuracy"]
    assert [(int(r["step"]), float(r["value"])) for r in ta] == list(zip(EVAL_STEPS,
                                                                         LSGD_S1_ACC[2]))
    assert float(ta[1]["wall_time"]) == pytest.approx(5.22)
    sent = [r for r in pick if r["metric"] == "comm_bytes_sent"]
    assert sent[-1]["step"] == "20" and sent[-1]["value"] == "6000"
    loss = [r for r in pick if r["metric"] == "train_loss"]
    assert float(loss[3]["value"]) == pytest.approx(2.0 / 4 + 0.2)
    cons = [r for r in pick if r["metric"] == "consensus_distance"]
    assert [(r["step"], float(r["value"]), float(r["wall_time"])) for r in cons] == \
        [("8", 0.75, pytest.approx(4.02)), ("16", 0.375, pytest.approx(8.02))]
    centre = [r for r in rows if r["run"] == "easgd_s1" and r["rank"] == "0"
              and r["metric"] == "center_test_accuracy"]
    assert [float(r["value"]) for r in centre] == EASGD_CENTRE


def test_group_runs_by_seed(aggregated):
    _, res = aggregated
    groups = res["groups"]
    assert len(groups) == 3
    lsgd = groups[0]
    assert [r.name for r in lsgd.runs] == ["lsgd_s1", "lsgd_s2"] and lsgd.seeds == [1, 2]
    assert "seed" not in lsgd.config and "run_dir" not in lsgd.config
    assert lsgd.label == "lsgd ranks_per_node=2 world_size=4 (2 seeds)"
    assert groups[1].label == "easgd ranks_per_node=2 world_size=2"
    assert groups[2].label == "allreduce ranks_per_node=3 world_size=3"
    # a single configuration is named by its algorithm only
    one = agg.group_runs([r for r in res["runs"] if r.algorithm == "lsgd"])
    assert len(one) == 1 and one[0].label == "lsgd (2 seeds)"


def test_band_mean_min_max(runs_root):
    runs = [agg.read_run(runs_root / n) for n in ("lsgd_s1", "lsgd_s2")]
    grid, mean, lo, hi = agg.band([agg.run_curve(r, "step", "test_accuracy") for r in runs])
    m1 = np.mean(LSGD_S1_ACC, axis=0)
    m2 = np.mean(LSGD_S2_ACC, axis=0)
    assert grid.tolist() == EVAL_STEPS
    assert mean == pytest.approx((m1 + m2) / 2)
    assert lo == pytest.approx(np.minimum(m1, m2)) and hi == pytest.approx(np.maximum(m1, m2))
    # runs with different x ranges: each contributes only inside its own range
    g, m, lo, hi = agg.band([(np.array([0.0, 2.0]), np.array([0.0, 2.0])),
                             (np.array([1.0, 3.0]), np.array([5.0, 7.0]))])
    assert g.tolist() == [0, 1, 2, 3]
    assert m.tolist() == [0.0, 3.0, 4.0, 7.0]


def test_pngs_are_real_plots(aggregated):
    import matplotlib.image as mpimg
    out, res = aggregated
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == sorted(agg.PLOTS) and len(res["plots"]) == 5
    assert "test_acc_vs_training_time.png" in names
    for name in names:
        path = out / name
        assert path.stat().st_size > 15_000
        img = mpimg.imread(path)
        assert img.shape[0] > 300 and img.shape[1] > 500
        assert float(img[..., :3].std()) > 0.05             # not a blank canvas


@pytest.mark.slow
def test_truncated_file_warned_and_skipped(runs_root, tmp_path, capsys):
    run_dir = tmp_path / "lsgd_trunc"
    shutil.copytree(runs_root / "lsgd_s1", run_dir)
    bad = run_dir / "metrics" / "rank00002.h5"
    size = bad.stat().st_size
    with open(bad, "r+b") as fh:
        fh.truncate(size // 2)
    res = agg.aggregate([run_dir], tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lsgd_hpc.aggregate: warning:")
    assert "rank00002.h5" in err[0]
    run = res["runs"][0]
    assert sorted(run.ranks) == [0, 1, 3] and len(run.skipped) == 1
    row = read_csv(tmp_path / "out" / "summary.csv")[0]
    assert int(row["total_bytes_sent"]) == 100 * 20 * (1 + 2 + 4)
    assert float(row["final_test_acc_leader"]) == 0.55        # leader rank 3 still read
    assert float(row["final_test_acc_mean"]) == pytest.approx((0.7 + 0.8 + 0.55) / 3)
    # all files unreadable -> bad input
    for p in (run_dir / "metrics").glob("*.h5"):
        p.write_bytes(b"not hdf5")
    with pytest.raises(agg.AggregateError, match="no readable metrics files"):
        agg.read_run(run_dir, warn=lambda m: None)


def test_config_comes_from_the_files_not_a_stale_config_yaml(runs_root, tmp_path):
    run_dir = tmp_path / "rerun"
    shutil.copytree(runs_root / "easgd_s1", run_dir)
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**cfg, "lr": 0.5, "seed": 9}))
    warnings = []
    run = agg.read_run(run_dir, warn=warnings.append)
    assert run.config["lr"] == 0.1 and run.seed == 1
    assert warnings == [f"{run_dir / 'config.yaml'} differs from the config in the metrics "
                        f"files in lr; using the files'"]        # the seed is no configuration


def test_parent_directory_expands_to_runs(runs_root):
    runs = agg.read_runs([runs_root], warn=lambda m: None)
    assert sorted(r.name for r in runs) == sorted(RUN_NAMES)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "MPLBACKEND": "Agg"})


@pytest.mark.slow
def test_cli_aggregate(runs_root, tmp_path):
    out = tmp_path / "cli_out"
    p = _cli("lsgd_hpc.aggregate", *(str(runs_root / n) for n in RUN_NAMES), "--out", str(out))
    assert p.returncode == 0, p.stderr
    assert (out / "summary.csv").is_file() and len(read_csv(out / "summary.csv")) == 4
    assert len(list(out.glob("*.png"))) == 5

    for bad in ([str(tmp_path / "missing"), "--out", str(out)],
                [str(tmp_path), "--out", str(out)],          # no metrics files
                [str(runs_root / "lsgd_s1")]):                # --out missing
        p = _cli("lsgd_hpc.aggregate", *bad)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and "Traceback" not in p.stderr
        assert len(lines) == 1 and lines[0].startswith("lsgd_hpc.aggregate: error: "), lines

    h = _cli("lsgd_hpc.aggregate", "--help")
    assert h.returncode == 0 and "rank 0" in h.stdout and "centre" in h.stdout


def test_main_returns_int(runs_root, tmp_path, capsys):
    assert agg.main([str(runs_root / "easgd_s1"), "--out", str(tmp_path / "o")]) == 0
    assert agg.main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "lsgd_hpc.aggregate: error: run directory not found" in capsys.readouterr().err


def test_summary_text(runs_root, capsys):
    run = agg.read_run(runs_root / "lsgd_s1")
    text = summary.format_summary(run)
    lines = text.splitlines()
    assert str(runs_root / "lsgd_s1" / "metrics") in lines[0]
    rank_lines = [ln.split() for ln in lines if ln.split() and ln.split()[0].isdigit()]
    assert [ln[:5] for ln in rank_lines] == [
        ["0", "0", "0.1000", "70.00%", "0"],
        ["1", "0", "0.2000", "80.00%", "1"],
        ["2", "1", "0.3000", "90.00%", "1"],
        ["3", "1", "0.4000", "55.00%", "1"]]
    assert "final global leader: rank 3" in text and "55.00%" in text
    assert "mean test accuracy: 73.75%" in text
    ea = summary.format_summary(agg.read_run(runs_root / "easgd_s1"))
    assert "centre test accuracy 62.00%" in ea
    ar = summary.format_summary(agg.read_run(runs_root / "allreduce_s1"))
    assert "rank 0 test accuracy 45.00%" in ar


def test_cli_summary(runs_root, tmp_path):
    p = _cli("lsgd_hpc.summary", str(runs_root / "lsgd_s1"))
    assert p.returncode == 0, p.stderr
    assert "final global leader: rank 3" in p.stdout
    assert "rank00000.h5" in p.stdout or "rank*.h5" in p.stdout
    p = _cli("lsgd_hpc.summary", str(tmp_path / "missing"))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lsgd_hpc.summary: error: ")


def test_node_traffic_in_summary_curves_and_text(tmp_path):
    """A run with the node_* columns of /train (a hierarchical compressed allreduce: float32
    inside the node) gets total_node_bytes_sent in summary.csv (the sum over ranks of the
    last node_bytes_sent), node_bytes_sent curves and a node_bytes column in the summary
    text; a run without them leaves the cell empty and has neither."""
    from lsgd_hpc.analysis.tables import (NODE_COLUMNS, curve_rows, has_node_traffic,
                                          write_summary_csv)
    hier = write_run(tmp_path, "diloco_int8", "diloco", 1, ALLREDUCE_ACC + [[0.1, 0.3, 0.45]])
    flat = write_run(tmp_path, "diloco_fp32", "diloco", 1, ALLREDUCE_ACC + [[0.1, 0.3, 0.45]])
    for r in range(4):
        with h5py.File(hier / "metrics" / f"rank{r:05d}.h5", "a") as f:
            f["train/node_bytes_sent"] = (1000 * (1 + r % 2) * TRAIN_STEPS).astype(np.int64)
            f["train/node_bytes_recv"] = (1000 * TRAIN_STEPS).astype(np.int64)
            f["train/node_seconds"] = 0.001 * TRAIN_STEPS
    runs = [agg.read_run(hier), agg.read_run(flat)]
    assert [has_node_traffic(r) for r in runs] == [True, False]
    write_summary_csv(runs, tmp_path / "summary.csv")
    with open(tmp_path / "summary.csv") as fh:
        assert fh.readline().strip().split(",")[-len(NODE_COLUMNS):] == list(NODE_COLUMNS)
    rows = {r["run"]: r for r in read_csv(tmp_path / "summary.csv")}
    assert rows["diloco_int8"]["total_node_bytes_sent"] == str(20 * 1000 * (1 + 2 + 1 + 2))
    assert rows["diloco_fp32"]["total_node_bytes_sent"] == ""
    node = [v for (_, r, s, _, m, v) in curve_rows(runs[0]) if m == "node_bytes_sent" and r == 1]
    assert len(node) == 20 and int(node[-1]) == 40000
    assert not [m for (*_, m, _) in curve_rows(runs[1]) if m == "node_bytes_sent"]
    text = summary.format_summary(runs[0]).splitlines()
    header = next(ln for ln in text if ln.split()[:2] == ["rank", "node"])
    assert header.split()[-1] == "node_bytes"
    assert "node_bytes" not in summary.format_summary(runs[1])
