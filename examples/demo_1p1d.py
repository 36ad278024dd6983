"""1P1D demo on CPU: one prefill and one decode vLLM engine with PDConnector
(over NIXL) behind vllm-pd-proxy. Prints the generated text, whether it
matches what a single engine generates for the same prompt, and how many KV
bytes moved from P to D, then stops everything it started. P, D and the
proxy share a secret made for this run (docs/security.md): the demo also
shows an unsigned leg sent straight to D being refused.

    ./examples/demo.sh                        # pull mode: D reads P's blocks
    ./examples/demo.sh --transfer-mode push   # push mode: P writes into D's blocks
    ./examples/demo.sh --tp 1,2               # P with TP=1, D with TP=2 (pull)
"""

from __future__ import annotations

import argparse
import re
import secrets
import sys
import time
import urllib.request

from vllm_pd_ext.testing.engines import REPO, Engine, Proxy
from vllm_pd_ext.testing.oracle import compare, near_tie_nats, output_of
from vllm_pd_ext.tools.launch import parse_tp_pair, tp_bind
from vllm_pd_ext.wire import auth

PROMPT = (
    "def fibonacci(n):\n"
    '    """Return the n-th Fibonacci number."""\n'
    "    if n < 2:\n"
    "        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
    "class Cache:\n"
    "    def __init__(self, size):\n"
    "        self.size = size\n"
    "        self.data = {}\n\n"
    "    def get(self, key):\n"
) * 3


