"""How vLLM lays out a layer's KV cache, as NIXL regions and compat info.

``kv_regions`` turns the per-layer tensors vLLM hands ``register_kv_caches``
into strided block regions (``protocol.Region``: block ``i`` at
``base_addr + i * block_stride``, ``block_len`` bytes); ``compat_info`` is
what two engines must agree on to exchange blocks (the handshake compares
it field by field). Both depend on vLLM's layout conventions, hence here.

vLLM 0.32 hands each layer a logical ``[B, H, N, C]`` view of one raw
allocation whose strides follow the resolved ``KVCacheLayout``
(``vllm/v1/kv_cache_layout.py``). What we need of it is one thing: the bytes
of one block of one layer form one dense range. That holds whenever the
block is the outermost of the layer's dims among those larger than one
(LBHNC, LBNHC, BLHNC, BLNHC; LHBNC and BHLNC only with one head slot); the
block stride may exceed the block (cross-layer BL* layouts, padded pages).
The table is in docs/architecture.md#kv-layouts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_pd_ext.wire.protocol import PROTOCOL_VERSION, CompatInfo, Region

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

#: Cache dtype spellings that name the same bytes (vLLM's ``--kv-cache-dtype``
#: and ``torch.dtype`` names), mapped to one name.
_DTYPE_ALIASES = {
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
    "half": "float16",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
}


def normalize_dtype(name: str) -> str:
    """One name per KV byte format: ``fp8`` == ``fp8_e4m3``, ``torch.float16`` == ``half``."""
    name = str(name).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def kv_layout_name(vllm_config: VllmConfig) -> str:
    """The resolved ``KVCacheLayout`` name (``cache_config.kv_cache_layout``).

    The engine core resolves it before the KV cache is allocated and both the
    scheduler's and the workers' connectors are built after that (vLLM 0.32);
    "unresolved" only for a config no engine has resolved (tests, tools).
    Legacy aliases (NHD, HND) are mapped to the member names.
    """
    cc = vllm_config.cache_config
    if getattr(cc, "kv_cache_layout", None) is None:
        return "unresolved"
    return str(cc.get_resolved_kv_cache_layout().name)


def required_kv_cache_layout(vllm_config: Any) -> str | None:
    """``PDConnector.get_required_kvcache_layout``: "LBHNC", None for MLA (or no model)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or getattr(mc, "use_mla", False):
        return None
    return "LBHNC"


