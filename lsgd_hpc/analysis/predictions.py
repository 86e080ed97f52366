"""Predicted against measured: a table of predictions joined onto aggregate's groups, rank
correlations of each predictor with each measured group figure, and one scatter plot each.

A predictions table has the grouping keys (aggregate's ``--by`` keys) as its first columns and
one column per predictor after them, e.g.::

    topology,world_size,spectral_gap,effective_neighbors,predicted_time_to_target_loss
    ring,8,0.1464,2.9,41.0

A row applies to the group whose key values are equal (numbers compared as numbers, text
case-insensitively: ``8``, ``8.0`` and ``"8"`` are one value). The measured side of a group is
the mean over its runs of a per-run summary figure (groups.csv's ``<figure>_mean``).

Units: a predictor named ``predicted_<figure>`` is in the unit of that measured figure and is
always plotted against it; otherwise its unit is read from its name's suffix (``_time``,
``_seconds`` or ``_s``: seconds; ``_steps``; ``_bytes``) and none is assumed without one (a
spectral gap, a number of neighbours). The plots draw y = x when both sides have one unit.
"""

from __future__ import annotations

import csv
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from lsgd_hpc.analysis.stats import rank_correlation

__all__ = ["PredictionsError", "CORRELATION_COLUMNS", "read_predictions", "join_predictions",
           "correlation_table", "measured_unit", "predictor_unit", "default_plot_measured",
           "plot_predicted_vs_measured"]

CORRELATION_COLUMNS = ("predictor", "measured", "n_groups", "spearman", "kendall")

#: measured group figures plotted against predictors without a ``predicted_`` name, in order
#: of preference, when the caller names none: the first one that varies between groups
PLOT_MEASURED_PREFERENCE = ("time_to_target_loss", "time_to_target_acc", "training_time")

_UNIT_OF_FIGURE = (("time_to_target", "s"), ("training_time", "s"), ("wall_time", "s"),
                   ("steps", "steps"), ("bytes", "B"), ("test_acc", "fraction"))
_UNIT_OF_SUFFIX = (("_time", "s"), ("_seconds", "s"), ("_s", "s"), ("_steps", "steps"),
                   ("_bytes", "B"))


class PredictionsError(ValueError):
    """A predictions table that cannot be joined (missing key columns, unreadable)."""


def measured_unit(figure: str) -> str | None:
    """Unit of a measured group figure: 's', 'steps', 'B', 'fraction', or None (a consensus
    distance: squared parameter distance, no unit of its own)."""
    for part, unit in _UNIT_OF_FIGURE:
        if part in figure:
            return unit
    return None


def predictor_unit(name: str) -> str | None:
    """Unit of a predictor from its name (module docstring); None when the name gives none."""
    if name.startswith("predicted_") and measured_unit(name[len("predicted_"):]):
        return measured_unit(name[len("predicted_"):])
    for suffix, unit in _UNIT_OF_SUFFIX:
        if name.endswith(suffix):
            return unit
    return None


def read_predictions(path: str | os.PathLike) -> list[dict]:
    """The rows of a predictions CSV (header first) as dicts of strings."""
    try:
        with open(path, newline="") as fh:
            rows = list(csv.DictReader(fh))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise PredictionsError(f"cannot read predictions {path}: {exc}") from None
    if not rows:
        raise PredictionsError(f"predictions {path}: no rows under the header")
    return rows


def _norm(value: Any) -> str:
    """Key value as compared in a join: numbers as numbers, text case-insensitively."""
    if value is None:
        return ""
    text = str(value).strip()
    try:
        x = float(text)
    except ValueError:
        return text.lower()
    return str(int(x)) if x.is_integer() else repr(x)