def tp_sizes(text: str) -> tuple[int, int]:
    try:
        return parse_tp_pair(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".models/tiny"))
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--transfer-mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--tp", type=tp_sizes, default=(1, 1), metavar="P,D",
                    help="tensor-parallel sizes of P and D (on CPU each rank gets a core "
                         "of its own; a TP=2 engine uses cores 0 and 1)")
    args = ap.parse_args()
    p_tp, d_tp = args.tp
    logs = REPO / ".runs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    mode = {"transfer_mode": args.transfer_mode}
    # One shared secret for this run: signed side-channel frames and legs.
    env = {auth.DEFAULT_SECRET_ENV: secrets.token_urlsafe(32)}
    p = Engine("prefill", args.model, logs, role="kv_producer", cpu_bind=tp_bind(p_tp, "0"),
               tp_size=p_tp, extra_config=mode, env=env)
    d = Engine("decode", args.model, logs, role="kv_consumer", cpu_bind=tp_bind(d_tp, "1"),
               tp_size=d_tp, extra_config=mode, env=env)
    proxy = None
    try:
        print(f"starting P (TP={p_tp}) on :{p.port} and D (TP={d_tp}) on :{d.port} (logs in "
              f"{logs}) ...", flush=True)
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
        # Threshold 0: this one short prompt must be disaggregated (by default
        # the proxy prefills prompts this short on D itself, docs/slo.md).
        proxy = Proxy([p.url], [d.url], logs, env=env,
                      args=["--transfer-mode", args.transfer_mode,
                            "--local-prefill-threshold", "0"]).start().wait_ready()
        print(f"proxy on {proxy.url} ({args.transfer_mode} mode); sending one completion "
              "through it", flush=True)
        before, p_before = d.metrics(), p.metrics()
        t0 = time.perf_counter()
        status, body = proxy.post("/v1/completions", {
            "model": args.model, "prompt": PROMPT, "max_tokens": args.max_tokens,
            "temperature": 0, "return_token_ids": True})
        elapsed = time.perf_counter() - t0
        if status != 200:
            print(f"request failed: HTTP {status}: {body}")
            return 1
        after = d.metrics()
        # The single-engine answer: P serves the same prompt alone (no KV
        # transfer); the salt keeps it off P's prefix cache, so it is one
        # ordinary prefill + decode. The rule: docs/testing.md.
        pd_out = output_of(body)
        status, alone = p.post("/v1/completions", {
            "model": args.model, "prompt": list(pd_out.prompt), "max_tokens": args.max_tokens,
            "temperature": 0, "return_token_ids": True, "cache_salt": "demo-single-engine"})
        if status != 200:
            print(f"single-engine request failed: HTTP {status}: {alone}")
            return 1
        verdict = compare(p.url, args.model, pd_out.prompt, pd_out.tokens,
                          output_of(alone).tokens, near_tie_nats(p.dtype))
        # Push: P counts its WRITEs when it next steps (an idle P does not).
        p.post("/v1/completions", {"model": args.model, "prompt": [1, 2], "max_tokens": 1})
        p_after = p.metrics()

        def delta(key: str) -> int:
            return int(after.get(key, 0) - before.get(key, 0))

        def p_delta(key: str) -> int:
            return int(p_after.get(key, 0) - p_before.get(key, 0))

        kv_bytes = delta("vllm:pd_ext_kv_bytes_total")
        print("\n=== generated text ===")
        print(repr(body["choices"][0]["text"]))
        print("(the tiny model has random weights, so the text is noise: what matters is that "
              "it is the text one engine alone generates)")
        print(f"matches a single engine: {'yes' if verdict.same else 'no'} "
              f"({verdict.summary()})")
        print("\n=== KV handoff P -> D ===")
        print(f"prompt tokens:          {body['usage']['prompt_tokens']}")
        print(f"tokens loaded as KV:    "
              f"{delta('vllm:prompt_tokens_by_source_total[external_kv_transfer]')}")
        print(f"KV bytes moved:         {kv_bytes} ({kv_bytes / 2**20:.2f} MiB)")
        descs = delta("vllm:pd_ext_kv_descriptors_total") or p_delta(
            "vllm:pd_ext_kv_descriptors_total")
        ranks = f" (summed over D's {d_tp} ranks)" if d_tp > 1 else ""
        print(f"KV blocks / descriptors: {delta('vllm:pd_ext_kv_blocks_total')} / {descs}{ranks}")
        if args.transfer_mode == "push":
            print(f"P's WRITEs / bytes:     {p_delta('vllm:pd_ext_kv_writes_total')} / "
                  f"{p_delta('vllm:pd_ext_kv_bytes_written_total')}")
        print(f"request latency:        {elapsed * 1e3:.0f} ms")
        paths = first_token_paths(proxy.url)
        print(f"token #1:               "
              f"{describe_first_token(paths)}")
        # An unsigned handoff leg sent straight to D (what any client of D's
        # port could try): refused before it reaches the engine.
        forged, answer = d.post("/v1/completions", {
            "model": args.model, "prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {
                "do_remote_prefill": True, "remote_engine_id": "x", "remote_host": "127.0.0.1",
                "remote_port": p.side_channel_port, "remote_request_id": "x",
                "remote_block_ids": [[0]], "transfer_mode": args.transfer_mode,
                "pd_request_id": "x"}})
        print("\n=== authenticated control plane (shared secret) ===")
        print(f"unsigned leg sent to D: HTTP {forged}: "
              f"{answer.get('error', {}).get('message', answer)}")
        return 0 if kv_bytes > 0 and verdict.same and forged == 401 else 2
    finally:
        if proxy is not None:
            proxy.stop()
        d.stop()
        p.stop()


def first_token_paths(url: str) -> dict[str, float]:
    """The proxy's ``pd_proxy_first_token_total`` by path (``seeded``: token
    #1 came from P and D computed only its KV, docs/proxy.md)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {m[1] + (f":{m[2]}" if m[2] else ""): float(m[3]) for m in re.finditer(
        r'^pd_proxy_first_token_total\{path="([^"]*)",reason="([^"]*)"\} (\S+)$', text, re.M)}


def describe_first_token(paths: dict[str, float]) -> str:
    """What the proxy did with token #1, in words."""
    if paths.get("seeded"):
        return "from P, D continued from token #2"
    if paths.get("seeded:concurrent"):
        return ("from P, D continued from token #2 (D's leg went out with P's, before "
                "token #1 existed; D appended it when P's KV came)")
    return str(paths)


if __name__ == "__main__":
    sys.exit(main())
