"""Preemption and exact resume, fail-fast on a rank's error or death, and bad input."""

import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from lsgd_hpc.runtime.metrics import TIME_COLUMNS
from mpi_util import REPO, fault_time, mpi_env, run_mpi

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")
SHORT = ["--ranks-per-node", "1", "--max-steps", "40", "--eval-every", "10", "--seed", "5",
         "--flush-every", "5"]


def rows(run_dir: Path, rank: int) -> dict:
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return {g: {c: f[g][c][()] for c in f[g]} for g in f}


@pytest.mark.mpi
@pytest.mark.parametrize("alg", ["lsgd", "easgd"])
def test_sigterm_checkpoint_resume_equals_uninterrupted(tmp_path, alg):
    # reference: uninterrupted
    run_mpi(2, [sys.executable, DRIVER, str(tmp_path / "ref"), alg, "--", *SHORT], timeout=300)
    # preempted: rank 1 gets SIGTERM after step 17; its flag is posted at the next
    # agreement (step 20, --stop-check-every 10) and read by every rank at step 30
    proc = run_mpi(2, [sys.executable, DRIVER, str(tmp_path / "cut"), alg, "--", *SHORT],
                   timeout=300, env={"LSGD_FAULT": "sigterm:1:17"}, check=False)
    assert proc.returncode == 143, proc.stderr[-2000:]
    assert "stop requested: checkpoint at step 30" in proc.stdout
    cut = tmp_path / f"cut-{alg}"
    assert (cut / "checkpoints" / "latest.json").is_file()
    assert len(rows(cut, 0)["train"]["step"]) == 30
    # resume through the CLI
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", alg,
                       "--run-dir", str(cut), "--resume", *SHORT], timeout=300)
    assert "resumed at step 30" in proc.stdout
    ref = tmp_path / f"ref-{alg}"
    for rank in (0, 1):
        a, b = rows(ref, rank), rows(cut, rank)
        for g in a:
            for c in a[g]:
                if c in TIME_COLUMNS:
                    assert len(a[g][c]) == len(b[g][c])
                    continue
                assert np.array_equal(a[g][c], b[g][c]), (rank, g, c)


@pytest.mark.mpi
def test_exception_on_one_rank_ends_job_fast(tmp_path):
    proc = run_mpi(4, [sys.executable, DRIVER, str(tmp_path / "r"), "lsgd", "--",
                       "--ranks-per-node", "2", "--max-steps", "100000", "--flush-every", "5"],
                   timeout=120, env={"LSGD_FAULT": "raise:2:12"}, check=False)
    ended = time.time()
    assert proc.returncode not in (0, None)
    assert "rank 2: RuntimeError: injected fault at step 12" in proc.stderr
    fault_at = fault_time(proc.stderr)
    # from the error to the end of the whole job (the other ranks would otherwise train on
    # or wait in the next collective)
    assert ended - fault_at < 30, ended - fault_at
    # what was flushed before the error is readable on every rank
    for r in range(4):
        assert len(rows(tmp_path / "r-lsgd", r)["train"]["step"]) >= 10


@pytest.mark.mpi
def test_killed_rank_ends_job_and_metrics_survive(tmp_path):
    proc = run_mpi(4, [sys.executable, DRIVER, str(tmp_path / "k"), "gossip", "--",
                       "--max-steps", "400", "--flush-every", "3"],
                   timeout=120, env={"LSGD_FAULT": "kill:1:20"}, check=False)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode not in (0, None), out
    assert "FAULT_AT" in proc.stderr, out          # it ended for the kill, not another cause
    for r in range(4):
        assert (tmp_path / "k-gossip" / "metrics" / f"rank{r:05d}.h5").is_file(), (r, out)
        t = rows(tmp_path / "k-gossip", r)["train"]
        n = len(t["step"])
        assert n >= 18 and list(t["step"]) == list(range(1, n + 1))


BAD = [
    (["--algorithm", "sgd"], "--algorithm"),
    (["--lr", "-0.1"], "--lr"),
    (["--lr", "abc"], "--lr"),
    (["--batch-size", "0"], "--batch-size"),
    (["--epochs", "nan"], "--epochs"),
    (["--momentum", "1.5"], "--momentum"),
    (["--tau-local", "3", "--tau-global", "8"], "--tau-global"),
    (["--pull-global", "2"], "--pull-global"),
    (["--algorithm", "local-sgd", "--local-steps", "0"], "--local-steps"),
    (["--algorithm", "local-sgd", "--local-steps", "often"], "--local-steps"),
    (["--algorithm", "gossip", "--topology", "moebius"], "--topology"),
    # another method's option would be ignored: refused
    (["--algorithm", "allreduce", "--tau-local", "4"], "--tau-local"),
    (["--local-steps", "4"], "--local-steps"),
    (["--dataset", "imagenet"], "--dataset"),
    (["--dataset", "cifar10", "--data-dir", "/nonexistent/cifar"], "--data-dir"),
    (["--dataset", "cifar10"], "--data-dir"),
    (["--model", "resnet1000"], "--model"),
    (["--backend", "nccl"], "--backend"),
    (["--device", "tpu"], "--device"),
    (["--ranks-per-node", "-2"], "--ranks-per-node"),
    (["--resume"], "--resume"),
    (["--easgd-alpha", "1.5"], "--easgd-alpha"),
    (["--no-such-option"], "command line"),
    (["--config", "/nonexistent.yaml"], "--config"),
    (["--batch-size", "100000"], "--batch-size"),
]


