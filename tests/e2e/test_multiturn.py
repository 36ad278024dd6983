"""Multi-turn conversations on real engines: D keeps each turn, P reads it back.

Engines run ``bidirectional_kv_xfer`` behind ``vllm-pd-proxy --multi-turn``.
Every turn is checked against the collocated ``ref`` engine given the same
full history (the oracle), and against the engines' own counters: from
turn 2, P's external-KV tokens are the history D kept (read back over NIXL,
``readback_tokens``), P computes only what follows it, and D loads only the
new blocks from P (its own prefix cache holds the history).
"""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    BLOCK_SIZE,
    CACHE_HIT,
    EXTERNAL,
    assert_same_as_reference,
    completion_body,
    delta,
    log_dir,
    open_stream,
    poke,
    stream_text,
    token_prompt,
)
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.oracle import output_of, stream_output

pytestmark = pytest.mark.engine

BLOCK = BLOCK_SIZE  # 128 on CPU: a kept turn is read back in whole blocks
COMPUTED = "vllm:prompt_tokens_by_source_total[local_compute]"
READBACK = "vllm:pd_ext_readback_tokens_total"
READBACK_BYTES = "vllm:pd_ext_readback_bytes_total"
KEPT = "vllm:pd_ext_turns_kept_total"
USAGE = "vllm:kv_cache_usage_perc"


def _sample(url: str, series: str, label: str) -> float:
    """A Prometheus counter's value summed over the samples with ``label``."""
    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(series + "{") and label in line)


def _fallbacks(engine: Engine, reason: str) -> float:
    return _sample(engine.url, "vllm:pd_ext_readback_fallbacks_total", f'reason="{reason}"')


def _proxy_count(proxy: Proxy, outcome: str) -> float:
    return _sample(proxy.url, "pd_proxy_multi_turn_total", f'outcome="{outcome}"')


