"""The methods as users call them from their own training loop.

    method = lsgd_hpc.LeaderSGD(model, optimizer, comm, tau_local=4, tau_global=16)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        method.step(loss)          # in place of optimizer.step()

Each class wraps one update rule of :mod:`lsgd_hpc.methods.rules` (where the maths is) around
the user's own model and ``torch.optim`` optimizer. At construction the model's parameters
and floating-point buffers are moved into one flat buffer (the tensors the optimizer holds
stay the same objects), every rank checks that it can handle the model, and rank 0's state
is broadcast so every worker starts from the same x_0. ``step`` is the optimizer step plus
the method's communication.

:data:`METHODS` maps each method's name to its class. What a method's options are (defaults,
ranges, help) is written once, in its spec (``lsgd_hpc.methods.registry``), which the
classes here, the trainer's command line, the docs and the planner all read.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from lsgd_hpc.comm import FlatParams
from lsgd_hpc.comm.accounting import uncounted
from lsgd_hpc.comm.injection import injection_point
from lsgd_hpc.comm.stack import compose
from lsgd_hpc.comm.workers import WorkerRanks, worker_layout, worker_layout_problem
from lsgd_hpc.methods.recovery import Recoverable
from lsgd_hpc.methods.registry import SPECS
from lsgd_hpc.methods.rules import (AllreduceRule, AsyncLeaderRule, DiLoCoRule, EASGDRule,
                                    GossipRule, LeaderRule, LocalSGDRule, SlowMoRule)
from lsgd_hpc.methods.rules.diloco import fragment_tensors
from lsgd_hpc.methods.rules.workers import WorkerRule
from lsgd_hpc.methods.spec import (COMMON_OPTIONS, QUANTIZED_COMM_DTYPES, MethodSpec, OptionError,
                                   comm_dtype_problem, error_feedback_decay_problem,
                                   error_feedback_problem, topk_problem)
from lsgd_hpc.comm.monitor import MONITOR

__all__ = ["Method", "LeaderSGD", "AsyncLeaderSGD", "AllreduceSGD", "EASGD", "LocalSGD",
           "DiLoCo", "SlowMo", "GossipSGD", "METHODS", "method_class"]


_COMMON = {o.name: o for o in COMMON_OPTIONS}


def _check_count(name: str, value, low: int) -> int:
    """The library-only integer arguments of every method (max_steps, ...)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def _check_common(backend, model, name: str, *, max_steps, checkpoint_every, consensus_every,
                  stop_check_every, comm_dtype, error_feedback, topk=1.0,
                  error_feedback_decay=1.0) -> None:
    """The options every method takes (the same checks on every rank, before any
    collective); ``backend`` is the comm's (None: not known)."""
    if max_steps is not None:
        _check_count("max_steps", max_steps, 1)
    _check_count("checkpoint_every", checkpoint_every, 0)
    _check_count("consensus_every", consensus_every, 0)
    _COMMON["stop_check_every"].check(stop_check_every)
    _COMMON["comm_dtype"].check(comm_dtype)
    problem = comm_dtype_problem(comm_dtype, backend, name)
    if problem:
        raise OptionError("comm_dtype", problem)
    topk = _COMMON["topk"].check(topk)
    problem = topk_problem(topk, comm_dtype, backend, name)
    if problem:
        raise OptionError("topk", problem)
    _COMMON["error_feedback"].check(error_feedback)
    problem = error_feedback_problem(error_feedback, comm_dtype, topk, name)
    if problem:
        raise OptionError("error_feedback", problem)
    decay = _COMMON["error_feedback_decay"].check(error_feedback_decay)
    problem = error_feedback_decay_problem(decay, error_feedback, name)
    if problem:
        raise OptionError("error_feedback_decay", problem)
    if comm_dtype in QUANTIZED_COMM_DTYPES:    # fp8: where this torch converts on the device
        from lsgd_hpc.comm.quantized import kind_problem
        first = next(iter(model.parameters()), None) if isinstance(model, nn.Module) else None
        problem = kind_problem(comm_dtype, None if first is None else first.device)
        if problem:
            raise OptionError("comm_dtype", problem)


def _agree_on_model(world, model, optimizer, where: str) -> None:
    """Collective: every rank checks its own model and all agree before anything else, so a
    model one rank cannot handle stops every rank with the same message."""
    problem = _model_problem(model, optimizer)
    n = sum(p.numel() for p in model.parameters()) if problem is None else -1
    shapes = world.allgather_object((problem, n))
    bad = [r for r, (p, _) in enumerate(shapes) if p]
    if bad:
        detail = "" if len(bad) == len(shapes) else f" (on rank {bad[0]} of {len(shapes)})"
        raise ValueError(f"{where}: {shapes[bad[0]][0]}{detail}")
    if len({s for _, s in shapes}) > 1:
        raise ValueError(f"{where}: the ranks' models differ in size "
                         f"({sorted({s for _, s in shapes})} parameters); every rank must "
                         "build the same model")


class _Alone:
    """A world of one for the checks that agree over the ranks (Method.check): every rank
    says what this one says."""

    @staticmethod
    def allgather_object(obj):
        return [obj]


