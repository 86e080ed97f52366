"""The trainer's options: the trainer's own, plus every method's from its spec
(lsgd_hpc.methods.registry); YAML files, the command line, the data set's defaults and preset,
and the checks that run before any MPI call.

Where a value comes from, lowest first: the option's default (for a method option, the
library's: ``lsgd_hpc.METHODS[NAME].defaults``), the data set's defaults and preset
(lsgd_hpc.data.specs; ``--no-preset`` leaves the preset out), ``--config FILE``, then the
command line.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import asdict, field, fields, make_dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import yaml

from lsgd_hpc.data.specs import DATASETS, PLUGIN, TRAINER_DEFAULT_KEYS, dataset_spec
from lsgd_hpc.envvars import RANKS_PER_NODE, REPLACEMENT_STARTED
from lsgd_hpc.methods.registry import SPECS
from lsgd_hpc.methods.spec import COMMON_OPTIONS, SECTIONS, Option, OptionError, \
    comm_dtype_problem, error_feedback_decay_problem, error_feedback_problem, topk_problem
from lsgd_hpc.runtime.trackers import TRACKERS, check_trackers

__all__ = ["Config", "ConfigError", "parse_config", "check_world", "launcher_world_size",
           "option_group", "ALGORITHMS", "GROUPS", "TRAINER_OPTIONS", "straggler_of",
           "cli_options"]

ALGORITHMS = tuple(SPECS)
#: --help sections, in the order they are printed
GROUPS = SECTIONS


class ConfigError(ValueError):
    """A user's mistake in an option: ``option`` names it, the message says why."""

    def __init__(self, option: str, message: str):
        super().__init__(f"{option}: {message}")
        self.option = option


_DATA_SET = "the data set's (see --dataset)"

