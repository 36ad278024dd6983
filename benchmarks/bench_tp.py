"""KV handoff across tensor-parallel sizes: 1->1, 2->2, 1->2, 2->1 side by side.

For each (P TP, D TP) pair, one after the other on the same two cores (a
TP=2 engine has a core per rank, so a TP=2 P and a TP=2 D share both),
``--reps`` sequential handoffs per prompt length: P leg (max_tokens=1,
``do_remote_decode``), then D leg (max_tokens=1) with P's answer, distinct
random prompts (no prefix hit). D answers with its transfer record
(``transfer_telemetry_in_response``), the ranks' records merged: bytes and
descriptors summed over D's ranks, each phase its slowest rank's. Printed
per pair and length (medians): the handoff (D's arrival to its KV ready,
``kv_ready_ms``), the READ (slowest rank), the bytes and descriptors per D
rank, the D leg's client latency, and each against 1->1.

    python benchmarks/bench_tp.py --lengths 1000,4000 --reps 15
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from benchstats import median

from vllm_pd_ext.testing.engines import REPO, Engine
from vllm_pd_ext.tools.launch import tp_bind

PAIRS = [(1, 1), (2, 2), (1, 2), (2, 1)]


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 3000) for _ in range(n)]


def run_pair(p_tp: int, d_tp: int, model: str, lengths: list[int], reps: int, logs: Path
             ) -> list[dict[str, Any]]:
    p = Engine(f"p-tp{p_tp}", model, logs, role="kv_producer", tp_size=p_tp,
               cpu_bind=tp_bind(p_tp, "0"), max_model_len=max(lengths) + 64,
               kv_bytes=1 << 30)
    d = Engine(f"d-tp{d_tp}", model, logs, role="kv_consumer", tp_size=d_tp,
               cpu_bind=tp_bind(d_tp, "1"), max_model_len=max(lengths) + 64,
               kv_bytes=1 << 30, failure_policy="fail",
               extra_config={"transfer_telemetry_in_response": True})
    rows: list[dict[str, Any]] = []
    try:
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
        for n in lengths:
            for i in range(reps + 1):  # the first is a warm-up (handshake)
                body = {"model": model, "prompt": prompt(n, 1000 * n + i), "max_tokens": 1,
                        "temperature": 0}
                status, pa = p.post("/v1/completions",
                                    dict(body, kv_transfer_params={"do_remote_decode": True}))
                assert status == 200, pa
                t0 = time.perf_counter()
                status, da = d.post("/v1/completions",
                                    dict(body, kv_transfer_params=pa["kv_transfer_params"]))
                leg_ms = (time.perf_counter() - t0) * 1e3
                assert status == 200, da
                rec = da["kv_transfer_params"]["pd_transfer"]
                assert rec["outcome"] == "ok" and rec.get("ranks", 1) == d_tp, rec
                if i:
                    rows.append({"pair": f"{p_tp}->{d_tp}", "tokens": n, "d_leg_ms": leg_ms,
                                 "handoff_ms": rec["kv_ready_ms"], "read_ms": rec["read_ms"],
                                 "bytes_per_rank": rec["bytes"] / d_tp,
                                 "descs_per_rank": rec["descriptors"] / d_tp})
    finally:
        d.stop()
        p.stop()
    return rows


def table(rows: list[dict[str, Any]], lengths: list[int]) -> str:
    def med(pair: str, n: int, key: str) -> float:
        return median([r[key] for r in rows if r["pair"] == pair and r["tokens"] == n])

    out = ["| P->D TP | tokens | handoff ms | vs 1->1 | READ ms (slowest rank) | bytes per D rank "
           "| descriptors per D rank | D leg ms |", "|---" * 8 + "|"]
    for n in lengths:
        base = med("1->1", n, "handoff_ms")
        for p_tp, d_tp in PAIRS:
            pair = f"{p_tp}->{d_tp}"
            h = med(pair, n, "handoff_ms")
            out.append(f"| {pair} | {n} | {h:.2f} | {h / base:.2f} | "
                       f"{med(pair, n, 'read_ms'):.2f} | {med(pair, n, 'bytes_per_rank'):,.0f} | "
                       f"{med(pair, n, 'descs_per_rank'):.0f} | {med(pair, n, 'd_leg_ms'):.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".models/tiny"))
    ap.add_argument("--lengths", default="1000,4000")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out-json", default=None)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    logs = REPO / ".runs" / "bench" / time.strftime("tp-%Y%m%d-%H%M%S")
    rows: list[dict[str, Any]] = []
    for p_tp, d_tp in PAIRS:
        print(f"P TP={p_tp} -> D TP={d_tp} ...", flush=True)
        rows += run_pair(p_tp, d_tp, args.model, lengths, args.reps, logs)
    print(table(rows, lengths))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
