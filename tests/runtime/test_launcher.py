"""lsgd_hpc.comm.launcher: what torchrun, mpirun and srun tell a rank, read from an env dict."""

import pytest

from lsgd_hpc.comm import launcher
from lsgd_hpc.comm.launcher import (LaunchInfo, detect, env_rank, expand_hostlist,
                                       launched_alone, launcher_world_size, slurm_master,
                                       world_on_one_host)

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x",
            "GROUP_RANK": "1"}
OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "PMIX_RANK": "3", "PRTE_LAUNCHED": "1"}
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "6", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"}
SRUN = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "6", "SLURM_NTASKS": "8",
        "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_STEP_NUM_NODES": "2", "SLURM_JOB_ID": "123456"}


def test_torchrun():
    info = detect(TORCHRUN)
    assert info == LaunchInfo("torchrun", 5, 8, 1, 4, "node01", 29500)
    assert info.launched and env_rank(TORCHRUN) == 5 and not launched_alone(TORCHRUN)
    assert launcher_world_size(TORCHRUN) == ("torchrun", 8)
    assert world_on_one_host(8, TORCHRUN) is False
    assert world_on_one_host(4, TORCHRUN) is True


def test_torchrun_started_by_srun_reads_torchrun_first():
    env = {**SRUN, **TORCHRUN, "SLURM_NTASKS": "2", "SLURM_PROCID": "1"}
    assert detect(env).launcher == "torchrun" and env_rank(env) == 5
    assert launcher_world_size(env) == ("torchrun", 8)


def test_open_mpi():
    info = detect(OMPI)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == \
        ("mpirun", 3, 4, 1, 2)
    assert info.master_addr is None and info.master_port is None
    assert env_rank(OMPI) == 3 and not launched_alone(OMPI)
    assert launcher_world_size(OMPI) == ("mpirun", 4)
    assert world_on_one_host(4, {**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}) is True


def test_mpirun_inside_slurm_ignores_the_daemon_step():
    env = {**SRUN, **OMPI}
    info = detect(env)
    assert (info.launcher, info.rank, info.size, info.local_rank) == ("mpirun", 3, 4, 1)
    assert launcher_world_size(env) == ("mpirun", 4)


def test_pmix_and_hydra():
    assert detect({"PMIX_RANK": "7"}).rank == 7
    info = detect(HYDRA)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == \
        ("mpirun", 2, 6, 0, 3)
    assert launcher_world_size(HYDRA) == ("mpirun", 6)
    assert launcher_world_size({"PRTE_LAUNCHED": "1"}) == ("mpirun", None)


def test_srun_without_mpi():
    info = detect(SRUN)
    assert info == LaunchInfo("srun", 6, 8, 2, 4, "gpu07", 12000 + 123456 % 20000)
    assert env_rank(SRUN) == 6 and not launched_alone(SRUN)
    assert launcher_world_size(SRUN) == ("srun", 8)
    assert world_on_one_host(8, SRUN) is False
    # MASTER_ADDR / MASTER_PORT override what SLURM implies
    info = detect({**SRUN, "MASTER_ADDR": "login1", "MASTER_PORT": "4000"})
    assert (info.master_addr, info.master_port) == ("login1", 4000)


def test_alone():
    assert detect({}) == LaunchInfo(None, 0, None, None, None)
    assert launched_alone({}) and env_rank({}) == 0
    assert launcher_world_size({}) == (None, None)
    assert world_on_one_host(4, {}) is None
    assert env_rank({"SLURM_PROCID": "3"}) == 3     # a batch script's tasks without a step id


@pytest.mark.parametrize("spec,hosts", [
    ("node01", ["node01"]),
    ("node[01-03,7]", ["node01", "node02", "node03", "node7"]),
    ("a[1-2],b,c[09-10]", ["a1", "a2", "b", "c09", "c10"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("gpu[007-009]", ["gpu007", "gpu008", "gpu009"]),
])
def test_expand_hostlist(spec, hosts):
    assert expand_hostlist(spec) == hosts


def test_slurm_master_prefers_the_step_nodelist():
    env = {"SLURM_JOB_NODELIST": "n[1-4]", "SLURM_STEP_NODELIST": "n[3-4]", "SLURM_JOB_ID": "7"}
    assert slurm_master(env) == ("n3", 12007)
    assert slurm_master({}) == (None, None)
    assert slurm_master({"SLURM_JOB_ID": "40001"}) == (None, 12001)


def test_slurm_local_size_from_tasks_per_node():
    env = {"SLURM_STEP_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}
    assert launcher._slurm_local_size(env) == 3
    assert launcher._slurm_local_size({**env, "SLURM_NODEID": "1"}) == 4
    assert launcher._slurm_local_size({"SLURM_NODEID": "0"}) is None


def test_launch_method_names_torchrun():
    assert launcher.launch_method(TORCHRUN).startswith("torchrun")
    assert launcher.launch_method(OMPI).startswith("mpirun")


def test_module_imports_no_communication_library():
    import subprocess
    import sys
    code = ("import sys, lsgd_hpc.comm.launcher; "
            "print(any(m in sys.modules for m in ('torch', 'mpi4py')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "False", out.stderr
