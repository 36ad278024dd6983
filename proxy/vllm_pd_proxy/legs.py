"""Request bodies of the prefill (P) and decode (D) legs.

Role: pure functions from the client's parsed request body to each leg's body,
implementing the ``kv_transfer_params`` handshake shared by vLLM's in-tree
NixlConnector and vllm_pd_ext's connector (same wire format):

* pull: P gets a 1-token, non-streaming copy with ``do_remote_decode``; P's
  answer carries ``kv_transfer_params`` that D gets verbatim with the
  original body, and D reads the KV from P.
* concurrent pull (token #1 from P, ``--concurrent-dispatch``): both legs
  are sent at once, matched by ``pd_request_id``; D learns P's identity
  from the proxy's probe cache, parks the request until P, asked over the
  side channel, names its blocks and token #1, then reads the KV.
* push: both legs are sent at once; D learns P's identity from the proxy's
  probe cache and P pushes the KV to D, matched by ``pd_request_id``.

No I/O and no state: the flows (:mod:`vllm_pd_proxy.pull`,
:mod:`vllm_pd_proxy.push`, the local one in :mod:`vllm_pd_proxy.forward`)
call these once per request.
"""

from __future__ import annotations

from typing import Any

from vllm_pd_ext.wire.protocol import TransferMode

from .backends import PrefillIdentity

# Sampling fields P must not see: it only prefills and emits one token, once.
# n and best_of: D samples the n children from the one KV P hands over.
_P_LEG_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens", "n", "best_of")


def prefill_body(body: dict[str, Any], kv_params: dict[str, Any] | None, responses: bool = False,
                 seeding: bool = False) -> dict[str, Any]:
    """The P leg: the client body cut down to one non-streaming prefill, one token
    (``kv_params`` None: an ordinary request, its answer the client's).

    ``responses``: a Responses API body (``/v1/responses``), whose limit is
    ``max_output_tokens``; P neither stores its one-token answer nor runs
    it in the background (both refused for the client's request upstream).
    ``seeding``: P's token is the client's token #1
    (:mod:`vllm_pd_proxy.first_token`): P returns the token ids, and a
    client's ``min_tokens`` keeps token #1 from being EOS there too.
    """
    leg = {k: v for k, v in body.items() if k not in _P_LEG_DROPPED}
    if seeding:
        leg["return_token_ids"] = True
        if _least(body) > 0:
            leg["min_tokens"] = 1
    if responses:
        leg["max_output_tokens"] = 1
        leg["store"] = False
        leg["background"] = False
    else:
        leg["max_tokens"] = 1
        if "max_completion_tokens" in leg:
            leg["max_completion_tokens"] = 1
    leg["stream"] = False
    if kv_params is None:  # a one-token answer from P alone: no handoff
        leg.pop("kv_transfer_params", None)
    else:
        leg["kv_transfer_params"] = kv_params
    return leg


def _least(body: dict[str, Any]) -> int:
    for key in ("min_tokens", "min_completion_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def decode_body(body: dict[str, Any], kv_params: dict[str, Any] | None,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The D leg: the client body plus ``kv_params`` (None: local prefill)
    and ``extra`` (what the proxy asks D for itself: ``return_token_ids``)."""
    leg = dict(body)
    if extra:
        leg.update(extra)
    if kv_params is None:
        leg.pop("kv_transfer_params", None)
    else:
        leg["kv_transfer_params"] = kv_params
    return leg


def pull_prefill_params(first_token: bool = False,
                        request_id: str | None = None) -> dict[str, Any]:
    """P-leg params in pull mode; identical to vLLM's toy proxy, plus
    ``pd_first_token`` when the proxy sends P's token #1 itself, and
    ``pd_request_id`` for a concurrent pull (the key D's leg, sent at the
    same time, asks P for the blocks under)."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    if first_token:
        params["pd_first_token"] = True
    if request_id is not None:
        params["pd_request_id"] = request_id
    return params


def pull_wait_decode_params(identity: PrefillIdentity, request_id: str) -> dict[str, Any]:
    """D-leg params of a concurrent pull, sent with P's leg: which P to ask
    for the blocks of ``pd_request_id`` (push's D leg in pull mode, no
    ``remote_block_ids``: D learns them, and token #1, from P once the
    prefill is done). D keeps no turn: token #1 from P is never a
    multi-turn request."""
    return dict(push_decode_params(identity, request_id),
                transfer_mode=TransferMode.PULL.value, pd_seed_pending=True,
                pd_bidirectional=False)


def push_prefill_params(request_id: str, first_token: bool = False) -> dict[str, Any]:
    """P-leg params in push mode: P pushes the KV for ``pd_request_id``."""
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_mode": TransferMode.PUSH.value,
        "pd_request_id": request_id,
    }
    if first_token:
        params["pd_first_token"] = True
    return params


def push_decode_params(identity: PrefillIdentity, request_id: str) -> dict[str, Any]:
    """D-leg params in push mode: where the KV comes from and under which id."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": identity.engine_id,
        "remote_host": identity.host,
        "remote_port": identity.port,
        "tp_size": identity.tp_size,
        "remote_request_id": request_id,
        "pd_request_id": request_id,
        "transfer_mode": TransferMode.PUSH.value,
    }
