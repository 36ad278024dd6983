"""The short seeded chaos soak (issue 11's CI tier): 2P2D, about 100
requests, every fault class at least once. Where network namespaces can be
used (root, ``ip netns``, a C compiler for the UCX shim) each engine runs in
its own namespace with UCX over TCP and the partitions are among the faults;
elsewhere the soak runs on 127.0.0.1 with every class but the partitions,
and says why (vllm_pd_ext/testing/netns.py).

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
from vllm_pd_ext.testing.soak_plan import table

pytestmark = pytest.mark.engine


def test_short_soak_every_fault_class_nothing_lost_leaked_or_wrong(
        model: str, ref: Engine) -> None:
    why_not = netns.engines_unavailable()
    if why_not is not None:
        print(f"soak on 127.0.0.1 without partitions: namespaces unavailable ({why_not})")
    cfg = SoakConfig(mode="pull", requests=100, faults=0, clients=6, seed=11, lease_s=6.0,
                     log_dir=log_dir("soak"), progress=False, netns=why_not is None)
    kinds = fault_kinds(cfg)
    cfg.faults = len(kinds)
    rep = run(cfg, model, ref=ref)
    (cfg.log_dir / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    print(table(rep["summary"]))
    assert {f["fault"]["kind"] for f in rep["faults"]} == {str(k) for k in kinds}
    assert rep["summary"]["requests"] >= 100
    assert not rep["violations"], "\n".join(rep["violations"][:20])
    # Most requests still succeed: the faults cost only the requests they hit.
    assert rep["summary"]["equal"] >= 0.7 * rep["summary"]["requests"], rep["summary"]
