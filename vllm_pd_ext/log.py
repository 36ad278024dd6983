"""Loggers under vLLM's ``vllm`` logger, so our lines share its handler and format.

vLLM configures only the ``vllm`` logger tree; a plain ``vllm_pd_ext.*``
logger would print INFO lines nowhere in a served engine.
"""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger("vllm.pd_ext." + name.removeprefix("vllm_pd_ext."))
