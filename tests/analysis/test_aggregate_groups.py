"""aggregate's --by groups, groups.csv, time to target and predicted-vs-measured, on the
schema-exact fake runs of test_aggregate (every figure below is worked out by hand from them:
/train loss 2/step + 0.1 rank, training time 0.45 step + 0.01 rank, bytes 100 (rank+1) step)."""
import csv
import math
import subprocess
import sys

import pytest

from lsgd_hpc.analysis import aggregate as agg
from lsgd_hpc.analysis import predictions as pred
from test_aggregate import REPO
from test_aggregate import runs_root  # noqa: F401 (the fake runs: a module fixture)


RUNS = ["lsgd_s1", "lsgd_s2", "easgd_s1", "allreduce_s1"]


def dirs(runs_root):
    return [runs_root / n for n in RUNS]


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def quiet(msg):
    raise AssertionError(f"unexpected warning: {msg}")


def test_by_chooses_the_groups(runs_root):
    res = agg.aggregate(dirs(runs_root), by=["world_size"], warn=quiet)
    assert [g.name for g in res["groups"]] == ["world_size=4", "world_size=2", "world_size=3"]
    assert res["groups"][0].label == "world_size=4 (2 runs)"
    # runs of different algorithms share a group when only the by keys count
    res = agg.aggregate(dirs(runs_root), by=["ranks_per_node"], warn=quiet)
    assert [[r.name for r in g.runs] for g in res["groups"]] == [
        ["lsgd_s1", "lsgd_s2", "easgd_s1"], ["allreduce_s1"]]
    res = agg.aggregate(dirs(runs_root), by=["algorithm", "world_size"], warn=quiet)
    assert [g.name for g in res["groups"]] == ["lsgd world_size=4", "easgd world_size=2",
                                               "allreduce world_size=3"]
    assert res["group_columns"][:5] == ["group", "algorithm", "world_size", "n_runs", "runs"]
    with pytest.raises(agg.AggregateError, match="--by topolgy: not a key"):
        agg.aggregate(dirs(runs_root), by=["topolgy"], warn=quiet)


def test_groups_csv_statistics(runs_root, tmp_path):
    agg.aggregate(dirs(runs_root), tmp_path, by=["algorithm"], warn=quiet)
    rows = {r["group"]: r for r in read_csv(tmp_path / "groups.csv")}
    assert list(rows) == ["lsgd", "easgd", "allreduce"]
    lsgd = rows["lsgd"]
    assert lsgd["n_runs"] == "2" and lsgd["runs"] == "lsgd_s1 lsgd_s2"
    # final leader accuracy 0.55 (seed 1) and 0.5 (seed 2): sample std = 0.05 / sqrt(2)
    assert float(lsgd["final_test_acc_leader_mean"]) == pytest.approx(0.525)
    assert float(lsgd["final_test_acc_leader_std"]) == pytest.approx(0.05 / math.sqrt(2))
    assert (float(lsgd["final_test_acc_leader_min"]), float(lsgd["final_test_acc_leader_max"])) \
        == (0.5, 0.55)
    assert float(lsgd["final_test_acc_mean_mean"]) == pytest.approx((0.7375 + 0.65) / 2)
    assert float(lsgd["total_bytes_sent_mean"]) == 100 * 20 * 10
    assert float(lsgd["training_time_max"]) == pytest.approx(0.45 * 20 + 0.03)
    assert float(lsgd["final_consensus_distance_mean"]) == pytest.approx(0.125)
    assert float(lsgd["mean_consensus_distance_mean"]) == pytest.approx((0.25 + 0.125) / 2)
    one = rows["easgd"]                       # one run: no standard deviation
    assert one["final_test_acc_leader_std"] == "" and float(one["steps_mean"]) == 20
    assert rows["allreduce"]["final_consensus_distance_mean"] == ""   # no probes


