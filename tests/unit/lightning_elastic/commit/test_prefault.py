"""The helper that faults in a joiner's new buffers while the receive fills them."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_elastic.commit.prefault import Prefaulter, page_ranges

PAGE = os.sysconf("SC_PAGE_SIZE")


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def test_page_ranges_cover_the_whole_pages_inside_the_range_in_slices() -> None:
    # 100 bytes into page 1 up to 50 bytes into page 11: whole pages 2..10, in slices of 4 pages.
    ranges = page_ranges(start=1 * 4096 + 100, nbytes=10 * 4096 - 50, page=4096, slice_bytes=4 * 4096)
    assert ranges == [(2 * 4096, 4 * 4096), (6 * 4096, 4 * 4096), (10 * 4096, 1 * 4096)]


def test_page_ranges_of_a_range_inside_one_page_are_empty() -> None:
    assert page_ranges(start=4096 + 1, nbytes=100, page=4096, slice_bytes=1 << 20) == []


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="MADV_POPULATE_WRITE is Linux's")
def test_the_pages_of_new_buffers_become_resident_without_being_written() -> None:
    size = 64 << 20
    buffers = [torch.empty(size // 2, dtype=torch.uint8) for _ in range(2)]
    before = resident_bytes()
    prefaulter = Prefaulter(buffers)
    with prefaulter:
        assert prefaulter._thread is not None
        prefaulter._thread.join(timeout=60)
    assert resident_bytes() - before > 0.9 * size


def test_leaving_stops_the_thread_and_pinned_or_empty_tensors_are_skipped() -> None:
    prefaulter = Prefaulter([torch.empty(0), torch.empty(256 << 20, dtype=torch.uint8)])
    with prefaulter:
        pass
    assert prefaulter._thread is None or not prefaulter._thread.is_alive()
    with Prefaulter([torch.empty(0)]) as idle:
        assert idle._thread is None
