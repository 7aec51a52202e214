"""A ``/v1/responses`` request as a chat request: input items to messages, function tools to chat tools, ``text.format``
to ``response_format``; chat errors named as the Responses API names the field."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pipeline.io_proc.json_limits import Shallow
from pipeline.io_proc.openai.protocol import APIError

# Content parts whose text a message may carry.
_TEXT_PARTS = ("input_text", "output_text", "text")
# The fields of an input item that become chat messages.
_ITEM_FIELDS = ("type", "role", "content", "call_id", "name", "arguments", "output")


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``; ``input`` items are checked by ``chat_messages``."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: Annotated[str | list[dict], Shallow]
    instructions: str | None = None
    tools: Annotated[list[dict] | None, Shallow] = None
    tool_choice: Annotated[str | dict | None, Shallow] = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: Annotated[dict | None, Shallow] = None
    stream: bool = False
    store: bool = False
    previous_response_id: str | None = None
    metadata: Annotated[dict | None, Shallow] = None


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def stored_items(items: list[dict]) -> list[dict]:
    """``items`` as a follow-up reads them: only the fields ``chat_messages`` uses, and no ``reasoning`` items (they
    carry nothing this server's models read), so that what the store keeps is what the prompt holds."""
    out = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            continue
        kept = {k: item[k] for k in _ITEM_FIELDS if k in item}
        for key in ("content", "output"):  # text parts as the text they join to (checked already)
            if key in kept:
                kept[key] = _text(kept[key], key)
        out.append(kept)
    return out


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Chat messages for ``items`` (checked), ``instructions`` first as the system message.

    Raises:
        APIError: 400 naming ``input[i]`` for an item this server cannot take.
    """
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for i, item in enumerate(items):
        kind, param = item.get("type", "message"), f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError.bad_request(
                    f"{param}.role must be user, system, developer or assistant", param=f"{param}.role"
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise APIError.bad_request(f"{param}.{key} must be a string", param=f"{param}.{key}")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError.bad_request(f"{param}.call_id must be a string", param=f"{param}.call_id")
            output = _text(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind != "reasoning":  # a reasoning item carries nothing this server's models read
            raise APIError.bad_request(
                f"{param}.type {kind!r} is not supported: give message, function_call or function_call_output items",
                param=f"{param}.type",
            )
    return messages


def _text(content: object, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError.bad_request(f"{param} must be a string or a list of text parts", param=param)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError.bad_request(
                f"{param}[{j}] must be a text part ({', '.join(_TEXT_PARTS)}); only text is supported",
                param=f"{param}[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools as chat tools.

    Raises:
        APIError: 400 for a tool that is not a function.
    """
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError.bad_request(
                f"tools[{i}].type {t.get('type')!r} is not supported: only function tools are", param=f"tools[{i}].type"
            )
        if not isinstance(t.get("name"), str):
            raise APIError.bad_request(f"tools[{i}].name must be a string", param=f"tools[{i}].name")
        function = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: object) -> object:
    """A Responses ``tool_choice`` in the chat shape (unknown shapes pass on, to get the chat path's 400)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def chat_response_format(text: dict | None) -> dict | None:
    """``text.format`` as a chat ``response_format``."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def responses_error(e: APIError) -> APIError:
    """A chat-path error with its parameter named as the Responses API names it."""
    param = e.param
    if param is not None:
        if param.startswith("tools[") and ".function." in param:
            param = param.replace(".function.", ".", 1)
        elif param.startswith("messages"):
            param = "input"
        elif param == "max_tokens":
            param = "max_output_tokens"
        elif param == "response_format":
            param = "text.format"
    return APIError(e.status_code, e.message, e.type, param, e.code)
