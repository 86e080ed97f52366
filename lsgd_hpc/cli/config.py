"""Training options: defaults, YAML config files, command line, and validation before any MPI call."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, List, Optional, Sequence

import yaml

__all__ = ["Config", "ConfigError", "parse_config", "check_world", "launcher_world_size",
           "option_group", "ALGORITHMS", "DATASET_DEFAULTS", "GROUPS", "straggler_of"]

ALGORITHMS = ("lsgd", "lsgd-async", "allreduce", "easgd", "local-sgd", "diloco", "slowmo",
              "gossip")
BACKENDS = ("mpi", "horovod", "torch")
LR_SCHEDULES = ("constant", "step", "cosine")
OPTIMIZERS = ("sgd", "adamw")
PRECISIONS = ("fp32", "bf16", "fp16")
COMM_DTYPES = ("fp32", "bf16")
LSGD_BN = ("keep", "copy", "pull")
LEADER_SCORES = ("train", "heldout")


class ConfigError(ValueError):
    """A user's mistake in an option: ``option`` names it, the message says why."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


@dataclass
class Config:
    """Every option of ``python -m lsgd_hpc.train``; field names are the options' with ``_``."""

    algorithm: str = "lsgd"
    topology: str = "ring"
    dataset: str = "digits"
    data_dir: Optional[str] = None
    model: Optional[str] = None            # None: the dataset's default model
    epochs: Optional[float] = None         # None: the dataset's default (see DATASET_DEFAULTS)
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    lr_schedule: str = "constant"
    momentum: float = 0.9
    optimizer: str = "sgd"
    grad_clip: Optional[float] = None     # max global gradient norm; None: no clipping
    warmup_steps: int = 0                 # linear warmup of the learning rate
    precision: str = "fp32"
    comm_dtype: str = "fp32"              # what the methods send: fp32, or bf16 (half the bytes)
    weight_decay: float = 1e-4
    seed: int = 0
    run_dir: Optional[str] = None
    resume: bool = False
    tau_local: Optional[int] = None
    tau_global: Optional[int] = None
    pull_local: float = 0.1
    pull_global: float = 0.1
    leader_window: int = 10
    leader_score: str = "train"           # LSGD: election score, train window or held-out slice
    heldout_size: Optional[int] = None    # heldout: samples; None: 10% of training, at most 256
    validation_size: int = 0              # training samples held out for validation; 0 = none
    max_staleness: Optional[int] = None   # lsgd-async; None: tau_global
    local_steps: str = "8"                # an integer T, or "auto"
    local_steps_cost_ratio: Optional[float] = None   # auto: assumed round/step cost; None: measure
    easgd_alpha: Optional[float] = None   # None: 0.9 / world size (beta = p * alpha = 0.9)
    easgd_tau: Optional[int] = None       # None: tau_local
    outer_lr: float = 0.7                 # DiLoCo: outer SGD (DiLoCo's values)
    outer_momentum: float = 0.9
    outer_nesterov: bool = True
    slowmo_every: int = 48                # SlowMo: steps between slow steps (fairscale's values)
    slowmo_beta: float = 0.5
    slowmo_alpha: float = 1.0
    ranks_per_node: Optional[int] = None
    eval_every: Optional[int] = None
    consensus_every: int = 10             # steps between consensus-distance probes; 0 = off
    bn_recompute: Optional[int] = None    # batches; None: 16 for models with BatchNorm, else 0
    stop_check_every: int = 10            # steps between non-blocking stop-flag agreements
    nesterov: bool = False                # Nesterov momentum (needs --momentum > 0)
    lsgd_pull_every_step: bool = False    # LSGD: proximal pull toward the last leader copies
    lsgd_bn: str = "keep"                 # LSGD: BatchNorm statistics on a pull
    bucket_mb: float = 1.0                # allreduce: gradient bucket size; 0 = no overlap
    backend: str = "mpi"
    device: str = "cpu"                   # cuda: one GPU per rank (node-local rank % GPUs)
    log_every: int = 1                    # steps between rows of /train
    # A flush rebuilds the rank's file and fsyncs it (25-60 ms here): every 200 steps that
    # was 3-8 % of a small model's step time (loop_overhead benchmark), every 1000 under 1.5 %.
    flush_every: int = 1000               # steps between metric flushes ...
    flush_seconds: float = 60.0           # ... or seconds, whichever comes first
    checkpoint_every: int = 0             # steps; 0 = only on preemption and at the end
    max_steps: Optional[int] = None       # stop early (benchmarks, tests)
    synthetic_size: int = 4096
    image_size: int = 32                  # imagefolder: pixels of the square crops
    data_workers: int = 2                 # imagefolder: DataLoader processes per rank; 0 = none
    label_noise: float = 0.0              # fraction of training labels replaced by wrong ones
    eval_batch_size: int = 1000
    straggler: Optional[str] = None       # RANK:SECONDS_PER_STEP (experiments, tests)
    collective_timeout: float = 300.0     # seconds; 0 = no watchdog

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


