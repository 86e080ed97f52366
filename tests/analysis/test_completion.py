"""The run's completion record (RUN_DIR/complete.json, lsgd_hpc.runtime.completion) and what
the offline tools make of it: ``summary`` says whether the run completed (``--check``: the
exit status), ``aggregate`` marks the runs that did not (summary.csv's ``complete`` column
and one warning each). Fake run directories, no MPI."""

import csv
import json
import subprocess
import sys

import pytest

from test_aggregate import ALLREDUCE_ACC, EASGD_ACC, LSGD_S1_ACC, REPO, write_run

from lsgd_hpc.analysis import aggregate as agg
from lsgd_hpc.analysis import summary
from lsgd_hpc.runtime.completion import (COMPLETION_FILE, clear_completion, read_completion,
                                         write_completion)


class FakeComm:
    def __init__(self, rank, size=3, initial_size=4, lost_ranks=(2,)):
        self.rank, self.size = rank, size
        self.initial_size, self.lost_ranks = initial_size, lost_ranks


def test_write_read_clear(tmp_path):
    run_dir = tmp_path / "run"
    assert read_completion(run_dir) is None
    record = write_completion(run_dir, step=600, total_steps=600, world_size=4, seconds=12.5)
    assert COMPLETION_FILE == "complete.json"
    on_disk = json.loads((run_dir / "complete.json").read_text())
    assert on_disk == record == read_completion(run_dir)
    assert (record["status"], record["step"], record["total_steps"], record["world_size"],
            record["initial_size"], record["lost_ranks"], record["requeued"],
            record["exit_status"], record["seconds"]) == \
        ("complete", 600, 600, 4, 4, [], False, 0, 12.5)
    assert "T" in record["wall_time"] and record["wall_time"].endswith("+00:00")
    assert [p.name for p in run_dir.iterdir()] == ["complete.json"]      # no temporary left
    # overwritten, not appended: the latest attempt's
    write_completion(run_dir, status="stopped", step=120, total_steps=600, world_size=4)
    assert (read_completion(run_dir)["status"], read_completion(run_dir)["exit_status"]) == \
        ("stopped", 143)
    assert clear_completion(run_dir) and read_completion(run_dir) is None
    assert not clear_completion(run_dir)
    with pytest.raises(ValueError, match="status 'done'"):
        write_completion(run_dir, status="done", step=1, total_steps=1)
    (run_dir / "complete.json").write_text("{not json")
    assert read_completion(run_dir)["status"] == "unreadable"


def test_with_a_comm_rank_0_writes_and_the_world_comes_from_it(tmp_path):
    assert write_completion(tmp_path, FakeComm(1), step=5, total_steps=5) is None
    assert read_completion(tmp_path) is None
    record = write_completion(tmp_path, FakeComm(0), step=5, total_steps=5, dataset="x")
    assert (record["world_size"], record["initial_size"], record["lost_ranks"],
            record["dataset"]) == (3, 4, [2], "x")


def test_completion_module_loads_neither_torch_nor_mpi4py():
    code = ("import sys, lsgd_hpc.runtime.completion; "
            "print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("completion")
    return {"complete": write_run(root, "done", "lsgd", 1, LSGD_S1_ACC),
            "stopped": write_run(root, "preempted", "easgd", 1, EASGD_ACC,
                                 completion="stopped"),
            "incomplete": write_run(root, "killed", "allreduce", 1, ALLREDUCE_ACC,
                                    ranks_per_node=3, completion=None)}


def _summary(run_dir, *args, capsys):
    rc = summary.main([str(run_dir), *args])
    out = capsys.readouterr()
    return rc, out.out, out.err.strip().splitlines()


def test_summary_says_whether_the_run_completed(runs, capsys):
    rc, out, err = _summary(runs["complete"], capsys=capsys)
    assert rc == 0 and err == [] and out.splitlines()[-1] == "completion: complete (20/20 steps)"
    rc, out, err = _summary(runs["incomplete"], capsys=capsys)
    assert rc == 0 and err == []         # without --check, only said
    assert out.splitlines()[-1] == (
        "completion: NOT COMPLETE: no completion record (the job ended before its budget: "
        "ranks crashed or were killed); last step 20")
    rc, out, err = _summary(runs["stopped"], capsys=capsys)
    assert rc == 0 and "completion: stopped on purpose" in out


def test_summary_check_exit_status(runs, tmp_path, capsys):
    rc, out, err = _summary(runs["complete"], "--check", capsys=capsys)
    assert rc == 0 and err == [] and "completion: complete (20/20 steps)" in out
    rc, out, err = _summary(runs["incomplete"], "--check", capsys=capsys)
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith("lsgd_hpc.summary: error: ") and "NOT COMPLETE" in err[0]
    assert "no completion record" in err[0] and "last step 20" in err[0]
    # stopped on purpose (preempted): not complete for --check, but said as a stop
    rc, out, err = _summary(runs["stopped"], "--check", capsys=capsys)
    assert rc == 1 and len(err) == 1 and "not complete: stopped on purpose" in err[0], err
    # no metrics at all (killed at start-up), no directory: not complete either
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = _summary(empty, "--check", capsys=capsys)
    assert rc == 1 and len(err) == 1 and "NOT COMPLETE" in err[0], err
    assert "completion: NOT COMPLETE" in out
    rc, out, err = _summary(tmp_path / "missing", "--check", capsys=capsys)
    assert rc == 1 and len(err) == 1 and "no run directory" in err[0], err
    with pytest.raises(SystemExit) as exc:
        summary.main([str(empty), "--check", "--follow"])
    assert exc.value.code == 2
    capsys.readouterr()


def test_summary_check_cli(runs):
    p = subprocess.run([sys.executable, "-m", "lsgd_hpc.summary", str(runs["incomplete"]),
                        "--check"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "NOT COMPLETE" in p.stderr


def test_aggregate_complete_column_and_warnings(runs, tmp_path):
    warnings = []
    res = agg.aggregate([runs[k] for k in ("complete", "stopped", "incomplete")],
                        tmp_path / "out", warn=warnings.append)
    with open(tmp_path / "out" / "summary.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert agg.SUMMARY_COLUMNS[-1] == "complete"
    assert [(r["run"], r["complete"]) for r in rows] == \
        [("done", "complete"), ("preempted", "stopped"), ("killed", "incomplete")]
    assert [r["complete"] for r in res["summary"]] == ["complete", "stopped", "incomplete"]
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith("run preempted did not complete its budget: stopped on purpose")
    assert warnings[1].startswith("run killed did not complete its budget: NOT COMPLETE: no "
                                  "completion record")
