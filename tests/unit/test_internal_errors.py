"""A route's own fault is a 500 that leaves its kept-alive connection usable (issue 40, finding 4)."""

from __future__ import annotations

import json
import socket

from fastapi import FastAPI
from starlette.responses import Response, StreamingResponse

from pipeline.io_proc.api_server import InternalErrors
from pipeline.io_proc.http_limits import guarded_h11_protocol
from tests.unit.test_http_limits import InProcessServer


def failing_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(InternalErrors)

    @app.get("/fail")
    async def fail() -> Response:
        raise RecursionError("maximum recursion depth exceeded")

    @app.get("/ok")
    async def ok() -> Response:
        return Response(b"{}", media_type="application/json")

    @app.get("/fail-mid-stream")
    async def fail_mid_stream() -> Response:
        async def body():
            yield b"data: 1\n\n"
            raise RuntimeError("broken stream")

        return StreamingResponse(body(), media_type="text/event-stream")

    return app


def read_response(s: socket.socket) -> tuple[int, bytes]:
    """One response with a Content-Length from ``s``: (status, body); (0, b"") if the server closed it."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return 0, b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), body


def test_a_fault_is_a_500_and_the_connection_serves_the_next_request():
    server = InProcessServer(failing_app(), guarded_h11_protocol(10.0, 10.0))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n")
            status, body = read_response(s)
            assert status == 500
            assert json.loads(body) == {
                "error": {
                    "message": "internal server error: RecursionError",
                    "type": "internal_server_error",
                    "param": None,
                    "code": None,
                }
            }
            s.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            assert read_response(s) == (200, b"{}")
    finally:
        server.close()


def test_a_stream_failing_after_its_headers_is_closed():
    server = InProcessServer(failing_app(), guarded_h11_protocol(10.0, 10.0))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"GET /fail-mid-stream HTTP/1.1\r\nHost: x\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200") and b"data: 1" in data and not data.endswith(b"0\r\n\r\n")
    finally:
        server.close()
