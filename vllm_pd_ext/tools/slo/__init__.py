"""``vllm-pd-bench``: the equal-budget SLO benchmark, aggregated against
disaggregated serving at the same GPU count and the same open-loop trace.

Layers, lightest first: ``trace`` (the request schedule and prompts),
``metrics`` (per-request results, SLO cutoffs, one rate point's summary and
queue trend, the gates), ``verdict`` (SLO-compliant capacity per deployment
and the comparison), ``breakdown`` (TTFT split from the proxy's telemetry) are
pure; ``client`` sends a trace over HTTP (aiohttp) and ``plots`` draws the
figures (matplotlib, optional). None of them imports vLLM, torch or NIXL.
"""
