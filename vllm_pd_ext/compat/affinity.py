"""Keep an engine's EngineCore process on its workers' CPU cores (CPU only).

Applied through ``patches`` (row ``engine_core_affinity``): it reads vLLM
CPU's own convention for the workers' cores (``VLLM_CPU_OMP_THREADS_BIND``:
a core list, ``auto``, ``nobind``, or one set per rank with ``|``). The
functions import nothing of vLLM themselves.

Why: on CPU, ``VLLM_CPU_OMP_THREADS_BIND`` binds only the workers' OpenMP
threads. The EngineCore process floats over every core, and while a worker
runs a step it busy-waits on vLLM's shared-memory queue (``sched_yield``).
With P and D on one host, each engine's EngineCore then takes CPU from the
other engine's workers: in push mode D's took P's prefill core (issue 10,
``docs/push-mode.md#cpu-and-concurrency``). Confining it to the cores the
operator gave the engine is what that operator asked for.

When: once, as the connector's scheduler half starts in the EngineCore
process (``bind_engine_core`` in ``kv_connector_extra_config``, on by default), and
only when the bind names explicit cores (not ``auto``/``nobind``); with one
set per rank (tensor parallelism, ``0-3|4-7``) the EngineCore gets their
union. Every thread the process has now is moved; threads
started later inherit the mask. The API server process is not ours to move.
"""

from __future__ import annotations

import os

from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)

#: A core list longer than this is refused as malformed (no real host has more).
MAX_CORES = 8192


def parse_cpu_list(spec: str) -> set[int] | None:
    """``"0-3,8,10-11"`` -> cores; one set per worker rank (``"0-3|4-7"``,
    tensor parallelism) -> the union of the ranks' cores, which is what the
    engine was given. None for ``auto``, ``nobind``, or an empty or
    malformed list (any rank's)."""
    spec = spec.strip()
    if not spec or spec in ("auto", "nobind"):
        return None
    cores: set[int] = set()
    for rank_spec in spec.split("|"):
        rank_cores = _parse_one(rank_spec.strip())
        if rank_cores is None:
            return None
        cores |= rank_cores
    return cores


def _parse_one(spec: str) -> set[int] | None:
    cores: set[int] = set()
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            return None
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last >= MAX_CORES:
            return None
        cores.update(range(first, last + 1))
    return cores or None


def bind_process(cores: set[int]) -> int:
    """Move every thread of this process to ``cores``; returns how many moved."""
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            moved += 1
        except OSError:  # the thread ended meanwhile
            continue
    return moved


def bind_engine_core(is_cpu: bool, omp_bind: str | None) -> set[int] | None:
    """Apply the module's rule; returns the cores bound to, if any."""
    if not is_cpu or omp_bind is None:
        return None
    cores = parse_cpu_list(omp_bind)
    if cores is None:
        return None
    allowed = os.sched_getaffinity(0)
    cores &= allowed
    if not cores or cores == allowed:
        return None
    moved = bind_process(cores)
    logger.info("PDConnector: EngineCore process (%d threads) bound to cores %s, the "
                "workers' VLLM_CPU_OMP_THREADS_BIND (bind_engine_core=false keeps it "
                "floating)", moved, ",".join(map(str, sorted(cores))))
    return cores