def _number(value: Any) -> float | None:
    """A predictor cell as a float; NaN for an empty cell, None when it is not a number."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def join_predictions(group_rows: Sequence[dict], predictions: Sequence[dict],
                     by: Sequence[str], warn: Callable[[str], None]) -> tuple[list[str],
                                                                             list[dict]]:
    """Join predictions onto groups.csv rows on the ``by`` columns.

    Returns (predictors, rows): predictors are the prediction columns other than ``by`` whose
    cells are all numbers or empty (any other column is warned about and left out); rows are
    the group rows, each with the predictors' values added (NaN where the group has no
    prediction). A prediction row that matches no group, a second row for one key, and a group
    without a prediction are each warned about. Raises PredictionsError when a ``by`` column
    is missing from the predictions."""
    by = list(by)
    columns: list[str] = []
    for row in predictions:
        columns += [c for c in row if c not in columns]
    missing = [k for k in by if k not in columns]
    if missing:
        raise PredictionsError(f"predictions lack the grouping column(s) {', '.join(missing)} "
                               f"(their columns: {', '.join(columns)})")
    predictors = []
    for c in columns:
        if c in by:
            continue
        bad = [row.get(c) for row in predictions if _number(row.get(c)) is None]
        if bad:
            warn(f"predictions column {c!r} left out: not a number ({bad[0]!r})")
        else:
            predictors.append(c)
    table: dict[tuple[str, ...], dict] = {}
    for i, row in enumerate(predictions, 1):
        key = tuple(_norm(row.get(k)) for k in by)
        if key in table:
            warn(f"predictions row {i} repeats {_key_text(by, key)}; the first row is used")
            continue
        table[key] = row
    used: set[tuple[str, ...]] = set()
    joined = []
    for g in group_rows:
        key = tuple(_norm(g.get(k)) for k in by)
        pred = table.get(key)
        if pred is None:
            warn(f"group {g.get('group', _key_text(by, key))!r} has no row in the predictions")
        else:
            used.add(key)
        joined.append({**g, **{p: (_number(pred.get(p)) if pred else math.nan)
                               for p in predictors}})
    for key in table:
        if key not in used:
            warn(f"predictions row {_key_text(by, key)} matches no group; ignored")
    return predictors, joined


def _key_text(by: Sequence[str], key: Sequence[str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in zip(by, key))


def _column(rows: Sequence[dict], name: str) -> np.ndarray:
    return np.asarray([math.nan if r.get(name) is None else float(r[name]) for r in rows],
                      dtype=float)


def _varies(values: np.ndarray) -> bool:
    finite = values[np.isfinite(values)]
    return len(np.unique(finite)) >= 2


def correlation_table(rows: Sequence[dict], predictors: Sequence[str],
                      figures: Iterable[str]) -> list[dict]:
    """correlations.csv: for each predictor and each measured figure whose group means
    (``<figure>_mean``) take at least two different values, the rank correlation over the
    groups that have both values: n_groups, Spearman's rho and Kendall's tau-b
    (lsgd_hpc.stats.rank_correlation; NaN when undefined, e.g. a constant predictor)."""
    out = []
    measured = [f for f in figures if _varies(_column(rows, f"{f}_mean"))]
    for p in predictors:
        x = _column(rows, p)
        for f in measured:
            y = _column(rows, f"{f}_mean")
            both = np.isfinite(x) & np.isfinite(y)
            # rounded: scipy's 0.9999999999999999 for a perfect ordering reads as 1.0
            out.append({"predictor": p, "measured": f, "n_groups": int(both.sum()),
                        "spearman": round(rank_correlation(x, y, "spearman"), 12),
                        "kendall": round(rank_correlation(x, y, "kendall"), 12)})
    return out


def default_plot_measured(rows: Sequence[dict]) -> list[str]:
    """The first of PLOT_MEASURED_PREFERENCE whose group means vary (none when none does)."""
    for f in PLOT_MEASURED_PREFERENCE:
        if _varies(_column(rows, f"{f}_mean")):
            return [f]
    return []


def _label(name: str, unit: str | None) -> str:
    return f"{name} ({unit})" if unit else name


def _log_worthy(values: np.ndarray) -> bool:
    v = values[np.isfinite(values)]
    return len(v) >= 2 and bool(np.all(v > 0)) and float(v.max() / v.min()) >= 20


def plot_predicted_vs_measured(rows: Sequence[dict], predictor: str, figure: str,
                               out_dir: str | os.PathLike) -> Path | None:
    """Scatter of the groups: x the predictor, y the measured figure's mean over the group's
    runs with a min-max bar, each point labelled with the group's name; y = x when both have
    one unit; the title gives both rank correlations. None when no group has both values."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = _column(rows, predictor)
    y, lo, hi = (_column(rows, f"{figure}_{st}") for st in ("mean", "min", "max"))
    ok = np.isfinite(x) & np.isfinite(y)
    if not ok.any():
        return None
    names = [str(r.get("group", "")) for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 5.2), dpi=120)
    yerr = np.vstack([np.where(np.isfinite(lo), y - lo, 0.0), np.where(np.isfinite(hi), hi - y,
                                                                       0.0)])[:, ok]
    ax.errorbar(x[ok], y[ok], yerr=yerr, fmt="o", color="C0", ms=6, capsize=3, lw=1,
                label="group: mean over its runs, bar min-max")
    for xi, yi, name in zip(x[ok], y[ok], (n for n, k in zip(names, ok) if k)):
        ax.annotate(name, (xi, yi), textcoords="offset points", xytext=(5, 4), fontsize=8)
    p_unit, m_unit = predictor_unit(predictor), measured_unit(figure)
    same_unit = p_unit is not None and p_unit == m_unit
    if same_unit:
        both = np.concatenate([x[ok], y[ok]])
        span = np.array([both.min(), both.max()])
        ax.plot(span, span, ls="--", color="0.4", lw=1, label="y = x (prediction exact)")
        # one scale for both axes, so that y = x is the diagonal it looks like
        log_x = log_y = _log_worthy(both)
    else:
        log_x = _log_worthy(x[ok])
        log_y = _log_worthy(np.concatenate([y[ok], lo[ok & np.isfinite(lo)]]))
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    rho = rank_correlation(x, y, "spearman")
    tau = rank_correlation(x, y, "kendall")
    ax.set_xlabel(_label(predictor, p_unit))
    ax.set_ylabel(_label(f"{figure}, measured", m_unit))
    ax.set_title(f"measured {figure} against {predictor}\nSpearman rho = {rho:+.2f}, "
                 f"Kendall tau-b = {tau:+.2f} over {int(ok.sum())} groups", fontsize=10)
    ax.margins(x=0.15, y=0.1)            # room for the point labels
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"pred_{predictor}_vs_{figure}")
    path = Path(out_dir) / f"{safe}.png"
    fig.savefig(path)
    plt.close(fig)
    return path