def _model_problem(model, optimizer) -> Optional[str]:
    """Why this rank cannot run a method on (model, optimizer), or None."""
    if not isinstance(model, nn.Module):
        return f"model must be a torch.nn.Module, got {type(model).__name__}"
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return ("model is wrapped in DistributedDataParallel/DataParallel; pass the plain "
                "module (the method does the communication)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        return f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
    params = list(model.parameters())
    if not params:
        return "model has no parameters"
    from lsgd_hpc.comm.flat import state_buffers
    tensors = params + [b for _, b in state_buffers(model)]
    devices = sorted({str(t.device) for t in tensors})
    if len(devices) > 1:
        return (f"model has parameters or buffers on {len(devices)} devices "
                f"({', '.join(devices)}); a method needs the whole model on one device")
    dtypes = sorted({str(t.dtype).replace("torch.", "") for t in tensors})
    if len(dtypes) > 1:
        return (f"model mixes parameter/buffer dtypes ({', '.join(dtypes)}); keep the "
                "weights in one dtype (fp32 master weights; use autocast for bf16/fp16)")
    if not params[0].is_floating_point():
        return f"model parameters must be floating point, got {dtypes[0]}"
    ids = {id(p) for p in params}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in ids)
    if foreign:
        return (f"optimizer holds {foreign} tensor(s) that are not parameters of the model; "
                "build it over model.parameters() (or a subset)")
    return None