def device_kind() -> str:
    """The platform's device type ("cuda", "cpu", "rocm" ...): CPU and GPU
    engines lay out and address KV memory differently, so they never pair."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def attention_backend_name(vllm_config: VllmConfig) -> str:
    """The attention backend the user chose (``--attention-backend``), or "auto".

    The backend vLLM finally selects is known only inside the worker's model
    runner, not at the scheduler's connector, so this is informational (see
    ``CompatInfo.INFORMATIONAL``); the layout, dtype and device kind are what
    the bytes depend on and those are compared.
    """
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return "auto" if backend is None else str(getattr(backend, "name", backend))


def compat_info(vllm_config: VllmConfig, transfer_mode: str) -> CompatInfo:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    return CompatInfo(
        protocol_version=PROTOCOL_VERSION,
        # The served name, not the path: P and D may load the same weights from
        # different directories; --served-model-name aligns them.
        model=_served_name(mc),
        dtype=normalize_dtype(str(cache_dtype if cache_dtype != "auto" else mc.dtype)),
        block_size=int(vllm_config.cache_config.block_size),
        kv_layout=kv_layout_name(vllm_config),
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_size=int(mc.get_head_size()),
        tp_size=int(pc.tensor_parallel_size),
        transfer_mode=str(transfer_mode),
        device=device_kind(),
        attn_backend=attention_backend_name(vllm_config),
        total_kv_heads=int(mc.get_total_num_kv_heads()),
        mla=bool(getattr(mc, "use_mla", False)),
    )


def _served_name(model_config: Any) -> str:
    name = model_config.served_model_name or model_config.model
    if isinstance(name, list | tuple):
        name = name[0]
    return str(name)


def dense_problem(shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """Why elements of ``shape``/``strides`` are not one dense range ("" if they are).

    Dense means: some permutation of the dims is a contiguous layout, i.e.
    sorted by stride (size-1 dims ignored) the smallest stride is 1 and each
    next stride is the previous one times its size.
    """
    dims = sorted((st, sz) for sz, st in zip(shape, strides, strict=True) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return (f"dims {tuple(shape)} with element strides {tuple(strides)} leave gaps "
                    f"or interleave with other blocks (a stride {st} where {expected} "
                    f"continues the block)")
        expected = st * sz
    return ""


def _layer_region(name: str, t: torch.Tensor, num_blocks: int) -> Region:
    """One layer's ``[B', ...]`` view, ``B' = num_blocks * ratio`` (``ratio`` > 1:
    vLLM split each manager block into ``ratio`` kernel blocks)."""
    esize = t.element_size()
    ratio = t.shape[0] // num_blocks
    inner = tuple(t.shape[1:])
    problem = dense_problem(inner, tuple(t.stride()[1:]))
    if problem:
        raise RuntimeError(
            f"PDConnector: KV cache of layer {name}: the bytes of one block are not one "
            f"dense range ({problem}); this layout (a head- or layer-major one with "
            f"several head slots) cannot be moved block by block")
    kernel_len = t[0].numel() * esize
    kernel_stride = t.stride(0) * esize
    if ratio > 1:
        # A manager block is `ratio` kernel blocks; one range only if they abut.
        if kernel_stride != kernel_len:
            raise RuntimeError(
                f"PDConnector: KV cache of layer {name}: a {num_blocks}-block cache split "
                f"into {ratio} kernel blocks per block whose stride ({kernel_stride} B) is "
                f"not their size ({kernel_len} B), so a block is not one dense range")
        return Region(t.data_ptr(), ratio * kernel_stride, ratio * kernel_len, num_blocks)
    if num_blocks > 1 and kernel_stride < kernel_len:
        raise RuntimeError(
            f"PDConnector: KV cache of layer {name}: blocks overlap (stride {kernel_stride} "
            f"B, {kernel_len} B each)")
    # block_stride > block_len: cross-layer (BL*) layouts or padded pages; a strided
    # region, which the coalescer never merges block to block.
    return Region(t.data_ptr(), max(kernel_stride, kernel_len), kernel_len, num_blocks)


def kv_regions(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[Region]:
    """Describe each layer's KV tensor as strided block regions.

    vLLM 0.32: a ``[num_blocks * ratio, H, N, C]`` view per layer, any
    ``KVCacheLayout``: one region per layer whose blocks are each one dense
    range. The older ``[2, num_blocks, ...]`` K/V-split form: two regions (K,
    V) per layer. Anything else is refused with the reason, never guessed.
    """
    regions: list[Region] = []
    for name, t in kv_caches.items():
        if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            # [2, num_blocks, block_size, H, D]: checked first, as the 4D views
            # below can also start with a 2 (two blocks, or one split in two).
            for half in range(2):
                regions.append(_layer_region(f"{name} ({'KV'[half]})", t[half], num_blocks))
        elif t.dim() >= 1 and t.shape[0] >= num_blocks > 0 and t.shape[0] % num_blocks == 0:
            regions.append(_layer_region(name, t, num_blocks))
        else:
            raise RuntimeError(
                f"PDConnector: unsupported KV cache layout for layer {name}: shape "
                f"{tuple(t.shape)} has no block dimension of {num_blocks} (or a multiple, "
                f"for kernel blocks) first, nor [2, {num_blocks}, ...]")
    return regions


def kernel_blocks_per_block(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> int:
    """How many kernel blocks vLLM split each manager block into (1: none).

    Two engines must agree on it: in a head-major layout (LBHNC, several
    heads) a block split into kernel blocks orders its bytes differently
    from an unsplit one of the same length (``AgentInfo.kernel_blocks``)."""
    t = next(iter(kv_caches.values()))
    if t.dim() == 5 and t.shape[0] == 2 and t.shape[1] == num_blocks:
        return 1
    return max(1, int(t.shape[0]) // num_blocks) if num_blocks > 0 else 1
