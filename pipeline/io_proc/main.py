"""io_proc's process body: uvicorn serving the OpenAI API over the engine client (docs/design.md, "Processes and
lifecycle")."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection

import uvicorn

from pipeline.common.config import EngineConfig
from pipeline.common.heartbeat import Heartbeats
from pipeline.common.memory import BurstWatch, HeapWatch, heap_in_use, limit_arenas, trim_heap
from pipeline.common.process import StopFlag, freeze_startup_heap, report, start_background_thread
from pipeline.common.shm_ring import ShmRing
from pipeline.common.step_output import StepOutput
from pipeline.common.trace import TraceRecorder
from pipeline.io_proc.api_server import STATS_TIMEOUT_S, build_app
from pipeline.io_proc.engine_client import EngineClient
from pipeline.io_proc.http_limits import OncePerInterval, guarded_h11_protocol
from pipeline.io_proc.stats_logger import StatsLogger
from pipeline.io_proc.tokenization import Tokenization, load_tokenizer

logger = logging.getLogger("pipeline.io_proc")

_NAME = "io_proc"
# Seconds between two looks at the stop flag and the reader thread's health
# while serving (the rings are polled by the reader thread, every
# POLL_INTERVAL_S); shutdown takes about this plus uvicorn's graceful timeout
# plus one ring poll.
_WATCH_INTERVAL_S = 0.1
# The heap is read every this many turns, and only until this many seconds after the last request ended:
# mallinfo2 walks every free chunk of every arena (about 20 ms here), and read each turn it took 5 % of
# an idle io_proc's core.
_HEAP_EVERY_TURNS = 5
_HEAP_WATCH_AFTER_S = 5.0
# Open responses get this long to finish after a stop (they are all ended with
# "abort" first, so they normally finish at once).
_GRACEFUL_SHUTDOWN_S = 0.5
# uvicorn's warnings about refused or malformed requests are logged at most
# this often (seconds), with a count of those left out.
_REPEATED_WARNING_S = 10.0
# Threads that prepare requests off the event loop (asyncio.to_thread): two keep a burst of large bodies
# from taking the GIL from the loop more than twice over (six, asyncio's default here, gave /health a
# p99 of 1.3-2.2 s against 0.8-1.4 s during 16 requests of 5,000 tools on a loaded 2-core machine).
_PREPARE_THREADS = 2
# File descriptors io_proc needs besides one per HTTP connection (rings, zmq,
# tokenizer files, logs).
_SPARE_FDS = 256


class _Server(uvicorn.Server):
    """uvicorn without its own SIGINT/SIGTERM handlers: the launcher stops this process with SIGTERM, which
    ``child_setup``'s flag receives, and uvicorn's handlers would replace it and re-raise the signal on exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class StartupError(Exception):
    """A start-up step failed; the message says what and what to do."""


