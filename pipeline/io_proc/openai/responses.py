"""``/v1/responses``: OpenAI's Responses API, served through the chat path (docs/design.md, "The Responses API").

Requests become chat requests and outputs become items; streams send the standard semantic events. ``store: true`` keeps
the response in a bounded store (``response_store``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from pipeline.io_proc.openai.event_stream import EventStream
from pipeline.io_proc.openai.protocol import APIError
from pipeline.io_proc.openai.protocol_chat import ChatCompletionRequest
from pipeline.io_proc.openai.response_store import ResponseStore, StoredResponse
from pipeline.io_proc.openai.responses_input import (
    ResponsesRequest,
    chat_messages,
    chat_response_format,
    chat_tool_choice,
    chat_tools,
    input_items,
    responses_error,
    stored_items,
)
from pipeline.io_proc.openai.responses_output import Events, ResponseBuilder
from pipeline.io_proc.openai.serving import CLIENT_CLOSED, grammar_field, json_body
from pipeline.io_proc.openai.serving_chat import OpenAIServingChat, chat_output
from pipeline.io_proc.request_state import RequestState
from pipeline.io_proc.tool_calling import ChatToolStream, ToolPlan, new_call_id

logger = logging.getLogger(__name__)


class ResponsesServing:
    """The ``/v1/responses`` routes' logic, over ``OpenAIServingChat``."""

    def __init__(self, serving: OpenAIServingChat, store: ResponseStore):
        self._serving, self._store = serving, store

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        """Serve ``POST /v1/responses``.

        Raises:
            APIError: 400 for input this server cannot take or an unknown ``previous_response_id``, and as chat does.
        """
        previous = None
        if req.previous_response_id is not None:
            previous = self._store.get(req.previous_response_id)
            if previous is None:
                raise APIError.bad_request(
                    f"Previous response with id {req.previous_response_id!r} not found: responses are kept only "
                    "when created with store: true, and for a bounded time and number (see "
                    "--responses-store-max-entries, --responses-store-max-bytes and --responses-store-max-age)",
                    param="previous_response_id",
                )
        # A long stored history takes milliseconds per megabyte to decode and check: off the event loop.
        chat = await asyncio.to_thread(self._chat_request, req, previous)
        try:
            plan, _, states = await self._serving.start_chat(chat)
        except APIError as e:
            raise responses_error(e) from None
        resp = ResponseBuilder(req, self._serving.response_model(chat), previous)
        close = self._serving.closer(resp.id, chat, states, plan)
        param = grammar_field(chat, plan)
        try:
            if req.stream:
                if not await self._serving.compiled(states, raw, close, param):
                    return Response(status_code=CLIENT_CLOSED)
                return EventStream(self._stream(resp, plan, states[0]), close)
            if not await self._serving.wait(states, raw, close, param):
                return Response(status_code=CLIENT_CLOSED)
        except APIError as e:  # the grammar refused (400) or the request failed (500)
            raise responses_error(e) from None
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

    def _chat_request(self, req: ResponsesRequest, previous: StoredResponse | None) -> ChatCompletionRequest:
        """The chat request of ``req``, continuing ``previous``'s conversation."""
        items = (previous.conversation() if previous is not None else []) + input_items(req)
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

    async def _finish(self, resp: ResponseBuilder, finish_reason: str | None, states: list[RequestState]) -> bytes:
        """The final response object, stored if asked; ``store`` says false if the store could not keep it."""
        obj = resp.object(finish_reason, await self._serving.usage(states, 1))
        body = json_body(obj)
        if resp.req.store:
            items = json_body(stored_items(input_items(resp.req)) + resp.output)
            if not self._store.put(resp.id, body, items, resp.previous):
                body = json_body({**obj, "store": False})
        return body

    async def _stream(self, resp: ResponseBuilder, plan: ToolPlan, state: RequestState) -> AsyncIterator[bytes]:
        ev = Events()
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
            if state.finish_reason == "error":
                yield ev("error", code="500", message=f"the response failed: {state.error}", param=None)
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
