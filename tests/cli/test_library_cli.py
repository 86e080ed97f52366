"""The CLI is a user of the library: it gives what the library loop gives, and its plug-ins
(--model module:callable) and new options behave as documented. Real mpirun jobs."""

import json
import sys

import h5py
import pytest

from mpi_util import REPO, run_mpi

TRAIN = [sys.executable, "-m", "lsgd_hpc.train"]

#: Several runs in one mpirun job (a rank's python, torch and MPI start-up costs seconds;
#: the suite's time), one after another: ["train", ARGS...] is lsgd_hpc.train's main, as
#: `python -m lsgd_hpc.train ARGS` runs it; ["script", PATH, ARGS...] runs that script as
#: __main__ with those arguments. A run that fails ends the job with its status.
JOB = """
import json, runpy, sys
from lsgd_hpc.cli import train
for run in json.load(open(sys.argv[1])):
    if run[0] == "script":
        sys.argv = run[1:]
        runpy.run_path(run[1], run_name="__main__")
    else:
        status = train.main(run[1:])
        if status != 0:
            sys.exit(status)
"""


def run_job(folder, np_, runs, timeout, env=None, cwd=None):
    """``runs`` (see JOB) in one ``mpirun -np np_`` job under ``timeout``."""
    (folder / "job.json").write_text(json.dumps(runs))
    (folder / "job.py").write_text(JOB)
    return run_mpi(np_, [sys.executable, str(folder / "job.py"), str(folder / "job.json")],
                   env=env, cwd=cwd, timeout=timeout)


LOOP_STEPS = 30
ALGORITHMS = ["lsgd", "allreduce"]


@pytest.fixture(scope="module")
def loop_runs(tmp_path_factory):
    """For each algorithm, the library loop (tests/drivers/library_vs_cli.py) and the CLI, at
    4 ranks as 2 nodes: all in one job."""
    base = tmp_path_factory.mktemp("loop")
    runs = []
    for algorithm in ALGORITHMS:
        extra = ["--bucket-mb", "1"] if algorithm == "allreduce" else []
        runs.append(["script", str(REPO / "tests" / "drivers" / "library_vs_cli.py"),
                     str(base / f"{algorithm}.json"), algorithm, str(LOOP_STEPS), "2"])
        runs.append(["train", "--algorithm", algorithm, "--max-steps", str(LOOP_STEPS),
                     "--run-dir", str(base / f"cli-{algorithm}"), "--ranks-per-node", "2",
                     "--consensus-every", "0", "--seed", "0", *extra])
    run_job(base, 4, runs, timeout=480)
    return base


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_library_loop_equals_cli_step_for_step(loop_runs, algorithm):
    steps = LOOP_STEPS
    lib = json.loads((loop_runs / f"{algorithm}.json").read_text())
    run = loop_runs / f"cli-{algorithm}"
    for rank in range(4):
        with h5py.File(run / "metrics" / f"rank{rank:05d}.h5", "r") as f:
            cli_losses = f["train/loss"][:].tolist()
            cli_leader = [[int(s), int(c), int(r)] for s, c, r in
                          zip(f["leader/step"][:], f["leader/scope"][:], f["leader/leader_rank"][:])]
        assert cli_losses == lib[rank]["losses"], rank
        assert cli_leader == lib[rank]["leader"], rank
    if algorithm == "lsgd":
        assert len(lib[0]["leader"]) >= steps // 4


PRECISIONS = ("fp32", "bf16", "fp16")

FACTORY = '''
import torch
from torch import nn

def make(num_classes, input_shape):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 32), nn.ReLU(), nn.Linear(32, num_classes))

def not_a_model(num_classes, input_shape):
    return "oops"

def broken(num_classes, input_shape):
    raise RuntimeError("cannot build")
'''


def _run_usage(i: int, args: list, env: dict, cwd, forked_cli) -> "subprocess.CompletedProcess":
    """The first bad case under mpirun -np 2 (every rank agrees on the one line), the others
    in one process each (the same check, without an MPI job's start-up)."""
    if i == 0:
        return run_mpi(2, args, env=env, cwd=cwd, timeout=120, check=False)
    assert args[:3] == TRAIN
    return forked_cli.run(args[3:], env=env, cwd=cwd)


