"""What every experiment under results/experiments shares: starting training jobs, plot style, CSV.

An experiment is ``results/experiments/<name>.py``: ``python results/experiments/<name>.py
--out results/<name> [--quick] [its own options for a bigger budget]`` runs it alone, and its
``run(out, quick=False, log=print) -> dict`` is what ``results/run_all.py`` (``make results``)
calls. It writes CSV tables and PNG figures into ``out`` and returns::

    {"name": ..., "title": ..., "figures": [png names], "tables": [csv names],
     "findings": [one sentence each, computed from the numbers], "seconds": wall seconds}

Raw runs (HDF5) go under ``runs/results/<name>/`` (not kept in git).
"""

from __future__ import annotations

import csv
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for p in (str(REPO), str(REPO / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
from lsgd_hpc.testing import mpi_env, mpirun_cmd, run_group  # noqa: E402
# The layout and link-rate check every benchmark and experiment that claims a multi-node
# layout or a link rate runs on what its own runs reported (benchmarks/_common.py).
from _common import LayoutError, check_layout, fmt_bytes, rho_fields  # noqa: E402

__all__ = ["REPO", "RAW", "raw_dir", "train_many", "write_csv", "read_csv", "new_figure",
           "save_figure", "write_json", "LayoutError", "check_layout", "fmt_bytes", "rho_fields",
           "RHO_COLUMNS", "add_rho", "rho_sentence"]

#: where raw runs go (ignored by git)
RAW = REPO / "runs" / "results"


def raw_dir(name: str) -> Path:
    d = RAW / name
    d.mkdir(parents=True, exist_ok=True)
    return d


def train_many(np_: int, argvs: Sequence[Sequence[str]], timeout: float,
               mpi_args: Optional[List[str]] = None, env: Optional[Dict[str, str]] = None,
               log=print) -> None:
    """Run every ``python -m lsgd_hpc.train`` command line of ``argvs`` one after another in ONE
    ``mpirun -np np_`` job (one start-up for all; benchmarks/_train_many.py), killed as a whole
    after ``timeout`` seconds. Raises RuntimeError with the job's last lines on failure."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump([list(map(str, a)) for a in argvs], fh)
        spec = fh.name
    try:
        cmd = mpirun_cmd(np_, [sys.executable, str(REPO / "benchmarks" / "_train_many.py"), spec],
                         mpi_args)
        p = run_group(cmd, env=mpi_env(env), cwd=REPO, timeout=timeout)
    finally:
        os.unlink(spec)
    if p.returncode is None:
        raise RuntimeError(f"mpirun -np {np_} timed out after {timeout:.0f} s")
    if p.returncode != 0:
        tail = " / ".join((p.stderr or p.stdout or "").strip().splitlines()[-4:])
        raise RuntimeError(f"mpirun -np {np_} exited {p.returncode}: {tail[-500:]}")


def write_csv(path: Path, rows: Iterable[dict], columns: Optional[Sequence[str]] = None) -> Path:
    rows = list(rows)
    columns = list(columns or (rows[0].keys() if rows else []))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else
                            (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]))
                        for k in columns})
    return path


def read_csv(path: Path) -> List[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj, indent=1, default=float, allow_nan=True))
    return path


def new_figure(ncols: int = 1, width: float = 6.4, height: float = 4.2):
    """A figure readable at 100 % zoom: 10-pt text or larger, a grid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "legend.fontsize": 9,
                         "axes.grid": True, "grid.alpha": 0.3})
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: the rho columns an experiment over links adds to its tables (rho_fields)
RHO_COLUMNS = ["rho", "rho_allreduce_s", "rho_compute_s", "rho_source"]


def add_rho(rows: Iterable[dict], n_params: int, link_of, layout_of, compute_of) -> None:
    """rho_fields into every row whose link is known: ``link_of(row)`` the probed link between
    the nodes (or None), ``layout_of(row)`` (nodes, ranks per node), ``compute_of(row)`` the
    run's compute seconds of one step."""
    for r in rows:
        link = link_of(r)
        if link:
            r.update(rho_fields(n_params, *layout_of(r), link, compute_of(r)))


def rho_sentence(where: str, row: dict, n_params: int) -> str:
    """The finding for one row with rho_fields: rho and its parts."""
    return (f"rho {where}: {row['rho']:.3g} ({row['rho_source']} from the probed link: one "
            f"fp32 allreduce of the {n_params:,} parameters between the nodes "
            f"{1e3 * row['rho_allreduce_s']:.3g} ms / compute {1e3 * row['rho_compute_s']:.3g}"
            " ms a step).")
