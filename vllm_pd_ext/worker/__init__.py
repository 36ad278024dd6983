"""The connector's worker half (one per worker process / TP rank).

``dispatcher.PDWorker`` registers the KV cache with the transport and hands
each step's specs to this rank's role: ``d_pull`` (D reads P's blocks),
``d_push`` (D waits for P's WRITEs), ``p_push`` (P posts the WRITEs). A pull P
runs nothing here: D reads, the scheduler half pins.
"""
