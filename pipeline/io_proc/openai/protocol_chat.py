"""Shapes of ``POST /v1/chat/completions``: messages, tools, the request, and the response whole or as stream chunks
(OpenAI API reference; ``pipeline.io_proc.openai.protocol`` for the conventions)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from pydantic import Field, ValidationInfo, field_validator, model_validator

from pipeline.common.step_output import MAX_LOGPROBS
from pipeline.io_proc.json_limits import Shallow
from pipeline.io_proc.openai.protocol import OpenAIBaseModel, SamplingRequest, UsageInfo


class TextPart(OpenAIBaseModel):
    """One part of a message's content; only text parts are supported."""

    type: Literal["text"]
    text: str


class FunctionCall(OpenAIBaseModel):
    """A past call's function: ``arguments`` is JSON text, as the model wrote it."""

    name: str
    arguments: str


class ToolCallItem(OpenAIBaseModel):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    """One input message, content a string or text parts; assistant messages may carry ``tool_calls`` (content then
    nullable), ``tool`` messages answer ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only in an assistant message with tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def template_role(self) -> str:
        """The role the chat template sees: OpenAI's ``developer`` is the ``system`` role."""
        return "system" if self.role == "developer" else self.role

    def text(self) -> str:
        """The content as one string; text parts are joined with newlines, like vLLM."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionDefinition(OpenAIBaseModel):
    """A function the model may call: ``parameters`` is the JSON schema of its arguments (an object)."""

    name: str
    description: str | None = None
    parameters: Annotated[dict | None, Shallow] = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    """One entry of ``tools``: only functions."""

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    """Body of ``POST /v1/chat/completions``; ``top_logprobs`` (0..20) needs ``logprobs: true`` (as OpenAI and vLLM)."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    # Tool calling (docs/design.md, "Tool calling"): tool_choice is checked where it is served.
    tools: list[ChatTool] | None = None
    tool_choice: Annotated[str | dict | None, Shallow] = None
    parallel_tool_calls: bool | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs requires logprobs: true")
        return v

    def sampled_logprobs(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else -1


# -- responses ----------------------------------------------------------------


class FunctionCallOut(msgspec.Struct, kw_only=True):
    """A call's function: ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, kw_only=True):
    """One call in ``message.tool_calls``."""

    id: str
    type: str = "function"
    function: FunctionCallOut


class ChatCompletionMessage(msgspec.Struct, kw_only=True):
    """The generated message of a non-streamed chat completion; ``content`` is null when it is calls only."""

    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChoice(msgspec.Struct, kw_only=True):
    """One choice of a ``chat.completion`` (``index`` 0..n-1); ``logprobs`` is ``{"content": [...]}`` (see
    ``chat_logprobs``) when asked."""

    index: int = 0
    message: ChatCompletionMessage
    logprobs: dict | None = None
    finish_reason: str | None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    """A ``chat.completion`` object; ``created`` is Unix time in seconds."""

    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class DeltaFunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed call's function: ``name`` in its first delta, then fragments of ``arguments``."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of call ``index``: the first has ``id``, ``type`` and the name."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A streamed message delta; absent fields are omitted (the final delta is ``{}``)."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionChunkChoice(msgspec.Struct, kw_only=True):
    """The choice a chunk is about; ``finish_reason`` is null until its last; ``logprobs`` covers the chunk's tokens
    when asked."""

    index: int = 0
    delta: DeltaMessage
    logprobs: dict | None = None
    finish_reason: str | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    """One ``chat.completion.chunk``. ``usage`` is omitted unless the client asked for it
    (``stream_options.include_usage``); then it is null on every chunk but the last, which has no choices."""

    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionChunkChoice]
    usage: UsageInfo | None | msgspec.UnsetType = msgspec.UNSET
    prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
