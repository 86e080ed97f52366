"""Train with LSGD or a baseline: the options, then the library's own pieces (lsgd_hpc.init,
a method of lsgd_hpc.METHODS, open_metrics, Checkpointer, StopSignals and requeue,
start_watchdog, ShardedSampler), and one flat loop. What a library loop can do, this does
with the same calls; a checkpoint of either resumes in the other.

    mpirun -np 4 python -m lsgd_hpc.train [options]
    srun --mpi=pmix python -m lsgd_hpc.train [options]
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import signal
import sys
import time
import traceback
from typing import Optional, Sequence

from lsgd_hpc.cli.startup import (EXIT_STOPPED, EXIT_USAGE, PROG, agree_on_start,
                                  boot_backend, close_torch_world, env_rank, exit_together,
                                  option_spelling, usage_error)
# The trainer's stop flag is the library's: SIGUSR1 (SLURM's warning before the time limit)
# or SIGTERM (preemption, scancel, scontrol requeue) sets it; the loop acts on it at the next
# step boundary, after every rank agrees: a checkpoint, then exit. It is installed first thing
# in main, before the heavy imports, so that a signal arriving while a (requeued) job starts
# up is a request to stop, not the default action's death.
from lsgd_hpc.runtime.signals import StopSignals

__all__ = ["main", "EXIT_USAGE", "EXIT_STOPPED"]

#: what Trainer.run returns when replacements are ready to join (--on-failure heal)
HEAL = "heal"

from lsgd_hpc.cli.build import lr_at, make_optimizer  # noqa: E402
from lsgd_hpc.comm.monitor import MONITOR  # noqa: E402
from lsgd_hpc.cli.evaluate import Evaluator  # noqa: E402
from lsgd_hpc.cli.progress import Progress  # noqa: E402


def _requeue(env: dict) -> bool:
    """``scontrol requeue`` this job (it comes back with the same id and resumes from its
    checkpoint), under SLURM. True when SLURM took it."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return False
    from lsgd_hpc.runtime.preemption import scontrol_requeue
    return scontrol_requeue(job)


def _record(run_dir: str, comm, status: str, step, total_steps, started: float,
            **fields) -> None:
    """Rank 0 (of the world that got here: the lowest survivor after lost ranks) writes
    ``RUN_DIR/complete.json`` (lsgd_hpc.runtime.completion), the record that the run finished
    or stopped on purpose. A record that cannot be written is one line on stderr: the run
    then reads as not complete, which is what a job check must see."""
    from lsgd_hpc.runtime.completion import COMPLETION_FILE, write_completion
    try:
        write_completion(run_dir, comm, status=status, step=step, total_steps=total_steps,
                         seconds=round(time.monotonic() - started, 3), **fields)
    except OSError as exc:
        print(f"{PROG}: warning: cannot write {os.path.join(run_dir, COMPLETION_FILE)}: "
              f"{exc.strerror or exc}", file=sys.stderr, flush=True)


def _checkpointed_step(run_dir: str):
    """The step of the newest complete checkpoint set of ``run_dir`` (0: none), or None when
    it cannot be told."""
    try:
        from lsgd_hpc.runtime.checkpoint import latest_checkpoint
        latest = latest_checkpoint(run_dir)
        return int(latest["step"]) if latest else 0
    except Exception:
        return None


