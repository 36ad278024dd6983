"""The connector's scheduler half (EngineCore process), one module per side and mode.

``dispatcher.PDScheduler`` receives vLLM's scheduler-side calls and hands each
request to its role: ``p_pull`` (P lends a finished prefill's blocks for D to
read), ``p_push`` (P writes them into D's blocks), ``d_pull`` / ``d_push`` (D's
halves), ``p_readback`` and ``d_keep`` (multi-turn: P reads back the turn D
kept). Nothing here is imported eagerly: pure cores (``bidir``, ``pushbook``)
import without vLLM.
"""
