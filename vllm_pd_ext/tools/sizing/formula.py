"""KV sizing and the handoff floor: what one prompt's KV weighs and how long
it takes, at best, to cross a link (the pure core of ``vllm-pd-size``).

Pure: no vLLM, torch or NIXL, so it runs anywhere the base package is
installed. The formula (docs/sizing.md):

    KV bytes           = bytes_per_token x prompt_tokens
    bytes_per_token    = 2 x layers x kv_heads x head_dim x bytes_per_element    (K and V)
                       = layers x (kv_lora_rank + qk_rope_head_dim) x bytes/elem  (MLA latent)
    bandwidth floor ms = KV bytes / (GB/s x 1e9) x 1000
    handoff floor ms   = setup_ms + bandwidth floor ms

``GB/s`` is sustained payload bandwidth (1e9 bytes), the setup term is
modelled apart; the floor is one logical payload over one equivalent link,
not a tail latency. ``spec_from_config`` reads a Hugging Face ``config.json``
and refuses, naming the field, what it cannot size.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

#: Bytes per KV element by dtype name (config ``torch_dtype`` or ``--kv-dtype``).
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "half": 2, "bfloat16": 2,
               "bf16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1,
               "int8": 1}
#: Config keys that mark a model whose KV is not one attention cache per
#: layer (state-space or hybrid layers): its size is not this formula.
_HYBRID_KEYS = ("layers_block_type", "hybrid_override_pattern", "attn_layer_indices",
                "mamba_d_state", "ssm_cfg")


class SizingError(ValueError):
    """A model description this calculator cannot size; names the field."""


@dataclass(frozen=True)
class KVSpec:
    """What one token's KV cache is made of."""

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_element: int
    #: MLA (DeepSeek-style latent KV): one latent of this width per layer
    #: instead of K and V per head. 0: standard attention.
    latent_dim: int = 0
    source: str = "explicit"

    @property
    def bytes_per_token(self) -> int:
        if self.latent_dim:
            return self.layers * self.latent_dim * self.bytes_per_element
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_element

    def with_dtype(self, dtype: str) -> KVSpec:
        return replace(self, bytes_per_element=dtype_bytes(dtype, "kv dtype"))


def dtype_bytes(name: str, field: str) -> int:
    try:
        return DTYPE_BYTES[str(name).lower().removeprefix("torch.")]
    except KeyError:
        raise SizingError(f"{field}={name!r}: unknown dtype; accepted: "
                          f"{', '.join(sorted(DTYPE_BYTES))}") from None


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SizingError(f"config.json: {key}={value!r}: expected a positive integer")
    return value


def spec_from_config(cfg: Mapping[str, Any], kv_dtype: str | None = None,
                     source: str = "config.json") -> KVSpec:
    """The KV spec of a Hugging Face model config (``text_config`` of a
    multimodal one). GQA: ``num_key_value_heads`` (absent: every attention
    head has its own KV); ``head_dim`` explicit or ``hidden_size /
    num_attention_heads``; MLA when ``kv_lora_rank`` is set."""
    if not isinstance(cfg, Mapping):
        raise SizingError("config.json: expected a JSON object")
    text = cfg.get("text_config")
    if isinstance(text, Mapping):
        cfg = {**cfg, **text}
    for key in _HYBRID_KEYS:
        if cfg.get(key) is not None:
            raise SizingError(f"config.json: {key} is set: a hybrid or state-space model's KV "
                              "is not one attention cache per layer; size it by hand")
    layer_key = next((k for k in ("num_hidden_layers", "n_layer", "num_layers") if k in cfg),
                     "num_hidden_layers")
    layers = _positive_int(cfg, layer_key)
    dtype = kv_dtype or cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype is None:
        raise SizingError("config.json: torch_dtype is missing; give the KV dtype (--kv-dtype)")
    nbytes = dtype_bytes(dtype, "kv dtype" if kv_dtype else "config.json: torch_dtype")
    if cfg.get("kv_lora_rank") is not None:
        latent = _positive_int(cfg, "kv_lora_rank") + int(cfg.get("qk_rope_head_dim") or 0)
        return KVSpec(layers=layers, kv_heads=1, head_dim=latent, bytes_per_element=nbytes,
                      latent_dim=latent, source=source)
    heads = _positive_int(cfg, "num_attention_heads")
    kv_heads = (_positive_int(cfg, "num_key_value_heads")
                if cfg.get("num_key_value_heads") is not None else heads)
    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, "head_dim")
    else:
        hidden = _positive_int(cfg, "hidden_size")
        if hidden % heads:
            raise SizingError(f"config.json: hidden_size={hidden} is not a multiple of "
                              f"num_attention_heads={heads}; give head_dim")
        head_dim = hidden // heads
    return KVSpec(layers=layers, kv_heads=kv_heads, head_dim=head_dim,
                  bytes_per_element=nbytes, source=source)


