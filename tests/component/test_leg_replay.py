"""The EngineCore's replay check against vLLM's own request ids (issue 27 item 2).

A signed leg acts once per client request: the ``n`` children vLLM fans
out of one request (``ParentRequest``, ids from vLLM's own code here) share
its params and are admitted; the same params on any other request (another
id from ``InputProcessor.assign_request_id``) are a replay and refused.
"""

from __future__ import annotations

from types import SimpleNamespace

from vllm import SamplingParams
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.parallel_sampling import ParentRequest

from vllm_pd_ext import compat
from vllm_pd_ext.scheduler.legs import decode_leg
from vllm_pd_ext.wire import auth

RING = auth.Keyring.parse("s3cret-for-tests-0123456789", "test")
LEG = {"do_remote_decode": True}


def engine_request(external_id: str, n: int = 1) -> SimpleNamespace:
    req = SimpleNamespace(request_id=external_id, external_req_id=None,
                          params=SamplingParams(n=n, temperature=1.0))
    InputProcessor.assign_request_id(req)  # type: ignore[arg-type]
    return req


def test_n_children_share_a_signature_and_another_request_cannot() -> None:
    frame_auth = auth.FrameAuth(RING)
    signed = auth.sign_leg(RING, LEG, "rid-1", {"prompt": "x"})
    parent = ParentRequest(engine_request("cmpl-rid-1-0", n=3))  # type: ignore[arg-type]
    children = [parent.get_child_info(i)[0] for i in range(3)]
    assert len({compat.sibling_group(c) for c in children}) == 1
    for child in children:
        assert not decode_leg(signed, frame_auth, compat.sibling_group(child)).refused
    # The same X-Request-Id again (a replay through the API server): vLLM
    # gives it another random suffix, so it is another group.
    again = engine_request("cmpl-rid-1-0")
    replay = decode_leg(signed, frame_auth, compat.sibling_group(again.request_id))
    assert replay.refused and "already used" in replay.problem
    # Neither can a request whose id looks like a child of another parent.
    fake_child = "0_" + engine_request("cmpl-rid-1-0").request_id
    assert decode_leg(signed, frame_auth, compat.sibling_group(fake_child)).refused
