"""lsgd_hpc.aggregate on runs the trainer makes here (mpirun -np 2, digits): summary.csv against
the HDF5 read directly with h5py, and damaged copies of the runs (a truncated file, a file of
another run, another schema_version, two files claiming one rank)."""

import csv
import json
import shutil
import sys

import h5py
import numpy as np
import pytest

from lsgd_hpc.analysis import aggregate as agg
from mpi_util import REPO, run_mpi

pytestmark = pytest.mark.mpi

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
STEPS, EVAL_EVERY = 30, 5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """LSGD (two nodes of one rank: global elections) and allreduce SGD, 2 ranks, one job."""
    base = tmp_path_factory.mktemp("real")
    run_mpi(2, [sys.executable, DRIVER, str(base / "run"), "lsgd,allreduce", "--",
                "--ranks-per-node", "1", "--max-steps", str(STEPS), "--eval-every",
                str(EVAL_EVERY), "--consensus-every", "5", "--tau-global", "4", "--seed", "5"],
            timeout=300)
    return {"lsgd": base / "run-lsgd", "allreduce": base / "run-allreduce"}


def h5(run_dir, rank):
    """Rank file, read straight with h5py: attrs and every column of every group."""
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r", locking=False) as f:
        return {"attrs": dict(f.attrs), **{g: {c: f[g][c][()] for c in f[g]} for g in f}}


def read_csv(path):
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def expected_from_hdf5(run_dir, target_acc, target_loss, world=2):
    """summary.csv's figures worked out from the files, independently of the aggregator."""
    r = [h5(run_dir, k) for k in range(world)]
    ev_steps = r[0]["eval"]["step"]
    for d in r:
        assert (d["eval"]["step"] == ev_steps).all()   # every rank evaluated the same steps
    acc = np.array([d["eval"]["test_accuracy"] for d in r])          # rank x evaluation
    mean_acc = acc.mean(0)
    lead = r[0]["leader"]
    glob = lead["scope"] == 0
    el_steps, el_rank = lead["step"][glob], lead["leader_rank"][glob]
    # the leader at each evaluation: the last global election at or before it (rank 0 before
    # the first one)
    at = np.searchsorted(el_steps, ev_steps, side="right") - 1
    leaders = np.where(at >= 0, el_rank[np.maximum(at, 0)] if len(el_steps) else 0, 0)
    leader = int(leaders[-1])
    tr_steps = r[0]["train"]["step"]
    loss = np.mean([d["train"]["loss"] for d in r], 0)
    first_acc = int(np.argmax(mean_acc >= target_acc))
    first_loss = int(np.argmax(loss <= target_loss))
    s_acc, s_loss = int(ev_steps[first_acc]), int(tr_steps[first_loss])

    def sent_at(step):
        return sum(int(d["train"]["comm_bytes_sent"][d["train"]["step"] <= step][-1]) for d in r)

    return {
        "final_test_acc_mean": float(mean_acc[-1]),
        "final_test_acc_leader": float(acc[leader, -1]), "leader": leader,
        "acc_leader": acc[leaders, np.arange(len(ev_steps))],
        "total_bytes_sent": sum(int(d["train"]["comm_bytes_sent"][-1]) for d in r),
        "total_bytes_recv": sum(int(d["train"]["comm_bytes_recv"][-1]) for d in r),
        "steps": max(int(d["train"]["step"][-1]) for d in r),
        "training_time": max(float(d["train"]["training_time"][-1]) for d in r),
        "steps_to_target_acc": s_acc,
        "time_to_target_acc": max(float(d["eval"]["training_time"][first_acc]) for d in r),
        "bytes_to_target_acc": sent_at(s_acc),
        "steps_to_target_loss": s_loss,
        "time_to_target_loss": max(float(d["train"]["training_time"][first_loss]) for d in r),
        "bytes_to_target_loss": sent_at(s_loss),
        "final_consensus_distance": float(r[0]["consensus"]["distance"][-1]),
        "mean_acc": mean_acc, "loss": loss,
    }


