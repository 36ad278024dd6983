"""The short seeded chaos soak (issue 11's CI tier): 2P2D, about 100
requests, every fault class at least once. Each engine runs in its own
network namespace with UCX over TCP, and the partitions are among the
faults. Without namespaces (root, ``ip netns``, a C compiler for the UCX
shim: vllm_pd_ext/testing/netns.py) the test skips and says why, as the
other namespace tests do: it never falls back to 127.0.0.1, where the
partitions could not run (``python -m vllm_pd_ext.testing.soak`` without
``--netns`` is that loopback soak). CI allows no skip (tests/conftest.py).

``vllm_pd_ext/testing/soak.py`` does the work; this test runs it with the
session's collocated engine as the reference and fails on any violation of
its oracle: a hang, a 200 with other tokens, a stream cut without an error
event, a block held at the end, an engine down, threads or descriptors
grown, a malformed D leg answered with anything but a 4xx, or a fault that
could not be carried out. The full soak (1,000 requests, both modes) is
``python -m vllm_pd_ext.testing.soak`` (docs/reliability.md).
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import log_dir
from vllm_pd_ext.testing import netns
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.testing.soak import SoakConfig, fault_kinds, run
from vllm_pd_ext.testing.soak_plan import FaultKind, table

UNAVAILABLE = netns.engines_unavailable()
pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(UNAVAILABLE is not None,
                                 reason=f"soak needs network namespaces: {UNAVAILABLE}")]


def test_short_soak_every_fault_class_nothing_lost_leaked_or_wrong(
        model: str, ref: Engine) -> None:
    cfg = SoakConfig(mode="pull", requests=100, faults=0, clients=6, seed=11, lease_s=6.0,
                     log_dir=log_dir("soak"), progress=False, netns=True)
    kinds = fault_kinds(cfg)
    assert {FaultKind.PARTITION_SHORT, FaultKind.PARTITION_LONG} <= set(kinds)
    cfg.faults = len(kinds)
    rep = run(cfg, model, ref=ref)
    (cfg.log_dir / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    print(table(rep["summary"]))
    assert {f["fault"]["kind"] for f in rep["faults"]} == {str(k) for k in kinds}
    assert rep["summary"]["requests"] >= 100
    assert not rep["violations"], "\n".join(rep["violations"][:20])
    # Most requests still succeed: the faults cost only the requests they hit.
    assert rep["summary"]["equal"] >= 0.7 * rep["summary"]["requests"], rep["summary"]
