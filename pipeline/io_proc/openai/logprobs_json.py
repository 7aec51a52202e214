"""Log-probabilities as the OpenAI API shapes them.

Two shapes exist (OpenAI API reference): the legacy completions object ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`` (what lm-evaluation-harness reads with ``echo``), and the chat object ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}]}``. Values are the raw model's log-softmax, computed on the device
(``pipeline.gpu_worker.sampling.logprobs``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipeline.io_proc.byte_level import UNICODE_TO_BYTE

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback


@dataclass
class TokenLogprob:
    """One token's log-probability and its ``k`` most likely alternatives (ids, log-probabilities).

    ``logprob`` is None for a prompt's first token, which nothing predicts.
    """

    token_id: int
    logprob: float | None
    top_ids: list[int]
    top_logprobs: list[float]

    @classmethod
    def of(cls, token_id: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray, k: int) -> TokenLogprob:
        return cls(int(token_id), float(logprob), top_ids[:k].tolist(), top_logprobs[:k].tolist())


class TokenTexts:
    """Each token id's raw bytes and display text, computed once per id.

    A byte-level BPE token (GPT-2, Llama 3, SmolLM) maps back to its bytes through GPT-2's table; a SentencePiece token
    maps ``▁`` to a space and ``<0xNN>`` to that byte. A token that is part of a multi-byte character shows as U+FFFD in
    its text; its ``bytes`` are exact.
    """

    def __init__(self, tokenizer: Any):
        self._tokens = tokenizer.convert_ids_to_tokens
        try:
            decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
        except AttributeError:  # a slow tokenizer
            decoder = {}
        self._byte_level = "ByteLevel" in json.dumps(decoder)
        self._unbyte = UNICODE_TO_BYTE
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, bytes)`` of ``token_id``."""
        hit = self._cache.get(token_id)
        if hit is None:
            tok = self._tokens(int(token_id)) or ""
            if self._byte_level and all(c in self._unbyte for c in tok):
                raw = bytes(self._unbyte[c] for c in tok)
            elif m := _BYTE_TOKEN.match(tok):
                raw = bytes([int(m.group(1), 16)])
            else:
                raw = tok.replace("▁", " ").encode("utf-8")
            hit = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return hit


def completion_logprobs(texts: TokenTexts, entries: list[TokenLogprob], text_offset: int = 0) -> dict:
    """The legacy completions ``logprobs`` object for consecutive tokens.

    An entry whose ``logprob`` is None (the first prompt token under ``echo``) has ``token_logprobs`` and
    ``top_logprobs`` None, as OpenAI gives them; its token is still listed. ``top_logprobs`` maps each alternative's
    text to its log-probability and includes the chosen token, as vLLM does. ``text_offset`` is where each token's text
    starts, counting from ``text_offset``.
    """
    tokens, lps, tops, offsets = [], [], [], []
    pos = text_offset
    for e in entries:
        text, _ = texts.get(e.token_id)
        tokens.append(text)
        offsets.append(pos)
        pos += len(text)
        if e.logprob is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(e.logprob)
        top = {texts.get(i)[0]: lp for i, lp in zip(e.top_ids, e.top_logprobs)}
        top.setdefault(text, e.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, entries: list[TokenLogprob]) -> list[dict]:
    """The chat ``logprobs.content`` list for consecutive output tokens."""
    out = []
    for e in entries:
        text, raw = texts.get(e.token_id)
        top = []
        for i, lp in zip(e.top_ids, e.top_logprobs):
            t, b = texts.get(i)
            top.append({"token": t, "logprob": lp, "bytes": b})
        out.append({"token": text, "logprob": e.logprob, "bytes": raw, "top_logprobs": top})
    return out
