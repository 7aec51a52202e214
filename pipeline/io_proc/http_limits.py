"""Bounds on what one HTTP client can cost io_proc: time, bytes and sockets (docs/design.md, "Bounds per client").

``guarded_h11_protocol`` adds header and body read deadlines to uvicorn's h11 protocol and skips writes to closing
transports; ``RequestBodyLimit`` caps body size (413); ``OncePerInterval`` thins uvicorn's warnings.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.io_proc.openai.protocol import ErrorInfo, ErrorResponse


def error_body(message: str, type: str, code: str | None = None) -> bytes:
    """An OpenAI error object, ``{"error": {...}}``, as JSON bytes."""
    return msgspec.json.encode(ErrorResponse(error=ErrorInfo(message=message, type=type, code=code)))


class _QuietTransport:
    """A transport whose ``write`` does nothing once it is closing; everything else is the wrapped transport's."""

    __slots__ = ("_transport",)

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport

    def write(self, data: bytes) -> None:
        if not self._transport.is_closing():
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines and quiet writes: a missed header deadline closes the connection, a
    missed body deadline answers 408 (if no response started) and closes it."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None
        super().connection_made(transport)
        self.transport = _QuietTransport(transport)  # type: ignore[assignment]
        self._update_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_phase(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._update_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_deadline()

    def _update_deadline(self) -> None:
        """Time the phase the client is in: "headers", "body", or none (left to uvicorn's keep-alive timer)."""
        if self.transport.is_closing():
            phase = None
        elif self.conn.their_state is h11.IDLE:
            phase = "headers" if self.timeout_keep_alive_task is None else None
        elif self.conn.their_state is h11.SEND_BODY:
            phase = "body"
        else:
            phase = None
        if phase != self._phase:
            self._set_phase(phase)

    def _set_phase(self, phase: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            timeout = self.header_timeout_s if phase == "headers" else self.body_timeout_s
            self._deadline = self.loop.call_later(timeout, self._expire)

    def _expire(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if phase == "body" and cycle is not None and not cycle.response_started:
            # The app is waiting for the body: it gets a disconnect, and its
            # own sends become no-ops, while the client gets a 408.
            cycle.disconnected = True
            cycle.message_event.set()
            body = error_body(
                f"the request body did not arrive within {self.body_timeout_s:g} s",
                "invalid_request_error",
                "request_timeout",
            )
            headers = [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ]
            try:
                for event in (
                    h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                    h11.Data(data=body),
                    h11.EndOfMessage(),
                ):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:
                pass
        self.transport.close()


def guarded_h11_protocol(header_timeout_s: float, body_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with these read deadlines (seconds), for ``uvicorn.Config(http=...)``."""
    return type(
        "GuardedH11Protocol",
        (_GuardedH11Protocol,),
        {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s},
    )


class RequestBodyLimit:
    """ASGI middleware: read each request body up to ``max_bytes`` before the app runs, else 413 with an OpenAI error
    (at once when ``Content-Length`` says so); the app gets the body as one ``http.request`` message."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            # h11 has already refused a malformed or repeated Content-Length.
            if name == b"content-length" and int(value) > self.max_bytes:
                await self._too_large(send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before its body was complete
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                await self._too_large(send)
                return
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        # b"".join of one bytes object returns it without a copy.
        first: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal first
            if first is not None:
                message, first = first, None
                return message
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        body = error_body(
            f"the request body is larger than this server's limit of {self.max_bytes} bytes",
            "invalid_request_error",
            "request_too_large",
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class OncePerInterval(logging.Filter):
    """A logging filter passing ``message`` at most once per ``interval_s`` seconds, noting how many it dropped (uvicorn
    logs one per refused or malformed request)."""

    def __init__(self, message: str, interval_s: float):
        super().__init__()
        self.message, self.interval_s = message, interval_s
        self._last = -float("inf")
        self._dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != self.message:
            return True
        now = time.monotonic()
        if now - self._last < self.interval_s:
            self._dropped += 1
            return False
        if self._dropped:
            record.msg, record.args = f"{self.message} ({self._dropped} more since the last report)", ()
        self._last, self._dropped = now, 0
        return True
