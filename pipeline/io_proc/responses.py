"""``/v1/responses``: OpenAI's Responses API, served through the chat path.

A request becomes a chat request (input items to messages, function tools to
chat tools, ``text.format`` to ``response_format``) and is served as chat
completions are; the output becomes output items (a message, function calls).
A stream sends the standard semantic events, each ``event: <type>`` with
its ``sequence_number``. ``store: true`` keeps the response for
``previous_response_id`` in a bounded store (:mod:`pipeline.io_proc.response_store`);
the default is stateless. docs/design.md, "The Responses API".
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from pipeline.io_proc.protocol import APIError, ChatCompletionRequest
from pipeline.io_proc.request_state import RequestState
from pipeline.io_proc.response_store import ResponseStore
from pipeline.io_proc.serving import EventStream, OpenAIServing, chat_output, json_body
from pipeline.io_proc.tool_calling import ChatToolStream, ToolPlan, new_call_id

logger = logging.getLogger(__name__)

# Content parts whose text a message may carry.
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """Body of ``POST /v1/responses``; ``input`` items are checked by :func:`chat_messages`."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    text: dict | None = None
    stream: bool = False
    store: bool = False
    previous_response_id: str | None = None
    metadata: dict | None = None


def input_items(req: ResponsesRequest) -> list[dict]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return req.input


