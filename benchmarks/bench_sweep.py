"""P's scheduler time per step against the number of live leases, old vs new.

Every P step (and every arriving request) runs ``PDScheduler._sweep`` and
vLLM asks ``has_pending_block_frees``; before issue 9 both scanned every
lease (and, in push mode, every waiting registration), so an idle-looking
P paid for its load on every step. This drives that exact path through the
real ``PDScheduler`` (P side, no vLLM scheduler, no sockets: a duck-typed
vLLM config and a fake block pool) with 0, 100 and 1,000 live leases, and
reports the median step time over many steps and its ratio to 0 leases.

The old and the new code run in the same invocation, each in its own child
process: "old" is ``vllm_pd_ext`` as of ``--old-ref`` (default: the parent
of the commit that added ``lease_service.py``, or ``HEAD`` while that is not
committed), extracted with ``git archive``; "new" is this working tree. The
configurations are stepped round-robin so drift hits each alike.

    . .venv/bin/activate && python benchmarks/bench_sweep.py
    python benchmarks/bench_sweep.py --steps 20000 --sizes 0 100 1000 10000

Push mode ("push" rows): N leases whose prefill waits for D's registration
plus N registrations waiting for their prefill, as ``request_finished`` and
the side channel create them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# Child: one implementation, every size, both modes.
# --------------------------------------------------------------------------
class _BlockPool:
    def __init__(self, num_blocks: int) -> None:
        self.blocks = list(range(num_blocks))

    def touch(self, blocks: Any) -> None:
        return

    def free_blocks(self, blocks: Any) -> None:
        list(blocks)


def _vllm_config() -> Any:
    """What ``PDScheduler.__init__`` reads from vLLM's config, nothing more."""
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(engine_id="bench-p"),
        cache_config=SimpleNamespace(block_size=16, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_index=0,
                                        data_parallel_rank=0),
        model_config=SimpleNamespace(served_model_name="bench", model="bench", dtype="float32",
                                     get_num_layers=lambda pc: 1,
                                     get_num_kv_heads=lambda pc: 1, get_head_size=lambda: 8),
    )


def _scheduler(mode: str, num_leases: int) -> Any:
    from vllm_pd_ext.compat import RequestStatus
    from vllm_pd_ext.config import PDConfig
    from vllm_pd_ext.scheduler.dispatcher import PDScheduler
    from vllm_pd_ext.wire import protocol as proto

    sched = PDScheduler(_vllm_config(), PDConfig.from_extra_config({"transfer_mode": mode}))
    sched.bind_gpu_block_pool(_BlockPool(num_leases + 1))
    for i in range(num_leases):
        params: dict[str, Any] = {"do_remote_decode": True}
        if mode == "push":
            params.update(transfer_mode="push", pd_request_id=f"pd-{i}")
        req = SimpleNamespace(request_id=f"p-{i}", kv_transfer_params=params,
                              status=RequestStatus.FINISHED_LENGTH_CAPPED,
                              num_computed_tokens=16)
        _, out = sched.request_finished(req, [i])
        assert out is not None and out["remote_block_ids"] == [[i]], out
    if mode == "push":
        assert sched.producer is not None
        agent = proto.AgentInfo(tp_rank=0, agent_name="d", agent_metadata=b"m",
                                mem_type="DRAM", regions=[proto.Region(0, 64, 64, 8)])
        for i in range(num_leases):
            reply = sched.producer.handle(proto.PushRegister(
                engine_id="bench-d", compat=sched.compat, expect_engine_id=sched.engine_id,
                pd_request_id=f"waiting-{i}", request_id=f"d-{i}", notify_host="127.0.0.1",
                notify_port=9, agents=[agent], first_block=0, block_ids=[0], num_tokens=16,
                ttl_s=proto.MAX_TTL_S))
            assert isinstance(reply, proto.PushAccepted) and reply.state == "waiting", reply
    assert sched.num_pinned_requests == num_leases
    return sched


def _child(sizes: list[int], steps: int) -> dict[str, Any]:
    import vllm_pd_ext

    result: dict[str, Any] = {"package": str(Path(vllm_pd_ext.__file__).parent)}
    for mode in ("pull", "push"):
        scheds = {n: _scheduler(mode, n) for n in sizes}
        samples: dict[int, list[int]] = {n: [] for n in sizes}
        for step in range(steps + steps // 10):
            for n in sizes:
                sched = scheds[n]
                t0 = time.perf_counter_ns()
                sched._sweep()
                sched.has_pending_block_frees()
                dt = time.perf_counter_ns() - t0
                if step >= steps // 10:  # the first tenth warms up
                    samples[n].append(dt)
        for n, sched in scheds.items():
            assert sched.num_pinned_requests == n  # nothing was freed while measuring
            sched.shutdown()
        result[mode] = {str(n): statistics.median(samples[n]) / 1e3 for n in sizes}
    return result


# --------------------------------------------------------------------------
# Parent: extract the old package, run both children, print the table.
# --------------------------------------------------------------------------
def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def _default_old_ref() -> str:
    added = _git("log", "--diff-filter=A", "--format=%H", "--", "vllm_pd_ext/lease_service.py")
    return f"{added.splitlines()[-1]}^" if added else "HEAD"


def _run_child(name: str, pythonpath: Path, sizes: list[int], steps: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    out = subprocess.run(
        [sys.executable, __file__, "--child", "--steps", str(steps),
         "--sizes", *map(str, sizes)], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{name} child failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).is_relative_to(pythonpath):
        sys.exit(f"{name} child imported {result['package']}, not the copy under {pythonpath}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 100, 1000])
    ap.add_argument("--steps", type=int, default=5000, help="measured steps per size")
    ap.add_argument("--old-ref", default=None, help="git ref of the old code")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = sorted(set(args.sizes) | {0})
    if args.child:
        print(json.dumps(_child(sizes, args.steps)))
        return
    old_ref = args.old_ref or _default_old_ref()
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", old_ref, "vllm_pd_ext"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        old = _run_child("old", Path(tmp), sizes, args.steps)
    new = _run_child("new", REPO, sizes, args.steps)
    print(f"P scheduler step (_sweep + has_pending_block_frees), median of {args.steps} steps; "
          f"old = {old_ref} ({_git('rev-parse', '--short', old_ref)}), new = working tree")
    print(f"{'mode':<5} {'live leases':>11} {'old us':>9} {'old x0':>7} {'new us':>9} "
          f"{'new x0':>7} {'old/new':>8}")
    for mode in ("pull", "push"):
        for n in sizes:
            o, w = old[mode][str(n)], new[mode][str(n)]
            print(f"{mode:<5} {n:>11} {o:>9.2f} {o / old[mode]['0']:>7.2f} {w:>9.2f} "
                  f"{w / new[mode]['0']:>7.2f} {o / w:>8.1f}")
    worst = max(new[m][str(max(sizes))] / new[m]["0"] for m in ("pull", "push"))
    print(f"RESULT {json.dumps({'old': old, 'new': new, 'new_worst_ratio': round(worst, 3)})}")


if __name__ == "__main__":
    main()
