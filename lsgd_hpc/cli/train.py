"""Train with LSGD or a baseline: config -> data, model, comm, algorithm, metrics (one flat loop).

    mpirun -np 4 python -m lsgd_hpc.train [options]
    srun --mpi=pmix python -m lsgd_hpc.train [options]
"""

from __future__ import annotations

import datetime as _dt
import math
import os
import signal
import socket
import sys
import time
import traceback
from typing import Optional, Sequence

__all__ = ["main", "make_optimizer", "EXIT_USAGE", "EXIT_STOPPED"]

PROG = "lsgd_hpc.train"
EXIT_USAGE = 2        # a user's mistake, found before any collective
EXIT_STOPPED = 143    # stopped by SIGTERM/SIGUSR1 after a complete checkpoint (not requeued)


def _env_rank(env: Optional[dict] = None) -> int:
    """This process's rank as its launcher set it, readable before MPI starts (to print a
    message once; with ``srun --mpi=pmi2`` under Open MPI every process is rank 0 of a world
    of its own, and only this tells them apart). See lsgd_hpc.runtime.launcher."""
    from lsgd_hpc.runtime.launcher import env_rank
    return env_rank(env)


def _usage_error(message: str) -> int:
    if _env_rank() == 0:
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


from lsgd_hpc.runtime.signals import StopSignals as StopFlag  # noqa: E402
# The trainer's stop flag is the library's: SIGUSR1 (SLURM's warning before the time limit)
# or SIGTERM (preemption, scancel, scontrol requeue) sets it; the loop acts on it at the next
# step boundary, after every rank agrees: a checkpoint, then exit. Only the warning makes the
# job requeue itself: after SIGTERM SLURM already knows what becomes of the job (a preempted
# or requeued job goes back to the queue by itself; a cancelled one must stay ended). It is
# installed first thing in main, before the heavy imports, so that a signal arriving while a
# (requeued) job starts up is a request to stop, not the default action's death.


def _requeue(env: dict) -> bool:
    """Rank 0's half of a stop under SLURM: ``scontrol requeue`` this job (it comes back with
    the same id and resumes from its checkpoint). True when SLURM took it."""
    job = env.get("SLURM_JOB_ID")
    if not job:
        return False
    from lsgd_hpc.runtime.blocks import scontrol_requeue
    return scontrol_requeue(job)


def _git_sha() -> str:
    from lsgd_hpc.runtime.blocks import git_sha
    return git_sha()


def _default_run_dir(cfg) -> str:
    # Under SLURM the config already chose runs/<job id> (see config.validate).
    return os.path.join("runs", f"{cfg.algorithm}-{_dt.datetime.now():%Y%m%d-%H%M%S}")


def _lr_at(cfg, step: int, total: int) -> float:
    """The schedule's learning rate at ``step`` (0-based), times a linear warmup ramp
    (step + 1) / warmup over the first --warmup-steps steps."""
    warm = getattr(cfg, "warmup_steps", 0) or 0
    ramp = min(1.0, (step + 1) / warm) if warm else 1.0
    if cfg.lr_schedule == "step":
        return ramp * cfg.lr * (0.1 ** (int(step >= 0.5 * total) + int(step >= 0.75 * total)))
    if cfg.lr_schedule == "cosine":
        return ramp * 0.5 * cfg.lr * (1 + math.cos(math.pi * step / max(1, total)))
    return ramp * cfg.lr


def _fmt_eta(seconds: float) -> str:
    return str(_dt.timedelta(seconds=int(max(0, seconds))))


def _launched_alone(env: dict) -> bool:
    """No launcher (torchrun, mpirun, srun) started this process: its world is itself alone."""
    from lsgd_hpc.runtime.launcher import launched_alone
    return launched_alone(env)


def _start_backend(cfg, argv: Optional[Sequence[str]], env: dict) -> str:
    """'torch' or 'mpi': what the start-up agreement runs over. Every rank must choose alike,
    also one whose options failed to parse: under torchrun always torch; else the parsed
    --backend, or (parse failed) the --backend written on the command line."""
    from lsgd_hpc.runtime.launcher import detect
    if detect(env).launcher == "torchrun":
        return "torch"
    backend = cfg.backend if cfg is not None else None
    if backend is None:
        args = list(sys.argv[1:] if argv is None else argv)
        for i, arg in enumerate(args):
            if arg == "--backend" and i + 1 < len(args):
                backend = args[i + 1]
            elif arg.startswith("--backend="):
                backend = arg.split("=", 1)[1]
    return "torch" if backend == "torch" else "mpi"


