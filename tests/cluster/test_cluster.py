"""The SLURM templates and the trainer on a real SLURM cluster: two emulated nodes
(scripts/cluster.sh: network namespaces with their own host names, munge, slurmctld, one
slurmd per node), real sbatch/srun/salloc/scontrol, real time limits, signals and requeues.

Every job runs under a timeout (a job still running past it is cancelled and the test fails).
Times from SLURM come from its job completion log (one record per job end or requeue).
The two preemption jobs overlap (one waits out its time limit while the other is requeued from
outside); one uninterrupted reference run serves both.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from cluster_util import catches, parse_time
from mpi_util import REPO, mpirun_path, run_group

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]

CIFAR_JOB = REPO / "slurm" / "lsgd_cifar.sbatch"
SWEEP_JOB = REPO / "slurm" / "sweep.sbatch"
# 2 nodes x 2 ranks, one CPU each: what this machine's cores can take.
TWO_BY_TWO = ["--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=1"]
DIGITS = ["--dataset", "digits"]
JOB_TIMEOUT = 600          # s: a job past this is cancelled and its test fails
# Columns that measure time: they differ between any two runs.
TIMING = re.compile(r"time|seconds")


# ------------------------------------------------------------------------------ helpers

def log_of(tmp_path: Path, job: int, prefix: str = "lsgd-cifar") -> str:
    path = tmp_path / f"{prefix}-{job}.out"
    return path.read_text() if path.exists() else f"(no {path.name})"


def requeued(text: str, job: int) -> bool:
    """The trainer's line for a requeue SLURM took: scontrol said ok, or the requeue ended the
    step (scontrol included) before scontrol could say so."""
    return (f"scontrol requeue {job}: ok" in text
            or f"scontrol requeue {job}: sent; SLURM ended this step" in text)


def error_lines(text: str) -> list:
    return [line for line in text.splitlines() if line.startswith("lsgd_hpc.train: error")]


def read_ranks(run_dir: Path) -> list:
    """(attributes, {group: {column: values}}) of every rank file, by rank."""
    files = sorted((run_dir / "metrics").glob("rank*.h5"))
    out = []
    for f in files:
        with h5py.File(f, "r") as h5:
            attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in h5.attrs.items()}
            groups = {g: {c: h5[g][c][()] for c in h5[g]} for g in h5
                      if isinstance(h5[g], h5py.Group)}
        out.append((attrs, groups))
    return out


def assert_two_nodes_by_hostname(cluster, run_dir: Path, world: int = 4) -> None:
    ranks = read_ranks(run_dir)
    assert len(ranks) == world, [a.get("rank") for a, _ in ranks]
    hosts = [a["hostname"] for a, _ in ranks]
    assert hosts == [cluster.nodes[0]] * 2 + [cluster.nodes[1]] * 2, hosts
    assert [int(a["node_index"]) for a, _ in ranks] == [0, 0, 1, 1]
    assert [int(a["n_nodes"]) for a, _ in ranks] == [2] * 4
    for attrs, _ in ranks:
        assert json.loads(attrs["config"])["ranks_per_node"] is None   # grouped by host name


def assert_second_node_lost(run_dir: Path, log: str, steps: int) -> None:
    """Ranks 2 and 3 (the second node) were lost: the log line names them and their node,
    and ranks 0 and 1 finished the budget with /faults rows saying so."""
    ranks = read_ranks(run_dir)
    lost_host = ranks[2][0]["hostname"]
    assert lost_host == ranks[3][0]["hostname"] != ranks[0][0]["hostname"]
    assert re.search(rf"lost rank\(s\) [23,\- ]+ \(initial numbering\) and node\(s\) "
                     rf"{re.escape(lost_host)};", log), log
    for rank in (0, 1):
        attrs, groups = ranks[rank]
        assert int(groups["train"]["step"][-1]) == steps
        faults = groups["faults"]
        assert sum(faults["n_lost"]) == 2 and faults["world_size_after"][-1] == 2
        assert faults["lost_nodes"][-1].decode() == lost_host


def submit_template(cluster, tmp_path: Path, *trainer_args: str, sbatch_args=(),
                    env: dict | None = None) -> int:
    """sbatch slurm/lsgd_cifar.sbatch from the repository, the job running in tmp_path."""
    return cluster.sbatch(f"--chdir={tmp_path}", *TWO_BY_TWO, *sbatch_args, str(CIFAR_JOB),
                          *trainer_args, env=env or cluster.env({"DATA_DIR": tmp_path / "data"}))


def wait_for(predicate, timeout: float, what: str, poll: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def train_rows(run_dir: Path, rank: int) -> int:
    try:
        with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as h5:
            return len(h5["train/step"])
    except (OSError, KeyError):
        return 0


# ------------------------------------------------------------------------------ the script

def test_script_up_status_down(cluster_nodes):
    """A second, SLURM-less cluster beside the session's: names, host names, the rate limit,
    refusal to come up twice, and a down that leaves nothing behind."""
    from cluster_util import CLUSTER_SH, free_subnet
    name = f"u{os.getpid() % 100000}"
    sh = [str(CLUSTER_SH)]
    up = subprocess.run(sh + ["up", "--name", name, "--no-slurm", "--nodes", "2", "--rate",
                              "200mbit", "--subnet", free_subnet()],
                        capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stderr
        again = subprocess.run(sh + ["up", "--name", name, "--no-slurm"], capture_output=True,
                               text=True, timeout=60)
        assert again.returncode == 1 and "already up" in again.stderr, again.stderr
        status = subprocess.run(sh + ["status", "--name", name], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0, status.stdout + status.stderr
        for i in range(2):
            node = f"{name}-node{i}"
            inside = subprocess.run(sh + ["exec", "--name", name, node, "sh", "-c",
                                          "hostname; tc qdisc show dev eth0; ip -4 -o addr"],
                                    capture_output=True, text=True, timeout=60)
            assert inside.returncode == 0, inside.stderr
            assert inside.stdout.splitlines()[0] == node
            assert re.search(r"qdisc tbf .* rate 200Mbit", inside.stdout), inside.stdout
            assert re.search(r"eth0\s+inet \S+\.1%d/24" % i, inside.stdout), inside.stdout
        # The session cluster is not touched by this one.
        assert cluster_nodes.script("status").returncode == 0
    finally:
        down = subprocess.run(sh + ["down", "--name", name], capture_output=True, text=True,
                              timeout=120)
    assert down.returncode == 0, down.stderr
    left = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"{name}-" not in left, left
    assert not Path(f"/run/lsgd-cluster/{name}").exists()
    assert cluster_nodes.script("status").returncode == 0


# ------------------------------------------------------------------------------ jobs

@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_template_on_two_nodes(slurm_cluster, tmp_path):
    """The template unmodified, digits, 2 nodes x 2 tasks: ranks grouped by host name."""
    job = submit_template(slurm_cluster, tmp_path, *DIGITS, "--max-steps", "6",
                          "--eval-every", "3")
    (rec,) = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    text = log_of(tmp_path, job)
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{rec}\n{text}"
    assert "done: 6 steps" in text and "2 node(s)" in text, text
    # the template passes no --ranks-per-node (its header's dry-run example and the dry run's
    # own hint may name the option; the trainer's options must not)
    options = [ln for ln in text.splitlines() if ln.startswith("trainer options:")]
    assert options and not any("--ranks-per-node" in ln for ln in options), options
    code = [ln for ln in CIFAR_JOB.read_text().splitlines() if not ln.lstrip().startswith("#")]
    assert not any("--ranks-per-node" in ln for ln in code)
    run_dir = tmp_path / "runs" / str(job)
    assert_two_nodes_by_hostname(slurm_cluster, run_dir)
    for rank, (attrs, groups) in enumerate(read_ranks(run_dir)):
        assert attrs["rank"] == rank and attrs["slurm_job_id"] == str(job)
        assert list(groups["train"]["step"]) == [1, 2, 3, 4, 5, 6]


GPU_JOB = REPO / "slurm" / "lsgd_gpu.sbatch"


#: the GPU template's backends run here (torch: srun --mpi=none, gloo on the CPU)
@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_gpu_template_on_two_nodes(slurm_cluster, tmp_path, backend):
    """slurm/lsgd_gpu.sbatch with --device cpu (no GPUs here), 2 nodes x 2 tasks. The
    emulated nodes declare no GPUs (no GRES), so it runs a copy without its
    --gpus-per-node line, from the repository; everything else is the template's."""
    text = GPU_JOB.read_text()
    assert "#SBATCH --gpus-per-node=" in text
    copy = tmp_path / "lsgd_gpu.sbatch"
    copy.write_text("".join(line for line in text.splitlines(keepends=True)
                            if not line.startswith("#SBATCH --gpus-per-node")))
    job = slurm_cluster.sbatch(f"--chdir={tmp_path}", *TWO_BY_TWO, str(copy), *DIGITS,
                               "--device", "cpu", "--max-steps", "6", "--eval-every", "3",
                               env=slurm_cluster.env({"LSGD_BACKEND": backend}))
    (rec,) = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    text = log_of(tmp_path, job, prefix="lsgd-gpu")
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{rec}\n{text}"
    assert f"backend: {backend}" in text and "done: 6 steps" in text, text
    run_dir = tmp_path / "runs" / str(job)
    assert_two_nodes_by_hostname(slurm_cluster, run_dir)
    for rank, (attrs, groups) in enumerate(read_ranks(run_dir)):
        config = json.loads(attrs["config"])
        assert config["backend"] == backend and config["device"] == "cpu", config
        assert list(groups["train"]["step"]) == [1, 2, 3, 4, 5, 6]
        if backend == "torch":
            # srun --mpi=none, no MPI in any rank; the template's MASTER_ADDR (first host of
            # the job's node list) and MASTER_PORT (29500 + job id % 1000)
            assert "srun --mpi=none" in text, text
            assert attrs["launcher"] == "srun" and attrs["mpi_library"] == "", attrs
            assert attrs["rendezvous"] == \
                f"{slurm_cluster.nodes[0]}:{29500 + job % 1000}", attrs["rendezvous"]


