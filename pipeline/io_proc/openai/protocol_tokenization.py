"""Shapes of ``POST /tokenize`` and ``POST /detokenize`` (vLLM's)."""

from __future__ import annotations

import msgspec
from pydantic import Field, ValidationInfo, field_validator

from pipeline.io_proc.openai.protocol import OpenAIBaseModel
from pipeline.io_proc.openai.protocol_chat import ChatMessage


class TokenizeRequest(OpenAIBaseModel):
    """Body of ``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered with the chat template
    (``add_generation_prompt``, default true), exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True
    # validate_default: the one-of check runs when messages is absent too.
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, validate_default=True)
    add_generation_prompt: bool = True

    @field_validator("messages")
    @classmethod
    def _one_input(cls, v: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if (v is None) == (info.data.get("prompt") is None):
            raise ValueError("give exactly one of prompt and messages")
        return v


class DetokenizeRequest(OpenAIBaseModel):
    """Body of ``POST /detokenize`` (vLLM's shape): token ids to turn back into text."""

    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _check_tokens(cls, v: list[int]) -> list[int]:
        if v and min(v) < 0:
            raise ValueError("token ids must be >= 0")
        return v


class TokenizeResponse(msgspec.Struct, kw_only=True):
    """``{"count", "max_model_len", "tokens"}``, as vLLM answers ``/tokenize``."""

    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    """``{"prompt": text}``, as vLLM answers ``/detokenize``."""

    prompt: str
