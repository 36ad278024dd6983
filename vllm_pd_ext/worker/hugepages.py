"""Best-effort transparent huge pages for the KV cache in host memory.

Why: on one host UCX moves KV with ``process_vm_readv``, which pins the
source pages one by one; on 4 KiB pages a READ runs at about half the speed it
reaches on 2 MiB pages (measured 7.7 vs 16 GB/s between two processes, see
docs/benchmarks.md). vLLM's CPU KV cache is allocated and zeroed before the
connector sees it, so ``MADV_HUGEPAGE`` alone is too late: ``MADV_COLLAPSE``
(Linux >= 6.1) rebuilds the already-faulted range on huge pages. Failure is
harmless (the KV stays on small pages) and logged once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25


def prefer_huge_pages(ranges: dict[int, int]) -> tuple[int, int]:
    """Ask the kernel to back ``{addr: nbytes}`` with huge pages.

    Returns ``(bytes collapsed, bytes attempted)``.
    """
    if not sys.platform.startswith("linux"):
        return 0, 0
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = tried = 0
    errno = 0
    for addr, n in ranges.items():
        lo, hi = (addr + _HUGE - 1) & ~(_HUGE - 1), (addr + n) & ~(_HUGE - 1)
        if hi <= lo:
            continue
        tried += hi - lo
        libc.madvise(lo, hi - lo, _MADV_HUGEPAGE)
        if libc.madvise(lo, hi - lo, _MADV_COLLAPSE) == 0:
            done += hi - lo
        else:
            errno = ctypes.get_errno()
    if tried and done < tried:
        logger.info("PDConnector: huge pages for %d of %d KV bytes (madvise errno %d); the "
                    "rest stays on small pages, which halves same-host READ speed",
                    done, tried, errno)
    return done, tried
