"""Model zoo: digits_cnn, cnn7 (EASGD), vgg16, resnet20, mlp and mlp_wide, built by name."""

from __future__ import annotations

from typing import Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "build_model", "count_parameters",
           "DigitsCNN", "CNN7", "VGG16", "ResNet20", "MLP", "WideMLP"]

MODELS = ("digits_cnn", "cnn7", "vgg16", "resnet20", "mlp", "mlp_wide")

# Plain modules only: the training code re-seats every parameter and floating-point buffer as a
# view of one flat tensor, so no parameter sharing/tying and no parametrizations here.


def _init(module: nn.Module) -> None:
    """Kaiming (fan_out, ReLU) for convolutions, unit/zero BatchNorm, zero biases."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            # PyTorch's default (Kaiming-uniform, a=sqrt(5)) for the weight; zero bias.
            nn.init.zeros_(m.bias)


class DigitsCNN(nn.Module):
    """A very small CNN for the 1x8x8 digits images (6.1 k parameters, ~0.2 MFLOP/image).

    conv3x3(C->16)-BN-ReLU-maxpool2, conv3x3(16->32)-BN-ReLU-maxpool2, fully connected
    (32*(H/4)*(W/4) -> classes).  BatchNorm keeps plain SGD with lr 0.1 and momentum 0.9 stable
    (without it that step size oscillates around 90 %): single-process SGD with batch 32 reaches
    >= 95 % test accuracy on digits in 2-3 epochs (about 0.1 s per epoch on one core).
    """

    def __init__(self, num_classes: int, input_shape: Sequence[int]):
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(),
                                        nn.Linear(32 * (h // 4) * (w // 4), num_classes))
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class CNN7(nn.Module):
    """The 7-layer CNN used for CIFAR-10 in EASGD (Zhang, Choromanska & LeCun, NIPS 2015).

    Seven layers, counted as in that paper's description of its CIFAR model (and as reused by
    the Leader-SGD paper as "CNN7"):

    1. convolution 5x5, 64 maps, ReLU          4. max pooling 2x2 (stride 2)
    2. max pooling 2x2 (stride 2)             5. convolution 3x3, 64 maps, ReLU
    3. convolution 5x5, 128 maps, ReLU        6. fully connected -> 256, ReLU
                                              7. fully connected -> classes (softmax in the loss)

    Differences from the paper, stated plainly: the paper feeds 28x28 random crops of the
    32x32 images and uses 'valid' convolutions; here the input is the full 32x32 image (our
    augmentation is the standard pad-4 random crop back to 32x32 plus flips), convolutions are
    'same'-padded and a third 2x2 max pooling follows layer 5 so that the classifier sees
    64x4x4 features.  The layer list was reconstructed from the paper's text without access to
    its code, so treat it as "EASGD-style CNN7", not a bit-exact replica.  About 0.55 M
    parameters; no BatchNorm.
    """

    def __init__(self, num_classes: int, input_shape: Sequence[int]):
        super().__init__()
        c, h, w = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(c, 64, 5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 64, 3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * (h // 8) * (w // 8), 256), nn.ReLU(inplace=True),
            nn.Linear(256, num_classes),
        )
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


_VGG16_CFG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
              512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """VGG-16 with BatchNorm for 32x32 inputs (the usual CIFAR variant).

    Thirteen 3x3 convolutions (64-64-M-128-128-M-256x3-M-512x3-M-512x3-M), each followed by
    BatchNorm and ReLU; after five poolings a 32x32 image is 512x1x1.  Classifier as in the
    common CIFAR VGG: Dropout-Linear(512,512)-ReLU-Dropout-Linear(512,512)-ReLU-Linear(512,
    classes).  About 15.25 M parameters for 10 classes.
    """

    def __init__(self, num_classes: int, input_shape: Sequence[int]):
        super().__init__()
        c = input_shape[0]
        layers = []
        for v in _VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(0.5), nn.Linear(512, 512), nn.ReLU(inplace=True),
            nn.Dropout(0.5), nn.Linear(512, 512), nn.ReLU(inplace=True),
            nn.Linear(512, num_classes),
        )
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class _ShortcutA(nn.Module):
    """He et al.'s option A: identity shortcut, subsampled by stride, zero-padded channels."""

    def __init__(self, in_planes: int, out_planes: int, stride: int):
        super().__init__()
        self.stride = stride
        extra = out_planes - in_planes
        self.pad = (extra // 2, extra - extra // 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stride != 1:
            x = x[:, :, ::self.stride, ::self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad[0], self.pad[1]))


