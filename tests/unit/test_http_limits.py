"""The HTTP bounds of io_proc without the engine: the body-size middleware and the guarded h11 protocol."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import struct
import threading
import time

import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.io_proc.http_limits import OncePerInterval, RequestBodyLimit, guarded_h11_protocol

# -- RequestBodyLimit --------------------------------------------------------------------


def run_middleware(max_bytes: int, headers: list[tuple[bytes, bytes]], messages: list[dict]):
    """Run the middleware over ``messages``; returns (what the app received or None, what was sent, receives)."""
    sent: list[dict] = []
    seen: dict = {}
    received = 0

    async def receive():
        nonlocal received
        received += 1
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        seen["body"] = await receive()
        seen["next"] = await receive()

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers}
    asyncio.run(RequestBodyLimit(app, max_bytes)(scope, receive, send))
    return seen or None, sent, received


def test_body_within_the_limit_reaches_the_app_once():
    seen, sent, _ = run_middleware(
        10,
        [],
        [
            {"type": "http.request", "body": b"12345", "more_body": True},
            {"type": "http.request", "body": b"67890", "more_body": False},
        ],
    )
    assert seen["body"] == {"type": "http.request", "body": b"1234567890", "more_body": False}
    assert seen["next"] == {"type": "http.disconnect"}
    assert sent == []


def test_content_length_over_the_limit_is_413_without_reading():
    seen, sent, received = run_middleware(
        10, [(b"content-length", b"11")], [{"type": "http.request", "body": b"x" * 11}]
    )
    assert seen is None and received == 0
    assert sent[0]["status"] == 413
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"


def test_chunked_body_over_the_limit_is_413_as_soon_as_it_passes():
    chunks = [{"type": "http.request", "body": b"x" * 6, "more_body": True} for _ in range(5)]
    seen, sent, received = run_middleware(10, [], chunks)
    assert seen is None and received == 2 and sent[0]["status"] == 413


def test_client_leaving_mid_body_gets_nothing():
    seen, sent, _ = run_middleware(10, [], [{"type": "http.request", "body": b"x", "more_body": True}])
    assert seen is None and sent == []


# -- the protocol: writes to a lost connection -----------------------------------------


class InProcessServer:
    """uvicorn serving ``app`` on a thread, with the given h11 protocol class."""

    def __init__(self, app, http):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, http=http, lifespan="off", log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])))
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.mark.parametrize("protocol", ["uvicorn", "guarded"])
def test_writes_to_a_reset_connection_are_dropped_quietly(protocol, caplog):
    """The cause of the "socket.send() raised exception" flood: a response
    written in a burst after its client reset the connection, before the
    server's read side noticed (here reading is paused, as uvicorn does when
    bytes follow a complete request). asyncio warns from the sixth write to a
    lost transport on; the guarded protocol drops writes to a closing one."""
    reset = threading.Event()

    async def app(scope, receive, send):
        await asyncio.to_thread(reset.wait, 10)
        await asyncio.sleep(0.2)  # the RST has arrived
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(10):
            await send({"type": "http.response.body", "body": b"data: x\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    http = H11Protocol if protocol == "uvicorn" else guarded_h11_protocol(10.0, 10.0)
    server = InProcessServer(app, http)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncio"):
            c = socket.create_connection(("127.0.0.1", server.port))
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n\r\n")  # a stray CRLF after the request
            time.sleep(0.2)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            c.close()
            reset.set()
            time.sleep(0.6)
    finally:
        server.close()
    floods = [r for r in caplog.records if "socket.send() raised exception" in r.getMessage()]
    # The control: plain uvicorn floods (if a new uvicorn stops doing so, the guard may be unneeded).
    assert bool(floods) == (protocol == "uvicorn"), floods


def test_concurrency_limit_warning_is_rate_limited():
    f = OncePerInterval("Exceeded concurrency limit.", 60.0)

    def record(msg):
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, (), None)

    assert f.filter(record("Exceeded concurrency limit."))
    assert not any(f.filter(record("Exceeded concurrency limit.")) for _ in range(100))
    assert f.filter(record("something else"))
    f._last -= 61
    r = record("Exceeded concurrency limit.")
    assert f.filter(r) and "100 more" in r.getMessage()