#: The trainer's own options (what is not a method option). Each one written once: default,
#: kind and range, help, --help section.
TRAINER_OPTIONS = (
    # -- method (how every worker trains) --
    Option("algorithm", "lsgd", "choice", "training method", section="method",
           choices=ALGORITHMS),
    Option("no_preset", False, "bool",
           "the method's options at the library's defaults (lsgd_hpc.METHODS[NAME].defaults), "
           "without the data set's preset", section="method"),
    Option("epochs", None, "float", "passes over each shard (the budget; --max-steps caps it)",
           section="method", low=0, low_open=True, none=_DATA_SET),
    Option("max_steps", None, "int", "stop after this many steps (the budget when --epochs "
           "is not given)", section="method", low=1, none=_DATA_SET),
    Option("batch_size", None, "int", "per-rank minibatch", section="method", low=1,
           none=_DATA_SET),
    Option("lr", None, "float", "learning rate eta", section="method", low=0, low_open=True,
           none=_DATA_SET),
    Option("lr_schedule", "constant", "choice",
           "constant, step (x0.1 at 50% and 75%) or cosine (to 0 at the end)",
           section="method", choices=("constant", "step", "cosine")),
    Option("momentum", 0.9, "float", "SGD momentum (adamw: beta1)", section="method", low=0,
           high=1, high_open=True),
    Option("nesterov", False, "bool", "Nesterov momentum (with --momentum > 0)",
           section="method"),
    Option("optimizer", "sgd", "choice",
           "each worker's own optimizer: sgd (momentum, --nesterov) or adamw",
           section="method", choices=("sgd", "adamw")),
    Option("grad_clip", None, "float",
           "clip the global gradient norm to this value (after any gradient averaging)",
           section="method", low=0, low_open=True, high=math.inf, high_open=True,
           none="no clipping"),
    Option("warmup_steps", 0, "int",
           "linear learning-rate warmup over this many steps, then --lr-schedule",
           section="method", low=0),
    Option("precision", "fp32", "choice",
           "fp32, or autocast of forward and loss in bf16 or fp16 (fp16 with a gradient "
           "scaler; overflow-skipped steps in /train/skipped_steps); weights stay fp32",
           section="method", choices=("fp32", "bf16", "fp16")),
    Option("weight_decay", 1e-4, "float", "L2 weight decay", section="method", low=0),
    Option("seed", 0, "int", "random seed", section="method", low=0),
    # -- LSGD --
    Option("leader_score", "train", "choice",
           "LSGD: election score: train (mean of the last K minibatch losses) or heldout "
           "(loss on a fixed held-out slice of the training set, removed from training)",
           section="LSGD", choices=("train", "heldout")),
    Option("heldout_size", None, "int", "LSGD --leader-score heldout: samples in the "
           "held-out slice", section="LSGD", low=1, none="10% of the training set, at most 256"),
    # -- data and model --
    Option("dataset", "digits", "str", "data set (digits is embedded)", section="data and model"),
    Option("data_dir", None, "str", "folder of a staged data set", section="data and model",
           none="none (digits and synthetic need none; imagefolder: DIR with train/ and val/)"),
    Option("model", None, "str", "network", section="data and model", none=_DATA_SET),
    Option("synthetic_size", 4096, "int", "synthetic training samples",
           section="data and model", low=1),
    Option("image_size", 32, "int", "imagefolder: side of the square crops the model sees "
           "(RandomResizedCrop for training, resize and centre crop for val/)",
           section="data and model", low=8),
    Option("data_workers", 2, "int", "imagefolder: DataLoader worker processes per rank "
           "decoding images (0: decode in the training process)", section="data and model",
           low=0),
    Option("label_noise", 0.0, "float",
           "fraction P of training labels (a random subset, fixed by --seed, the same on "
           "every rank) replaced by a uniformly drawn wrong class; the test set keeps its "
           "labels (0: none)", section="data and model", low=0, high=1, high_open=True),
    Option("validation_size", 0, "int",
           "training samples held out (the same on every rank, drawn from --seed) and "
           "evaluated at every evaluation as val_loss and val_accuracy, for choosing "
           "settings without the test set; 0 = none", section="data and model", low=0),
    Option("eval_batch_size", 1000, "int", "batch size of evaluation",
           section="data and model", low=1),
    Option("bn_recompute", None, "int",
           "batches on which BatchNorm statistics of a model no worker trained (EASGD's "
           "centre) are recomputed before evaluation (0 = off)", section="data and model",
           low=0, none="16 for models with BatchNorm, else 0"),
    # -- cluster and backend --
    Option("backend", "mpi", "choice", "communication backend", section="cluster and backend",
           choices=("mpi", "horovod", "torch")),
    Option("device", "cpu", "choice",
           "cpu, or cuda: one GPU per rank (needs a CUDA-aware MPI for --backend mpi)",
           section="cluster and backend", choices=("cpu", "cuda")),
    Option("ranks_per_node", None, "int", "group K consecutive ranks as one node",
           section="cluster and backend", low=1, none="by host name"),
    Option("collective_timeout", 300.0, "float",
           "seconds a collective may wait before the job is aborted with a report of the "
           "ranks that did not arrive (0: no watchdog)", section="cluster and backend", low=0),
    Option("straggler", None, "str",
           "RANK:SECONDS: that rank sleeps SECONDS per step (experiments; off by default)",
           section="cluster and backend", none="none"),
    Option("on_failure", "abort", "choice",
           "a dead rank: abort ends the job (resume it from its checkpoint); shrink: the "
           "survivors go on without it; heal: they go on and replacements started for the "
           "lost ranks join at a step boundary (shrink and heal: the mpi backend under "
           "mpirun --with-ft ulfm; see docs/cluster.md, When a node dies)",
           section="cluster and backend", choices=("abort", "shrink", "heal")),
    Option("spares", 0, "int",
           "with --on-failure heal: the job's last K ranks train nothing and wait to replace "
           "lost ranks (before any is spawned); start the job with K more ranks",
           section="cluster and backend", low=0),
    Option("min_ranks", 1, "int",
           "with --on-failure shrink or heal: fewer survivors than this end the job (exit 3)",
           section="cluster and backend", low=1),
    Option("failure_timeout", None, "float",
           "with --backend torch --on-failure shrink: seconds after which a silent worker "
           "counts as lost; torchft's timeouts follow from it (between workers this, inside "
           "a worker twice this, quorum and start-up six times, at least 60 s)",
           section="cluster and backend", low=0, low_open=True, none="10"),
    Option("inject_failure", None, "str",
           "RANK:STEP[,RANK:STEP...]: testing only, that rank (as numbered at the start) "
           "SIGKILLs itself at that step; leader:STEP kills the global leader elected then, "
           "before its broadcast; RANK:STEP:save, in the save of that step's checkpoint",
           section="cluster and backend", none="none"),
    # -- the pre-flight check (lsgd_hpc.cli.preflight): the command line only --
    Option("dry_run", False, "bool",
           "the pre-flight check, on a login node, before sbatch: no MPI, no GPU; runs every "
           "check the job would run (for --world-size ranks), prints the resolved "
           "configuration, what each rank sends and rho, and exits 0, or 2 with the job's "
           "error line", section="cluster and backend"),
    Option("world_size", None, "int", "with --dry-run: the ranks the job will start",
           section="cluster and backend", low=1, none="none (required with --dry-run)"),
    Option("inter_gbps", None, "float",
           "with --dry-run: the link between nodes, Gbit/s a node, for the planner's rho and "
           "seconds of communication", section="cluster and backend", low=0, low_open=True,
           none="none (rho only on one node)"),
    Option("step_ms", None, "float",
           "with --dry-run: the compute of one local step, ms, for rho",
           section="cluster and backend", low=0, low_open=True,
           none="the planner's estimate from the model's multiply-adds"),
    # -- output and checkpoints --
    Option("run_dir", None, "str", "output folder", section="output and checkpoints",
           none="runs/<job id> under SLURM, else runs/<algorithm>-<time>"),
    Option("resume", False, "bool",
           "continue from the latest complete checkpoint in --run-dir",
           section="output and checkpoints"),
    Option("eval_every", None, "int", "steps between test evaluations (and log lines)",
           section="output and checkpoints", low=1, none=_DATA_SET),
    Option("consensus_every", 10, "int",
           "steps between consensus-distance measurements, every method (0: none; timing "
           "experiments use 0; the library's methods default to 0)",
           section="output and checkpoints", low=0),
    Option("log_every", 1, "int", "steps between rows of /train",
           section="output and checkpoints", low=1),
    # A flush appends the rows since the last one and fsyncs the file (a few ms here, at any
    # length of run: metrics_flush benchmark): every 5 s it is ~0.1 % of the run, and a rank
    # that dies (SIGKILL, a lost node) leaves a file that ends at most ~5 s before its death.
    Option("flush_every", 1000, "int",
           "steps between metric flushes (or --flush-seconds, whichever comes first)",
           section="output and checkpoints", low=1),
    Option("flush_seconds", 5.0, "float",
           "seconds between metric flushes (a killed rank's file ends at most this long "
           "before its death)", section="output and checkpoints", low=0, low_open=True),
    Option("checkpoint_every", 0, "int",
           "steps between checkpoints (0: on preemption and at the end)",
           section="output and checkpoints", low=0),
    Option("checkpoint_sync", False, "bool",
           "write each checkpoint before training goes on (off: the state is copied to "
           "host memory and written in the background; --on-failure shrink always writes "
           "at once)", section="output and checkpoints"),
    Option("tracker", None, "choice",
           "mirror rank 0's metrics to an experiment tracker, offline, under --run-dir "
           "(repeat the flag for several; each is an optional extra: pip install "
           "lsgd_hpc[NAME])", section="output and checkpoints", choices=TRACKERS,
           none="none", multiple=True),
)


