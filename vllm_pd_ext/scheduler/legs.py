"""What a request asks of this engine, decoded once when it arrives.

A request's ``kv_transfer_params`` (set by the proxy, or by a client: treat
them as hostile) make it one *leg* of a P/D handoff. ``decode_leg`` decodes
and authenticates them once, in ``on_new_request``; the dispatcher routes
the request by ``Leg`` from then on and never re-reads the raw dict.

Pure (no vLLM): the caller passes the raw params and the engine's
``FrameAuth``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from vllm_pd_ext.wire import auth
from vllm_pd_ext.wire.protocol import KVTransferParams, ParamsError, decode_params


class Leg(enum.Enum):
    """The part a request plays in a handoff."""

    #: No params, or params that ask for nothing: an ordinary request.
    NONE = "none"
    #: Params that do not decode and do not ask D to load KV: the request runs
    #: as an ordinary one and its KV is not handed over (logged at its end).
    MALFORMED = "malformed"
    #: P leg asking only for this engine's identity (``pd_ext_probe``).
    PROBE = "probe"
    #: P leg: prefill, then hand the KV to D (pull: lend; push: write). With
    #: ``params.is_readback`` it first reads the conversation's kept turn back.
    P_HANDOFF = "p_handoff"
    #: D leg: load the prompt's KV from P, then decode (``do_remote_prefill``).
    D_LOAD = "d_load"
    #: A turn D prefills itself and keeps for the next turn (``pd_bidirectional``
    #: alone: the proxy decided to prefill locally).
    LOCAL_TURN = "local_turn"


@dataclass(frozen=True)
class DecodedLeg:
    kind: Leg
    params: KVTransferParams | None = None
    #: Why the params cannot be acted on (malformed, unsigned); "" if they can.
    #: A refused D leg fails its load with this; a refused P leg or local turn
    #: runs as an ordinary request and hands nothing over.
    problem: str = ""
    #: The problem is a failed signature check (counted apart).
    unauthenticated: bool = False

    @property
    def refused(self) -> bool:
        return bool(self.problem)


def kind_of(params: KVTransferParams | None) -> Leg:
    if params is None:
        return Leg.NONE
    if params.do_remote_prefill:
        return Leg.D_LOAD
    if params.do_remote_decode:
        return Leg.PROBE if params.pd_ext_probe else Leg.P_HANDOFF
    if params.pd_bidirectional:
        return Leg.LOCAL_TURN
    return Leg.NONE


def decode_leg(raw: Any, frame_auth: auth.FrameAuth | None, group: str = "") -> DecodedLeg:
    """The request's leg, its typed params, and why they are refused if they are.

    Every leg that asks for something privileged (a handoff either way, or a
    kept turn) must carry the proxy's signature when the engine has a shared
    secret; the API server's middleware (``leg_auth.py``) refused a bad one
    already, and this is the EngineCore's own check, so an engine started
    without that middleware still never acts on an unsigned leg. A
    signature acts once per client request (``group``: its ``n`` children
    share it), inside the window (``FrameAuth.admit_leg``).
    """
    try:
        params = decode_params(raw)
    except ParamsError as exc:
        if isinstance(raw, dict) and not raw.get("do_remote_prefill"):
            return DecodedLeg(Leg.MALFORMED, problem=str(exc))
        # Possibly a D leg: its load fails (vLLM's failure policy applies).
        return DecodedLeg(Leg.D_LOAD, problem=str(exc))
    kind = kind_of(params)
    if kind is Leg.NONE or frame_auth is None:
        return DecodedLeg(kind, params)
    try:
        frame_auth.admit_leg(raw, group)
    except auth.AuthError as exc:
        return DecodedLeg(kind, params, problem=f"unauthenticated kv_transfer_params: "
                          f"{exc.reason}", unauthenticated=True)
    return DecodedLeg(kind, params)
