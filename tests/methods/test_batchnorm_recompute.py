"""BatchNorm statistics of a model no worker trained: recomputed on training batches."""

import sys

import h5py
import numpy as np
import pytest
import torch
import yaml

from lsgd_hpc.models.batchnorm import batchnorm_layers, int_buffers, recompute_bn_stats
from lsgd_hpc.comm import FlatParams
from lsgd_hpc.data.loaders import load_dataset
from lsgd_hpc.data.sampler import ShardedBatches
from lsgd_hpc.models.zoo import build_model
from mpi_util import REPO, run_mpi

DRIVER = str(REPO / "tests" / "parallel" / "train_driver.py")


def test_recompute_is_the_average_of_training_batch_moments():
    torch.manual_seed(0)
    ds = load_dataset("digits")
    model = build_model("digits_cnn", ds.num_classes, ds.input_shape)
    flat = FlatParams(model)
    flat.flat[flat.n_params:].fill_(7.0)               # stale statistics, far off
    sampler = ShardedBatches(ds, 0, 2, 32, seed=0)
    batches = [x for x, _ in sampler.batches(0)][:5]
    first_conv, first_bn = model.features[0], batchnorm_layers(model)[0]
    assert isinstance(first_conv, torch.nn.Conv2d)
    with torch.no_grad():     # the first BatchNorm sees the first convolution's output
        acts = [first_conv(x).transpose(0, 1).reshape(first_bn.num_features, -1)
                for x in batches]
    want_mean = torch.stack([a.mean(1) for a in acts]).mean(0)
    want_var = torch.stack([a.var(1, unbiased=True) for a in acts]).mean(0)
    params = flat.params.clone()
    model.train()
    assert recompute_bn_stats(model, iter(batches)) == 5
    assert torch.allclose(first_bn.running_mean, want_mean, rtol=1e-5, atol=1e-6)
    assert torch.allclose(first_bn.running_var, want_var, rtol=1e-5, atol=1e-6)
    assert torch.equal(flat.params, params)            # parameters untouched
    assert model.training and first_bn.momentum == 0.1 # modes and momentum restored
    # the statistics stayed views of the flat buffer (what the trainer saves and restores)
    assert first_bn.running_mean.data_ptr() >= flat.flat.data_ptr()
    assert [int(b) for b in int_buffers(model)][0] == 5


def _eval_rows(run_dir, rank):
    with h5py.File(run_dir / "metrics" / f"rank{rank:05d}.h5", "r") as f:
        return {c: f["eval"][c][()] for c in f["eval"]}, f["train"]["loss"][()]


@pytest.mark.mpi
def test_easgd_centre_evaluated_with_recomputed_statistics(tmp_path):
    common = ["--max-steps", "24", "--eval-every", "6", "--seed", "4", "--consensus-every", "0"]
    for name, extra in (("off", ["--bn-recompute", "0"]), ("on", [])):
        run_mpi(2, [sys.executable, DRIVER, str(tmp_path / name), "easgd", "--", *common,
                    *extra], timeout=300)
    cfg = yaml.safe_load((tmp_path / "on-easgd" / "config.yaml").read_text())
    assert cfg["bn_recompute"] == 16                    # on by default: digits_cnn has BatchNorm
    for rank in (0, 1):
        (off, loss_off), (on, loss_on) = (_eval_rows(tmp_path / f"{n}-easgd", rank)
                                          for n in ("off", "on"))
        # the workers' own training and evaluation are not disturbed by the recompute
        assert np.array_equal(loss_off, loss_on)
        assert np.array_equal(off["test_loss"], on["test_loss"])
        assert np.array_equal(off["test_accuracy"], on["test_accuracy"])
        # the centre is evaluated with statistics of its own
        assert np.all(off["center_test_loss"] != on["center_test_loss"])
        assert np.any(off["center_test_accuracy"] != on["center_test_accuracy"])
