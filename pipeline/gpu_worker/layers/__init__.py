"""Building blocks of the model families (``pipeline.gpu_worker.models``); each layer takes its switches."""
