"""``wire/zmq_context.GcSafeContext``: a context the collector cannot hang.

A CI test worker hung for good in ``zmq.Context.term`` inside an unrelated
``ast.parse``: the collection that call triggered found a context and its
open socket in a reference cycle, finalized the context first, and pyzmq's
finalizer waited for a socket whose own finalizer could then never run.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import zmq

from vllm_pd_ext.wire.zmq_context import GcSafeContext

REPO = Path(__file__).resolve().parents[2]

#: A context and its bound socket dropped in a reference cycle, collected.
CYCLE = textwrap.dedent("""
    import gc, sys, threading, time, weakref, zmq
    from vllm_pd_ext.wire.zmq_context import GcSafeContext
    cls = GcSafeContext if sys.argv[1] == "safe" else zmq.Context
    class Holder: pass
    gc.disable()
    h = Holder()
    h.ctx = cls()  # created first: the collector finalizes it first
    h.sock = h.ctx.socket(zmq.PULL)
    h.sock.bind("tcp://127.0.0.1:*")
    h.me = h
    ref = weakref.ref(h.ctx)
    del h
    gc.collect()
    deadline = time.monotonic() + 10
    while ref() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
        gc.collect()
    print("collected", ref() is None, flush=True)
""")


def run_cycle(kind: str, timeout: float) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run([sys.executable, "-W", "ignore", "-c", CYCLE, kind],
                              capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return None


def test_a_context_collected_in_a_cycle_with_its_open_socket_does_not_hang():
    done = run_cycle("safe", timeout=60)
    assert done is not None, "the collection hung"
    assert done.returncode == 0, done.stderr
    # and the context was terminated and freed, not leaked
    assert done.stdout.strip() == "collected True", done.stdout


def test_pyzmq_s_own_context_hangs_there():
    """The control: the case above is the one that hangs with pyzmq's
    context (if this starts passing, pyzmq fixed it and the class can go)."""
    assert run_cycle("plain", timeout=3) is None


def test_explicit_close_and_term_behave_as_pyzmq_s():
    ctx = GcSafeContext()
    sock = ctx.socket(zmq.PUSH)
    sock.close()
    ctx.term()
    assert ctx.closed
    del ctx  # the finalizer of a terminated context does nothing


def test_the_package_creates_no_other_zmq_context():
    """Every ``zmq.Context(...)`` call in vllm_pd_ext goes through the class
    (``zmq.Context.instance()``, never collected, is allowed)."""
    found = []
    for path in (REPO / "vllm_pd_ext").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("Context", "AsyncContext")
                    and isinstance(node.func.value, ast.Name)
                    and node.func.value.id in ("zmq", "azmq")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
