"""vllm_pd_proxy: an aiohttp front-end for vLLM prefill/decode disaggregation.

Role: accept OpenAI-style completion requests, run the prefill (P) leg on a
prefill engine and the decode (D) leg on a decode engine with the
``kv_transfer_params`` handshake of vLLM's KV connectors, and relay D's answer
to the client. ``create_app`` (in :mod:`vllm_pd_proxy.app`) builds the
application; ``vllm-pd-proxy`` (:mod:`vllm_pd_proxy.cli`) runs it.

This package must stay light: it imports neither vllm, torch, nixl nor zmq, so
it can run on a host without the inference stack.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
