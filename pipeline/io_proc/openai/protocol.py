"""Shapes of the OpenAI API as served by io_proc: errors, shared sampling fields, usage, the model list (each endpoint's
own in ``protocol_chat``, ``protocol_completion``, ``protocol_tokenization``).

Requests are pydantic (failures become a 400 ``ErrorResponse``), responses msgspec structs (faster per chunk). Shapes
follow the OpenAI API reference with vLLM's extensions, omitted from responses unless asked for.
"""

from __future__ import annotations

import secrets
from typing import Annotated

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from pipeline.io_proc.json_limits import Shallow, loads

# The OpenAI API accepts at most four stop sequences.
MAX_STOP_STRINGS = 4
# Choices per prompt (n); each is a sequence with a req_index of its own.
MAX_CHOICES = 128
_SEED_MASK = (1 << 63) - 1
_MIN_TEMPERATURE = 1e-5
# A nucleus this small keeps only the most likely token (ties included); any
# smaller value is the same, and 0 is not a valid float32 top_p.
_MIN_TOP_P = 1e-6
# top_k beyond any vocabulary means "disabled"; larger values do not fit int32.
_INT32_MAX = 2**31 - 1


# -- errors -------------------------------------------------------------------


class APIError(Exception):
    """An error returned to the client as ``{"error": {...}}`` with ``status_code``; ``type`` is OpenAI's error type."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = status_code, message, type, param, code

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        """HTTP 400, ``invalid_request_error``."""
        return cls(400, message, "invalid_request_error", param, code)


class ErrorInfo(msgspec.Struct, kw_only=True):
    """The body of an error; see ``APIError`` for the fields."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """``{"error": {"message", "type", "param", "code"}}``, the OpenAI error body."""

    error: ErrorInfo


# -- requests -----------------------------------------------------------------


class OpenAIBaseModel(BaseModel):
    # Strict: a string is not a number and a number is not a string, as in the
    # OpenAI API. Unknown fields are ignored, since clients send optional
    # fields (user, metadata, ...) that change nothing here.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(OpenAIBaseModel):
    """``include_usage``: end the stream with a chunk carrying the usage."""

    include_usage: bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by chat and text completions (OpenAI's, plus vLLM's ``top_k``, ``min_p``, ``min_tokens``,
    ``stop_token_ids``, ``return_token_ids``, ``guided_*``).

    ``max_completion_tokens`` wins over ``max_tokens``; choice ``i`` of ``n`` is seeded ``seed + i``; ``best_of`` is
    refused. Ranges: penalties -2..2, ``repetition_penalty`` 0.01..100, ``logit_bias`` -100..100 keyed by decimal token
    ids (docs/design.md, "Penalties and biases"). ``response_format`` or ``guided_*``: docs/design.md, "Structured
    output".
    """

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    best_of: int | None = None
    return_token_ids: bool = False
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    logit_bias: dict[str, float] | None = None
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    response_format: Annotated[dict | None, Shallow] = None
    guided_json: Annotated[dict | str | None, Shallow] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    def structured_output(self) -> tuple[str, object, str] | None:
        """``(kind, spec, param)`` for ``build_grammar``, or None for free text.

        Raises:
            APIError: 400 naming the field: an unknown ``response_format`` type, a ``json_schema`` without ``schema``,
                or more than one constraint.
        """
        found = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("json_object", None, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                    raise APIError.bad_request(
                        "response_format.json_schema.schema must be a JSON schema object", param="response_format"
                    )
                found.append(("json_schema", js["schema"], "response_format"))
            elif kind != "text":
                raise APIError.bad_request(
                    f"response_format.type must be one of 'text', 'json_object' and 'json_schema', got {kind!r}",
                    param="response_format",
                )
        for kind, spec, param in (
            ("json_schema", self.guided_json, "guided_json"),
            ("regex", self.guided_regex, "guided_regex"),
            ("choice", self.guided_choice, "guided_choice"),
        ):
            if spec is not None:
                found.append((kind, spec, param))
        if len(found) > 1:
            raise APIError.bad_request(f"give at most one of {', '.join(p for _, _, p in found)}", param=found[1][2])
        return found[0] if found else None

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {len(v)}")
        for key, bias in v.items():
            if not (key.isascii() and key.isdigit() and str(int(key)) == key):
                raise ValueError(f"logit_bias keys must be token ids written as decimal integers, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return v

    @field_validator("guided_json")
    @classmethod
    def _check_guided_json(cls, v: dict | str | None) -> dict | str | None:
        if isinstance(v, str):
            loads(v)  # a schema as JSON text nests no deeper than one given as an object
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and min(v) < 0:
            raise ValueError("stop_token_ids must be token ids >= 0")
        return v

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as ``(token id, bias)`` pairs (possibly none)."""
        return tuple((int(k), float(b)) for k, b in (self.logit_bias or {}).items())

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or at least 1, got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
        if not all(stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("best_of")
    @classmethod
    def _check_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise ValueError("best_of is not supported; ask for n choices and rank them on the client")
        return v

    def num_choices(self) -> int:
        """``n``: choices per prompt."""
        return 1 if self.n is None else self.n

    @model_validator(mode="after")
    def _check_stream_options(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> list[str]:
        """``stop`` as a list (possibly empty)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether the stream ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        """The client's output-token limit (``max_completion_tokens`` first), or None for "up to ``max_model_len``"."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampled_logprobs(self) -> int:
        """Alternatives wanted with each output token's log-probability; -1 for no log-probabilities."""
        return -1

    def sampling_params(self, max_tokens: int, stop_token_ids: tuple[int, ...], lora_id: int) -> SamplingParams:
        """The engine's ``SamplingParams`` of this request, once ``max_tokens`` and the stop ids are resolved."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        return SamplingParams(
            max_tokens=max_tokens,
            # Below _MIN_TEMPERATURE, logits / temperature overflow: that is greedy (as vLLM treats it).
            temperature=0.0 if temperature < _MIN_TEMPERATURE else temperature,
            # The descriptor stores top_p as float32 and top_k as int32: keep both representable.
            top_p=1.0 if self.top_p is None else max(self.top_p, _MIN_TOP_P),
            top_k=0 if top_k > _INT32_MAX else top_k,
            seed=secrets.randbits(63) if self.seed is None else self.seed & _SEED_MASK,
            stop_token_ids=stop_token_ids,
            logprobs=self.sampled_logprobs(),
            prompt_logprobs=self.prompt_logprobs(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_p=self.min_p or 0.0,
            min_tokens=self.min_tokens,
            logit_bias=self.logit_bias_pairs(),
            lora_id=lora_id,
        )

    def prompt_logprobs(self) -> int:
        """Alternatives wanted with each prompt token's log-probability; -1 for none."""
        return -1


# -- responses ----------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    """What OpenAI reports of the prompt: ``cached_tokens``, its tokens found in the prefix cache."""

    cached_tokens: int


class UsageInfo(msgspec.Struct, kw_only=True):
    """Token counts; ``completion_tokens`` includes the finishing token (EOS too)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ModelCard(msgspec.Struct, kw_only=True):
    """One served model; ``root`` is the model (or LoRA adapter) directory, ``parent`` an adapter's base model
    (null for the base model, as vLLM)."""

    id: str
    object: str = "model"
    created: int
    owned_by: str = "pipeline"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    """The body of ``GET /v1/models``."""

    object: str = "list"
    data: list[ModelCard]