def cli_options() -> Dict[str, Option]:
    """Every command-line option by name: the trainer's, the methods' common ones, then each
    method's own (an option that several methods share appears once; the first method's
    Option parses it, the chosen method's checks it)."""
    out: Dict[str, Option] = {o.name: o for o in TRAINER_OPTIONS}
    for o in COMMON_OPTIONS:
        out.setdefault(o.name, o)
    for spec in SPECS.values():
        for o in spec.options:
            if o.cli:
                out.setdefault(o.name, o)
    return out


_OPTIONS = cli_options()
_METHOD_OPTION_NAMES = {o.name for s in SPECS.values() for o in s.options if o.cli}
_TYPES = {"int": Optional[int], "float": Optional[float], "bool": bool, "choice": Optional[str],
          "str": Optional[str], "int_or_auto": Any, "int_or_modules": Any,
          "int_or_node": Any, "list": Optional[List[str]]}

#: Every option of ``python -m lsgd_hpc.train``; field names are the options' with ``_``.
#: A method's option is None unless given, and after parse_config holds the resolved value
#: for the chosen method (None for the options of other methods). ``method_options`` holds
#: the chosen method's options, resolved; ``preset`` the values that came from the data
#: set's preset.
Config = make_dataclass("Config", [
    *[(name, _TYPES["list" if o.multiple else o.kind],
       field(default=None if name in _METHOD_OPTION_NAMES else o.default))
      for name, o in _OPTIONS.items()],
    ("method_options", Dict[str, Any], field(default_factory=dict)),
    ("preset", Dict[str, Any], field(default_factory=dict)),
])
Config.to_dict = lambda self: asdict(self)
Config.__doc__ = "Every option of python -m lsgd_hpc.train (see lsgd_hpc.cli.config)."


def option_group(name: str) -> str:
    """The ``--help`` section of option ``name``."""
    return _OPTIONS[name].section