def _agree_on_start(comm, error: Optional[str], code: int, stop: StopFlag):
    """The one start-up collective: every rank says whether its checks failed (why, and the
    exit status that goes with it) and whether a stop signal came. Checks that can differ
    between ranks (a data folder missing on one node, a per-node environment, a model that
    fails to build there) would otherwise leave the good ranks waiting forever in their first
    collective.

    Returns ``(message, code, signals)``: the first failing rank's message (saying where it
    failed when not every rank did) and exit status, or ``(None, 0, ...)``; and the set of
    signals the ranks got."""
    gather = getattr(comm, "allgather_object", None) or comm.allgather   # torch world, or MPI
    votes = gather((error, code, stop.signum, socket.gethostname()))
    failed = [r for r, vote in enumerate(votes) if vote[0]]
    stopped = {vote[2] for vote in votes if vote[2] is not None}
    if not failed:
        return None, 0, stopped
    message, code = votes[failed[0]][:2]
    if len(failed) < len(votes):
        hosts = sorted({votes[r][3] for r in failed})
        message += (f" (on {len(failed)} of {len(votes)} ranks, from rank {failed[0]}; "
                    f"host {', '.join(hosts)})")
    return message, code, stopped


def main(argv: Optional[Sequence[str]] = None) -> int:
    # First, before the heavy imports (torch, MPI): a warning signal is a request from now on.
    stop = StopFlag()
    env = dict(os.environ)
    from lsgd_hpc.cli.config import ConfigError, check_world, parse_config

    cfg, error, code = None, None, EXIT_USAGE
    try:
        cfg = parse_config(argv, env)
    except ConfigError as exc:
        if _launched_alone(env):           # a world of one: nobody to agree with
            return _usage_error(str(exc))
        error = str(exc)

    from lsgd_hpc.comm import CommError
    from lsgd_hpc.data.datasets import DataError
    world = None
    # --backend torch, and anything under torchrun (no MPI job to agree over): the torch world
    # first, the start-up agreement over it
    if _start_backend(cfg, argv, env) == "torch":
        from lsgd_hpc.comm import make_world
        try:
            gpu = None
            if cfg is not None and cfg.device == "cuda" and _cuda_available():
                gpu = _device("cuda", _env_rank(env), env)     # bound to the group (NCCL)
            world = comm = make_world("torch", device=gpu)   # every rank, as to MPI_Init
        except CommError as exc:
            return _usage_error(str(exc))
        rank, size = world.rank, world.size
    else:
        from mpi4py import MPI  # MPI_Init: every rank gets here, even one whose options failed
        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
    trainer = None
    if error is None:
        try:
            check_world(cfg, size, env)
            if cfg.backend == "horovod":   # hvd.init is collective: import it everywhere first
                from lsgd_hpc.comm.horovod import NOT_INSTALLED, horovod_available
                if not horovod_available():
                    raise CommError(NOT_INSTALLED)
            trainer = Trainer(cfg, env, rank, size)    # local only: data, model
        except (ConfigError, CommError, DataError) as exc:
            error = str(exc)
        except Exception as exc:           # not the user's mistake: show it, then agree
            traceback.print_exc(file=sys.stderr)
            error, code = f"rank {rank} failed to start: {type(exc).__name__}: {exc}", 1
    message, code, stopped = _agree_on_start(comm, error, code, stop)
    if message is not None:
        if rank == 0 and _env_rank(env) == 0:
            print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        return code
    if stopped:
        # Signalled before step 1: nothing to lose. Warned of the time limit under SLURM, the
        # job goes back to the queue and starts again (from the last checkpoint set, if any).
        requeued = False
        if rank == 0:
            print("[lsgd_hpc] stop requested during start-up, before any step; nothing to "
                  "checkpoint", flush=True)
            if signal.SIGUSR1 in stopped:
                requeued = _requeue(env)
        requeued = (world.allgather_object(requeued)[0] if world is not None
                    else comm.bcast(requeued, root=0))
        return 0 if requeued else EXIT_STOPPED

    if world is None:
        from lsgd_hpc.comm import make_world
        try:
            world = make_world(cfg.backend)
        except CommError as exc:
            return _usage_error(str(exc))
    try:
        trainer.connect(world, stop)
    except ValueError as exc:
        # agreed by every rank (a run folder that cannot be made, a model the method cannot
        # handle): the same one line everywhere, no traceback
        if rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    try:
        status = trainer.run()
    except BaseException as exc:  # fail fast: one rank's error ends every rank now
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        print(f"{PROG}: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        if cfg.backend == "torch":
            world.abort(1)
        MPI.COMM_WORLD.Abort(1)
        return 1
    # Done, or stopped after its checkpoint: a warning that comes while the process winds down
    # (MPI_Finalize, interpreter teardown, which puts Python handlers back to the default) has
    # nothing left to save, and its default action would turn a finished job into a failed one.
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    return status


class Trainer:
    """One rank's training run. Everything it holds is in its checkpoint.

    Built in two phases: the constructor does local work only (data, model, optimizer), so
    that a data or model error is a usage error before any collective; ``connect`` then
    forms the node groups, the algorithm and the metrics file.
    """

    def __init__(self, cfg, env: dict, rank: int, size: int):
        import torch

        from lsgd_hpc.runtime import checkpoint
        from lsgd_hpc.data import datasets as data
        from lsgd_hpc.data.specs import dataset_spec
        from lsgd_hpc.models import zoo as models

        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1") or 1))
        self.torch, self.cfg, self.env, self.ckpt = torch, cfg, env, checkpoint
        self.rank, self.size = rank, size
        self.ds = data.load_dataset(cfg.dataset, cfg.data_dir, cfg.seed, cfg.synthetic_size,
                                     cfg.label_noise, **data.loader_options(cfg))
        self.ds, self.validation = _validation_split(cfg, self.ds)   # --validation-size
        self.ds, self.heldout = _heldout_split(cfg, self.ds)   # --leader-score heldout
        self.sampler = data.ShardedBatches(self.ds, rank, size, cfg.batch_size, cfg.seed)
        self.spe = self.sampler.steps_per_epoch
        # the budget: --epochs (capped by --max-steps), or --max-steps alone
        self.total_steps = (max(1, math.ceil(cfg.epochs * self.spe)) if cfg.epochs
                            else cfg.max_steps)
        if cfg.max_steps:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.model_name = cfg.model or dataset_spec(cfg.dataset).default_model
        self.device = _device(cfg.device, rank, env)
        torch.manual_seed(cfg.seed)                 # the same x_0 on every worker
        try:
            self.model = models.build_model(self.model_name, self.ds.num_classes,
                                            self.ds.input_shape).to(self.device)
        except ValueError as exc:
            from lsgd_hpc.cli.config import ConfigError
            raise ConfigError("--model", str(exc)) from None
        torch.manual_seed(cfg.seed * 100003 + rank)   # per-rank dropout etc.
        self.opt = make_optimizer(cfg, self.model.parameters())
        # --precision: autocast of forward and loss; fp16 scales the loss (GradScaler)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.scaler = (torch.amp.GradScaler(self.device.type) if cfg.precision == "fp16"
                       else None)
        from lsgd_hpc.models.batchnorm import DEFAULT_BN_BATCHES, batchnorm_layers
        # models no worker trained get BatchNorm statistics of their own before evaluation
        self.bn_batches = (cfg.bn_recompute if cfg.bn_recompute is not None
                           else DEFAULT_BN_BATCHES if batchnorm_layers(self.model) else 0)
        self.step = 0
        self.elapsed0 = 0.0          # wall time before this process (resume)
        self.compute_seconds = 0.0
        # cumulative seconds left out of the training time (see training_time)
        self.eval_seconds = 0.0
        self.checkpoint_seconds = 0.0
        self.metrics_seconds = 0.0
        self.losses_since_print: list = []

    def connect(self, world, stop: StopFlag) -> "Trainer":
        from lsgd_hpc import __version__
        from lsgd_hpc.comm import NodeGroups
        from lsgd_hpc.runtime import make_run_dir
        from lsgd_hpc.runtime.metrics import SCHEMA_VERSION, MetricsWriter, encode_config, rank_file

        cfg, env, torch = self.cfg, self.env, self.torch
        self.world, self.stop = world, stop
        self.groups = NodeGroups.build(world, cfg.ranks_per_node)
        # Rank 0 decides what every rank must agree on (not traffic of the method).
        shared = None
        if self.rank == 0:
            shared = {"run_dir": cfg.run_dir or _default_run_dir(cfg), "git_sha": _git_sha(),
                      "start_time": _dt.datetime.now(_dt.timezone.utc).isoformat()}
        shared = world.allgather_object(shared)[0]
        cfg.run_dir = self.run_dir = shared["run_dir"]
        self.pointer = self.ckpt.latest_checkpoint(self.run_dir) if cfg.resume else None
        if cfg.resume and self.pointer is None:
            raise RuntimeError(f"no complete checkpoint in {self.run_dir}")
        resolved = cfg.to_dict()
        resolved.update(model=self.model_name, world_size=self.size, bn_recompute=self.bn_batches,
                        n_nodes=self.groups.n_nodes, steps_per_epoch=self.spe,
                        total_steps=self.total_steps)
        self.resolved = resolved
        # The method as a library user builds it (lsgd_hpc.METHODS): the CLI is its user.
        from lsgd_hpc.methods import METHODS
        from lsgd_hpc.session import Comm
        self.comm = Comm(world, self.groups, self.device, cfg.backend)
        make_run_dir(self.run_dir, self.comm)      # a folder that cannot be made: exit 2
        self.method = METHODS[cfg.algorithm](
            self.model, self.opt, self.comm, max_steps=self.total_steps,
            checkpoint_every=cfg.checkpoint_every, stop=stop,
            consensus_every=cfg.consensus_every, stop_check_every=cfg.stop_check_every,
            comm_dtype=cfg.comm_dtype, error_feedback=cfg.error_feedback,
            broadcast_initial=False, **cfg.method_options,
            **({"score_fn": self._leader_score_fn()} if cfg.algorithm == "lsgd" else {}))
        self.flat, self.rule = self.method.flat, self.method.rule
        attrs = {
            "schema_version": SCHEMA_VERSION, "rank": self.rank, "world_size": self.size,
            "local_rank": self.groups.local_rank, "node_index": self.groups.node_index,
            "n_nodes": self.groups.n_nodes, "hostname": socket.gethostname(),
            "algorithm": cfg.algorithm, "config": encode_config(resolved),
            "lsgd_hpc_version": __version__, "git_sha": shared["git_sha"],
            "torch_version": torch.__version__, "mpi_library": _mpi_library(),
            "slurm_job_id": env.get("SLURM_JOB_ID", ""), "start_time": shared["start_time"],
        }
        attrs.update(_launch_attrs(cfg.backend, env))
        attrs.update(self.rule.file_attrs)
        extra = {g: dict(c) for g, c in self.rule.extra_columns.items()}
        if self.scaler is not None:
            extra.setdefault("train", {})["skipped_steps"] = "i8"
        if self.validation is not None:       # val_* beside every test_* column of /eval
            ev = extra.setdefault("eval", {})
            for c in ["test_loss", "test_accuracy"] + list(ev):
                if c.endswith(("test_loss", "test_accuracy")):
                    ev[c.replace("test_", "val_")] = "f8"
        self.metrics = MetricsWriter(rank_file(self.run_dir, self.rank), attrs,
                                     cfg.flush_every, cfg.flush_seconds, extra_columns=extra)
        self.method.set_metrics(self.metrics)
        self.watchdog = None
        if cfg.collective_timeout > 0:
            from lsgd_hpc.runtime.watchdog import Watchdog
            self.watchdog = Watchdog(cfg.collective_timeout, self.run_dir, self.rank,
                                     abort=lambda: world.abort(1),
                                     on_stall=lambda report: self.metrics.flush()).start()
        return self

    def _leader_score_fn(self):
        """LSGD's score at elections for --leader-score heldout, else None (the window)."""
        if self.heldout is None:
            return None
        return heldout_score_fn(self.model, self.heldout, self.world, self.device,
                                self.cfg.eval_batch_size)

    def _log(self, group: str, **row) -> None:
        self.metrics.log(group, **row)

    # -- time --------------------------------------------------------------------------------
    def wall(self) -> float:
        return self.elapsed0 + time.perf_counter() - self.t_start

    def training_time(self, wall: Optional[float] = None) -> float:
        """Wall time (now, or ``wall``) less what measures the training rather than doing
        it: test evaluations (with BatchNorm recomputes and the progress line), consensus
        probes, checkpoints and metric flushes. Control traffic (the stop-flag agreement)
        stays in."""
        return ((self.wall() if wall is None else wall) - self.eval_seconds - self.checkpoint_seconds
                - self.metrics_seconds - self.world.stats.probe_seconds)

    def _flush_metrics(self, force: bool = False) -> None:
        t0 = time.perf_counter()
        if force:
            self.metrics.flush()
        else:
            self.metrics.maybe_flush()
        self.metrics_seconds += time.perf_counter() - t0

    # -- main loop ---------------------------------------------------------------------------
    def run(self) -> int:
        from lsgd_hpc.cli import config
        torch, cfg = self.torch, self.cfg
        self.t_start = time.perf_counter()
        if self.pointer is not None:
            self._restore(self.pointer)
        else:
            self._start_fresh()
        self._flush_metrics(force=True)
        t_print, step_print = time.perf_counter(), self.step
        loss_fn = torch.nn.CrossEntropyLoss()
        self.model.train()
        if self.rank == 0:
            print(f"[lsgd_hpc] {cfg.algorithm} on {self.size} ranks / {self.groups.n_nodes} "
                  f"node(s), {cfg.dataset} ({self.resolved['model']}), {self.total_steps} steps "
                  f"({self.spe}/epoch), run dir {self.run_dir}"
                  + (f", resumed at step {self.step}" if self.pointer else ""), flush=True)
            if cfg.preset:
                print(f"[lsgd_hpc] {cfg.dataset} preset for {cfg.algorithm}: "
                      + ", ".join(f"{k}={v}" for k, v in cfg.preset.items())
                      + " (--no-preset: the library's defaults)", flush=True)
            if self.pointer and self.pointer.get("skipped"):
                print(f"[lsgd_hpc] newer checkpoint set(s) at step(s) "
                      f"{', '.join(map(str, self.pointer['skipped']))} damaged or incomplete: "
                      f"resumed from the previous complete set", flush=True)
        # A method that owns its schedule ends training itself (ranks take uneven steps).
        owns = self.rule.owns_schedule
        last_step = math.inf if owns else self.total_steps
        method = self.method
        from lsgd_hpc.runtime.watchdog import MONITOR
        straggler = config.straggler_of(cfg)
        sleep_s = straggler[1] if straggler and straggler[0] == self.rank else 0.0
        MONITOR.step = self.step
        while self.step < last_step:
            epoch, start = divmod(self.step, self.spe)
            for xb, yb in self.sampler.batches(epoch, start):
                xb = xb.to(self.device, non_blocking=True)
                yb = yb.to(self.device, non_blocking=True)
                t0 = time.perf_counter()
                stats = self.world.stats
                comm0 = stats.seconds + stats.overhead_seconds + stats.probe_seconds
                lr = _lr_at(cfg, min(self.step, self.total_steps), self.total_steps)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                with torch.autocast(self.device.type, dtype=self.amp_dtype,
                                    enabled=self.amp_dtype is not None):
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
                MONITOR.step = self.step + 1
                loss_v = float(loss.detach())
                # the optimizer step and the method's communication (with the consensus
                # probe between the two, at the same point of every method's cycle)
                method.step(loss_v, scaler=self.scaler)
                self.step = method.steps
                self.compute_seconds += (time.perf_counter() - t0) - (
                    stats.seconds + stats.overhead_seconds + stats.probe_seconds - comm0)
                self.losses_since_print.append(loss_v)
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    acc = float((out.argmax(1) == yb).float().mean())
                    self._log_train(loss_v, acc, lr)
                if self.step % cfg.eval_every == 0 or self.step == self.total_steps:
                    t_eval = time.perf_counter()
                    test_acc = self.evaluate()
                    if self.rank == 0:
                        now = time.perf_counter()
                        self._print_line(test_acc, (self.step - step_print) / max(now - t_print, 1e-9))
                        t_print, step_print = now, self.step
                    self.eval_seconds += time.perf_counter() - t_eval
                # what the method agreed on after this step (the same on every rank)
                if method.checkpoint_due:
                    self.save_checkpoint()
                if method.stopping:
                    return self._preempted()
                if method.done:
                    last_step = self.step
                self._flush_metrics()
                if self.step >= last_step:
                    break
        method.drain()
        if owns and self.step != self.total_steps:   # the last step's rows (uneven steps)
            if self.step % cfg.log_every:
                self._log_train(loss_v, float((out.argmax(1) == yb).float().mean()), lr)
            if self.step % cfg.eval_every:
                t_eval = time.perf_counter()
                self.evaluate()
                self.eval_seconds += time.perf_counter() - t_eval
        self.save_checkpoint()                # flushes the metrics too
        if self.rank == 0:
            print(f"[lsgd_hpc] done: {self.step} steps in {self.wall():.1f} s; metrics in "
                  f"{os.path.join(self.run_dir, 'metrics')}", flush=True)
        if self.watchdog is not None:
            self.watchdog.stop()
        self.groups.free()
        return 0

    def _start_fresh(self) -> None:
        if self.rank == 0:
            os.makedirs(self.run_dir, exist_ok=True)
            path = os.path.join(self.run_dir, "config.yaml")
            if not os.path.exists(path):
                import yaml
                with open(path, "w") as fh:
                    yaml.safe_dump(self.resolved, fh, sort_keys=True)
        # the common x_0, whatever the init's determinism; EASGD's centre and similar
        # copies of x_0 are taken from it
        self.method.broadcast_initial()

    def _log_train(self, loss: float, acc: float, lr: float) -> None:
        s, wall = self.world.stats, self.wall()
        self._log("train", step=self.step, epoch=self.step / self.spe, wall_time=wall,
                  loss=loss, accuracy=acc, lr=lr, comm_bytes_sent=s.bytes_sent,
                  comm_bytes_recv=s.bytes_recv, comm_seconds=s.seconds,
                  compute_seconds=self.compute_seconds, overhead_seconds=s.overhead_seconds,
                  probe_seconds=s.probe_seconds, eval_seconds=self.eval_seconds,
                  checkpoint_seconds=self.checkpoint_seconds,
                  metrics_seconds=self.metrics_seconds, training_time=self.training_time(wall),
                  **self.rule.train_columns(),
                  **({"skipped_steps": self.method.skipped_steps} if self.scaler else {}))

    def _print_line(self, test_acc: float, steps_per_s: float) -> None:
        losses, self.losses_since_print = self.losses_since_print, []
        loss = sum(losses) / max(1, len(losses))
        leader = getattr(self.rule, "last_global", None)
        lead = f"leader {leader.world_rank} ({leader.score:.3f})" if leader else "leader -"
        samples = steps_per_s * self.cfg.batch_size * self.size
        eta = (self.total_steps - self.step) / max(steps_per_s, 1e-9)
        print(f"step {self.step:>7d}/{self.total_steps} | epoch {self.step / self.spe:6.2f} | "
              f"loss {loss:.4f} | test acc {100 * test_acc:5.2f}% | {lead} | "
              f"{samples:,.0f} samples/s | ETA {_fmt_eta(eta)}", flush=True)

    # -- evaluation --------------------------------------------------------------------------
    def _eval_current(self, batches=None):
        """(mean loss, accuracy) of the current model on the test set, or on ``batches``."""
        torch = self.torch
        self.model.eval()
        total, correct, loss_sum = 0, 0, 0.0
        with torch.no_grad():
            for xb, yb in batches or self.ds.test_batches(self.cfg.eval_batch_size):
                xb, yb = xb.to(self.device), yb.to(self.device)
                out = self.model(xb)
                loss_sum += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
                correct += int((out.argmax(1) == yb).sum())
                total += len(yb)
        self.model.train()
        return loss_sum / total, correct / total

    def evaluate(self) -> float:
        wall = self.wall()
        row = dict(step=self.step, epoch=self.step / self.spe, wall_time=wall,
                   training_time=self.training_time(wall))
        row["test_loss"], row["test_accuracy"] = self._eval_current()
        if self.validation is not None:
            row["val_loss"], row["val_accuracy"] = self._eval_current(self._val_batches())
        extra = self.rule.eval_models()
        if extra:
            from lsgd_hpc.models.batchnorm import int_buffers, recompute_bn_stats
            saved = self.flat.flat.clone()
            saved_ints = [b.clone() for b in int_buffers(self.model)]
            for name, vec in extra.items():
                self.flat.flat.copy_(vec)
                if self.bn_batches:   # no worker trained this model: its own statistics
                    recompute_bn_stats(self.model, self._bn_inputs())
                row[f"{name}_test_loss"], row[f"{name}_test_accuracy"] = self._eval_current()
                if self.validation is not None:
                    row[f"{name}_val_loss"], row[f"{name}_val_accuracy"] = \
                        self._eval_current(self._val_batches())
            # the worker's own parameters and statistics, untouched by the above
            self.flat.flat.copy_(saved)
            for b, v in zip(int_buffers(self.model), saved_ints):
                b.copy_(v)
        self._log("eval", **row)
        return row["test_accuracy"]

    def _val_batches(self):
        x, y = self.validation
        b = self.cfg.eval_batch_size
        return [(x[i:i + b], y[i:i + b]) for i in range(0, len(y), b)]

    def _bn_inputs(self):
        """The first ``bn_batches`` training inputs of this rank from the current epoch on
        (read from the sampler, whose order and state the training does not share)."""
        epoch, n = self.step // self.spe, 0
        while n < self.bn_batches:
            for xb, _ in self.sampler.batches(epoch, 0):
                if n == self.bn_batches:
                    return
                n += 1
                yield xb.to(self.device)
            epoch += 1

    # -- preemption and checkpoints -----------------------------------------------------------
    def _preempted(self) -> int:
        from lsgd_hpc.methods.rules import uncounted
        self.save_checkpoint()
        with uncounted(self.world):      # a time-limit warning on any rank: requeue
            warned = self.world.any_true(self.stop.warned)
        requeued = False
        if self.rank == 0:
            print(f"[lsgd_hpc] stop requested: checkpoint at step {self.step} in "
                  f"{self.run_dir}/checkpoints", flush=True)
            if self.env.get("SLURM_JOB_ID") and warned:
                requeued = _requeue(self.env)
            elif self.env.get("SLURM_JOB_ID"):
                print("[lsgd_hpc] SIGTERM: SLURM requeues a preempted job itself; "
                      "a cancelled one stays cancelled", flush=True)
            else:
                print(f"[lsgd_hpc] continue with: --resume --run-dir {self.run_dir}", flush=True)
        requeued = self.world.allgather_object(requeued)[0]
        return 0 if requeued else EXIT_STOPPED

    def save_checkpoint(self) -> None:
        t0 = time.perf_counter()
        self._save_checkpoint()
        self.checkpoint_seconds += time.perf_counter() - t0

    def _save_checkpoint(self) -> None:
        torch = self.torch
        state = {
            "step": self.step, "world_size": self.size,
            "flat": self.flat.flat.clone(), "optimizer": self.opt.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else {},
            "algorithm": self.method.state_dict(), "torch_rng": torch.get_rng_state(),
            "cuda_rng": (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda"
                         else torch.empty(0, dtype=torch.uint8)),
            "comm_stats": self.world.stats.state_dict(), "wall_time": self.wall(),
            "compute_seconds": self.compute_seconds, "metrics_rows": self.metrics.row_counts(),
            "eval_seconds": self.eval_seconds, "checkpoint_seconds": self.checkpoint_seconds,
            "metrics_seconds": self.metrics_seconds,
        }
        # The set's label: the step, or, where ranks take uneven steps, the largest one (each
        # rank's own step is in its file).
        label = self.step
        if self.rule.owns_schedule:
            label = max(self.world.allgather_object(self.step))
        self.ckpt.save_rank(self.run_dir, label, self.rank, state)
        self.metrics.flush()                 # rows up to this step are on disk before the pointer
        self.world.barrier()
        if self.rank == 0:
            self.ckpt.commit_set(self.run_dir, label, self.size)
        self.world.barrier()

    def _restore(self, pointer: dict) -> None:
        if int(pointer["world_size"]) != self.size:
            raise RuntimeError(f"checkpoint was written by {pointer['world_size']} ranks, "
                               f"this job has {self.size}")
        state = self.ckpt.load_rank(self.run_dir, int(pointer["step"]), self.rank)
        self.step = int(state["step"])
        self.flat.flat.copy_(state["flat"])
        self.opt.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.method.load_state_dict(state["algorithm"])
        self.torch.set_rng_state(state["torch_rng"])
        if self.device.type == "cuda" and state["cuda_rng"].numel():
            self.torch.cuda.set_rng_state(state["cuda_rng"], self.device)
        self.world.stats.load_state_dict(state["comm_stats"])
        self.elapsed0 = float(state["wall_time"])
        self.compute_seconds = float(state["compute_seconds"])
        for name in ("eval_seconds", "checkpoint_seconds", "metrics_seconds"):
            setattr(self, name, float(state.get(name, 0.0)))
        self.metrics.load_existing(state["metrics_rows"])


