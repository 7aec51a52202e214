"""The steps every generation endpoint shares: checks, sampling parameters, adding a request's choices, waiting, usage.

With vLLM's ``return_token_ids`` each chunk carries the token ids it covers, so a stream sends a chunk per token;
streamed text concatenates exactly to the non-streamed text.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pipeline.common.config import EngineConfig
from pipeline.common.grammar import GrammarError, build_grammar
from pipeline.common.messages import SamplingParams
from pipeline.common.step_protocol import MAX_STOP_TOKEN_IDS
from pipeline.io_proc.engine_client import EngineClient, EngineUnavailable
from pipeline.io_proc.lora_adapters import LoraAdapters
from pipeline.io_proc.openai.event_stream import ABORTED
from pipeline.io_proc.openai.protocol import APIError, PromptTokensDetails, SamplingRequest, UsageInfo
from pipeline.io_proc.openai.protocol_chat import ChatCompletionRequest
from pipeline.io_proc.openai.protocol_tokenization import DetokenizeRequest, TokenizeRequest
from pipeline.io_proc.request_log import log_request
from pipeline.io_proc.request_state import RequestState
from pipeline.io_proc.tokenization import Tokenization
from pipeline.io_proc.tool_calling import ToolCalling, ToolPlan, compile_tool_grammar

# HTTP status nginx uses for "client closed request"; nobody reads it.
CLIENT_CLOSED = 499


def json_body(obj: object) -> bytes:
    """``obj`` (structs, dicts, lists, scalars) as JSON, encoded with msgspec."""
    return msgspec.json.encode(obj)


def json_response(obj: msgspec.Struct, status_code: int = 200) -> Response:
    """A JSON response encoded with msgspec."""
    return Response(msgspec.json.encode(obj), status_code=status_code, media_type="application/json")


class OpenAIServing:
    """The steps the endpoints share; each endpoint's class extends it; ``adapters``: the LoRA adapters a request's
    ``model`` may name."""

    def __init__(
        self,
        config: EngineConfig,
        client: EngineClient,
        tokenization: Tokenization,
        stop_token_ids: tuple[int, ...],
        adapters: LoraAdapters | None = None,
    ):
        self.tool_calling = ToolCalling(
            config.tools.tool_call_parser or None,
            config.tools.enable_auto_tool_choice,
            tokenization.renders_tools,
            tokenization.renders_tool_calls,
            tokenization.system_role,
            tokenization.tool_role,
        )
        self._model = config.served_model_name
        self._adapters = adapters or LoraAdapters(config)
        self._max_model_len = config.max_model_len
        self._max_prompt_chars = tokenization.max_prompt_chars(config.max_model_len)
        self._client = client
        self._tokenization = tokenization
        self._stop_token_ids = stop_token_ids
        # Prompt ids must have an embedding row (an out-of-range id is an
        # asynchronous device assert on CUDA) and decode with the tokenizer.
        self._vocab_limit = min(tokenization.vocab_size, config.vocab_size or tokenization.vocab_size)
        self._structured_output = config.vocab_size > 0
        self._log_requests, self._log_prompts = (
            config.observability.enable_log_requests,
            config.observability.log_prompts,
        )
        self._max_seqs = config.http.max_seqs_per_request

    @property
    def _texts(self):
        """Token texts and bytes for log-probabilities."""
        return self._tokenization.token_texts

    def _check_model(self, req: SamplingRequest | TokenizeRequest | DetokenizeRequest) -> None:
        if req.model is not None and req.model != self._model and self._adapters.id_of(req.model) is None:
            raise APIError(
                404,
                f"The model `{req.model}` does not exist. This server serves `{self._model}`.",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )

    def response_model(self, req: SamplingRequest) -> str:
        """The ``model`` a response names: the LoRA adapter the request asked for, else the served model (as
        vLLM answers)."""
        return req.model if self._adapters.id_of(req.model) is not None else self._model

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

    def _check_chars(self, num_chars: int, param: str, what: str | None = None) -> None:
        """Refuse, before tokenizing, a text too long to fit ``max_model_len`` whatever it encodes to.

        Raises:
            APIError: 400 ``context_length_exceeded``.
        """
        if num_chars > self._max_prompt_chars:
            limit = self._max_model_len
            raise APIError.bad_request(
                f"This model's maximum context length is {limit} tokens. However, your request has {num_chars} "
                f"characters in {what or 'the ' + param}, more than {limit} tokens can hold (at most "
                f"{self._max_prompt_chars}). "
                f"Please reduce the length of the input.",
                param=param,
                code="context_length_exceeded",
            )

    def _sampling_params(self, req: SamplingRequest, prompt: list[int], prompt_param: str) -> SamplingParams:
        """Check the prompt and token ids, before any grammar compiles; the sampling parameters without a grammar.

        Raises:
            APIError: 400 naming the field (``context_length_exceeded`` for lengths).
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
        return req.sampling_params(max_tokens, stop_ids, lora_id=self._adapters.id_of(req.model) or 0)

    def _start(
        self,
        req: SamplingRequest,
        prompt: list[int],
        params: SamplingParams,
        grammar: str = "",
        plan: ToolPlan | None = None,
    ) -> list[RequestState]:
        """Add the request's ``n`` choices to the engine; ``grammar`` "" for free text.

        Raises:
            APIError: 503 when the scheduler takes no more requests.
        """
        if grammar:
            params = msgspec.structs.replace(
                params,
                grammar=grammar,
                grammar_trigger=plan.trigger if plan is not None else "",
                grammar_trigger_at_start=plan is not None and plan.trigger_at_start,
            )
        # Stop strings apply to free text only: a forced call's output has none (docs/design.md, "Stop strings").
        forced = bool(grammar) and plan is not None and not plan.trigger
        try:
            return self._client.add_choices(
                prompt,
                params,
                [] if forced else req.stop_strings(),
                streaming=req.stream,
                return_token_ids=req.return_token_ids,
                n=req.num_choices(),
            )
        except EngineUnavailable as e:
            raise APIError(503, f"{e}; retry later", type="service_unavailable_error") from None

    def _stop_ids(self, req: SamplingRequest) -> tuple[int, ...]:
        """The request's own ``stop_token_ids``, then the model's EOS ids unless ``ignore_eos`` (as vLLM)."""
        eos_ids = () if req.ignore_eos else self._stop_token_ids
        return tuple(dict.fromkeys((*(req.stop_token_ids or ()), *eos_ids)))

    async def _request_grammar(self, req: SamplingRequest, plan: ToolPlan | None = None) -> str:
        """The request's grammar ("" for free text), built on a thread so large schemas do not stall the event loop.

        Raises:
            APIError: 400 naming the field (see ``_grammar``).
        """
        if grammar_field(req, plan) is None:
            return ""
        return await asyncio.to_thread(self._grammar, req, self._stop_ids(req), plan)

    def _grammar(self, req: SamplingRequest, stop_ids: tuple[int, ...], plan: ToolPlan | None) -> str:
        """The request's llguidance grammar, or "" (docs/design.md, "Structured output"; "Tool calling").

        Raises:
            APIError: 400 naming the field: a malformed schema, regex or choice list, no vocabulary, ``min_tokens`` set,
                or no stop token to end on.
        """
        tools = plan is not None and bool(plan.grammar)
        so = ("lark", plan.grammar, "tools") if tools else req.structured_output()
        if so is None:
            return ""
        kind, spec, param = so
        if not self._structured_output:
            raise APIError.bad_request(
                "structured output needs the model's vocabulary, not configured here", param=param
            )
        if req.min_tokens:
            raise APIError.bad_request(f"min_tokens cannot be combined with {param}", param="min_tokens")
        if not stop_ids:
            raise APIError.bad_request(
                f"{param} needs a stop token to end on: with ignore_eos, give stop_token_ids", param="ignore_eos"
            )
        if tools:
            return compile_tool_grammar(plan)
        try:
            return build_grammar(kind, spec, param)
        except GrammarError as e:
            raise APIError.bad_request(str(e), param=e.param) from None

    def closer(
        self, rid: str, req: SamplingRequest, states: list[RequestState], plan: ToolPlan | None = None
    ) -> Callable[[], None]:
        """What ends a request's response however it ends: release its states, then log it (``--enable-log-requests``,
        with how ``plan`` served its tools; its prompt only with ``--log-prompts``)."""

        def close() -> None:
            for st in states:
                self._client.release(st)
            if self._log_requests:
                prompt = None
                if self._log_prompts:
                    chat = isinstance(req, ChatCompletionRequest)
                    prompt = [m.model_dump(exclude_none=True) for m in req.messages] if chat else req.prompt
                tools = plan.route if plan is not None else ""
                lora = req.model if states[0].params.lora_id else ""
                log_request(rid, states, req.num_choices(), req.stop_strings(), req.stream, prompt, tools, lora)

        return close

    async def wait(
        self, states: list[RequestState], raw: Request, close: Callable[[], None], grammar_param: str | None = None
    ) -> bool:
        """Wait for non-streaming requests to finish, then ``close``; False (requests aborted) if the client left first.

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
        """Before a stream starts, wait until the scheduler compiled ``states``' grammar, so a refusal is still a 400;
        False if the client left first.

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
        """Prompt tokens once per prompt, completion tokens of every choice; cached tokens are the first choice's."""
        await self._client.wait_admitted(states[::n])
        prompt = sum(st.prompt_len for st in states[::n])
        completion = sum(st.num_output_tokens for st in states)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(st.num_cached_tokens for st in states[::n])),
        )


async def _all_finished(states: list[RequestState]) -> None:
    # One task rather than a gather: a cancelled gather whose children end
    # cancelled logs "exception was never retrieved".
    for st in states:
        await st.wait_finished()


async def _client_left(raw: Request) -> None:
    """Return when the client disconnects; only once the request body has been read."""
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
        APIError: 503 if shutting down; 400 naming ``grammar_param`` for a refused grammar; 500 for a failed request.
    """
    for st in states:
        if st.finish_reason == "abort":
            raise APIError(503, ABORTED, type="service_unavailable_error")
        if st.finish_reason == "error":
            if st.refused:
                raise APIError.bad_request(f"{grammar_param}: {st.error}", param=grammar_param)
            raise APIError(500, f"the request failed: {st.error}", type="internal_server_error")
