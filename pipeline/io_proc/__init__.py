"""io_proc: the process that owns HTTP, tokenization, detokenization and streaming.

It talks to the scheduler over zmq (control messages only) and reads sampled tokens from the output shared-memory ring.
It never imports ``pipeline.scheduler_proc`` or ``pipeline.gpu_worker`` (docs/design.md, "Overview"). Entry point:
``pipeline.io_proc.main.run_io_proc``.
"""