def _validation_split(cfg, ds):
    """``(training set, validation slice)``: with --validation-size N, N training samples (the
    same on every rank, drawn from --seed) taken out of training and returned as normalized
    ``(x, y)`` for the evaluations' val_loss and val_accuracy; otherwise ``(ds, None)``."""
    if not getattr(cfg, "validation_size", 0):
        return ds, None
    from lsgd_hpc.data.datasets import split_validation
    train, idx = split_validation(ds, cfg.validation_size, cfg.seed)
    return train, (ds.normalize(ds.x_train[idx]), ds.y_train[idx])


def _heldout_split(cfg, ds):
    """``(training set, held-out slice)``: with --leader-score heldout, the slice (the same
    samples on every rank, drawn from --seed) is taken out of the training set and returned
    as normalized ``(x, y)``; otherwise ``(ds, None)``."""
    if getattr(cfg, "leader_score", "train") != "heldout":
        return ds, None
    from lsgd_hpc.data.datasets import default_heldout_size, split_heldout
    size = cfg.heldout_size if cfg.heldout_size is not None else default_heldout_size(ds.n_train)
    train, idx = split_heldout(ds, size, cfg.seed)
    return train, (ds.normalize(ds.x_train[idx]), ds.y_train[idx])


def heldout_score_fn(model, heldout, world, device, batch_size: int):
    """LSGD's election score under --leader-score heldout: the model's mean cross-entropy on
    the held-out slice (eval mode, no gradient; BatchNorm statistics untouched). Its time is
    booked as measurement (probe_seconds), left out of the training time."""
    import torch
    from lsgd_hpc.methods.rules import uncounted
    x, y = heldout[0].to(device), heldout[1].to(device)

    def score() -> float:
        with uncounted(world, probe=True), torch.no_grad():
            was_training = model.training
            model.eval()
            total = 0.0
            for i in range(0, len(y), batch_size):
                out = model(x[i:i + batch_size])
                total += float(torch.nn.functional.cross_entropy(out, y[i:i + batch_size],
                                                                 reduction="sum"))
            model.train(was_training)
        return total / len(y)
    return score