def _kept_tokens(prompt: list[int], answer: list[int]) -> int:
    """What D keeps of a finished turn: the full blocks of every token whose
    KV it computed (all but the last sampled one)."""
    return (len(prompt) + len(answer) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def pull_engines(model: str) -> Iterator[dict[str, Any]]:
    """P and two Ds (bidirectional, pull) behind a ``--multi-turn`` proxy. The
    push set is test_multiturn_push.py's: a module of its own, so that the
    two sets never run at once (the engine budget, tests/e2e/engine_set.py)."""
    logs = log_dir("multiturn-pull")
    pull = {"bidirectional_kv_xfer": True, "handshake_timeout": 2.0}
    engs = {
        # Without a prefix cache of its own (the push P has one): every
        # history token P does not compute comes back from D.
        "p": Engine("mt-p", model, logs, role="kv_both", cpu_bind="0",
                    extra_config=pull, failure_policy="fail",
                    extra_args=["--no-enable-prefix-caching"]),
        "d0": Engine("mt-d0", model, logs, role="kv_both", cpu_bind="1",
                     extra_config=pull, failure_policy="fail"),
        "d1": Engine("mt-d1", model, logs, role="kv_both", cpu_bind="1",
                     extra_config=pull, failure_policy="fail"),
    }
    with engine_set(*engs.values()):
        px = Proxy([engs["p"].url], [engs["d0"].url, engs["d1"].url], logs,
                   args=["--multi-turn", "--health-interval", "1"]).start()
        try:
            yield {**engs, "proxy": px.wait_ready()}
        finally:
            px.stop()


def _four_turns(ref: Engine, model: str, engs: dict[str, Any], seed: int) -> None:
    """Four turns of one token-id conversation through the proxy (turns 2
    and 4 streamed), each checked exactly against the counters."""
    p, proxy = engs["p"], engs["proxy"]
    ds = [engs[k] for k in ("d0", "d1") if k in engs]
    session = {"X-Session-Id": f"four-{seed}"}
    prompt = token_prompt(150, seed)
    prev: tuple[list[int], list[int]] | None = None
    for turn in range(1, 5):
        # Answers longer than a block: every turn adds a block D has and P lacks.
        body = completion_body(model, prompt, max_tokens=130, ignore_eos=True)
        _, want = ref.post("/v1/completions", body)
        p0, d0 = p.metrics(), [d.metrics() for d in ds]
        if turn % 2 == 0:
            _, events = _stream(proxy, body, session)
            got = stream_output(events)
        else:
            status, answer = proxy.post("/v1/completions", body, headers=session)
            assert status == 200, answer
            assert "kv_transfer_params" not in answer  # engine addresses stay inside
            got = output_of(answer)
        p1, d1 = p.metrics(), [d.metrics() for d in ds]
        assert_same_as_reference(ref, got, want)
        # KV moved P -> D: D loaded from P what its own cache did not hold.
        loaded = sum(delta(a, b, EXTERNAL) for a, b in zip(d0, d1, strict=True))
        assert loaded > 0, f"turn {turn}: D loaded nothing from P"
        if prev is None:
            assert delta(p0, p1, READBACK) == 0
        else:
            kept = _kept_tokens(*prev)
            hit = delta(p0, p1, CACHE_HIT)
            # The history came back from D: everything D kept that P's own
            # prefix cache (the previous prompt's blocks) did not hold.
            assert delta(p0, p1, EXTERNAL) == kept - hit > 0, (turn, kept, hit)
            assert delta(p0, p1, READBACK) == kept - hit
            assert delta(p0, p1, READBACK_BYTES) > 0
            # P computed only the new suffix.
            assert delta(p0, p1, COMPUTED) == len(prompt) - kept, (turn, len(prompt), kept)
            # D's prefix cache served the history: it loaded only new blocks.
            assert loaded <= len(prompt) - kept + BLOCK, (turn, loaded)
        prev = (list(prompt), list(got.tokens))
        prompt = prompt + list(got.tokens) + token_prompt(40, seed * 10 + turn)


def _stream(proxy: Proxy, body: dict[str, Any], headers: dict[str, str],
            path: str = "/v1/completions") -> tuple[str, list[Any]]:
    text, events = stream_text(proxy.url + path, body, headers=headers)
    assert all("kv_transfer_params" not in ev for ev in events if isinstance(ev, dict))
    return text, events


def test_four_turns_pull(ref: Engine, model: str, pull_engines: dict[str, Any]) -> None:
    _four_turns(ref, model, pull_engines, seed=301)


def test_four_turn_chat_pull(ref: Engine, model: str, pull_engines: dict[str, Any]) -> None:
    """A real chat: messages, the chat template, the client's own history
    (retokenized answers), streamed and not; keyed by the conversation's
    opening (no session header). The random-weight model's answers do not
    retokenize to the ids it generated, so P matches D's history up to the
    first answer block only: the hash check at work. This P has no prefix
    cache, so every matching block comes back from D."""
    p, proxy = pull_engines["p"], pull_engines["proxy"]
    messages = [{"role": "system", "content": "You answer briefly and precisely. " * 20},
                {"role": "user", "content": "Tell me about sorting lists in Python. " * 12}]
    for turn in range(1, 5):
        body = {"model": model, "temperature": 0, "max_tokens": 130, "ignore_eos": True,
                "return_token_ids": True, "messages": messages}
        _, want = ref.post("/v1/chat/completions", body)
        before = p.metrics()
        if turn % 2 == 0:
            text, events = _stream(proxy, body, {}, "/v1/chat/completions")
            got = stream_output(events)
        else:
            status, answer = proxy.post("/v1/chat/completions", body)
            assert status == 200, answer
            got = output_of(answer)
            text = got.text
        after = p.metrics()
        assert_same_as_reference(ref, got, want)
        print(f"chat turn {turn}: prompt {len(got.prompt)} read back "
              f"{delta(before, after, READBACK)} hit {delta(before, after, CACHE_HIT)}")
        if turn > 1:
            assert delta(before, after, READBACK) > 0, f"turn {turn}: nothing read back"
            assert delta(before, after, EXTERNAL) == delta(before, after, READBACK)
        messages = [*messages, {"role": "assistant", "content": text},
                    {"role": "user", "content": f"And what about turn {turn}? " * 3}]


def test_rewritten_history_falls_back(ref: Engine, model: str,
                                      pull_engines: dict[str, Any]) -> None:
    """A client that rewrote its history: a change in the first block reads
    nothing back (prefix_mismatch), one later reads back only the blocks
    before it. Both equal the collocated engine."""
    p, proxy = pull_engines["p"], pull_engines["proxy"]
    ds = [pull_engines["d0"], pull_engines["d1"]]
    for where, label in ((3, "early"), (300, "late")):
        session = {"X-Session-Id": f"rewrite-{label}"}
        prompt = token_prompt(200, 310 + where)
        body = completion_body(model, prompt, max_tokens=250, ignore_eos=True)
        status, first = proxy.post("/v1/completions", body, headers=session)
        assert status == 200, first
        # D kept 3 blocks (384 tokens); P's own cache holds the prompt's first.
        history = prompt + first["choices"][0]["token_ids"]
        history[where] = 7 if history[where] != 7 else 8  # the client rewrote it
        body = completion_body(model, history + token_prompt(20, 9), max_tokens=8)
        assert where // BLOCK > 1 or where < BLOCK
        _, want = ref.post("/v1/completions", body)
        before, mismatches = p.metrics(), _fallbacks(p, "prefix_mismatch")
        d_before = [d.metrics() for d in ds]
        status, got = proxy.post("/v1/completions", body, headers=session)
        after = p.metrics()
        assert status == 200, got
        assert_same_as_reference(ref, got, want)
        # The handoff itself still happened: D loaded the prompt's KV from P.
        assert sum(delta(a, d.metrics(), EXTERNAL) for a, d in zip(d_before, ds, strict=True)) > 0
        if where < BLOCK:
            assert _fallbacks(p, "prefix_mismatch") == mismatches + 1
            assert delta(before, after, READBACK) == 0
            assert delta(before, after, EXTERNAL) == 0
        else:
            # Only whole blocks before the rewritten token (2), less P's own hit.
            read = delta(before, after, READBACK)
            assert read > 0 and read + delta(before, after, CACHE_HIT) == where // BLOCK * BLOCK


def test_abort_mid_turn_leaks_nothing(model: str, pull_engines: dict[str, Any]) -> None:
    """A client that goes away in the middle of a read-back turn: P's lease
    and D's kept turn end, nothing stays pinned on either engine."""
    p, proxy = pull_engines["p"], pull_engines["proxy"]
    ds = [pull_engines["d0"], pull_engines["d1"]]
    base = [d.metrics()[USAGE] for d in ds]
    session = {"X-Session-Id": "abort"}
    prompt = token_prompt(200, 320)
    status, first = proxy.post("/v1/completions", completion_body(
        model, prompt, max_tokens=130, ignore_eos=True), headers=session)
    assert status == 200, first
    assert sum(d.metrics()[USAGE] for d in ds) > sum(base)  # the kept turn
    history = prompt + first["choices"][0]["token_ids"] + token_prompt(30, 321)
    body = completion_body(model, history, max_tokens=1500, ignore_eos=True, stream=True)
    before = p.metrics()
    with open_stream(proxy.url + "/v1/completions", body, headers=session):
        pass  # decoding on D; then the client goes away
    assert delta(before, p.metrics(), READBACK) > 0  # the turn did read back
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for e in (p, *ds):
            poke(e, model)  # an idle engine frees released leases on the next request
        usage = [e.metrics()[USAGE] for e in (p, *ds)]
        if usage[0] == 0.0 and usage[1:] == base:
            break
        time.sleep(0.5)
    assert usage[0] == 0.0, "P still pins blocks"
    assert usage[1:] == base, f"D kept blocks of an aborted conversation: {usage[1:]} vs {base}"


def _direct_kept_turn(p: Engine, d: Engine, model: str, prompt: list[int]) -> dict[str, Any]:
    """One push turn without the proxy: D's answer with its kept turn."""
    import threading

    body = completion_body(model, prompt, max_tokens=130, ignore_eos=True)
    pd_id = f"direct-{time.monotonic_ns()}"
    ident = p.post("/v1/completions", completion_body(
        model, [1, 2, 3], max_tokens=1,
        kv_transfer_params={"do_remote_decode": True, "transfer_mode": "push",
                            "pd_ext_probe": True, "pd_request_id": "probe"}))[1]
    params = ident["kv_transfer_params"]
    d_leg = dict(body, kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": params["remote_engine_id"], "remote_host": params["remote_host"],
        "remote_port": params["remote_port"], "tp_size": params["tp_size"],
        "remote_request_id": pd_id, "pd_request_id": pd_id, "transfer_mode": "push",
        "pd_bidirectional": True})
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.update(answer=d.post("/v1/completions", d_leg)))
    th.start()
    status, _ = p.post("/v1/completions", dict(body, max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "transfer_mode": "push", "pd_request_id": pd_id}))
    assert status == 200
    th.join(60)
    status, answer = out["answer"]
    assert status == 200, answer
    return answer["kv_transfer_params"]


