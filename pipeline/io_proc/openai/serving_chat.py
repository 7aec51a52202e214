"""``POST /v1/chat/completions`` (tools: docs/design.md, "Tool calling")."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pipeline.io_proc.openai.event_stream import (
    DONE,
    EventStream,
    merged_updates,
    sse,
    stream_aborted,
    stream_error,
    stream_failed,
)
from pipeline.io_proc.openai.logprobs_json import chat_logprobs
from pipeline.io_proc.openai.protocol_chat import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
)
from pipeline.io_proc.openai.serving import CLIENT_CLOSED, OpenAIServing, grammar_field, json_response
from pipeline.io_proc.request_state import RequestState
from pipeline.io_proc.tool_calling import ChatToolStream, ToolPlan, message_calls
from pipeline.io_proc.tool_parsers import ToolCall

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    """The chat completion endpoint's logic (arguments as ``OpenAIServing``)."""

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """Serve ``POST /v1/chat/completions``.

        Raises:
            APIError: 404 unknown model, 400 invalid or too long request, 503 scheduler not taking requests.
        """
        plan, prompt, states = await self.start_chat(req)
        param = grammar_field(req, plan)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_ids = prompt if req.return_token_ids else msgspec.UNSET
        close = self.closer(rid, req, states, plan)
        if req.stream:
            if not await self.compiled(states, raw, close, param):
                return Response(status_code=CLIENT_CLOSED)
            return EventStream(self._chat_stream(req, plan, states, rid, created, prompt_ids), close)
        if not await self.wait(states, raw, close, param):
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for i, st in enumerate(states):
            logprobs = {"content": chat_logprobs(self._texts, st.take_logprobs())} if req.logprobs else None
            content, calls, finish_reason = chat_output(plan, st)
            choices.append(
                ChatCompletionChoice(
                    index=i,
                    message=ChatCompletionMessage(content=content, tool_calls=message_calls(calls) or msgspec.UNSET),
                    logprobs=logprobs,
                    finish_reason=finish_reason,
                    token_ids=self._output_ids(req, st),
                )
            )
        return json_response(
            ChatCompletionResponse(
                id=rid,
                created=created,
                model=self.response_model(req),
                prompt_token_ids=prompt_ids,
                choices=choices,
                usage=await self.usage(states, len(states)),
            )
        )

    async def start_chat(self, req: ChatCompletionRequest) -> tuple[ToolPlan, list[int], list[RequestState]]:
        """Check, render and encode a chat request and add its choices: ``(tool plan, prompt ids, one state per
        choice)``.

        Raises:
            APIError: 404 unknown model, 400 invalid or too long request, 503 scheduler not taking requests.
        """
        self._check_model(req)
        self._check_fan_out(1, req.num_choices())
        self._check_chars(sum(len(m.text()) for m in req.messages), "messages")
        # Tools' schemas are checked, and rendered as the grammar's text, off the event loop.
        plan = await asyncio.to_thread(self.tool_calling.plan, req) if req.tools else self.tool_calling.plan(req)
        # The prompt must fit before it is tokenized, and before any grammar is compiled.
        text = await self._tokenization.render_chat(plan.conversation, tools=plan.template_tools)
        self._check_chars(len(text), "messages", "the prompt the chat template renders")
        prompt = await self._tokenization.encode_rendered(text)
        params = self._sampling_params(req, prompt, "messages")
        grammar = await self._request_grammar(req, plan)
        return plan, prompt, self._start(req, prompt, params, grammar, plan)

    async def _chat_stream(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan,
        states: list[RequestState],
        rid: str,
        created: int,
        prompt_ids: list[int] | msgspec.UnsetType,
    ) -> AsyncIterator[bytes]:
        include_usage = req.include_usage()
        usage = None if include_usage else msgspec.UNSET
        with_ids = prompt_ids is not msgspec.UNSET

        def chunk(
            i: int,
            delta: DeltaMessage,
            finish_reason: str | None = None,
            token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET,
            logprobs: dict | None = None,
            prompt_token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET,
        ) -> bytes:
            return sse(
                ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=self.response_model(req),
                    usage=usage,
                    prompt_token_ids=prompt_token_ids,
                    choices=[
                        ChatCompletionChunkChoice(
                            index=i, delta=delta, finish_reason=finish_reason, token_ids=token_ids, logprobs=logprobs
                        )
                    ],
                )
            )

        # Each choice's text goes through its tool-call parser, if the request has one.
        tools = [ChatToolStream(plan.parser) if plan.parser is not None else None for _ in states]
        try:
            for i in range(len(states)):
                yield chunk(i, DeltaMessage(role="assistant", content=""), prompt_token_ids=prompt_ids)
            async for i, update in merged_updates(states):
                st = states[i]
                if update is not None:
                    text, ids, lps = update
                    delta = DeltaMessage(content=text)
                    if tools[i] is not None:
                        delta.content, delta.tool_calls = tools[i].feed(text)
                        if delta.content is None and delta.tool_calls is None and not (with_ids or req.logprobs):
                            continue  # text held back, nothing else to send
                    logprobs = {"content": chat_logprobs(self._texts, lps)} if req.logprobs else None
                    yield chunk(i, delta, token_ids=ids if with_ids else msgspec.UNSET, logprobs=logprobs)
                elif st.finish_reason == "abort":
                    yield stream_aborted()
                    yield DONE
                    return
                else:
                    finish_reason = st.finish_reason
                    if tools[i] is not None and finish_reason != "error":
                        content, calls = tools[i].finish()
                        if content is not None or calls is not None:
                            yield chunk(i, DeltaMessage(content=content, tool_calls=calls))
                        if tools[i].num_calls and finish_reason == "stop":
                            finish_reason = "tool_calls"
                    yield chunk(i, DeltaMessage(), finish_reason)
                    if finish_reason == "error":
                        yield stream_failed(st)
                        yield DONE
                        return
            if include_usage:
                yield sse(
                    ChatCompletionChunk(
                        id=rid,
                        created=created,
                        model=self.response_model(req),
                        choices=[],
                        usage=await self.usage(states, len(states)),
                    )
                )
        except Exception:
            # Headers are sent: the error can only travel in the stream.
            logger.exception("chat stream %s failed", rid)
            yield stream_error()
        yield DONE


def chat_output(plan: ToolPlan, state: RequestState) -> tuple[str | None, list[ToolCall], str | None]:
    """A finished choice's ``(content, tool calls, finish reason)``: calls end it with ``"tool_calls"`` (unless cut
    short by ``max_tokens``), and its content is null when it is calls only."""
    text = state.take_text()
    if plan.parser is None:
        return text, [], state.finish_reason
    content, calls = plan.parser.extract(text)
    if not calls:
        return content, [], state.finish_reason
    return content or None, calls, "tool_calls" if state.finish_reason == "stop" else state.finish_reason
