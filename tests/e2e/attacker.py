"""A third process on the KV network with the wrong secret (issue 12 item 6).

``python -m tests.e2e.attacker SPEC_JSON`` tries, against real engines, to
handshake with P (for its NIXL metadata), pin, renew and release one of P's
live leases, register a push, and send handoff legs to P and D over HTTP:
unsigned, signed with its own (wrong) secret, and a legitimately signed leg
paired with another prompt. It prints one JSON object: per attempt, the
error code or HTTP status it got and whether any NIXL metadata came back.
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


def http(url: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "X-Request-Id": rid})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"status": r.status, "message": r.read()[:200].decode(errors="replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "message": exc.read()[:300].decode(errors="replace")}


def main(spec: dict[str, Any]) -> dict[str, Any]:
    wrong = auth.Keyring.parse(spec["secret"], "attacker")
    signed = SideChannelClient(3.0, auth=auth.FrameAuth(wrong))
    unsigned = SideChannelClient(3.0)
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


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
