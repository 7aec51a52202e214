"""Serving one chat or text completion: request -> prompt and sampling
parameters -> engine -> JSON response or Server-Sent Events stream.

Both endpoints share every step (checks, parameters, waiting, streaming), so
they live together, in a module longer than most.

Stream format (OpenAI API): each chunk is ``data: <json>\\n\\n``; the stream
ends with ``data: [DONE]\\n\\n``. Chat streams start with a delta
``{"role": "assistant", "content": ""}``, send content deltas, then a chunk
with an empty delta and the finish reason, then (``include_usage``) a chunk
with no choices and the usage. Text completion streams send text chunks with
``finish_reason`` null, then a chunk with empty text and the finish reason,
then the usage chunk if asked for. Streamed text concatenates exactly to the
non-streamed text: both read the same per-request deltas.

With ``return_token_ids`` (vLLM), the prompt token ids go in the first chunk
and each chunk carries the output token ids it covers, so a stream sends a
chunk per token even when a token adds no text (part of a character, or text
held back for stop strings). Log-probabilities stream the same way: each
chunk carries the entries of the tokens it covers.

A completions request with a list of prompts runs one engine request per
prompt, concurrently; choice ``i`` answers prompt ``i`` (OpenAI API), and a
stream interleaves the choices' chunks as their tokens arrive. With ``n`` >
1, each prompt has ``n`` choices, prompt-major (choice ``p * n + i`` is
prompt ``p``'s ``i``-th), from one engine request that prefills the prompt
once (docs/design.md, "Parallel choices"); usage counts each prompt once. With
``echo``, a choice's text starts with its prompt (the prompt string, or the
decoded token ids), and its first streamed chunk is that prompt.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeline.common.config import EngineConfig
from pipeline.common.grammar import GrammarError, build_grammar
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import MAX_STOP_TOKEN_IDS
from pipeline.io_proc.engine_client import EngineClient, EngineUnavailable
from pipeline.io_proc.logprobs_json import TokenLogprob, chat_logprobs, completion_logprobs
from pipeline.io_proc.protocol import (
    APIError,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionMessage,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    SamplingRequest,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from pipeline.io_proc.request_log import log_request
from pipeline.io_proc.request_state import RequestState
from pipeline.io_proc.tokenization import Tokenization
from pipeline.io_proc.tool_calling import ChatToolStream, ToolCalling, ToolPlan, message_calls
from pipeline.io_proc.tool_parsers import ToolCall

logger = logging.getLogger(__name__)

_SEED_MASK = (1 << 63) - 1
_MIN_TEMPERATURE = 1e-5
# A nucleus this small keeps only the most likely token (ties included); any
# smaller value is the same, and 0 is not a valid float32 top_p.
_MIN_TOP_P = 1e-6
# top_k beyond any vocabulary means "disabled"; larger values do not fit int32.
_INT32_MAX = 2**31 - 1
_DONE = b"data: [DONE]\n\n"
_ABORTED = "the server is shutting down and stopped this request before it finished; retry it"
# HTTP status nginx uses for "client closed request"; nobody reads it.
_CLIENT_CLOSED = 499


def _sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def json_body(obj: object) -> bytes:
    """``obj`` (structs, dicts, lists, scalars) as JSON, encoded with msgspec."""
    return msgspec.json.encode(obj)


def json_response(obj: msgspec.Struct, status_code: int = 200) -> Response:
    """A JSON response encoded with msgspec."""
    return Response(msgspec.json.encode(obj), status_code=status_code, media_type="application/json")


class EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends: fully sent,
    client gone (Starlette cancels the send task), or server shutdown."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


class OpenAIServing:
    """The chat and text completion endpoints' logic.

    Args:
        config: gives ``served_model_name``, ``max_model_len`` and the model's ``vocab_size``.
        client: the engine client.
        tokenization: prompt encoding.
        stop_token_ids: token ids that end generation (see
            ``load_tokenizer``).
    """

    def __init__(
        self, config: EngineConfig, client: EngineClient, tokenization: Tokenization, stop_token_ids: tuple[int, ...]
    ):
        self.tool_calling = ToolCalling(
            config.tool_call_parser or None,
            config.enable_auto_tool_choice,
            tokenization.renders_tools,
            tokenization.renders_tool_calls,
        )
        self._model = config.served_model_name
        self._max_model_len = config.max_model_len
        self._max_prompt_chars = tokenization.max_prompt_chars(config.max_model_len)
        self._client = client
        self._tokenization = tokenization
        self._stop_token_ids = stop_token_ids
        # Prompt ids must have an embedding row (an out-of-range id is an
        # asynchronous device assert on CUDA) and decode with the tokenizer.
        self._vocab_limit = min(tokenization.vocab_size, config.vocab_size or tokenization.vocab_size)
        self._structured_output = config.vocab_size > 0
        self._log_requests, self._log_prompts = config.enable_log_requests, config.log_prompts
        self._max_seqs = config.max_seqs_per_request

    @property
    def _texts(self):
        """Token texts and bytes for log-probabilities."""
        return self._tokenization.token_texts

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """Serve ``POST /v1/chat/completions``.

        Raises:
            APIError: 404 unknown model, 400 invalid or too long request,
                503 scheduler not taking requests.
        """
        plan, prompt, states = await self.start_chat(req)
        param = grammar_field(req, plan)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_ids = prompt if req.return_token_ids else msgspec.UNSET
        close = self.closer(rid, req, states)
        if req.stream:
            if not await self.compiled(states, raw, close, param):
                return Response(status_code=_CLIENT_CLOSED)
            return EventStream(self._chat_stream(req, plan, states, rid, created, prompt_ids), close)
        if not await self.wait(states, raw, close, param):
            return Response(status_code=_CLIENT_CLOSED)
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
                model=self._model,
                prompt_token_ids=prompt_ids,
                choices=choices,
                usage=await self.usage(states, len(states)),
            )
        )

    async def start_chat(self, req: ChatCompletionRequest) -> tuple[ToolPlan, list[int], list[RequestState]]:
        """Check a chat request, render and encode its prompt and add its choices to the engine:
        ``(tool plan, prompt token ids, one state per choice)``.

        Raises:
            APIError: 404 unknown model, 400 invalid or too long request,
                503 scheduler not taking requests.
        """
        self._check_model(req)
        self._check_fan_out(1, req.num_choices())
        self._check_chars(sum(len(m.text()) for m in req.messages), "messages")
        # Tools' schemas are checked as grammars, which the event loop must not spend its time on.
        plan = await asyncio.to_thread(self.tool_calling.plan, req) if req.tools else self.tool_calling.plan(req)
        grammar = await self._request_grammar(req, plan)
        prompt = await self._tokenization.encode_chat(plan.conversation, tools=plan.template_tools)
        return plan, prompt, self._start(req, prompt, "messages", grammar, plan)

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        """Serve ``POST /v1/completions``: one choice per prompt.

        Raises:
            APIError: as ``chat``, 400 for token ids outside the vocabulary,
                and 400 for ``max_tokens`` 0 without ``echo``.
        """
        self._check_model(req)
        self._check_fan_out(len(req.prompt), req.num_choices())
        if req.requested_max_tokens() == 0 and not req.echo:
            raise APIError.bad_request("max_tokens must be at least 1 unless echo is true", param="max_tokens")
        grammar, param = await self._request_grammar(req), grammar_field(req)  # once for every prompt and choice
        prompts: list[list[int]] = []
        for p in req.prompt:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
                prompts.append(await self._tokenization.encode_text(p))
            else:
                prompts.append(p)
        echoes = (
            [p if isinstance(p, str) else await self._tokenization.decode(p) for p in req.prompt]
            if req.echo
            else [""] * len(prompts)
        )
        # Choices are prompt-major, as in the OpenAI API: choice p * n + i is prompt p's i-th.
        n = req.num_choices()
        states: list[RequestState] = []
        try:
            for ids in prompts:
                states.extend(self._start(req, ids, "prompt", grammar))
        except APIError:
            for st in states:
                self._client.release(st)
            raise
        echoes = [e for e in echoes for _ in range(n)]
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_ids = [p for p in prompts for _ in range(n)] if req.return_token_ids else [msgspec.UNSET] * len(states)
        close = self.closer(rid, req, states)
        if req.stream:
            if not await self.compiled(states, raw, close, param):
                return Response(status_code=_CLIENT_CLOSED)
            return EventStream(self._completion_stream(req, states, echoes, rid, created, prompt_ids), close)
        if not await self.wait(states, raw, close, param):
            return Response(status_code=_CLIENT_CLOSED)
        choices = []
        for i, st in enumerate(states):
            logprobs = None
            if req.logprobs is not None:
                entries = (st.prompt_logprobs if req.echo else []) + st.take_logprobs()
                logprobs = completion_logprobs(self._texts, entries)
            choices.append(
                CompletionChoice(
                    index=i,
                    text=echoes[i] + st.take_text(),
                    logprobs=logprobs,
                    finish_reason=st.finish_reason,
                    prompt_token_ids=prompt_ids[i],
                    token_ids=self._output_ids(req, st),
                )
            )
        return json_response(
            CompletionResponse(
                id=rid, created=created, model=self._model, choices=choices, usage=await self.usage(states, n)
            )
        )

    async def tokenize(self, req: TokenizeRequest) -> Response:
        """Serve ``POST /tokenize`` (vLLM's shape): the ids a prompt or a conversation encodes to.

        Raises:
            APIError: 404 unknown model, 400 too long a text or a template error.
        """
        self._check_model(req)
        if req.prompt is not None:
            self._check_chars(len(req.prompt), "prompt")
            ids = await self._tokenization.encode_text(req.prompt, req.add_special_tokens)
        else:
            self._check_chars(sum(len(m.text()) for m in req.messages), "messages")
            conversation = self.tool_calling.conversation(req.messages)
            ids = await self._tokenization.encode_chat(conversation, req.add_generation_prompt)
        return json_response(TokenizeResponse(count=len(ids), max_model_len=self._max_model_len, tokens=ids))

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        """Serve ``POST /detokenize`` (vLLM's shape): the text of token ids.

        Raises:
            APIError: 404 unknown model, 400 an id outside the vocabulary.
        """
        self._check_model(req)
        if req.tokens and max(req.tokens) >= self._vocab_limit:
            raise APIError.bad_request(
                f"token id {max(req.tokens)} is out of range: the vocabulary has {self._vocab_limit} tokens",
                param="tokens",
            )
        return json_response(DetokenizeResponse(prompt=await self._tokenization.decode(req.tokens)))

    # -- shared steps ------------------------------------------------------------

    def _check_model(self, req: SamplingRequest | TokenizeRequest | DetokenizeRequest) -> None:
        if req.model is not None and req.model != self._model:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist. This server serves `{self._model}`.",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def _check_fan_out(self, num_prompts: int, n: int) -> None:
        """Refuse a request for more than ``max_seqs_per_request`` sequences (prompts times ``n``).

        Raises:
            APIError: 400 naming ``n`` (or ``prompt`` when ``n`` is 1).
        """
        if num_prompts * n > self._max_seqs:
            raise APIError.bad_request(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x n={n}); this "
                f"server runs at most {self._max_seqs} per request (--max-seqs-per-request): send fewer "
                f"prompts or a smaller n, or split the request",
                param="n" if n > 1 else "prompt",
            )

    def _check_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit ``max_model_len`` whatever it encodes to.

        Raises:
            APIError: 400 ``context_length_exceeded``.
        """
        if num_chars > self._max_prompt_chars:
            limit = self._max_model_len
            raise APIError.bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has {num_chars} "
                f"characters in the {param}, more than {limit} tokens can hold (at most {self._max_prompt_chars}). "
                f"Please reduce the length of the input.",
                param=param,
                code="context_length_exceeded",
            )

    def _start(
        self,
        req: SamplingRequest,
        prompt: list[int],
        prompt_param: str,
        grammar: str = "",
        plan: ToolPlan | None = None,
    ) -> list[RequestState]:
        """Check lengths, build sampling parameters and add the request's ``n`` choices to the engine.

        ``grammar``: from ``_request_grammar`` ("" for free text); ``plan``: a chat request's tools.
        """
        n, limit = len(prompt), self._max_model_len
        if n == 0:
            raise APIError.bad_request(f"the {prompt_param} encode to no tokens", param=prompt_param)
        if max(prompt) >= self._vocab_limit:
            vocab = self._vocab_limit
            raise APIError.bad_request(
                f"prompt token id {max(prompt)} is out of range: the vocabulary "
                f"has {vocab} tokens (ids 0..{vocab - 1})",
                param=prompt_param,
            )
        if n >= limit:
            raise APIError.bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has {n} input "
                f"tokens, which leaves no room for output. Please reduce the length of the input.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = req.requested_max_tokens()
        if max_tokens is None:
            max_tokens = limit - n
        elif n + max_tokens > limit:
            raise APIError.bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested {n + max_tokens} "
                f"tokens ({n} in the {prompt_param}, {max_tokens} in the completion). Please reduce the length "
                f"of the {prompt_param} or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if req.min_tokens > max_tokens:
            raise APIError.bad_request(
                f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})", param="min_tokens"
            )
        logit_bias = req.logit_bias_pairs()
        for name, ids in (("logit_bias", [t for t, _ in logit_bias]), ("stop_token_ids", req.stop_token_ids or [])):
            if ids and max(ids) >= self._vocab_limit:
                raise APIError.bad_request(
                    f"{name}: token id {max(ids)} is out of range: the vocabulary has {self._vocab_limit} tokens",
                    param=name,
                )
        stop_ids = self._stop_ids(req)
        if len(stop_ids) > MAX_STOP_TOKEN_IDS:
            raise APIError.bad_request(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} stop token ids in all, with "
                f"the model's {len(self._stop_token_ids)}",
                param="stop_token_ids",
            )
        temperature = 1.0 if req.temperature is None else req.temperature
        top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
        params = SamplingParams(
            max_tokens=max_tokens,
            # Below _MIN_TEMPERATURE, logits / temperature overflow: that is greedy (as vLLM treats it).
            temperature=0.0 if temperature < _MIN_TEMPERATURE else temperature,
            # The descriptor stores top_p as float32 and top_k as int32: keep both representable.
            top_p=1.0 if req.top_p is None else max(req.top_p, _MIN_TOP_P),
            top_k=0 if top_k > _INT32_MAX else top_k,
            seed=secrets.randbits(63) if req.seed is None else req.seed & _SEED_MASK,
            stop_token_ids=stop_ids,
            logprobs=req.sampled_logprobs(),
            prompt_logprobs=req.prompt_logprobs(),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0,
            min_tokens=req.min_tokens,
            logit_bias=logit_bias,
            grammar=grammar,
            grammar_trigger=plan.trigger if plan is not None and grammar else "",
            grammar_trigger_at_start=plan is not None and plan.trigger_at_start,
        )
        try:
            return self._client.add_choices(
                prompt,
                params,
                req.stop_strings(),
                streaming=req.stream,
                return_token_ids=req.return_token_ids,
                n=req.num_choices(),
            )
        except EngineUnavailable as e:
            raise APIError(503, f"{e}; retry later", type="service_unavailable_error") from None

    def _stop_ids(self, req: SamplingRequest) -> tuple[int, ...]:
        """The ids that end the request: its own ``stop_token_ids``, then the model's EOS ids unless ``ignore_eos``.

        As in vLLM, ignore_eos drops only the EOS ids: the request's own stop_token_ids still end it.
        """
        eos_ids = () if req.ignore_eos else self._stop_token_ids
        return tuple(dict.fromkeys((*(req.stop_token_ids or ()), *eos_ids)))

    async def _request_grammar(self, req: SamplingRequest, plan: ToolPlan | None = None) -> str:
        """The request's grammar ("" for free text), built on a thread: a schema of megabytes takes tens of
        milliseconds to serialize, which the event loop must not spend (a tool plan's is built already).

        Raises:
            APIError: 400 naming the field (see ``_grammar``).
        """
        if plan is not None and plan.grammar:
            return self._grammar(req, self._stop_ids(req), plan)
        if req.structured_output() is None:
            return ""
        return await asyncio.to_thread(self._grammar, req, self._stop_ids(req), plan)

    def _grammar(self, req: SamplingRequest, stop_ids: tuple[int, ...], plan: ToolPlan | None) -> str:
        """The request's llguidance grammar (docs/design.md, "Structured output"; the tool plan's,
        "Tool calling"), or "" for free text.

        Raises:
            APIError: 400 naming the field for a malformed schema, regex or
                choice list, without a model (the simulated device samples
                no logits), with ``min_tokens`` (it could forbid the only
                token the grammar allows), or with no stop token to end on.
        """
        tools = plan is not None and bool(plan.grammar)
        so = ("lark", plan.grammar, "tools") if tools else req.structured_output()
        if so is None:
            return ""
        kind, spec, param = so
        if not self._structured_output:
            raise APIError.bad_request("structured output needs a model; the simulated device has none", param=param)
        if req.min_tokens:
            raise APIError.bad_request(f"min_tokens cannot be combined with {param}", param="min_tokens")
        if not stop_ids:
            raise APIError.bad_request(
                f"{param} needs a stop token to end on: with ignore_eos, give stop_token_ids", param="ignore_eos"
            )
        if tools:
            return plan.grammar  # compiled and checked by the plan
        try:
            return build_grammar(kind, spec, param)
        except GrammarError as e:
            raise APIError.bad_request(str(e), param=e.param) from None

    def closer(self, rid: str, req: SamplingRequest, states: list[RequestState]) -> Callable[[], None]:
        """What ends a request's response however it ends: release its states, then log it
        (``--enable-log-requests``; its prompt only with ``--log-prompts``)."""

        def close() -> None:
            for st in states:
                self._client.release(st)
            if self._log_requests:
                prompt = None
                if self._log_prompts:
                    chat = isinstance(req, ChatCompletionRequest)
                    prompt = [m.model_dump(exclude_none=True) for m in req.messages] if chat else req.prompt
                log_request(rid, states, req.num_choices(), req.stop_strings(), req.stream, prompt)

        return close

    async def wait(
        self, states: list[RequestState], raw: Request, close: Callable[[], None], grammar_param: str | None = None
    ) -> bool:
        """Wait for non-streaming requests to finish, then ``close``; False if the client left
        first (then the requests are aborted at once, within the step).

        Raises:
            APIError: as ``_raise_ended``.
        """
        finished = asyncio.ensure_future(_all_finished(states))
        left = asyncio.ensure_future(_client_left(raw))
        try:
            await asyncio.wait((finished, left), return_when=asyncio.FIRST_COMPLETED)
            if any(st.finish_reason is None for st in states):
                return False
            _raise_ended(states, grammar_param)
            return True
        finally:
            finished.cancel()
            left.cancel()
            close()

    async def compiled(
        self, states: list[RequestState], raw: Request, close: Callable[[], None], grammar_param: str | None
    ) -> bool:
        """Before a stream starts: wait until the scheduler has compiled the grammar of ``states`` (if they
        have one) and queued them, so that a grammar it refuses is still a 400. False if the client left
        first; then, and on an error, ``close`` has run.

        Raises:
            APIError: as ``_raise_ended``.
        """
        pending = {st.compiled for st in states if st.compiled is not None}
        if not pending:
            return True
        left = asyncio.ensure_future(_client_left(raw))
        try:
            while pending:
                done, _ = await asyncio.wait(pending | {left}, return_when=asyncio.FIRST_COMPLETED)
                if left in done:
                    close()
                    return False
                pending -= done
            _raise_ended(states, grammar_param)
            return True
        except BaseException:
            close()
            raise
        finally:
            left.cancel()

    @staticmethod
    def _output_ids(req: SamplingRequest, state: RequestState) -> list[int] | msgspec.UnsetType:
        return state.take_token_ids() if req.return_token_ids else msgspec.UNSET

    async def usage(self, states: list[RequestState], n: int) -> UsageInfo:
        """Prompt tokens once per prompt (its ``n`` choices are consecutive), completion tokens of every choice.

        A prompt's cached tokens are its first choice's: the others find the blocks it computed.
        """
        await self._client.wait_admitted(states[::n])
        prompt = sum(st.prompt_len for st in states[::n])
        completion = sum(st.num_output_tokens for st in states)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(st.num_cached_tokens for st in states[::n])),
        )

    # -- streams -------------------------------------------------------------------

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
            return _sse(
                ChatCompletionChunk(
                    id=rid,
                    created=created,
                    model=self._model,
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
            async for i, update in _merged_updates(states):
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
                    yield _stream_aborted()
                    yield _DONE
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
                        yield _stream_failed(st)
                        yield _DONE
                        return
            if include_usage:
                yield _sse(
                    ChatCompletionChunk(
                        id=rid,
                        created=created,
                        model=self._model,
                        choices=[],
                        usage=await self.usage(states, len(states)),
                    )
                )
        except Exception:
            # Headers are sent: the error can only travel in the stream.
            logger.exception("chat stream %s failed", rid)
            yield _stream_error()
        yield _DONE

    async def _completion_stream(
        self,
        req: CompletionRequest,
        states: list[RequestState],
        echoes: list[str],
        rid: str,
        created: int,
        prompt_ids: list[list[int] | msgspec.UnsetType],
    ) -> AsyncIterator[bytes]:
        include_usage = req.include_usage()
        usage = None if include_usage else msgspec.UNSET
        with_ids = req.return_token_ids
        started = [False] * len(states)
        offsets = [0] * len(states)  # text_offset of each choice's next token

        def chunk(
            i: int,
            text: str,
            finish_reason: str | None = None,
            token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET,
            entries: list[TokenLogprob] | None = None,
        ) -> bytes:
            logprobs = None
            if req.logprobs is not None and entries is not None:
                logprobs = completion_logprobs(self._texts, entries, offsets[i])
                if entries:
                    offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            c = CompletionChoice(
                index=i,
                text=text,
                finish_reason=finish_reason,
                logprobs=logprobs,
                prompt_token_ids=prompt_ids[i] if not started[i] else msgspec.UNSET,
                token_ids=token_ids,
            )
            started[i] = True  # the prompt ids go with a choice's first chunk only
            return _sse(CompletionResponse(id=rid, created=created, model=self._model, usage=usage, choices=[c]))

        try:
            async for i, update in _merged_updates(states):
                st = states[i]
                if st.finish_reason == "abort" and update is None:
                    yield _stream_aborted()
                    yield _DONE
                    return
                if req.echo and not started[i]:
                    # The prompt's entries are complete once any output (or the finish) has come.
                    yield chunk(i, echoes[i], entries=st.prompt_logprobs)
                if update is not None:
                    text, ids, lps = update
                    yield chunk(i, text, token_ids=ids if with_ids else msgspec.UNSET, entries=lps)
                else:
                    yield chunk(i, "", st.finish_reason)
                    if st.finish_reason == "error":
                        yield _stream_failed(st)
                        yield _DONE
                        return
            if include_usage:
                yield _sse(
                    CompletionResponse(
                        id=rid,
                        created=created,
                        model=self._model,
                        choices=[],
                        usage=await self.usage(states, req.num_choices()),
                    )
                )
        except Exception:
            logger.exception("completion stream %s failed", rid)
            yield _stream_error()
        yield _DONE


async def _merged_updates(states: list[RequestState]) -> AsyncIterator[tuple[int, tuple | None]]:
    """Each request's ``RequestState.updates`` as ``(i, update)``, as they arrive, then
    ``(i, None)`` when request ``i`` has finished; ends when all have."""
    if len(states) == 1:
        async for update in states[0].updates():
            yield 0, update
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, st: RequestState) -> None:
        try:
            async for update in st.updates():
                queue.put_nowait((i, update))
            queue.put_nowait((i, None))
        except Exception as e:  # surfaces in the consumer, which owns the stream
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, st)) for i, st in enumerate(states)]
    try:
        remaining = len(states)
        while remaining:
            i, update = await queue.get()
            if isinstance(update, Exception):
                raise update
            if update is None:
                remaining -= 1
            yield i, update
    finally:
        for t in tasks:
            t.cancel()