def make_optimizer(cfg, params):
    """The worker's own optimizer over the model's parameters (the method steps it).

    sgd: with momentum mu and weight decay wd,
        g <- g + wd x;   b <- mu b + g;   x <- x - lr (g + mu b)  (Nesterov)  or  x - lr b,
    Nesterov's form being the reference LSGD's choice whenever mu > 0 (--nesterov).
    adamw: AdamW (decoupled weight decay wd) with betas (--momentum, 0.999)."""
    import torch
    if getattr(cfg, "optimizer", "sgd") == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.momentum, 0.999),
                                 weight_decay=cfg.weight_decay)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay, nesterov=bool(cfg.nesterov))


def _device(kind: str, rank: int, env: dict):
    """cpu, or the GPU of this rank: its node-local rank modulo the node's GPU count (the
    launcher's local rank; SLURM's, Open MPI's or MPICH's variable, else the world rank)."""
    import torch
    if kind != "cuda":
        return torch.device("cpu")
    from lsgd_hpc.runtime.launcher import local_rank
    local = local_rank(env)
    local = rank if local is None else local
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _launch_attrs(backend: str, env: dict) -> dict:
    """``launcher`` (torchrun, mpirun, srun, '' alone) and, for --backend torch, the
    ``rendezvous`` host:port every rank joined (MASTER_ADDR/PORT, srun's derived ones, or
    rank 0's under mpirun)."""
    from lsgd_hpc.runtime import launcher
    out = {"launcher": launcher.detect(env).launcher or "", "rendezvous": ""}
    if backend == "torch":
        from lsgd_hpc.comm.torchdist import RENDEZVOUS
        out["launcher"] = RENDEZVOUS.get("launcher", out["launcher"])
        if RENDEZVOUS.get("host"):
            out["rendezvous"] = f"{RENDEZVOUS['host']}:{RENDEZVOUS['port']}"
    return out