@pytest.mark.timeout(JOB_TIMEOUT + 60)
@pytest.mark.parametrize("policy", ["shrink", "heal"])
def test_a_node_lost_under_the_gpu_template_with_torchft_the_job_finishes(slurm_cluster,
                                                                         tmp_path, policy):
    """LSGD_ON_FAILURE=shrink sbatch --no-kill slurm/lsgd_gpu.sbatch (--device cpu: gloo):
    the template starts torchft's lighthouse on the batch host and every task as a replica
    group of its own; once they train, both trainers of the second node are SIGKILLed from
    outside. shrink: the job ends COMPLETED (exit 0) on the first node; the log and the
    survivors' /faults name the lost ranks and node. heal: each task starts its trainer
    again, they join the running job, and it ends COMPLETED with all four ranks at the last
    step."""
    text = GPU_JOB.read_text()
    copy = tmp_path / "lsgd_gpu.sbatch"
    copy.write_text("".join(line for line in text.splitlines(keepends=True)
                            if not line.startswith("#SBATCH --gpus-per-node")))
    steps = 300 if policy == "shrink" else 600
    slow = ["--straggler", "0:0.03"] if policy == "heal" else []   # time for the restarts
    job = slurm_cluster.sbatch(f"--chdir={tmp_path}", *TWO_BY_TWO, "--no-kill", str(copy),
                               *DIGITS, "--device", "cpu", "--algorithm", "lsgd",
                               "--max-steps", str(steps), "--epochs", "1000", "--eval-every",
                               str(steps), "--flush-every", "5", *slow,
                               env=slurm_cluster.env({"LSGD_ON_FAILURE": policy,
                                                      "LSGD_FAILURE_TIMEOUT": "5"}))
    run_dir = tmp_path / "runs" / str(job)
    try:
        wait_for(lambda: all(train_rows(run_dir, r) >= 1 for r in (2, 3)), JOB_TIMEOUT,
                 "ranks 2 and 3 training")
        pids = slurm_cluster.rank_pids(job)
        assert sorted(pids) == [0, 1, 2, 3], pids
        for rank in (2, 3):
            os.kill(pids[rank], signal.SIGKILL)
        (rec,) = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    finally:
        slurm_cluster.slurm_cmd("scancel", str(job), check=False)
        wait_for(lambda: not slurm_cluster.rank_pids(job), 60, f"job {job}'s ranks to exit")
    log = log_of(tmp_path, job, prefix="lsgd-gpu")
    assert f"on a dead rank: {policy} (torchft lighthouse http://" in log, log
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{rec}\n{log}"
    if policy == "shrink":
        assert_second_node_lost(run_dir, log, steps)
        return
    assert re.search(r"lost rank\(s\) [23,]+ \(initial numbering\)", log), log
    assert "starting it again (1 of 3)" in log, log
    joined = re.findall(r"heal: rank\(s\) ([23,]+) joined", log)
    assert sorted(",".join(joined).split(",")) == ["2", "3"], log
    for rank, (_, groups) in enumerate(read_ranks(run_dir)):
        assert int(groups["train"]["step"][-1]) == steps, rank
        assert groups["faults"]["world_size_after"][-1] == 4, rank


