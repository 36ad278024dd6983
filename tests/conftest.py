"""Suite-wide environment: loopback-only UCX and vLLM, no Hub access."""

import os

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
