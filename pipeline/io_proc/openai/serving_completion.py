"""``POST /v1/completions``: one engine request per prompt, run concurrently; with ``n`` > 1, choice ``p * n + i`` is
prompt ``p``'s ``i``-th (docs/design.md, "Parallel choices"). ``echo`` starts a choice's text with its prompt."""

from __future__ import annotations

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
from pipeline.io_proc.openai.logprobs_json import TokenLogprob, completion_logprobs
from pipeline.io_proc.openai.protocol import APIError
from pipeline.io_proc.openai.protocol_completion import CompletionChoice, CompletionRequest, CompletionResponse
from pipeline.io_proc.openai.serving import CLIENT_CLOSED, OpenAIServing, grammar_field, json_response
from pipeline.io_proc.request_state import RequestState

logger = logging.getLogger(__name__)


class OpenAIServingCompletion(OpenAIServing):
    """The text completion endpoint's logic (arguments as ``OpenAIServing``)."""

    async def completion(self, req: CompletionRequest, raw: Request) -> Response:
        """Serve ``POST /v1/completions``: one choice per prompt.

        Raises:
            APIError: as ``chat``, 400 for token ids outside the vocabulary, and 400 for ``max_tokens`` 0 without
                ``echo``.
        """
        self._check_model(req)
        self._check_fan_out(len(req.prompt), req.num_choices())
        if req.requested_max_tokens() == 0 and not req.echo:
            raise APIError.bad_request("max_tokens must be at least 1 unless echo is true", param="max_tokens")
        prompts: list[list[int]] = []
        for p in req.prompt:
            if isinstance(p, str):
                self._check_chars(len(p), "prompt")
                prompts.append(await self._tokenization.encode_text(p))
            else:
                prompts.append(p)
        params = [self._sampling_params(req, ids, "prompt") for ids in prompts]
        # Once every prompt fits: once for every prompt and choice.
        grammar, param = await self._request_grammar(req), grammar_field(req)
        echoes = (
            [p if isinstance(p, str) else await self._tokenization.decode(p) for p in req.prompt]
            if req.echo
            else [""] * len(prompts)
        )
        # Choices are prompt-major, as in the OpenAI API: choice p * n + i is prompt p's i-th.
        n = req.num_choices()
        states: list[RequestState] = []
        try:
            for ids, p in zip(prompts, params, strict=True):
                states.extend(self._start(req, ids, p, grammar))
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
                return Response(status_code=CLIENT_CLOSED)
            return EventStream(self._completion_stream(req, states, echoes, rid, created, prompt_ids), close)
        if not await self.wait(states, raw, close, param):
            return Response(status_code=CLIENT_CLOSED)
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
                id=rid,
                created=created,
                model=self.response_model(req),
                choices=choices,
                usage=await self.usage(states, n),
            )
        )

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
            return sse(
                CompletionResponse(id=rid, created=created, model=self.response_model(req), usage=usage, choices=[c])
            )

        try:
            async for i, update in merged_updates(states):
                st = states[i]
                if st.finish_reason == "abort" and update is None:
                    yield stream_aborted()
                    yield DONE
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
                        yield stream_failed(st)
                        yield DONE
                        return
            if include_usage:
                yield sse(
                    CompletionResponse(
                        id=rid,
                        created=created,
                        model=self.response_model(req),
                        choices=[],
                        usage=await self.usage(states, req.num_choices()),
                    )
                )
        except Exception:
            logger.exception("completion stream %s failed", rid)
            yield stream_error()
        yield DONE
