"""The short seeded chaos soak (issue 11's CI tier): 2P2D on 127.0.0.1,
about 100 requests, every fault class that runs on loopback at least once
(all but partitions, which need namespaces: vllm_pd_ext/testing/netns.py).

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
from vllm_pd_ext.testing.engines import Engine
from vllm_pd_ext.testing.soak import SoakConfig, run
from vllm_pd_ext.testing.soak_plan import LOOPBACK_FAULTS, table

pytestmark = pytest.mark.engine


def test_short_soak_every_fault_class_nothing_lost_leaked_or_wrong(
        model: str, ref: Engine) -> None:
    cfg = SoakConfig(mode="pull", requests=100, faults=len(LOOPBACK_FAULTS), clients=6, seed=11,
                     lease_s=6.0, log_dir=log_dir("soak"), progress=False)
    rep = run(cfg, model, ref=ref)
    (cfg.log_dir / "report.json").write_text(json.dumps(rep, indent=1, default=str))
    print(table(rep["summary"]))
    assert {f["fault"]["kind"] for f in rep["faults"]} == {str(k) for k in LOOPBACK_FAULTS}
    assert rep["summary"]["requests"] >= 100
    assert not rep["violations"], "\n".join(rep["violations"][:20])
    # Most requests still succeed: the faults cost only the requests they hit.
    assert rep["summary"]["equal"] >= 0.7 * rep["summary"]["requests"], rep["summary"]
