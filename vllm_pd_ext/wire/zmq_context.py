"""A zmq context that the garbage collector cannot hang.

Role: every zmq context this package creates is a ``GcSafeContext``.

Why: pyzmq's ``Context.__del__`` calls ``destroy()``, which closes the
sockets the context still tracks and then calls ``term()``; ``term()``
blocks until every socket of the context is closed. The context tracks
its sockets in a ``WeakSet``. When a context and its sockets become
garbage together (an object that holds both, in a reference cycle, dropped
without ``close()``: a scheduler a test never shut down, a connector whose
engine died mid-init), the collector clears those weak references before
it runs any finalizer, so ``destroy()`` finds no socket, and if the
context is finalized before its sockets, ``term()`` waits for sockets whose
own finalizers can no longer run: the thread that triggered the
collection hangs for ever. It hung a CI test worker in ``Context.term``,
called from an ``ast.parse`` that happened to trigger the collection;
in an engine it would hang whichever thread allocated at that moment.

What: ``__del__`` hands ``term()`` to a short-lived daemon thread and
returns, so the collection goes on, finalizes the sockets (each closes
itself), and the thread's ``term()`` then returns. Explicit ``close()``
/ ``term()`` / ``destroy()`` behave as pyzmq's.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import zmq
from zmq.sugar import context as _zmq_context

__all__ = ["GcSafeContext"]


class GcSafeContext(zmq.Context):  # type: ignore[type-arg]
    """``zmq.Context`` whose finalizer never blocks (see the module)."""

    def __del__(self) -> None:
        # As pyzmq's: nothing for a shadow, a closed context, or at exit.
        if getattr(self, "_shadow", True) or self.closed or _zmq_context._exiting:
            return
        # Not destroy(): the sockets it could still find are finalized by
        # the same collection, on this thread, once this returns.
        with contextlib.suppress(RuntimeError):  # no new threads at shutdown
            threading.Thread(target=_term, args=(self,), name="pd-zmq-term",
                             daemon=True).start()


def _term(ctx: Any) -> None:
    with contextlib.suppress(zmq.ZMQError):  # already terminated elsewhere
        zmq.Context.term(ctx)