def test_time_to_target(runs_root):
    def rows(**kw):
        return {r["run"]: r for r in agg.aggregate(dirs(runs_root), warn=quiet, **kw)["summary"]}

    # mean accuracy: seed 1 0.45 at step 10, 0.7375 at 20; the leader (rank 1) 0.6 at 10
    s = rows(target_acc=0.5)["lsgd_s1"]
    assert (s["steps_to_target_acc"], s["bytes_to_target_acc"]) == (20, 20000)
    assert s["time_to_target_acc"] == pytest.approx(0.45 * 20 + 0.03)
    s = rows(target_acc=0.5, target_figure="leader")["lsgd_s1"]
    assert (s["steps_to_target_acc"], s["bytes_to_target_acc"]) == (10, 10000)
    assert s["time_to_target_acc"] == pytest.approx(0.45 * 10 + 0.03)
    assert rows(target_acc=0.95)["lsgd_s1"]["steps_to_target_acc"] is None
    # loss, mean over 4 ranks 2/s + 0.15 <= 0.42 from step 8; easgd (2 ranks) 2/s + 0.05
    # from step 6; over a window of 3 steps LSGD's (2/7 + 2/8 + 2/9)/3 + 0.15 = 0.403 at step 9
    # is the first (at 8: (2/6 + 2/7 + 2/8)/3 + 0.15 = 0.440)
    r = rows(target_loss=0.42)
    assert (r["lsgd_s1"]["steps_to_target_loss"], r["lsgd_s1"]["bytes_to_target_loss"]) == \
        (8, 8000)
    assert r["lsgd_s1"]["time_to_target_loss"] == pytest.approx(0.45 * 8 + 0.03)
    assert (r["easgd_s1"]["steps_to_target_loss"], r["easgd_s1"]["bytes_to_target_loss"]) == \
        (6, 6 * 300)
    assert rows(target_loss=0.42, loss_window=3)["lsgd_s1"]["steps_to_target_loss"] == 9
    with pytest.raises(agg.AggregateError, match="fraction"):
        agg.aggregate(dirs(runs_root), target_acc=90, warn=quiet)


PREDICTIONS = ("algorithm,gap,predicted_time_to_target_loss,note\n"
               "LSGD,1,4,a\neasgd,3,3,b\nallreduce,2,3,c\ngossip,9,9,d\n")