#: Per-data-set defaults for options left unset. CIFAR-10 follows the LSGD reference
#: implementation; digits is sized so the default run takes about a minute on 4 ranks.
DATASET_DEFAULTS: Dict[str, Dict[str, Any]] = {
    "digits": dict(epochs=8, batch_size=32, lr=0.05, tau_local=4, tau_global=8, eval_every=40),
    "cifar10": dict(epochs=200, batch_size=128, lr=0.1, tau_local=64, tau_global=128,
                    eval_every=390, lr_schedule="step"),
    "synthetic": dict(epochs=2, batch_size=64, lr=0.05, tau_local=4, tau_global=8,
                      eval_every=50),
    "imagefolder": dict(epochs=90, batch_size=64, lr=0.1, tau_local=64, tau_global=128,
                        eval_every=500, lr_schedule="cosine"),
}

#: Defaults of a user's data set (--dataset module:callable).
PLUGIN_DEFAULTS: Dict[str, Any] = dict(epochs=10, batch_size=64, lr=0.05, tau_local=4,
                                       tau_global=8, eval_every=100)

_HELP = {
    "algorithm": "training method", "topology": "gossip graph (see python -m lsgd_hpc.topology)",
    "dataset": "data set (digits is embedded)", "data_dir": "folder of a staged data set",
    "model": "network", "epochs": "passes over each shard",
    "batch_size": "per-rank minibatch", "lr": "learning rate eta",
    "lr_schedule": "constant, step (x0.1 at 50% and 75%) or cosine (to 0 at the end)",
    "momentum": "SGD momentum (adamw: beta1)",
    "comm_dtype": "what the methods send (pulls, averages, pseudo-gradients, gradients): fp32, "
                  "or bf16, half the bytes, rounded (see docs/algorithms.md)",
    "optimizer": "each worker's own optimizer: sgd (momentum, --nesterov) or adamw",
    "grad_clip": "clip the global gradient norm to this value (after any gradient averaging)",
    "warmup_steps": "linear learning-rate warmup over this many steps, then --lr-schedule",
    "precision": "fp32, or autocast of forward and loss in bf16 or fp16 (fp16 with a gradient "
                 "scaler; overflow-skipped steps in /train/skipped_steps); weights stay fp32",
    "weight_decay": "L2 weight decay", "seed": "random seed",
    "run_dir": "output folder",
    "resume": "continue from the latest complete checkpoint in --run-dir",
    "tau_local": "steps between local (in-node) leader pulls",
    "tau_global": "steps between global leader pulls (a multiple of --tau-local)",
    "pull_local": "c_L: pull strength toward the node's leader",
    "pull_global": "c_G: pull strength toward the global leader",
    "leader_window": "K: a worker's score is its mean loss over its last K minibatches",
    "max_staleness": "lsgd-async: S, steps a worker takes past a probe or leader broadcast "
                     "it posted before it waits for it (default --tau-global)",
    "straggler": "RANK:SECONDS: that rank sleeps SECONDS per step (experiments; off by default)",
    "collective_timeout": "seconds a collective may wait before the job is aborted with a "
                          "report of the ranks that did not arrive (0: no watchdog)",
    "local_steps": "local SGD and SlowMo: T local steps between averages, or auto (local "
                   "SGD only); DiLoCo: H inner steps between outer steps",
    "outer_lr": "DiLoCo: outer SGD learning rate",
    "outer_momentum": "DiLoCo: outer SGD momentum",
    "outer_nesterov": "DiLoCo: Nesterov outer momentum (--no-outer-nesterov: heavy ball)",
    "slowmo_every": "SlowMo: steps between slow-momentum steps (a multiple of --local-steps)",
    "slowmo_beta": "SlowMo: slow momentum beta",
    "slowmo_alpha": "SlowMo: slow learning rate alpha",
    "leader_score": "LSGD: election score: train (mean of the last K minibatch losses) or "
                    "heldout (loss on a fixed held-out slice of the training set, removed "
                    "from training)",
    "heldout_size": "LSGD --leader-score heldout: samples in the held-out slice",
    "validation_size": "training samples held out (the same on every rank, drawn from --seed) "
                       "and evaluated at every evaluation as val_loss and val_accuracy, for "
                       "choosing settings without the test set; 0 = none",
    "local_steps_cost_ratio": "local SGD auto: take one averaging round to cost this many "
                              "local steps instead of measuring it",
    "easgd_alpha": "EASGD moving rate alpha",
    "easgd_tau": "EASGD: steps between elastic updates",
    "ranks_per_node": "group K consecutive ranks as one node",
    "eval_every": "steps between test evaluations (and log lines)",
    "consensus_every": "steps between consensus-distance measurements, every method "
                       "(0: none; timing experiments use 0)",
    "bn_recompute": "batches on which BatchNorm statistics of a model no worker trained "
                    "(EASGD's centre) are recomputed before evaluation (default 16 with "
                    "BatchNorm, 0 = off)",
    "stop_check_every": "steps between the non-blocking agreements on a stop signal",
    "nesterov": "Nesterov momentum (with --momentum > 0)",
    "lsgd_pull_every_step": "LSGD: also pull toward the last leader copies at every step, "
                            "strength c/tau",
    "lsgd_bn": "LSGD: BatchNorm statistics on a pull: keep local, copy the leader's, or pull",
    "bucket_mb": "allreduce: MB per gradient bucket averaged during backward "
                 "(0: one allreduce after backward)",
    "backend": "communication backend",
    "device": "cpu, or cuda: one GPU per rank (needs a CUDA-aware MPI for --backend mpi)",
    "log_every": "steps between rows of /train",
    "flush_every": "steps between metric flushes", "flush_seconds": "seconds between flushes",
    "checkpoint_every": "steps between checkpoints (0: on preemption and at the end)",
    "max_steps": "stop after this many steps", "synthetic_size": "synthetic training samples",
    "image_size": "imagefolder: side of the square crops the model sees (RandomResizedCrop "
                  "for training, resize and centre crop for val/)",
    "data_workers": "imagefolder: DataLoader worker processes per rank decoding images "
                    "(0: decode in the training process)",
    "label_noise": "fraction P of training labels (a random subset, fixed by --seed, the same on "
                   "every rank) replaced by a uniformly drawn wrong class; the test set keeps "
                   "its labels (0: none)",
    "eval_batch_size": "batch size of evaluation",
}
DEVICES = ("cpu", "cuda")
_CHOICES = {"algorithm": ALGORITHMS, "backend": BACKENDS, "lr_schedule": LR_SCHEDULES,
            "optimizer": OPTIMIZERS, "precision": PRECISIONS, "comm_dtype": COMM_DTYPES,
            "device": DEVICES, "lsgd_bn": LSGD_BN, "leader_score": LEADER_SCORES}


