"""testing/soak_client.send against a fake engine on 127.0.0.1: what it
records for a complete stream, an error event, a cut stream, a silent server
(the deadline's watchdog) and a plain JSON answer. These are the fields
soak_plan.classify judges, so each case also checks the verdict."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_pd_ext.testing.soak_client import send
from vllm_pd_ext.testing.soak_plan import Job, Verdict, classify

Reply = Callable[[BaseHTTPRequestHandler], None]


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def tokens(*ids: int) -> bytes:
    return event({"choices": [{"index": 0, "text": "t", "token_ids": list(ids)}]})


def streaming(*pieces: bytes, delay_s: float = 0.0, hold_s: float = 0.0) -> Reply:
    """A 200 event stream (HTTP/1.0: the body ends when the connection does),
    its first piece after ``delay_s``, the connection held ``hold_s`` after the last."""

    def reply(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        time.sleep(delay_s)
        for piece in pieces:
            h.wfile.write(piece)
            h.wfile.flush()
        time.sleep(hold_s)

    return reply


@pytest.fixture
def engine() -> Iterator[Callable[[Reply], str]]:
    servers: list[ThreadingHTTPServer] = []

    def start(reply: Reply) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                reply(self)

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def job(stream: bool = True) -> Job:
    return Job("r1", [1, 2, 3], stream, None)


def test_complete_stream(engine) -> None:
    url = engine(streaming(tokens(7, 8), b": comment\n\n", tokens(9), b"data: [DONE]\n\n"))
    r = send(url, "m", job(), 3, deadline_s=10, clock=time.monotonic)
    assert (r.status, r.tokens, r.done_marker, r.error, r.timed_out) == (
        200, [7, 8, 9], True, None, False)
    assert classify(r, [7, 8, 9]) is Verdict.EQUAL


def test_error_event_is_the_error_the_client_was_given(engine) -> None:
    error = {"message": "kv load failed", "code": 502}
    url = engine(streaming(tokens(7), event({"error": error}), b"data: [DONE]\n\n"))
    r = send(url, "m", job(), 3, deadline_s=10, clock=time.monotonic)
    assert r.error is not None and json.loads(r.error) == error
    assert not r.done_marker and classify(r, [7]) is Verdict.CLEAN_ERROR


def test_cut_stream_is_truncated(engine) -> None:
    url = engine(streaming(tokens(7), tokens(8)))
    r = send(url, "m", job(), 3, deadline_s=10, clock=time.monotonic)
    assert (r.tokens, r.done_marker, r.timed_out) == (None, False, False)
    assert classify(r, [7, 8]) is Verdict.TRUNCATED


def test_silent_server_hits_the_deadline(engine) -> None:
    """The watchdog closes the socket at the deadline (1 s). The first event
    comes late (0.6 s) so that the socket's own idle timeout (the deadline
    again, from the last byte: 1.6 s) cannot be what ends the read."""
    url = engine(streaming(tokens(7), delay_s=0.6, hold_s=6.0))
    t0 = time.monotonic()
    r = send(url, "m", job(), 3, deadline_s=1.0, clock=time.monotonic)
    assert time.monotonic() - t0 < 4.0  # the watchdog, not the server's 6 s
    assert r.timed_out and r.tokens is None and classify(r, [7]) is Verdict.HANG


def test_plain_json_answer(engine) -> None:
    def reply(h: BaseHTTPRequestHandler) -> None:
        body = json.dumps({"choices": [{"text": "ab", "token_ids": [4, 5]}]}).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    r = send(engine(reply), "m", job(stream=False), 2, deadline_s=10, clock=time.monotonic)
    assert (r.status, r.tokens) == (200, [4, 5]) and classify(r, [4, 5]) is Verdict.EQUAL
