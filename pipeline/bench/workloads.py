"""The benchmark's requests: prompts as token ids and output lengths, from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from pipeline.common.constants import SIM_WORD_ID_RANGE as WORD_IDS


@dataclass
class Workload:
    """Prompts (token ids) and output lengths; every request ignores EOS."""

    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def fixed(cls, batch_size: int, input_len: int, output_len: int, seed: int) -> Workload:
        """``batch_size`` requests of ``input_len`` prompt and ``output_len`` output tokens."""
        rng = random.Random(seed)
        return cls(
            [[rng.randrange(*WORD_IDS) for _ in range(input_len)] for _ in range(batch_size)], [output_len] * batch_size
        )

    @classmethod
    def sharegpt_synth(cls, num_requests: int, max_model_len: int, seed: int) -> Workload:
        """Long-tailed lengths like ShareGPT conversations: log-normal prompt
        (median 180 tokens) and output (median 130) lengths, clipped to fit."""
        rng = np.random.default_rng(seed)
        inp = np.clip(rng.lognormal(np.log(180), 1.0, num_requests), 4, max_model_len // 2).astype(int)
        out = np.clip(rng.lognormal(np.log(130), 0.9, num_requests), 2, max_model_len // 2 - 1).astype(int)
        r = random.Random(seed)
        return cls([[r.randrange(*WORD_IDS) for _ in range(n)] for n in inp.tolist()], out.tolist())
