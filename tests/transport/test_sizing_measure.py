"""vllm-pd-size --measure on real NIXL: two processes, READs of three sizes."""

from __future__ import annotations

import json

from vllm_pd_ext.tools.sizing.cli import main
from vllm_pd_ext.tools.sizing.measure import DEFAULT_SIZES, measure


def test_measure_reads_three_sizes_between_two_processes():
    m = measure(reps=2)
    assert [b for b, _ in m.points] == sorted(DEFAULT_SIZES)
    assert all(t > 0 for _, t in m.points)
    assert m.points[-1][1] > m.points[0][1]  # 64 MiB takes longer than 64 KiB
    assert m.effective_bandwidth_gb_s > 0.05
    # The fitted setup term is the line's intercept at the smallest size,
    # so it never exceeds that read's own time.
    assert m.setup_ms <= m.points[0][1] * 1e3
    assert "'lo'" in m.where and "not a link to another host" in m.where


def test_cli_uses_the_measured_link_and_setup(capsys):
    main(["--layers", "4", "--kv-heads", "2", "--head-dim", "64", "--kv-dtype", "bf16",
          "--tokens", "300", "--link", "10", "--measure", "--measure-reps", "2", "--json"])
    out = json.loads(capsys.readouterr().out)
    measured = out["measured"]
    links = [link["effective_bandwidth_gb_s"] for link in out["prompts"][0]["links"]]
    assert links == [10, round(measured["effective_bandwidth_gb_s"], 3)]
    assert out["setup_ms"] == measured["setup_ms"]  # no --setup-ms: the measured term
