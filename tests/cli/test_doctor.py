"""python -m lsgd_hpc.doctor: a passing run and runs whose checks fail for real, under mpirun
-np 2 and -np 4; the judging of facts (lsgd_hpc.doctor.evaluate) for failures this machine
cannot produce (a SLURM launch, a second host, a missing interface, a broken Horovod)."""

import argparse
import json
import sys

import pytest

from lsgd_hpc.data.cifar10_files import write_cifar10_python
from lsgd_hpc.cli.doctor import evaluate, launch_method
from mpi_util import run_mpi

DOCTOR = [sys.executable, "-m", "lsgd_hpc.doctor"]
CHECKS = ["MPI library", "world size", "node layout", "GPUs", "network interfaces",
          "latency/bandwidth", "Horovod", "data folder", "run directory"]


def statuses(report):
    return {c["name"]: c["status"] for c in report["checks"]}


@pytest.mark.mpi
def test_passing_run_on_4_ranks_as_2_nodes(tmp_path):
    write_cifar10_python(str(tmp_path / "data"), per_batch=2, n_test=2)
    out = tmp_path / "doctor.json"
    proc = run_mpi(4, [*DOCTOR, "--ranks-per-node", "2", "--run-dir", str(tmp_path / "run"),
                       "--dataset", "cifar10", "--data-dir", str(tmp_path / "data"),
                       "--probe-repeats", "2", "--json", str(out)], timeout=300)
    assert proc.stdout.count("lsgd_hpc doctor: 4 rank(s)") == 1       # one table, rank 0
    assert "lsgd_hpc.doctor: all checks passed" in proc.stdout
    report = json.loads(out.read_text())
    assert list(statuses(report)) == CHECKS
    assert "FAIL" not in statuses(report).values() and report["failed"] == []
    assert len(report["facts"]) == 4
    assert "2 node(s) by --ranks-per-node 2" in proc.stdout
    # the probe measured both kinds of link between the ranks the layout implies
    assert report["probe"]["intra"]["pairs"] == [[0, 1], [2, 3]]
    assert report["probe"]["inter"]["pairs"] == [[0, 2]]
    assert "world size          ok      4 ranks (launcher=4)" in proc.stdout
    assert "cifar10 readable on every rank" in proc.stdout


@pytest.mark.mpi
def test_failing_checks_are_named_and_exit_1(tmp_path):
    """CIFAR-10 staged for rank 0 but not rank 1 (a per-rank path through $OMPI_COMM_WORLD_RANK,
    as a node-local $TMPDIR would be), and a run directory asked for more space than exists."""
    write_cifar10_python(str(tmp_path / "data0"), per_batch=2, n_test=2)
    out = tmp_path / "doctor.json"
    proc = run_mpi(2, [*DOCTOR, "--dataset", "cifar10",
                       "--data-dir", str(tmp_path / "data$OMPI_COMM_WORLD_RANK"),
                       "--run-dir", str(tmp_path / "run"), "--min-free-gb", "1e12",
                       "--no-probe", "--json", str(out)], timeout=300, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "lsgd_hpc.doctor: 2 check(s) failed: data folder, run directory" in proc.stdout
    report = json.loads(out.read_text())
    st = statuses(report)
    assert st["data folder"] == "FAIL" and st["run directory"] == "FAIL"
    assert [k for k, v in st.items() if v == "FAIL"] == ["data folder", "run directory"]
    detail = {c["name"]: c["detail"] for c in report["checks"]}
    assert detail["data folder"].startswith("ranks 1 on ")
    assert str(tmp_path / "data1") in detail["data folder"]
    assert "too little space for ranks 0, 1" in detail["run directory"]
    assert [bool(f["data_error"]) for f in report["facts"]] == [False, True]


@pytest.mark.mpi
def test_usage_error_is_one_line_once_exit_2():
    proc = run_mpi(2, [*DOCTOR, "--min-free-gb", "-1"], timeout=120, check=False)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if "lsgd_hpc.doctor: error" in ln]
    assert lines == ["lsgd_hpc.doctor: error: --min-free-gb must be >= 0"]
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ judging, without MPI

def args(**kw):
    base = dict(dataset="digits", data_dir=None, run_dir="runs", min_free_gb=1.0,
                device="cpu", backend="mpi", ranks_per_node=None)
    base.update(kw)
    return argparse.Namespace(**base)


def fact(host="a", **kw):
    f = {"host": host, "launch": "mpirun (Open MPI)", "launcher_size": None, "gpus": 0,
         "interfaces": {"lo": "127.0.0.1", "eth0": "10.0.0.1"}, "data_dir": None,
         "data_error": "", "horovod": "available",
         "run_dir": {"path": "/r", "existing": "/", "free_bytes": 10 ** 12, "writable": True}}
    f.update(kw)
    return f


def judge(facts, env=None, cuda="no", **kw):
    rows = evaluate(facts, args(**kw), env or {}, "MPI x", cuda, None)
    return {r.name: (r.status, r.detail) for r in rows}


