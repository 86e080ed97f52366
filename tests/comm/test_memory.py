"""Fused buffers on transparent huge pages (lsgd_hpc.comm.memory)."""

import sys
from pathlib import Path

import pytest
import torch

from lsgd_hpc.comm import FlatParams
from lsgd_hpc.comm.memory import HUGE_PAGE, advise_huge_pages, host_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _mapping_of(t: torch.Tensor) -> dict:
    """The /proc/self/smaps entry (field -> text) of the mapping holding t's first
    huge-page-aligned byte."""
    addr = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
    entry, inside = {}, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            if inside:
                break
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
    return entry


def _advised(t: torch.Tensor) -> bool:
    """The kernel marks memory advised with MADV_HUGEPAGE with the 'hg' VmFlag. Whether a huge
    page then backs it (AnonHugePages) depends on free, unfragmented memory at fault time, so
    the advice is what the package controls and what is asserted."""
    return "hg" in _mapping_of(t).get("VmFlags", "").split()


def test_small_or_gpu_buffers_get_no_advice():
    assert not advise_huge_pages(torch.zeros(1000))
    t = host_zeros(1000, torch.float32, "cpu")
    assert t.dtype == torch.float32 and not t.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists()
                    or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages not set to never")
def test_large_buffers_are_advised_to_huge_pages():
    n = 3 * HUGE_PAGE // 4 + 12345            # > 2 whole huge pages of float32, unaligned end
    t = host_zeros(n, torch.float32, "cpu")
    assert t.numel() == n and not t.any()
    assert _advised(t)
    # torch's own allocation carries no advice (48 MB: above glibc's largest mmap threshold,
    # so a fresh mapping, not heap memory an earlier test's advised buffer left behind)
    assert not _advised(torch.zeros(12 * 2 ** 20))
    flat = FlatParams(torch.nn.Linear(1024, 2048))
    assert _advised(flat.flat) and _advised(flat.grad)