#: Help sections of ``--help``, in the order they are printed.
GROUPS = ("method", "LSGD", "baselines", "data and model", "cluster and backend",
          "output and checkpoints")

#: Section of every option. Options not listed here fall to _group_by_name's rules, so an
#: option added to Config lands in a sensible section without touching this table.
_GROUP_OF = {
    "algorithm": "method", "epochs": "method", "batch_size": "method", "lr": "method",
    "lr_schedule": "method", "momentum": "method", "nesterov": "method",
    "optimizer": "method", "grad_clip": "method", "warmup_steps": "method",
    "precision": "method", "comm_dtype": "cluster and backend",
    "weight_decay": "method", "seed": "method", "max_steps": "method",
    "tau_local": "LSGD", "tau_global": "LSGD", "pull_local": "LSGD", "pull_global": "LSGD",
    "leader_window": "LSGD", "max_staleness": "LSGD", "leader_score": "LSGD",
    "heldout_size": "LSGD",
    "outer_lr": "baselines", "outer_momentum": "baselines", "outer_nesterov": "baselines",
    "slowmo_every": "baselines", "slowmo_beta": "baselines", "slowmo_alpha": "baselines",
    "easgd_alpha": "baselines", "easgd_tau": "baselines", "local_steps": "baselines",
    "topology": "baselines", "bucket_mb": "baselines",
    "dataset": "data and model", "data_dir": "data and model", "model": "data and model",
    "synthetic_size": "data and model", "eval_batch_size": "data and model",
    "image_size": "data and model", "data_workers": "data and model",
    "label_noise": "data and model",
    "bn_recompute": "data and model",
    "backend": "cluster and backend", "device": "cluster and backend",
    "ranks_per_node": "cluster and backend", "stop_check_every": "cluster and backend",
    "collective_timeout": "cluster and backend", "straggler": "cluster and backend",
    "run_dir": "output and checkpoints", "resume": "output and checkpoints",
    "eval_every": "output and checkpoints", "consensus_every": "output and checkpoints",
    "log_every": "output and checkpoints", "flush_every": "output and checkpoints",
    "flush_seconds": "output and checkpoints", "checkpoint_every": "output and checkpoints",
}

