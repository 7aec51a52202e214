"""``pipeline-bench --bound``: what the same steps cost the bare model, with no runtime around it (docs/design.md,
"Measuring the token gap").

Replays the worker's recorded steps (``step_shapes``) in one process; the bound is engine throughput ÷ bound throughput,
i.e. replay time ÷ engine wall time.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from pipeline.common.config import EngineConfig
from pipeline.gpu_worker.step_shapes import StepShapes


class BoundReplay:
    """The bare model and a KV cache sized like the engine's, loaded once, replayed per run."""

    def __init__(self, config: EngineConfig):
        from pipeline.gpu_worker.models.loader import load_model

        self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        self.block_size = config.scheduler.block_size
        self.model = load_model(
            config.model, self.dtype, self.device, config.worker.attention_backend, max_model_len=config.max_model_len
        )
        self.kv_caches = self.model.allocate_kv_caches(
            config.num_kv_blocks, config.scheduler.block_size, self.dtype, self.device
        )
        # Row i of a step gets its own run of blocks, spread over the whole cache as the engine's would be.
        width = config.max_blocks_per_seq
        ids = np.arange(config.scheduler.max_num_seqs * width) % config.num_kv_blocks
        self.block_table = torch.from_numpy(ids.reshape(config.scheduler.max_num_seqs, width)).to(self.device)

    def _step(self, query_lens: np.ndarray, start_pos: np.ndarray, sampled: np.ndarray) -> None:
        meta = self.model.attn_backend.build_from_rows(
            query_lens, start_pos, self.block_table[: len(query_lens)], self.block_size
        )
        input_ids = torch.zeros(meta.num_tokens, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, meta.positions, meta, self.kv_caches)
        last = torch.from_numpy(np.cumsum(query_lens)[sampled] - 1).to(self.device)
        self.model.compute_logits(hidden.index_select(0, last)).argmax(-1)

    def replay(self, path: str, label: str) -> float:
        """Replay the steps recorded in ``path`` (step 0 once untimed first); returns their total time in seconds."""
        shapes = StepShapes.load(path)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        with torch.inference_mode():
            if shapes.num_steps:
                self._step(*shapes.step(0))
            sync()
            t0 = time.perf_counter()
            for i in tqdm(range(shapes.num_steps), desc=f"{label} bound", unit="step", file=sys.stderr):
                self._step(*shapes.step(i))
            sync()
            return time.perf_counter() - t0
