"""The collective watchdog: numbering, the report from heartbeat files, and a stalled rank under
mpirun (it sleeps instead of calling collectives) named in a report before the job is aborted."""

import json
import subprocess
import sys

import h5py
import pytest

from mpi_util import REPO, run_mpi

from lsgd_hpc.comm.monitor import CollectiveMonitor
from lsgd_hpc.runtime.watchdog import Watchdog, heartbeat_path


def _write_heartbeat(run_dir, rank, rec):
    path = heartbeat_path(str(run_dir), rank)
    (run_dir / "heartbeat").mkdir(exist_ok=True)
    with open(path, "w") as fh:
        json.dump(rec, fh)


def test_monitor_numbers_collectives_per_communicator():
    mon = CollectiveMonitor()
    mon.step = 4
    assert mon.post("world", "allreduce_") == 1
    with mon.blocking("world", [0, 1], "barrier"):
        inside = mon.record()["inside"]
        assert inside["seq"] == 2 and inside["name"] == "barrier" and inside["step"] == 4
    assert mon.post("world/dup1", "ielect") == 1          # another communicator: own count
    rec = mon.record()
    assert rec["inside"] is None
    assert rec["entered"] == {"world": [2, "barrier", 4], "world/dup1": [1, "ielect", 4]}


def test_report_names_only_members_that_have_not_arrived(tmp_path):
    now = __import__("time").time()
    # rank 1 entered collective #3 of world; rank 2 is still at #2, rank 3 wrote no heartbeat
    _write_heartbeat(tmp_path, 1, {"rank": 1, "step": 9, "time": now,
                                   "entered": {"world": [3, "allreduce_", 9]},
                                   "inside": {"key": "world", "members": [0, 1, 2, 3], "seq": 3,
                                              "name": "allreduce_", "step": 9, "since": now}})
    _write_heartbeat(tmp_path, 2, {"rank": 2, "step": 8, "time": now,
                                   "entered": {"world": [2, "barrier", 7]}, "inside": None})
    dog = Watchdog(10, str(tmp_path), 0, abort=lambda: None)
    report = dog.report({"key": "world", "members": [0, 1, 2, 3], "seq": 3,
                         "name": "allreduce_", "step": 9, "since": now - 12})
    assert "rank(s) 2, 3 have not arrived" in report
    assert "rank 2: at step 8, last entered #2 (barrier) at step 7; outside any collective" in report
    assert "rank 3: no heartbeat file" in report
    assert "rank 1:" not in report
    assert "collective #3 (allreduce_) of communicator world at step 9" in report


def test_watchdog_thread_reports_and_aborts_a_blocked_process(tmp_path):
    """No MPI: the main thread 'blocks' in a collective nobody else joins; the thread fires."""
    script = f"""
import time
from lsgd_hpc.comm.monitor import MONITOR
from lsgd_hpc.runtime.watchdog import Watchdog
dog = Watchdog(1.0, {str(tmp_path)!r}, 0, abort=lambda: print("ABORT", flush=True),
               on_stall=lambda report: print("STALL-HOOK", flush=True), interval=0.1).start()
with MONITOR.blocking("world", [0, 1], "barrier"):
    time.sleep(60)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=50, cwd=REPO)
    assert proc.returncode == 1, proc
    assert "STALL-HOOK" in proc.stdout and "ABORT" in proc.stdout
    assert "rank(s) 1 have not arrived" in proc.stderr
    assert "rank 1: no heartbeat file" in proc.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("alg,np_,stalled", [("lsgd", 2, 1), ("lsgd-async", 4, 2)])
def test_stalled_rank_is_named_and_job_aborts(tmp_path, alg, np_, stalled):
    """One rank sleeps in its first step (a rank that stops calling collectives, not one that
    dies): the others wait (sync LSGD in its first blocking collective, async LSGD once it is
    max-staleness steps ahead), the watchdog names the sleeper, writes the metrics, and the
    job ends with status 1 long before the test's timeout kills anything."""
    run_dir = tmp_path / "run"
    proc = run_mpi(np_, [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", alg,
                         "--run-dir", str(run_dir), "--ranks-per-node", "2", "--max-steps", "30",
                         "--straggler", f"{stalled}:600", "--collective-timeout", "5"],
                   timeout=600, check=False)     # headroom for start-up on a loaded machine
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert "collective watchdog: rank" in proc.stderr
    assert f"rank(s) {stalled} have not arrived" in proc.stderr, proc.stderr[-3000:]
    assert f"rank {stalled}: at step 0" in proc.stderr
    assert "outside any collective" in proc.stderr
    rows = []
    for r in range(np_):                     # every rank's metrics file reads back
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            assert f.attrs["algorithm"] == alg
            rows.append(len(f["train"]["step"]))
    assert rows[stalled] == 0 and max(rows) >= 1, rows   # the reporters wrote what they had
    with open(heartbeat_path(str(run_dir), stalled)) as fh:
        assert json.load(fh)["inside"] is None           # it was sleeping, not waiting