#: Fallback for options missing from _GROUP_OF: the first rule whose word is in the name.
_GROUP_RULES = (
    (("lsgd", "leader", "tau_", "pull_"), "LSGD"),
    (("easgd", "local_steps", "gossip", "topology", "async", "stale", "bucket"), "baselines"),
    (("checkpoint", "flush", "log_", "eval_", "run_", "resume", "consensus"),
     "output and checkpoints"),
    (("data", "model", "synthetic", "bn_", "batchnorm"), "data and model"),
    (("backend", "device", "rank", "node", "mpi", "timeout", "straggler", "gpu"),
     "cluster and backend"),
)


def option_group(name: str) -> str:
    """The ``--help`` section of option ``name`` (a Config field name)."""
    if name in _GROUP_OF:
        return _GROUP_OF[name]
    for words, group in _GROUP_RULES:
        if any(w in name for w in words):
            return group
    return GROUPS[0]  # anything else changes how the method trains


#: What an option left unset (None) means, for --help.
_UNSET_MEANS = {
    "data_dir": "none (digits and synthetic need none; imagefolder: DIR with train/ and val/)",
    "run_dir": "runs/<job id> under SLURM, else runs/<algorithm>-<time>",
    "easgd_alpha": "0.9 / world size", "easgd_tau": "--tau-local",
    "ranks_per_node": "by host name", "max_steps": "none (all epochs)",
    "local_steps_cost_ratio": "measured at run time",
    "bn_recompute": "16 for models with BatchNorm, else 0",
    "heldout_size": "10% of the training set, at most 256",
}


def _default_text(name: str, default: Any) -> str:
    """``default: ...`` for --help: the Config default, or the per-data-set defaults."""
    per_set = {d: v[name] for d, v in DATASET_DEFAULTS.items() if name in v}
    if name == "model":
        from lsgd_hpc.models.zoo import DEFAULT_MODELS
        per_set = dict(DEFAULT_MODELS)
    if default is None and per_set:
        return "default: " + ", ".join(f"{d} {v}" for d, v in per_set.items())
    if default is None:
        return f"default: {_UNSET_MEANS.get(name, 'none')}"
    text = "off" if default is False else str(default)
    others = {d: v for d, v in per_set.items() if v != default}
    if others:
        text += " (" + ", ".join(f"{d}: {v}" for d, v in others.items()) + ")"
    return f"default: {text}"