def _method_default_text(name: str) -> str:
    """``default: ...`` of a method option: each method's default, then the presets."""
    by_default: Dict[str, List[str]] = {}
    for spec in SPECS.values():
        for o in spec.options:
            if o.name == name:
                by_default.setdefault(o.default_text(), []).append(spec.name)
    if len(by_default) == 1:
        text = next(iter(by_default))
    else:
        text = "; ".join(f"{', '.join(m)} {v}" for v, m in by_default.items())
    presets = []
    for ds in DATASETS.values():
        vals = {m: p[name] for m, p in ds.presets.items() if name in p}
        if vals:
            shown = sorted(set(vals.values()), key=str)
            what = (str(shown[0]) if len(shown) == 1 and len(vals) == len(
                [s for s in SPECS.values() if any(o.name == name for o in s.options)])
                else ", ".join(f"{m} {v}" for m, v in vals.items()))
            presets.append(f"{ds.name} preset: {what}")
    return f"default: {text}" + (f" ({'; '.join(presets)})" if presets else "")


def _default_text(o: Option) -> str:
    """``default: ...`` for --help: the option's default and the data sets' own."""
    if o.name in _METHOD_OPTION_NAMES:
        return _method_default_text(o.name)
    per_set = {d.name: d.defaults[o.name] for d in DATASETS.values() if o.name in d.defaults}
    if o.name == "model":
        per_set = {d.name: d.default_model for d in DATASETS.values()}
    if o.default is None and per_set:
        return "default: " + ", ".join(f"{d} {v}" for d, v in per_set.items())
    text = o.default_text()
    others = {d: v for d, v in per_set.items() if v != o.default}
    if others:
        text += " (" + ", ".join(f"{d}: {v}" for d, v in others.items()) + ")"
    return f"default: {text}"


def _help_text(o: Option) -> str:
    helps = {}
    if o.name in _METHOD_OPTION_NAMES:
        for spec in SPECS.values():
            for m in spec.options:
                if m.name == o.name:
                    helps.setdefault(m.help, []).append(spec.name)
    parts = ["; ".join(f"{', '.join(ms)}: {h}" for h, ms in helps.items())
             if len(helps) > 1 else o.help]
    if o.name == "dataset":
        parts.append(f"one of: {', '.join(DATASETS)}, or module:callable")
    elif o.name == "model":
        from lsgd_hpc.models.zoo import MODELS
        parts.append(f"one of: {', '.join(MODELS)}, or module:callable")
    elif o.kind == "choice" and o.name not in _ARGPARSE_CHOICES:
        parts.append(f"one of: {', '.join(o.choices)}")
    parts.append(_default_text(o))
    return "; ".join(p for p in parts if p).replace("%", "%%")


#: closed sets argparse shows as {a,b,...}; other choices are listed in the help and checked
#: with the option's own message (YAML files go through the same check)
_ARGPARSE_CHOICES = ("algorithm", "backend", "lr_schedule", "optimizer", "precision",
                     "comm_dtype", "device", "lsgd_bn", "leader_score", "tracker")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, as argparse does, but with our prefix
        raise ConfigError("command line", message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m lsgd_hpc.train", argument_default=argparse.SUPPRESS,
                usage="%(prog)s [--config FILE] [options]",
                description="Train with Leader SGD or a baseline on MPI ranks. Options come "
                            "from the defaults shown (a method's: the library's), then the "
                            "data set's defaults and preset, then --config, then the command "
                            "line.")
    p.add_argument("--config", metavar="FILE", help="YAML file of options (the command line wins)")
    sections = {g: p.add_argument_group(g) for g in GROUPS}
    for o in _OPTIONS.values():
        section, helptext = sections[o.section], _help_text(o)
        if o.kind == "bool" and o.default is True:
            # on by default: --no-NAME turns it off
            section.add_argument(o.flag, action=argparse.BooleanOptionalAction, help=helptext)
        elif o.kind == "bool":
            section.add_argument(o.flag, action="store_true", help=helptext)
        elif o.multiple:
            section.add_argument(o.flag, action="append", choices=o.choices or None,
                                 metavar=None if o.choices else o.name.upper(), help=helptext)
        else:
            # Strings here; types are checked in one place (Option.parse) for YAML and CLI.
            choices = o.choices if o.name in _ARGPARSE_CHOICES else None
            section.add_argument(o.flag, metavar=None if choices else o.name.upper(),
                                 choices=choices, help=helptext)
    return p


