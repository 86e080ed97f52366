"""--backend torch (torch.distributed: gloo on CPU) end to end: the same results as --backend mpi
under mpirun, and launches by torchrun (the CLI and a library-style script), a crash under
each launcher ending the job, and a usage error under torchrun. Every job runs under a
timeout: a hang fails the test."""

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpi_util import REPO, fault_time, mpi_env, run_group, run_mpi

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
#: one method per pattern of collectives: elections and broadcasts, non-blocking probes,
#: bucketed non-blocking allreduce, neighbour exchange (EASGD and local SGD use the blocking
#: allreduce that LSGD's consensus probes and the parallel bodies already run on both)
ALGS = ["lsgd", "lsgd-async", "allreduce", "gossip"]
SHORT = ["--ranks-per-node", "2", "--local-steps", "4", "--seed", "3", "--max-steps", "24",
         "--eval-every", "8"]


def read(run_dir: Path, n: int) -> list:
    out = []
    for r in range(n):
        with h5py.File(run_dir / "metrics" / f"rank{r:05d}.h5", "r") as f:
            out.append({g: {c: f[g][c][()] for c in f[g]} for g in f})
    return out


def torchrun(nproc: int, args: list, timeout: float = 240, env: dict | None = None):
    """``torchrun --standalone --nproc-per-node N args`` (this interpreter), in a session of
    its own killed past ``timeout``; returncode None means it hung."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *args]
    e = mpi_env(env)
    for var in [v for v in e if v.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_"))]:
        e.pop(var)       # not under mpirun or srun
    return run_group(cmd, env=e, cwd=REPO, timeout=timeout)


#: Both backends' runs in one job (a rank's python, torch and MPI start-up costs seconds):
#: lsgd_hpc.train's main once per backend and method, as tests/parallel/train_driver.py runs
#: it (with its own_options), the MPI backend's first.
BOTH = """
import sys
sys.path.insert(0, sys.argv[1])
from train_driver import own_options
from lsgd_hpc.cli import train
base, algs, short = sys.argv[2], sys.argv[3].split(","), sys.argv[4:]
for backend in ("mpi", "torch"):
    for alg in algs:
        status = train.main(["--algorithm", alg, "--run-dir", f"{base}/{backend}-{alg}",
                             *own_options(alg, ["--backend", backend, *short])])
        if status != 0:
            sys.exit(status)
"""


@pytest.fixture(scope="module")
def both_backends(tmp_path_factory):
    base = tmp_path_factory.mktemp("torchbackend")
    (base / "both.py").write_text(BOTH)
    run_mpi(4, [sys.executable, str(base / "both.py"), str(Path(DRIVER).parent), str(base),
                ",".join(ALGS), *SHORT], timeout=600)
    return {backend: {a: read(base / f"{backend}-{a}", 4) for a in ALGS}
            for backend in ("mpi", "torch")}


@pytest.mark.mpi
@pytest.mark.parametrize("alg", ALGS)
def test_same_leaders_and_accuracies_as_mpi(both_backends, alg):
    """Same seed, 4 ranks as 2 nodes: the same elections and final accuracies on both.

    lsgd-async is not deterministic on either backend: when a round happens depends on when
    its non-blocking probes complete (the number of elections differs from run to run), so
    there both runs only have to finish and learn."""
    if alg == "lsgd-async":
        for backend in ("mpi", "torch"):
            final = [r["eval"]["test_accuracy"][-1] for r in both_backends[backend][alg]]
            assert min(final) >= 0.5, (backend, final)
        return
    for a, b in zip(both_backends["mpi"][alg], both_backends["torch"][alg]):
        if "leader" in a:
            assert np.array_equal(a["leader"]["leader_rank"], b["leader"]["leader_rank"])
            assert np.array_equal(a["leader"]["step"], b["leader"]["step"])
        assert np.allclose(a["eval"]["test_accuracy"], b["eval"]["test_accuracy"],
                           rtol=0, atol=1e-6)
        assert np.allclose(a["train"]["loss"], b["train"]["loss"], rtol=1e-6, atol=1e-7)
        # the same traffic, counted the same way
        assert np.array_equal(a["train"]["comm_bytes_sent"], b["train"]["comm_bytes_sent"])


@pytest.mark.mpi
def test_torchrun_cli(tmp_path):
    run_dir = tmp_path / "run"
    proc = torchrun(2, ["-m", "lsgd_hpc.train", "--backend", "torch", "--run-dir", str(run_dir),
                        "--max-steps", "6", "--eval-every", "3", "--seed", "1"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lsgd on 2 ranks" in proc.stdout
    ranks = read(run_dir, 2)
    assert [len(r["train"]["step"]) for r in ranks] == [6, 6]
    # both ranks elected the same leaders
    assert np.array_equal(ranks[0]["leader"]["leader_rank"], ranks[1]["leader"]["leader_rank"])


LIBRARY_SCRIPT = textwrap.dedent("""
    import math, torch
    from lsgd_hpc.comm import make_world
    world = make_world("torch")
    el = world.elect(math.nan if world.rank == 0 else float(10 - world.rank))
    t = torch.full((4,), float(world.rank))
    world.allreduce_(t, "mean")
    print(f"RANK {world.rank}/{world.size} leader {el.rank} mean {t[0].item()}", flush=True)
