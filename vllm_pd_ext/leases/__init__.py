"""Who holds lent KV blocks, and until when.

``table`` is the pure lease table (injected clock), ``service`` its one owner
(a lock and named operations), ``lender`` pins blocks in vLLM's block pool
under a lease and frees them exactly once. Pure: no vLLM, torch or NIXL.
"""