def test_summary_csv_matches_the_hdf5(runs, tmp_path):
    ref = expected_from_hdf5(runs["lsgd"], 0.0, 0.0)
    # targets reached part-way: the mean accuracy of the second evaluation, the loss at the
    # middle step (so "first" is a real search, not the first or the last row)
    target_acc = float(ref["mean_acc"][1])
    target_loss = float(np.sort(ref["loss"])[len(ref["loss"]) // 2])
    out = tmp_path / "out"
    assert agg.main([str(runs["lsgd"]), str(runs["allreduce"]), "--out", str(out),
                     "--target-acc", repr(target_acc), "--target-loss", repr(target_loss)]) == 0
    rows = {r["algorithm"]: r for r in read_csv(out / "summary.csv")}
    for alg in ("lsgd", "allreduce"):
        exp = expected_from_hdf5(runs[alg], target_acc, target_loss)
        row = rows[alg]
        assert int(row["steps"]) == exp["steps"] == STEPS
        assert int(row["total_bytes_sent"]) == exp["total_bytes_sent"] > 0
        assert int(row["total_bytes_recv"]) == exp["total_bytes_recv"] > 0
        for c in ("final_test_acc_mean", "final_test_acc_leader", "training_time",
                  "time_to_target_acc", "time_to_target_loss", "final_consensus_distance"):
            assert float(row[c]) == pytest.approx(exp[c], rel=1e-12), (alg, c)
        for c in ("steps_to_target_acc", "bytes_to_target_acc", "steps_to_target_loss",
                  "bytes_to_target_loss"):
            assert int(row[c]) == exp[c], (alg, c)
        assert float(row["target_acc"]) == target_acc
    # LSGD's leader figure is the elected rank's model at every evaluation
    lsgd = expected_from_hdf5(runs["lsgd"], target_acc, target_loss)
    assert len(h5(runs["lsgd"], 0)["leader"]["step"]) > 0
    assert agg.eval_table(agg.read_run(runs["lsgd"]))["acc_leader"].tolist() == \
        lsgd["acc_leader"].tolist()
    assert 0 < int(rows["lsgd"]["steps_to_target_loss"]) < STEPS


def test_target_never_reached_is_empty(runs, tmp_path):
    out = tmp_path / "out"
    assert agg.main([str(runs["allreduce"]), "--out", str(out), "--target-acc", "1.0",
                     "--target-loss", "0", "--by", "algorithm"]) == 0
    row = read_csv(out / "summary.csv")[0]
    for c in ("time_to_target_acc", "steps_to_target_acc", "bytes_to_target_acc",
              "time_to_target_loss", "steps_to_target_loss", "bytes_to_target_loss"):
        assert row[c] == "", c
    group = read_csv(out / "groups.csv")[0]
    assert group["n_reached_acc"] == "0" and group["time_to_target_acc_mean"] == ""
    assert float(group["training_time_mean"]) == float(row["training_time"])


# --------------------------------------------------------------------------- damaged copies

def damaged(runs, tmp_path, alg="lsgd"):
    copy = tmp_path / f"copy-{alg}"
    shutil.copytree(runs[alg], copy)
    return copy


def aggregate_cli(run_dir, out, capsys):
    rc = agg.main([str(run_dir), "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err, (read_csv(out / "summary.csv")[0] if rc == 0 else None)


def test_truncated_file_is_skipped(runs, tmp_path, capsys):
    run = damaged(runs, tmp_path)
    bad = run / "metrics" / "rank00001.h5"
    with open(bad, "r+b") as fh:
        fh.truncate(bad.stat().st_size // 2)
    rc, err, row = aggregate_cli(run, tmp_path / "out", capsys)
    assert rc == 0
    assert len(err) == 1 and str(bad) in err[0] and "unreadable" in err[0]
    assert int(row["total_bytes_sent"]) == int(h5(runs["lsgd"], 0)["train"]["comm_bytes_sent"][-1])
    assert float(row["final_test_acc_mean"]) == \
        pytest.approx(float(h5(runs["lsgd"], 0)["eval"]["test_accuracy"][-1]))


@pytest.mark.parametrize("replaced", [0, 1])
def test_file_of_another_run_is_skipped(runs, tmp_path, capsys, replaced):
    """One file of two from another run: a tie, settled by config.yaml, whichever rank it is."""
    run = damaged(runs, tmp_path)
    foreign = run / "metrics" / f"rank{replaced:05d}.h5"
    shutil.copy(runs["allreduce"] / "metrics" / foreign.name, foreign)
    rc, err, row = aggregate_cli(run, tmp_path / "out", capsys)
    assert rc == 0 and len(err) == 1, err
    assert str(foreign) in err[0] and "another run" in err[0]
    assert "start_time" in err[0] and "algorithm" in err[0]    # says what differs
    kept = 1 - replaced
    assert row["algorithm"] == "lsgd"
    assert int(row["total_bytes_sent"]) == \
        int(h5(runs["lsgd"], kept)["train"]["comm_bytes_sent"][-1])


def restamp(path, resume):
    """Make a rank file look written by a later start of its run (a resume) or by a later
    fresh start of the same command into the same directory."""
    with h5py.File(path, "r+") as f:
        f.attrs["start_time"] = "2099" + str(f.attrs["start_time"])[4:]
        f.attrs["config"] = json.dumps({**json.loads(f.attrs["config"]), "resume": resume})


def test_a_resume_is_the_same_run(runs, tmp_path, capsys):
    """After a resume each rank restamps its file at its next flush: until every rank has,
    the files carry two start times and are still one run."""
    run = damaged(runs, tmp_path)
    restamp(run / "metrics" / "rank00001.h5", resume=True)
    rc, err, row = aggregate_cli(run, tmp_path / "out", capsys)
    assert rc == 0 and err == []
    assert int(row["total_bytes_sent"]) == \
        sum(int(h5(runs["lsgd"], k)["train"]["comm_bytes_sent"][-1]) for k in (0, 1))


def test_a_fresh_start_is_another_run(runs, tmp_path, capsys):
    run = damaged(runs, tmp_path)
    restamp(run / "metrics" / "rank00001.h5", resume=False)
    rc, err, row = aggregate_cli(run, tmp_path / "out", capsys)
    assert rc == 0 and len(err) == 1, err          # a tie: the run holding rank 0 is kept
    assert "rank00001.h5" in err[0] and "a fresh start of the same configuration" in err[0]
    assert int(row["total_bytes_sent"]) == int(h5(runs["lsgd"], 0)["train"]["comm_bytes_sent"][-1])


def test_other_schema_version_is_skipped(runs, tmp_path, capsys):
    run = damaged(runs, tmp_path)
    with h5py.File(run / "metrics" / "rank00000.h5", "r+") as f:
        f.attrs["schema_version"] = 2
    rc, err, row = aggregate_cli(run, tmp_path / "out", capsys)
    assert rc == 0 and len(err) == 1, err
    assert "rank00000.h5" in err[0] and "schema_version 2" in err[0]
    assert int(row["total_bytes_sent"]) == int(h5(runs["lsgd"], 1)["train"]["comm_bytes_sent"][-1])


def test_two_files_claiming_one_rank(runs, tmp_path, capsys):
    run = damaged(runs, tmp_path)
    metrics = run / "metrics"
    # rank 1's file copied under another name: the file named for rank 1 is kept
    shutil.copy(metrics / "rank00001.h5", metrics / "rank00007.h5")
    rc, err, row = aggregate_cli(run, tmp_path / "out", capsys)
    assert rc == 0 and len(err) == 1, err
    assert "rank00007.h5" in err[0] and "claims rank 1" in err[0] and "rank00001.h5" in err[0]
    assert int(row["total_bytes_sent"]) == \
        sum(int(h5(runs["lsgd"], k)["train"]["comm_bytes_sent"][-1]) for k in (0, 1))
    # two files claim rank 1 and neither is named for it: both skipped, both reported
    (metrics / "rank00001.h5").rename(metrics / "rank00009.h5")
    rc, err, row = aggregate_cli(run, tmp_path / "out2", capsys)
    assert rc == 0 and len(err) == 2, err
    assert {("rank00007.h5" in e, "rank00009.h5" in e) for e in err} == {(True, True)}
    assert all(e.startswith("lsgd_hpc.aggregate: warning: skipping") for e in err)
    assert int(row["total_bytes_sent"]) == int(h5(runs["lsgd"], 0)["train"]["comm_bytes_sent"][-1])


def test_nothing_readable_left_is_exit_2(runs, tmp_path, capsys):
    run = damaged(runs, tmp_path)
    for p in (run / "metrics").glob("rank*.h5"):
        with h5py.File(p, "r+") as f:
            f.attrs["schema_version"] = 7
    rc, err, _ = aggregate_cli(run, tmp_path / "out", capsys)
    assert rc == 2
    assert [e.split(":")[1].strip() for e in err] == ["warning", "warning", "error"]
    assert "no readable metrics files" in err[-1]
    # beside a good run, the bad one is only skipped
    rc = agg.main([str(run), str(runs["allreduce"]), "--out", str(tmp_path / "o2")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 0 and "skipping run" in err[-1] and str(run) in err[-1]
    assert [r["algorithm"] for r in read_csv(tmp_path / "o2" / "summary.csv")] == ["allreduce"]