def test_predictions_join_and_correlate(runs_root, tmp_path):
    (tmp_path / "p.csv").write_text(PREDICTIONS)
    warnings = []
    res = agg.aggregate(dirs(runs_root), tmp_path / "out", by=["algorithm"], target_loss=0.42,
                        predictions=tmp_path / "p.csv", warn=warnings.append)
    assert sorted(warnings) == ["predictions column 'note' left out: not a number ('a')",
                                "predictions row algorithm=gossip matches no group; ignored"]
    assert res["predictors"] == ["gap", "predicted_time_to_target_loss"]
    groups = {r["group"]: r for r in read_csv(tmp_path / "out" / "groups.csv")}
    assert groups["lsgd"]["gap"] == "1.0" and groups["easgd"]["gap"] == "3.0"
    # measured time to loss 0.42: easgd 2.71 s < allreduce 3.17 s < lsgd 3.63 s
    assert [float(groups[g]["time_to_target_loss_mean"]) for g in ("easgd", "allreduce",
                                                                   "lsgd")] == \
        pytest.approx([2.71, 3.17, 3.63])
    corr = {(r["predictor"], r["measured"]): r for r in read_csv(tmp_path / "out" /
                                                                 "correlations.csv")}
    gap = corr[("gap", "time_to_target_loss")]
    assert (gap["n_groups"], float(gap["spearman"]), float(gap["kendall"])) == ("3", -1.0, -1.0)
    # predicted (4, 3, 3) against measured ranks (3, 1, 2): tie -> rho = 1.5/sqrt(3),
    # tau-b = 2/sqrt(2*3)
    own = corr[("predicted_time_to_target_loss", "time_to_target_loss")]
    assert float(own["spearman"]) == pytest.approx(1.5 / math.sqrt(3))
    assert float(own["kendall"]) == pytest.approx(2 / math.sqrt(6))
    # figures equal in every group (steps) are no ordering to predict: left out
    assert ("gap", "steps") not in corr and ("gap", "final_test_acc_leader") in corr
    names = sorted(p.name for p in res["plots"] if p.name.startswith("pred_"))
    assert names == ["pred_gap_vs_time_to_target_loss.png",
                     "pred_predicted_time_to_target_loss_vs_time_to_target_loss.png"]
    for p in names:
        assert (tmp_path / "out" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_predictions_as_rows_numbers_and_missing_groups(runs_root):
    warnings = []
    res = agg.aggregate(dirs(runs_root), by=["world_size"], target_loss=0.42, warn=warnings.append,
                        predictions=[{"world_size": "4.0", "enn": 2.5},
                                     {"world_size": 2, "enn": 1.5}])
    assert warnings == ["group 'world_size=3' has no row in the predictions"]
    assert [r["enn"] for r in res["group_rows"]][:2] == [2.5, 1.5]
    assert math.isnan(res["group_rows"][2]["enn"])
    row = next(r for r in res["correlations"] if r["measured"] == "time_to_target_loss")
    assert row["n_groups"] == 2 and row["spearman"] == pytest.approx(1.0)
    assert res["plots"] == []                      # no out_dir: tables only


def test_units_decide_the_identity_line():
    assert pred.predictor_unit("predicted_time_to_target_loss") == "s"
    assert pred.predictor_unit("predicted_time") == "s"
    assert pred.predictor_unit("predicted_steps_to_target_acc") == "steps"
    assert pred.predictor_unit("spectral_gap") is None
    assert pred.predictor_unit("effective_neighbors") is None
    assert pred.measured_unit("mean_consensus_distance") is None
    assert pred.measured_unit("bytes_to_target_acc") == "B"


def test_predictions_errors(runs_root, tmp_path):
    (tmp_path / "p.csv").write_text("topology,gap\nring,1\n")
    with pytest.raises(agg.AggregateError, match="give --by"):
        agg.aggregate(dirs(runs_root), predictions=tmp_path / "p.csv", warn=quiet)
    with pytest.raises(agg.AggregateError, match="lack the grouping column.*algorithm"):
        agg.aggregate(dirs(runs_root), by=["algorithm"], predictions=tmp_path / "p.csv", warn=quiet)
    with pytest.raises(agg.AggregateError, match="cannot plot against bogus"):
        agg.aggregate(dirs(runs_root), by=["algorithm"], plot_measured=["bogus"], warn=quiet)


def test_cli_options(runs_root, tmp_path, capsys):
    (tmp_path / "p.csv").write_text(PREDICTIONS)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "lsgd_hpc.aggregate", *map(str, dirs(runs_root)),
           "--out", str(out),
           "--by", "algorithm", "--target-acc", "0.5", "--target-loss", "0.42",
           "--predictions", str(tmp_path / "p.csv"), "--plot-measured",
           "time_to_target_acc,mean_consensus_distance"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert len(p.stderr.strip().splitlines()) == 2            # the two warnings
    # each predictor against the figures asked for; predicted_<figure> against <figure> too
    assert sorted(x.name for x in out.glob("pred_*.png")) == [
        "pred_gap_vs_mean_consensus_distance.png", "pred_gap_vs_time_to_target_acc.png",
        "pred_predicted_time_to_target_loss_vs_mean_consensus_distance.png",
        "pred_predicted_time_to_target_loss_vs_time_to_target_acc.png",
        "pred_predicted_time_to_target_loss_vs_time_to_target_loss.png"]
    summary = read_csv(out / "summary.csv")
    assert summary[0]["steps_to_target_acc"] == "20" and summary[0]["steps_to_target_loss"] == "8"
    # the refusal from the same main() in this process (one torch import less)
    try:
        code = agg.main(cmd[3:-2] + ["--by", "nokey"])
    except SystemExit as exc:                # argparse's refusals
        code = exc.code
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "nokey" in lines[0], lines