def _run_cli(args, env=None, cwd=None):
    e = mpi_env(env)
    return subprocess.run([sys.executable, "-m", "lsgd_hpc.train", *args], capture_output=True,
                          text=True, env=e, cwd=cwd or REPO, timeout=120)


def _check_one_line(proc, option):
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-1500:])
    assert len(err) == 1 and err[0].startswith("lsgd_hpc.train: error:"), proc.stderr
    assert option in err[0], err[0]
    assert "Traceback" not in proc.stderr


def test_bad_options_one_line_exit_2(tmp_path, forked_cli):
    """Each case in its own process (forked from one that imported the CLI once)."""
    for args, option in BAD:
        _check_one_line(forked_cli.run(["--run-dir", str(tmp_path / "never"), *args]), option)
    assert not (tmp_path / "never" / "metrics").exists()


def test_a_bad_option_through_python_m(tmp_path):
    """The same check through a plain `python -m lsgd_hpc.train` start."""
    args, option = BAD[0]
    _check_one_line(_run_cli(["--run-dir", str(tmp_path / "never"), *args]), option)


def test_bad_yaml_keys_and_values(tmp_path, forked_cli):
    cases = [("lr: 0.1\nfrobnicate: 3\n", "unknown key"), ("lr: [1, 2]\n", "--lr"),
             ("{{not yaml", "not valid YAML"), ("- a\n- b\n", "mapping")]
    for i, (text, expect) in enumerate(cases):
        path = tmp_path / f"c{i}.yaml"
        path.write_text(text)
        _check_one_line(forked_cli.run(["--config", str(path)]), expect)


def test_yaml_config_and_command_line_precedence(tmp_path):
    from lsgd_hpc.cli.config import parse_config
    path = tmp_path / "c.yaml"
    path.write_text("algorithm: easgd\nlr: 0.02\ntau-local: 2\ntau_global: 6\n")
    cfg = parse_config(["--config", str(path), "--lr", "0.03"], env={})
    assert (cfg.algorithm, cfg.lr, cfg.tau_local, cfg.tau_global) == ("easgd", 0.03, 2, 6)
    assert cfg.batch_size == 32     # data-set default where neither says


def test_run_dir_with_a_previous_run_is_refused(tmp_path):
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank00000.h5").write_bytes(b"x")
    _check_one_line(_run_cli(["--run-dir", str(tmp_path)]), "--run-dir")


@pytest.mark.mpi
def test_usage_error_under_mpirun_prints_once(tmp_path):
    proc = run_mpi(2, [sys.executable, "-m", "lsgd_hpc.train", "--lr", "0"], timeout=120,
                   check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("lsgd_hpc.train: error: --lr") == 1
    assert "Traceback" not in proc.stderr


def test_world_unlike_the_launchers_count():
    # One process that srun says is one of 3 tasks of its step: what srun --mpi=pmi2 gives
    # with Open MPI 5 (every task a world of its own). Checked after MPI_Init; the message
    # names the fix.
    proc = _run_cli(["--algorithm", "gossip"],
                    env={"SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3"})
    _check_one_line(proc, "srun started 3 tasks")
    assert "--mpi=pmix" in proc.stderr


@pytest.mark.mpi
def test_error_on_some_ranks_only_is_agreed(tmp_path):
    """A check that fails on rank 1 only (its own options here; on a cluster, a data folder
    one node lacks): every rank exits 2 after one collective, the message printed once."""
    from mpi_util import mpirun_cmd, run_group
    good = [sys.executable, "-m", "lsgd_hpc.train", "--max-steps", "2", "--run-dir",
            str(tmp_path / "run")]
    cmd = mpirun_cmd(1, [*good, ":", "-np", "1", *good, "--lr", "0"])
    proc = run_group(cmd, env=mpi_env(), cwd=REPO, timeout=180)
    assert proc.returncode is not None, "hung: rank 0 waits for rank 1 in a collective"
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lsgd_hpc.train")]
    assert lines == ["lsgd_hpc.train: error: --lr: must be > 0, got 0.0 (on 1 of 2 ranks, "
                     "from rank 1; host " + __import__("socket").gethostname() + ")"], lines
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "metrics").exists()


@pytest.mark.mpi
def test_hypercube_on_three_ranks_refused():
    proc = run_mpi(3, [sys.executable, "-m", "lsgd_hpc.train", "--algorithm", "gossip",
                       "--topology", "hypercube"], timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.count("lsgd_hpc.train: error: --topology") == 1


def test_cuda_device_without_gpu_is_a_usage_error():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU, so --device cuda is valid here")
    _check_one_line(_run_cli(["--device", "cuda"]), "--device")


def test_resume_with_another_rank_count_is_a_usage_error(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / "step000000010").mkdir(parents=True)
    for r in range(4):
        (ck / "step000000010" / f"rank{r:05d}.pt").write_bytes(b"")
    (ck / "latest.json").write_text('{"step": 10, "world_size": 4, "folder": "step000000010"}')
    _check_one_line(_run_cli(["--resume", "--run-dir", str(tmp_path)]), "--resume")
