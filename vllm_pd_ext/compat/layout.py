"""How vLLM lays out a layer's KV cache, as NIXL regions and compat info.

``kv_regions`` turns the per-layer tensors vLLM hands ``register_kv_caches``
into strided block regions (``protocol.Region``: block ``i`` at
``base_addr + i * block_stride``, ``block_len`` bytes); ``compat_info`` is
what two engines must agree on to exchange blocks (the handshake compares
it field by field). Both depend on vLLM's layout conventions, hence here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_pd_ext.wire.protocol import PROTOCOL_VERSION, CompatInfo, Region

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig


def kv_layout_name(vllm_config: VllmConfig) -> str:
    from vllm.platforms import current_platform

    return "LBHNC" if current_platform.is_cpu() else "NHD"


def compat_info(vllm_config: VllmConfig, transfer_mode: str) -> CompatInfo:
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
        transfer_mode=str(transfer_mode),
    )


def _served_name(model_config: Any) -> str:
    name = model_config.served_model_name or model_config.model
    if isinstance(name, list | tuple):
        name = name[0]
    return str(name)


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
