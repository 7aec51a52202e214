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


@dataclass
class MultiTurn:
    """Chat traffic: users that each hold a conversation of several turns, in a closed loop.

    Every turn's prompt is the shared system prompt, then the user's earlier
    messages each followed by the reply it got (the server's own tokens),
    then a new message; a user sends its next turn when the previous reply
    has ended. Replies are ``output_len`` tokens, ignoring EOS.
    """

    system: list[int]
    messages: list[list[list[int]]]  # [user][turn] -> that turn's new message
    output_len: int

    @classmethod
    def synth(
        cls, num_users: int, num_turns: int, system_len: int, message_len: int, output_len: int, seed: int
    ) -> MultiTurn:
        rng = random.Random(seed)

        def words(n: int) -> list[int]:
            return [rng.randrange(*WORD_IDS) for _ in range(n)]

        return cls(
            words(system_len), [[words(message_len) for _ in range(num_turns)] for _ in range(num_users)], output_len
        )

    @property
    def num_users(self) -> int:
        return len(self.messages)

    @property
    def num_turns(self) -> int:
        return len(self.messages[0])

    @property
    def max_len(self) -> int:
        """Tokens of the longest conversation: prompt and reply of its last turn."""
        return len(self.system) + max(sum(map(len, m)) for m in self.messages) + self.num_turns * self.output_len

    def prompt(self, user: int, replies: list[list[int]]) -> list[int]:
        """The prompt of ``user``'s turn ``len(replies)``, given the replies to its earlier turns."""
        out = list(self.system)
        for message, reply in zip(self.messages[user], replies):
            out += message + reply
        return out + self.messages[user][len(replies)]
