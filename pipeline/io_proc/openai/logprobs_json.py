"""Log-probabilities as the OpenAI API shapes them: the legacy completions object (what lm-evaluation-harness reads with
``echo``) and the chat object; values are the raw model's log-softmax."""

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
    """One token's log-probability (None for a prompt's first token) and its ``k`` most likely alternatives."""

    token_id: int
    logprob: float | None
    top_ids: list[int]
    top_logprobs: list[float]

    @classmethod
    def of(cls, token_id: int, logprob: float, top_ids: np.ndarray, top_logprobs: np.ndarray, k: int) -> TokenLogprob:
        return cls(int(token_id), float(logprob), top_ids[:k].tolist(), top_logprobs[:k].tolist())


class TokenTexts:
    """Each token id's raw bytes and display text, computed once per id (byte-level or SentencePiece); a partial
    character shows as U+FFFD, its ``bytes`` exact."""

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
    """The legacy completions ``logprobs`` object for consecutive tokens; ``top_logprobs`` includes the chosen token (as
    vLLM), and entries with ``logprob`` None have None values (as OpenAI)."""
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
