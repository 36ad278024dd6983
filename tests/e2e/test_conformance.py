"""Request parity in pull mode: every case of ``conformance.CASES`` through
``vllm-pd-proxy`` in front of the session's P and D equals the collocated
reference engine's answer, with the KV moved where the case says, and no
block held on either engine afterwards (issue 24)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conformance import CASES, Case, check_case
from tests.e2e.helpers import assert_nothing_held, log_dir
from vllm_pd_ext.testing.engines import Engine, Proxy

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def proxy(p: Engine, d: Engine, model: str) -> Iterator[Proxy]:
    px = Proxy([p.url], [d.url], log_dir("conformance")).start()
    try:
        yield px.wait_ready()
    finally:
        px.stop()
    # After every case: nothing of any request stays held on P or D.
    assert_nothing_held([p], [d], model, within_s=20, what="conformance (pull)")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_same_as_collocated_pull(case: Case, ref: Engine, d: Engine, proxy: Proxy,
                                 model: str) -> None:
    print(check_case(case, ref, proxy.url, d, model))