# ------------------------------------------------------------------------------ torch backend

def failure_text(proc) -> str:
    """What a failed job printed, c10d's per-connection warnings left out (they filled the
    excerpt CI keeps and hid the error once)."""
    err = "\n".join(ln for ln in proc.stderr.splitlines()
                     if "socket.cpp" not in ln and "[c10d]" not in ln)
    return f"exit {proc.returncode}\n--- stderr ---\n{err[-4000:]}\n--- stdout ---\n{proc.stdout[-2000:]}"


def _salloc(slurm_cluster, tmp_path: Path, *cmd: str, timeout: float = JOB_TIMEOUT):
    """salloc 2 nodes x 2 tasks, then ``srun --mpi=none`` (no MPI anywhere) of ``cmd`` in
    it; (process, job id)."""
    proc = run_group(["salloc", *TWO_BY_TWO, "srun", "--mpi=none", "-N", "2",
                      "--ntasks-per-node", "2", "--kill-on-bad-exit=1", *cmd],
                     env=slurm_cluster.env(), cwd=tmp_path, timeout=timeout)
    assert proc.returncode is not None, f"salloc srun hung\n{proc.stdout}{proc.stderr}"
    m = re.search(r"Granted job allocation (\d+)", proc.stderr)
    return proc, int(m.group(1)) if m else None


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_srun_without_mpi_torch_backend(slurm_cluster, tmp_path):
    """srun --mpi=none -N 2 --ntasks-per-node 2 python -m lsgd_hpc.train --backend torch: no
    MPI in any rank; rendezvous at the first host of the node list, port 12000 + job id %
    20000 (lsgd_hpc.launcher.slurm_master); ranks grouped by host name; it trains."""
    from lsgd_hpc.comm.launcher import SLURM_PORT_BASE, SLURM_PORT_SPAN, slurm_master
    proc, job = _salloc(slurm_cluster, tmp_path, sys.executable, "-m", "lsgd_hpc.train",
                        "--backend", "torch", *DIGITS, "--max-steps", "4", "--eval-every", "2",
                        "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, failure_text(proc)
    assert "done: 4 steps" in proc.stdout and not error_lines(proc.stderr), proc.stdout
    assert job is not None, proc.stderr
    run_dir = tmp_path / "run"
    assert_two_nodes_by_hostname(slurm_cluster, run_dir)
    port = SLURM_PORT_BASE + job % SLURM_PORT_SPAN
    nodelist = slurm_cluster.job_info(job).get("NodeList") or \
        ",".join(slurm_cluster.nodes[:2])
    assert slurm_master({"SLURM_JOB_NODELIST": nodelist, "SLURM_JOB_ID": str(job)}) == \
        (slurm_cluster.nodes[0], port)
    for rank, (attrs, groups) in enumerate(read_ranks(run_dir)):
        assert attrs["rank"] == rank and attrs["slurm_job_id"] == str(job)
        assert json.loads(attrs["config"])["backend"] == "torch"
        assert attrs["launcher"] == "srun" and attrs["mpi_library"] == "", attrs
        assert attrs["rendezvous"] == f"{slurm_cluster.nodes[0]}:{port}", attrs["rendezvous"]
        assert list(groups["train"]["step"]) == [1, 2, 3, 4]
        assert list(groups["eval"]["step"]) == [2, 4]


LIBRARY_SCRIPT = """\
import json, socket, sys
import torch
from torch import nn
import lsgd_hpc

comm = lsgd_hpc.init(backend="torch", device="cpu")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
method = lsgd_hpc.LeaderSGD(model, opt, comm, tau_local=2, tau_global=4, max_steps=12)
g = torch.Generator().manual_seed(1000 + comm.rank)
x = torch.randn(96, 10, generator=g)
y = (x[:, :3].sum(1) > 0).long() + 2 * (x[:, 3] > 0).long()
while not method.done:
    for i in range(0, 96, 32):
        loss = nn.functional.cross_entropy(model(x[i:i + 32]), y[i:i + 32])
        opt.zero_grad()
        loss.backward()
        method.step(loss)
        if method.done:
            break
steps = comm.allgather_object(method.steps)
hosts = comm.allgather_object(socket.gethostname())
with open(f"{sys.argv[1]}/rank{comm.rank}.json", "w") as fh:
    json.dump({"rank": comm.rank, "size": comm.size, "n_nodes": comm.n_nodes,
               "node_index": comm.node_index, "local_rank": comm.local_rank,
               "backend": comm.backend, "steps": steps, "hosts": hosts,
               "mpi": "mpi4py.MPI" in sys.modules}, fh)
method.close()
"""


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_library_api_torch_backend_under_srun(slurm_cluster, tmp_path):
    """A user's script: lsgd_hpc.init(backend="torch") and lsgd_hpc.LeaderSGD in its own loop,
    srun --mpi=none on 2 nodes x 2 tasks: comm.n_nodes == 2, every rank takes 12 steps."""
    script = tmp_path / "user.py"
    script.write_text(LIBRARY_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc, _ = _salloc(slurm_cluster, tmp_path, sys.executable, str(script), str(out))
    assert proc.returncode == 0, failure_text(proc)
    got = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    a, b = slurm_cluster.nodes[0], slurm_cluster.nodes[1]
    for r, g in enumerate(got):
        assert g["rank"] == r and g["size"] == 4 and g["n_nodes"] == 2, g
        assert g["node_index"] == r // 2 and g["local_rank"] == r % 2, g
        assert g["hosts"] == [a, a, b, b] and g["steps"] == [12] * 4, g
        assert g["backend"] == "torch" and not g["mpi"], g


@pytest.mark.timeout(300)
def test_srun_pmi2_says_use_pmix(slurm_cluster, tmp_path):
    """srun --mpi=pmi2 with Open MPI 5 (no PMI-2): every task is a world of its own. Exit 2,
    one line (not one per task) that names --mpi=pmix; nothing trains."""
    proc = run_group(["srun", "--mpi=pmi2", *TWO_BY_TWO, sys.executable, "-m",
                      "lsgd_hpc.train", *DIGITS, "--max-steps", "2", "--run-dir",
                      str(tmp_path / "run")],
                     env=slurm_cluster.env(), cwd=tmp_path, timeout=240)
    assert proc.returncode is not None, "srun --mpi=pmi2 hung"
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "srun started 4 tasks" in lines[0] and "--mpi=pmix" in lines[0], lines
    assert not (tmp_path / "run" / "metrics").exists()


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_mpirun_inside_sbatch(slurm_cluster, tmp_path):
    """mpirun in a batch job starts the second node's ranks through a one-task srun step:
    they see that step's SLURM variables, not the job's. It trains, on two nodes."""
    script = tmp_path / "mpirun.sbatch"
    script.write_text("#!/bin/bash\nset -e\n"
                      f"{mpirun_path()} -np 4 {sys.executable} -m lsgd_hpc.train "
                      "--dataset digits --max-steps 4 --eval-every 2 --run-dir run\n")
    job = slurm_cluster.sbatch(f"--chdir={tmp_path}", *TWO_BY_TWO, "--output=%j.out",
                               str(script))
    (rec,) = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    text = (tmp_path / f"{job}.out").read_text()
    assert rec["JobState"] == "COMPLETED" and rec["ExitCode"] == "0:0", f"{rec}\n{text}"
    assert "done: 4 steps" in text and not error_lines(text), text
    assert_two_nodes_by_hostname(slurm_cluster, tmp_path / "run")


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_mpirun_inside_salloc(slurm_cluster, tmp_path):
    """salloc runs mpirun on the submit host (here the root namespace); mpirun starts its
    daemons on both nodes with srun. It trains, on two nodes."""
    proc = run_group(["salloc", *TWO_BY_TWO, mpirun_path(), "-np", "4", sys.executable, "-m",
                      "lsgd_hpc.train", *DIGITS, "--max-steps", "4", "--eval-every", "2",
                      "--run-dir", str(tmp_path / "run")],
                     env=slurm_cluster.env(), cwd=tmp_path, timeout=JOB_TIMEOUT)
    assert proc.returncode is not None, f"salloc mpirun hung\n{proc.stdout}{proc.stderr}"
    assert proc.returncode == 0, failure_text(proc)
    assert "done: 4 steps" in proc.stdout and not error_lines(proc.stderr)
    assert_two_nodes_by_hostname(slurm_cluster, tmp_path / "run")


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_sweep_is_a_job_array(slurm_cluster, tmp_path):
    """The sweep template as a real job array: one run directory per task; an index past the
    end of the sweep file exits 2 with one line, before any rank starts."""
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("# two runs\n--algorithm allreduce --seed 1\n\n"
                     "--algorithm local-sgd --seed 2 --local-steps 2\n")
    array = slurm_cluster.sbatch(f"--chdir={tmp_path}", "--array=0-2", "--nodes=1",
                                 "--ntasks-per-node=2", "--cpus-per-task=1", str(SWEEP_JOB),
                                 str(sweep), *DIGITS, "--max-steps", "3", "--eval-every", "3",
                                 env=slurm_cluster.env({"DATA_DIR": tmp_path / "data"}))
    recs = {int(r["ArrayTaskId"]): r for r in slurm_cluster.wait_end(array, JOB_TIMEOUT, 3)}
    logs = {i: log_of(tmp_path, f"{array}_{i}", "lsgd-sweep") for i in range(3)}
    for i, (algorithm, seed) in enumerate([("allreduce", 1), ("local-sgd", 2)]):
        assert recs[i]["JobState"] == "COMPLETED", f"{recs[i]}\n{logs[i]}"
        assert f"run {i} of 0-1" in logs[i], logs[i]
        ranks = read_ranks(tmp_path / "runs" / f"sweep-{array}" / str(i))
        assert len(ranks) == 2
        for attrs, groups in ranks:
            assert attrs["algorithm"] == algorithm and json.loads(attrs["config"])["seed"] == seed
            assert attrs["slurm_job_id"] == recs[i]["JobId"]       # each task's own job id
            assert list(groups["train"]["step"]) == [1, 2, 3]
    assert recs[2]["JobState"] == "FAILED" and recs[2]["ExitCode"] == "2:0", recs[2]
    errors = [line for line in logs[2].splitlines() if "error" in line]
    assert len(errors) == 1 and "index 2 is past the end" in errors[0] and "0-1" in errors[0], \
        logs[2]
    assert not (tmp_path / "runs" / f"sweep-{array}" / "2").exists()


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_missing_data_on_one_node_is_agreed(slurm_cluster, tmp_path):
    """The data folder exists on the first node only (the second node mounts an empty
    folder over it): every rank exits 2, one line naming the second node, no hang."""
    from lsgd_hpc.data.cifar10_files import write_cifar10_python
    data = tmp_path / "data"
    write_cifar10_python(str(data), per_batch=20, n_test=20)
    node = slurm_cluster.nodes[1]
    hide = slurm_cluster.on_node(node, "mount", "-t", "tmpfs", "-o", "size=1m", "lsgd-hide",
                                 str(data))
    assert hide.returncode == 0, hide.stderr
    try:
        look = slurm_cluster.on_node(node, "ls", "-A", str(data))
        assert look.returncode == 0 and look.stdout.strip() == "", look.stdout
        assert any(data.iterdir())                     # ... still there on this machine
        job = submit_template(slurm_cluster, tmp_path, "--model", "cnn7", "--batch-size", "8",
                              "--max-steps", "2")
        (rec,) = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    finally:
        slurm_cluster.on_node(node, "umount", str(data))
    text = log_of(tmp_path, job)
    assert rec["JobState"] == "FAILED" and rec["ExitCode"] == "2:0", f"{rec}\n{text}"
    lines = error_lines(text)
    assert len(lines) == 1, text
    assert "--data-dir" in lines[0] and f"on 2 of 4 ranks, from rank 2; host {node})" in lines[0]
    assert "Traceback" not in text
    assert not (tmp_path / "runs" / str(job) / "metrics").exists()


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_killed_rank_ends_the_job(slurm_cluster, tmp_path):
    """SIGKILL to one rank under srun --kill-on-bad-exit=1 (the template's): the job ends
    within 30 s of the kill (SLURM's end time), and the other ranks' HDF5 files read back."""
    job = submit_template(slurm_cluster, tmp_path, *DIGITS, "--epochs", "100000",
                          "--flush-every", "5", "--eval-every", "50")
    run_dir = tmp_path / "runs" / str(job)
    try:
        wait_for(lambda: all(train_rows(run_dir, r) >= 10 for r in range(4)), JOB_TIMEOUT,
                 "10 flushed steps on every rank\n" + log_of(tmp_path, job), poll=0.5)
        pids = slurm_cluster.rank_pids(job)
        assert sorted(pids) == [0, 1, 2, 3], pids
        killed_at = time.time()
        os.kill(pids[2], signal.SIGKILL)
        (rec,) = slurm_cluster.wait_end(job, 120)
    finally:
        slurm_cluster.slurm_cmd("scancel", str(job), check=False)
    text = log_of(tmp_path, job)
    assert rec["JobState"] == "FAILED", f"{rec}\n{text}"
    # SLURM's end time has second resolution (rounded down).
    assert parse_time(rec["EndTime"]) - killed_at <= 30, (rec["EndTime"], killed_at, text)
    for rank, (attrs, groups) in enumerate(read_ranks(run_dir)):
        steps = list(groups["train"]["step"])
        assert len(steps) >= 10 and steps == list(range(1, len(steps) + 1)), (rank, steps)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_scancel_stays_cancelled(slurm_cluster, tmp_path):
    """scancel sends SIGTERM, as preemption does: the ranks checkpoint, but the job must not
    requeue itself (it did: a cancelled job came back). Only SIGUSR1, the time-limit warning,
    makes it requeue itself."""
    job = submit_template(slurm_cluster, tmp_path, *DIGITS, "--epochs", "100000",
                          "--flush-every", "5", "--eval-every", "50")
    run_dir = tmp_path / "runs" / str(job)
    try:
        wait_for(lambda: train_rows(run_dir, 0) >= 5, JOB_TIMEOUT,
                 "5 flushed steps\n" + log_of(tmp_path, job), poll=0.5)
        slurm_cluster.slurm_cmd("scancel", str(job))
        (rec,) = slurm_cluster.wait_end(job, 120)
        info = slurm_cluster.job_info(job)
    finally:
        slurm_cluster.slurm_cmd("scancel", str(job), check=False)
    text = log_of(tmp_path, job)
    assert rec["JobState"] == "CANCELLED", f"{rec}\n{text}"
    assert info.get("JobState") == "CANCELLED" and info.get("Restarts") == "0", f"{info}\n{text}"
    m = re.search(r"stop requested: checkpoint at step (\d+)", text)
    assert m and "scontrol requeue" not in text, text
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == int(m.group(1)) and pointer["world_size"] == 4


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_signal_during_start_up_requeues(slurm_cluster, tmp_path):
    """SIGUSR1 to every rank while it starts (handlers installed, no step yet): the ranks
    agree, nothing needs a checkpoint, the job requeues itself and then runs to the end.

    The signal goes to the ranks directly, the moment all four catch it (their handlers are
    installed before MPI and torch are imported, which takes a second or more): through
    `scancel --signal` it can take long enough on a loaded machine to arrive after the
    start-up agreement, and the stop is then (correctly) a checkpoint at the first step.
    SLURM's own delivery of SIGUSR1 is what the time-limit preemption test checks."""
    job = submit_template(slurm_cluster, tmp_path, *DIGITS, "--max-steps", "4",
                          "--eval-every", "2")
    run_dir = tmp_path / "runs" / str(job)
    pids: dict = {}
    try:
        def starting():
            pids.clear()
            pids.update(slurm_cluster.rank_pids(job))
            return len(pids) == 4 and all(catches(p, signal.SIGUSR1) for p in pids.values())
        wait_for(starting, JOB_TIMEOUT, "4 ranks catching SIGUSR1", poll=0.02)
        for pid in pids.values():
            os.kill(pid, signal.SIGUSR1)
        assert not (run_dir / "metrics").exists(), "already training: too late to test start-up"
        recs = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    finally:
        slurm_cluster.slurm_cmd("scancel", str(job), check=False)
    text = log_of(tmp_path, job)
    states = [r["JobState"] for r in slurm_cluster.records(job)]
    assert states == ["PENDING", "COMPLETED"], f"{states}\n{text}"   # requeued, then done
    assert recs[0]["ExitCode"] == "0:0"
    assert "stop requested during start-up" in text and requeued(text, job)
    assert "restart 1" in text and "done: 4 steps" in text, text
    assert "User defined signal" not in text and not error_lines(text)
    for attrs, groups in read_ranks(run_dir):
        assert list(groups["train"]["step"]) == [1, 2, 3, 4]


# ------------------------------------------------------------------------- a node lost

def _shrink_job_losing(slurm_cluster, tmp_path, steps, ranks):
    """The template with LSGD_ON_FAILURE=shrink (sbatch --no-kill) training LSGD on the
    digits; once ``ranks`` train, each is SIGKILLed from outside. Returns the job, its run
    directory, its accounting records and its log once it ended."""
    env = slurm_cluster.env({"DATA_DIR": tmp_path / "data", "LSGD_ON_FAILURE": "shrink"})
    job = submit_template(slurm_cluster, tmp_path, *DIGITS, "--algorithm", "lsgd",
                          "--max-steps", str(steps), "--epochs", "1000", "--eval-every",
                          str(steps), "--flush-every", "5", sbatch_args=["--no-kill"], env=env)
    run_dir = tmp_path / "runs" / str(job)
    try:
        wait_for(lambda: all(train_rows(run_dir, r) >= 1 for r in ranks), JOB_TIMEOUT,
                 f"rank(s) {list(ranks)} training")
        pids = slurm_cluster.rank_pids(job)
        assert sorted(pids) == [0, 1, 2, 3], pids
        for rank in ranks:
            os.kill(pids[rank], signal.SIGKILL)
        recs = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    finally:
        slurm_cluster.slurm_cmd("scancel", str(job), check=False)
        # nothing of this job may outlive it into the next test's job on the same nodes
        wait_for(lambda: not slurm_cluster.rank_pids(job), 60, f"job {job}'s ranks to exit")
    return job, run_dir, recs, log_of(tmp_path, job)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_a_node_lost_under_the_shrink_template_the_job_finishes_on_the_other(slurm_cluster,
                                                                           tmp_path):
    """LSGD_ON_FAILURE=shrink sbatch --no-kill: the template starts the ranks with mpirun
    --with-ft ulfm inside the allocation; once they train, both ranks of the second node are
    SIGKILLed from outside. The job ends COMPLETED (exit 0) on the first node, and the log
    and the survivors' /faults name the lost ranks and the lost node."""
    steps = 300
    job, run_dir, recs, text = _shrink_job_losing(slurm_cluster, tmp_path, steps, (2, 3))
    assert "mpirun --with-ft ulfm" in text and "on a dead rank: shrink" in text, text
    assert recs[0]["JobState"] == "COMPLETED" and recs[0]["ExitCode"] == "0:0", f"{recs}\n{text}"
    assert f"done: {steps} steps" in text, text
    assert_second_node_lost(run_dir, text, steps)


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_a_node_lost_under_the_heal_template_a_spare_node_takes_its_place(slurm_cluster,
                                                                         tmp_path):
    """LSGD_ON_FAILURE=heal LSGD_SPARE_NODES=1 sbatch --no-kill --nodes 3 (2 nodes train, the
    third's ranks wait as hot spares): once they train, both ranks of the second node are
    SIGKILLed from outside. The spares take their numbers and form a node group on the spare
    node; the job finishes its budget at full size on 2 nodes, COMPLETED (exit 0), and the log
    and /faults name the node lost and the spare node used."""
    if len(slurm_cluster.nodes) < 3:
        pytest.skip("needs a third node: scripts/cluster.sh up --extra-nodes 1 (as .ci/run)")
    steps = 300
    env = slurm_cluster.env({"DATA_DIR": tmp_path / "data", "LSGD_ON_FAILURE": "heal",
                             "LSGD_SPARE_NODES": "1"})
    job = slurm_cluster.sbatch(
        f"--chdir={tmp_path}", f"--partition={slurm_cluster.name}-all", "--nodes=3",
        "--ntasks-per-node=2", "--cpus-per-task=1", "--no-kill", str(CIFAR_JOB), *DIGITS,
        "--algorithm", "lsgd", "--max-steps", str(steps), "--epochs", "1000",
        "--eval-every", str(steps), "--flush-every", "5", env=env)
    run_dir = tmp_path / "runs" / str(job)
    try:
        wait_for(lambda: all(train_rows(run_dir, r) >= 1 for r in range(4)), JOB_TIMEOUT,
                 "the 4 training ranks")
        pids = slurm_cluster.rank_pids(job)
        assert sorted(pids) == list(range(6)), pids          # 4 train, 2 spares
        for rank in (2, 3):
            os.kill(pids[rank], signal.SIGKILL)
        recs = slurm_cluster.wait_end(job, JOB_TIMEOUT)
    finally:
        slurm_cluster.slurm_cmd("scancel", str(job), check=False)
        wait_for(lambda: not slurm_cluster.rank_pids(job), 60, f"job {job}'s ranks to exit")
    text = log_of(tmp_path, job)
    lost, spare = slurm_cluster.nodes[1], slurm_cluster.nodes[2]
    assert "spares: the last 1 node(s) (2 ranks)" in text, text
    assert recs[0]["JobState"] == "COMPLETED" and recs[0]["ExitCode"] == "0:0", f"{recs}\n{text}"
    assert re.search(rf"lost rank\(s\) 2,3 \(initial numbering\) and node\(s\) "
                     rf"{re.escape(lost)};", text), text
    assert "hot spare(s) take rank(s) 2,3 (0 of 2 spare(s) left)" in text, text
    assert f"heal: rank(s) 2,3 joined on node(s) {spare}; 4 ranks on 2 node(s)" in text, text
    assert "spawning" not in text and f"done: {steps} steps" in text, text
    record = json.loads((run_dir / "complete.json").read_text())
    assert record["world_size"] == 4 and record["step"] == steps, record
    ranks = read_ranks(run_dir)
    assert len(ranks) == 4                           # the spares have no files of their own
    assert [a["hostname"] for a, _ in ranks] == [slurm_cluster.nodes[0]] * 2 + [spare] * 2
    for attrs, groups in ranks:
        assert int(groups["train"]["step"][-1]) == steps
        faults = groups["faults"]
        heal = [i for i, r in enumerate(faults["replaced_ranks"]) if r]
        assert len(heal) == 1 and faults["replaced_nodes"][heal[0]].decode() == spare, faults
        assert faults["world_size_after"][heal[0]] == 4
        if int(attrs["rank"]) < 2:                   # the survivors recorded the loss
            assert lost in [n.decode() for n in faults["lost_nodes"]], faults


@pytest.mark.timeout(JOB_TIMEOUT + 60)
def test_every_rank_lost_under_the_shrink_template_the_job_fails(slurm_cluster, tmp_path):
    """LSGD_ON_FAILURE=shrink: every rank SIGKILLed once they train. mpirun --with-ft ulfm
    exits 0 all the same; the template finds no completion record (RUN_DIR/complete.json),
    says so in one line and exits 1, so SLURM marks the job FAILED (and summary --check
    agrees)."""
    job, run_dir, recs, text = _shrink_job_losing(slurm_cluster, tmp_path, 300, range(4))
    assert "mpirun --with-ft ulfm" in text, text
    assert "did not record its completion" in text, text
    assert recs[0]["JobState"] == "FAILED" and recs[0]["ExitCode"] == "1:0", f"{recs}\n{text}"
    assert not (run_dir / "complete.json").exists()
    check = subprocess.run([sys.executable, "-m", "lsgd_hpc.summary", str(run_dir), "--check"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "NOT COMPLETE" in check.stdout, check.stdout


# ------------------------------------------------------------------- preemption (long jobs)

#: The same training for every preemption job (same seed, same layout): only how it is
#: stopped differs. Many epochs: a job ends by its signal or at the --max-steps the test sets.
PREEMPT = [*DIGITS, "--seed", "3", "--epochs", "100000", "--eval-every", "50",
           "--flush-every", "10"]
#: A real time limit and warning. SLURM looks every 30 s, so SIGUSR1 comes 60-90 s after the
#: start, 30-60 s before the kill: room for a slow start (torch imports on a loaded machine)
#: and for the checkpoint and the requeue.
TIME_LIMIT = ["--time=2", "--signal=USR1@60"]
EXTRA_STEPS = 10
STOPPED = re.compile(r"stop requested: checkpoint at step (\d+)")


@pytest.fixture(scope="module")
def preemption(slurm_cluster, tmp_path_factory):
    """Two jobs preempted: one by its time limit (SIGUSR1 from SLURM), one by `scontrol
    requeue` from outside once it trains (SIGTERM); the second is submitted once the first
    trains, so that their start-ups do not compete. Each reads --max-steps from a config file,
    rewritten as soon as the job stopped, so that its second life ends EXTRA_STEPS later. Then
    an uninterrupted reference as long as the longer of the two."""
    base = tmp_path_factory.mktemp("preempt")
    jobs = {}

    def submit(what, sbatch_args):
        folder = base / what
        folder.mkdir()
        config = folder / "steps.yaml"
        config.write_text("max_steps: 1000000\n")
        job = submit_template(slurm_cluster, folder, *PREEMPT, "--config", str(config),
                              sbatch_args=sbatch_args)
        jobs[what] = dict(folder=folder, config=config, job=job, run=folder / "runs" / str(job))

    def trained(what, rows=1):
        return what in jobs and train_rows(jobs[what]["run"], 0) >= rows

    try:
        submit("time_limit", TIME_LIMIT)
        deadline = time.monotonic() + JOB_TIMEOUT
        requeued = False
        while not all("stopped" in jobs.get(w, {}) for w in ("time_limit", "requeue")):
            assert time.monotonic() < deadline, "preemption jobs did not stop in time:\n" + \
                "\n".join(log_of(i["folder"], i["job"]) for i in jobs.values())
            if "requeue" not in jobs and trained("time_limit"):
                submit("requeue", ["--time=15"])
            if not requeued and trained("requeue", 10):
                slurm_cluster.slurm_cmd("scontrol", "requeue", str(jobs["requeue"]["job"]))
                requeued = True
            for info in jobs.values():
                m = "stopped" not in info and STOPPED.search(log_of(info["folder"], info["job"]))
                if m:
                    info["stopped"] = int(m.group(1))
                    info["config"].write_text(f"max_steps: {info['stopped'] + EXTRA_STEPS}\n")
                    # Time for the second life to start and finish before another warning.
                    slurm_cluster.slurm_cmd("scontrol", "update", f"JobId={info['job']}",
                                            "TimeLimit=15")
            time.sleep(0.5)
        want = max(info["stopped"] for info in jobs.values()) + EXTRA_STEPS
        folder = base / "reference"
        folder.mkdir()
        jobs["reference"] = dict(folder=folder, job=submit_template(
            slurm_cluster, folder, *PREEMPT, "--max-steps", str(want)))
        for info in jobs.values():
            info["records"] = slurm_cluster.wait_end(info["job"], JOB_TIMEOUT)
        yield jobs
    finally:
        for info in jobs.values():
            slurm_cluster.slurm_cmd("scancel", str(info["job"]), check=False)


def _check_resumed_equals_reference(cluster, info: dict, reference: dict) -> None:
    folder, job, stopped = info["folder"], info["job"], info["stopped"]
    want = stopped + EXTRA_STEPS
    text = log_of(folder, job)
    states = [r["JobState"] for r in cluster.records(job)]
    assert states == ["PENDING", "COMPLETED"], f"{states}\n{text}"   # requeued once, then done
    assert "restart 1" in text and f"resumed at step {stopped}" in text, text
    assert f"done: {want} steps" in text and "User defined signal" not in text, text
    assert reference["records"][0]["JobState"] == "COMPLETED", reference["records"]
    cut = read_ranks(folder / "runs" / str(job))
    ref = read_ranks(reference["folder"] / "runs" / str(reference["job"]))
    assert len(cut) == len(ref) == 4
    for rank in range(4):
        a, b = cut[rank][1], ref[rank][1]
        assert list(a["train"]["step"]) == list(range(1, want + 1))
        # Evaluations every 50 steps and at each run's end: compare those at the same steps.
        common = sorted(set(a["eval"]["step"]) & set(b["eval"]["step"]))
        assert [s for s in common if s % 50 == 0] == list(range(50, want + 1, 50))
        for group in ("train", "eval"):
            rows_a = np.isin(a[group]["step"], b[group]["step"])
            rows_b = np.isin(b[group]["step"], a[group]["step"])
            assert rows_a.sum() == rows_b.sum() >= len(common)
            for column, values in a[group].items():
                if TIMING.search(column):
                    continue
                assert np.array_equal(values[rows_a], b[group][column][rows_b]), \
                    (rank, group, column)


@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_preempt_at_time_limit_resumes_exactly(slurm_cluster, preemption):
    """--time=2 --signal=USR1@60: SLURM warns the ranks, they checkpoint, the job requeues
    itself, comes back with SLURM_RESTART_COUNT=1, resumes, and its metrics equal those of
    an uninterrupted run (every column but the timings)."""
    info = preemption["time_limit"]
    assert requeued(log_of(info["folder"], info["job"]), info["job"])
    _check_resumed_equals_reference(slurm_cluster, info, preemption["reference"])


@pytest.mark.timeout(3 * JOB_TIMEOUT)
def test_preempt_by_scontrol_requeue_resumes_exactly(slurm_cluster, preemption):
    """scontrol requeue from outside (SIGTERM, SIGKILL after KillWait): the ranks checkpoint
    on SIGTERM, the job comes back, resumes, and equals the uninterrupted run."""
    _check_resumed_equals_reference(slurm_cluster, preemption["requeue"],
                                    preemption["reference"])


# ------------------------------------------------------------------------------ preflight

@pytest.mark.timeout(300)
def test_doctor_on_two_nodes(slurm_cluster, tmp_path):
    """python -m lsgd_hpc.doctor under srun --mpi=pmix, 2 nodes x 2 tasks: one table, every
    check passes, the layout names both host names, SLURM's task count agrees with the
    world, and the probe measured the link between the nodes (node 0's root to node 1's)."""
    out = tmp_path / "doctor.json"
    proc = run_group(["srun", "--mpi=pmix", *TWO_BY_TWO, sys.executable, "-m",
                      "lsgd_hpc.doctor", "--run-dir", str(tmp_path / "run"),
                      "--probe-repeats", "2", "--json", str(out)],
                     env=slurm_cluster.env(), cwd=tmp_path, timeout=240)
    assert proc.returncode is not None, "srun doctor hung"
    assert proc.returncode == 0, failure_text(proc)
    assert proc.stdout.count("lsgd_hpc doctor: 4 rank(s)") == 1
    report = json.loads(out.read_text())
    a, b = slurm_cluster.nodes[0], slurm_cluster.nodes[1]
    assert [f["host"] for f in report["facts"]] == [a, a, b, b]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["node layout"]["status"] == "ok"
    assert checks["node layout"]["detail"] == \
        f"2 node(s) by host names, 2 host(s): {a}: ranks 0, 1; {b}: ranks 2, 3"
    assert "srun --mpi=pmix" in checks["MPI library"]["detail"]
    assert checks["world size"]["status"] == "ok"
    assert checks["world size"]["detail"].startswith("4 ranks (SLURM_STEP_NUM_TASKS=4")
    assert report["probe"]["inter"]["pairs"] == [[0, 2]]
    assert report["probe"]["intra"]["pairs"] == [[0, 1], [2, 3]]
