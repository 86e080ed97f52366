"""A run directory as the offline tools read it: its per-rank HDF5 files, checked, and the run
they belong to.

Rank files are skipped, each with one warning naming the file and why, when they are unreadable
(truncated, not HDF5), carry a ``schema_version`` not in KNOWN_SCHEMA_VERSIONS (or none), belong
to another run than most of the directory's files (``run_identities``: configuration and
chain of starts), or claim the rank of another file (the one named for the rank is kept).
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from lsgd_hpc.ranklists import parse_ranks
from lsgd_hpc.runtime.completion import STATUSES, read_completion
from lsgd_hpc.runtime.metrics import SCHEMA_VERSION, open_rank_file, rank_file

__all__ = ["GROUPS", "KNOWN_SCHEMA_VERSIONS", "NON_CONFIG_KEYS", "AggregateError", "Run",
           "read_rank_file", "col", "run_identities", "read_run", "expand_run_dirs", "read_runs",
           "canonical", "completion_state", "last_step", "describe_completion"]

GROUPS = ("train", "eval", "leader", "consensus", "faults")

#: schema versions whose meaning the readers know (docs/metrics.md, schema_version policy)
KNOWN_SCHEMA_VERSIONS = (SCHEMA_VERSION,)

# Config keys that name where/how a run was started, not what it trains: runs whose configs
# differ only in these keys (and the seed) are the same configuration.
NON_CONFIG_KEYS = frozenset({"seed", "run_dir", "resume", "config", "data_dir",
                             # bookkeeping that does not change what is trained
                             "flush_every", "flush_seconds", "log_every", "checkpoint_every",
                             "eval_batch_size"})


class AggregateError(Exception):
    """Bad input to the offline tools: reported as one line and exit status 2."""


def _warn(msg: str) -> None:
    print(f"lsgd_hpc: warning: {msg}", file=sys.stderr)


def _py(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _open_h5(path: Path):
    # readable while a trainer still appends to it, no HDF5 locking (a file flagged open for
    # write by an older writer: as a SWMR reader)
    return open_rank_file(path)


def read_rank_file(path: str | os.PathLike) -> dict:
    """Read one rank's HDF5 metrics file.

    Returns ``{"path", "rank", "attrs", "config", "train", "eval", "leader", "consensus",
    "faults"}`` (/faults: the recoveries from lost ranks; empty in most files);
    each group is a dict name -> 1-D numpy array (all columns cut to the shortest, so rows
    stay aligned, also in a file whose writer was killed mid-flush; a missing group is
    empty). Raises OSError/ValueError/KeyError when the
    file cannot be read.
    """
    path = Path(path)
    out: dict[str, Any] = {"path": str(path)}
    with _open_h5(path) as f:
        attrs = {k: _py(v) for k, v in f.attrs.items()}
        for name in GROUPS:
            cols: dict[str, np.ndarray] = {}
            grp = f.get(name)
            if grp is not None:
                for key, ds in grp.items():
                    if hasattr(ds, "shape") and len(ds.shape) == 1:
                        cols[key] = np.asarray(ds[()])
            if cols:
                n = min(len(v) for v in cols.values())
                cols = {k: v[:n] for k, v in cols.items()}
            out[name] = cols
    cfg = attrs.get("config", "{}")
    try:
        config = json.loads(cfg) if isinstance(cfg, str) and cfg else {}
    except ValueError:
        config = {}
    out["attrs"] = attrs
    out["config"] = config if isinstance(config, dict) else {}
    rank = attrs.get("rank")
    if rank is None:
        stem = path.stem
        rank = int(stem[4:]) if stem.startswith("rank") and stem[4:].isdigit() else -1
    out["rank"] = int(rank)
    return out


def col(rank_data: dict, group: str, name: str, dtype=float) -> np.ndarray:
    """Column ``group/name`` of a rank (empty array when absent)."""
    arr = rank_data.get(group, {}).get(name)
    return np.asarray(arr if arr is not None else [], dtype=dtype)


@dataclass
class Run:
    """One run directory: its config and the rank files that could be read."""
    path: Path
    name: str
    config: dict
    ranks: dict[int, dict]                      # rank -> read_rank_file(...)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (file, reason)

    def _attr(self, key: str, default=None):
        for r in sorted(self.ranks):
            v = self.ranks[r]["attrs"].get(key)
            if v is not None:
                return v
        return default

    @property
    def algorithm(self) -> str:
        return str(self.config.get("algorithm") or self._attr("algorithm", ""))

    @property
    def world_size(self) -> int:
        ws = self._attr("world_size") or self.config.get("world_size")
        return int(ws) if ws is not None else len(self.ranks) + len(self.skipped)

    @property
    def n_nodes(self) -> int:
        n = self._attr("n_nodes")
        if n is not None:
            return int(n)
        return len({d["attrs"].get("node_index", 0) for d in self.ranks.values()})

    def faults(self) -> list[dict]:
        """The recoveries from lost ranks (/faults, on_failure="shrink"), oldest first: one
        dict per event (step, wall_time, lost_ranks as a list of initial ranks, n_lost,
        world_size_after, recovery_seconds, lost_nodes as a list of node names), the union
        over the survivors' files (the slowest recovery's seconds)."""
        events: dict[tuple, dict] = {}
        for r in sorted(self.ranks):
            f = self.ranks[r].get("faults", {})
            n = len(f.get("step", ()))
            for i in range(n):
                lost = parse_ranks(f["lost_ranks"][i]) if "lost_ranks" in f else []
                healed = (parse_ranks(f["replaced_ranks"][i]) if "replaced_ranks" in f
                          else [])
                key = (int(f["step"][i]), tuple(lost), tuple(healed))
                ev = events.setdefault(key, {
                    "step": key[0], "wall_time": float(f["wall_time"][i]), "lost_ranks": lost,
                    "n_lost": int(f["n_lost"][i]) if "n_lost" in f else len(lost),
                    "world_size_after": int(f["world_size_after"][i]),
                    "recovery_seconds": float(f["recovery_seconds"][i]),
                    "lost_nodes": _names(f["lost_nodes"][i]) if "lost_nodes" in f else [],
                    "replaced_ranks": healed,
                    "replace_seconds": (float(f["replace_seconds"][i])
                                        if "replace_seconds" in f else float("nan")),
                    "replaced_nodes": (_names(f["replaced_nodes"][i])
                                       if "replaced_nodes" in f else [])})
                ev["recovery_seconds"] = max(ev["recovery_seconds"],
                                             float(f["recovery_seconds"][i]))
        return [events[k] for k in sorted(events)]

    @property
    def lost_ranks(self) -> dict[int, int]:
        """initial rank -> the step of the recovery that found it gone, for the ranks lost
        and not replaced by a heal afterwards (empty: none)."""
        return {r: gaps[-1][0] for r, gaps in self.gaps.items() if gaps[-1][1] is None}

    @property
    def gaps(self) -> dict[int, list]:
        """initial rank -> [(step lost, step its replacement took over or None), ...]: the
        steps each lost rank did not train (on_failure="shrink" or "heal")."""
        out: dict[int, list] = {}
        for ev in self.faults():
            for r in ev["lost_ranks"]:
                spans = out.setdefault(int(r), [])
                if not spans or spans[-1][1] is not None:
                    spans.append((ev["step"], None))
            for r in ev.get("replaced_ranks") or []:
                spans = out.get(int(r))
                if spans and spans[-1][1] is None:
                    spans[-1] = (spans[-1][0], ev["step"])
        return out

    def alive(self, step: int) -> list[int]:
        """The ranks (of those read) training at ``step``: not lost at or before it, or
        replaced (on_failure="heal") by then."""
        gaps = self.gaps
        return sorted(r for r in self.ranks
                      if not any(lo <= step and (hi is None or step < hi)
                                 for lo, hi in gaps.get(r, ())))

    @property
    def has_workers(self) -> bool:
        """Whether the run's method ran between workers that span ranks (--worker-ranks):
        its files carry ``worker_index``, ``worker_size`` and ``n_workers``."""
        return any("worker_index" in d["attrs"] for d in self.ranks.values())

    @property
    def worker_of(self) -> dict[int, int]:
        """The worker of every readable rank (the rank itself without workers)."""
        return {r: int(d["attrs"].get("worker_index", r)) for r, d in self.ranks.items()}

    @property
    def n_workers(self) -> int:
        n = self._attr("n_workers")
        return int(n) if n is not None else self.world_size

    @property
    def completion(self) -> dict | None:
        """The run's completion record (``RUN_DIR/complete.json``, written at the end of a run
        that finished or stopped on purpose), or None: the run did not finish."""
        return read_completion(self.path)

    @property
    def seed(self):
        return self.config.get("seed")

    @property
    def epochs(self):
        return self.config.get("epochs")


def _rank_files(metrics: Path) -> list[Path]:
    return sorted(p for p in metrics.glob("rank*.h5") if p.is_file())


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _schema_problem(data: dict) -> str | None:
    """Why a readable file is not one this aggregator can interpret (None when it is)."""
    version = data["attrs"].get("schema_version")
    if version is None:
        return "no schema_version attribute (not a lsgd_hpc metrics file?)"
    try:
        known = int(version) in KNOWN_SCHEMA_VERSIONS
    except (TypeError, ValueError):
        known = False
    if not known:
        return (f"schema_version {version!r}, this aggregator reads schema_version "
                f"{', '.join(map(str, KNOWN_SCHEMA_VERSIONS))}")
    return None


#: config keys that change when a run is resumed, so that they do not tell two runs apart
RESUME_KEYS = frozenset({"resume"})


def run_identities(datas: list[dict]) -> list[tuple[str, int]]:
    """The run each rank file belongs to, as (configuration, start): files of one run carry the
    same resolved ``config`` attribute (which includes the seed, the world size and the run
    directory; ``resume`` aside) and come from one chain of starts. Every start stamps its
    files with its own ``start_time``, the same on every rank; a resumed start (``resume`` true
    in its config) continues the run before it, a fresh one begins another run. So a rank that
    has not flushed since a resume (its file still has the previous start's stamp) stays with
    its run, and a file left over from an earlier fresh start of the same command does not."""
    def config_of(d: dict) -> str:
        return canonical({k: v for k, v in d["config"].items() if k not in RESUME_KEYS})

    starts: dict[str, dict[str, bool]] = {}     # config -> start_time -> resumed
    for d in datas:
        st = str(d["attrs"].get("start_time", ""))
        resumed = bool(d["config"].get("resume"))
        starts.setdefault(config_of(d), {})[st] = starts.get(config_of(d), {}).get(st, False) \
            or resumed
    chain: dict[tuple[str, str], int] = {}
    for cfg, by_start in starts.items():
        n = 0
        for i, st in enumerate(sorted(by_start)):   # ISO 8601 UTC stamps sort by time
            n += i > 0 and not by_start[st]
            chain[(cfg, st)] = n
    return [(config_of(d), chain[(config_of(d), str(d["attrs"].get("start_time", "")))])
            for d in datas]


def _identity_difference(ref: dict, other: dict) -> str:
    """What tells ``other``'s run from ``ref``'s: 'config differs in seed, run_dir' and/or
    'start_time B, not A' (with an identical configuration: a fresh start, not a resume)."""
    parts = []
    keys = sorted((set(ref["config"]) | set(other["config"])) - RESUME_KEYS)
    diff = [k for k in keys
            if canonical(ref["config"].get(k)) != canonical(other["config"].get(k))]
    if diff:
        parts.append("config differs in " + ", ".join(diff[:6]) + (" ..." if len(diff) > 6 else ""))
    a, b = ref["attrs"].get("start_time"), other["attrs"].get("start_time")
    if str(a) != str(b):
        parts.append(f"start_time {b}, not {a}"
                     + ("" if diff else ": a fresh start of the same configuration, not a resume"))
    return "; ".join(parts) or "identity differs"


def _one_run(datas: list[dict], dir_config: dict, run_dir: Path,
             skip: Callable[[str, str], None]) -> list[dict]:
    """Keep the files of the run the directory holds; skip the files of any other run.

    The run is the identity (``run_identities``) most files share; on a tie, the one whose
    config agrees with ``config.yaml`` on the most keys, then the one of the lowest rank."""
    idents = run_identities(datas)
    by_id: dict[tuple[str, int], list[dict]] = {}
    for d, ident in zip(datas, idents):
        by_id.setdefault(ident, []).append(d)
    if len(by_id) <= 1:
        return datas

    def agreement(ds: list[dict]) -> int:
        cfg = ds[0]["config"]
        return sum(canonical(cfg.get(k)) == canonical(v) for k, v in dir_config.items())

    chosen = max(by_id, key=lambda i: (len(by_id[i]), agreement(by_id[i]),
                                       -min(d["rank"] for d in by_id[i])))
    keep = by_id[chosen]
    for ident, ds in by_id.items():
        if ident == chosen:
            continue
        for d in ds:
            skip(d["path"], f"a file of another run than the other {len(keep)} file(s) in "
                            f"{run_dir / 'metrics'} ({_identity_difference(keep[0], d)})")
    return list(keep)


def _one_file_per_rank(datas: list[dict], skip: Callable[[str, str], None]) -> dict[int, dict]:
    """rank -> file. Two files claiming one rank: the one whose file name is that rank's
    (``rank%05d.h5``) is kept and the others skipped; when none or several are so named,
    there is no telling which is the rank's and all of them are skipped."""
    claims: dict[int, list[dict]] = {}
    for d in datas:
        claims.setdefault(d["rank"], []).append(d)
    out: dict[int, dict] = {}
    for rank, ds in sorted(claims.items()):
        if len(ds) == 1:
            out[rank] = ds[0]
            continue
        own = [d for d in ds if Path(d["path"]).name == Path(rank_file("", rank)).name]
        names = [Path(d["path"]).name for d in ds]
        for d in ds:
            others = ", ".join(n for n in names if n != Path(d["path"]).name)
            if len(own) == 1 and d is own[0]:
                continue
            if len(own) == 1:
                why = f"claims rank {rank}, as does {others}, whose file name is that rank's"
            else:
                why = f"claims rank {rank}, as does {others}; no telling which is rank {rank}'s"
            skip(d["path"], why)
        if len(own) == 1:
            out[rank] = own[0]
    return out


def read_run(run_dir: str | os.PathLike, name: str | None = None,
             warn: Callable[[str], None] = _warn,
             read: Callable[[Path], dict] = read_rank_file) -> Run:
    """Read a run directory.

    Rank files are skipped, each with one warning naming the file and why, when they are
    unreadable (truncated, not HDF5), carry a ``schema_version`` this aggregator does not know,
    belong to another run (``_one_run``), or claim the rank of another file
    (``_one_file_per_rank``). Raises AggregateError when nothing readable is left. ``read``:
    what reads one rank file (``read_rank_file``; ``summary --follow`` passes a cached one)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise AggregateError(f"run directory not found: {run_dir}")
    metrics = run_dir / "metrics"
    files = _rank_files(metrics) if metrics.is_dir() else []
    if not files:
        raise AggregateError(f"no metrics files (metrics/rank*.h5) in {run_dir}")
    skipped: list[tuple[str, str]] = []

    def skip(path: str, reason: str) -> None:
        skipped.append((str(path), reason))
        warn(f"skipping metrics file {path}: {reason}")

    datas: list[dict] = []
    for p in files:
        try:
            data = read(p)
        except Exception as exc:  # truncated / corrupt file: skip it, keep the rest
            reason = " ".join(str(exc).split()) or type(exc).__name__
            skip(str(p), f"unreadable ({reason[:200]})")
            continue
        problem = _schema_problem(data)
        if problem:
            skip(str(p), problem)
            continue
        datas.append(data)
    dir_config: dict = {}
    cfg_path = run_dir / "config.yaml"
    if cfg_path.is_file():
        try:
            import yaml
            loaded = yaml.safe_load(cfg_path.read_text())
            dir_config = loaded if isinstance(loaded, dict) else {}
        except Exception as exc:
            warn(f"cannot read {cfg_path} ({' '.join(str(exc).split())[:200]}); "
                 "using the config stored in the metrics files")
    ranks = _one_file_per_rank(_one_run(datas, dir_config, run_dir, skip), skip)
    if not ranks:
        raise AggregateError(f"no readable metrics files in {run_dir}")
    # The configuration the kept files were written with; config.yaml is written once, by the
    # first start, so a later run into the same directory can leave it stale.
    config = dict(ranks[min(ranks)]["config"]) or dir_config
    stale = sorted(k for k in set(config) | set(dir_config)
                   if k not in NON_CONFIG_KEYS and dir_config
                   and canonical(config.get(k)) != canonical(dir_config.get(k)))
    if stale:
        warn(f"{cfg_path} differs from the config in the metrics files in "
             f"{', '.join(stale[:6])}{' ...' if len(stale) > 6 else ''}; using the files'")
    return Run(path=run_dir, name=name or run_dir.resolve().name, config=config,
               ranks=ranks, skipped=skipped)


def expand_run_dirs(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """RUN_DIR arguments -> run directories. A directory without ``metrics/`` whose
    sub-directories hold ``metrics/`` (a sweep's parent) stands for those sub-directories."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir() and not (p / "metrics").is_dir():
            subs = sorted(d for d in p.iterdir() if (d / "metrics").is_dir())
            if subs:
                out.extend(subs)
                continue
        out.append(p)
    return out


def read_runs(paths: Iterable[str | os.PathLike],
              warn: Callable[[str], None] = _warn) -> list[Run]:
    """Read every run of ``paths`` (``expand_run_dirs``). A run directory with nothing readable
    is warned about and skipped; AggregateError (all the reasons, one line) when no run is left."""
    dirs = expand_run_dirs(paths)
    names = [d.resolve().name for d in dirs]
    dup = {n for n, c in Counter(names).items() if c > 1}
    runs: list[Run] = []
    failed: list[str] = []
    for d, n in zip(dirs, names):
        try:
            runs.append(read_run(d, name=(str(d) if n in dup else n), warn=warn))
        except AggregateError as exc:
            failed.append(str(exc))
    if not runs:
        raise AggregateError("; ".join(failed) if failed else "no run directories given")
    for reason in failed:
        warn(f"skipping run: {reason}")
    return runs


def _names(value) -> list[str]:
    """A comma-separated /faults string column (bytes or str) as a list; empty: []."""
    text = value.decode() if isinstance(value, bytes) else str(value)
    return [n for n in text.split(",") if n]


# --------------------------------------------------------------------------- completion

def completion_state(record: dict | None) -> str:
    """``complete`` (the step budget done), ``stopped`` (stopped on purpose: a checkpoint,
    then exit; preempted) or ``incomplete`` (no record: ranks crashed or were killed; or a
    record that cannot be read)."""
    status = (record or {}).get("status")
    return status if status in STATUSES else "incomplete"


def last_step(run: Run) -> int | None:
    """The last training step any rank of ``run`` logged (None: no rows)."""
    steps = [int(d["train"]["step"][-1]) for d in run.ranks.values()
             if len(d.get("train", {}).get("step", ()))]
    return max(steps) if steps else None


def describe_completion(record: dict | None, run: Run | None = None) -> str:
    """One line on whether a run completed, e.g. ``complete (600/600 steps)`` or
    ``NOT COMPLETE: no completion record (...); last step 119 of 600``. ``run``: its metrics,
    for the last step and the budget when there is no record."""
    state = completion_state(record)
    if state != "incomplete":
        step, total = record.get("step"), record.get("total_steps")
        steps = (f"{step if step is not None else '?'}/{total if total is not None else '?'} "
                 "steps")
        lost = record.get("lost_ranks") or []
        ranks = ""
        if lost:
            ranks = (f", {record.get('world_size', '?')} of {record.get('initial_size', '?')} "
                     f"ranks at the end (lost: {','.join(map(str, lost))})")
        if state == "complete":
            return f"complete ({steps}{ranks})"
        then = ("the job requeued itself and resumes from it" if record.get("requeued")
                else "continue it with --resume")
        return (f"stopped on purpose (preempted or signalled) with a checkpoint at "
                f"{steps}{ranks}; {then}")
    if record is not None:
        why = f"the completion record cannot be read ({record.get('error', '?')})"
    else:
        why = ("no completion record (the job ended before its budget: ranks crashed or were "
               "killed)")
    where = ""
    if run is not None:
        step = last_step(run)
        total = run.config.get("total_steps")
        where = (f"; last step {step if step is not None else 0}"
                 + (f" of {total}" if total is not None else ""))
    return f"NOT COMPLETE: {why}{where}"
