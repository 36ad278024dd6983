"""Console tools shipped beside the connector (the connector never imports them).

``sizing`` is ``vllm-pd-size`` (KV bytes and the handoff floor), ``slo`` is
``vllm-pd-bench`` (aggregated vs disaggregated at equal budget), ``launch``
starts local engines and a proxy for them, ``sse`` reads a completion stream.
"""
