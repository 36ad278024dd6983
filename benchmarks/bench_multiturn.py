"""Multi-turn TTFT per turn: bidirectional KV on vs off, side by side (issue 13).

One P (core 0) and one D (core 1), both with ``bidirectional_kv_xfer``, and
two ``vllm-pd-proxy`` processes in front of them: one with ``--multi-turn``
(the next turn's P reads the history back from D), one without (P prefills
the history again, from its own prefix cache where it has it). Conversations
alternate between the two proxies, so machine noise hits both alike; each
conversation has its own random tokens (no prefix is shared across them).

A turn adds ``--turn-tokens`` user tokens to the history and D answers
``--answer-tokens`` (streamed, ``ignore_eos``). Per turn and mode: the
client's TTFT (median over conversations), and the share of the prompt P
did not compute (read back from D, or P's own prefix-cache hit), from P's
``vllm:prompt_tokens_by_source_total`` counters. ``--no-prefix-cache`` runs
P without its own prefix cache (the case where read-back matters most).

    python benchmarks/bench_multiturn.py                          # 6 turns of 300 tokens
    python benchmarks/bench_multiturn.py --turn-tokens 40 --answer-tokens 16   # short
    python benchmarks/bench_multiturn.py --no-prefix-cache
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import benchstats

from vllm_pd_ext.testing.engines import REPO, Engine, Proxy, running
from vllm_pd_ext.tools import sse

sys.path.insert(0, str(REPO))
from tests.e2e.helpers import build_model, completion_body, token_prompt

COMPUTED = "vllm:prompt_tokens_by_source_total[local_compute]"
EXTERNAL = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
HIT = "vllm:prompt_tokens_by_source_total[local_cache_hit]"
READBACK = "vllm:pd_ext_readback_tokens_total"


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def stream_ttft(proxy: Proxy, body: dict[str, Any], session: str) -> tuple[float, list[int]]:
    """Client TTFT (first token's chunk) and the answer's token ids."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=300)
    started = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                 {"Content-Type": "application/json", "X-Session-Id": session})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()[:300]
    ttft = None
    tokens: list[int] = []
    for event in sse.response_events(resp):
        if event.kind is sse.Kind.DONE:
            break
        for choice in event.data.get("choices", []):
            if choice.get("token_ids"):
                if ttft is None:
                    ttft = time.perf_counter() - started
                tokens += choice["token_ids"]
    conn.close()
    assert ttft is not None, "no token streamed"
    return ttft, tokens


