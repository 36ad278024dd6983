"""Equality-oracle margins on this CPU: how far legitimate P/D outputs and
outputs over wrong KV sit from a collocated engine, side by side.

Starts a collocated reference engine, a PDConnector P and a D (tiny model,
bfloat16, pull mode; the e2e tests' engines) on 127.0.0.1 and runs three
workloads, 12 greedy tokens each:

* ``fresh``: distinct prompts of 37..700 tokens, handed off whole;
* ``prefix``: a prompt handed off, then one sharing its first two blocks
  (D hits its prefix cache and loads only the tail: the case whose rounding
  differs most from a one-shot prefill);
* ``decoy``: D decodes a prompt over a decoy's KV of the same length (another
  prompt, or the prompt with its middle block replaced), with a cache salt of
  its own.

Every output is scored by the reference (teacher forcing, as the oracle does
on a mismatch) and reported as: exact, same up to near ties, or different,
with the largest gap ``best - chosen`` in nats over its positions. The
figure that matters is the separation: the smallest gap of a decoy output
against the largest gap of a genuine one, on either side of ``eps``.

    python benchmarks/bench_oracle.py [--fresh 35 --prefix 20 --decoys 12] [--out-json F]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_pd_ext.testing.engines import REPO, Engine, running
from vllm_pd_ext.testing.oracle import judge, near_tie_nats, output_of, teacher_forced_scores

sys.path.insert(0, str(REPO))
from tests.e2e.helpers import BLOCK_SIZE, build_model, completion_body, prefill, token_prompt

LENGTHS = [37, 128, 200, 333, 384, 500, 700]
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def cpu_summary() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    return (f"{fields.get('Model name', '?').strip()}; "
            + " ".join(f for f in ISA_FLAGS if f in flags))


class Bench:
    def __init__(self, ref: Engine, p: Engine, d: Engine, model: str, max_tokens: int) -> None:
        self.ref, self.p, self.d, self.model = ref, p, d, model
        self.max_tokens = max_tokens
        self.eps = near_tie_nats(ref.dtype)
        self.rows: list[dict[str, Any]] = []

    def reference(self, prompt: list[int]) -> tuple[int, ...]:
        status, want = self.ref.post("/v1/completions", completion_body(
            self.model, prompt, max_tokens=self.max_tokens))
        assert status == 200, want
        return output_of(want).tokens

    def decode(self, prompt: list[int], kv_of: list[int], salt: str | None = None
               ) -> tuple[tuple[int, ...], float]:
        """D decodes ``prompt`` over the KV P computed for ``kv_of``; returns
        the tokens and how many tokens D loaded as external KV."""
        params = prefill(self.p, completion_body(self.model, kv_of, max_tokens=1))
        body = dict(completion_body(self.model, prompt, max_tokens=self.max_tokens),
                    kv_transfer_params=params)
        if salt:
            body["cache_salt"] = salt
        key = "vllm:prompt_tokens_by_source_total[external_kv_transfer]"
        before = self.d.metrics().get(key, 0.0)
        status, got = self.d.post("/v1/completions", body)
        assert status == 200, got
        return output_of(got).tokens, self.d.metrics().get(key, 0.0) - before

    def score(self, kind: str, prompt: list[int], tokens: tuple[int, ...],
              want: tuple[int, ...], external: float, want_external: int) -> None:
        scores = teacher_forced_scores(self.ref.url, self.model, prompt, tokens)
        v = judge(tokens, want, scores, self.eps)
        gaps = [max(pos.values()) - pos[t] for t, pos in zip(tokens, scores, strict=True)]
        verdict = "exact" if v.exact else "near_tie" if v.same else "different"
        self.rows.append(dict(kind=kind, tokens=len(prompt), verdict=verdict,
                              max_gap=max(gaps), first_over_eps=v.position,
                              kv_moved=external == want_external,
                              near_ties=len(v.near_ties)))
        print(f"{kind:7s} {len(prompt):4d} tok: {verdict:9s} max gap {max(gaps):.4f}"
              + (f", first over eps at {v.position}" if v.position is not None else ""),
              flush=True)

    def fresh(self, n: int) -> None:
        for i in range(n):
            prompt = token_prompt(LENGTHS[i % len(LENGTHS)], seed=50_000 + i)
            tokens, ext = self.decode(prompt, prompt)
            self.score("fresh", prompt, tokens, self.reference(prompt), ext, len(prompt))

    def prefix(self, n: int) -> None:
        for i in range(n):
            first = token_prompt(2 * BLOCK_SIZE + 40, seed=60_000 + i)
            self.decode(first, first)
            second = first[: 2 * BLOCK_SIZE] + token_prompt(90, seed=61_000 + i)
            tokens, ext = self.decode(second, second)
            self.score("prefix", second, tokens, self.reference(second), ext, 90)

    def decoys(self, n: int) -> None:
        for i in range(n):
            prompt = token_prompt(LENGTHS[1 + i % 6], seed=70_000 + i)
            want = self.reference(prompt)
            start = (len(prompt) // 2) // BLOCK_SIZE * BLOCK_SIZE
            end = min(start + BLOCK_SIZE, len(prompt))
            variants = {
                "other": token_prompt(len(prompt), seed=71_000 + i),
                "block": [*prompt[:start], *token_prompt(end - start, seed=72_000 + i),
                          *prompt[end:]],
            }
            for name, kv_of in variants.items():
                tokens, ext = self.decode(prompt, kv_of, salt=f"bench-oracle-{i}-{name}")
                self.score(f"decoy:{name}", prompt, tokens, want, ext, len(prompt))


def report(rows: list[dict[str, Any]], eps: float, cpu: str) -> dict[str, Any]:
    kinds = sorted({r["kind"] for r in rows}, key=lambda k: (k.startswith("decoy"), k))
    out: dict[str, Any] = {"cpu": cpu, "eps": eps, "kinds": {}}
    print(f"\nCPU: {cpu}; eps {eps} nats (bfloat16)")
    print("| workload | outputs | exact | near ties | different | largest gap | smallest gap |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k in kinds:
        rs = [r for r in rows if r["kind"] == k]
        c = {v: sum(1 for r in rs if r["verdict"] == v) for v in ("exact", "near_tie",
                                                                   "different")}
        gaps = [r["max_gap"] for r in rs]
        out["kinds"][k] = dict(c, n=len(rs), largest_gap=max(gaps), smallest_gap=min(gaps))
        print(f"| {k} | {len(rs)} | {c['exact']} | {c['near_tie']} | {c['different']} | "
              f"{max(gaps):.4f} | {min(gaps):.4f} |")
    genuine = [r["max_gap"] for r in rows if not r["kind"].startswith("decoy")]
    decoy = [r["max_gap"] for r in rows if r["kind"].startswith("decoy")]
    if genuine and decoy:
        worst, best = max(genuine), min(decoy)
        out.update(genuine_largest_gap=worst, decoy_smallest_gap=best)
        print(f"separation: largest genuine gap {worst:.4f} <= eps {eps} < smallest decoy gap "
              f"{best:.4f}: {'holds' if worst <= eps < best else 'DOES NOT HOLD'} "
              f"(decoy / eps = {best / eps:.1f}x, eps / genuine = "
              f"{eps / worst if worst else float('inf'):.1f}x)")
    moved = sum(1 for r in rows if r["kv_moved"])
    print(f"KV moved (D's external-KV tokens == the prompt; the 90-token tail after a "
          f"prefix hit): {moved}/{len(rows)} outputs")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh", type=int, default=35)
    ap.add_argument("--prefix", type=int, default=20)
    ap.add_argument("--decoys", type=int, default=12, help="prompts; two decoys each")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)
    model = build_model("tiny")
    logs = REPO / ".runs" / "bench" / time.strftime("oracle-%Y%m%d-%H%M%S")
    ref = Engine("ref", model, logs, connector=None, cpu_bind="0")
    p = Engine("p", model, logs, role="kv_producer", cpu_bind="0")
    d = Engine("d", model, logs, role="kv_consumer", cpu_bind="1", failure_policy="fail")
    print(f"starting ref, P, D (logs in {logs})", flush=True)
    with running(ref, p, d):
        bench = Bench(ref, p, d, model, args.max_tokens)
        bench.fresh(args.fresh)
        bench.prefix(args.prefix)
        bench.decoys(args.decoys)
    summary = report(bench.rows, bench.eps, cpu_summary())
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out_json).write_text(json.dumps(dict(summary, rows=bench.rows), indent=1))
    genuine_ok = all(r["verdict"] != "different" for r in bench.rows
                     if not r["kind"].startswith("decoy"))
    decoys_seen = all(r["verdict"] == "different" for r in bench.rows
                      if r["kind"].startswith("decoy"))
    moved = all(r["kv_moved"] for r in bench.rows)
    return 0 if genuine_ok and decoys_seen and moved else 1


if __name__ == "__main__":
    sys.exit(main())