def _parse_value(name: str, value: Any, algorithm: str) -> Any:
    """A YAML or command-line value in the option's type (the chosen method's Option for a
    method option it has), or ConfigError naming the option."""
    o = _OPTIONS[name]
    mine = SPECS.get(algorithm)
    if mine is not None and name in _METHOD_OPTION_NAMES:
        o = next((m for m in mine.options if m.name == name), o)
    if value is None and (o.none is not None or name in _METHOD_OPTION_NAMES):
        return None
    try:
        return o.parse(value)
    except OptionError as exc:
        raise ConfigError(o.flag, exc.reason) from None


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
    out = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in _OPTIONS:
            raise ConfigError("--config", f"unknown key {key!r} in {path}")
        out[name] = value
    return out


def _foreign_flags(algorithm: str, given: Mapping[str, Any]):
    """``(flag, reason)`` for the first command-line option of another method than
    ``algorithm`` (it would be ignored), or None. A --config file may hold several methods'
    options (each run takes its own algorithm's)."""
    mine = {o.name for o in SPECS[algorithm].options if o.cli}
    for name in given:
        owners = [a for a in ALGORITHMS
                  if name in {o.name for o in SPECS[a].options if o.cli}]
        if owners and name not in mine:
            return (SPECS[owners[0]].option(name).flag,
                    f"is an option of {', '.join(owners)}, not of --algorithm {algorithm}")
    return None


def resolve_method_options(algorithm: str, dataset: str, given: Mapping[str, Any],
                           no_preset: bool = False):
    """``(options, preset)``: the method's command-line options (its library defaults, the
    data set's preset unless ``no_preset``, then ``given``), checked; and the values that
    came from the preset. Raises ConfigError naming the option."""
    spec = SPECS[algorithm]
    mine = {o.name for o in spec.options if o.cli}
    given = {k: v for k, v in given.items() if k in mine and v is not None}
    preset = {} if no_preset else {k: v for k, v in dataset_spec(dataset).preset(algorithm)
                                   .items() if k not in given}
    try:
        options = spec.resolve({**preset, **given})
    except OptionError as exc:
        raise ConfigError(spec.option(exc.option).flag, exc.reason) from None
    return {k: v for k, v in options.items() if k in mine}, preset


def parse_config(argv: Optional[Sequence[str]] = None, env: Optional[dict] = None, *,
                 dry_run: bool = False) -> Config:
    """Defaults < data-set defaults and preset < YAML file < command line; then validated.
    ``dry_run``: for the pre-flight check (lsgd_hpc.cli.preflight), which alone takes its
    options (PREFLIGHT_OPTIONS) and checks the device on the job's nodes, not here."""
    args = vars(_parser().parse_args(argv))
    values: Dict[str, Any] = {}
    if "config" in args:
        values.update(load_yaml(args.pop("config")))
    _check_preflight_options(args, values, dry_run)
    values.update(args)
    algorithm = values.get("algorithm", "lsgd")
    if algorithm not in SPECS:
        raise ConfigError("--algorithm", f"must be one of {', '.join(ALGORITHMS)}, "
                                         f"got {algorithm!r}")
    foreign = _foreign_flags(algorithm, args)
    if foreign:
        raise ConfigError(*foreign)
    for name in list(values):
        values[name] = _parse_value(name, values[name], algorithm)
    dataset = values.get("dataset", "digits")
    try:
        ds = dataset_spec(dataset)
    except ValueError as exc:
        raise ConfigError("--dataset", str(exc)) from None
    if ds is PLUGIN:                 # a user's factory: importable and callable
        from lsgd_hpc.models.zoo import load_factory
        try:
            load_factory(dataset)
        except ValueError as exc:
            raise ConfigError("--dataset", str(exc)) from None
    budget_given = "epochs" in values or "max_steps" in values
    for name, default in ds.defaults.items():
        if name in ("epochs", "max_steps") and budget_given:
            continue                 # the user's budget replaces the data set's
        values.setdefault(name, default)
    options, preset = resolve_method_options(algorithm, dataset, values,
                                             bool(values.get("no_preset")))
    values.update(options)
    cfg = Config(**{k: v for k, v in values.items()}, method_options=options, preset=preset)
    validate(cfg, env if env is not None else os.environ, device_here=not dry_run)
    return cfg


#: the pre-flight check's options (python -m lsgd_hpc.train --dry-run; lsgd_hpc.cli.preflight)
PREFLIGHT_OPTIONS = ("dry_run", "world_size", "inter_gbps", "step_ms")


