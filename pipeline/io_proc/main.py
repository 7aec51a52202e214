"""io_proc's process entry point, called by the launcher in a spawned child."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection

import uvicorn

from pipeline.common.config import EngineConfig
from pipeline.common.process import StopFlag, child_setup, report
from pipeline.common.shm_ring import ShmRing
from pipeline.common.trace import TraceRecorder
from pipeline.io_proc.api_server import build_app
from pipeline.io_proc.engine_client import EngineClient
from pipeline.io_proc.tokenization import Tokenization, load_tokenizer

logger = logging.getLogger("pipeline.io_proc")

_NAME = "io_proc"
# Seconds between checks of the stop flag; shutdown takes about this plus
# uvicorn's graceful timeout plus one ring poll.
_POLL_S = 0.1
# Open responses get this long to finish after a stop (they are all ended with
# "abort" first, so they normally finish at once).
_GRACEFUL_SHUTDOWN_S = 0.5


class _Server(uvicorn.Server):
    """uvicorn without its own SIGINT/SIGTERM handlers: the launcher stops this
    process with SIGTERM, which :func:`child_setup`'s flag receives, and
    uvicorn's handlers would replace it and re-raise the signal on exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _StartupError(Exception):
    """A start-up step failed; the message says what and what to do."""


def run_io_proc(config: EngineConfig, status_conn: Connection) -> None:
    """Run io_proc until SIGTERM (or the launcher's death).

    Steps: attach the output ring (reader ``OUTPUT_READER_IO``) and report
    ``("attached", "io_proc")``; bind the HTTP port; load the tokenizer from
    ``config.tokenizer``; connect zmq (push to ``config.control_address``, pull
    on ``config.reply_address``); serve the OpenAI API on
    ``config.host:config.port`` and report ``("ready", "io_proc")`` once
    listening. On a start-up failure it reports ``("error", "io_proc",
    message)`` and exits with status 1; it also exits with 1 if the output
    reader thread dies. A stop ends every open request with finish reason
    "abort" and exits within about a second.
    """
    stop = child_setup(_NAME)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        ring = config.output_ring()
    except Exception as e:
        report(status_conn, "error", _NAME, f"cannot attach the output ring {config.output_ring_name!r} ({e}); "
                                            "it must be created by the launcher before io_proc starts")
        sys.exit(1)
    report(status_conn, "attached", _NAME)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(ring.close)
        try:
            code = _start_and_serve(config, ring, stop, status_conn, cleanup)
        except _StartupError as e:
            logger.error("%s", e)
            report(status_conn, "error", _NAME, str(e))
            code = 1
        except Exception as e:
            logger.exception("io_proc failed")
            report(status_conn, "error", _NAME, f"io_proc failed: {type(e).__name__}: {e} (see its log)")
            code = 1
    if code:
        sys.exit(code)


def _start_and_serve(config: EngineConfig, ring: ShmRing, stop: StopFlag, status_conn: Connection,
                     cleanup: contextlib.ExitStack) -> int:
    sock = _bind(config.host, config.port)
    cleanup.callback(sock.close)
    try:
        tokenizer, stop_token_ids = load_tokenizer(config.tokenizer)
    except Exception as e:
        raise _StartupError(f"cannot load the tokenizer from {config.tokenizer!r} ({type(e).__name__}: {e}); "
                            "--model must be a Hugging Face model directory with tokenizer files") from e
    tokenization = Tokenization(tokenizer)
    cleanup.callback(tokenization.close)
    trace = TraceRecorder() if config.trace else None
    if trace is not None:
        # Registered first among these, so it runs after the client has stopped reading.
        cleanup.callback(trace.dump, config.trace_path("io_proc"))
    try:
        client = EngineClient(config, ring, tokenization.make_decoder(), trace)
    except Exception as e:
        raise _StartupError(f"cannot open the control sockets ({e}); check that {config.ipc_dir!r} exists "
                            "and is writable") from e
    cleanup.callback(client.close)
    app = build_app(config, client, tokenization, stop_token_ids)
    server = _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                    access_log=False, timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S))
    return asyncio.run(_serve(server, sock, client, stop, status_conn))


def _bind(host: str, port: int) -> socket.socket:
    """Bind the HTTP port now, so a port in use is a clear start-up error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise _StartupError(f"cannot listen on {host}:{port} ({e.strerror}); another server may be using "
                            f"the port: stop it or choose another one with --port") from e
    return sock


async def _serve(server: _Server, sock: socket.socket, client: EngineClient, stop: StopFlag,
                 status_conn: Connection) -> int:
    """Serve until stopped; returns the exit status."""
    serving = asyncio.create_task(_run_server(server, sock))
    while not server.started:
        if serving.done():
            raise _StartupError("the HTTP server failed to start (see the log above)")
        if stop.is_set():
            server.should_exit = True
            await serving
            return 0
        await asyncio.sleep(0.01)
    logger.info("serving the OpenAI API on http://%s:%d", server.config.host, server.config.port)
    report(status_conn, "ready", _NAME)
    code = 0
    while not serving.done() and not stop.is_set():
        if not client.is_healthy():
            logger.error("the output reader thread died (%r); exiting", client.reader_error)
            code = 1
            break
        await asyncio.sleep(_POLL_S)
    if serving.done() and not stop.is_set():
        logger.error("the HTTP server stopped on its own; exiting")
        code = 1
    client.abort_all()
    server.should_exit = True
    await serving
    return code


async def _run_server(server: _Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit:
        # uvicorn calls sys.exit() when its start-up fails; it logged why.
        pass