async def _all_finished(states: list[RequestState]) -> None:
    # One task rather than a gather: a cancelled gather whose children end
    # cancelled logs "exception was never retrieved".
    for st in states:
        await st.wait_finished()


async def _client_left(raw: Request) -> None:
    """Return when the client disconnects (the ASGI ``http.disconnect`` message).

    Only for a request whose body has been read: the server's ``receive``
    then has nothing but the disconnect to deliver.
    """
    while (await raw.receive())["type"] != "http.disconnect":
        pass


def grammar_field(req: SamplingRequest, plan: ToolPlan | None = None) -> str | None:
    """The request field a grammar the scheduler refuses is named by in the 400 (None: no grammar)."""
    if plan is not None and plan.grammar:
        return "tools"
    so = req.structured_output()
    return None if so is None else so[2]


def _raise_ended(states: list[RequestState], grammar_param: str | None) -> None:
    """Raise the error of the first of ``states`` that the server ended.

    Raises:
        APIError: 503 if the server stopped a request (shutting down); 400
            naming ``grammar_param`` if the scheduler refused its grammar; 500
            if a request failed while it ran (its finish reason "error", as
            vLLM reports a request-level internal error).
    """
    for st in states:
        if st.finish_reason == "abort":
            raise APIError(503, _ABORTED, type="service_unavailable_error")
        if st.finish_reason == "error":
            if st.refused:
                raise APIError.bad_request(f"{grammar_param}: {st.error}", param=grammar_param)
            raise APIError(500, f"the request failed: {st.error}", type="internal_server_error")


def _stream_failed(state: RequestState) -> bytes:
    """The error event of a stream whose request failed while it ran (after its finish_reason "error" chunk)."""
    return _sse(
        ErrorResponse(
            error=ErrorInfo(message=f"the request failed: {state.error}", type="internal_server_error", code="500")
        )
    )


def _stream_aborted() -> bytes:
    """The error event of a stream the server ended before its finish (shutdown)."""
    return _sse(ErrorResponse(error=ErrorInfo(message=_ABORTED, type="service_unavailable_error", code="503")))


def _stream_error() -> bytes:
    return _sse(
        ErrorResponse(error=ErrorInfo(message="internal server error while streaming", type="internal_server_error"))
    )


def chat_output(plan: ToolPlan, state: RequestState) -> tuple[str | None, list[ToolCall], str | None]:
    """A finished choice's ``(content, tool calls, finish reason)``: calls end it with ``"tool_calls"``
    (unless cut short by ``max_tokens``), and its content is null when it is calls only."""
    text = state.take_text()
    if plan.parser is None:
        return text, [], state.finish_reason
    content, calls = plan.parser.extract(text)
    if not calls:
        return content, [], state.finish_reason
    return content or None, calls, "tool_calls" if state.finish_reason == "stop" else state.finish_reason