def _check_preflight_options(args: Mapping[str, Any], from_file: Mapping[str, Any],
                             dry_run: bool) -> None:
    """The pre-flight check's options: on the command line, and with --dry-run only."""
    in_file = [n for n in PREFLIGHT_OPTIONS if n in from_file]
    if in_file:
        raise ConfigError("--config", f"{in_file[0]} is an option of the pre-flight check, "
                                      "for the command line only")
    given = [n for n in PREFLIGHT_OPTIONS if n in args and args[n] not in (None, False)]
    if given and not dry_run:
        raise ConfigError(_OPTIONS[given[0]].flag,
                          "is for the pre-flight check: python -m lsgd_hpc.train --dry-run "
                          "--world-size N [options]")


def validate(cfg: Config, env: dict, device_here: bool = True) -> None:
    """Checks that need no MPI and go across options: files, folders, combinations.
    (Single values were checked as they were parsed, method options by their spec.)
    The first problem found is raised (ConfigError); ``cfg.run_dir`` may be set (a SLURM
    job's default) and ``cfg.resume`` turned on (a requeued or restarted job).
    ``device_here``: False on a login node (the pre-flight check), where --device cuda
    cannot be checked."""
    if device_here:
        _check_device(cfg)
    _check_combinations(cfg)
    _check_failure_options(cfg)
    _check_data_set_and_method(cfg)
    _check_model(cfg)
    _check_data_dir(cfg)
    _default_run_dir(cfg, env)
    _check_run_dir(cfg, env)
    _check_ranks_per_node_env(cfg, env)
    _check_replica_env(cfg, env)


def _check_replica_env(cfg: Config, env: dict) -> None:
    """--backend torch --on-failure shrink or heal: torchft's variables, before anything
    starts."""
    if cfg.backend == "torch" and cfg.on_failure in ("shrink", "heal"):
        from lsgd_hpc.comm.replicas import replica_env
        try:
            replica_env(env)
        except ValueError as exc:
            raise ConfigError("--on-failure", str(exc).replace(
                "--backend torch with --on-failure shrink or heal",
                f"{cfg.on_failure} with --backend torch"))


def _check_device(cfg: Config) -> None:
    if cfg.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise ConfigError("--device", "cuda asked for, but torch sees no GPU on this node")


def _check_combinations(cfg: Config) -> None:
    """What is sent (--comm-dtype, --topk, --error-feedback), the trackers, the optimizer's
    options."""
    problem = comm_dtype_problem(cfg.comm_dtype, cfg.backend, cfg.algorithm)
    if problem:
        raise ConfigError("--comm-dtype", problem)
    problem = topk_problem(cfg.topk, cfg.comm_dtype, cfg.backend, cfg.algorithm)
    if problem:
        raise ConfigError("--topk", problem)
    problem = error_feedback_problem(cfg.error_feedback, cfg.comm_dtype, cfg.topk)
    if problem:
        raise ConfigError("--error-feedback", problem)
    problem = error_feedback_decay_problem(cfg.error_feedback_decay, cfg.error_feedback,
                                           cfg.algorithm)
    if problem:
        raise ConfigError("--error-feedback-decay", problem)
    problem = check_trackers(cfg.tracker)
    if problem:
        raise ConfigError("--tracker", problem)
    if cfg.nesterov and cfg.momentum <= 0:
        raise ConfigError("--nesterov", "needs --momentum > 0 (Nesterov momentum without "
                                        "momentum is plain SGD)")