class _BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        if stride != 1 or in_planes != planes:
            self.shortcut: nn.Module = _ShortcutA(in_planes, planes, stride)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for CIFAR (He et al., CVPR 2016, section 4.2).

    conv3x3(16)-BN-ReLU, then 3 stages of 3 basic blocks with 16/32/64 channels (stride 2 at the
    first block of stages 2 and 3), global average pooling, fully connected -> classes.
    Shortcuts are option A of the paper (parameter-free identity with stride-2 subsampling and
    zero-padded extra channels), as in the paper's CIFAR experiments: 0.27 M parameters.
    """

    def __init__(self, num_classes: int, input_shape: Sequence[int]):
        super().__init__()
        self.conv1 = nn.Conv2d(input_shape[0], 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        blocks = []
        in_planes = 16
        for planes, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_BasicBlock(in_planes, planes, stride if i == 0 else 1))
                in_planes = planes
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(64, num_classes)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


class MLP(nn.Module):
    """A small multilayer perceptron: flatten, 256-ReLU-256-ReLU, linear -> classes."""

    def __init__(self, num_classes: int, input_shape: Sequence[int],
                 hidden: Tuple[int, ...] = (256, 256)):
        super().__init__()
        layers: list = [nn.Flatten()]
        n = int(input_shape[0]) * int(input_shape[1]) * int(input_shape[2])
        for h in hidden:
            layers += [nn.Linear(n, h), nn.ReLU(inplace=True)]
            n = h
        layers.append(nn.Linear(n, num_classes))
        self.net = nn.Sequential(*layers)
        _init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _check_shape(name: str, input_shape: Tuple[int, int, int]) -> None:
    c, h, w = input_shape
    shape = f"{c}x{h}x{w}"
    if name == "digits_cnn" and (h < 4 or w < 4):
        raise ValueError(f"model digits_cnn needs images of at least 4x4 pixels "
                         f"(two 2x2 poolings), got {shape}")
    if name == "cnn7" and (h < 8 or w < 8):
        raise ValueError(f"model cnn7 needs images of at least 8x8 pixels (three 2x2 poolings), "
                         f"got {shape}")
    if name == "vgg16" and (h, w) != (32, 32):
        raise ValueError(f"model vgg16 needs 32x32 images (five 2x2 poolings to 1x1), got {shape}")
    if name == "resnet20" and (h < 8 or w < 8):
        raise ValueError(f"model resnet20 needs images of at least 8x8 pixels, got {shape}")


class WideMLP(MLP):
    """MLP with two hidden layers of 1024 units."""

    def __init__(self, num_classes: int, input_shape: Sequence[int]):
        super().__init__(num_classes, input_shape, hidden=(1024, 1024))


_CLASSES = {"digits_cnn": DigitsCNN, "cnn7": CNN7, "vgg16": VGG16, "resnet20": ResNet20, "mlp": MLP,
            "mlp_wide": WideMLP}


def load_factory(spec: str):
    """The user's factory named ``module:callable`` (``--model`` and ``--dataset`` plug-ins);
    the module is imported as Python finds it (the working directory, PYTHONPATH).
    ValueError (one line) when it cannot be imported or is not callable."""
    import importlib
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise ValueError(f"{spec!r} is not of the form module:callable")
    try:
        module = importlib.import_module(mod)
    except Exception as exc:           # the user's module may fail in any way on import
        raise ValueError(f"cannot import {mod!r} for {spec}: {type(exc).__name__}: {exc}") from None
    obj = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"module {mod!r} has no {attr!r} (for {spec})")
    if not callable(obj):
        raise ValueError(f"{spec} is a {type(obj).__name__}, not a callable")
    return obj


def build_model(name: str, num_classes: int, input_shape: Sequence[int]) -> nn.Module:
    """The model ``name`` (one of MODELS, or a user's ``module:callable`` factory called as
    ``f(num_classes, input_shape)``) for ``num_classes`` classes and (C, H, W) inputs.

    Built-in models are float32 on the CPU.  Raises ValueError (one line) for an unknown
    name, a bad class count, an input shape the model cannot take, or a factory that fails
    or returns something other than an ``nn.Module``.
    """
    if ":" in name:
        factory = load_factory(name)
        try:
            model = factory(num_classes, tuple(int(s) for s in input_shape))
        except Exception as exc:
            raise ValueError(f"{name}({num_classes}, {tuple(input_shape)}) failed: "
                             f"{type(exc).__name__}: {exc}") from None
        if not isinstance(model, nn.Module):
            raise ValueError(f"{name} returned a {type(model).__name__}, not a torch.nn.Module")
        if not any(True for _ in model.parameters()):
            raise ValueError(f"{name} returned a model without parameters")
        return model
    if name not in _CLASSES:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"model {name} needs num_classes >= 2, got {num_classes!r}")
    try:
        shape = tuple(int(s) for s in input_shape)
    except (TypeError, ValueError):
        raise ValueError(f"model {name} needs input_shape (C, H, W), got {input_shape!r}") from None
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"model {name} needs input_shape (C, H, W) of positive sizes, "
                         f"got {tuple(input_shape)!r}")
    _check_shape(name, shape)  # type: ignore[arg-type]
    model = _CLASSES[name](num_classes, shape)
    return model.float()


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (buffers not included)."""
    return sum(p.numel() for p in model.parameters())
