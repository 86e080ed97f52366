"""Runs grouped for the tables and plots: by configuration minus the seed, or by chosen
config keys (group_runs), and groups.csv, each figure summarised over a group's runs
(group_table)."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from lsgd_hpc.analysis.rundir import NON_CONFIG_KEYS, AggregateError, Run, canonical
from lsgd_hpc.analysis.tables import Targets

__all__ = ["DERIVED_KEYS", "GROUP_METRICS", "STATS", "RunGroup", "config_key", "group_runs",
           "group_metrics", "group_columns", "group_table"]

# Derived from other options (epochs, batch size, world size, max steps): never a label.
DERIVED_KEYS = frozenset({"steps_per_epoch", "total_steps"})


def config_key(config: dict) -> str:
    """The configuration a run belongs to: its config minus seed and NON_CONFIG_KEYS."""
    return json.dumps({k: v for k, v in config.items() if k not in NON_CONFIG_KEYS},
                      sort_keys=True, default=str)


@dataclass
class RunGroup:
    """Runs drawn as one line: by default runs of one configuration (differing only in seed),
    with ``by`` the runs that share the values of the ``by`` config keys."""
    key: str
    config: dict            # the configuration (config minus NON_CONFIG_KEYS), or the by keys
    runs: list[Run]
    label: str = ""         # legend entry (wrapped, with the number of runs)
    name: str = ""          # one line: the group column of groups.csv
    values: dict = field(default_factory=dict)   # key columns of groups.csv -> value
    by: tuple[str, ...] | None = None

    @property
    def seeds(self) -> list:
        return [r.seed for r in self.runs]


def _short(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _check_by(runs: list[Run], by: Iterable[str]) -> tuple[str, ...]:
    by = tuple(by)
    if not by:
        raise AggregateError("--by needs at least one config key")
    known = sorted({k for r in runs for k in r.config})
    missing = [k for k in by if not any(k in r.config for r in runs)]
    if missing:
        raise AggregateError(f"--by {','.join(missing)}: not a key of any run's config.yaml "
                             f"(keys: {', '.join(known)})")
    return by


def _name(values: dict) -> str:
    return " ".join(_short(v) if k == "algorithm" else f"{k}={_short(v)}"
                    for k, v in values.items())


def group_runs(runs: list[Run], by: Iterable[str] | None = None) -> list[RunGroup]:
    """Group runs (first-appearance order).

    Without ``by``: by configuration (``config_key``: config minus the seed and NON_CONFIG_KEYS);
    a group is named by its algorithm plus the options that differ between the groups.
    With ``by`` (config keys, e.g. ``("topology", "world_size")``): by the values of those keys
    only, whatever else differs; a group is named by those values ("algorithm" by its value
    alone, the others as key=value). Raises AggregateError for a key no run's config has."""
    by = _check_by(runs, by) if by is not None else None
    groups: dict[str, RunGroup] = {}
    for run in runs:
        if by is None:
            key = config_key(run.config)
            cfg = {k: v for k, v in run.config.items() if k not in NON_CONFIG_KEYS}
        else:
            cfg = {k: run.config.get(k) for k in by}
            key = canonical([cfg[k] for k in by])
        if key not in groups:
            groups[key] = RunGroup(key=key, config=cfg, runs=[], by=by)
        groups[key].runs.append(run)
    out = list(groups.values())
    if by is None:
        keys = sorted({k for g in out for k in g.config} - {"algorithm"} - DERIVED_KEYS)
        differing = [k for k in keys if len({canonical(g.config.get(k)) for g in out}) > 1]
    for g in out:
        if by is None:
            alg = str(g.config.get("algorithm") or g.runs[0].algorithm)
            g.values = {"algorithm": alg, **{k: g.config.get(k) for k in differing}}
        else:
            g.values = dict(g.config)
        g.name = _name(g.values)
        g.label = textwrap.fill(g.name, width=60, subsequent_indent="  ")
        if len(g.runs) > 1:
            g.label += f" ({len(g.runs)} {'seeds' if by is None else 'runs'})"
    return out


#: Per-run summary columns that groups.csv summarises over each group's runs (mean, std, min,
#: max), before the target columns of the targets given.
GROUP_METRICS = ("final_test_acc_leader", "final_test_acc_mean", "training_time",
                 "total_bytes_sent", "total_bytes_recv", "steps", "final_consensus_distance",
                 "mean_consensus_distance")
STATS = ("mean", "std", "min", "max")


def group_metrics(targets: Targets | None = None) -> tuple[str, ...]:
    """The summary columns groups.csv summarises: GROUP_METRICS, then time, steps and bytes
    to each target given."""
    extra = tuple(c for c in (targets.columns() if targets else ())
                  if not c.startswith("target_"))
    return GROUP_METRICS + extra


def group_columns(groups: list[RunGroup], targets: Targets | None = None) -> list[str]:
    """groups.csv's columns: group (its name), the key columns (the --by keys, or algorithm
    plus the options that differ), n_runs, runs, then <metric>_<stat> for each metric of
    group_metrics and each stat of STATS, and n_reached_acc / n_reached_loss with targets."""
    keys: list[str] = []
    for g in groups:
        keys += [k for k in g.values if k not in keys]
    cols = ["group", *keys, "n_runs", "runs"]
    cols += [f"{m}_{st}" for m in group_metrics(targets) for st in STATS]
    if targets and targets.acc is not None:
        cols.append("n_reached_acc")
    if targets and targets.loss is not None:
        cols.append("n_reached_loss")
    return cols


def _stats(values: list) -> dict[str, float]:
    """mean, std (sample standard deviation, n - 1; NaN for one value), min, max over the
    finite values; NaN each when there is none."""
    a = np.asarray([v for v in values if v is not None], dtype=float)
    a = a[np.isfinite(a)]
    if not len(a):
        return {st: math.nan for st in STATS}
    return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if len(a) > 1 else math.nan,
            "min": float(a.min()), "max": float(a.max())}


def group_table(groups: list[RunGroup], summary: list[dict],
                targets: Targets | None = None) -> list[dict]:
    """groups.csv: one row per group (columns: group_columns) from the runs' summary rows
    (``summary`` in the order of the runs, as summarize_run returns them). A time to target
    is summarised over the runs that reached the target; n_reached_* says how many did."""
    by_run = {row["run"]: row for row in summary}
    out = []
    for g in groups:
        rows = [by_run[r.name] for r in g.runs]
        row: dict[str, Any] = {"group": g.name, **g.values, "n_runs": len(rows),
                               "runs": " ".join(r.name for r in g.runs)}
        for m in group_metrics(targets):
            for st, v in _stats([r.get(m) for r in rows]).items():
                row[f"{m}_{st}"] = v
        if targets and targets.acc is not None:
            row["n_reached_acc"] = sum(r.get("steps_to_target_acc") is not None for r in rows)
        if targets and targets.loss is not None:
            row["n_reached_loss"] = sum(r.get("steps_to_target_loss") is not None for r in rows)
        out.append(row)
    return out