class Method(Recoverable):
    """A training method in the user's own loop (see the module docstring).

    Options common to every method:

    - ``max_steps``: this rank's step budget; ``done`` turns True when it is spent
      (AsyncLeaderSGD: when all ranks together have taken the sum of their budgets).
    - ``checkpoint_every``: ``checkpoint_due`` turns True every that many steps (for
      AsyncLeaderSGD at agreed moments), so the loop knows when to save.
    - ``stop``: anything with a ``raised`` attribute (``lsgd_hpc.StopSignals``); the ranks
      agree on it at a step boundary without a blocking collective per step, and
      ``stopping`` then turns True on every rank after the same step.
    - ``consensus_every``: log the consensus distance every that many steps (0: never).
    - ``metrics``: a writer with ``log(group, **row)`` (``lsgd_hpc.MetricsWriter``) that
      receives the method's elections and consensus rows.
    - ``comm_dtype``: ``"fp32"``, or ``"bf16"``: what the method sends (pulls, averages,
      pseudo-gradients, gradients) moves in bfloat16, half the bytes (see
      ``lsgd_hpc.comm.lowprec`` for what that rounding changes); or ``"int8"``/``"fp8"``:
      one byte per element plus per-block scales, or ``"int4"``/``"int2"``: half or a
      quarter of a byte (``lsgd_hpc.comm.quantized``; LSGD, EASGD, local SGD, DiLoCo,
      SlowMo).
    - ``topk``: F in (0, 1]; below 1, each periodic allreduce of EASGD, DiLoCo, local SGD
      and SlowMo (these two: of the change since the last average) sends the
      largest ceil(F c) entries of every chunk of c = 4096 as (index, value), values as
      ``comm_dtype`` (fp32, bf16, int8, fp8, int4, int2) (``lsgd_hpc.comm.sparse``).
    - ``error_feedback``: with bf16/int8/fp8/int4/int2 or ``topk`` < 1, each rank's
      allreduce input carries what rounding (or top-k) dropped from its previous ones; the
      residuals are in ``state_dict`` (bf16 alone: not for LSGD, AsyncLeaderSGD and gossip,
      which have no allreduce to feed back).
    - ``error_feedback_decay``: beta in (0, 1]; below 1 (with ``error_feedback``) each
      allreduce compresses v + beta e instead of v + e: SparseLoCo's decayed accumulator,
      which replaces the outer momentum (DiLoCo with ``outer_momentum=0``). Not for LSGD,
      whose compressed pull keeps no residual.
    - ``worker_ranks``: 1 (every rank is a worker), K, or ``"node"``: K consecutive ranks of
      a node, or all of a node's ranks, form one worker that trains one replica as data
      parallel SGD (gradients averaged inside it every step, ``WorkerRule``), and the method
      runs between workers (``lsgd_hpc.comm.workers``). K must divide the ranks of every
      node. AllreduceSGD accepts it and is unchanged (it trains one replica over all ranks
      already); AsyncLeaderSGD refuses it.

    A method is a context manager: ``with lsgd_hpc.DiLoCo(model, opt, comm) as method:``
    closes it at the end (``close()`` does the same); a closed method refuses ``step``.
    """

    #: what the method is: name, options, defaults, checks, cost (lsgd_hpc.methods.registry)
    spec: MethodSpec
    #: True when the method averages gradients (so it must see them in the flat buffer)
    averages_gradients = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "spec" in cls.__dict__:
            #: the CLI's name of the method (``--algorithm``)
            cls.name = cls.spec.name
            #: the method's own options and their defaults (the spec's)
            cls.defaults = cls.spec.defaults

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm, *,
                 max_steps: Optional[int] = None, checkpoint_every: int = 0, stop=None,
                 consensus_every: int = 0, stop_check_every: int = 10, metrics=None,
                 comm_dtype: str = "fp32", error_feedback: bool = False, topk: float = 1.0,
                 error_feedback_decay: float = 1.0, worker_ranks: WorkerRanks = 1,
                 broadcast_initial: bool = True, **options):
        # The same checks on every rank, before any collective: every rank refuses alike.
        layout, opts = self._check_before_collectives(
            model, optimizer, world_size=comm.size, backend=getattr(comm, "backend", None),
            node_of=getattr(getattr(comm, "groups", None), "node_of", None),
            max_steps=max_steps, checkpoint_every=checkpoint_every,
            consensus_every=consensus_every, stop_check_every=stop_check_every,
            comm_dtype=comm_dtype, error_feedback=error_feedback, topk=topk,
            error_feedback_decay=error_feedback_decay, worker_ranks=worker_ranks, **options)
        self._fault_tolerance = getattr(comm, "fault_tolerance", None)
        _agree_on_model(comm.world, model, optimizer, type(self).__name__)
        self.model, self.optimizer, self.comm, self.options = model, optimizer, comm, opts
        self.worker_ranks, self.comm_dtype = worker_ranks, comm_dtype
        self.error_feedback, self.topk = error_feedback, float(topk)
        self.error_feedback_decay = float(error_feedback_decay)
        #: the communicators: workers, wire format, failure policy (lsgd_hpc.comm.stack)
        self.stack = compose(comm, layout=layout, worker_ranks=worker_ranks,
                             comm_dtype=comm_dtype, error_feedback=error_feedback,
                             topk=float(topk), error_feedback_decay=float(error_feedback_decay))
        self.world, self.groups = self.stack.world, self.stack.groups
        self.workers, self.wire = self.stack.workers, self.stack.wire
        self.flat = FlatParams(model)
        self.log = metrics.log if metrics is not None else (lambda group, **row: None)
        self.rule = self._build_rule(opts, metrics, consensus_every)
        self._init_loop(max_steps, checkpoint_every, consensus_every, stop, stop_check_every)
        if broadcast_initial:
            self.broadcast_initial()
        if self._fault_tolerance is not None:   # restored after every recovery
            self._fault_tolerance.register(self)

    def _build_rule(self, opts, metrics, consensus_every: int):
        """The method's rule over its communicators, with allreduce SGD inside each worker
        when workers span ranks; a rule with collectives in flight across steps moves them
        on during backward (gradient hooks)."""
        rule = self.build(opts)
        # whether the rule's after_step reads the loss: AllreduceRule's does not (step then
        # leaves a loss tensor unread, no device sync per step)
        self._reads_loss = type(rule) is not AllreduceRule
        self._progress_hooks = []
        if rule.overlaps and self.world.size > 1:
            progress = rule.progress
            self._progress_hooks = [p.register_post_accumulate_grad_hook(
                lambda _p: progress()) for p in self.model.parameters() if p.requires_grad]
        if metrics is not None:
            rule.track = getattr(metrics, "track", rule.track)
        if self.workers is not None:              # allreduce SGD inside each worker
            allreduce = SPECS["allreduce"]
            rule = WorkerRule(
                rule, self.workers, self.flat,
                bucket_bytes=int(allreduce.option("bucket_mb").default * 2**20),
                check_every=allreduce.option("check_replicas_every").default)
        rule.consensus_every = consensus_every
        return rule

    def _init_loop(self, max_steps, checkpoint_every: int, consensus_every: int, stop,
                   stop_check_every: int) -> None:
        """The loop's counters and flags, and the agreement on a stop signal."""
        self.consensus_every = consensus_every
        self.max_steps, self.checkpoint_every = max_steps, checkpoint_every
        self.stop_signals = stop
        self.steps = 0
        self.skipped_steps = 0      # fp16 steps a GradScaler skipped (inf/NaN gradients)
        #: callables run (no argument) at the end of every ``step``, its communication done
        #: (RunMetrics' compute clock: lsgd_hpc/runtime/run_metrics.py)
        self.step_listeners: List[Callable[[], None]] = []
        self.done = self.closed = self.stopping = self.checkpoint_due = False
        self._synced = False
        # on_failure="shrink" (methods/recovery.py): the part of a step running now, and a
        # step to drop after a recovery inside the user's synchronize()
        self._phase = None
        self._drop_next = False
        # (parameter, its gradient's view in the flat buffer, the view's address)
        self._grad_views = [(p, v, v.data_ptr()) for p, v in
                            ((p, self.flat.grad[off:off + n].view_as(p)) for p, (_, off, n)
                             in zip(self.model.parameters(), self.flat.slices)
                             if p.requires_grad)]
        self._agreement = None
        if self.rule.owns_schedule:
            if max_steps is None:
                raise ValueError(f"{type(self).__name__}: max_steps is required (its ranks take "
                                 "uneven numbers of steps and agree on when to end)")
            self.rule.set_schedule(max_steps, checkpoint_every)
        elif stop:
            from lsgd_hpc.runtime.stopping import StopAgreement
            # (with workers, a signal may reach any rank: agreed over every rank of the job)
            over = self.world if self.workers is None else self.comm.world
            self._agreement = StopAgreement(over, stop_check_every)

    # -- what subclasses define --------------------------------------------------------------
    def check_usage(self, opts: Dict[str, Any], model, optimizer) -> None:
        """Raise ValueError for a use the method cannot handle that its options do not show
        (the options themselves were checked by the spec); the same on every rank."""

    def build(self, opts: Dict[str, Any]):
        raise NotImplementedError

    def _worker_layout(self, node_of, worker_ranks):
        """The workers' layout when the method runs between workers that span ranks, else
        None; ValueError (the same on every rank, from the node layout every rank holds:
        ``node_of``, the node of every rank) for a grouping that does not fit or a method
        that cannot run between workers."""
        _COMMON["worker_ranks"].check(worker_ranks)
        if worker_ranks == 1:
            return None
        if self.spec.workers_refused:
            raise OptionError("worker_ranks", self.spec.workers_refused)
        problem = worker_layout_problem(node_of, worker_ranks)
        if problem:
            raise OptionError("worker_ranks", problem)
        if not self.spec.worker_grouping:      # one replica over all ranks already
            return None
        return worker_layout(node_of, worker_ranks)

    def _check_before_collectives(self, model, optimizer, *, world_size: int, backend,
                                  node_of, worker_ranks, max_steps=None, checkpoint_every=0,
                                  consensus_every=0, stop_check_every=10, comm_dtype="fp32",
                                  error_feedback=False, topk=1.0, error_feedback_decay=1.0,
                                  **options):
        """What ``__init__`` checks before its first collective, from numbers every rank
        holds (no communication): the workers' layout, the method's options, the common
        options on this model, the method's own use of the model (``check_usage``).
        Returns ``(layout, options)``; raises ValueError (OptionError) naming the argument."""
        layout = self._worker_layout(node_of, worker_ranks)
        opts = self.spec.resolve(options, world_size=world_size if layout is None
                                 else layout.n_workers, where=type(self).__name__)
        _check_common(backend, model, self.spec.name, max_steps=max_steps,
                      checkpoint_every=checkpoint_every, consensus_every=consensus_every,
                      stop_check_every=stop_check_every, comm_dtype=comm_dtype,
                      error_feedback=error_feedback, topk=topk,
                      error_feedback_decay=error_feedback_decay)
        self.check_usage(opts, model, optimizer)
        return layout, opts

    @classmethod
    def check(cls, model, optimizer, *, world_size: int, node_of=None, backend=None,
              worker_ranks: WorkerRanks = 1, **kwargs) -> Dict[str, Any]:
        """Every check that ``cls(model, optimizer, comm, **kwargs)`` runs before it
        communicates, without a world (a login node's pre-flight check,
        ``lsgd_hpc.check_config``): the same ValueError (OptionError) with the same words.
        ``world_size`` ranks, ``node_of`` the node of each (None: one node), ``backend``
        the comm's. Also the model check that ``__init__`` agrees on across the ranks,
        as a world where every rank has this model. Returns the resolved options."""
        node_of = list(node_of) if node_of is not None else [0] * world_size
        bare = object.__new__(cls)              # check_usage is an instance's method
        _, opts = bare._check_before_collectives(
            model, optimizer, world_size=world_size, backend=backend, node_of=node_of,
            worker_ranks=worker_ranks, **kwargs)
        _agree_on_model(_Alone(), model, optimizer, cls.__name__)
        return opts

    @property
    def worker_stats(self):
        """Cumulative traffic inside this rank's worker (``CommStats``; None without
        workers): the gradients' allreduce, the buffers' broadcast, the method's results
        spread from the representative. ``comm.stats`` holds the method's own traffic."""
        return None if self.workers is None else self.workers.stats

    @property
    def node_stats(self):
        """Cumulative float32 traffic inside the node of the hierarchical compressed
        allreduces (``CommStats``; None unless ``comm_dtype`` is int8, fp8, int4 or int2 or
        ``topk`` < 1, at a layout of several nodes with more than one rank on some node,
        lsgd_hpc.comm.quantized): each node's sum, and the result spread from the node's
        root. ``comm.stats`` then holds what crosses between the nodes (on node roots), and
        its seconds include these phases'."""
        wire = self.wire
        if wire is None or wire.world.hierarchy() is None:
            return None
        return wire.node_stats

    # -- set-up ------------------------------------------------------------------------------
    def broadcast_initial(self) -> None:
        """Collective: every worker takes rank 0's parameters and buffers (the common x_0);
        the method's copies of x_0 (EASGD's centre) are taken from it. Done at construction;
        call it again after loading weights on rank 0 only."""
        with uncounted(self.comm.world):                # exact, whatever comm_dtype
            self.comm.world.broadcast_(self.flat.flat, 0)
        for v in self.rule.eval_models().values():
            v.copy_(self.flat.flat)

    def set_metrics(self, metrics) -> None:
        """Send the method's rows (elections, consensus) to ``metrics.log``, and values
        outside the schema (the elected leader's score) to ``metrics.track`` when it has one
        (the experiment trackers)."""
        self.log = self.rule.log = metrics.log
        self.rule.track = getattr(metrics, "track", self.rule.track)

    # -- the step ----------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero every gradient in place in one operation over the fused gradient buffer (a
        faster equivalent of ``optimizer.zero_grad(set_to_none=False)``; either works)."""
        for p, view, ptr in self._grad_views:
            g = p.grad
            if g is not None and g.data_ptr() != ptr:
                p.grad = view
        self.flat.grad.zero_()

    def _gradients_into_buffer(self) -> None:
        """Put every trainable parameter's gradient into the flat gradient buffer (where the
        averaging reads it): ``optimizer.zero_grad()`` sets ``.grad`` to None and backward
        then allocates a new tensor. A parameter without a gradient this step contributes
        zeros, and gets the averaged gradient like the others (as DDP does)."""
        for p, view, ptr in self._grad_views:
            g = p.grad
            if g is None:
                view.zero_()
            elif g.data_ptr() != ptr:
                view.copy_(g)
            else:
                continue
            p.grad = view

    def synchronize(self) -> None:
        """Finish this step's gradient communication now (gradient-averaging methods; a no-op
        for the others). Call it after backward and before anything that reads or changes
        the gradients, such as ``clip_grad_norm_`` or ``GradScaler.unscale_``; ``step``
        then does not communicate the gradients again."""
        if self._fault_tolerance is None or self._synced:
            return self._synchronize()
        self._phase = "sync"
        self._guarded(self._synchronize)
        if self._phase == "sync":
            self._phase = None

    def _synchronize(self) -> None:
        if self._synced:
            return
        if (self.averages_gradients and self.world.size > 1) or \
                (self.workers is not None and self.workers.size > 1):  # (alone: nothing to do)
            self._gradients_into_buffer()
        self.rule.before_step(self.steps + 1)
        self._synced = True

    def step(self, loss=None, scaler: Optional["torch.amp.GradScaler"] = None) -> None:
        """The optimizer step and the method's communication of this step.

        ``loss``: this minibatch's loss (a tensor or a float); leader methods score workers
        by it (and local SGD's automatic period fits it); the methods that never read it
        (AllreduceSGD) leave a tensor unread: no device sync. ``scaler``: a
        ``torch.amp.GradScaler`` for fp16 training: the step is then
        ``scaler.step(optimizer)`` and ``scaler.update()``; a step it skips for inf/NaN
        gradients is counted in ``skipped_steps``.
        """
        # (the per-step path: a few attribute reads and calls, nothing built per step)
        if self.closed or self.done:
            self._refuse_step()
        if self._fault_tolerance is None:
            # the testing hook (a no-op without a plan) under on_failure="abort" too
            injection_point("step", self.steps + 1, self.comm)
            self._step(loss, scaler)
        elif self._drop_next:      # a recovery cut off this step's synchronize(): dropped
            self._drop_next = self._synced = False
        else:
            injection_point("step", self.steps + 1, self.comm)
            self._guarded(self._step, loss, scaler)
            self._phase = None
        for listener in self.step_listeners:
            listener()

    def _refuse_step(self) -> None:
        if self.closed:
            raise RuntimeError(f"{type(self).__name__}.step() after close(): the method has "
                               "released its hooks; build a new one to train on")
        raise RuntimeError(f"{type(self).__name__}.step() after done (max_steps reached)")

    def _step(self, loss, scaler) -> None:
        self._phase = "before"
        if not self._synced:
            self._synchronize()
        self._synced = False
        if scaler is None:
            self.optimizer.step()
        else:
            scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            if scaler.get_scale() < scale:
                self.skipped_steps += 1
        steps = self.steps = self.steps + 1
        MONITOR.step = steps               # the collective watchdog's reports name the step
        self._phase = "after"
        value = self._loss_value(loss)
        rule = self.rule
        if self.consensus_every and not rule.owns_schedule \
                and steps % self.consensus_every == 0:
            rule.measure_consensus(steps)
        rule.after_step(steps, value)
        self.after_rule(steps)
        self._phase = "control"
        self._control()

    def after_rule(self, step: int) -> None:
        """Hook after the rule's communication of ``step``."""

    def _loss_value(self, loss) -> float:
        """The loss as the rule's ``after_step`` takes it: a float, NaN for none; a tensor
        is read (a device sync) only for a rule that reads it (``_reads_loss``)."""
        if loss is None:
            return math.nan
        if type(loss) is float:
            return loss
        if isinstance(loss, torch.Tensor):
            return float(loss.detach()) if self._reads_loss else math.nan
        return float(loss)

    def _control(self) -> None:
        raised = bool(self.stop_signals is not None and self.stop_signals.raised)
        if self.rule.owns_schedule:
            action = self.rule.control(raised)
            self.checkpoint_due = action == "checkpoint"
            self.stopping = action == "stop"
            self.done = action == "end"
            return
        self.checkpoint_due = bool(self.checkpoint_every and self.steps % self.checkpoint_every == 0)
        if self._agreement is not None and self._agreement.check(self.steps, raised):
            self.stopping = True
        if self.max_steps is not None and self.steps >= self.max_steps:
            self.done = True
        if self.done or self.stopping:
            self.drain()

    def drain(self) -> None:
        """Complete any control request in flight (before a checkpoint's barriers or exit)."""
        if self._agreement is not None:
            self._agreement.drain()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context only accumulate gradients (for accumulation
        over several microbatches with overlapped gradient averaging); the averaging runs
        for the last backward, outside it. Without buckets it changes nothing."""
        buckets = getattr(self.rule, "buckets", None)
        if buckets is None:
            yield
            return
        buckets.enabled = False
        try:
            yield
        finally:
            buckets.enabled = True

    # -- the model the method reports ----------------------------------------------------------
    def reported_state(self) -> torch.Tensor:
        """The flat vector (parameters then floating-point buffers) of the model this method
        reports; collective for the methods whose model lives on another rank."""
        return self.flat.flat

    @contextlib.contextmanager
    def reported_model(self) -> Iterator[nn.Module]:
        """Collective context: inside it ``self.model`` holds the model this method reports
        (LSGD: the global leader's; EASGD: the centre; otherwise the worker's own); the
        worker's own parameters are put back afterwards."""
        vec = self.reported_state()
        if vec is self.flat.flat:
            yield self.model
            return
        saved = self.flat.flat.clone()
        self.flat.flat.copy_(vec)
        try:
            yield self.model
        finally:
            self.flat.flat.copy_(saved)

    # -- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The method's own state (its step counter and rule state; not the model's or the
        optimizer's, which the user saves as usual)."""
        self.drain()
        state = {"method": self.name, "steps": self.steps, "skipped_steps": self.skipped_steps,
                 "rule": self.rule.state_dict()}
        if self.wire is not None and self.error_feedback:
            state["error_feedback"] = self.wire.state_dict()      # the residuals
        if self.node_stats is not None:               # (the node_* columns go on from it)
            state["node_stats"] = self.node_stats.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("method") != self.name:
            raise ValueError(f"state is of method {state.get('method')!r}, not {self.name!r}")
        self.steps = int(state["steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.rule.load_state_dict(state["rule"])
        if self.wire is not None and self.error_feedback:   # (none saved: they start at zero)
            self.wire.load_state_dict(state.get("error_feedback", {}))
        if self.node_stats is not None and "node_stats" in state:
            self.node_stats.load_state_dict(state["node_stats"])
        self.done = bool(self.max_steps is not None and not self.rule.owns_schedule
                         and self.steps >= self.max_steps)

    def close(self) -> None:
        """Finish what is in flight and release hooks (the communicators stay the user's).
        ``step`` is refused afterwards; closing twice does nothing."""
        if self.closed:
            return
        if self._fault_tolerance is not None:
            self._fault_tolerance.unregister(self)
        self.drain()
        self._remove_hooks()
        self.closed = True

    def _remove_hooks(self) -> None:
        buckets = getattr(self.rule, "buckets", None)
        if buckets is not None:
            buckets.remove()
        for h in self._progress_hooks:
            h.remove()
        self._progress_hooks = []

    def __enter__(self) -> "Method":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:            # leave in-flight collectives alone: other ranks may never post theirs
            if self._fault_tolerance is not None:
                self._fault_tolerance.unregister(self)
            self._remove_hooks()
            self.closed = True
        return False

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({opts})"


class LeaderSGD(Method):
    """Leader SGD (Teng et al. 2019), synchronous, single- or multi-leader: every
    ``tau_local`` steps each worker is pulled toward its node's leader,
    ``x <- x - pull_local (x - x_l)``, and every ``tau_global`` steps toward the global
    leader, ``x <- x - pull_global (x - x_L)``; leaders have the lowest mean loss over their
    last ``leader_window`` minibatches (so pass the loss to ``step``), or, with
    ``score_fn``, the lowest ``score_fn()`` evaluated at each election (for instance the loss
    on a held-out slice of the training data: a leader that generalises; time it inside
    ``uncounted(comm.world, probe=True)`` to keep it out of the training time). The reported
    model is the last elected global leader's.

    ``pull_delay`` d (default 0) hides the leader's broadcast behind d steps of compute: the
    election at step s stays blocking (16 bytes), the broadcast of the leader's step-s
    parameters runs while the workers train on, and the pull toward them lands at step
    s + d, on the workers' parameters of that step (d < ``tau_local``). A broadcast in flight
    is completed by ``state_dict`` (and ``close``) and its pull still lands at s + d."""

    spec = SPECS["lsgd"]

    def build(self, o):
        return LeaderRule(self.groups, self.flat, o["tau_local"], o["tau_global"],
                          o["pull_local"], o["pull_global"], o["leader_window"], log=self.log,
                          pull_every_step=bool(o["lsgd_pull_every_step"]), bn=o["lsgd_bn"],
                          score_fn=o["score_fn"], pull_delay=o["pull_delay"])

    def drain(self) -> None:
        """Also complete a delayed leader broadcast in flight (its pull lands at its step)."""
        super().drain()
        self.rule.drain()

    def reported_state(self) -> torch.Tensor:
        """The last elected global leader's parameters (elected now if none was yet):
        one broadcast from it, crossing node boundaries once per node."""
        el = self.rule.last_global
        with uncounted(self.world, probe=True):
            if el is None:
                el = self.world.elect(self.rule.score())
            buf = self.flat.flat.clone()
            self.comm.groups.broadcast_from_(buf, el.world_rank)     # exact
        return buf


class AsyncLeaderSGD(Method):
    """Leader SGD without per-step coupling: rounds are counted in the total work of the
    workers and decided by non-blocking probes, and no worker waits for another one's step
    (``max_staleness`` bounds how far ahead a worker runs past a request it posted; default
    ``tau_global``). Ranks take different numbers of steps: ``max_steps`` is required, and
    the loop ends when ``done`` turns True (agreed by every rank)."""

    spec = SPECS["lsgd-async"]

    def build(self, o):
        staleness = o["max_staleness"] if o["max_staleness"] is not None else o["tau_global"]
        return AsyncLeaderRule(self.groups, self.flat, o["tau_local"], o["tau_global"],
                               o["pull_local"], o["pull_global"], o["leader_window"], staleness,
                               log=self.log)

    def reported_state(self) -> torch.Tensor:
        # between rounds no leader is pinned down on every rank: the worker's own model
        return self.flat.flat


class AllreduceSGD(Method):
    """Synchronous data parallel SGD (as DDP and Horovod): gradients averaged over all
    workers every step, every replica takes the same step. ``bucket_mb > 0`` averages the
    gradient in buckets of that size started during backward (overlap); then call
    ``synchronize()`` before reading the gradients (clipping, ``GradScaler.unscale_``) and
    use ``no_sync()`` for all but the last backward when accumulating. Every
    ``check_replicas_every`` steps the replicas are checked to be bit-identical (one small
    object allgather; 0: never): a divergence raises on every rank instead of going on."""

    spec = SPECS["allreduce"]
    averages_gradients = True

    def build(self, o):
        rule = AllreduceRule(self.groups, self.flat, log=self.log,
                             bucket_bytes=int(float(o["bucket_mb"]) * 2**20))
        if rule.buckets is not None:
            rule.buckets.adopt_gradients = True     # copy a fresh .grad in from its hook
        return rule

    def after_rule(self, step: int) -> None:
        every = self.options["check_replicas_every"]
        if every and step % every == 0:
            self.check_replicas(step)

    def check_replicas(self, step: Optional[int] = None) -> None:
        """Collective: raise RuntimeError on every rank unless every replica holds the same
        parameters and buffers, bit for bit."""
        digest = hashlib.blake2b(self.flat.flat.detach().cpu().numpy().tobytes(),
                                 digest_size=16).hexdigest()
        with uncounted(self.world):
            digests = self.world.allgather_object(digest)
        if len(set(digests)) > 1:
            groups: Dict[str, list] = {}
            for r, d in enumerate(digests):
                groups.setdefault(d, []).append(r)
            raise RuntimeError(
                f"AllreduceSGD: replicas diverged by step {self.steps if step is None else step}: "
                f"{len(groups)} different parameter sets among the ranks "
                f"({'; '.join(str(v) for v in groups.values())}). Were gradients read or "
                "changed while their averaging was in flight? Call method.synchronize() "
                "before clipping or unscaling them")


class EASGD(Method):
    """Elastic averaging SGD (Zhang et al. 2015), synchronous, without a parameter server:
    every ``easgd_tau`` steps ``d_i = alpha (x_i - c)``, ``x_i <- x_i - d_i``,
    ``c <- c + sum_i d_i`` (one allreduce), the centre c held identically on every rank.
    ``easgd_alpha`` defaults to 0.9 / world size. The reported model is the centre."""

    spec = SPECS["easgd"]

    def build(self, o):
        alpha = o["easgd_alpha"] if o["easgd_alpha"] is not None else 0.9 / self.world.size
        return EASGDRule(self.groups, self.flat, alpha, o["easgd_tau"], log=self.log)

    def reported_state(self) -> torch.Tensor:
        return self.rule.center


class LocalSGD(Method):
    """Local SGD (periodic averaging): every ``local_steps`` steps ``x <- mean_j x_j`` (one
    allreduce). ``local_steps="auto"`` measures the cost of a round against a local step
    and the local loss decay, and picks T at run time (at most ``local_steps_max``)."""

    spec = SPECS["local-sgd"]

    def build(self, o):
        return LocalSGDRule(self.groups, self.flat, o["local_steps"], t_max=o["local_steps_max"],
                            cost_ratio=o["local_steps_cost_ratio"], log=self.log)


class DiLoCo(Method):
    """DiLoCo (Douillard et al. 2023): ``local_steps`` (H) steps of the user's optimizer (the
    inner one; AdamW in the paper), then one outer step: the pseudo-gradient
    ``delta = mean_i (x_prev - x_i)`` (one allreduce) is the gradient of an outer SGD with
    ``outer_lr``, ``outer_momentum`` and Nesterov (``outer_nesterov``) from x_prev. With
    outer lr 1 and momentum 0 it is local SGD with T = H. The inner optimizer's state stays
    local; the outer state is in ``state_dict``.

    Streaming DiLoCo (Douillard et al. 2025; torchft's option names): ``fragments`` P splits
    the parameters into P fragments, whole tensors in model order and near-equal in size, or
    is a list of submodules, one per fragment (as torchft's ``model_fragments``; every
    parameter in exactly one); one fragment syncs every H / P steps, round-robin, with an
    outer optimizer of its own. Its pseudo-gradient allreduce starts
    ``fragment_sync_delay`` (tau < H / P) steps before its sync and runs behind compute;
    at the sync the fragment becomes ``lerp(outer result, local, fragment_update_alpha)``.
    P = 1, tau = 0, alpha = 0 is DiLoCo. An allreduce in flight is completed by
    ``state_dict`` (and ``close``); its result is applied at its sync step."""

    spec = SPECS["diloco"]

    def check_usage(self, opts, model, optimizer) -> None:
        if opts["fragments"] != 1 and isinstance(model, nn.Module):
            try:
                fragment_tensors(model, opts["fragments"])
            except ValueError as exc:
                raise ValueError(f"{type(self).__name__}: {exc}") from None

    def build(self, o):
        return DiLoCoRule(self.groups, self.flat, local_steps=o["local_steps"],
                          outer_lr=o["outer_lr"], outer_momentum=o["outer_momentum"],
                          outer_nesterov=bool(o["outer_nesterov"]), optimizer=self.optimizer,
                          log=self.log, fragments=o["fragments"],
                          fragment_sync_delay=o["fragment_sync_delay"],
                          fragment_update_alpha=o["fragment_update_alpha"])

    def drain(self) -> None:
        """Also complete a fragment's allreduce in flight (applied at its sync step)."""
        super().drain()
        self.rule.drain()


class SlowMo(Method):
    """SlowMo (Wang et al. 2019): local SGD with period ``local_steps`` (T; 1 averages every
    step) and, every ``slowmo_every`` steps (a multiple of T), an exact average followed by
    the slow momentum step ``u <- beta u + (x_old - x) / lr``,
    ``x_old <- x_old - alpha lr u``, x <- x_old, with lr the optimizer's current learning
    rate (its first parameter group's). ``slowmo_beta`` 0 and ``slowmo_alpha`` 1 give back
    local SGD."""

    spec = SPECS["slowmo"]

    def build(self, o):
        return SlowMoRule(self.groups, self.flat, local_steps=o["local_steps"],
                          slowmo_every=o["slowmo_every"], slowmo_beta=o["slowmo_beta"],
                          slowmo_alpha=o["slowmo_alpha"], optimizer=self.optimizer,
                          log=self.log)


class GossipSGD(Method):
    """Decentralised SGD: after each step ``x_i <- sum_j W_ij x_j`` over the neighbours of
    ``topology`` (a name of ``python -m lsgd_hpc.topology``), parameters sent to the
    neighbours only, never an allreduce. With ``comm_dtype`` int8, fp8, int4 or int2 or
    ``topk`` < 1: CHOCO-SGD, compressed differences to public copies and the consensus step
    ``gossip_gamma`` (lsgd_hpc.methods.rules.gossip)."""

    spec = SPECS["gossip"]

    def _check_before_collectives(self, model, optimizer, **kwargs):
        layout, opts = super()._check_before_collectives(model, optimizer, **kwargs)
        if opts["gossip_gamma"] is not None and kwargs.get("topk", 1.0) >= 1 \
                and kwargs.get("comm_dtype", "fp32") not in QUANTIZED_COMM_DTYPES:
            raise OptionError("gossip_gamma", "needs --comm-dtype int8, fp8, int4 or int2 or "
                              "--topk < 1: it is the consensus step of compressed gossip "
                              "(CHOCO-SGD); fp32 and bf16 gossip mix with W as it is")
        return layout, opts

    def build(self, o):
        from lsgd_hpc.topology import build_topology
        topo = build_topology(o["topology"], self.world.size, node_of=self.groups.node_of)
        return GossipRule(self.groups, self.flat, topo, log=self.log, comm_dtype=self.comm_dtype,
                          topk=self.topk, gamma=o["gossip_gamma"])


#: every method's class by its name (``--algorithm``), in the registry's order
METHODS: Dict[str, type] = {cls.spec.name: cls for cls in
                            (LeaderSGD, AsyncLeaderSGD, AllreduceSGD, EASGD, LocalSGD, DiLoCo,
                             SlowMo, GossipSGD)}
assert tuple(METHODS) == tuple(SPECS), "a spec without a class, or the reverse"


def method_class(name: str) -> type:
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}") from None
