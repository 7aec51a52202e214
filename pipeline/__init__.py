"""pipeline: an LLM serving runtime with asynchronous scheduling.

Three OS processes (``io_proc``, ``scheduler_proc``, ``gpu_worker``) exchange per-step data through shared-memory rings
(``pipeline.common.shm_ring``) and control messages over zmq (``pipeline.common.messages``).
"""

__version__ = "0.1.0"
