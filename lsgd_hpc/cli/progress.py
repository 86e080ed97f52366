"""What rank 0 of the trainer prints: one line at the start (and the preset taken), one per
evaluation interval, one at the end; no progress bars, so batch logs stay readable."""

from __future__ import annotations

import datetime as _dt
from typing import List, Optional

__all__ = ["Progress"]


class Progress:
    """Rank 0's lines of one run (every call is a no-op on other ranks). After lost ranks
    (--on-failure shrink) rank 0 is the lowest survivor, which takes the lines over."""

    def __init__(self, trainer):
        self.t = trainer
        self.losses: List[float] = []
        self.t_last: Optional[float] = None
        self.step_last = 0

    @property
    def on(self) -> bool:
        return self.t.comm.rank == 0

    def start(self, resumed: Optional[int], skipped, now: float, step: int) -> None:
        t, cfg = self.t, self.t.cfg
        self.t_last, self.step_last = now, step
        if not self.on:
            return
        print(f"[lsgd_hpc] {cfg.algorithm} on {t.size} ranks / {t.comm.n_nodes} node(s), "
              f"{cfg.dataset} ({t.model_name}), {t.total_steps} steps ({t.spe}/epoch), run dir "
              f"{t.run_dir}" + (f", resumed at step {step}" if resumed is not None else ""),
              flush=True)
        if cfg.preset:
            print(f"[lsgd_hpc] {cfg.dataset} preset for {cfg.algorithm}: "
                  + ", ".join(f"{k}={v}" for k, v in cfg.preset.items())
                  + " (--no-preset: the library's defaults)", flush=True)
        if resumed is not None and skipped:
            print(f"[lsgd_hpc] newer checkpoint set(s) at step(s) "
                  f"{', '.join(map(str, skipped))} damaged or incomplete: "
                  f"resumed from the previous complete set", flush=True)

    def evaluated(self, step: int, test_acc: float, now: float) -> None:
        """The line of an evaluation interval: mean loss since the last one, test accuracy,
        the global leader, throughput and the time left."""
        t = self.t
        losses, self.losses = self.losses, []
        steps_per_s = (step - self.step_last) / max(now - self.t_last, 1e-9)
        self.t_last, self.step_last = now, step
        if not self.on:
            return
        loss = sum(losses) / max(1, len(losses))
        leader = getattr(t.rule, "last_global", None)
        # (ranks as numbered at the start: after lost ranks they are renumbered)
        lead = (f"leader {t.comm.initial_ranks[leader.world_rank]} ({leader.score:.3f})"
                if leader else "leader -")
        samples = steps_per_s * t.cfg.batch_size * t.comm.size
        eta = _dt.timedelta(seconds=int(max(0, (t.total_steps - step) / max(steps_per_s, 1e-9))))
        print(f"step {step:>7d}/{t.total_steps} | epoch {t.batches.epoch_of(step):6.2f} | "
              f"loss {loss:.4f} | test acc {100 * test_acc:5.2f}% | {lead} | "
              f"{samples:,.0f} samples/s | ETA {eta}", flush=True)

    def done(self, step: int, seconds: float, metrics_dir: str) -> None:
        if self.on:
            print(f"[lsgd_hpc] done: {step} steps in {seconds:.1f} s; metrics in {metrics_dir}",
                  flush=True)