def test_vllm_demo_proxy_flow_drives_our_engines(ref: Engine, model: str,
                                                 pull_engines: dict[str, Any]) -> None:
    """The legs vLLM's multi-turn demo proxy (disagg_proxy_multiturn.py) sends:
    P's first leg with null remote fields, D's leg with P's answer verbatim
    (no pd_bidirectional: the engine's setting decides), D streamed and its
    params taken from the finishing chunk, then the next P leg with those
    params and do_remote_decode."""
    p, d = pull_engines["p"], pull_engines["d0"]
    prompt = token_prompt(200, 350)
    first_leg = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    captured: dict[str, Any] | None = None
    prev_prompt: list[int] = []
    prev_answer: list[int] = []
    for turn in (1, 2):
        body = completion_body(model, prompt, max_tokens=130, ignore_eos=True)
        _, want = ref.post("/v1/completions", body)
        leg = first_leg if captured is None else dict(captured, do_remote_decode=True,
                                                       do_remote_prefill=False)
        before = p.metrics()
        status, answer = p.post("/v1/completions", dict(body, max_tokens=1, stream=False,
                                                        kv_transfer_params=leg))
        assert status == 200, answer
        after = p.metrics()
        _, events = stream_text(d.url + "/v1/completions",
                                dict(body, kv_transfer_params=answer["kv_transfer_params"]))
        got = stream_output(events)
        assert_same_as_reference(ref, got, want)
        finishing = [ev for ev in events if isinstance(ev, dict) and "kv_transfer_params" in ev]
        assert len(finishing) == 1 and finishing[0]["choices"][0]["finish_reason"]
        captured = finishing[0]["kv_transfer_params"]
        assert captured["remote_block_hashes"]
        if turn == 2:
            assert delta(before, after, READBACK) == _kept_tokens(prev_prompt, prev_answer)
        prev_prompt, prev_answer = prompt, list(got.tokens)
        prompt = prompt + list(got.tokens) + token_prompt(40, 351)


