"""A real vLLM ``Scheduler`` with PDConnector, no workers, no model run.

Re-implements the parts of vLLM's ``tests/v1/kv_connector/unit/utils.py``
(not shipped in the wheel) that these tests need, for the installed vLLM.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

import vllm_pd_ext

REPO = Path(__file__).resolve().parents[2]
EOS_TOKEN_ID = 2
BLOCK_SIZE = 32


def tiny_model() -> str:
    path = REPO / ".models" / "tiny"
    if not (path / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "examples" / "make_tiny_model.py"),
                        "--out", str(path)], check=True, env={**os.environ})
    return str(path)


def create_vllm_config(kv_role: str = "kv_consumer", block_size: int = BLOCK_SIZE,
                       extra: dict[str, Any] | None = None,
                       kv_load_failure_policy: str = "fail",
                       engine_id: str | None = None,
                       max_num_batched_tokens: int = 2048) -> VllmConfig:
    vllm_pd_ext.register()
    model_config = ModelConfig(model=tiny_model(), dtype="float32", seed=0, max_model_len=4096)
    scheduler_config = SchedulerConfig(
        max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=model_config.max_model_len, enable_chunked_prefill=True,
        is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=block_size, cache_dtype="auto",
                               enable_prefix_caching=True)
    kv_transfer_config = KVTransferConfig(
        kv_connector="PDConnector", kv_role=kv_role,
        kv_connector_extra_config=dict(extra or {}),
        kv_load_failure_policy=kv_load_failure_policy,
        engine_id=engine_id)
    return VllmConfig(model_config=model_config, scheduler_config=scheduler_config,
                      cache_config=cache_config, kv_transfer_config=kv_transfer_config,
                      device_config=DeviceConfig("cpu"))


#: The two scheduling modes the scheduler tier runs under. ``sync``:
#: vLLM's ``Scheduler`` driven like ``EngineCore.step`` (schedule N, update N).
#: ``async``: vLLM's ``AsyncScheduler`` (the GPU default, async_scheduling=True;
#: the CPU platform forces it off) driven like
#: ``EngineCore.step_with_batch_queue`` with its batch queue of 2
#: (vllm/v1/engine/core.py): step N+1 is scheduled before step N's output is
#: processed, so requests carry ``num_output_placeholders``.
SCHEDULING_MODES = ("sync", "async")


def create_scheduler(vllm_config: VllmConfig, num_blocks: int = 64,
                     mode: str = "sync") -> Scheduler:
    assert mode in SCHEDULING_MODES, mode
    block_size = vllm_config.cache_config.block_size
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], FullAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    cls = Scheduler
    if mode == "async":
        # What VllmConfig leaves on where the platform allows it (CUDA);
        # EngineCore then picks AsyncScheduler and the batch queue.
        vllm_config.scheduler_config.async_scheduling = True
        cls = AsyncScheduler
    sched = cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                structured_output_manager=StructuredOutputManager(vllm_config),
                block_size=block_size, log_stats=True)
    sched.pd_inflight = deque()  # type: ignore[attr-defined]
    sched.pd_carry = {}  # type: ignore[attr-defined]
    return sched


def is_async(scheduler: Scheduler) -> bool:
    return isinstance(scheduler, AsyncScheduler)


def engine_step(scheduler: Scheduler, **output_kw: Any
                ) -> tuple[SchedulerOutput, dict[int, Any]]:
    """One engine step with a fake forward; ``output_kw`` (``make_output``'s
    worker reports: finished_recving, ...) ride on the output processed in it.

    Returns (the step's SchedulerOutput, the EngineCoreOutputs processed).
    sync: schedule N, update N. async, the batch queue's steady state:
    schedule N+1, then update from step N's output (the first call only
    schedules; its reports wait for the next update).
    """
    out = scheduler.schedule()
    if not is_async(scheduler):
        return out, scheduler.update_from_output(
            out, make_output(list(out.num_scheduled_tokens), **output_kw))
    inflight: deque[SchedulerOutput] = scheduler.pd_inflight  # type: ignore[attr-defined]
    carry: dict[str, Any] = scheduler.pd_carry  # type: ignore[attr-defined]
    for key, val in output_kw.items():
        carry[key] = (carry.get(key) or set()) | set(val) if isinstance(val, set) else val
    inflight.append(out)
    if len(inflight) < 2:
        return out, {}
    return out, _update_oldest(scheduler)


def _update_oldest(scheduler: Scheduler) -> dict[int, Any]:
    inflight: deque[SchedulerOutput] = scheduler.pd_inflight  # type: ignore[attr-defined]
    carry: dict[str, Any] = scheduler.pd_carry  # type: ignore[attr-defined]
    prev = inflight.popleft()
    kw = dict(carry)
    carry.clear()
    return scheduler.update_from_output(
        prev, make_output(list(prev.num_scheduled_tokens), **kw))


def drain(scheduler: Scheduler) -> dict[int, Any]:
    """async: process every step still in flight, scheduling nothing more
    (what step_with_batch_queue does once ``has_requests()`` is False).
    Merged EngineCoreOutputs; sync: nothing to do."""
    merged: dict[int, Any] = {}
    while is_async(scheduler) and scheduler.pd_inflight:  # type: ignore[attr-defined]
        merge_outputs(merged, _update_oldest(scheduler))
    return merged


def merge_outputs(into: dict[int, Any], more: dict[int, Any]) -> dict[int, Any]:
    """Add ``more``'s EngineCoreOutputs to ``into``, client by client."""
    for client, eco in more.items():
        if client in into:
            into[client].outputs.extend(eco.outputs)
        else:
            into[client] = eco
    return into