def _choices_text(name: str) -> Optional[str]:
    """Choices of options checked in validate() rather than by argparse (their error message
    names the option, and YAML files go through the same check)."""
    if name == "topology":
        from lsgd_hpc.topology import TOPOLOGIES
        return ", ".join(TOPOLOGIES)
    if name == "dataset":
        return ", ".join(DATASET_DEFAULTS)
    if name == "model":
        from lsgd_hpc.models.zoo import MODELS
        return ", ".join(MODELS)
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as argparse does, but with our prefix
        raise ConfigError("command line", message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lsgd_hpc.train", argument_default=argparse.SUPPRESS,
                usage="%(prog)s [--config FILE] [options]",
                description="Train with Leader SGD or a baseline on MPI ranks. Options come "
                            "from the defaults shown, then the data set's defaults, then "
                            "--config, then the command line.")
    p.add_argument("--config", metavar="FILE", help="YAML file of options (the command line wins)")
    sections = {g: p.add_argument_group(g) for g in GROUPS}
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        section = sections[option_group(f.name)]
        parts = [_HELP.get(f.name, "")]
        if _choices_text(f.name):
            parts.append(f"one of: {_choices_text(f.name)}")
        parts.append(_default_text(f.name, f.default))
        helptext = "; ".join(x for x in parts if x).replace("%", "%%")
        if (f.type in ("bool",) or isinstance(f.default, bool)) and f.default is True:
            # on by default: --no-NAME turns it off
            section.add_argument(flag, action=argparse.BooleanOptionalAction, help=helptext)
        elif f.type in ("bool",) or isinstance(f.default, bool):
            section.add_argument(flag, action="store_true", help=helptext)
        else:
            # Strings here; types are checked in one place (_coerce) for YAML and CLI alike.
            # Options with argparse choices show them as {a,b,...}; others name their type.
            choices = _CHOICES.get(f.name)
            section.add_argument(flag, metavar=None if choices else f.name.upper(),
                                 choices=choices, help=helptext)
    return p


def _coerce(name: str, value: Any) -> Any:
    """Turn a YAML or command-line value into the field's type, or say why not."""
    opt = "--" + name.replace("_", "-")
    kind = {f.name: f.type for f in fields(Config)}[name]
    if value is None:
        if "Optional" in str(kind):
            return None
        raise ConfigError(opt, "must not be empty")
    try:
        if "bool" in str(kind):
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if "int" in str(kind):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(str(value)) if not isinstance(value, float) else int(value)
        if "float" in str(kind):
            if isinstance(value, bool):
                raise ValueError
            out = float(value)
            if not math.isfinite(out):
                raise ValueError
            return out
        return str(value)
    except (TypeError, ValueError):
        want = "an integer" if "int" in str(kind) else "a number" if "float" in str(kind) \
            else "true or false"
        raise ConfigError(opt, f"must be {want}, got {value!r}") from None


def load_yaml(path: str) -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError("--config", f"no such file: {path}")
    try:
        with open(path) as fh:
            data = yaml.safe_load(fh)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where else ""
        raise ConfigError("--config", f"{path} is not valid YAML{line}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of option: value")
    known = {f.name for f in fields(Config)}
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise ConfigError("--config", f"unknown key {key!r} in {path}")
        out[name] = value
    return out


def parse_config(argv: Optional[Sequence[str]] = None, env: Optional[dict] = None) -> Config:
    """Defaults < data-set defaults < YAML file < command line; then validated."""
    args = vars(_parser().parse_args(argv))
    values: Dict[str, Any] = {}
    if "config" in args:
        values.update(load_yaml(args.pop("config")))
    values.update(args)
    for name in list(values):
        values[name] = _coerce(name, values[name])
    dataset = values.get("dataset", Config.dataset)
    if ":" in str(dataset):              # a user's factory: the in-memory sets' defaults
        from lsgd_hpc.models.zoo import load_factory
        try:
            load_factory(dataset)
        except ValueError as exc:
            raise ConfigError("--dataset", str(exc)) from None
    elif dataset not in DATASET_DEFAULTS:
        raise ConfigError("--dataset", f"must be one of {', '.join(DATASET_DEFAULTS)}, "
                                       f"or module:callable, got {dataset!r}")
    for name, default in DATASET_DEFAULTS.get(dataset, PLUGIN_DEFAULTS).items():
        values.setdefault(name, default)
    cfg = Config(**values)
    validate(cfg, env if env is not None else os.environ)
    return cfg