def test_tenants_with_the_same_opening_keep_apart(ref: Engine, model: str,
                                                  pull_engines: dict[str, Any]) -> None:
    """Issue 27 item 7: two tenants (cache_salt) open a conversation with the
    same tokens, keyed by its opening (no session header). Neither tenant's
    turn takes the other's kept turn: a first turn reads nothing back, a
    second reads back exactly its own tenant's history, P never falls back
    (reading the other tenant's turn would be a mismatch, and would free it),
    and every answer equals the collocated engine."""
    p, proxy = pull_engines["p"], pull_engines["proxy"]
    tenants = ("tenant-a", "tenant-b")
    opening = token_prompt(200, 360)
    prompts = dict.fromkeys(tenants, opening)
    prev: dict[str, tuple[list[int], list[int]]] = {}
    fell = {r: _fallbacks(p, r) for r in ("prefix_mismatch", "scope_mismatch")}
    for turn in (1, 2):
        for tenant in tenants:
            body = completion_body(model, prompts[tenant], max_tokens=130, ignore_eos=True,
                                   cache_salt=tenant)
            _, want = ref.post("/v1/completions", body)
            before = p.metrics()
            status, answer = proxy.post("/v1/completions", body)
            after = p.metrics()
            assert status == 200, answer
            assert "kv_transfer_params" not in answer
            got = output_of(answer)
            assert_same_as_reference(ref, got, want)
            read = delta(before, after, READBACK)
            if turn == 1:
                assert read == 0, f"{tenant}'s first turn read another tenant's history back"
            else:
                kept = _kept_tokens(*prev[tenant]) - delta(before, after, CACHE_HIT)
                assert read == kept > 0, (tenant, read, kept)
            prev[tenant] = (list(prompts[tenant]), list(got.tokens))
            prompts[tenant] = [*prompts[tenant], *got.tokens, *token_prompt(40, 361)]
    assert {r: _fallbacks(p, r) for r in fell} == fell


def test_decode_killed_between_turns(ref: Engine, model: str,
                                     pull_engines: dict[str, Any]) -> None:
    """The D that kept the last turn dies: the next turn is still served, by
    the other D, and equals the collocated engine (P prefills it all, or the
    proxy already knew the D was gone). Runs last: it kills a module engine."""
    p, proxy = pull_engines["p"], pull_engines["proxy"]
    ds = [pull_engines["d0"], pull_engines["d1"]]
    session = {"X-Session-Id": "killed"}
    prompt = token_prompt(200, 340)
    kept0 = [d.metrics().get(KEPT, 0.0) for d in ds]
    status, first = proxy.post("/v1/completions", completion_body(
        model, prompt, max_tokens=130, ignore_eos=True), headers=session)
    assert status == 200, first
    kept1 = [d.metrics().get(KEPT, 0.0) for d in ds]
    victim = next(i for i in range(2) if kept1[i] > kept0[i])
    ds[victim].kill()  # our own engine, by PID
    history = prompt + first["choices"][0]["token_ids"] + token_prompt(20, 341)
    body = completion_body(model, history, max_tokens=8)
    _, want = ref.post("/v1/completions", body)
    before = p.metrics()
    outcomes = {o: _proxy_count(proxy, o) for o in ("d_unavailable", "readback_failed")}
    survivor = ds[1 - victim]
    d_before = survivor.metrics()
    status, got = proxy.post("/v1/completions", body, headers=session)
    assert status == 200, got
    assert_same_as_reference(ref, got, want)
    # The other D decoded it, from KV it loaded from P (not recomputed).
    assert delta(d_before, survivor.metrics(), EXTERNAL) == len(history)
    assert delta(before, p.metrics(), READBACK) == 0
    assert sum(_proxy_count(proxy, o) - n for o, n in outcomes.items()) == 1