def conversation(proxy: Proxy, p: Engine, model: str, args: argparse.Namespace, seed: int
                 ) -> list[dict[str, float]]:
    history: list[int] = []
    rows = []
    for turn in range(args.turns):
        prompt = history + token_prompt(args.turn_tokens, seed * 100 + turn)
        body = completion_body(model, prompt, max_tokens=args.answer_tokens, ignore_eos=True)
        before = p.metrics()
        ttft, answer = stream_ttft(proxy, body, f"conv-{seed}")
        after = p.metrics()
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (COMPUTED, EXTERNAL, HIT,
                                                                 READBACK)}
        rows.append({"turn": turn + 1, "prompt": len(prompt), "ttft": ttft,
                     "computed": d[COMPUTED], "read_back": d[READBACK], "hit": d[HIT]})
        history = prompt + answer
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--turn-tokens", type=int, default=300)
    ap.add_argument("--answer-tokens", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=5, help="per mode")
    ap.add_argument("--preset", default="bench", choices=["tiny", "bench"])
    ap.add_argument("--no-prefix-cache", action="store_true",
                    help="P runs without its own prefix cache")
    ap.add_argument("--threshold", type=int, default=0,
                    help="kv_recompute_threshold of P (0: read back any match)")
    ap.add_argument("--out-json")
    args = ap.parse_args()
    model = build_model(args.preset, preset=args.preset)
    logs = REPO / ".runs" / "bench" / time.strftime("multiturn-%Y%m%d-%H%M%S")
    extra = {"bidirectional_kv_xfer": True, "kv_recompute_threshold": args.threshold}
    need = (args.turn_tokens + args.answer_tokens) * args.turns + 64
    common = dict(extra_config=extra, kv_bytes=4 << 30, max_model_len=max(2048, need),
                  role="kv_both")
    p = Engine("p", model, logs, cpu_bind="0",
               extra_args=["--no-enable-prefix-caching"] if args.no_prefix_cache else [],
               **common)  # type: ignore[arg-type]
    d = Engine("d", model, logs, cpu_bind="1", **common)  # type: ignore[arg-type]
    say(f"engines starting ({args.preset}), logs in {logs}")
    with running(p, d):
        on = Proxy([p.url], [d.url], logs / "on", args=["--multi-turn"]).start().wait_ready()
        off = Proxy([p.url], [d.url], logs / "off").start().wait_ready()
        try:
            for mode, px in (("on", on), ("off", off)):  # warm-up, not recorded
                conversation(px, p, model, argparse.Namespace(**{**vars(args), "turns": 2}),
                             seed=9000 + len(mode))
            results: dict[str, list[list[dict[str, float]]]] = {"on": [], "off": []}
            for c in range(args.conversations):
                for mode, px in (("on", on), ("off", off)):
                    results[mode].append(conversation(px, p, model, args,
                                                      seed=c * 2 + (mode == "off")))
                say(f"conversation {c + 1}/{args.conversations} done")
        finally:
            on.stop()
            off.stop()
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, list[list[dict[str, float]]]]) -> None:
    print(f"\nMulti-turn, {args.preset} model, {args.turns} turns of {args.turn_tokens} user + "
          f"{args.answer_tokens} answer tokens, {args.conversations} conversations per mode, "
          f"P prefix cache {'off' if args.no_prefix_cache else 'on'}, threshold "
          f"{args.threshold}\n")
    print("| turn | prompt | TTFT on (ms) | TTFT off (ms) | on/off | P did not compute, on "
          "| off | read back from D |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for t in range(args.turns):
        row: dict[str, float] = {"turn": t + 1}
        for mode in ("on", "off"):
            turns = [conv[t] for conv in results[mode]]
            row[f"ttft_{mode}_ms"] = statistics.median(r["ttft"] for r in turns) * 1e3
            row[f"saved_{mode}"] = statistics.median(
                1 - r["computed"] / r["prompt"] for r in turns)
            row[f"read_back_{mode}"] = statistics.median(r["read_back"] for r in turns)
            row["prompt"] = turns[0]["prompt"]
        row["ratio"] = row["ttft_on_ms"] / row["ttft_off_ms"]
        summary.append(row)
        print(f"| {t + 1} | {row['prompt']:.0f} | {benchstats.fmt(row['ttft_on_ms'], 1)} | "
              f"{benchstats.fmt(row['ttft_off_ms'], 1)} | {row['ratio']:.2f} | "
              f"{row['saved_on']:.0%} | {row['saved_off']:.0%} | {row['read_back_on']:.0f} |")
    later = [r["ratio"] for r in summary[1:]]
    total = {m: sum(r[f"ttft_{m}_ms"] for r in summary[1:]) for m in ("on", "off")}
    out = {"turns": summary, "median_ratio_from_turn_2": statistics.median(later) if later
           else None, "ttft_sum_ratio_from_turn_2": total["on"] / total["off"] if later
           else None, "args": vars(args)}
    median_ratio = benchstats.fmt(out["median_ratio_from_turn_2"])
    sum_ratio = benchstats.fmt(out["ttft_sum_ratio_from_turn_2"])
    print(f"\nturns 2..{args.turns}: median TTFT on/off {median_ratio}, summed TTFT on/off "
          f"{sum_ratio}")
    print("RESULT " + json.dumps(out))
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