class IoProc:
    """Owns the HTTP socket, the tokenizer, the engine client and the uvicorn server; ``run`` is the process body,
    ``close`` releases all but the output rings.

    Raises:
        StartupError: a start-up step failed (what was opened is closed again).
    """

    def __init__(self, config: EngineConfig, rings: list[ShmRing[StepOutput]], heartbeats: Heartbeats | None = None):
        self.config = config
        self.heartbeats = heartbeats
        self._cleanup = contextlib.ExitStack()
        try:
            self._open(rings)
        except BaseException:
            self._cleanup.close()
            raise

    def _open(self, rings: list[ShmRing[StepOutput]]) -> None:
        config, cleanup = self.config, self._cleanup
        self.sock = _bind(config.http.host, config.http.port)
        cleanup.callback(self.sock.close)
        try:
            tokenizer, stop_token_ids = load_tokenizer(config.tokenizer)
        except Exception as e:
            raise StartupError(
                f"cannot load the tokenizer from {config.tokenizer!r} ({type(e).__name__}: {e}); "
                "--model must be a Hugging Face model directory with tokenizer files"
            ) from e
        try:
            tokenization = Tokenization(tokenizer, chat_template=config.chat_template or None)
        except Exception as e:
            raise StartupError(
                f"the chat template does not load ({type(e).__name__}: {e}); check --chat-template"
            ) from e
        cleanup.callback(tokenization.close)
        trace = TraceRecorder() if config.trace else None
        if trace is not None:
            # Registered before the client's close, so it runs after the client has stopped reading.
            cleanup.callback(trace.dump, config.trace_path(_NAME))
        try:
            self.client = EngineClient(config, rings, tokenization.make_detokenizer(), trace)
        except Exception as e:
            raise StartupError(
                f"cannot open the control sockets ({e}); check that {config.ipc_dir!r} exists and is writable"
            ) from e
        cleanup.callback(self.client.close)
        app = build_app(config, self.client, tokenization, stop_token_ids, self.heartbeats)
        _raise_fd_limit(config.http.limit_concurrency + _SPARE_FDS)
        # Warnings any client can trigger at will, one line per request otherwise.
        for message in ("Exceeded concurrency limit.", "Invalid HTTP request received."):
            logging.getLogger("uvicorn.error").addFilter(OncePerInterval(message, _REPEATED_WARNING_S))
        access_log = not config.observability.disable_uvicorn_access_log
        server_config = uvicorn.Config(
            app,
            host=config.http.host,
            port=config.http.port,
            log_level="warning",
            access_log=access_log,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
            limit_concurrency=config.http.limit_concurrency,
            timeout_keep_alive=config.http.keep_alive_timeout_s,
            http=guarded_h11_protocol(config.http.header_timeout_s, config.http.body_timeout_s),
        )
        if access_log:  # uvicorn's own start-up chatter stays at "warning"; its access lines show
            logging.getLogger("uvicorn.access").setLevel(logging.INFO)
        self.server = _Server(server_config)

    def run(self, stop: StopFlag, status_conn: Connection) -> int:
        """Serve until ``stop`` is set; returns the exit status (1 if the reader thread dies or the server stops on its
        own).

        Raises:
            StartupError: the HTTP server did not start.
        """
        return asyncio.run(self._serve(stop, status_conn))

    def close(self) -> None:
        """Close the client, the tokenizer threads and the socket; write the trace."""
        self._cleanup.close()

    async def _serve(self, stop: StopFlag, status_conn: Connection) -> int:
        server, client = self.server, self.client
        # asyncio.to_thread's pool: it parses bodies and plans tools, Python that holds the GIL, and each
        # thread of it competes with the event loop for it (docs/design.md, "Large bodies").
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(_PREPARE_THREADS, "prepare", start_background_thread, ("prepare",))
        )
        serving = asyncio.create_task(_run_server(server, self.sock))
        while not server.started:
            if serving.done():
                raise StartupError("the HTTP server failed to start (see the log above)")
            if stop.is_set():
                server.should_exit = True
                await serving
                return 0
            await asyncio.sleep(0.01)
        logger.info("serving the OpenAI API on http://%s:%d", self.config.http.host, self.config.http.port)
        freeze_startup_heap()
        report(status_conn, "ready", _NAME)
        interval = self.config.observability.log_stats_interval_s
        stats_lines = asyncio.create_task(StatsLogger(client, interval, STATS_TIMEOUT_S).run()) if interval else None
        code = 0
        burst, heap, turn = BurstWatch(), HeapWatch(), 0
        activity, watch_heap_until = None, 0.0
        while not serving.done() and not stop.is_set():
            turn += 1
            now_activity = (client.num_live, server.server_state.total_requests)
            if now_activity != activity or client.num_live:
                activity, watch_heap_until = now_activity, time.monotonic() + _HEAP_WATCH_AFTER_S
            if not client.is_healthy():
                logger.error("the output reader thread died (%r); exiting", client.reader_error)
                code = 1
                break
            if self.heartbeats is not None:
                # As old as the reader thread's last turn: a stuck thread or a stuck loop both stop the beat.
                self.heartbeats.beat(_NAME, client.reader_turn)
            if burst.passed(client.num_live):
                await asyncio.to_thread(_release_memory)
            elif turn % _HEAP_EVERY_TURNS == 0 and time.monotonic() < watch_heap_until and heap.passed(heap_in_use()):
                # Large bodies, refused or not, freed their heap; no collection (it would hold the GIL).
                await asyncio.to_thread(trim_heap)
            await asyncio.sleep(_WATCH_INTERVAL_S)
        if serving.done() and not stop.is_set():
            logger.error("the HTTP server stopped on its own; exiting")
            code = 1
        if stats_lines is not None:
            stats_lines.cancel()
        client.abort_all()
        server.should_exit = True
        await serving
        return code


def run_io_proc(config: EngineConfig, status_conn: Connection, stop: StopFlag) -> int:
    """Process body of io_proc: attach the output rings, report, run an ``IoProc`` until ``stop``; returns the exit
    status."""
    # Before any thread starts: the threads that parse, render and tokenize large bodies share two malloc
    # arenas, whose free pages the trim after a burst gives back (docs/design.md, "Memory after a burst").
    limit_arenas(2)
    rings: list[ShmRing[StepOutput]] = []
    for engine in config.engines():
        try:
            rings.append(engine.output_ring())
        except Exception as e:
            report(
                status_conn,
                "error",
                _NAME,
                f"cannot attach the output ring {engine.output_ring_name!r} ({e}); "
                "it must be created by the launcher before io_proc starts",
            )
            for ring in rings:
                ring.close()
            return 1
    heartbeats = config.heartbeats()
    report(status_conn, "attached", _NAME)
    try:
        proc = IoProc(config, rings, heartbeats)
        try:
            code = proc.run(stop, status_conn)
        finally:
            proc.close()
    except StartupError as e:
        logger.error("%s", e)
        report(status_conn, "error", _NAME, str(e))
        code = 1
    except Exception as e:
        logger.exception("io_proc failed")
        report(status_conn, "error", _NAME, f"io_proc failed: {type(e).__name__}: {e} (see its log)")
        code = 1
    finally:
        for ring in rings:
            ring.close()
        heartbeats.close()
    return code


def _release_memory() -> None:
    """After a burst of requests: collect what is left in reference cycles, then give the free heap back."""
    gc.collect()
    trim_heap()


def _raise_fd_limit(wanted: int) -> None:
    """Raise this process's soft limit on open files towards ``wanted`` (up to the hard limit), so ``limit_concurrency``
    connections fit; many systems start at 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            logger.warning(
                "open files are limited to %d (hard limit): fewer connections than --limit-concurrency can be accepted",
                new,
            )


def _bind(host: str, port: int) -> socket.socket:
    """Bind the HTTP port now, so a port in use is a clear start-up error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose protocol says TCP, and
    # without it a response's headers and body meet the client's delayed ACK (~40 ms a kept-alive request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(
            f"cannot listen on {host}:{port} ({e.strerror}); another server may be using "
            f"the port: stop it or choose another one with --port"
        ) from e
    return sock


async def _run_server(server: _Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit:
        # uvicorn calls sys.exit() when its start-up fails; it logged why.
        pass