def _check_failure_options(cfg: Config) -> None:
    """--straggler, --inject-failure, --on-failure and --min-ranks."""
    straggler_of(cfg)
    failures_of(cfg)
    torch_ft = cfg.on_failure in ("shrink", "heal") and cfg.backend == "torch"
    if cfg.failure_timeout is not None and not torch_ft:
        raise ConfigError("--failure-timeout", "is for --backend torch with --on-failure "
                                               "shrink (torchft's timeouts); ULFM detects "
                                               "failures itself")
    if torch_ft:
        from lsgd_hpc.comm.replicas import replica_problem
        problem = replica_problem(cfg.on_failure)
        if problem:
            raise ConfigError("--on-failure", problem.replace(
                "on_failure='heal'", "heal").replace("on_failure='shrink'", "--on-failure "
                "shrink").replace("backend='", "--backend ").replace("'", ""))
        if cfg.worker_ranks != 1 and cfg.on_failure == "heal":
            raise ConfigError("--worker-ranks", f"{cfg.worker_ranks} is not supported with "
                                                "--backend torch --on-failure heal yet (a "
                                                "restarted rank of a worker does not rejoin it "
                                                "reliably); use --on-failure shrink, or "
                                                "--worker-ranks 1")
        if cfg.spares:
            raise ConfigError("--spares", "is for --backend mpi: on the torch backend a lost "
                                          "worker's launcher starts it again (torchrun "
                                          "--max-restarts), and it joins the running job")
    elif cfg.on_failure in ("shrink", "heal") and cfg.backend != "mpi":
        from lsgd_hpc.comm.ulfm import ulfm_problem
        raise ConfigError("--on-failure", ulfm_problem(cfg.backend).replace(
            "on_failure='shrink'", cfg.on_failure).replace("backend='", "--backend ").replace(
            "'", ""))
    if cfg.on_failure == "heal" and cfg.algorithm == "lsgd-async":
        raise ConfigError("--on-failure", "heal needs step boundaries that every rank "
                                          "shares, and lsgd-async's ranks take uneven steps; "
                                          "use --on-failure shrink with it")
    if cfg.spares and cfg.on_failure != "heal":
        raise ConfigError("--spares", "needs --on-failure heal (spares replace lost ranks)")
    if cfg.min_ranks != 1 and cfg.on_failure not in ("shrink", "heal"):
        raise ConfigError("--min-ranks", "needs --on-failure shrink or heal (with abort the "
                                         "first dead rank ends the job)")


def _check_data_set_and_method(cfg: Config) -> None:
    """Options that the data set (imagefolder) or the method (--worker-ranks, --leader-score
    heldout) refuses."""
    if cfg.dataset == "imagefolder" and cfg.validation_size:
        raise ConfigError("--validation-size", "not for imagefolder (its val/ folder is the "
                                               "test set; split train/ yourself)")
    if cfg.dataset == "imagefolder" and cfg.leader_score == "heldout":
        raise ConfigError("--leader-score", "heldout is not for imagefolder (its slice is held "
                                            "in memory; digits, cifar10 and synthetic only)")
    refused = SPECS[cfg.algorithm].workers_refused
    if cfg.worker_ranks != 1 and refused:
        raise ConfigError("--worker-ranks", refused)
    if cfg.leader_score == "heldout" and cfg.algorithm != "lsgd":
        why = ("lsgd-async elects at every probe, where a held-out evaluation would stall "
               "the round machine" if cfg.algorithm == "lsgd-async"
               else "only LSGD elects a leader")
        raise ConfigError("--leader-score", f"heldout applies to --algorithm lsgd only ({why})")


def _check_model(cfg: Config) -> None:
    """--model (or the data set's default): one of the zoo's, or an importable factory."""
    from lsgd_hpc.models import zoo as models
    model = cfg.model or dataset_spec(cfg.dataset).default_model
    if ":" in model:
        try:
            models.load_factory(model)
        except ValueError as exc:
            raise ConfigError("--model", str(exc)) from None
    elif model not in models.MODELS:
        raise ConfigError("--model", f"must be one of {', '.join(models.MODELS)}, or "
                                     f"module:callable, got {model!r}")


def _check_data_dir(cfg: Config) -> None:
    from lsgd_hpc.data.errors import DataError
    from lsgd_hpc.data.loaders import check_data_dir
    try:
        check_data_dir(cfg.dataset, cfg.data_dir)
    except DataError as exc:
        raise ConfigError("--data-dir", str(exc)) from None


def _default_run_dir(cfg: Config, env: dict) -> None:
    """Under SLURM without --run-dir: runs/JOB_ID (runs/ARRAY-JOB_TASK for an array task)."""
    if cfg.run_dir is None and env.get("SLURM_JOB_ID"):
        # Keyed by job id, so a requeued job (same id) finds its own run directory.
        job = env["SLURM_JOB_ID"]
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        cfg.run_dir = os.path.join("runs", job)