""")


@pytest.mark.mpi
def test_torchrun_library_use(tmp_path):
    script = tmp_path / "lib.py"
    script.write_text(LIBRARY_SCRIPT)
    proc = torchrun(2, [str(script)], timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):
        assert f"RANK {r}/2 leader 1 mean 0.5" in proc.stdout


@pytest.mark.mpi
def test_usage_error_under_torchrun_is_one_line_exit_2():
    proc = torchrun(2, ["-m", "lsgd_hpc.train", "--backend", "torch", "--lr", "-1"],
                    timeout=180)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lsgd_hpc.train: error")]
    assert len(lines) == 1 and "--lr" in lines[0], proc.stderr[-3000:]
    # every rank exited 2 (torchrun itself reports the failed workers and exits 1)
    assert proc.returncode not in (0, None)
    assert "exitcode  : 2" in proc.stderr or "exitcode: 2" in proc.stderr.replace(" ", ""), \
        proc.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("launch", ["torchrun", "mpirun"])
def test_a_crash_ends_the_job(tmp_path, launch):
    """One rank raises at step 3: every rank is gone soon after, the job fails."""
    args = [DRIVER, str(tmp_path / "run"), "lsgd", "--", "--backend", "torch",
            "--max-steps", "200", "--eval-every", "100"]
    env = {"LSGD_FAULT": "raise:1:3"}
    t0 = time.time()
    if launch == "torchrun":
        proc = torchrun(2, args, timeout=180, env=env)
    else:
        proc = run_mpi(2, [sys.executable, *args], timeout=180, env=env, check=False)
    assert proc.returncode not in (0, None), proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "injected fault at step 3" in proc.stderr
    assert "FAULT_AT" in proc.stderr
    fault_at = fault_time(proc.stderr)
    assert time.time() - fault_at < 60, "the job outlived the crash by a minute"
    assert time.time() - t0 < 180


@pytest.mark.mpi
def test_error_on_some_ranks_only_is_agreed_over_the_torch_world(tmp_path):
    """Rank 1's options fail (it never learns the backend from its config): it still joins
    the torch world, and every rank exits 2 with the message printed once."""
    from mpi_util import mpirun_cmd
    good = [sys.executable, "-m", "lsgd_hpc.train", "--backend", "torch", "--max-steps", "2",
            "--run-dir", str(tmp_path / "run")]
    cmd = mpirun_cmd(1, [*good, ":", "-np", "1", *good, "--lr", "0"])
    proc = run_group(cmd, env=mpi_env(), cwd=REPO, timeout=180)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lsgd_hpc.train")]
    assert len(lines) == 1 and "--lr" in lines[0] and "on 1 of 2 ranks" in lines[0], lines
    assert "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_mpi_backend_under_torchrun_is_refused():
    proc = torchrun(2, ["-m", "lsgd_hpc.train", "--max-steps", "2"], timeout=180)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("lsgd_hpc.train: error")]
    assert len(lines) == 1 and "--backend torch" in lines[0], proc.stderr[-3000:]


@pytest.mark.mpi
def test_stalled_rank_under_torchrun_is_named_and_job_ends(tmp_path):
    """The collective watchdog on the torch backend: rank 1 sleeps in its first step, rank 0
    waits in gloo, its watchdog names rank 1 and ends its process; torchrun ends the rest."""
    t0 = time.time()
    proc = torchrun(2, ["-m", "lsgd_hpc.train", "--backend", "torch", "--run-dir",
                        str(tmp_path / "run"), "--max-steps", "30", "--straggler", "1:600",
                        "--collective-timeout", "5"], timeout=300)
    assert proc.returncode not in (0, None), proc.stderr[-3000:]
    assert "collective watchdog: rank" in proc.stderr
    assert "rank(s) 1 have not arrived" in proc.stderr, proc.stderr[-3000:]
    assert time.time() - t0 < 200


def _worker_pid(marker: str, rank: int):
    """The pid of the lsgd_hpc.train worker of torchrun with RANK=rank whose argv holds
    ``marker`` (its run directory), or None."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if b"lsgd_hpc.train" not in argv or marker.encode() not in argv:
                continue
            environ = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"TORCHELASTIC_RESTART_COUNT=0" in environ:
            return int(d.name)
    return None


@pytest.mark.mpi
def test_torchrun_restart_resumes_from_the_last_complete_checkpoint(tmp_path):
    """torchrun --max-restarts 1 and a real SIGKILL of worker 1 from outside once a
    checkpoint is complete: torchrun restarts the group (TORCHELASTIC_RESTART_COUNT=1), every
    worker resumes from the latest complete checkpoint by itself, and the run ends at its
    step budget with exit 0."""
    import json
    import signal
    import subprocess
    from mpi_util import kill_session
    run_dir = tmp_path / "run"
    steps = 60
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", "1", "-m", "lsgd_hpc.train", "--backend", "torch",
           "--run-dir", str(run_dir), "--max-steps", str(steps), "--epochs", "1000",
           "--eval-every", str(steps), "--checkpoint-every", "10", "--straggler", "1:0.1",
           "--seed", "2"]
    e = mpi_env()
    for var in [v for v in e if v.startswith(("OMPI_", "PMIX_", "PMI_", "PRTE_", "SLURM_"))]:
        e.pop(var)
    p = subprocess.Popen(cmd, env=e, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        latest = run_dir / "checkpoints" / "latest.json"
        deadline = time.monotonic() + 180
        while not latest.exists():
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "no checkpoint within 180 s"
            time.sleep(0.1)
        stopped_at = json.loads(latest.read_text())["step"]
        pid = _worker_pid(str(run_dir), 1)
        assert pid is not None, "worker 1 not found"
        os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            kill_session(p.pid)
            p.kill()
    assert p.returncode == 0, out[-3000:] + err[-3000:]
    assert stopped_at < steps
    m = re.search(r"resumed at step (\d+)", out)
    assert m and stopped_at <= int(m.group(1)) < steps, out[-3000:]
    assert f"done: {steps} steps" in out, out[-3000:]
    for r in read(run_dir, 2):
        assert int(r["train"]["step"][-1]) == steps
