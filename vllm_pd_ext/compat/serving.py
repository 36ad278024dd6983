"""The API server's streamed answers carry ``kv_transfer_params`` (see ``patches``).

vLLM 0.32/0.33 put a finished request's ``kv_transfer_params`` in the
non-streaming completion and chat bodies only; multi-turn reuse needs D's
kept-turn params in a streamed answer too, so the chunk that carries the
choice's ``finish_reason`` gets them, as newer vLLM does.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any

from vllm_pd_ext.log import get_logger

logger = get_logger(__name__)

_TARGETS = (("vllm.entrypoints.openai.completion.serving", "OpenAIServingCompletion",
             "completion_stream_generator"),
            ("vllm.entrypoints.openai.chat_completion.serving", "OpenAIServingChat",
             "chat_completion_stream_generator"))
_patched = False


def _generators() -> list[tuple[type, str]]:
    import importlib

    out = []
    for module, cls_name, name in _TARGETS:
        cls = getattr(importlib.import_module(module), cls_name)
        out.append((cls, name))
    return out


def probe_stream_generators() -> str | None:
    """None if both stream generators take the ``result_generator`` we tap."""
    try:
        targets = _generators()
    except (ImportError, AttributeError) as exc:
        return f"stream generators not found: {exc}"
    for cls, name in targets:
        fn = getattr(cls, name, None)
        if fn is None:
            return f"{cls.__name__}.{name} is gone"
        if "result_generator" not in inspect.signature(fn).parameters:
            return f"{cls.__name__}.{name} takes no result_generator"
    return None


def stream_kv_transfer_params() -> None:
    """Wrap both stream generators so the finishing chunk carries the
    request's ``kv_transfer_params``. Costs nothing for requests without
    params. Idempotent. Call through ``patches.apply`` (it probes first)."""
    global _patched
    if _patched:
        return
    for cls, name in _generators():
        setattr(cls, name, _tap_kv_params(getattr(cls, name)))
    _patched = True


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


def kv_extra_config_of(app: Any) -> dict[str, Any] | None:
    """``kv_connector_extra_config`` as vLLM parsed it for this API server
    (``app.state.vllm_config``, set by ``init_app_state``; else the parsed
    ``args``): whatever form the command line used (``--kv-transfer-config``,
    ``--kv_transfer_config``, the dotted keys, ``--config file.yaml``).
    None when this app carries neither (not vLLM's API server, or no
    ``--kv-transfer-config``)."""
    state = getattr(app, "state", None)
    config = getattr(getattr(state, "vllm_config", None), "kv_transfer_config", None)
    if config is None:
        config = getattr(getattr(state, "args", None), "kv_transfer_config", None)
    if config is None:
        return None
    extra = (config.get("kv_connector_extra_config") if isinstance(config, dict)
             else getattr(config, "kv_connector_extra_config", None))
    return extra if isinstance(extra, dict) else {}
