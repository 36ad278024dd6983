"""What crosses a process boundary: typed messages and the channels they take.

``protocol`` (the msgspec messages and ``kv_transfer_params``), ``auth`` (HMAC
frames and signed legs), ``side_channel`` (the ZMQ server and client),
``outbox`` (per-peer sender lanes), ``specs`` (the scheduler -> worker step
payload), ``telemetry`` (per-handoff records), ``wakeup`` (worker -> scheduler
wake-ups). No module here imports vLLM, torch or NIXL.
"""
