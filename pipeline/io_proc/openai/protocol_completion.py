"""Shapes of ``POST /v1/completions``: the request and the ``text_completion`` object, whole or as a stream chunk
(OpenAI API reference; ``pipeline.io_proc.openai.protocol`` for the conventions)."""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import Field, field_validator, model_validator

from pipeline.common.step_output import MAX_LOGPROBS
from pipeline.io_proc.openai.protocol import SamplingRequest, UsageInfo

# Prompts in one completions request (a list of strings or of token-id lists),
# as the OpenAI API bounds a batched input; each becomes its own request.
MAX_PROMPTS = 2048


class CompletionRequest(SamplingRequest):
    """Body of ``POST /v1/completions``; ``prompt`` is validated into a list of prompts, each ``str`` or ``list[int]``
    (token ids checked against the tokenizer when served).

    ``echo`` prepends the prompt (and its log-probabilities, the first null); ``max_tokens`` 0 is allowed with ``echo``
    (what evaluation harnesses score).
    """

    prompt: Any
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    # Accepted only at its "off" value: refusing is more honest than ignoring it.
    tools: list | None = None

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.tools:
            raise ValueError("tools is not supported by /v1/completions; use /v1/chat/completions")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, v: Any) -> list[str | list[int]]:
        if isinstance(v, str) or (isinstance(v, list) and v and all(type(t) is int for t in v)):
            v = [v]
        if not isinstance(v, list) or not v or len(v) > MAX_PROMPTS:
            raise ValueError(
                f"prompt must be a non-empty string, a list of 1 to {MAX_PROMPTS} strings, "
                "a non-empty list of token ids, or a list of such lists"
            )
        if len({type(p) for p in v}) > 1:
            raise ValueError("a list of prompts must hold only strings or only token-id lists, not both")
        for p in v:
            if isinstance(p, str):
                if not p:
                    raise ValueError("prompts must not be empty")
            elif isinstance(p, list) and p and all(type(t) is int for t in p):
                if min(p) < 0:
                    raise ValueError("prompt token ids must be >= 0")
            else:
                raise ValueError(
                    "each prompt of a list must be a non-empty string or a non-empty list of token ids >= 0"
                )
        return v

    def sampled_logprobs(self) -> int:
        return -1 if self.logprobs is None else self.logprobs

    def prompt_logprobs(self) -> int:
        return self.logprobs if self.echo and self.logprobs is not None else -1


class CompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a ``text_completion`` (whole or chunk), one per prompt; ``logprobs`` is the legacy object (see
    ``completion_logprobs``) when asked."""

    index: int = 0
    text: str
    logprobs: dict | None = None
    finish_reason: str | None = None
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class CompletionResponse(msgspec.Struct, kw_only=True):
    """A ``text_completion`` object: the whole response, or one streamed chunk (then ``usage`` follows the same rule as
    ``ChatCompletionChunk``)."""

    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None | msgspec.UnsetType = msgspec.UNSET
