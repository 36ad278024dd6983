"""Multi-turn during a drain, on real vLLM schedulers (no model run).

Once vLLM's SIGTERM reached D's EngineCore (``PDScheduler.on_engine_shutdown``,
the hook ``compat.engine.on_engine_shutdown`` chains in front of vLLM's
handler), vLLM keeps stepping only while it has requests or the connector
says it holds blocks (``has_pending_push_work``). A decode that finishes
then must not keep its turn: a kept turn holds D's blocks for
``decoder_kv_blocks_ttl`` (480 s), so the drain would last until the
force-kill (issue 27, item 6).
"""

from __future__ import annotations

from pdsched import create_request
from pdunit_utils import free_port
from test_bidir_schedulers import BIDIR
from test_scheduler_lifecycle import (
    admit_remote,
    assert_empty_after_step,
    make_scheduler,  # noqa: F401 - fixture
    num_free,
    pd,
    remote_params,
    run_until_finished,
    step,
)


def test_d_turn_finishing_during_the_drain_is_not_kept(make_scheduler):  # noqa: F811
    sched = make_scheduler(**BIDIR)
    free0 = num_free(sched)
    params = remote_params(free_port(), 4, num_tokens=100, pd_bidirectional=True)
    req = create_request(100, kv_transfer_params=params, max_tokens=30)
    admit_remote(sched, req)
    step(sched, finished_recving={req.request_id})  # loaded: decoding

    pd(sched).on_engine_shutdown()  # SIGTERM reaches the EngineCore mid-decode
    # vLLM asks every drain step; nothing is kept yet (vLLM steps for the decode).
    assert pd(sched).has_pending_push_work() is False
    finals = run_until_finished(sched, req, max_steps=35)

    answer = finals[-1].kv_transfer_params
    assert answer is None or "remote_block_ids" not in answer, answer  # no turn offered
    assert len(pd(sched).keeper.kept) == 0
    assert pd(sched).has_pending_push_work() is False  # the drain ends with the decode
    step(sched)
    assert num_free(sched) == free0
    assert_empty_after_step(sched)