def test_all_good_facts_pass():
    rows = judge([fact("a"), fact("a"), fact("b"), fact("b")])
    assert [k for k, (s, _) in rows.items() if s == "FAIL"] == []
    assert rows["node layout"][1].startswith("2 node(s) by host names, 2 host(s): a: ranks 0, 1;")


def test_world_size_against_slurm():
    env = {"SLURM_NTASKS": "8", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}
    facts = [fact(launch=launch_method(env))]
    assert facts[0]["launch"].startswith("srun without PMI")
    status, detail = judge(facts, env)["world size"]
    assert status == "FAIL" and "SLURM_NTASKS=8" in detail and "1 ranks" in detail
    assert judge([fact(launch="srun --mpi=pmix")] * 8, env)["world size"][0] == "ok"
    # the step's count wins over the job's
    env["SLURM_STEP_NUM_TASKS"] = "4"
    assert judge([fact(launch="srun --mpi=pmix")] * 4, env)["world size"][0] == "ok"


def test_node_layout_against_slurm_nodes():
    srun = {"SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_NUM_NODES": "2"}
    by_srun = dict(launch="srun --mpi=pmix")
    assert judge([fact("a", **by_srun), fact("a", **by_srun)], srun)["node layout"][0] == "FAIL"
    assert judge([fact("a", **by_srun), fact("b", **by_srun)], srun)["node layout"][0] == "ok"
    # mpirun inside a 2-node allocation may use one node on purpose: a warning
    assert judge([fact("a"), fact("a")], {"SLURM_JOB_NUM_NODES": "2"})["node layout"][0] == \
        "warn"
    assert judge([fact("a"), fact("a"), fact("b")])["node layout"][0] == "warn"


def test_mpirun_in_a_batch_job_ignores_the_batch_steps_counts():
    env = {"SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "1", "SLURM_JOB_ID": "7"}
    facts = [fact(launch="mpirun (Open MPI) inside a SLURM allocation", launcher_size=4)] * 4
    status, detail = judge(facts, env)["world size"]
    assert status == "ok" and detail == "4 ranks (launcher=4)"
    status, detail = judge(facts[:3], env)["world size"]
    assert status == "FAIL" and "launcher=4" in detail


def test_gpus_and_cuda_aware_mpi_with_device_cuda():
    rows = judge([fact(gpus=0), fact(gpus=0)], device="cuda")
    assert rows["GPUs"][0] == "FAIL" and rows["CUDA-aware MPI"][0] == "FAIL"
    rows = judge([fact(gpus=4), fact(gpus=4)], device="cuda", cuda="yes")
    assert rows["GPUs"][0] == "ok" and rows["CUDA-aware MPI"][0] == "ok"
    rows = judge([fact(gpus=1), fact(gpus=1)], device="cuda", cuda="unknown")
    assert rows["GPUs"][0] == "warn" and rows["CUDA-aware MPI"][0] == "warn"
    assert "CUDA-aware MPI" not in judge([fact()], device="cuda", backend="horovod")
    assert judge([fact(gpus=0)])["GPUs"][0] == "info"         # --device cpu: nothing judged


def test_interface_named_for_mpi_must_exist_on_every_node():
    env = {"OMPI_MCA_btl_tcp_if_include": "ib0"}
    facts = [fact("a", interfaces={"ib0": "10.1.0.1"}), fact("b", interfaces={"eth0": "1.2.3.4"})]
    status, detail = judge(facts, env)["network interfaces"]
    assert status == "FAIL" and "OMPI_MCA_btl_tcp_if_include=ib0 not on b" in detail
    facts[1]["interfaces"]["ib0"] = "10.1.0.2"
    assert judge(facts, env)["network interfaces"][0] == "info"


def test_horovod_states():
    assert judge([fact(horovod="not installed")])["Horovod"][0] == "info"
    assert judge([fact(horovod="not installed")], backend="horovod")["Horovod"][0] == "FAIL"
    status, detail = judge([fact(), fact(horovod="broken: ImportError: undefined symbol")])[
        "Horovod"]
    assert status == "warn" and detail.startswith("ranks 1: broken")


def test_unwritable_run_directory_fails():
    ro = fact(run_dir={"path": "/r", "existing": "/", "free_bytes": 10 ** 12, "writable": False})
    status, detail = judge([fact(), ro])["run directory"]
    assert status == "FAIL" and "cannot write a file there on ranks 1" in detail


@pytest.mark.parametrize("env,method", [
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "PMIX_RANK": "1"}, "srun --mpi=pmix"),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}, "srun without PMI"),
    ({"OMPI_COMM_WORLD_SIZE": "4", "SLURM_JOB_ID": "7"}, "mpirun (Open MPI) inside a SLURM"),
    ({"PMI_RANK": "0"}, "mpiexec"), ({}, "no launcher")])
def test_launch_method(env, method):
    assert launch_method(env).startswith(method)
