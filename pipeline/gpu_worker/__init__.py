"""gpu_worker: the process that owns the device (model, KV cache, token-id cache, sampler)."""