def _positive(cfg: Config, names: List[str], strict: bool = True) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is None:
            continue
        if (strict and v <= 0) or (not strict and v < 0):
            raise ConfigError("--" + name.replace("_", "-"),
                              f"must be {'>' if strict else '>='} 0, got {v}")


def validate(cfg: Config, env: dict) -> None:
    """Checks that need no MPI: ranges, choices, files. World-size checks are in check_world."""
    from lsgd_hpc.data import datasets as data
    from lsgd_hpc.models import zoo as models
    from lsgd_hpc import topology
    from lsgd_hpc.runtime.checkpoint import latest_checkpoint

    if cfg.algorithm not in ALGORITHMS:
        raise ConfigError("--algorithm", f"must be one of {', '.join(ALGORITHMS)}")
    if cfg.backend not in BACKENDS:
        raise ConfigError("--backend", f"must be one of {', '.join(BACKENDS)}")
    if cfg.device not in DEVICES:
        raise ConfigError("--device", f"must be one of {', '.join(DEVICES)}")
    if cfg.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("--device", "cuda asked for, but torch sees no GPU on this node")
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError("--optimizer", f"must be one of {', '.join(OPTIMIZERS)}")
    if cfg.comm_dtype not in COMM_DTYPES:
        raise ConfigError("--comm-dtype", f"must be one of {', '.join(COMM_DTYPES)}")
    if cfg.comm_dtype == "bf16" and cfg.backend == "horovod":
        raise ConfigError("--comm-dtype", "bf16 needs --backend mpi or torch (Horovod has no "
                                          "bfloat16 sum here)")
    if cfg.precision not in PRECISIONS:
        raise ConfigError("--precision", f"must be one of {', '.join(PRECISIONS)}")
    if cfg.grad_clip is not None and not (math.isfinite(cfg.grad_clip) and cfg.grad_clip > 0):
        raise ConfigError("--grad-clip", f"must be a finite number > 0, got {cfg.grad_clip}")
    if cfg.lr_schedule not in LR_SCHEDULES:
        raise ConfigError("--lr-schedule", f"must be one of {', '.join(LR_SCHEDULES)}")
    if cfg.topology not in topology.TOPOLOGIES:
        raise ConfigError("--topology", f"must be one of {', '.join(topology.TOPOLOGIES)}")
    _positive(cfg, ["epochs", "batch_size", "lr", "tau_local", "tau_global", "leader_window",
                    "eval_every", "stop_check_every", "log_every", "flush_every",
                    "flush_seconds", "max_steps", "synthetic_size", "eval_batch_size",
                    "image_size",
                    "ranks_per_node", "easgd_tau", "outer_lr", "slowmo_every", "slowmo_alpha",
                    "heldout_size"])
    _positive(cfg, ["weight_decay", "checkpoint_every", "seed", "max_staleness",
                    "collective_timeout", "consensus_every", "bn_recompute", "warmup_steps",
                    "data_workers", "validation_size"], strict=False)
    if cfg.image_size < 8:
        raise ConfigError("--image-size", f"must be >= 8, got {cfg.image_size}")
    if not (math.isfinite(cfg.label_noise) and 0 <= cfg.label_noise < 1):
        raise ConfigError("--label-noise", f"must be in [0, 1), got {cfg.label_noise}")
    if cfg.lsgd_bn not in LSGD_BN:
        raise ConfigError("--lsgd-bn", f"must be one of {', '.join(LSGD_BN)}")
    if cfg.nesterov and cfg.momentum <= 0:
        raise ConfigError("--nesterov", "needs --momentum > 0 (Nesterov momentum without "
                                        "momentum is plain SGD)")
    if not (math.isfinite(cfg.bucket_mb) and cfg.bucket_mb >= 0):
        raise ConfigError("--bucket-mb", f"must be a finite number >= 0, got {cfg.bucket_mb}")
    straggler_of(cfg)
    if not 0 <= cfg.momentum < 1:
        raise ConfigError("--momentum", f"must be in [0, 1), got {cfg.momentum}")
    for name in ("pull_local", "pull_global"):
        v = getattr(cfg, name)
        if not 0 <= v <= 1:
            raise ConfigError("--" + name.replace("_", "-"), f"must be in [0, 1], got {v}")
    if cfg.easgd_alpha is not None and not 0 < cfg.easgd_alpha < 1:
        raise ConfigError("--easgd-alpha", f"must be in (0, 1), got {cfg.easgd_alpha}")
    if cfg.tau_global % cfg.tau_local:
        raise ConfigError("--tau-global", f"must be a multiple of --tau-local "
                                          f"({cfg.tau_global} vs {cfg.tau_local})")
    if cfg.local_steps != "auto":
        try:
            t = int(cfg.local_steps)
        except ValueError:
            raise ConfigError("--local-steps", f"must be a positive integer or auto, "
                                               f"got {cfg.local_steps!r}") from None
        if t < 1:
            raise ConfigError("--local-steps", f"must be >= 1 or auto, got {t}")
    for name in ("outer_momentum", "slowmo_beta"):
        v = getattr(cfg, name)
        if not 0 <= v < 1:
            raise ConfigError("--" + name.replace("_", "-"), f"must be in [0, 1), got {v}")
    if cfg.algorithm in ("diloco", "slowmo") and cfg.local_steps == "auto":
        raise ConfigError("--local-steps", f"auto is local SGD's; {cfg.algorithm} needs an "
                                           "integer")
    if cfg.algorithm == "slowmo" and cfg.slowmo_every % int(cfg.local_steps):
        raise ConfigError("--slowmo-every", f"must be a multiple of --local-steps "
                                            f"({cfg.slowmo_every} vs {cfg.local_steps})")
    if cfg.leader_score not in LEADER_SCORES:
        raise ConfigError("--leader-score", f"must be one of {', '.join(LEADER_SCORES)}")
    if cfg.dataset == "imagefolder" and cfg.validation_size:
        raise ConfigError("--validation-size", "not for imagefolder (its val/ folder is the "
                                               "test set; split train/ yourself)")
    if cfg.dataset == "imagefolder" and cfg.leader_score == "heldout":
        raise ConfigError("--leader-score", "heldout is not for imagefolder (its slice is held "
                                            "in memory; digits, cifar10 and synthetic only)")
    if cfg.leader_score == "heldout" and cfg.algorithm != "lsgd":
        why = ("lsgd-async elects at every probe, where a held-out evaluation would stall "
               "the round machine" if cfg.algorithm == "lsgd-async"
               else "only LSGD elects a leader")
        raise ConfigError("--leader-score", f"heldout applies to --algorithm lsgd only ({why})")
    if cfg.local_steps_cost_ratio is not None and not cfg.local_steps_cost_ratio > 0:
        raise ConfigError("--local-steps-cost-ratio",
                          f"must be > 0, got {cfg.local_steps_cost_ratio}")
    model = cfg.model or models.default_model(cfg.dataset)
    if ":" in model:
        try:
            models.load_factory(model)
        except ValueError as exc:
            raise ConfigError("--model", str(exc)) from None
    elif model not in models.MODELS:
        raise ConfigError("--model", f"must be one of {', '.join(models.MODELS)}, or "
                                     f"module:callable, got {model!r}")
    try:
        data.check_data_dir(cfg.dataset, cfg.data_dir)
    except data.DataError as exc:
        raise ConfigError("--data-dir", str(exc)) from None
    if cfg.run_dir is None and env.get("SLURM_JOB_ID"):
        # Keyed by job id, so a requeued job (same id) finds its own run directory.
        job = env["SLURM_JOB_ID"]
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        cfg.run_dir = os.path.join("runs", job)
    if cfg.run_dir and not cfg.resume:
        requeued = env.get("SLURM_RESTART_COUNT", "0") not in ("", "0")
        metrics_dir = os.path.join(cfg.run_dir, "metrics")
        if requeued and latest_checkpoint(cfg.run_dir) is not None:
            cfg.resume = True          # a requeued job continues where it stopped
        elif not requeued and os.path.isdir(metrics_dir) and os.listdir(metrics_dir):
            raise ConfigError("--run-dir", f"{cfg.run_dir} already holds a run; pass --resume "
                                           "to continue it, or choose another folder")
    if cfg.run_dir and os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        raise ConfigError("--run-dir", f"{cfg.run_dir} exists and is not a folder")
    if cfg.resume:
        if not cfg.run_dir:
            raise ConfigError("--resume", "needs --run-dir (the run to continue)")
        if latest_checkpoint(cfg.run_dir) is None:
            raise ConfigError("--resume", f"no complete checkpoint in {cfg.run_dir}/checkpoints")
    rpn = env.get("LSGD_HPC_RANKS_PER_NODE")
    if cfg.ranks_per_node is None and rpn:
        try:
            if int(rpn) < 1:
                raise ValueError
        except ValueError:
            raise ConfigError("LSGD_HPC_RANKS_PER_NODE", f"must be a positive integer, "
                                                         f"got {rpn!r}") from None


