"""Request parity: the request features of vLLM's OpenAI-compatible API, each
sent to the collocated reference engine and through P/D, answers compared.

Used by ``test_conformance.py`` (pull, on the session engines) and
``test_push.py`` (push, on its module's engines): one engine set per mode
serves every case. A case is one request body; its answer through P/D must
equal the reference's after :func:`normalize` (which drops only what differs
by construction: ids, timestamps, the connector's own fields), with floats
(logprobs) within :data:`LOGPROB_TOL`. A greedy answer whose tokens differ
is judged by the suite's near-tie oracle instead (``helpers.assert_same_as_reference``;
bf16 rounding differs between CPUs). Each case also states where its prompt
KV comes from on D (:class:`Kv`), checked on D's counters, so equal answers
from a D that silently recomputed fail.
"""

from __future__ import annotations

import enum
import json
import math
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from tests.e2e.helpers import EXTERNAL, assert_same_as_reference, delta, sse_events
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.testing.oracle import Output

#: Largest difference allowed between two logprobs (nats). Both engines run
#: the same kernels on one CPU, so they agree bit for bit in practice; the
#: margin covers a different batch composition on D (another reduction order).
LOGPROB_TOL = 0.02

#: What every engine of a conformance set is started with: a tool-call parser,
#: without which vLLM refuses ``tool_choice`` (the tiny tokenizer suits hermes).
SERVE_ARGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]

#: D's counter of every prompt token it saw (loaded or computed).
D_PROMPT_TOKENS = "vllm:prompt_tokens_total"

#: Keys that differ between any two answers by construction.
_VOLATILE = frozenset({"id", "created", "system_fingerprint", "kv_transfer_params",
                       "pd_telemetry", "metrics", "service_tier",
                       # the Responses API's timestamps and item ids
                       "created_at", "completed_at", "item_id",
                       # prefix-cache accounting: it depends on what each engine
                       # served before, and D's prompt came from P, not from its
                       # own cache (docs/proxy.md, request parity)
                       "cache_write_tokens", "cached_tokens"})


class Kv(enum.Enum):
    """Where D's prompt KV comes from."""

    #: Loaded from P: D's external-KV count grows by every prompt token.
    MOVED = "moved"
    #: D computes the prompt itself (vLLM recomputes it for prompt logprobs).
    LOCAL = "local"
    #: The request is refused, by both, before anything runs.
    NONE = "none"
    #: P's answer is the whole answer (one token; token #1 from P): D gets
    #: no leg, computes and loads nothing.
    PREFILL = "prefill"


@dataclass(frozen=True)
class Case:
    name: str
    body: dict[str, Any]
    chat: bool = False
    #: A Responses API request (``/v1/responses``).
    responses: bool = False
    kv: Kv = Kv.MOVED
    #: Greedy (temperature 0): differing tokens go to the near-tie oracle.
    greedy: bool = True
    #: Number of prompts (a batched /v1/completions prompt) and choices per
    #: prompt: D loads each prompt once whatever ``n`` is.
    prompts: int = 1
    notes: str = ""
    marks: tuple[Any, ...] = field(default=())

    @property
    def endpoint(self) -> str:
        if self.responses:
            return "/v1/responses"
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


def _prompt(seed: int, n: int = 120) -> list[int]:
    # Token ids 5..3004: no special tokens (the tiny vocabulary is 4096 wide).
    return [5 + (seed * 7919 + i * 104729) % 3000 for i in range(n)]


def _chat(text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": text}]


_WORDS = "the quick brown fox jumps over the lazy dog and keeps running far away " * 6
_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "age": {"type": "integer"}},
           "required": ["name", "age"], "additionalProperties": False}
_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                   "required": ["city"], "additionalProperties": False}}}


