"""What a method is, written once: its name, its class, and each option's default, type or
range, help text and command-line section, plus its entry in the cost model.

A :class:`MethodSpec` is plain data and imports neither torch nor mpi4py: the library's
classes (``lsgd_hpc.LeaderSGD``...), the trainer's command line (``--tau-local``...), the docs'
methods table and the planner all read it (``lsgd_hpc.methods.registry.SPECS``). Checks live
here too, so a value is refused with the same words wherever it comes from::

    spec.resolve({"tau_local": 4, "tau_global": 6})
    ValueError: tau_global must be a multiple of tau_local (6 vs 4)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["Option", "OptionError", "Check", "MethodSpec", "COMMON_OPTIONS", "COMM_DTYPES",
           "QUANTIZED_COMM_DTYPES", "SECTIONS", "comm_dtype_problem", "error_feedback_problem",
           "error_feedback_decay_problem",
           "topk_problem", "TOPK_METHODS"]

#: Command-line help sections, in the order ``--help`` prints them.
SECTIONS = ("method", "LSGD", "baselines", "data and model", "cluster and backend",
            "output and checkpoints")

#: What a method may send its model-sized traffic in (``comm_dtype``).
COMM_DTYPES = ("fp32", "bf16", "int8", "fp8", "int4", "int2")
#: the quantized ones (one byte, half a byte, a quarter of a byte per element): per-block
#: scales, a two-phase allreduce (lsgd_hpc.comm.quantized)
QUANTIZED_COMM_DTYPES = ("int8", "fp8", "int4", "int2")
#: the methods that may send quantized (and top-k) traffic
_PERIODIC = ("the synchronous methods (lsgd, allreduce, easgd, local-sgd, diloco, slowmo, "
             "gossip)")
#: methods that cannot send in int8/fp8/int4/int2, and why
_NOT_QUANTIZED = {
    "lsgd-async": "lsgd-async broadcasts without blocking; int8/fp8/int4/int2 are for "
                  f"{_PERIODIC}",
}

#: the methods whose allreduce the planner prices as top-k's (``topk`` < 1;
#: lsgd_hpc.planning; allreduce's gradient every step; local-sgd and slowmo average through
#: a reference, rules/local_sgd.FlatAverage)
TOPK_METHODS = ("allreduce", "easgd", "diloco", "local-sgd", "slowmo")
#: methods that refuse ``topk`` < 1, and why (lsgd takes it for its global pull, allreduce
#: for its gradient's average, easgd, local-sgd, diloco and slowmo for their periodic
#: allreduce)
_NOT_TOPK = {
    "lsgd-async": "lsgd-async broadcasts a leader's parameters; it has no periodic average "
                  "to sparsify (synchronous lsgd's global pull takes topk)",
}

#: Option kinds and how a value of each is described in an error
KINDS = ("int", "float", "bool", "choice", "str", "callable", "int_or_auto", "int_or_modules",
         "int_or_node")
#: the word each integer-or-word kind also takes
_WORDS = {"int_or_auto": "auto", "int_or_node": "node"}


class OptionError(ValueError):
    """A bad option value: ``option`` names it, ``reason`` says why (``must be ...``)."""

    def __init__(self, option: str, reason: str):
        super().__init__(f"{option} {reason}")
        self.option, self.reason = option, reason


@dataclass(frozen=True)
class Option:
    """One option of a method.

    ``kind``: int, float, bool, choice (one of ``choices``), str, callable, int_or_auto
    (a positive integer or the word ``auto``), int_or_node (a positive integer or the word
    ``node``), or int_or_modules (an integer, or in the
    library a non-empty list of ``torch.nn.Module``, told by duck type since this module
    imports no torch; the command line and YAML give the integer). ``low``/``high`` bound
    numbers (``low_open``, ``high_open``: the bound itself is excluded). ``none``: None is
    allowed and means this (the text --help shows); otherwise None is refused. ``cli``: False
    for options that only a library user can pass (callables). ``multiple``: the value is a
    list of such values (a repeatable flag).
    """

    name: str
    default: Any
    kind: str
    help: str
    section: str = "baselines"
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: Tuple[str, ...] = ()
    none: Optional[str] = None
    cli: bool = True
    multiple: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise TypeError(f"option {self.name}: kind must be one of {KINDS}")
        if self.section not in SECTIONS:
            raise TypeError(f"option {self.name}: section must be one of {SECTIONS}")

    @property
    def flag(self) -> str:
        """The command-line flag (``--tau-local``)."""
        return "--" + self.name.replace("_", "-")

    def _range(self) -> str:
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        return f"{'(' if self.low_open or self.low is None else '['}{lo}, {hi}" \
               f"{')' if self.high_open or self.high is None else ']'}"

    def check(self, value: Any) -> Any:
        """The value, normalised (an int stays an int, a float becomes float); raises
        :class:`OptionError` naming the option for anything else."""
        if value is None:
            if self.none is not None:
                return None
            raise OptionError(self.name, "must be given (None is not a value for it)")
        if self.multiple:
            values = [value] if isinstance(value, str) else value
            if not isinstance(values, (list, tuple)):
                raise OptionError(self.name, f"must be a list, got {value!r}")
            one = replace(self, multiple=False)
            return list(dict.fromkeys(one.check(v) for v in values))    # each once, in order
        k = self.kind
        if k in _WORDS:
            if value == _WORDS[k]:
                return value
            k = "int"
        if k == "int_or_modules":
            if isinstance(value, (list, tuple)):
                bad = [type(m).__name__ for m in value
                       if not callable(getattr(m, "parameters", None))]
                if not value or bad:
                    got = f"holding {bad[0]}" if bad else "that is empty"
                    raise OptionError(self.name, "must be an integer or a non-empty list of "
                                                 f"torch.nn.Module, got a list {got}")
                return list(value)
            k = "int"
        if k == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                if isinstance(value, float) and value.is_integer():
                    value = int(value)
                else:
                    alt = {**{k: f" or {w}" for k, w in _WORDS.items()},
                           "int_or_modules": " or a list of modules"}.get(self.kind, "")
                    raise OptionError(self.name, f"must be an integer >= {self.low:g}{alt}, "
                                                 f"got {value!r}")
            word = f" or {_WORDS[self.kind]}" if self.kind in _WORDS else ""
            self._check_bounds(value, (f"an integer >= {self.low:g}" if self.high is None
                                       else f"an integer in {self._range()}") + word)
            return int(value)
        if k == "float":
            if isinstance(value, bool):
                raise OptionError(self.name, f"must be a number, got {value!r}")
            try:
                v = float(value)
            except (TypeError, ValueError):
                raise OptionError(self.name, f"must be a number, got {value!r}") from None
            if math.isnan(v) or (math.isinf(v) and self.high is not None):
                raise OptionError(self.name, f"must be in {self._range()}, got {value!r}")
            self._check_bounds(v, self._want_number())
            return v
        if k == "bool":
            if not isinstance(value, bool):
                raise OptionError(self.name, f"must be True or False, got {value!r}")
            return value
        if k == "choice":
            if value not in self.choices:
                raise OptionError(self.name, f"must be one of {', '.join(self.choices)}, "
                                             f"got {value!r}")
            return value
        if k == "str":
            if not isinstance(value, str):
                raise OptionError(self.name, f"must be a string, got {value!r}")
            return value
        if not callable(value):     # callable
            raise OptionError(self.name, f"must be a callable, got {type(value).__name__}")
        return value

    def _want_number(self) -> str:
        if self.high is None and self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        return f"in {self._range()}"

    def _check_bounds(self, v: float, want: str) -> None:
        bad_low = self.low is not None and (v <= self.low if self.low_open else v < self.low)
        bad_high = self.high is not None and (v >= self.high if self.high_open else v > self.high)
        if bad_low or bad_high:
            raise OptionError(self.name, f"must be {want}, got {v!r}")

    def parse(self, text: Any) -> Any:
        """A value from a command line or a YAML file (text, or YAML's own types) in this
        option's type, then checked."""
        if isinstance(text, str) and self.kind in ("int", "float", "int_or_modules", *_WORDS):
            if self.kind in _WORDS and text == _WORDS[self.kind]:
                return text
            try:
                number = float(text) if self.kind == "float" else int(text)
            except ValueError:
                return self.check(text)          # refused, in the words of check
            return self.check(number)
        if self.multiple and isinstance(text, (list, tuple)):
            one = replace(self, multiple=False)
            return self.check([one.parse(t) for t in text])
        if isinstance(text, str) and self.kind == "bool":
            low = text.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise OptionError(self.name, f"must be true or false, got {text!r}")
        return self.check(text)

    def default_text(self) -> str:
        if self.default is None and self.none:
            return self.none
        if self.default is True:
            return "on"
        if self.default is False:
            return "off"
        return str(self.default)


@dataclass(frozen=True)
class Check:
    """A check across options (or of options against the world size): ``test(options)`` or
    ``test(options, world_size)`` returns why the values do not go together, or None; the
    error names ``option``."""

    option: str
    test: Callable[..., Optional[str]]


def comm_dtype_problem(comm_dtype: str, backend: Optional[str],
                       method: Optional[str] = None) -> Optional[str]:
    """Why ``comm_dtype`` cannot run on ``backend`` with ``method`` (a spec name), or None."""
    if comm_dtype in QUANTIZED_COMM_DTYPES:
        if method in _NOT_QUANTIZED:
            return f"{comm_dtype} is not for {method}: {_NOT_QUANTIZED[method]}"
    return None


def topk_problem(topk: float, comm_dtype: str, backend: Optional[str],
                 method: Optional[str] = None) -> Optional[str]:
    """Why ``topk`` (< 1: sparse) cannot run with ``comm_dtype`` on ``backend`` with
    ``method``, or None (its range is the option's own check)."""
    if topk >= 1:
        return None
    if method in _NOT_TOPK:
        return f"{topk:g} is not for {method}: {_NOT_TOPK[method]}"
    return None


#: methods whose communication keeps no error-feedback residual that a decay could act on
_NO_RESIDUAL = {
    "lsgd": "lsgd's pulls keep no residual (its compressed pull feeds back through the "
            "reference every rank keeps; see docs/algorithms.md)",
    "lsgd-async": "lsgd-async broadcasts parameters and keeps no residual",
    "gossip": "compressed gossip feeds back through CHOCO's public copies, not a residual "
              "(see docs/algorithms.md)",
}


def error_feedback_decay_problem(decay: float, error_feedback: bool,
                                 method: Optional[str] = None) -> Optional[str]:
    """Why ``error_feedback_decay`` (below 1) cannot go with ``error_feedback`` and
    ``method``, or None (its range is the option's own check)."""
    if decay >= 1:
        return None
    if not error_feedback:
        return (f"{decay:g} decays the error-feedback residual: it needs --error-feedback")
    if method in _NO_RESIDUAL:
        return f"{decay:g} is not for {method}: {_NO_RESIDUAL[method]}"
    return None


#: methods whose bf16 traffic holds no allreduce for error feedback to act on, and why
_NO_BF16_FEEDBACK = {
    "lsgd": "lsgd sends a leader's copy by broadcast, a new vector each time, not a term of "
            "a sum over rounds: there is no allreduce whose bf16 rounding could be fed back",
    "lsgd-async": "lsgd-async only broadcasts parameters: there is no allreduce whose bf16 "
                  "rounding could be fed back",
    "gossip": "bf16 gossip sends parameters to its neighbours: there is no allreduce whose "
              "bf16 rounding could be fed back",
}


def error_feedback_problem(error_feedback: bool, comm_dtype: str, topk: float = 1.0,
                           method: Optional[str] = None) -> Optional[str]:
    """Why ``error_feedback`` cannot go with ``comm_dtype``, ``topk`` and ``method`` (a spec
    name; None: not known), or None. It needs something dropped: bf16's rounding
    (e <- (v + e) - bf16(v + e), lsgd_hpc.comm.lowprec), int8/fp8/int4/int2's, or what top-k
    left out."""
    if not error_feedback or topk < 1 or comm_dtype in QUANTIZED_COMM_DTYPES:
        return None
    if comm_dtype == "bf16":
        return f"is not for {method}: {_NO_BF16_FEEDBACK[method]}" \
            if method in _NO_BF16_FEEDBACK else None
    return ("needs --comm-dtype bf16, int8, fp8, int4 or int2, or --topk < 1 (it feeds back "
            f"their rounding or what top-k left out; comm_dtype is {comm_dtype})")


#: Options every method takes (besides its own), with the library's defaults.
COMMON_OPTIONS: Tuple[Option, ...] = (
    Option("comm_dtype", "fp32", "choice",
           "what the method sends (pulls, averages, pseudo-gradients, gradients): fp32, or bf16, "
           "half the bytes, rounded; or int8 or fp8, a quarter of the bytes, int4 an eighth, "
           "int2 a sixteenth, plus per-block scales, for allreduce (its gradient), lsgd, "
           "easgd, local-sgd, diloco and slowmo, and gossip (CHOCO-SGD: the change against "
           "public copies) (see docs/algorithms.md)",
           section="cluster and backend", choices=COMM_DTYPES),
    Option("error_feedback", False, "bool",
           "with comm_dtype bf16, int8, fp8, int4 or int2, or topk < 1: each rank adds what "
           "rounding dropped (or top-k left out) from its allreduce input to the next one "
           "(residuals kept in the checkpoint); gossip's public copies feed back already "
           "(accepted, no change)",
           section="cluster and backend"),
    Option("error_feedback_decay", 1.0, "float",
           "beta in (0, 1]: with --error-feedback, each allreduce sends the compression of "
           "v + beta e instead of v + e (SparseLoCo's decayed accumulator, which stands in for "
           "the outer momentum: use it with --outer-momentum 0); 1: plain error feedback "
           "(see docs/algorithms.md)",
           section="cluster and backend", low=0, low_open=True, high=1),
    Option("topk", 1.0, "float",
           "F in (0, 1]: with F < 1 the gradient's allreduce of allreduce (every step) and "
           "the periodic allreduce of easgd, diloco (Streaming "
           "DiLoCo too), local-sgd and slowmo (these two send the change since the last "
           "average) send, of every chunk of 4096 elements, the ceil(F 4096) entries of "
           "largest magnitude as (index, value), values as --comm-dtype (fp32, bf16, int8, "
           "fp8, int4, int2); with --error-feedback what was left out is sent later; lsgd's "
           "global pull sends the top-k of the leader's change since the last pull (its own "
           "error feedback; with --pull-delay, not under --on-failure shrink or heal); gossip "
           "sends the top-k of the change against its public copy (CHOCO-SGD) (see "
           "docs/algorithms.md); 1: dense",
           section="cluster and backend",
           low=0, low_open=True, high=1),
    Option("stop_check_every", 10, "int",
           "steps between the non-blocking agreements on a stop signal",
           section="cluster and backend", low=1),
    Option("worker_ranks", 1, "int_or_node",
           "ranks per worker: K consecutive ranks of a node, or node (all of a node's ranks), "
           "train one replica as data parallel SGD (gradients averaged every step inside the "
           "worker) and the method runs between workers (1: every rank is a worker)",
           section="cluster and backend", low=1),
)


@dataclass(frozen=True)
class MethodSpec:
    """One method, as every part of the package sees it.

    ``name``: the trainer's ``--algorithm`` value; ``class_name``: the public class
    (``lsgd_hpc.<class_name>``); ``summary``: one line for tables; ``options``: the method's
    own options with the library's defaults (the papers' values); ``checks``: checks across
    options; ``world_checks``: checks that need the world size; ``cost``: its entry in the
    cost model, ``cost(cm, workload, cluster, options, collectives)`` with ``cm`` the module
    :mod:`lsgd_hpc.planning.costmodel` (passed in, so that this module needs none of it),
    returning a ``MethodCost``. With ``worker_ranks`` (workers that span ranks):
    ``worker_grouping`` False says the method trains one replica over every rank already
    (allreduce SGD), so a grouping changes nothing and is accepted as such;
    ``workers_refused`` says why the method cannot run between workers (refused).
    """

    name: str
    class_name: str
    summary: str
    options: Tuple[Option, ...]
    cost: Callable[..., Any]
    checks: Tuple[Check, ...] = ()
    world_checks: Tuple[Check, ...] = ()
    notes: Mapping[str, str] = field(default_factory=dict)
    worker_grouping: bool = True
    workers_refused: Optional[str] = None

    @property
    def defaults(self) -> Dict[str, Any]:
        """The method's own options and their defaults (a new dict each time)."""
        return {o.name: o.default for o in self.options}

    def option(self, name: str) -> Option:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(name)

    def resolve(self, given: Mapping[str, Any], world_size: Optional[int] = None,
                where: str = "") -> Dict[str, Any]:
        """The defaults updated by ``given``, every value checked: an OptionError (a
        ValueError) names the bad option; an unknown option is refused naming ``where`` (the
        class). With ``world_size`` the checks that need it run too."""
        known = {o.name for o in self.options}
        unknown = sorted(set(given) - known)
        prefix = f"{where}: " if where else ""
        if unknown:
            raise ValueError(f"{prefix}unknown option(s) {', '.join(unknown)} "
                             f"(its options: {', '.join(sorted(known)) or 'none'})")
        out = self.defaults
        for o in self.options:
            if o.name in given:
                out[o.name] = o.check(given[o.name])
        for c in self.checks:
            why = c.test(out)
            if why:
                raise OptionError(c.option, why)
        if world_size is not None:
            self.check_world(out, world_size)
        return out

    def check_world(self, options: Mapping[str, Any], world_size: int) -> None:
        """Raise OptionError for options that cannot work on ``world_size`` ranks."""
        for c in self.world_checks:
            why = c.test(options, world_size)
            if why:
                raise OptionError(c.option, why)
