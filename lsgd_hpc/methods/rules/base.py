"""What every training method shares: a step hook over the communication interface."""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import copy

import torch

from lsgd_hpc.comm import FlatParams, NodeGroups
from lsgd_hpc.comm.accounting import uncounted
from lsgd_hpc.methods.rules.state import REPLICA

__all__ = ["Rule", "MetricsSink"]

#: log(group, **row): the trainer's metrics writer (or a list-appender in tests)
MetricsSink = Callable[..., None]


class Rule:
    """A method's update rule: a hook around each worker's own optimizer step. Its options
    arrive checked (lsgd_hpc.methods.spec); a rule does not check them again.

    The trainer calls ``before_step`` after backward (gradients in ``flat.grad``) and
    ``after_step`` after the optimizer step with the number of completed steps and the
    minibatch loss. Anything a method keeps across steps is in ``state_dict``.

    Its state is declared once (lsgd_hpc.methods.rules.state): ``state_dict`` /
    ``load_state_dict`` serialise it, ``shared_state`` names the keys that every member of
    the group holds identically (the rest is the rank's own), and ``suspend`` / ``resume``
    hand over what is in flight when ranks die. Checkpoints, the survivors' recovery and the
    rejoin of lost ranks all work from that; the hooks below have defaults that suit a rule
    with nothing in flight across steps.
    """

    name = "base"
    #: extra columns this method adds to the metric groups, e.g. {"eval": {"center_test_accuracy": "f8"}}
    extra_columns: Dict[str, Dict[str, str]] = {}
    #: extra HDF5 file attributes this method adds, e.g. the meaning of a code column
    file_attrs: Dict[str, str] = {}
    #: True for a method that decides itself when training ends, stops and checkpoints
    #: (ranks take different numbers of steps): see AsyncLeaderRule.control
    owns_schedule = False
    #: --consensus-every, set by the trainer: a method that owns its schedule measures the
    #: consensus distance at its own agreed moments when this is non-zero (0: never)
    consensus_every = 0
    #: the keys of ``state_dict`` that must be identical on every member of the group, and
    #: ``REPLICA`` for the parameters, buffers and optimizer state (rules/state.py)
    shared_state: Tuple[str, ...] = ()
    #: the rank's own state (attributes), which ``state_dict`` also saves by default
    own_state: Tuple[str, ...] = ()

    def __init__(self, groups: NodeGroups, flat: FlatParams, log: Optional[MetricsSink] = None):
        self.groups = groups
        self.world = groups.world
        self.flat = flat
        self.log = log or (lambda group, **row: None)
        #: track(step, **scalars): values for the experiment trackers only (not the HDF5)
        self.track = lambda step, **scalars: None
        # the flat buffers' shapes are agreed on once here, not before every collective
        self.world.agree_buffers(flat.flat, flat.params, flat.grad, flat.flat[flat.n_params:])

    def before_step(self, step: int) -> None:
        """Gradients of this step are in flat.grad; the optimizer has not stepped yet."""

    def after_step(self, step: int, loss: float) -> None:
        """``step`` optimizer steps are done; the last minibatch loss was ``loss``."""

    @property
    def overlaps(self) -> bool:
        """True when the rule keeps collectives in flight across steps (see progress)."""
        return False

    def progress(self) -> None:
        """Advance the rule's non-blocking collectives in flight, if any. Open MPI moves a
        non-blocking collective forward only inside MPI calls: the method calls this from
        gradient hooks during backward, so a broadcast or allreduce posted at one step runs
        behind the next steps' compute instead of waiting for the step that needs it."""

    def eval_models(self) -> Dict[str, torch.Tensor]:
        """Extra flat parameter vectors to evaluate beside the worker's own (name -> vector)."""
        return {}

    def train_columns(self) -> Dict[str, float]:
        """Values of this method's extra /train columns for the current row."""
        return {}

    def state_dict(self) -> dict:
        """Default: the declared attributes (``shared_state`` and ``own_state``) by name, as
        copies (tensors cloned, an object with a ``state_dict`` as its state)."""
        return {k: _saved(getattr(self, k)) for k in self.shared_state + self.own_state
                if k != REPLICA}

    def load_state_dict(self, state: dict) -> None:
        """Default: the declared attributes back (tensors copied into in place)."""
        for k in self.shared_state + self.own_state:
            if k == REPLICA:
                continue
            current = getattr(self, k)
            if isinstance(current, torch.Tensor):
                current.copy_(state[k])
            elif hasattr(current, "load_state_dict"):
                current.load_state_dict(copy.deepcopy(state[k]))
            else:
                setattr(self, k, copy.deepcopy(state[k]))

    def shared_state_dict(self) -> dict:
        """The ``shared_state`` keys of ``state_dict`` (``REPLICA`` is the method's)."""
        state = self.state_dict()
        return {k: state[k] for k in self.shared_state if k != REPLICA}

    def take_shared(self, shared: dict) -> None:
        """Load another member's ``shared_state`` keys (a survivor's, at a recovery); this
        rank's own state stays. Default: through ``load_state_dict``."""
        state = self.state_dict()
        state.update(shared)
        self.load_state_dict(state)

    # -- ranks lost (on_failure="shrink"): what is in flight --------------------------------------
    def suspend(self, complete: bool, recovery) -> object:
        """Local, when a failure cut this rank's step off (``complete``: the step's
        communication had completed): forget the requests in flight (they died with the old
        communicators) and return what every survivor must know of them (picklable), or
        None. ``recovery``: a ``rules.state.Recovery``."""
        return None

    def resume(self, recovery) -> None:
        """Collective over the survivors, after the shared state is agreed (taken from
        ``recovery.source``): complete or drop, alike on every survivor, what was in flight
        (``recovery.reports``: each survivor's ``suspend`` result), rebuild communicators of
        the rule's own. Called again from the start if a rank dies during it."""

    def rejoin(self, world, joined: bool, source: int) -> str:
        """Collective, at a full-size resume of a survivors' checkpoint: the ranks that were
        lost (``joined``) take their parameters; returns what they took (for the log).
        Default: the parameters of ``source``, the lowest survivor."""
        from lsgd_hpc.methods.rules.state import take_parameters
        take_parameters(world, self.flat, source, joined)
        return f"rank {source}'s parameters and a fresh optimizer state"

    # -- shared pieces ----------------------------------------------------------------------
    def measure_consensus(self, step: int) -> float:
        """Log and return the consensus distance of the trainable parameters,

            D = (1/p) sum_i ||x_i - xbar||^2,   xbar = (1/p) sum_j x_j,

        over the parameters only (BatchNorm running statistics are not trained, and would
        otherwise dominate D). The same code for every method; the trainer calls it at the
        same point of every method's cycle: after the local optimizer step, before the
        method's communication of that step. Two uncounted allreduces (the mean, then the
        mean of the squared deviations), booked as measurement (probe_seconds).
        """
        world = getattr(self.world, "inner", self.world)    # exact, whatever --comm-dtype
        if world.size == 1:                                  # one worker: D = 0, no traffic
            self.log("consensus", step=step, distance=0.0)
            return 0.0
        x = self.flat.params
        mean = x.detach().clone()
        with uncounted(world, probe=True):
            world.allreduce_(mean, "mean")
            sq = (x.detach().double() - mean.double()).pow(2).sum().reshape(1).cpu()
            world.allreduce_(sq, "mean")
        distance = float(sq.item())
        self.log("consensus", step=step, distance=distance)
        return distance


def _saved(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if hasattr(value, "state_dict"):
        return copy.deepcopy(value.state_dict())
    return copy.deepcopy(value)