def straggler_of(cfg: Config) -> Optional[tuple]:
    """--straggler RANK:SECONDS as (rank, seconds per step), or None when off."""
    if cfg.straggler is None:
        return None
    rank, sep, secs = cfg.straggler.partition(":")
    try:
        out = int(rank), float(secs)
        if not sep or out[0] < 0 or not 0 <= out[1] < math.inf:
            raise ValueError
    except ValueError:
        raise ConfigError("--straggler", f"must be RANK:SECONDS with RANK >= 0 and SECONDS >= 0, "
                                         f"got {cfg.straggler!r}") from None
    return out


def launcher_world_size(env: dict):
    """``(launcher, n)``: how many ranks the launcher started (see lsgd_hpc.runtime.launcher)."""
    from lsgd_hpc.runtime.launcher import launcher_world_size as count
    return count(env)


def check_world(cfg: Config, world_size: int, env: dict) -> None:
    """Checks that need the world size (known locally after MPI_Init, no collective).

    The world must be what the launcher started: otherwise the processes did not join one MPI
    job (``srun --mpi=pmi2`` with Open MPI 5, which has no PMI-2, gives every task a world
    of its own; an mpirun of another MPI than mpi4py's does the same).
    """
    from lsgd_hpc import topology

    launcher, expected = launcher_world_size(env)
    if launcher == "torchrun" and cfg.backend != "torch":
        raise ConfigError("--backend", f"{cfg.backend} needs an MPI job, which torchrun does "
                          "not start; use --backend torch under torchrun (or mpirun/srun)")
    if expected is not None and expected != world_size:
        if launcher == "srun":
            raise ConfigError("MPI world size", f"is {world_size} but srun started {expected} "
                              f"tasks (SLURM_STEP_NUM_TASKS={expected}): the ranks did not join "
                              "one MPI job; use srun --mpi=pmix (Open MPI 5 has no PMI-2), or "
                              "mpirun inside the allocation")
        raise ConfigError("MPI world size", f"is {world_size} but mpirun started {expected} "
                          "ranks: mpi4py is built against another MPI than this mpirun's; "
                          "use the mpirun of the MPI that mpi4py was built with")
    if cfg.resume:
        from lsgd_hpc.runtime.checkpoint import latest_checkpoint
        pointer = latest_checkpoint(cfg.run_dir)
        if pointer is not None and int(pointer["world_size"]) != world_size:
            raise ConfigError("--resume", f"the checkpoint in {cfg.run_dir} was written by "
                                          f"{pointer['world_size']} ranks; this job has "
                                          f"{world_size} (resume with the same rank count)")
    slow = straggler_of(cfg)
    if slow is not None and slow[0] >= world_size:
        raise ConfigError("--straggler", f"rank {slow[0]} is not in this job of {world_size} "
                                         "ranks")
    if cfg.algorithm == "gossip":
        try:
            topology.build_topology(cfg.topology, world_size)
        except ValueError as exc:
            raise ConfigError("--topology", str(exc)) from None
    if cfg.algorithm == "easgd":
        alpha = cfg.easgd_alpha if cfg.easgd_alpha is not None else 0.9 / world_size
        if world_size * alpha >= 2:
            raise ConfigError("--easgd-alpha", f"p * alpha = {world_size * alpha:.3g} >= 2 "
                                               "makes the centre update unstable")
