"""The benchmark's requests: prompts as token ids and output lengths, from a seed."""

from __future__ import annotations

import ast
import importlib
import inspect
import random
import textwrap
from dataclasses import dataclass

import numpy as np

from pipeline.common.constants import SIM_WORD_ID_RANGE as WORD_IDS

# Where the rewrite workload's code comes from: pure-Python standard-library modules, whose
# functions of 20-80 lines are real code a user might paste (the same on every machine with the
# same Python).
_REWRITE_MODULES = (
    "argparse",
    "base64",
    "calendar",
    "configparser",
    "dataclasses",
    "difflib",
    "functools",
    "gettext",
    "ipaddress",
    "json.encoder",
    "locale",
    "posixpath",
    "pprint",
    "random",
    "statistics",
    "textwrap",
    "tokenize",
    "urllib.parse",
)
_REWRITE_TASKS = (
    "Rewrite the following Python function, adding type hints. Reply with the code only.",
    "Add a comment above every block of the following Python function and return the whole function.",
    "Rename the function below to follow snake_case if needed and return the complete code unchanged otherwise.",
    "Fix any bugs in the following Python function and return the corrected code in full.",
)


# The structured workload's schema: a free string, an array and an enum, as an agent's JSON reply.
STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}},
        "sentiment": {"enum": ["positive", "neutral", "negative"]},
    },
    "required": ["summary", "keywords", "sentiment"],
}
_STRUCTURED_TOPICS = ("the sea", "a city at night", "autumn leaves", "a chess game", "a train journey", "coffee")


@dataclass
class Workload:
    """Prompts (token ids) and output lengths; every request ignores EOS, except those with a ``response_formats`` entry
    (OpenAI's ``response_format``), which end with their JSON."""

    prompts: list[list[int]]
    output_lens: list[int]
    response_formats: list[dict | None] | None = None

    @classmethod
    def fixed(cls, batch_size: int, input_len: int, output_len: int, seed: int) -> Workload:
        """``batch_size`` requests of ``input_len`` prompt and ``output_len`` output tokens."""
        rng = random.Random(seed)
        return cls(
            [[rng.randrange(*WORD_IDS) for _ in range(input_len)] for _ in range(batch_size)], [output_len] * batch_size
        )

    @classmethod
    def sharegpt_synth(cls, num_requests: int, max_model_len: int, seed: int) -> Workload:
        """Long-tailed lengths like ShareGPT conversations: log-normal prompt (median 180 tokens) and output (median
        130) lengths, clipped to fit."""
        rng = np.random.default_rng(seed)
        inp = np.clip(rng.lognormal(np.log(180), 1.0, num_requests), 4, max_model_len // 2).astype(int)
        out = np.clip(rng.lognormal(np.log(130), 0.9, num_requests), 2, max_model_len // 2 - 1).astype(int)
        r = random.Random(seed)
        return cls([[r.randrange(*WORD_IDS) for _ in range(n)] for n in inp.tolist()], out.tolist())

    @classmethod
    def rewrite(cls, num_requests: int, tokenizer, max_model_len: int, seed: int) -> Workload:
        """Chat requests to rewrite a 20-80 line standard-library function given in the prompt, so the output mostly
        quotes it (where prompt lookup pays: docs/design.md, "Speculative decoding")."""
        functions = []
        for name in _REWRITE_MODULES:
            source = inspect.getsource(importlib.import_module(name))
            lines = source.splitlines()
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.FunctionDef) and 20 <= node.end_lineno - node.lineno + 1 <= 80:
                    functions.append(textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno])))
        rng = random.Random(seed)
        prompts, output_lens = [], []
        for i in range(num_requests):
            code = rng.choice(functions)
            text = f"{_REWRITE_TASKS[i % len(_REWRITE_TASKS)]}\n\n```python\n{code}\n```"
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            if not isinstance(ids, list):  # a BatchEncoding from newer transformers
                ids = ids["input_ids"]
            out = min(len(tokenizer.encode(code)) + 64, max_model_len - len(ids))
            if out < 1:
                continue
            prompts.append(list(ids))
            output_lens.append(out)
        return cls(prompts, output_lens)

    @classmethod
    def structured(cls, num_requests: int, share: float, output_len: int, tokenizer) -> Workload:
        """Chat requests about a few topics; a ``share`` of them, spread evenly, answer with a JSON object of
        ``STRUCTURED_SCHEMA`` (``response_format`` json_schema), the others in free text; up to ``output_len`` tokens
        each."""
        prompts, formats = [], []
        rf = {"type": "json_schema", "json_schema": {"name": "reply", "schema": STRUCTURED_SCHEMA}}
        for i in range(num_requests):
            text = f"Describe {_STRUCTURED_TOPICS[i % len(_STRUCTURED_TOPICS)]} in JSON with a summary, keywords "
            text += "and a sentiment."
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            prompts.append(list(ids if isinstance(ids, list) else ids["input_ids"]))
            formats.append(rf if int((i + 1) * share) > int(i * share) else None)
        return cls(prompts, [output_len] * num_requests, formats)


@dataclass
class MultiTurn:
    """Chat traffic in a closed loop: users each hold a multi-turn conversation (history plus the server's own replies),
    replies ``output_len`` tokens ignoring EOS."""

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