def chat_messages(items: list[dict], instructions: str | None) -> list[dict]:
    """Chat messages for ``items`` (checked), ``instructions`` first as the system message.

    Consecutive function calls, with the assistant text before them, become one assistant message.

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
        APIError: 400 for a tool that is not a function (web search, file search, ...).
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


class ResponsesServing:
    """The ``/v1/responses`` routes' logic, over :class:`OpenAIServing`.

    Args:
        serving: the chat path.
        store: where ``store: true`` responses go.
        model: the served model name.
    """

    def __init__(self, serving: OpenAIServing, store: ResponseStore, model: str):
        self._serving, self._store, self._model = serving, store, model

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        """Serve ``POST /v1/responses``.

        Raises:
            APIError: 400 for input this server cannot take or an unknown
                ``previous_response_id``, and as chat completions do.
        """
        items = input_items(req)
        history: list[dict] = []
        if req.previous_response_id is not None:
            stored = self._store.get(req.previous_response_id)
            if stored is None:
                raise APIError.bad_request(
                    f"Previous response with id {req.previous_response_id!r} not found: responses are kept only "
                    "when created with store: true, and for a bounded time and number (see "
                    "--responses-store-max-entries, --responses-store-max-bytes and --responses-store-max-age)",
                    param="previous_response_id",
                )
            history = json.loads(stored.conversation)
        chat = self._chat_request(req, history + items)
        try:
            plan, _, states = await self._serving.start_chat(chat)
        except APIError as e:
            raise _responses_error(e) from None
        resp = _Response(req, self._model, history + items)
        close = self._serving.closer(resp.id, chat, states)
        if req.stream:
            return EventStream(self._stream(resp, plan, states[0]), close)
        if not await self._serving.wait(states, raw, close):
            return Response(status_code=499)
        content, calls, finish_reason = chat_output(plan, states[0])
        if content or not calls:
            resp.add_message(content or "")
        for c in calls:
            resp.add_call(new_call_id(), c.name, c.arguments)
        body = await self._finish(resp, finish_reason, states)
        return Response(body, media_type="application/json")

    def retrieve(self, response_id: str) -> Response:
        """Serve ``GET /v1/responses/{id}``: a stored response, 404 otherwise."""
        stored = self._store.get(response_id)
        if stored is None:
            raise APIError(404, f"No response with id {response_id!r} is stored", type="not_found_error")
        return Response(stored.response, media_type="application/json")

    def delete(self, response_id: str) -> Response:
        """Serve ``DELETE /v1/responses/{id}``."""
        if not self._store.delete(response_id):
            raise APIError(404, f"No response with id {response_id!r} is stored", type="not_found_error")
        return Response(
            json_body({"id": response_id, "object": "response", "deleted": True}), media_type="application/json"
        )

    def _chat_request(self, req: ResponsesRequest, items: list[dict]) -> ChatCompletionRequest:
        body = {
            "model": req.model,
            "messages": chat_messages(items, req.instructions),
            "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "parallel_tool_calls": req.parallel_tool_calls,
            "max_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "response_format": chat_response_format(req.text),
            "stream": req.stream,
        }
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise APIError.bad_request(f"input: {where}: {first.get('msg', 'invalid')}", param="input") from None

    async def _finish(self, resp: _Response, finish_reason: str | None, states: list[RequestState]) -> bytes:
        """The final response object, stored if asked."""
        usage = await self._serving.usage(states, 1)
        body = json_body(resp.object(finish_reason, usage))
        if resp.req.store:
            self._store.put(resp.id, body, json_body(resp.conversation + resp.output))
        return body

    async def _stream(self, resp: _Response, plan: ToolPlan, state: RequestState) -> AsyncIterator[bytes]:
        ev = _Events()
        tools = ChatToolStream(plan.parser) if plan.parser is not None else None
        try:
            yield ev("response.created", response=resp.object(None, None))
            yield ev("response.in_progress", response=resp.object(None, None))
            async for text, _, _ in state.updates():
                content, calls = tools.feed(text) if tools is not None else (text or None, None)
                for chunk in resp.stream_delta(ev, content, calls):
                    yield chunk
            if state.finish_reason == "abort":
                yield ev(
                    "error", code="503", message="the server is shutting down and stopped this response", param=None
                )
                return
            if tools is not None:
                content, calls = tools.finish()
                for chunk in resp.stream_delta(ev, content, calls):
                    yield chunk
            if not resp.output:  # no text and no call: an empty message, as a whole response has
                for chunk in resp.stream_delta(ev, "", None, empty=True):
                    yield chunk
            for chunk in resp.close_open(ev):
                yield chunk
            finish_reason = "tool_calls" if resp.num_calls and state.finish_reason == "stop" else state.finish_reason
            final = json.loads(await self._finish(resp, finish_reason, [state]))
            done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            yield ev(done, response=final)
        except Exception:
            logger.exception("responses stream %s failed", resp.id)
            yield ev("error", code="500", message="internal server error while streaming", param=None)


class _Events:
    """Server-sent events of a Responses stream, numbered in order."""

    def __init__(self):
        self._seq = 0

    def __call__(self, kind: str, **data: object) -> bytes:
        body = json_body({"type": kind, "sequence_number": self._seq, **data})
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + body + b"\n\n"


class _Response:
    """A response being built: its output items, whole or streamed."""

    def __init__(self, req: ResponsesRequest, model: str, conversation: list[dict]):
        self.req, self.model, self.conversation = req, model, conversation
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.num_calls = 0
        self._open: dict | None = None  # the item a stream is writing

    def add_message(self, text: str) -> dict:
        item = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }
        self.output.append(item)
        return item

    def add_call(self, call_id: str, name: str, arguments: str) -> dict:
        item = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": call_id,
            "name": name,
            "arguments": arguments,
            "status": "completed",
        }
        self.output.append(item)
        self.num_calls += 1
        return item

    def object(self, finish_reason: str | None, usage: object) -> dict:
        """The response object: in progress while ``finish_reason`` is None."""
        req = self.req
        status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": self.output if finish_reason is not None else [],
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
            "tools": req.tools or [],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "usage": None if usage is None else _usage(usage),
        }

    def stream_delta(self, ev: _Events, content: str | None, calls: list | None, empty: bool = False) -> list[bytes]:
        """Events for a delta's text and call pieces, opening and closing items as they start and end
        (``empty``: open a message for no text)."""
        out: list[bytes] = []
        if content or empty:
            if self._open is None or self._open["type"] != "message":
                out += self.close_open(ev)
                item = self.add_message("")
                item["status"] = "in_progress"
                self._open = item
                part = item["content"][0]
                out.append(ev("response.output_item.added", output_index=len(self.output) - 1, item=_in_progress(item)))
                out.append(
                    ev(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=len(self.output) - 1,
                        content_index=0,
                        part={**part, "text": ""},
                    )
                )
            item = self._open
            item["content"][0]["text"] += content
        if content:
            out.append(
                ev(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=content,
                    logprobs=[],
                )
            )
        for d in calls or []:
            if d.id is not None:  # a new call
                out += self.close_open(ev)
                item = self.add_call(d.id, d.function.name, "")
                item["status"] = "in_progress"
                self._open = item
                out.append(ev("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
            fragment = d.function.arguments or ""
            if fragment:
                self._open["arguments"] += fragment
                out.append(
                    ev(
                        "response.function_call_arguments.delta",
                        item_id=self._open["id"],
                        output_index=len(self.output) - 1,
                        delta=fragment,
                    )
                )
        return out

    def close_open(self, ev: _Events) -> list[bytes]:
        """The ``*.done`` events of the item being written, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = "completed"
        index, out = len(self.output) - 1, []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                ev("response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part)
            )
        else:
            out.append(
                ev(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(ev("response.output_item.done", output_index=index, item=item))
        return out


def _in_progress(item: dict) -> dict:
    return {**item, "content": []}


def _usage(u) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.prompt_tokens_details.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def _responses_error(e: APIError) -> APIError:
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
