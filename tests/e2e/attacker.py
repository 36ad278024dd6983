"""A third process on the KV network with the wrong secret (issues 12 and 27).

``python -m tests.e2e.attacker SPEC_JSON`` tries, against real engines, to
handshake with P (for its NIXL metadata), pin, renew and release one of P's
live leases, register a push, and send handoff legs to P and D over HTTP:
unsigned, signed with its own (wrong) secret, and a legitimately signed leg
paired with another prompt. It prints one JSON object: per attempt, the
error code or HTTP status it got and whether any NIXL metadata came back.

With ``"round": 2`` in the spec (issue 27) it instead floods P's side
channel with many-part messages (each 512 MiB in 8 MiB frames, under the
per-frame limit) from a plain socket and from a CURVE socket with a random
key, and sends legs that used to slip past the checks: a captured signed P
leg replayed after the window (as is, with the key escaped, and with
another prompt), a fresh captured one replayed at once, escaped unsigned D
and keep legs, and a signed leg with a batch of prompts.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from typing import Any

from vllm_pd_ext.wire import auth
from vllm_pd_ext.wire import protocol as proto
from vllm_pd_ext.wire.side_channel import SideChannelClient, SideChannelError


def side_channel(client: SideChannelClient, host: str, port: int,
                 msg: proto.Request) -> dict[str, Any]:
    try:
        reply = client.request(host, port, msg)
    except SideChannelError as exc:
        return {"code": exc.code, "message": str(exc), "metadata": False}
    return {"code": "accepted", "message": repr(reply)[:200],
            "metadata": isinstance(reply, proto.HandshakeReply)}


def http(url: str, body: dict[str, Any], rid: str, escape: bool = False) -> dict[str, Any]:
    data = json.dumps(body)
    if escape:  # the key spelled with a JSON escape: decodes the same
        data = data.replace('"kv_transfer_params"', '"kv_transfer\\u005fparams"')
    req = urllib.request.Request(url + "/v1/completions", data=data.encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": rid})
    try:
        print(f"POST {url} {rid[:12]}", file=sys.stderr, flush=True)
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"status": r.status, "message": r.read()[:4000].decode(errors="replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "message": exc.read()[:300].decode(errors="replace")}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    wrong = auth.Keyring.parse(spec["secret"], "attacker")
    # 10 s: on a loaded 2-core CI machine P once took over 3 s to refuse a frame.
    signed = SideChannelClient(10.0, auth=auth.FrameAuth(wrong))
    unsigned = SideChannelClient(10.0)
    host, p_port, d_port = spec["host"], spec["p_side_channel"], spec["d_side_channel"]
    compat = proto.CompatInfo(**spec["compat"])
    lease = spec["params"]["remote_request_id"]
    me = "eng-attacker"
    out: dict[str, Any] = {}
    for name, client in (("wrong_key", signed), ("unsigned", unsigned)):
        out[f"handshake_{name}"] = side_channel(client, host, p_port, proto.HandshakeRequest(
            engine_id=me, tp_rank=0, compat=compat))
        out[f"pin_{name}"] = side_channel(client, host, p_port, proto.LeaseRenew(
            engine_id=me, request_ids=[lease], acquire=True, tp_rank=0, consumer="x"))
        out[f"heartbeat_{name}"] = side_channel(client, host, p_port, proto.LeaseRenew(
            engine_id=me, request_ids=[lease]))
        out[f"release_{name}"] = side_channel(client, host, p_port, proto.LeaseRelease(
            engine_id=me, request_ids=[lease], tp_rank=0))
        out[f"register_{name}"] = side_channel(client, host, p_port, proto.PushRegister(
            engine_id=me, compat=compat, expect_engine_id=spec["params"]["remote_engine_id"],
            pd_request_id=lease, request_id="x", notify_host=host, notify_port=d_port,
            agents=[], first_block=0, block_ids=[0], num_tokens=1, ttl_s=5.0))
        out[f"result_to_d_{name}"] = side_channel(client, host, d_port, proto.PushResult(
            engine_id=me, pd_request_id=lease, tp_rank=-1, ok=False))
    body, other = spec["body"], spec["other_body"]
    rid = spec["rid"]
    out["d_leg_unsigned"] = http(spec["d_url"], dict(body, kv_transfer_params={
        k: v for k, v in spec["signed_params"].items() if k != auth.LEG_FIELD}), rid)
    out["d_leg_wrong_key"] = http(spec["d_url"], dict(body, kv_transfer_params=auth.sign_leg(
        wrong, spec["params"], rid, body)), rid)
    out["d_leg_other_prompt"] = http(spec["d_url"], dict(
        other, kv_transfer_params=spec["signed_params"]), rid)
    out["p_leg_unsigned"] = http(spec["p_url"], dict(
        body, max_tokens=1, kv_transfer_params={"do_remote_decode": True}), rid)
    signed.close()
    unsigned.close()
    return out


FRAME = 8 << 20
FRAMES = 64  # 512 MiB a message
MESSAGES = 4


def flood(host: str, port: int, curve_keys: bool) -> dict[str, Any]:
    """``MESSAGES`` many-part messages; ``curve_keys``: a CURVE socket with a
    random key (the server's key is public by design), else a plain one."""
    import zmq

    from vllm_pd_ext.testing.flood import many_part_flood

    res = many_part_flood(host, port, zmq.curve_keypair() if curve_keys else None,
                          frame_bytes=FRAME, frames=FRAMES, messages=MESSAGES, settle_s=3.0)
    print(f"flood curve={curve_keys}: {res.queued} message(s) queued", file=sys.stderr,
          flush=True)
    return {"queued_mib": res.queued * FRAMES * FRAME >> 20, "reply": res.replied}


def round_two(spec: dict[str, Any]) -> dict[str, Any]:
    host, p_port = spec["host"], spec["p_side_channel"]
    out: dict[str, Any] = {"flood_plain": flood(host, p_port, False),
                           "flood_curve": flood(host, p_port, True)}
    p_url, d_url = spec["p_url"], spec["d_url"]
    stale, body, other = spec["stale_p_leg"], spec["body"], spec["other_body"]
    rid = spec["rid"]
    out["stale_p_leg"] = http(p_url, dict(body, kv_transfer_params=stale), rid)
    out["stale_p_leg_escaped"] = http(p_url, dict(body, kv_transfer_params=stale), rid,
                                      escape=True)
    out["stale_p_leg_escaped_other_prompt"] = http(
        p_url, dict(other, kv_transfer_params=stale), rid, escape=True)
    fresh = spec["fresh_p_leg"]  # already used once by the operator
    out["fresh_p_leg_replayed"] = http(p_url, dict(body, max_tokens=1,
                                                   kv_transfer_params=fresh), rid)
    out["fresh_p_leg_escaped_other_prompt"] = http(
        p_url, dict(other, max_tokens=1, kv_transfer_params=fresh), rid, escape=True)
    out["d_leg_unsigned_escaped"] = http(d_url, dict(body, kv_transfer_params=spec[
        "unsigned_d_params"]), rid, escape=True)
    out["keep_leg_unsigned"] = http(d_url, dict(body, kv_transfer_params={
        "pd_bidirectional": True}), rid)
    out["keep_leg_unsigned_escaped"] = http(d_url, dict(body, kv_transfer_params={
        "pd_bidirectional": True}), rid, escape=True)
    out["batch_p_leg"] = http(p_url, dict(spec["batch_body"], kv_transfer_params=spec[
        "batch_p_leg"]), spec["batch_rid"])
    return out


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(round_two(spec) if spec.get("round") == 2 else main(spec)))
