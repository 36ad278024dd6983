"""Where a worker's KV cache lives, and what that asks of the worker.

Called by ``PDWorker.register_kv_caches``, once, on the worker's step
thread, with vLLM's KV tensors:

1. ``kv_memory``: the memory NIXL registers: "VRAM" on the tensors' CUDA
   device, else "DRAM" (device 0).
2. ``check_kv_buffer_device``: vLLM's ``kv_buffer_device`` must name that
   memory. The connector registers the KV where vLLM allocated it and has no
   host staging buffer, so "cpu" on a CUDA KV cache (or any device the KV is
   not on) is refused at startup instead of being silently ignored.
3. ``thread_hook``: what every thread that calls NIXL runs first
   (``Transport.enter_thread``): on VRAM it sets the thread's CUDA device, as
   upstream vLLM does in its NIXL threads (UCX turns ``cuda_ipc`` off for a
   thread with no current device); on DRAM nothing.

The one place the worker half touches ``torch.cuda``, and only on VRAM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_pd_ext.config import ConfigError

#: kv_buffer_device values we honour, by the KV's memory type.
BUFFER_DEVICE = {"DRAM": "cpu", "VRAM": "cuda"}


@dataclass(frozen=True)
class KVMemory:
    mem_type: str  # "DRAM" or "VRAM", as NIXL names them
    device_id: int

    def describe(self) -> str:
        return f"cuda:{self.device_id}" if self.mem_type == "VRAM" else "cpu"


def kv_memory(tensor: Any) -> KVMemory:
    """The memory of one KV tensor (every layer's is on the same device)."""
    if tensor.is_cuda:
        return KVMemory("VRAM", tensor.device.index or 0)
    return KVMemory("DRAM", 0)


def check_kv_buffer_device(value: str | None, mem: KVMemory) -> None:
    """Refuse a ``kv_buffer_device`` we cannot honour (``ConfigError``);
    None (not set) takes the KV's own device."""
    if value is None:
        return
    wanted = BUFFER_DEVICE[mem.mem_type]
    if str(value).split(":")[0].lower() == wanted:
        return
    raise ConfigError(
        f"kv_transfer_config.kv_buffer_device={value!r}: PDConnector moves the KV cache "
        f"where vLLM allocated it ({mem.describe()}), so it supports only "
        f"kv_buffer_device={wanted!r} here (leave it at vLLM's default); a host staging "
        "buffer for a GPU KV cache is not implemented")


def _no_op() -> None:
    return


def thread_hook(mem: KVMemory) -> Callable[[], None]:
    """What a NIXL-calling thread runs first (module docstring)."""
    if mem.mem_type != "VRAM":
        return _no_op
    device_id = mem.device_id

    def set_cuda_device() -> None:
        import torch

        torch.cuda.set_device(device_id)

    return set_cuda_device
