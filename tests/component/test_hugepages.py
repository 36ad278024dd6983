"""Best-effort huge pages for a host KV cache."""

from __future__ import annotations

import mmap
import sys

import pytest

from vllm_pd_ext.worker.hugepages import prefer_huge_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux madvise")


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    return 0


def test_collapses_a_faulted_buffer_or_reports_why() -> None:
    size = 16 << 20
    # Private anonymous memory, like torch's CPU allocator (a shared mapping
    # would be shmem, counted elsewhere in smaps).
    buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\x01" * size)  # fault every page in, on small pages, like torch.zeros
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    before = _anon_huge_kb()
    done, tried = prefer_huge_pages({addr: size})
    # Only whole aligned 2 MiB pages are attempted.
    assert size - (4 << 20) <= tried <= size
    assert 0 <= done <= tried
    if done:
        assert _anon_huge_kb() - before >= done // 1024 // 2
    buf.close()


def test_ranges_smaller_than_a_huge_page_are_skipped() -> None:
    assert prefer_huge_pages({4096: 8192}) == (0, 0)
