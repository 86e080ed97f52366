"""The aggregator's figures (matplotlib, Agg): one line per group of runs, the mean over its
runs with a min-max band (plot_all, the PLOTS)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from lsgd_hpc.analysis.groups import RunGroup, group_runs
from lsgd_hpc.analysis.rundir import Run, col
from lsgd_hpc.analysis.tables import Targets, eval_table

__all__ = ["PLOTS", "run_curve", "band", "plot_all"]

PLOTS = {
    "test_acc_vs_training_time.png": ("training_time", "test_accuracy"),
    "test_acc_vs_wall_time.png": ("wall_time", "test_accuracy"),
    "test_acc_vs_bytes_sent.png": ("bytes_sent", "test_accuracy"),
    "test_acc_vs_step.png": ("step", "test_accuracy"),
    "train_loss_vs_step.png": ("step", "train_loss"),
}


def run_curve(run: Run, x: str, y: str) -> tuple[np.ndarray, np.ndarray]:
    """One run's curve. y 'test_accuracy': per-evaluation mean over ranks against x in
    {'step', 'wall_time', 'training_time', 'bytes_sent'}. y 'train_loss': per-step mean over ranks
    against 'step'."""
    if y == "test_accuracy":
        tab = eval_table(run)
        xs, ys = tab[x].astype(float), tab["acc_mean"]
    elif y == "train_loss" and x == "step":
        acc: dict[int, list[float]] = {}
        for d in run.ranks.values():
            for s, v in zip(col(d, "train", "step", np.int64), col(d, "train", "loss")):
                acc.setdefault(int(s), []).append(float(v))
        xs = np.asarray(sorted(acc), dtype=float)
        ys = np.asarray([np.mean(acc[int(s)]) for s in xs], dtype=float)
    else:
        raise ValueError(f"no curve {y} against {x}")
    ok = np.isfinite(xs) & np.isfinite(ys)
    xs, ys = xs[ok], ys[ok]
    order = np.argsort(xs, kind="stable")
    return xs[order], ys[order]


def band(curves: list[tuple[np.ndarray, np.ndarray]]):
    """Mean, min and max over runs on the union of their x values; each run is linearly
    interpolated inside its own x range and left out beyond it."""
    curves = [(x, y) for x, y in curves if len(x)]
    if not curves:
        e = np.array([])
        return e, e, e, e
    grid = np.unique(np.concatenate([x for x, _ in curves]))
    stack = np.full((len(curves), len(grid)), np.nan)
    for i, (x, y) in enumerate(curves):
        inside = (grid >= x[0]) & (grid <= x[-1])
        stack[i, inside] = np.interp(grid[inside], x, y)
    return grid, np.nanmean(stack, 0), np.nanmin(stack, 0), np.nanmax(stack, 0)


def _smooth(y: np.ndarray, n_points: int) -> np.ndarray:
    """Centred moving average over about 1% of the points (loss per step is noisy)."""
    w = max(1, n_points // 100)
    if w < 3 or len(y) < 3 * w:
        return y
    kernel = np.ones(w) / w
    pad = np.concatenate([np.full(w // 2, y[0]), y, np.full(w - 1 - w // 2, y[-1])])
    return np.convolve(pad, kernel, mode="valid")


_XLABEL = {"step": "training step", "wall_time": "wall time (s)",
           "training_time": "training time (s): wall time less evaluation, probes, checkpoints",
           "bytes_sent": "bytes sent, all ranks together"}
_YLABEL = {"test_accuracy": "test accuracy (mean over ranks)",
           "train_loss": "training loss (mean over ranks)"}


def plot_all(runs: list[Run], out_dir: str | os.PathLike,
             groups: list[RunGroup] | None = None, targets: Targets | None = None) -> list[Path]:
    """The PLOTS: one line per group (mean over its runs) with a min-max band, and the target
    accuracy / loss as a dashed horizontal line when given."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter

    groups = groups if groups is not None else group_runs(runs)
    by = groups[0].by if groups else None
    out_dir = Path(out_dir)
    written = []
    for fname, (x, y) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7.5, 4.8), dpi=120)
        smoothed = False
        for i, g in enumerate(groups):
            color = f"C{i % 10}"
            gx, mean, lo, hi = band([run_curve(r, x, y) for r in g.runs])
            if not len(gx):
                continue
            if y == "train_loss" and _smooth(mean, len(gx)) is not mean:
                mean, lo, hi = (_smooth(a, len(gx)) for a in (mean, lo, hi))
                smoothed = True
            ax.plot(gx, mean, color=color, lw=1.6, label=g.label,
                    marker="o" if len(gx) <= 30 else None, ms=3)
            if len(g.runs) > 1:
                ax.fill_between(gx, lo, hi, color=color, alpha=0.2, lw=0)
        target = (targets.acc if y == "test_accuracy" else targets.loss) if targets else None
        if target is not None:
            ax.axhline(target, color="0.3", ls="--", lw=1,
                       label=f"target {'accuracy' if y == 'test_accuracy' else 'loss'} "
                             f"{target:g}")
        ax.set_xlabel(_XLABEL[x])
        ax.set_ylabel(_YLABEL[y][:-1] + ", smoothed)" if smoothed else _YLABEL[y])
        if x == "bytes_sent":
            ax.xaxis.set_major_formatter(EngFormatter(unit="B"))
        ax.set_title(f"{_YLABEL[y].split(' (')[0]} vs {_XLABEL[x].split(',')[0].split(' (')[0]}"
                     + (f"  (band: min-max over {'seeds' if by is None else 'runs'})"
                        if any(len(g.runs) > 1 for g in groups) else ""), fontsize=10)
        ax.grid(True, alpha=0.3)
        if groups:
            ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = out_dir / fname
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
