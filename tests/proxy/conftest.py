"""Fixtures for the proxy tests: fake vLLM engines and a proxy in front of them.

Every server binds 127.0.0.1 on an ephemeral port (aiohttp's TestServer) and
is closed at the end of its test.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pdproxy_helpers import FakeEngine
from vllm_pd_proxy.app import create_app
from vllm_pd_proxy.config import ProxyConfig


@pytest.fixture
async def engines() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    """Factory: ``await engines("prefill", engine_id=...)`` starts a fake engine."""
    started: list[FakeEngine] = []

    async def _make(role: str, **kwargs: Any) -> FakeEngine:
        engine = await FakeEngine(role, **kwargs).start()
        started.append(engine)
        return engine

    yield _make
    for engine in started:
        await engine.close()


@pytest.fixture
async def proxy() -> AsyncIterator[Callable[..., Awaitable[TestClient[Any, Any]]]]:
    """Factory: ``await proxy([p...], [d...], **config)`` starts the proxy."""
    clients: list[TestClient[Any, Any]] = []

    async def _make(
        prefill: list[FakeEngine], decode: list[FakeEngine], **kwargs: Any
    ) -> TestClient[Any, Any]:
        kwargs.setdefault("health_interval", 60.0)
        # The tests' prompts are short: disaggregate them unless a test sets
        # a threshold (the proxy's default prefills short prompts on D).
        kwargs.setdefault("local_prefill_threshold", 0)
        # The tests of one leg's failure see it reach the client, as with
        # --max-migrations 0; test_migration.py runs the default (2).
        kwargs.setdefault("max_migrations", 0)
        # The legs' shapes and push's concurrent legs are those of the path
        # on which D computes token #1; test_first_token_flow.py runs the
        # default (token #1 from P).
        kwargs.setdefault("first_token_from_prefill", False)
        config = ProxyConfig(
            prefill=tuple(e.url for e in prefill),
            decode=tuple(e.url for e in decode),
            **kwargs,
        )
        client: TestClient[Any, Any] = TestClient(TestServer(create_app(config), host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield _make
    for client in clients:
        await client.close()