def _mpi_library() -> str:
    """The MPI library in use; '' when this process never started MPI (--backend torch under
    torchrun or srun)."""
    if "mpi4py.MPI" not in sys.modules:
        return ""
    from lsgd_hpc.comm.mpi import mpi_library
    return mpi_library()


def _exit_together(code: int) -> None:
    """Leave at once after an agreed usage error: every rank has the same status, but under
    ``srun --kill-on-bad-exit`` the first rank to exit with it gets the others killed while
    they still tear down the interpreter, and the step then reports the kill (143), not 2."""
    from mpi4py import MPI
    if MPI.Is_initialized() and not MPI.Is_finalized():
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.Finalize()
        os._exit(code)


def _close_torch_world(code: int) -> None:
    """--backend torch: leave the process group together (a barrier, then destroy it), so that
    no rank's gloo threads see a peer's connections close under them while the interpreter
    tears down (they abort the process: SIGABRT instead of the agreed status)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    from lsgd_hpc.comm.torchdist import _leave_world
    _leave_world()          # a barrier, destroy; rank 0 (the TCP store's server) leaves last
    if "mpi4py.MPI" not in sys.modules:
        # Everything is on disk (metrics flushed, checkpoints committed): leave now. The
        # interpreter's teardown can still destroy a c10d thread that is joinable, which
        # aborts the process ("terminate called without an active exception", SIGABRT; seen
        # once in CI on the emulated cluster) and turns a finished job into a failed one.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_as_main() -> None:
    """``python -m lsgd_hpc.train``: run, close the world, exit with the status."""
    status = main()
    _close_torch_world(status)
    if status == EXIT_USAGE and "mpi4py.MPI" in sys.modules:
        _exit_together(status)
    sys.exit(status)


if __name__ == "__main__":
    run_as_main()
