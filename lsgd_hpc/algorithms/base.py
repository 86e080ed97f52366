"""What every training method shares: a step hook over the communication interface."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Dict, Iterator, Optional

import torch

from ..comm import Communicator, FlatParams, NodeGroups

__all__ = ["Algorithm", "uncounted", "MetricsSink"]

#: log(group, **row): the trainer's metrics writer (or a list-appender in tests)
MetricsSink = Callable[..., None]


@contextmanager
def uncounted(comm: Communicator) -> Iterator[None]:
    """Measurement and control traffic (consensus probes, stop flags) is not the method's
    communication: restore the counters afterwards so comm_* report only the algorithm, and
    book the time as overhead (neither communication nor compute)."""
    saved = comm.stats.snapshot()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        comm.stats.load_state_dict(saved.state_dict())
        comm.stats.overhead_seconds += time.perf_counter() - t0


class Algorithm:
    """A training method is a hook around each worker's own optimizer step.

    The trainer calls ``before_step`` after backward (gradients in ``flat.grad``) and
    ``after_step`` after the optimizer step with the number of completed steps and the
    minibatch loss. Anything a method keeps across steps is in ``state_dict``.
    """

    name = "base"
    #: extra columns this method adds to the metric groups, e.g. {"eval": {"center_test_accuracy": "f8"}}
    extra_columns: Dict[str, Dict[str, str]] = {}
    #: extra HDF5 file attributes this method adds, e.g. the meaning of a code column
    file_attrs: Dict[str, str] = {}
    #: True for a method that decides itself when training ends, stops and checkpoints
    #: (ranks take different numbers of steps): see AsyncLeaderSGD.control
    owns_schedule = False

    def __init__(self, groups: NodeGroups, flat: FlatParams, log: Optional[MetricsSink] = None):
        self.groups = groups
        self.world = groups.world
        self.flat = flat
        self.log = log or (lambda group, **row: None)

    def before_step(self, step: int) -> None:
        """Gradients of this step are in flat.grad; the optimizer has not stepped yet."""

    def after_step(self, step: int, loss: float) -> None:
        """``step`` optimizer steps are done; the last minibatch loss was ``loss``."""

    def eval_models(self) -> Dict[str, torch.Tensor]:
        """Extra flat parameter vectors to evaluate beside the worker's own (name -> vector)."""
        return {}

    def train_columns(self) -> Dict[str, float]:
        """Values of this method's extra /train columns for the current row."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    # -- shared pieces ----------------------------------------------------------------------
    def log_consensus(self, step: int, deviation: torch.Tensor) -> float:
        """Log mean_i ||x_i - mean_j x_j||^2 given this worker's deviation x_i - mean (one
        scalar allreduce, not counted as the method's traffic)."""
        sq = torch.tensor([float(deviation.double().pow(2).sum())], dtype=torch.float64)
        with uncounted(self.world):
            self.world.allreduce_(sq, "mean")
        self.log("consensus", step=step, distance=float(sq.item()))
        return float(sq.item())

    def probe_consensus(self, step: int) -> float:
        """Consensus distance when the method has no average at hand: one full allreduce
        (not counted as the method's traffic)."""
        mean = self.flat.flat.clone()
        with uncounted(self.world):
            self.world.allreduce_(mean, "mean")
        return self.log_consensus(step, self.flat.flat - mean)