def _check_run_dir(cfg: Config, env: dict) -> None:
    """The run directory: a requeued or restarted job resumes from its latest complete
    checkpoint; a fresh one must not write over another run; --resume needs a checkpoint."""
    from lsgd_hpc.runtime.checkpoint import latest_checkpoint
    if REPLACEMENT_STARTED.raw(env):
        return      # a heal's replacement: the survivors give it the run folder to resume
    if cfg.run_dir and not cfg.resume:
        # A requeued SLURM job (same id) or a group that torchrun --max-restarts restarted
        # after a worker died: continue from the latest complete checkpoint, if any.
        requeued = any(env.get(var, "0") not in ("", "0")
                       for var in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"))
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


def _check_ranks_per_node_env(cfg: Config, env: dict) -> None:
    """LSGD_HPC_RANKS_PER_NODE (read when --ranks-per-node is not given): a positive integer."""
    rpn = RANKS_PER_NODE.raw(env)
    if cfg.ranks_per_node is None and rpn:
        try:
            if int(rpn) < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(RANKS_PER_NODE.name, f"must be a positive integer, "
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


def failures_of(cfg: Config) -> list:
    """--inject-failure as [(rank or "leader", step, point)] ([] when off)."""
    if cfg.inject_failure is None:
        return []
    from lsgd_hpc.comm.injection import failure_plan
    try:
        return failure_plan(cfg.inject_failure)
    except ValueError as exc:
        raise ConfigError("--inject-failure", str(exc).replace("inject_failures: ", "")
                          + f" (got {cfg.inject_failure!r})") from None


def launcher_world_size(env: dict):
    """``(launcher, n)``: how many ranks the launcher started (see lsgd_hpc.comm.launcher)."""
    from lsgd_hpc.comm.launcher import launcher_world_size as count
    return count(env)


def check_world(cfg: Config, world_size: int, env: dict, rebuilt: bool = False) -> None:
    """Checks that need the world size (known locally after MPI_Init, no collective).

    The world must be what the launcher started: otherwise the processes did not join one MPI
    job (``srun --mpi=pmi2`` with Open MPI 5, which has no PMI-2, gives every task a world
    of its own; an mpirun of another MPI than mpi4py's does the same).
    """
    launcher, expected = launcher_world_size(env)
    if launcher == "torchrun" and cfg.backend != "torch":
        raise ConfigError("--backend", f"{cfg.backend} needs an MPI job, which torchrun does "
                          "not start; use --backend torch under torchrun (or mpirun/srun)")
    if expected is not None and expected != world_size + cfg.spares and not rebuilt:
        if launcher == "srun":
            raise ConfigError("MPI world size", f"is {world_size} but srun started {expected} "
                              f"tasks (SLURM_STEP_NUM_TASKS={expected}): the ranks did not join "
                              "one MPI job; use srun --mpi=pmix (Open MPI 5 has no PMI-2), or "
                              "mpirun inside the allocation")
        raise ConfigError("MPI world size", f"is {world_size} but mpirun started {expected} "
                          "ranks: mpi4py is built against another MPI than this mpirun's; "
                          "use the mpirun of the MPI that mpi4py was built with")
    if cfg.resume and not rebuilt:     # a healed world's restore checks its own (library)
        from lsgd_hpc.runtime.checkpoint import latest_checkpoint, resume_problem
        pointer = latest_checkpoint(cfg.run_dir)
        problem = pointer and resume_problem(cfg.run_dir, pointer, world_size)
        if problem:
            raise ConfigError("--resume", problem)
    for rank, _, _ in failures_of(cfg):
        if rank != "leader" and rank >= world_size:
            raise ConfigError("--inject-failure", f"rank {rank} is not in this job of "
                                                  f"{world_size} ranks")
    if cfg.min_ranks > world_size:
        raise ConfigError("--min-ranks", f"{cfg.min_ranks} is more than the {world_size} ranks "
                                         "of this job")
    slow = straggler_of(cfg)
    if slow is not None and slow[0] >= world_size:
        raise ConfigError("--straggler", f"rank {slow[0]} is not in this job of {world_size} "
                                         "ranks")
    spec = SPECS[cfg.algorithm]
    # workers that span ranks: the method runs between n_workers of them (when the node
    # layout is known here; by host name it is not, and the method checks it on every rank)
    n_workers = world_size
    if cfg.worker_ranks != 1:
        from lsgd_hpc.comm.workers import worker_layout, worker_layout_problem
        rpn = cfg.ranks_per_node or RANKS_PER_NODE.read(env)
        node_of = [r // rpn for r in range(world_size)] if rpn else None
        problem = worker_layout_problem(node_of or [0] * world_size,
                                        cfg.worker_ranks if cfg.worker_ranks != "node" or
                                        node_of else 1)
        if problem:
            raise ConfigError("--worker-ranks", problem)
        if not spec.worker_grouping:
            n_workers = world_size
        elif node_of is not None:
            n_workers = worker_layout(node_of, cfg.worker_ranks).n_workers
        elif cfg.worker_ranks != "node":
            n_workers = world_size // cfg.worker_ranks
        else:
            return                       # not known before the node groups are formed
    try:
        spec.check_world(cfg.method_options, n_workers)
    except OptionError as exc:
        raise ConfigError(spec.option(exc.option).flag, exc.reason) from None
