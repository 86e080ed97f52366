"""How the offline tools write numbers for a reader: byte counts, accuracies, losses. No torch,
no mpi4py; imported by follow.py (and meant for summary.py) so that neither imports the
other for them."""

from __future__ import annotations

import math
from typing import Optional

__all__ = ["fmt_bytes", "fmt_acc", "fmt_num"]


def fmt_bytes(n: float) -> str:
    """``512 B``, ``1.50 KiB``, ... ``2.00 TiB`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0
    return f"{n} B"  # pragma: no cover


def fmt_acc(a: Optional[float]) -> str:
    """An accuracy in [0, 1] as a percentage with 2 decimals; ``-`` for None or NaN."""
    return "-" if a is None or math.isnan(a) else f"{100.0 * a:.2f}%"


def fmt_num(x: Optional[float]) -> str:
    """A loss (or any float) with 4 decimals; ``-`` for None or NaN."""
    return "-" if x is None or math.isnan(x) else f"{x:.4f}"
