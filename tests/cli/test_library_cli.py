"""The CLI is a user of the library: it gives what the library loop gives, and its plug-ins
(--model module:callable) and new options behave as documented. Real mpirun jobs."""

import json
import sys

import h5py
import pytest

from mpi_util import REPO, run_mpi

TRAIN = [sys.executable, "-m", "lsgd_hpc.train"]


@pytest.mark.mpi
@pytest.mark.parametrize("algorithm", ["lsgd", "allreduce"])
def test_library_loop_equals_cli_step_for_step(tmp_path, algorithm):
    steps = 30
    out = tmp_path / "lib.json"
    run_mpi(4, [sys.executable, str(REPO / "tests" / "drivers" / "library_vs_cli.py"), str(out),
                algorithm, str(steps), "2"], timeout=240)
    lib = json.loads(out.read_text())
    run = tmp_path / "cli"
    extra = ["--bucket-mb", "1"] if algorithm == "allreduce" else []
    run_mpi(4, [*TRAIN, "--algorithm", algorithm, "--max-steps", str(steps), "--run-dir",
                str(run), "--ranks-per-node", "2", "--consensus-every", "0", "--seed", "0",
                *extra], timeout=240)
    for rank in range(4):
        with h5py.File(run / "metrics" / f"rank{rank:05d}.h5", "r") as f:
            cli_losses = f["train/loss"][:].tolist()
            cli_leader = [[int(s), int(c), int(r)] for s, c, r in
                          zip(f["leader/step"][:], f["leader/scope"][:], f["leader/leader_rank"][:])]
        assert cli_losses == lib[rank]["losses"], rank
        assert cli_leader == lib[rank]["leader"], rank
    if algorithm == "lsgd":
        assert len(lib[0]["leader"]) >= steps // 4


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
def test_model_factory_plugin_trains_and_bad_ones_are_usage_errors(tmp_path, forked_cli):
    (tmp_path / "usermodels.py").write_text(FACTORY)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}
    run = tmp_path / "run"
    run_mpi(2, [*TRAIN, "--model", "usermodels:make", "--optimizer", "adamw", "--lr", "0.003",
                "--max-steps", "30", "--run-dir", str(run)], env=env, cwd=tmp_path, timeout=180)
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
    proc = run_mpi(4, [*TRAIN, "--run-dir", "/proc/lsgd", "--max-steps", "2"], timeout=120,
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
def test_bf16_trains_digits_within_margin_of_fp32(tmp_path):
    acc = {}
    for precision in ("fp32", "bf16", "fp16"):
        run = tmp_path / precision
        run_mpi(2, [*TRAIN, "--precision", precision, "--epochs", "4", "--run-dir", str(run),
                    "--consensus-every", "0"], timeout=180)
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


@pytest.mark.mpi
def test_dataset_factory_plugin_trains_and_bad_ones_are_usage_errors(tmp_path, forked_cli):
    (tmp_path / "userdata.py").write_text(DATA)
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}
    run = tmp_path / "run"
    run_mpi(2, [*TRAIN, "--dataset", "userdata:digits_tensors", "--max-steps", "60",
                "--run-dir", str(run)], env=env, cwd=tmp_path, timeout=180)
    with h5py.File(run / "metrics" / "rank00000.h5", "r") as f:
        assert f["eval/test_accuracy"][-1] > 0.7
    for i, (spec, needle) in enumerate((("userdata:wrong", "returned list; it must return"),
                                        ("nosuch:f", "cannot import 'nosuch'"))):
        proc = _run_usage(i, [*TRAIN, "--dataset", spec, "--max-steps", "2", "--run-dir",
                              str(tmp_path / spec.replace(":", "_"))], env, tmp_path, forked_cli)
        _usage(proc, needle)
