"""1P1D demo on CPU: one prefill and one decode vLLM engine with PDConnector
(pull mode over NIXL) behind vllm-pd-proxy. Prints the generated text and
how many KV bytes moved from P to D, then stops everything it started.

    ./examples/demo.sh            # sets up .venv and the tiny model, then runs this
"""

from __future__ import annotations

import argparse
import sys
import time

from vllm_pd_ext.testing.engines import REPO, Engine, Proxy

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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".models/tiny"))
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    logs = REPO / ".runs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    p = Engine("prefill", args.model, logs, role="kv_producer", cpu_bind="0")
    d = Engine("decode", args.model, logs, role="kv_consumer", cpu_bind="1")
    proxy = None
    try:
        print(f"starting P on :{p.port} and D on :{d.port} (logs in {logs}) ...", flush=True)
        p.start()
        d.start()
        p.wait_ready()
        d.wait_ready()
        proxy = Proxy([p.url], [d.url], logs).start().wait_ready()
        print(f"proxy on {proxy.url}; sending one completion through it", flush=True)
        before = d.metrics()
        t0 = time.perf_counter()
        status, body = proxy.post("/v1/completions", {
            "model": args.model, "prompt": PROMPT, "max_tokens": args.max_tokens,
            "temperature": 0})
        elapsed = time.perf_counter() - t0
        if status != 200:
            print(f"request failed: HTTP {status}: {body}")
            return 1
        after = d.metrics()

        def delta(key: str) -> int:
            return int(after.get(key, 0) - before.get(key, 0))

        kv_bytes = delta("vllm:pd_ext_kv_bytes_total")
        print("\n=== generated text ===")
        print(repr(body["choices"][0]["text"]))
        print("\n=== KV handoff P -> D ===")
        print(f"prompt tokens:          {body['usage']['prompt_tokens']}")
        print(f"tokens loaded as KV:    "
              f"{delta('vllm:prompt_tokens_by_source_total[external_kv_transfer]')}")
        print(f"KV bytes moved:         {kv_bytes} ({kv_bytes / 2**20:.2f} MiB)")
        print(f"KV blocks / descriptors: {delta('vllm:pd_ext_kv_blocks_total')} / "
              f"{delta('vllm:pd_ext_kv_descriptors_total')}")
        print(f"request latency:        {elapsed * 1e3:.0f} ms")
        return 0 if kv_bytes > 0 else 2
    finally:
        if proxy is not None:
            proxy.stop()
        d.stop()
        p.stop()


if __name__ == "__main__":
    sys.exit(main())