def _init(backend: str, cfg):
    """``lsgd_hpc.init`` as the trainer needs it: the world of ``backend``, node groups, this
    rank's device; an exception ends only this run (the trainer agrees and exits itself)."""
    import lsgd_hpc
    cuda = cfg is not None and cfg.device == "cuda"
    tolerant = (cfg is not None and cfg.on_failure in ("shrink", "heal")
                and backend in ("mpi", "torch") and cfg.backend == backend)
    torch_ft = tolerant and backend == "torch"
    return lsgd_hpc.init(backend, ranks_per_node=cfg.ranks_per_node if cfg else None,
                         device="cuda" if cuda else "cpu", abort_on_exception=False,
                         on_failure=cfg.on_failure if tolerant else "abort",
                         min_ranks=cfg.min_ranks if tolerant else 1,
                         spares=cfg.spares if tolerant and cfg.on_failure == "heal" else 0,
                         failure_timeout=cfg.failure_timeout if torch_ft else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The trainer: options, the world, the start every rank agrees on, then the run; the
    exit status."""
    words = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in words:    # the pre-flight check: no MPI, no world (cli/preflight.py)
        from lsgd_hpc.cli.preflight import dry_run
        return dry_run(words, dict(os.environ))
    # First, before the heavy imports (torch, MPI): a warning signal is a request from now on.
    stop = StopSignals()
    started = time.monotonic()
    env = dict(os.environ)
    from lsgd_hpc.cli.config import ConfigError, parse_config
    from lsgd_hpc.comm.launcher import launched_alone

    cfg, error, code = None, None, EXIT_USAGE
    try:
        cfg = parse_config(argv, env)
    except ConfigError as exc:
        if launched_alone(env):            # a world of one: nobody to agree with
            return usage_error(str(exc))
        error = str(exc)

    from lsgd_hpc.comm import CommError
    # MPI_Init or the torch process group: every rank gets here, even one whose options
    # failed, so that all of them can agree on the outcome
    try:
        comm = _init(boot_backend(cfg, argv, env), cfg)
    except (CommError, ValueError) as exc:
        # the library's refusals name its arguments (on_failure='heal'): say the options
        return usage_error(option_spelling(str(exc)))
    if comm.joined is not None:               # a replacement that joined a running job
        cfg.run_dir, cfg.resume = comm.joined["history"]["app"]["run_dir"], True
    while True:
        status = _start(cfg, env, comm, stop, started, error, code)
        if not isinstance(status, _Healed):
            return status
        # --on-failure heal: the survivors and their replacements go on in the healed world,
        # from the checkpoint the survivors saved at the join (the same calls on every rank)
        comm, cfg.resume, error = status.comm, True, None


class _Healed:
    """What a run returns when its world was healed: go on in ``comm``."""

    def __init__(self, comm):
        self.comm = comm


def _start(cfg, env: dict, comm, stop: StopSignals, started: float, error, code):
    """Everything after the world exists: the trainer built, the start agreed, the run; the
    exit status, or _Healed. Every rank of a healed world runs it again, together."""
    trainer = None
    if error is None:
        if not cfg.resume:
            _clear_record(cfg, comm)
        trainer, error, code = _build_trainer(cfg, env, comm, started)
    message, code, stopped = agree_on_start(comm, error, code, stop.signum)
    if message is not None:
        if comm.rank == 0 and env_rank(env) == 0:
            print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        return code
    if stopped:
        return _stopped_at_start(cfg, trainer, comm, env, stopped, started)
    if cfg.backend == "horovod":            # every rank agreed: join Horovod now
        comm.groups.free()
        try:
            comm = _init("horovod", cfg)
        except CommError as exc:
            return usage_error(str(exc))
    try:
        trainer.connect(comm, stop)
    except ValueError as exc:
        # agreed by every rank (a run folder that cannot be made, a model the method cannot
        # handle, a tracker that is not installed): the same one line everywhere
        if comm.rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    return _run_trainer(trainer, comm)


def _clear_record(cfg, comm) -> None:
    """Rank 0 removes a completion record left by an earlier attempt (a resumed or repeated
    run): the record in a run directory is always the latest attempt's."""
    if cfg.run_dir and comm.rank == 0:
        from lsgd_hpc.runtime.completion import clear_completion
        try:
            clear_completion(cfg.run_dir)
        except OSError:
            pass


def _build_trainer(cfg, env: dict, comm, started: float):
    """The checks that need the world, then the Trainer's local part (data, model):
    ``(trainer, error, exit status)``, with error None when it was built. A user's mistake is
    its one line (exit 2), anything else a traceback on stderr and exit 1."""
    from lsgd_hpc.cli.config import ConfigError, check_world
    from lsgd_hpc.comm import CommError
    from lsgd_hpc.data.errors import DataError
    try:
        check_world(cfg, comm.size, env, rebuilt=comm.generation > 0)
        if cfg.backend == "horovod":   # hvd.init is collective: every rank must have it
            from lsgd_hpc.comm.horovod import NOT_INSTALLED, horovod_available
            if not horovod_available():
                raise CommError(NOT_INSTALLED)
        trainer = Trainer(cfg, env, comm)            # local only: data, model
        trainer.started = started
    except (ConfigError, CommError, DataError) as exc:
        return None, str(exc), EXIT_USAGE
    except Exception as exc:           # not the user's mistake: show it, then agree
        traceback.print_exc(file=sys.stderr)
        return None, f"rank {comm.rank} failed to start: {type(exc).__name__}: {exc}", 1
    return trainer, None, EXIT_USAGE


def _stopped_at_start(cfg, trainer, comm, env: dict, stopped, started: float) -> int:
    """Signalled before step 1: nothing to lose. Warned of the time limit under SLURM, the
    job goes back to the queue and starts again (from the last checkpoint set, if any).
    Stopped on purpose: a "stopped" record (at the last checkpoint's step), written before the
    requeue too, since SLURM may end the ranks as soon as it takes it. The exit status."""
    run_dir = cfg.run_dir
    requeued = False
    step = _checkpointed_step(run_dir) if run_dir and comm.rank == 0 else None
    if comm.rank == 0:
        print("[lsgd_hpc] stop requested during start-up, before any step; nothing to "
              "checkpoint", flush=True)
        if run_dir:
            _record(run_dir, comm, "stopped", step, trainer.total_steps, started,
                    exit_status=EXIT_STOPPED)
        if signal.SIGUSR1 in stopped:
            requeued = _requeue(env)
    requeued = comm.allgather_object(requeued)[0]
    if requeued and run_dir:
        _record(run_dir, comm, "stopped", step, trainer.total_steps, started,
                requeued=True, exit_status=0)
    return 0 if requeued else EXIT_STOPPED


def _run_trainer(trainer: "Trainer", comm) -> int:
    """``trainer.run()`` (after --inject-failure's testing hook): its status, or an error's.
    An unrecoverable loss of ranks is one line on every survivor (no traceback); any other
    exception ends every rank now (fail fast: comm.abort). After the run, the warning signals
    are ignored."""
    cfg = trainer.cfg
    if cfg.inject_failure and comm.generation == 0:   # testing: ranks that SIGKILL themselves
        from lsgd_hpc.comm.injection import inject_failures
        inject_failures(cfg.inject_failure, comm)
    from lsgd_hpc.comm.failures import EXIT_UNRECOVERABLE, UnrecoverableFailure
    try:
        status = trainer.run()
        if status is HEAL:
            return _Healed(comm.heal(run_dir=trainer.run_dir))
    except UnrecoverableFailure as exc:
        # on every survivor alike (agreed): one line each, no traceback, then out
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_UNRECOVERABLE
    except BaseException as exc:  # fail fast: one rank's error ends every rank now
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        print(f"{PROG}: rank {comm.rank}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        comm.abort(1)
        return 1
    # Done, or stopped after its checkpoint: a warning that comes while the process winds down
    # (MPI_Finalize, interpreter teardown, which puts Python handlers back to the default) has
    # nothing left to save, and its default action would turn a finished job into a failed one.
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return status


class Trainer:
    """One rank's training run, built from the library's pieces.

    Built in two phases: the constructor does local work only (data, model, optimizer), so
    that a data or model error is a usage error agreed before any other collective;
    ``connect`` then builds the method, the metrics file, the checkpointer and the watchdog.
    """

    def __init__(self, cfg, env: dict, comm):
        import torch

        from lsgd_hpc.cli.build import heldout_split, loader_options, validation_split
        from lsgd_hpc.data.loaders import load_dataset
        from lsgd_hpc.data.sampler import ShardedBatches
        from lsgd_hpc.data.specs import dataset_spec
        from lsgd_hpc.models import zoo as models

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1") or 1))
        self.torch, self.cfg, self.env = torch, cfg, env
        self.rank, self.size, self.device = comm.rank, comm.size, comm.device
        self.ds = load_dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.synthetic_size,
                               cfg.label_noise, **loader_options(cfg))
        self.ds, self.validation = validation_split(cfg, self.ds)     # --validation-size
        self.ds, self.heldout = heldout_split(cfg, self.ds)           # --leader-score heldout
        self.batches = ShardedBatches(self.ds, self.rank, self.size, cfg.batch_size, cfg.seed)
        self.spe = self.batches.steps_per_epoch
        # the budget: --epochs (capped by --max-steps), or --max-steps alone
        self.total_steps = (max(1, math.ceil(cfg.epochs * self.spe)) if cfg.epochs
                            else cfg.max_steps)
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.model_name = cfg.model or dataset_spec(cfg.dataset).default_model
        torch.manual_seed(cfg.seed)                 # the same x_0 on every worker
        try:
            self.model = models.build_model(self.model_name, self.ds.num_classes,
                                            self.ds.input_shape).to(self.device)
        except ValueError as exc:
            from lsgd_hpc.cli.config import ConfigError
            raise ConfigError("--model", str(exc)) from None
        torch.manual_seed(cfg.seed * 100003 + self.rank)   # per-rank dropout etc.
        self.opt = make_optimizer(cfg, self.model.parameters())
        # --precision: autocast of forward and loss; fp16 scales the loss (GradScaler)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.scaler = (torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16"
                       else None)
        from lsgd_hpc.models.batchnorm import DEFAULT_BN_BATCHES, batchnorm_layers
        # models no worker trained get BatchNorm statistics of their own before evaluation
        self.bn_batches = (cfg.bn_recompute if cfg.bn_recompute is not None
                           else DEFAULT_BN_BATCHES if batchnorm_layers(self.model) else 0)
        self.progress = Progress(self)
        self.started = time.monotonic()     # (main sets it to the process's start)

    def connect(self, comm, stop: StopSignals) -> "Trainer":
        import lsgd_hpc
        from lsgd_hpc.cli.build import heldout_score_fn

        cfg = self.cfg
        self.comm, self.stop = comm, stop
        # Rank 0 names the run folder (a default one has the time in it)
        run_dir = cfg.run_dir or os.path.join(
            "runs", f"{cfg.algorithm}-{_dt.datetime.now():%Y%m%d-%H%M%S}")
        cfg.run_dir = self.run_dir = comm.allgather_object(run_dir)[0]
        self.heal = getattr(comm.fault_tolerance, "heal_event", None)   # this world's heal
        self.resolved = dict(cfg.to_dict(), model=self.model_name, world_size=self.size,
                             bn_recompute=self.bn_batches, n_nodes=comm.n_nodes,
                             steps_per_epoch=self.spe, total_steps=self.total_steps)
        score = ({"score_fn": heldout_score_fn(self.model, self.heldout, comm.world,
                                                self.device, cfg.eval_batch_size)}
                 if self.heldout is not None else {})
        # The method as a library user builds it: the trainer is its user.
        self.method = lsgd_hpc.METHODS[cfg.algorithm](
            self.model, self.opt, comm, max_steps=self.total_steps,
            checkpoint_every=cfg.checkpoint_every, stop=stop,
            consensus_every=cfg.consensus_every, stop_check_every=cfg.stop_check_every,
            comm_dtype=cfg.comm_dtype, error_feedback=cfg.error_feedback, topk=cfg.topk,
            error_feedback_decay=cfg.error_feedback_decay,
            worker_ranks=cfg.worker_ranks, broadcast_initial=False,
            **cfg.method_options, **score)
        self.flat, self.rule = self.method.flat, self.method.rule
        extra = {}
        if self.scaler is not None:
            extra["train"] = {"skipped_steps": "i8"}
        if self.validation is not None:       # val_* beside every test_* column of /eval
            tests = ["test_loss", "test_accuracy"] + list(self.rule.extra_columns.get("eval", {}))
            extra["eval"] = {c.replace("test_", "val_"): "f8" for c in tests
                             if c.endswith(("test_loss", "test_accuracy"))}
        self.metrics = lsgd_hpc.open_metrics(
            self.run_dir, comm, method=self.method, config=self.resolved,
            flush_every=cfg.flush_every, flush_seconds=cfg.flush_seconds, extra_columns=extra,
            trackers=cfg.tracker)
        # One checkpoint format: the objects a library loop names (docs/library.md)
        objects = dict(model=self.model, optimizer=self.opt, method=self.method,
                       sampler=self.batches.sampler, metrics=self.metrics)
        if self.scaler is not None:
            objects["scaler"] = self.scaler
        self.checkpointer = lsgd_hpc.Checkpointer(self.run_dir, comm,
                                                  sync=cfg.checkpoint_sync, **objects)
        self.watchdog = (lsgd_hpc.start_watchdog(comm, self.run_dir, cfg.collective_timeout,
                                                 self.metrics)
                         if cfg.collective_timeout > 0 else None)
        self.evaluator = Evaluator(self.model, self.flat, self.rule, self.ds, self.batches,
                                   self.validation, self.device, cfg.eval_batch_size,
                                   self.bn_batches)
        if cfg.on_failure in ("shrink", "heal") and comm.fault_tolerance is not None:
            comm.on_failure(self._reshard)
        return self

    def _reshard(self, event) -> None:
        """After lost ranks: the survivors share the whole training set from the next epoch
        boundary on (the dead ranks' shards are left out until then)."""
        self.batches.reshard(self.comm.rank, self.comm.size)
        if self.comm.rank == 0:
            print(f"data: the {self.comm.size} ranks left share the training set from step "
                  f"{self.batches.next_boundary(event.step)} (the next epoch) on", flush=True)

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        """Train to the end of the budget (or of the method's own schedule), or until a stop
        request; the exit status. ``compute_seconds`` is the metrics writer's clock (the
        writer times every ``method.step``: runtime.run_metrics.RunMetrics)."""
        method = self.method
        step = self._begin()
        loss_fn = self.torch.nn.CrossEntropyLoss()
        self.model.train()
        # A method that owns its schedule ends training itself (ranks take uneven steps).
        owns = self.rule.owns_schedule
        last_step = math.inf if owns else self.total_steps
        sleep_s = self._straggler_seconds()
        MONITOR.step = step
        last = None          # the last step's (loss, output, labels, lr)
        while step < last_step:
            # to the end of this step's epoch (where a reshard after lost ranks begins)
            for xb, yb in self.batches.from_step(step):
                last = self._train_step(step, xb, yb, loss_fn, sleep_s)
                step = method.steps
                self._log_and_evaluate(step, *last)
                if self.heal is not None and not self.heal.logged:
                    self.metrics.log_heal(self.heal, step)   # the first step after a heal
                # what the method agreed on after this step (the same on every rank)
                if method.checkpoint_due:
                    self.checkpointer.save()
                    self._saved = step
                if method.stopping:
                    return self._preempted(step)
                if method.done:
                    last_step = step
                if step >= last_step:
                    break
                if self.comm.heal_pending and self.comm.heal_ready():
                    return self._pause_for_heal(step)
        return self._finish(step, owns, last)

    def _begin(self) -> int:
        """Resume from the latest checkpoint (--resume) or start fresh; the step to go on
        from."""
        resumed = self.checkpointer.restore() if self.cfg.resume else None
        if resumed is None:
            self._start_fresh()
        self.metrics.flush()
        step = self.method.steps
        if self.heal is not None:          # the survivors' pause for the join ends here
            self.heal.pause_seconds = max(0.0, time.time() - self.heal.decided_at)
        self.progress.start(resumed, self.checkpointer.skipped, time.perf_counter(), step)
        return step

    def _straggler_seconds(self) -> float:
        """--straggler: the seconds this rank sleeps in every step (0: not the slow rank)."""
        from lsgd_hpc.cli.config import straggler_of
        straggler = straggler_of(self.cfg)
        return straggler[1] if straggler and straggler[0] == self.rank else 0.0

    def _train_step(self, step: int, xb, yb, loss_fn, sleep_s: float):
        """One training step on a minibatch: forward, backward (gradient clipping), then
        ``method.step`` (the optimizer step and the method's communication). Returns
        ``(loss, output, labels, lr)`` for the step's rows."""
        torch, cfg, method = self.torch, self.cfg, self.method
        xb = xb.to(self.device, non_blocking=True)
        yb = yb.to(self.device, non_blocking=True)
        lr = lr_at(cfg, min(step, self.total_steps), self.total_steps)
        for group in self.opt.param_groups:
            group["lr"] = lr
        if self.amp_dtype is None:
            out = self.model(xb)
            loss = loss_fn(out, yb)
        else:
            with torch.autocast(self.device.type, dtype=self.amp_dtype):
                out = self.model(xb)
                loss = loss_fn(out, yb)
        method.zero_grad()
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if cfg.grad_clip:
            method.synchronize()         # clip the averaged gradient (allreduce)
            if self.scaler is not None:
                self.scaler.unscale_(self.opt)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        if sleep_s:
            time.sleep(sleep_s)      # --straggler: this rank is slow
        MONITOR.step = step + 1
        loss_v = float(loss.detach())
        # the optimizer step and the method's communication (with the consensus
        # probe between the two, at the same point of every method's cycle)
        method.step(loss_v, scaler=self.scaler)
        return loss_v, out, yb, lr

    def _log_and_evaluate(self, step: int, loss_v: float, out, yb, lr: float) -> None:
        """The /train row every --log-every steps and an evaluation every --eval-every steps
        (and both at the last step of the budget)."""
        cfg = self.cfg
        self.progress.losses.append(loss_v)
        if step % cfg.log_every == 0 or step == self.total_steps:
            self._log_train(step, loss_v, out, yb, lr)
        if step % cfg.eval_every == 0 or step == self.total_steps:
            with self.metrics.measuring():
                self.progress.evaluated(step, self.evaluate(step), time.perf_counter())

    def _finish(self, step: int, owns: bool, last) -> int:
        """The end of the run at ``step`` (``owns``: the method owns its schedule; ``last``:
        that step's (loss, output, labels, lr)): the last rows, the final checkpoint, the
        metrics closed, then rank 0 records the run as complete. The exit status (0)."""
        cfg, metrics = self.cfg, self.metrics
        self.method.drain()
        if owns and step != self.total_steps:   # the last step's rows (uneven steps)
            if step % cfg.log_every:
                self._log_train(step, *last)
            if step % cfg.eval_every:
                with metrics.measuring():
                    self.evaluate(step)
        self.checkpointer.save()                 # flushes the metrics too
        self.checkpointer.wait()                 # the set written and committed
        metrics.close()                          # the end of the run: end_time, trackers
        self.progress.done(step, metrics.wall(), os.path.join(self.run_dir, "metrics"))
        # every rank's file is closed before rank 0 records the run as complete (the last
        # step: the furthest rank's, for a method whose ranks take uneven steps)
        furthest = max(self.comm.allgather_object(step))
        if self.watchdog is not None:
            self.watchdog.stop()
        _record(self.run_dir, self.comm, "complete", furthest, self.total_steps, self.started)
        self.comm.groups.free()
        return 0

    def _start_fresh(self) -> None:
        if self.rank == 0:
            path = os.path.join(self.run_dir, "config.yaml")
            if not os.path.exists(path):
                import yaml
                with open(path, "w") as fh:
                    yaml.safe_dump(self.resolved, fh, sort_keys=True)
        # the common x_0, whatever the init's determinism; EASGD's centre and similar
        # copies of x_0 are taken from it
        self.method.broadcast_initial()

    def _log_train(self, step: int, loss: float, out, yb, lr: float) -> None:
        # the batch's hits, left on the device: the metrics writer turns them into the row's
        # accuracy when it writes its rows (no sync per step; RunMetrics.log_step)
        hits = out.argmax(1) == yb
        self.metrics.log_step(step, loss, hits, lr, epoch=self.batches.epoch_of(step),
                              **({"skipped_steps": self.method.skipped_steps}
                                 if self.scaler is not None else {}))

    def evaluate(self, step: int) -> float:
        row = self.evaluator(step)
        self.metrics.log_eval(step, epoch=self.batches.epoch_of(step), **row)
        return row["test_accuracy"]

    # -- healing ---------------------------------------------------------------------------
    def _pause_for_heal(self, step: int):
        """--on-failure heal, replacements ready at this step boundary: a checkpoint that
        they will resume from (unless this step's is there), this world's objects let go.
        Returns HEAL: the caller joins the replacements and every rank builds anew."""
        if getattr(self, "_saved", None) != step:
            self.checkpointer.save()
        wait = getattr(self.checkpointer, "wait", None)
        if wait is not None:
            wait()                            # an asynchronous save: complete on disk first
        if self.watchdog is not None:
            self.watchdog.stop()
        self.metrics.flush()                   # the next writer goes on in the same file
        self.metrics.close_trackers()
        if self.comm.rank == 0:
            print(f"[lsgd_hpc] heal: replacement(s) ready at step {step}; joining",
                  file=sys.stderr, flush=True)
        return HEAL

    # -- preemption ------------------------------------------------------------------------
    def _preempted(self, step: int) -> int:
        import lsgd_hpc
        self.checkpointer.save()
        self.checkpointer.wait()                # on disk and committed before a requeue
        self.metrics.close_trackers()           # not the end of the run: no end_time
        # stopped on purpose: recorded before the requeue too (SLURM may end the ranks as
        # soon as it takes it), and again once it did
        _record(self.run_dir, self.comm, "stopped", step, self.total_steps, self.started,
                exit_status=EXIT_STOPPED)
        requeued = lsgd_hpc.requeue(self.comm, self.stop)
        if requeued:
            _record(self.run_dir, self.comm, "stopped", step, self.total_steps, self.started,
                    requeued=True, exit_status=0)
        if self.comm.rank == 0:            # (the lowest survivor after lost ranks)
            print(f"[lsgd_hpc] stop requested: checkpoint at step {step} in "
                  f"{self.run_dir}/checkpoints", flush=True)
            if self.env.get("SLURM_JOB_ID") and not requeued:
                print("[lsgd_hpc] SIGTERM: SLURM requeues a preempted job itself; "
                      "a cancelled one stays cancelled", flush=True)
            elif not self.env.get("SLURM_JOB_ID"):
                print(f"[lsgd_hpc] continue with: --resume --run-dir {self.run_dir}", flush=True)
        return 0 if requeued else EXIT_STOPPED


def run_as_main() -> None:
    """``python -m lsgd_hpc.train``: run, close the world, exit with the status.

    The exit is the interpreter's own less its teardown: the exit handlers (trackers, the
    checkpoint writer, the session's final barrier, a healed job's communicators freed),
    MPI_Finalize and flushed output, then ``os._exit`` (lsgd_hpc.session.exit_as_interpreter).
    Tearing down an interpreter that imported torch costs each rank about a CPU-second and
    the job about 2 s of wall time at 4 ranks on 2 cores, with nothing left to save."""
    from lsgd_hpc.session import exit_as_interpreter
    status = main()
    close_torch_world(status)
    if status == EXIT_USAGE and "mpi4py.MPI" in sys.modules:
        exit_together(status)
    exit_as_interpreter(status)


if __name__ == "__main__":
    run_as_main()
