"""``vllm-pd-size``: ``formula`` (pure), ``measure`` (the transport's bandwidth
here, needs NIXL), ``cli``."""
