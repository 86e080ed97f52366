"""Model zoo: shapes, sizes, flat-buffer compatibility, errors, and digits_cnn learning digits."""

import time

import pytest
import torch
from torch import nn

from lsgd_hpc.comm.flat import FlatParams
from lsgd_hpc.data.loaders import load_dataset
from lsgd_hpc.data.sampler import ShardedBatches
from lsgd_hpc.data.specs import dataset_spec
from lsgd_hpc.models.zoo import MODELS, build_model, count_parameters


def default_model(name):
    return dataset_spec(name).default_model

CIFAR = (3, 32, 32)
SHAPES = {"digits_cnn": (1, 8, 8), "cnn7": CIFAR, "vgg16": CIFAR, "resnet20": CIFAR, "mlp": CIFAR,
          "mlp_wide": (1, 8, 8)}
# parameter counts for 10 classes: (low, high)
COUNTS = {"digits_cnn": (3_000, 20_000), "cnn7": (400_000, 700_000),
          "vgg16": (14_500_000, 15_500_000), "resnet20": (265_000, 275_000),
          "mlp": (500_000, 1_000_000), "mlp_wide": (1_126_410, 1_126_410)}


@pytest.mark.parametrize("name", MODELS)
def test_forward_shape_and_parameter_count(name):
    torch.manual_seed(0)
    model = build_model(name, 10, SHAPES[name])
    lo, hi = COUNTS[name]
    assert lo <= count_parameters(model) <= hi
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        out = model(torch.randn(2, *SHAPES[name]))
    assert out.shape == (2, 10) and out.dtype == torch.float32 and torch.isfinite(out).all()


def test_exact_sizes_of_the_reference_models():
    assert count_parameters(build_model("resnet20", 10, CIFAR)) == 269_722   # paper: 0.27 M
    vgg = build_model("vgg16", 10, CIFAR)
    assert sum(isinstance(m, nn.Conv2d) for m in vgg.modules()) == 13
    assert [m.out_features for m in vgg.modules() if isinstance(m, nn.Linear)] == [512, 512, 10]
    res = build_model("resnet20", 10, CIFAR)
    # option A shortcuts: 19 convolutions (1 + 3 stages x 3 blocks x 2), all 3x3, no 1x1 projection
    convs = [m for m in res.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 19 and all(c.kernel_size == (3, 3) for c in convs)
    assert sum(isinstance(m, nn.Linear) for m in res.modules()) == 1   # 19 + 1 = 20 layers


@pytest.mark.parametrize("name,shape,classes", [("digits_cnn", (1, 8, 8), 3),
                                                ("mlp", (1, 8, 8), 10), ("cnn7", (3, 16, 16), 7),
                                                ("resnet20", (1, 8, 8), 10)])
def test_other_shapes_and_class_counts(name, shape, classes):
    with torch.no_grad():
        out = build_model(name, classes, shape).eval()(torch.randn(3, *shape))
    assert out.shape == (3, classes)


@pytest.mark.parametrize("name", [m for m in MODELS if m != "vgg16"])
def test_models_survive_flat_parameter_reseating(name):
    """The training code turns every parameter and float buffer into a view of one flat tensor."""
    torch.manual_seed(1)
    model = build_model(name, 10, SHAPES[name])
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(ptrs) == len(set(ptrs))                                  # no shared parameters
    x = torch.randn(4, *SHAPES[name])
    model.eval()
    with torch.no_grad():
        before = model(x)
    flat = FlatParams(model)
    assert flat.n_params == count_parameters(model)
    flat.check()
    with torch.no_grad():
        assert torch.equal(model(x), before)
        flat.params.zero_()                                            # the views are live
        assert all(float(p.abs().max()) == 0.0 for p in model.parameters())
        assert float(model(x).abs().max()) == 0.0      # last layer is a zeroed Linear


def test_convolutions_get_kaiming_init():
    torch.manual_seed(0)
    vgg = build_model("vgg16", 10, CIFAR)
    conv = [m for m in vgg.modules() if isinstance(m, nn.Conv2d)][-1]   # 512 -> 512, 3x3
    expected = (2.0 / (512 * 9)) ** 0.5                                 # fan_out, ReLU gain
    assert abs(float(conv.weight.detach().std()) / expected - 1.0) < 0.02
    assert all(float(m.bias.detach().abs().max()) == 0.0
               for m in vgg.modules() if isinstance(m, nn.Conv2d))


def test_bad_names_and_shapes_are_one_line_value_errors():
    with pytest.raises(ValueError, match="unknown model 'alexnet'") as e:
        build_model("alexnet", 10, CIFAR)
    assert "\n" not in str(e.value) and "resnet20" in str(e.value)
    with pytest.raises(ValueError, match="vgg16 needs 32x32"):
        build_model("vgg16", 10, (1, 8, 8))
    with pytest.raises(ValueError, match="cnn7"):
        build_model("cnn7", 10, (1, 8, 4))
    with pytest.raises(ValueError, match="input_shape"):
        build_model("mlp", 10, (8, 8))
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", 1, (1, 8, 8))


def test_default_models():
    assert default_model("digits") == "digits_cnn"
    assert default_model("cifar10") == "resnet20"
    assert default_model("synthetic") == "mlp"
    with pytest.raises(ValueError):
        default_model("imagenet")
    for ds, shape in (("digits", (1, 8, 8)), ("cifar10", CIFAR), ("synthetic", CIFAR)):
        assert build_model(default_model(ds), 10, shape) is not None


@pytest.mark.slow
def test_digits_cnn_learns_digits_quickly():
    """Single process, SGD lr 0.1 / momentum 0.9 / batch 32: >= 90 % (in fact ~98 %) in ~1 s.

    The time limit is on this process's CPU time, not wall time: other test jobs may share
    the machine's cores, which stretches wall time without saying anything about the model.
    """
    torch.manual_seed(0)
    ds = load_dataset("digits")
    model = build_model("digits_cnn", ds.num_classes, ds.input_shape)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    shards = ShardedBatches(ds, 0, 1, 32, seed=0)
    start, wall, accs = time.process_time(), time.perf_counter(), []
    for epoch in range(5):
        model.train()
        for x, y in shards.batches(epoch):
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            correct = sum(int((model(x).argmax(1) == y).sum()) for x, y in ds.test_batches(256))
        accs.append(correct / ds.n_test)
    cpu, wall = time.process_time() - start, time.perf_counter() - wall
    assert accs[-1] >= 0.90, accs
    assert max(accs) >= 0.95, accs
    assert cpu < 20.0, (cpu, wall)
    print(f"digits_cnn: test accuracy per epoch {accs}, {cpu:.2f} s CPU, {wall:.2f} s wall")