def _c(key: int, max_tokens: int = 10, **extra: Any) -> dict[str, Any]:
    """A completion body: a token-id prompt, greedy, with token ids returned."""
    return {"prompt": _prompt(key), "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}


def _t(key: int, max_tokens: int = 10, **extra: Any) -> dict[str, Any]:
    """A chat body (text, so the chat template and tokenizer are in the path)."""
    return {"messages": _chat(f"{key} {_WORDS}"), "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, **extra}


_SAMPLED = {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.02, "seed": 1234}

CASES: list[Case] = [
    Case("greedy", _c(1)),
    Case("greedy_stream", _c(2, stream=True)),
    Case("max_tokens_1", _c(3, max_tokens=1), kv=Kv.PREFILL,
         notes="token #1 from P is the whole answer: P serves it without a handoff"),
    Case("long_decode", _c(4, max_tokens=200, ignore_eos=True)),
    Case("text_prompt", {"prompt": _WORDS, "max_tokens": 10, "temperature": 0,
                         "return_token_ids": True}),
    Case("logprobs", _c(5, logprobs=3)),
    Case("logprobs_stream", _c(6, logprobs=2, stream=True)),
    Case("prompt_logprobs", _c(7, prompt_logprobs=2), kv=Kv.LOCAL,
         notes="vLLM computes prompt logprobs from the prompt's own forward pass"),
    Case("echo_logprobs", _c(8, echo=True, logprobs=1), kv=Kv.LOCAL,
         notes="echo with logprobs asks for prompt logprobs"),
    Case("beam_search", _c(48, n=2, use_beam_search=True, temperature=0), kv=Kv.LOCAL,
         notes="vLLM runs beam search as its API server's own requests"),
    Case("seeded_sampling", _c(9, max_tokens=16, **_SAMPLED), greedy=False),
    Case("seeded_sampling_stream", _c(10, max_tokens=16, stream=True, **_SAMPLED),
         greedy=False),
    Case("penalties", _c(11, max_tokens=16, presence_penalty=0.8, frequency_penalty=0.5,
                         repetition_penalty=1.3)),
    Case("logit_bias", _c(12, logit_bias={"17": 100, "18": 50})),
    Case("bad_words", _t(13, bad_words=["the", "fox"]), chat=True),
    Case("allowed_token_ids", _c(14, allowed_token_ids=[20, 21, 22, 23, 24])),
    Case("min_tokens", _c(15, max_tokens=12, min_tokens=12, stop_token_ids=[20, 21])),
    Case("stop_token_ids", _c(16, max_tokens=24, stop_token_ids=[17, 33, 61, 64, 90])),
    Case("stop_strings", _t(17, max_tokens=24, stop=["e", "o"],
                            include_stop_str_in_output=True), chat=True),
    Case("ignore_eos_skip_special", _c(18, ignore_eos=True, skip_special_tokens=False)),
    Case("truncate_prompt_tokens", _c(19, truncate_prompt_tokens=64)),
    Case("cache_salt", _c(20, cache_salt="tenant-a")),
    Case("usage_in_stream", _c(21, stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})),
    Case("return_tokens_as_token_ids", _c(22, logprobs=1, return_tokens_as_token_ids=True)),
    Case("json_schema", _c(23, max_tokens=40, structured_outputs={"json": _SCHEMA})),
    Case("choice", _c(24, structured_outputs={"choice": ["alpha", "beta", "gamma"]})),
    Case("regex", _c(25, max_tokens=12, structured_outputs={"regex": "[a-d]{3}-[0-9]{4}"})),
    Case("chat", _t(26), chat=True),
    Case("chat_stream_usage", _t(27, stream=True, stream_options={"include_usage": True}),
         chat=True),
    Case("chat_logprobs", _t(28, logprobs=True, top_logprobs=3), chat=True),
    Case("chat_response_format", _t(29, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": _SCHEMA}}),
        chat=True),
    Case("chat_continue_final_message", {
        "messages": [*_chat(f"30 {_WORDS}"), {"role": "assistant", "content": "Sure, the"}],
        "continue_final_message": True, "add_generation_prompt": False,
        "max_tokens": 10, "temperature": 0, "return_token_ids": True}, chat=True),
    Case("chat_tool_named", _t(31, max_tokens=30, tools=[_TOOL], tool_choice={
        "type": "function", "function": {"name": "get_weather"}}), chat=True),
    Case("chat_tool_required", _t(32, max_tokens=30, tools=[_TOOL], tool_choice="required"),
         chat=True),
    Case("chat_tool_none", _t(33, tools=[_TOOL], tool_choice="none"), chat=True),
    Case("chat_tool_auto_stream", _t(45, tools=[_TOOL], tool_choice="auto", stream=True,
                                     stream_options={"include_usage": True}), chat=True),
    Case("batched_prompts", {"prompt": [_prompt(34), _prompt(35, 200)], "max_tokens": 8,
                             "temperature": 0, "return_token_ids": True}, prompts=2),
    Case("batched_prompts_stream", {
        "prompt": [_prompt(36), _prompt(37, 150), _prompt(38, 90)], "max_tokens": 8,
        "temperature": 0, "return_token_ids": True, "stream": True,
        "stream_options": {"include_usage": True}}, prompts=3),
    Case("n2_seeded", _c(39, max_tokens=12, n=2, **_SAMPLED), greedy=False),
    Case("n3_seeded_stream", _c(40, max_tokens=8, n=3, stream=True, **_SAMPLED),
         greedy=False),
    Case("chat_n2_seeded", _t(41, n=2, **_SAMPLED), chat=True, greedy=False),
    Case("batched_n2", {"prompt": [_prompt(42), _prompt(43, 160)], "max_tokens": 6, "n": 2,
                        "return_token_ids": True, **_SAMPLED}, greedy=False, prompts=2),
    Case("responses", {"instructions": "You are terse.", "input": f"46 {_WORDS}",
                       "max_output_tokens": 12, "temperature": 0}, responses=True,
         greedy=False),
    Case("responses_stream", {"input": [{"role": "user", "content": f"47 {_WORDS}"}],
                              "max_output_tokens": 12, "temperature": 0, "stream": True},
         responses=True, greedy=False),
    Case("n2_greedy_refused", _c(44, n=2), kv=Kv.NONE,
         notes="vLLM refuses n > 1 at temperature 0 (400), collocated or not"),
]


# ------------------------------------------------------------------ requests
def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    """POST ``body``; (status, parsed JSON, or the SSE payloads when streamed)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=180) as r:
            if body.get("stream"):
                return r.status, sse_events(r)
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        try:
            return exc.code, json.loads(text)
        except json.JSONDecodeError:
            return exc.code, text


# ------------------------------------------------------------------ normalizing
def normalize(answer: Any, stream: bool, responses: bool = False) -> Any:
    """What the client can see of an answer, less what differs by construction.

    A stream is compared by what its chunks add up to, not by where they
    break: vLLM's API server merges the outputs a slow reader has not yet
    taken into one chunk, so chunk boundaries depend on timing (a D that
    skipped the prefill streams at another pace than a collocated engine).
    """
    if not stream:
        return _strip(answer)
    assert isinstance(answer, list) and answer, answer
    events = [_strip(ev) for ev in answer if isinstance(ev, dict)]
    return _responses_stream(events) if responses else _choices_stream(events)


def _choices_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Each choice's text, tokens, logprobs, tool calls and last fields, the
    top-level fields, and the last usage (summed over the stream's end)."""
    out: dict[str, Any] = {"usage": None, "top": {}}
    for chunk in chunks:
        if chunk.get("usage"):
            out["usage"] = chunk["usage"]
        out["top"].update({k: v for k, v in chunk.items()
                           if k not in ("choices", "usage") and v is not None})
        for choice in chunk.get("choices") or ():
            acc = out.setdefault(f"choice {choice.get('index')}", {
                "text": "", "token_ids": [], "logprobs": {}, "tool_calls": {}})
            delta = choice.get("delta") or {}
            acc["text"] += (choice.get("text") or "") + (delta.get("content") or "")
            acc["token_ids"] += choice.get("token_ids") or []
            _add_logprobs(acc["logprobs"], choice.get("logprobs"))
            for call in delta.get("tool_calls") or ():
                c = acc["tool_calls"].setdefault(call.get("index", 0), {"arguments": ""})
                fn = call.get("function") or {}
                c["arguments"] += fn.get("arguments") or ""
                if fn.get("name"):
                    c["name"] = fn["name"]
            for key, value in {**choice, **delta}.items():
                if key not in ("text", "content", "token_ids", "logprobs", "tool_calls",
                               "delta") and value is not None:
                    acc[key] = value
    return out


def _add_logprobs(acc: dict[str, list[Any]], logprobs: Any) -> None:
    """Concatenate a chunk's logprobs: every list field (completions'
    ``tokens``, ``token_logprobs``, ... and chat's ``content``)."""
    if isinstance(logprobs, dict):
        for key, value in logprobs.items():
            if isinstance(value, list):
                acc.setdefault(key, []).extend(value)


def _responses_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A Responses API stream: its event types (repeats of one collapsed),
    the text its deltas add up to, and the final response."""
    types: list[str] = []
    text = ""
    final = None
    for ev in events:
        kind = ev.get("type", "?")
        if not types or types[-1] != kind:
            types.append(kind)
        if kind == "response.output_text.delta":
            text += ev.get("delta") or ""
        if kind == "response.completed":
            final = ev.get("response")
    return {"types": types, "text": text, "final": final}


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        out = {k: _strip(v) for k, v in obj.items() if k not in _VOLATILE}
        calls = out.get("tool_calls")
        if isinstance(calls, list):  # tool call ids are random per answer
            out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in calls]
        return out
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def differences(want: Any, got: Any, path: str = "") -> list[str]:
    """Where ``got`` differs from ``want`` (floats within :data:`LOGPROB_TOL`)."""
    if isinstance(want, float) or isinstance(got, float):
        numbers = isinstance(want, (int, float)) and isinstance(got, (int, float))
        if numbers and (want == got or math.isclose(want, got, abs_tol=LOGPROB_TOL)):
            return []
        return [f"{path}: {want!r} != {got!r}"]
    if isinstance(want, dict) and isinstance(got, dict):
        out = [f"{path}.{k}: missing" for k in want if k not in got]
        out += [f"{path}.{k}: unexpected" for k in got if k not in want]
        for k in want.keys() & got.keys():
            out += differences(want[k], got[k], f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{path}: {len(want)} items != {len(got)}"]
        return [d for i, (w, g) in enumerate(zip(want, got, strict=True))
                for d in differences(w, g, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {want!r} != {got!r}"]


def _outputs(answer: Any, stream: bool) -> list[Output]:
    """Per choice index: (prompt, generated tokens), from ``return_token_ids``."""
    prompts: dict[int, list[int]] = {}
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    chunks = [ev for ev in answer if isinstance(ev, dict)] if stream else [answer]
    for chunk in chunks:
        for choice in chunk.get("choices", ()):
            i = choice["index"]
            if choice.get("prompt_token_ids"):
                prompts[i] = list(choice["prompt_token_ids"])
            elif chunk.get("prompt_token_ids"):
                prompts[i] = list(chunk["prompt_token_ids"])
            tokens.setdefault(i, []).extend(choice.get("token_ids") or ())
            message = choice.get("message") or choice.get("delta") or {}
            texts[i] = texts.get(i, "") + (choice.get("text") or message.get("content") or "")
    return [Output(tuple(prompts.get(i, [])), tuple(tokens[i]), texts.get(i, ""), None)
            for i in sorted(tokens)]


# ------------------------------------------------------------------ the check
def check_case(case: Case, ref: Engine, front_url: str, d: Engine, model: str) -> str:
    """Send ``case`` to ``ref`` and through P/D (``front_url``: the proxy);
    assert the answers agree and the KV came from where the case says.
    Returns a one-line summary."""
    body = dict(case.body, model=model)
    status_want, want = post(ref.url + case.endpoint, body)
    before = d.metrics()
    status_got, got = post(front_url + case.endpoint, body)
    after = d.metrics()
    assert status_got == status_want, (
        f"{case.name}: status {status_got} through P/D, {status_want} collocated: "
        f"{str(got)[:400]}")
    moved = delta(before, after, EXTERNAL)
    if status_want != 200:
        assert case.kv is Kv.NONE, f"{case.name}: refused by both: {str(want)[:300]}"
        assert moved == 0, f"{case.name}: a refused request loaded {moved} tokens"
        return f"{case.name}: {status_want} from both"
    assert case.kv is not Kv.NONE, f"{case.name}: expected a refusal, got 200 from both"
    if case.stream and not case.responses:  # a Responses stream has no [DONE]
        assert got[-1] == "[DONE]" and got.count("[DONE]") == 1, got[-3:]
    if case.stream:
        assert not [ev for ev in got if isinstance(ev, dict) and "error" in ev], got
    diffs = differences(normalize(want, case.stream, case.responses),
                        normalize(got, case.stream, case.responses))
    verdict = "equal"
    if diffs:
        assert case.greedy, f"{case.name}: answers differ: {diffs[:8]}"
        # Greedy tokens may differ at a near-tie (bf16 rounding): the oracle judges.
        w_out, g_out = _outputs(want, case.stream), _outputs(got, case.stream)
        assert len(w_out) == len(g_out) and w_out, (case.name, diffs[:8])
        exact = [assert_same_as_reference(ref, g, w).exact
                 for w, g in zip(w_out, g_out, strict=True)]
        # The same tokens: nothing else may differ (offsets, usage, texts).
        assert not all(exact), f"{case.name}: same tokens, yet answers differ: {diffs[:8]}"
        verdict = f"near-tie equal ({len(diffs)} fields differ: {diffs[0]})"
    prompt_tokens = _prompt_tokens(want, case)
    if case.kv is Kv.MOVED:
        assert moved == prompt_tokens, (
            f"{case.name}: D loaded {moved} prompt tokens from P, expected every one of "
            f"the {case.prompts} prompt(s)' {prompt_tokens} (did D recompute?)")
    elif case.kv is Kv.PREFILL:
        computed = delta(before, after, D_PROMPT_TOKENS)
        assert moved == 0 and computed == 0, (
            f"{case.name}: D loaded {moved} and computed {computed} prompt tokens; expected "
            "no D leg (P's answer is the whole answer)")
    else:
        assert moved == 0, f"{case.name}: D loaded {moved} tokens, expected to compute"
    return f"{case.name}: {verdict}; D loaded {int(moved)} prompt tokens from P"


def _prompt_tokens(answer: Any, case: Case) -> int:
    """The prompt tokens of the case's distinct prompts, each counted once
    whatever ``n`` is (as vLLM's ``usage.prompt_tokens`` counts them)."""
    if case.responses:
        if case.stream:
            answer = next(ev["response"] for ev in answer
                          if isinstance(ev, dict) and ev.get("type") == "response.completed")
        return int(answer["usage"]["input_tokens"])
    if not case.stream:
        return int(answer["usage"]["prompt_tokens"])
    usages = [ev["usage"] for ev in answer if isinstance(ev, dict) and ev.get("usage")]
    if usages:
        return int(usages[-1]["prompt_tokens"])
    prompt = case.body.get("prompt")
    assert isinstance(prompt, list) and prompt, (
        f"{case.name}: a streamed case without usage needs a token-id prompt")
    return sum(len(p) for p in prompt) if isinstance(prompt[0], list) else len(prompt)
