"""Fused buffers on transparent huge pages (lsgd_hpc.comm.memory)."""

import sys
from pathlib import Path

import pytest
import torch

from lsgd_hpc.comm import FlatParams
from lsgd_hpc.comm.memory import HUGE_PAGE, advise_huge_pages, host_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kb(t: torch.Tensor) -> int:
    """AnonHugePages (kB) of the mapping holding t's first huge-page-aligned byte."""
    addr = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_small_or_gpu_buffers_get_no_advice():
    assert not advise_huge_pages(torch.zeros(1000))
    t = host_zeros(1000, torch.float32, "cpu")
    assert t.dtype == torch.float32 and not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages not set to never")
def test_large_buffers_are_backed_by_huge_pages():
    n = 3 * HUGE_PAGE // 4 + 12345            # > 2 whole huge pages of float32, unaligned end
    t = host_zeros(n, torch.float32, "cpu")
    assert t.numel() == n and not t.any()
    assert _huge_kb(t) >= HUGE_PAGE // 1024   # at least one huge page behind it
    flat = FlatParams(torch.nn.Linear(1024, 2048))
    assert _huge_kb(flat.flat) >= HUGE_PAGE // 1024
    assert _huge_kb(flat.grad) >= HUGE_PAGE // 1024
