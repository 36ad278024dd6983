"""The chaos soak's clients: one request with a hard deadline, and the
client-side faults (disconnects, the abort burst, the malformed D leg).

Plain ``http.client`` and sockets, one thread per call, so that a stuck
server shows up as a deadline passing here instead of hanging the soak.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from vllm_pd_ext.testing.soak_plan import Job, Result
from vllm_pd_ext.tools import sse


def body_of(model: str, job: Job, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": job.prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream": job.stream}


def send(url: str, model: str, job: Job, max_tokens: int, deadline_s: float,
         clock: Callable[[], float]) -> Result:
    """POST one completion; fills in everything ``soak_plan.classify`` needs.

    The deadline bounds the whole exchange: a watchdog closes the socket
    when it passes, so a silent server cannot hold this thread longer.
    """
    res = Result(job.rid, started_s=clock(), stream=job.stream)
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=deadline_s)
    expired = threading.Event()

    def watchdog() -> None:
        expired.set()
        try:
            if conn.sock is not None:
                conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    timer = threading.Timer(deadline_s, watchdog)
    timer.daemon = True
    timer.start()
    try:
        payload = json.dumps(body_of(model, job, max_tokens)).encode()
        conn.request("POST", "/v1/completions", payload,
                     {"Content-Type": "application/json", "X-Request-Id": job.rid})
        resp = conn.getresponse()
        res.status = resp.status
        if resp.status != 200:
            res.error = resp.read()[:500].decode(errors="replace") or f"HTTP {resp.status}"
        elif job.stream:
            _read_stream(resp, res)
        else:
            data = json.loads(resp.read())
            res.tokens = sse.token_ids_of(data)
    except (OSError, http.client.HTTPException, json.JSONDecodeError, ValueError) as exc:
        # No status line, or a body that broke off: the client was told
        # nothing (classify: truncated, or a hang when the deadline did it).
        if not res.done_marker:
            res.tokens = None
        res.detail = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        timer.cancel()
        conn.close()
        res.ended_s = clock()
        res.timed_out = expired.is_set()
    return res


def _read_stream(resp: http.client.HTTPResponse, res: Result) -> None:
    """Tokens up to ``[DONE]`` (``res.tokens``), or the first error event
    (``res.error``); a stream that ends without either leaves ``res.tokens``
    None. Reads what has arrived (``read1``), so the deadline's watchdog
    ends a silent stream here with an ``OSError``."""
    tokens: list[int] = []
    for event in sse.response_events(resp):
        if event.kind is sse.Kind.DONE:
            res.done_marker = True
            res.tokens = tokens
            return
        if event.kind is sse.Kind.ERROR:
            res.error = json.dumps(event.data["error"])[:500]
            return
        tokens += sse.token_ids_of(event.data)
    res.tokens = None  # neither [DONE] nor an error event: truncated


def _raw_request(url: str, body: dict[str, Any], rid: str) -> socket.socket:
    u = urllib.parse.urlsplit(url)
    s = socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=10)
    payload = json.dumps(body).encode()
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {u.netloc}\r\n"
              f"Content-Type: application/json\r\nX-Request-Id: {rid}\r\n"
              f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return s


def disconnect_early(url: str, body: dict[str, Any], rid: str) -> str:
    """Send a request and close before any byte of the answer."""
    s = _raw_request(url, dict(body, stream=True), rid)
    time.sleep(0.05)
    s.close()
    return "closed before the first byte"


def disconnect_mid(url: str, body: dict[str, Any], rid: str, timeout_s: float = 60) -> str:
    """Read a stream until its first data event, then close."""
    s = _raw_request(url, dict(body, stream=True, max_tokens=64), rid)
    s.settimeout(timeout_s)
    got = b""
    try:
        while b"data:" not in got:
            chunk = s.recv(4096)
            if not chunk:
                return f"the server closed first: {got[:120]!r}"
            got += chunk
    except OSError as exc:
        return f"no first event: {exc}"
    finally:
        s.close()
    return "closed after the first event"


def abort_burst(url: str, bodies: list[tuple[str, dict[str, Any]]], hold_s: float = 0.5) -> str:
    """Open every request at once, then close them all together."""
    socks: list[socket.socket] = []
    errors = 0
    for rid, body in bodies:
        try:
            socks.append(_raw_request(url, dict(body, stream=True), rid))
        except OSError:
            errors += 1
    time.sleep(hold_s)
    for s in socks:
        s.close()
    return f"{len(socks)} opened and closed together" + (f", {errors} failed to open"
                                                         if errors else "")


MALFORMED_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "x" * 5000,
                    "remote_block_ids": "not a list", "remote_host": "\x00bad",
                    "remote_port": -1}


MALFORMED_PROMPT = [11, 12, 13]


def malformed_d_leg(d_url: str, model: str, rid: str
                    ) -> tuple[int | None, str, list[int] | None]:
    """A D leg with hostile ``kv_transfer_params``, straight to a D:
    (status, body, generated token ids of a 200)."""
    u = urllib.parse.urlsplit(d_url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions", json.dumps(
            {"model": model, "prompt": MALFORMED_PROMPT, "max_tokens": 4, "temperature": 0,
             "return_token_ids": True, "kv_transfer_params": MALFORMED_PARAMS}).encode(),
            {"Content-Type": "application/json", "X-Request-Id": rid})
        resp = conn.getresponse()
        raw = resp.read()
        tokens = None
        if resp.status == 200:
            try:
                tokens = json.loads(raw)["choices"][0]["token_ids"]
            except (ValueError, KeyError, IndexError, TypeError):
                tokens = None
        return resp.status, raw[:300].decode(errors="replace"), tokens
    except (OSError, http.client.HTTPException) as exc:
        return None, f"{type(exc).__name__}: {exc}", None
    finally:
        conn.close()