def _usage(proc, needle):
    lines = [l for l in proc.stderr.splitlines() if l.startswith("lsgd_hpc.train: error:")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.mpi
def test_model_factory_plugin_trains_and_bad_ones_are_usage_errors(tmp_path, forked_cli,
                                                                   two_rank_runs):
    (tmp_path / "usermodels.py").write_text(FACTORY)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}
    run = two_rank_runs / "model-run"
    with h5py.File(run / "metrics" / "rank00000.h5", "r") as f:
        assert json.loads(f.attrs["config"])["model"] == "usermodels:make"
        assert f["eval/test_accuracy"][-1] > 0.7
    for i, (spec, needle) in enumerate((
            ("usermodels:not_a_model", "returned a str, not a torch.nn.Module"),
            ("usermodels:broken", "failed: RuntimeError: cannot build"),
            ("nosuchmodule:make", "cannot import 'nosuchmodule'"),
            ("usermodels:missing", "has no 'missing'"))):
        proc = _run_usage(i, [*TRAIN, "--model", spec, "--max-steps", "2", "--run-dir",
                              str(tmp_path / spec.replace(":", "_"))], env, tmp_path, forked_cli)
        _usage(proc, needle)


@pytest.mark.mpi
def test_run_dir_that_cannot_be_made_is_one_line_exit_2(tmp_path):
    proc = run_mpi(2, [*TRAIN, "--run-dir", "/proc/lsgd", "--max-steps", "2"], timeout=120,
                   check=False)
    _usage(proc, "run dir /proc/lsgd: cannot create or write it")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    import os
    if os.geteuid() == 0:
        return       # root writes anywhere: the /proc case above is the one that fails here
    proc = run_mpi(2, [*TRAIN, "--run-dir", str(ro / "run"), "--max-steps", "2"], timeout=120,
                   check=False)
    _usage(proc, "cannot create or write it")


@pytest.mark.mpi
def test_bf16_trains_digits_within_margin_of_fp32(two_rank_runs):
    acc = {}
    for precision in PRECISIONS:
        run = two_rank_runs / precision
        with h5py.File(run / "metrics" / "rank00000.h5", "r") as f:
            acc[precision] = float(f["eval/test_accuracy"][-1])
            if precision == "fp16":
                assert "skipped_steps" in f["train"]
    assert acc["fp32"] > 0.9
    assert acc["bf16"] >= acc["fp32"] - 0.03, acc
    assert acc["fp16"] >= acc["fp32"] - 0.03, acc


DATA = '''
import torch
from sklearn.datasets import load_digits

def digits_tensors(data_dir, seed):
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    return x[:1400], y[:1400], x[1400:], y[1400:]

def wrong(data_dir, seed):
    return [1, 2, 3]
'''


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """The 2-rank trainings of this module's tests, in one job: the model and the dataset
    plug-ins (from the folder's usermodels.py and userdata.py), and digits for 4 epochs in
    each precision; each run into its own folder."""
    base = tmp_path_factory.mktemp("trainings")
    (base / "usermodels.py").write_text(FACTORY)
    (base / "userdata.py").write_text(DATA)
    runs = [["train", "--model", "usermodels:make", "--optimizer", "adamw", "--lr", "0.003",
             "--max-steps", "30", "--run-dir", str(base / "model-run")],
            ["train", "--dataset", "userdata:digits_tensors", "--max-steps", "60",
             "--run-dir", str(base / "data-run")]]
    runs += [["train", "--precision", precision, "--epochs", "4", "--run-dir",
              str(base / precision), "--consensus-every", "0"] for precision in PRECISIONS]
    run_job(base, 2, runs, env={"PYTHONPATH": f"{base}:{REPO}"}, cwd=base, timeout=600)
    return base


@pytest.mark.mpi
def test_dataset_factory_plugin_trains_and_bad_ones_are_usage_errors(tmp_path, forked_cli,
                                                                     two_rank_runs):
    (tmp_path / "userdata.py").write_text(DATA)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}
    run = two_rank_runs / "data-run"
    with h5py.File(run / "metrics" / "rank00000.h5", "r") as f:
        assert f["eval/test_accuracy"][-1] > 0.7
    for i, (spec, needle) in enumerate((("userdata:wrong", "returned list; it must return"),
                                        ("nosuch:f", "cannot import 'nosuch'"))):
        proc = _run_usage(i, [*TRAIN, "--dataset", spec, "--max-steps", "2", "--run-dir",
                              str(tmp_path / spec.replace(":", "_"))], env, tmp_path, forked_cli)
        _usage(proc, needle)
