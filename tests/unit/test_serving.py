"""io_proc's serving logic without a server: a non-streaming request notices its client leaving at once."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from pipeline.common.config import EngineConfig
from pipeline.io_proc.openai.protocol import APIError
from pipeline.io_proc.openai.serving import OpenAIServing
from pipeline.io_proc.request_state import RequestState


def make_serving() -> tuple[OpenAIServing, list[RequestState]]:
    released: list[RequestState] = []
    client = SimpleNamespace(release=released.append)
    tokenization = SimpleNamespace(
        max_prompt_chars=lambda max_tokens: 100 * max_tokens,
        vocab_size=1000,
        renders_tools=False,
        renders_tool_calls=False,
        system_role=True,
        tool_role=True,
    )
    return OpenAIServing(EngineConfig(model="sim", served_model_name="sim"), client, tokenization, ()), released


def closer(serving: OpenAIServing, states: list[RequestState]):
    """The serving's own close: releases the states (logging is off)."""
    return serving.closer("cmpl-test", SimpleNamespace(), states)


def make_request(disconnect_after: float | None) -> Request:
    """A request whose body has been read; the client leaves after ``disconnect_after`` seconds (or never)."""
    loop = asyncio.get_running_loop()
    at = None if disconnect_after is None else loop.time() + disconnect_after

    async def receive():
        # Like a server's receive(): blocks until the client leaves, then answers at once.
        if at is None:
            await asyncio.Event().wait()
        if loop.time() < at:
            await asyncio.sleep(at - loop.time())
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}, receive)


def test_wait_returns_as_soon_as_the_client_leaves():
    async def main():
        serving, released = make_serving()
        state = RequestState(1, 3, None, streaming=False, return_token_ids=False)
        t0 = time.monotonic()
        assert await serving.wait([state], make_request(0.05), closer(serving, [state])) is False
        # Before: the wait polled is_disconnected() every 0.5 s.
        assert time.monotonic() - t0 < 0.4
        assert released == [state]

    asyncio.run(main())


def test_wait_returns_on_finish_and_503_on_server_abort():
    async def main():
        serving, released = make_serving()
        done = RequestState(1, 3, None, streaming=False, return_token_ids=False)
        asyncio.get_running_loop().call_later(0.05, done.deliver, "text", "length", 2)
        assert await serving.wait([done], make_request(None), closer(serving, [done])) is True
        aborted = RequestState(2, 3, None, streaming=False, return_token_ids=False)
        asyncio.get_running_loop().call_later(0.05, aborted.deliver, "", "abort", 0)
        with pytest.raises(APIError) as e:
            await serving.wait([aborted], make_request(None), closer(serving, [aborted]))
        assert e.value.status_code == 503
        assert released == [done, aborted]

    asyncio.run(main())