def load_config(path: str | Path) -> dict[str, Any]:
    """``config.json`` from a file or a model directory."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise SizingError(f"{p}: no such file") from None
    except (OSError, ValueError) as exc:
        raise SizingError(f"{p}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise SizingError(f"{p}: expected a JSON object")
    return data


@dataclass(frozen=True)
class LinkFloor:
    effective_bandwidth_gb_s: float
    bandwidth_floor_ms: float
    handoff_floor_ms: float
    within_budget: bool


@dataclass(frozen=True)
class PromptSize:
    prompt_tokens: int
    kv_bytes: int
    kv_mib: float
    links: list[LinkFloor]


def handoff(spec: KVSpec, prompt_tokens: int, links_gb_s: Sequence[float], setup_ms: float,
            budget_ms: float) -> PromptSize:
    """One prompt's KV bytes and its floor over each link."""
    if prompt_tokens <= 0:
        raise SizingError(f"prompt tokens must be > 0, got {prompt_tokens}")
    kv_bytes = spec.bytes_per_token * prompt_tokens
    floors = []
    for gb_s in links_gb_s:
        if not gb_s > 0:
            raise SizingError(f"link bandwidth must be > 0 GB/s, got {gb_s}")
        bw_ms = kv_bytes / (gb_s * 1e9) * 1000
        total = setup_ms + bw_ms
        floors.append(LinkFloor(gb_s, bw_ms, total, total <= budget_ms))
    return PromptSize(prompt_tokens, kv_bytes, kv_bytes / 2**20, floors)


def report(spec: KVSpec, prompts: Sequence[int], links_gb_s: Sequence[float], setup_ms: float,
           budget_ms: float, short_tokens: int | None = None,
           sensitivity_dtype: str | None = "fp8") -> dict[str, Any]:
    """Everything ``vllm-pd-size`` prints, as plain data (its ``--json``)."""
    out: dict[str, Any] = {
        "scope": "KV transfer floor: full logical KV over one equivalent link, setup apart",
        "spec": asdict(spec), "bytes_per_token": spec.bytes_per_token,
        "setup_ms": setup_ms, "handoff_budget_ms": budget_ms,
        "prompts": [asdict(handoff(spec, n, links_gb_s, setup_ms, budget_ms)) for n in prompts],
    }
    if short_tokens:
        slowest = min(links_gb_s)
        short = handoff(spec, short_tokens, [slowest], setup_ms, budget_ms)
        out["short_prompt_case"] = {"prompt_tokens": short_tokens,
                                    "effective_bandwidth_gb_s": slowest,
                                    "kv_bytes": short.kv_bytes,
                                    "handoff_floor_ms": short.links[0].handoff_floor_ms}
    if sensitivity_dtype and dtype_bytes(sensitivity_dtype, "sensitivity dtype") != (
            spec.bytes_per_element):
        alt = spec.with_dtype(sensitivity_dtype)
        out["sensitivity"] = {
            "kv_dtype": sensitivity_dtype, "bytes_per_token": alt.bytes_per_token,
            "prompts": [asdict(handoff(alt, n, links_gb_s, setup_ms, budget_ms))
                        for n in prompts]}
    return out
