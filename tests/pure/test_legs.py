"""A request's leg, decoded once (``scheduler/legs.py``) and its load state.

Pure: the same decisions the dispatcher routes on, without vLLM.
"""

from __future__ import annotations

import pytest

from vllm_pd_ext.scheduler.legs import Leg, decode_leg
from vllm_pd_ext.scheduler.load_state import Load, LoadState
from vllm_pd_ext.wire import auth

D_LEG = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r",
         "remote_host": "127.0.0.1", "remote_port": 5600, "remote_block_ids": [[1, 2]]}
RING = auth.Keyring.parse("s3cret-for-tests-0123456789", "test")


@pytest.mark.parametrize("raw, kind", [
    (None, Leg.NONE),
    ({}, Leg.NONE),
    ({"do_remote_decode": True}, Leg.P_HANDOFF),
    ({"do_remote_decode": True, "pd_ext_probe": True}, Leg.PROBE),
    (D_LEG, Leg.D_LOAD),
    ({"pd_bidirectional": True}, Leg.LOCAL_TURN),
    ({"do_remote_decode": "maybe"}, Leg.MALFORMED),
    ({"do_remote_prefill": True, "remote_port": "x"}, Leg.D_LOAD),
    ({**D_LEG, "remote_port": 70000}, Leg.D_LOAD),
    (["not", "a", "dict"], Leg.D_LOAD),
])
def test_each_kind_and_what_a_malformed_leg_becomes(raw, kind):
    leg = decode_leg(raw, None)
    assert leg.kind is kind
    malformed = kind is Leg.MALFORMED or (kind is Leg.D_LOAD and raw is not D_LEG)
    assert leg.refused is malformed and not leg.unauthenticated
    assert (leg.params is None) is (malformed or raw is None)
    if malformed:
        assert "kv_transfer_params" in leg.problem  # names the field


@pytest.mark.parametrize("raw", [D_LEG, {"do_remote_decode": True}, {"pd_bidirectional": True},
                                 {"do_remote_decode": True, "pd_ext_probe": True}])
def test_every_privileged_leg_needs_the_proxys_signature(raw):
    frame_auth = auth.FrameAuth(RING)
    unsigned = decode_leg(raw, frame_auth)
    assert unsigned.refused and unsigned.unauthenticated
    assert unsigned.problem.startswith("unauthenticated kv_transfer_params")
    signed = decode_leg(auth.sign_leg(RING, raw, "req-1", {"prompt": "x"}), frame_auth)
    assert not signed.refused and signed.kind is decode_leg(raw, None).kind


def test_an_ordinary_request_needs_no_signature():
    assert not decode_leg(None, auth.FrameAuth(RING)).refused
    assert not decode_leg({"remote_prefill_cached_tokens": 3}, auth.FrameAuth(RING)).refused


class Rec(Load):
    pass


def test_load_state_transitions():
    done = Rec()
    assert done.state is LoadState.WAITING and not done.in_flight
    done.allocate(loading=True)
    assert done.state is LoadState.LOADING and done.in_flight
    assert done.reported() is False and done.state is LoadState.READY
    assert done.end() is True

    ended = Rec()
    ended.allocate(loading=True)
    assert ended.end() is False and ended.state is LoadState.ENDED and ended.in_flight
    assert ended.reported() is True  # the record goes once the workers reported

    cached = Rec()
    cached.allocate(loading=False)
    assert cached.state is LoadState.READY and cached.end() is True
    assert Rec().end() is True  # ended before allocation: nothing in flight
    with pytest.raises(AssertionError):
        cached.allocate(loading=True)  # allocated once only


class WallClock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("raw", [D_LEG, {"do_remote_decode": True}, {"pd_bidirectional": True}])
def test_the_enginecore_refuses_a_replayed_or_stale_signature(raw):
    """Issue 27 item 2: whatever reached the EngineCore past (or around) the
    API server's check, a signature acts once, and only inside the window."""
    clock = WallClock()
    frame_auth = auth.FrameAuth(RING, window_s=30.0, clock=clock)
    signed = auth.sign_leg(RING, raw, "req-1", {"prompt": "x"}, now=clock.now)
    assert not decode_leg(signed, frame_auth).refused
    again = decode_leg(dict(signed), frame_auth)  # the same leg, e.g. with another prompt
    assert again.refused and again.unauthenticated and "already used" in again.problem
    clock.now += 31
    late = decode_leg(auth.sign_leg(RING, raw, "req-2", {"prompt": "x"}, now=clock.now - 40),
                      frame_auth)
    assert late.refused and late.unauthenticated and "window" in late.problem
    # A fresh signature is served; the cache forgets what the window covers.
    assert not decode_leg(auth.sign_leg(RING, raw, "req-3", {"prompt": "x"}, now=clock.now),
                          frame_auth).refused
    assert frame_auth.num_nonces == 1
