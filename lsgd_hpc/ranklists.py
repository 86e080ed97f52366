"""Rank lists as text: ``format_ranks([1, 3, 8, 9, 10, 11])`` is '1,3,8-11' (the ``lost_ranks``
column of a metrics file's /faults group, the trainer's and the analysis' lines) and
:func:`parse_ranks` reads it back.

A leaf module: it imports nothing of lsgd_hpc, so that the offline analysis (lsgd_hpc/analysis/)
reads rank lists without importing the communication layer.
"""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["format_ranks", "parse_ranks"]


def format_ranks(ranks: Sequence[int]) -> str:
    """'1,3,8-11': sorted ranks with runs of three or more as ranges (the /faults column)."""
    out, rs = [], sorted({int(r) for r in ranks})
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{rs[i]}-{rs[j]}")
        else:
            out.extend(str(r) for r in rs[i:j + 1])
        i = j + 1
    return ",".join(out)


def parse_ranks(text) -> List[int]:
    """The inverse of :func:`format_ranks` (bytes accepted, as HDF5 gives them back)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    out: List[int] = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out
