"""Server-Sent Event streams (OpenAI API): each event is ``data: <json>\\n\\n``; a stream ends with ``data:
[DONE]\\n\\n``. With several choices, their updates interleave as they arrive."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pipeline.io_proc.openai.protocol import ErrorInfo, ErrorResponse
from pipeline.io_proc.request_state import RequestState

DONE = b"data: [DONE]\n\n"
ABORTED = "the server is shutting down and stopped this request before it finished; retry it"


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class EventStream(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends: fully sent, client gone (Starlette cancels the send
    task), or server shutdown."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def merged_updates(states: list[RequestState]) -> AsyncIterator[tuple[int, tuple | None]]:
    """Each request's ``RequestState.updates`` as ``(i, update)``, as they arrive, then ``(i, None)`` when request ``i``
    has finished; ends when all have."""
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


def stream_failed(state: RequestState) -> bytes:
    """The error event of a stream whose request failed while it ran (after its finish_reason "error" chunk)."""
    return sse(
        ErrorResponse(
            error=ErrorInfo(message=f"the request failed: {state.error}", type="internal_server_error", code="500")
        )
    )


def stream_aborted() -> bytes:
    """The error event of a stream the server ended before its finish (shutdown)."""
    return sse(ErrorResponse(error=ErrorInfo(message=ABORTED, type="service_unavailable_error", code="503")))


def stream_error() -> bytes:
    return sse(
        ErrorResponse(error=ErrorInfo(message="internal server error while streaming", type="internal_server_error"))
    )
