"""The pre-flight check: every check a job of ``python -m lsgd_hpc.train`` runs before it
trains, without its world (no MPI, no torch process group, no GPU), on a login node before
``sbatch`` or on the batch host before ``srun``:

    python -m lsgd_hpc.train --dry-run --world-size 8 --ranks-per-node 4 [options]
    lsgd_hpc.check_config({"algorithm": "diloco", "topk": 0.01}, world_size=8, ranks_per_node=4)

What it runs, in the job's order: the options' checks (``parse_config``: values,
combinations, files and folders, the run directory), the world's (``check_world`` for
``--world-size`` ranks, ``--ranks-per-node`` a node), the model built as the trainer builds
it, and the checks its method runs before the first collective (``Method.check``, the same
code ``Method.__init__`` runs). A refusal is the job's own line
(``lsgd_hpc.train: error: ...``, exit status 2). Not checked here, since they are the job's
nodes' and launcher's: ``--device cuda`` (a GPU on the node), that the launcher started the
world the ranks joined, and that Horovod imports beside MPI (only that it is installed).
``--backend torch --on-failure shrink``: ``--world-size`` stands in for torchft's
REPLICA_GROUP_ID and NUM_REPLICA_GROUPS (and a lighthouse address) that the job's tasks get.

An accepted job prints its resolved configuration (the data set's defaults and preset, every
option), and what the planner sees of it (lsgd_hpc.planning: the bytes each rank sends per
step and per round, and rho, the seconds of one fp32 allreduce of the parameters between
nodes over one compute step, when ``--inter-gbps`` gives the link, or on one node, where it
is 0).
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from lsgd_hpc.cli.startup import EXIT_USAGE, PROG
from lsgd_hpc.envvars import RANKS_PER_NODE

__all__ = ["Preflight", "check_config", "dry_run", "options_argv"]

#: torchft's variables that every task of a --backend torch --on-failure shrink job gets
#: (lsgd_hpc.comm.replicas.REPLICA_ENV); the dry run stands in for them
_PLACEHOLDER_LIGHTHOUSE = "http://localhost:29510"


@dataclass
class Preflight:
    """The answer of the pre-flight check. ``error``: the job's error line after
    ``lsgd_hpc.train: error: `` (None when accepted). ``config``: the resolved options (the
    keys of the run's config.yaml); ``traffic``: the planner's bytes a rank sends (per step,
    per round); ``rho``: the planner's rho and its parts (None when the link is not known)."""

    accepted: bool
    error: Optional[str] = None
    world_size: Optional[int] = None
    ranks_per_node: Optional[int] = None
    config: Dict[str, Any] = field(default_factory=dict)
    preset: Dict[str, Any] = field(default_factory=dict)
    model: Dict[str, Any] = field(default_factory=dict)
    traffic: Optional[Dict[str, Any]] = None
    rho: Optional[Dict[str, Any]] = None
    notes: List[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def exit_status(self) -> int:
        """What the job would exit with before training: 0 (it starts) or 2."""
        return 0 if self.accepted else EXIT_USAGE

    @property
    def error_line(self) -> Optional[str]:
        return None if self.accepted else f"{PROG}: error: {self.error}"

    def format(self) -> str:
        """The dry run's report (stdout), or the job's error line."""
        if not self.accepted:
            return self.error_line
        return _report(self)


def options_argv(options: Union[Mapping[str, Any], Sequence[str], None]) -> List[str]:
    """The trainer's command line for ``options``: words as they are, or a mapping of option
    names (``--config``'s keys: ``topk`` or ``error-feedback``) to values (True: the flag;
    False and None: left out, or ``--no-NAME`` for an option on by default; a list: the
    flag repeated)."""
    if options is None:
        return []
    if isinstance(options, (str, bytes)):
        raise TypeError("options: a mapping of option names to values, or a list of words")
    if not isinstance(options, Mapping):
        return [str(a) for a in options]
    from lsgd_hpc.cli.config import cli_options
    known = cli_options()
    argv: List[str] = []
    for key, value in options.items():
        name = str(key).replace("-", "_")
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            on_by_default = name in known and known[name].default is True
            if value:
                argv.append(flag)
            elif on_by_default:
                argv.append("--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):
            for v in value:
                argv += [flag, str(v)]
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def check_config(options: Union[Mapping[str, Any], Sequence[str], None] = None, *,
                 world_size: int, ranks_per_node: Optional[int] = None,
                 inter_gbps: Optional[float] = None, step_ms: Optional[float] = None,
                 env: Optional[Mapping[str, str]] = None) -> Preflight:
    """The pre-flight check of a ``python -m lsgd_hpc.train`` job of ``world_size`` ranks
    (``ranks_per_node`` a node) with ``options`` (see options_argv), in this process: no
    MPI, no process group. ``env``: the job's environment (default os.environ). Returns a
    Preflight; never raises for a refused job (``.error`` says why, in the job's words)."""
    argv = options_argv(options) + ["--dry-run", "--world-size", str(world_size)]
    for flag, value in (("--ranks-per-node", ranks_per_node), ("--inter-gbps", inter_gbps),
                        ("--step-ms", step_ms)):
        if value is not None:
            argv += [flag, str(value)]
    return _check(argv, dict(os.environ if env is None else env))


def dry_run(argv: Sequence[str], env: Mapping[str, str]) -> int:
    """``python -m lsgd_hpc.train --dry-run ...``: the report on stdout (accepted, exit 0) or
    the job's one error line on stderr (exit 2)."""
    result = _check(list(argv), dict(env))
    if result.accepted:
        print(result.format(), flush=True)
    else:
        print(result.error_line, file=sys.stderr, flush=True)
    return result.exit_status


# -- the checks ------------------------------------------------------------------------------
def _check(argv: List[str], env: Dict[str, str]) -> Preflight:
    """Every check of the job, in its order; the first refusal is the answer."""
    from lsgd_hpc.cli.config import ConfigError
    from lsgd_hpc.comm import CommError
    from lsgd_hpc.data.errors import DataError
    started = time.monotonic()
    out = Preflight(accepted=False)
    try:
        cfg = _parse(argv, env)
        out.world_size, out.ranks_per_node = cfg.world_size, _ranks_per_node(cfg, env)
        training = _check_world(cfg, env)
        model, optimizer = _build(cfg, env, out)
        _check_method(cfg, model, optimizer, training, out)
    except (ConfigError, CommError, DataError) as exc:
        out.error = str(exc)
    except _MethodRefusal as exc:
        out.error = str(exc.__cause__)
    else:
        out.accepted = True
        out.config, out.preset = _resolved(cfg, out), dict(cfg.preset)
        _plan(cfg, model, training, out)
    out.seconds = time.monotonic() - started
    return out


class _MethodRefusal(Exception):
    """A ValueError of Method.check (what the job prints at its first collective)."""


def _parse(argv: List[str], env: Dict[str, str]):
    """parse_config as the job runs it, with --world-size standing in for what the job's
    tasks get from their launcher (torchft's replica group variables)."""
    from lsgd_hpc.cli.config import ConfigError, parse_config
    world = _last_value(argv, "--world-size") or ""     # (parse_config checks it)
    if world.isdigit() and int(world) > 0:
        env.setdefault("NUM_REPLICA_GROUPS", world)
        env.setdefault("REPLICA_GROUP_ID", "0")
        env.setdefault("TORCHFT_LIGHTHOUSE", _PLACEHOLDER_LIGHTHOUSE)
    cfg = parse_config(argv, env, dry_run=True)
    if cfg.world_size is None:
        raise ConfigError("--world-size", "is required with --dry-run (the ranks the job will "
                                          "start, e.g. $SLURM_NTASKS)")
    return cfg


def _last_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """The value of the last ``flag VALUE`` or ``flag=VALUE`` in ``argv`` (argparse's)."""
    value = None
    for i, word in enumerate(argv):
        if word == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(flag + "="):
            value = word.split("=", 1)[1]
    return value


def _ranks_per_node(cfg, env: Mapping[str, str]) -> Optional[int]:
    return cfg.ranks_per_node or RANKS_PER_NODE.read(env)


def _check_world(cfg, env: Mapping[str, str]) -> int:
    """check_world for the job's ranks (those that train: --spares wait), without the
    launcher's variables (the world the launcher started is the job's to check); the
    training world's size."""
    from lsgd_hpc.cli.config import ConfigError, check_world
    training = cfg.world_size - cfg.spares
    if training < 1:
        raise ConfigError("--spares", f"{cfg.spares} spares leave no rank to train in a job "
                                      f"of {cfg.world_size} ranks")
    world_env = {k: env[k] for k in (RANKS_PER_NODE.name,) if env.get(k)}
    check_world(cfg, training, world_env)
    if cfg.backend == "horovod":
        import importlib.util
        if importlib.util.find_spec("horovod") is None:
            from lsgd_hpc.comm import CommError
            from lsgd_hpc.comm.horovod import NOT_INSTALLED
            raise CommError(NOT_INSTALLED)
    return training


#: built models by (name, classes, input shape): the checks read them, never change them
_MODELS: Dict[tuple, Any] = {}


def _build(cfg, env: Mapping[str, str], out: Preflight):
    """The model (as the Trainer builds it, on the CPU) and the worker's optimizer."""
    import torch
    from lsgd_hpc.cli.build import make_optimizer
    from lsgd_hpc.cli.config import ConfigError
    from lsgd_hpc.data.specs import dataset_spec
    from lsgd_hpc.models import zoo as models
    spec = dataset_spec(cfg.dataset)
    classes, shape = spec.num_classes, spec.input_shape
    if classes is None or shape is None:         # imagefolder, a user's data set: look
        from lsgd_hpc.cli.build import loader_options
        from lsgd_hpc.data.loaders import load_dataset
        ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.synthetic_size,
                          cfg.label_noise, **loader_options(cfg))
        classes, shape = ds.num_classes, ds.input_shape
    name = cfg.model or spec.default_model
    key = (name, classes, tuple(shape))
    if key not in _MODELS:
        torch.manual_seed(cfg.seed)
        try:
            _MODELS[key] = models.build_model(name, classes, shape)
        except ValueError as exc:
            raise ConfigError("--model", str(exc)) from None
    model = _MODELS[key]
    out.model = {"name": name, "classes": classes, "input_shape": list(shape),
                 "parameters": sum(p.numel() for p in model.parameters()),
                 "buffer_elements": sum(b.numel() for b in model.buffers()
                                        if b.is_floating_point())}
    return model, make_optimizer(cfg, model.parameters())


def _check_method(cfg, model, optimizer, training: int, out: Preflight) -> None:
    """The checks the job's method runs before its first collective (Method.check), with
    what the trainer passes it."""
    from lsgd_hpc.methods import METHODS
    rpn = out.ranks_per_node
    node_of = [r // rpn for r in range(training)] if rpn else None
    score = {"score_fn": lambda: 0.0} if cfg.leader_score == "heldout" else {}
    try:
        METHODS[cfg.algorithm].check(
            model, optimizer, world_size=training, node_of=node_of, backend=cfg.backend,
            checkpoint_every=cfg.checkpoint_every, consensus_every=cfg.consensus_every,
            stop_check_every=cfg.stop_check_every, comm_dtype=cfg.comm_dtype,
            error_feedback=cfg.error_feedback, topk=cfg.topk,
            error_feedback_decay=cfg.error_feedback_decay, worker_ranks=cfg.worker_ranks,
            **cfg.method_options, **score)
    except ValueError as exc:
        raise _MethodRefusal() from exc
    if rpn is None:
        out.notes.append("assumed: the ranks' nodes by host name, as the job finds them "
                         "(pass --ranks-per-node K to check the node layout here)")


def _resolved(cfg, out: Preflight) -> Dict[str, Any]:
    """The options as the run's config.yaml records them (without the dry run's own)."""
    from lsgd_hpc.cli.config import PREFLIGHT_OPTIONS
    from lsgd_hpc.methods.registry import SPECS
    rpn = out.ranks_per_node
    others = {o.name for s in SPECS.values() for o in s.options} - set(cfg.method_options)
    d = {k: v for k, v in cfg.to_dict().items()
         if k not in PREFLIGHT_OPTIONS and k not in others}
    d.update(model=out.model["name"], world_size=cfg.world_size - cfg.spares,
             n_nodes=-(-cfg.world_size // rpn) if rpn else None)
    return d


# -- what the planner sees -------------------------------------------------------------------
def _plan(cfg, model, training: int, out: Preflight) -> None:
    """The planner's bytes per step and per round of this method, and rho (when the link
    between nodes is given, or the job is on one node)."""
    rpn = out.ranks_per_node
    if rpn is None:
        out.notes.append("not priced: the planner needs the node layout (--ranks-per-node K)")
        return
    if training % rpn:
        out.notes.append(f"not priced: {training} ranks are not whole nodes of {rpn}")
        return
    try:
        facts, inp, cost, rho = _planner(cfg, training // rpn, rpn)
    except ValueError as exc:
        out.notes.append(f"not priced by the planner: {exc}")
        return
    period = _period(cfg.algorithm, cfg.method_options)
    out.traffic = {"bytes_per_step": cost.bytes_per_step, "setting": cost.setting,
                   "period_steps": period,
                   "bytes_per_round": cost.bytes_per_step * period if period else None}
    if cfg.inter_gbps is not None or training // rpn == 1:
        out.traffic.update(comm_s_per_step=cost.comm_s, compute_s=cost.compute_s,
                           comm_share=cost.comm_share)
        out.rho = rho
        out.notes += [f"the planner {a}" for a in inp.assumptions]
    else:
        out.notes.append("rho: pass --inter-gbps G (the link between nodes, Gbit/s) for the "
                         "planner's rho and seconds")


def _planner(cfg, nodes: int, rpn: int):
    """(facts, PlanInputs, MethodCost, rho dict) of the planner (lsgd_hpc.planning.plan) for
    this job."""
    from lsgd_hpc.models.zoo import MODELS
    from lsgd_hpc.planning import plan as planner
    name = cfg.model or _default_model(cfg.dataset)
    facts = _facts(name, cfg.dataset if name in MODELS else None)
    words = ["--nodes", str(nodes), "--ranks-per-node", str(rpn),
             "--inter-gbps", str(cfg.inter_gbps or 10.0), "--comm-dtype", cfg.comm_dtype,
             "--topk", repr(float(cfg.topk)), "--gpu", "cpu" if cfg.device == "cpu" else "h100",
             "--batch-size", str(cfg.batch_size)]
    if cfg.step_ms is not None:
        words += ["--step-ms", repr(float(cfg.step_ms))]
    args = _planner_parser().parse_args(words)
    args.worker_ranks = cfg.worker_ranks
    inp = planner._inputs(args, facts)
    costing = planner._Costing(inp, facts)
    cost = costing(cfg.algorithm, **cfg.method_options)
    return facts, inp, cost, planner._rho(costing.cluster, facts, inp.step_s)


@functools.lru_cache(maxsize=1)
def _planner_parser():
    from lsgd_hpc.planning import plan as planner
    return planner._parser()


def _default_model(dataset: str) -> str:
    from lsgd_hpc.data.specs import dataset_spec
    return dataset_spec(dataset).default_model


_FACTS: Dict[tuple, Any] = {}


def _facts(name: str, dataset: Optional[str]):
    """The planner's facts of the model (its counts and multiply-adds), once per model."""
    from lsgd_hpc.planning import plan as planner
    key = (name, dataset if dataset in planner.DATASET_SHAPES else None)
    if key not in _FACTS:
        if key[1] is None:
            raise ValueError(f"the planner knows the zoo's models on digits, cifar10 and "
                             f"synthetic, not {name} on {dataset}")
        _FACTS[key] = planner.model_facts(*key)
    return _FACTS[key]


def _period(algorithm: str, options: Mapping[str, Any]) -> Optional[int]:
    """Steps between the method's rounds (LSGD: its global round; allreduce and gossip:
    every step); None when it is chosen while training (local SGD's auto)."""
    value = {"lsgd": "tau_global", "lsgd-async": "tau_global", "easgd": "easgd_tau",
             "local-sgd": "local_steps", "diloco": "local_steps",
             "slowmo": "local_steps"}.get(algorithm)
    period = 1 if value is None else options.get(value)
    return period if isinstance(period, int) and not isinstance(period, bool) else None


# -- the report ------------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _report(r: Preflight) -> str:
    import yaml
    cfg, m = r.config, r.model
    rpn = r.ranks_per_node
    layout = (f"{r.world_size} ranks, {rpn} a node" if rpn else f"{r.world_size} ranks")
    lines = [f"{PROG} --dry-run: accepted: every check of the job ({layout}) passed in "
             f"{r.seconds:.2f} s; no MPI, no process group started",
             f"  model {m['name']}: {m['parameters']:,} parameters, {m['buffer_elements']:,} "
             f"floating-point buffer elements; method {cfg['algorithm']}: " + ", ".join(
                 f"{k} {v}" for k, v in cfg["method_options"].items())]
    if r.preset:
        lines.append(f"  from the {cfg['dataset']} preset: " + ", ".join(
            f"{k} {v}" for k, v in r.preset.items()) + " (--no-preset: the library's defaults)")
    t = r.traffic
    if t is not None:
        rnd = (f", {_bytes(t['bytes_per_round'])} a round of {t['period_steps']} step(s)"
               if t["bytes_per_round"] is not None else "")
        lines.append(f"  each rank sends (the planner's mean over ranks): "
                     f"{_bytes(t['bytes_per_step'])} a step{rnd} ({t['setting']}; "
                     f"comm {cfg['comm_dtype']}, top-k {cfg['topk']:g})")
    if r.rho is not None:
        lines.append(f"  rho = {r.rho['rho']:.3g}: one fp32 allreduce of the parameters between "
                     f"nodes {r.rho['allreduce_between_nodes_s'] * 1e3:.3g} ms / compute "
                     f"{r.rho['compute_s'] * 1e3:.3g} ms a step; predicted communication "
                     f"{t['comm_share'] * 100:.3g} % of a step")
    lines += [f"  {n}" for n in r.notes]
    lines.append("  not checked here (the job's nodes): --device cuda's GPU, the launcher's "
                 "world, Horovod beside MPI")
    lines.append("resolved configuration (the run's config.yaml; other methods' options left "
                 "out; the planner's assumed figures: python -m lsgd_hpc.plan sets them):")
    lines += ["  " + ln for ln in yaml.safe_dump(cfg, sort_keys=True).splitlines()]
    return "\n".join(lines)