_ids = itertools.count(1)
_none_hash_ready = False


def create_request(num_tokens: int, *, kv_transfer_params: dict[str, Any] | None = None,
                   max_tokens: int = 16, prompt: list[int] | None = None,
                   request_id: str | None = None, block_size: int = BLOCK_SIZE,
                   cache_salt: str | None = None) -> Request:
    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    n = next(_ids)
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, EOS_TOKEN_ID)
    tokens = prompt if prompt is not None else [10 + (i * n) % 3000 for i in range(num_tokens)]
    req = Request(request_id=request_id or f"req-{n}", prompt_token_ids=list(tokens),
                  sampling_params=params, pooling_params=None, cache_salt=cache_salt,
                  block_hasher=get_request_block_hasher(block_size, sha256))
    req.kv_transfer_params = kv_transfer_params
    return req


def make_output(reqs: list[Request] | list[str], *, finished_sending: set[str] | None = None,
                finished_recving: set[str] | None = None,
                failed_recving: set[str] | None = None,
                invalid_block_ids: set[int] | None = None,
                worker_meta: Any = None,
                token_id: int = 100) -> ModelRunnerOutput:
    """``worker_meta``: the workers' ``KVConnectorWorkerMetadata`` of the step."""
    req_ids = [r if isinstance(r, str) else r.request_id for r in reqs]
    kv_out = None
    if (finished_sending or finished_recving or failed_recving or invalid_block_ids
            or worker_meta is not None):
        kv_out = KVConnectorOutput(
            finished_sending=finished_sending, finished_recving=finished_recving,
            failed_recving=failed_recving or set(), invalid_block_ids=invalid_block_ids or set(),
            kv_connector_worker_meta=worker_meta)
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token_id] for _ in req_ids], logprobs=None,
        prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv_out)


def assert_scheduler_empty(scheduler: Scheduler) -> None:
    """No request anywhere, every block free with ref count 0."""
    assert not getattr(scheduler, "pd_inflight", None), "steps still in flight: drain() first"
    assert len(scheduler.requests) == 0, list(scheduler.requests)
    assert len(scheduler.waiting) == 0
    assert len(scheduler.kv_holding_waiting) == 0
    assert len(scheduler.running) == 0
    assert len(scheduler.finished_req_ids) == 0
    assert len(scheduler.finished_recving_kv_req_ids) == 0
    assert len(scheduler.failed_recving_kv_req_ids) == 0
    assert len(scheduler._inflight_prefills) == 0
    mgr = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
    assert len(mgr.req_to_blocks) == 0
    assert len(mgr.num_cached_block) == 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1
    for block in pool.blocks:
        assert block.ref_cnt == 0
