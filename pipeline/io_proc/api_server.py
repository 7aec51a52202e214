"""The FastAPI application: routes and the mapping of every error to an OpenAI error body.

Routes: README.md, "API". With an API key configured, every route but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>`` (401 otherwise, as the OpenAI API and vLLM's ``--api-key`` answer).

Errors: invalid input of any kind (bad JSON, a body that is not JSON, wrong
types, out-of-range values) is HTTP 400 ``invalid_request_error`` (FastAPI's
422 is replaced, as the OpenAI API and vLLM answer 400); an unknown model is
404 ``model_not_found``; a body over ``max_request_body_bytes`` is 413 (see
``pipeline.io_proc.http_limits``); unknown routes and methods keep their
status; anything unexpected is 500 and affects only its own request, whose
connection stays open for the next (``InternalErrors``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.common.config import EngineConfig
from pipeline.common.heartbeat import Heartbeats
from pipeline.common.messages import Stats
from pipeline.io_proc.engine_client import EngineClient
from pipeline.io_proc.http_limits import RequestBodyLimit
from pipeline.io_proc.json_limits import too_deep_message
from pipeline.io_proc.lora_adapters import LoraAdapters
from pipeline.io_proc.metrics import PipelineMetrics
from pipeline.io_proc.openai.protocol import APIError, ErrorInfo, ErrorResponse, ModelCard, ModelList
from pipeline.io_proc.openai.protocol_chat import ChatCompletionRequest
from pipeline.io_proc.openai.protocol_completion import CompletionRequest
from pipeline.io_proc.openai.protocol_tokenization import DetokenizeRequest, TokenizeRequest
from pipeline.io_proc.openai.response_store import ResponseStore
from pipeline.io_proc.openai.responses import ResponsesServing
from pipeline.io_proc.openai.responses_input import ResponsesRequest
from pipeline.io_proc.openai.serving import json_response
from pipeline.io_proc.openai.serving_chat import OpenAIServingChat
from pipeline.io_proc.openai.serving_completion import OpenAIServingCompletion
from pipeline.io_proc.openai.serving_tokenization import OpenAIServingTokenization
from pipeline.io_proc.server_info import engine_loads, model_info, server_info
from pipeline.io_proc.serving_lora import LoadLoRAAdapterRequest, LoraServing, UnloadLoRAAdapterRequest
from pipeline.io_proc.tokenization import Tokenization

logger = logging.getLogger(__name__)

# How long /metrics and /get_load wait for the schedulers' Stats replies.
STATS_TIMEOUT_S = 5.0

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    503: "service_unavailable_error",
}


def _error(status_code: int, message: str, type: str, param: str | None = None, code: str | None = None) -> Response:
    return json_response(
        ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)), status_code
    )


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";", 1)[0].strip().lower()
    return media_type == "application/json" or (media_type.startswith("application/") and media_type.endswith("+json"))


def _errors_message(errors: list) -> tuple[str, str | None]:
    """A readable message and the offending parameter of pydantic's errors (at least one)."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    text = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        text += f" (and {len(errors) - 1} more error{'s' if len(errors) > 2 else ''})"
    return text, param


M = TypeVar("M", bound=BaseModel)
# Bodies up to this size are parsed on the event loop; larger ones on a thread.
_INLINE_BODY_BYTES = 64 * 1024


async def _body(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``, parsed and validated, a large one on a thread: megabytes of
    tools take tens of milliseconds, which the event loop must not spend (``/health`` and the streams
    wait on it).

    Raises:
        APIError: 400 for a body that is not JSON, nests past ``json``'s limit, or is not a valid ``model``.
    """
    body, content_type = await request.body(), request.headers.get("content-type")
    if len(body) <= _INLINE_BODY_BYTES:  # microseconds: not worth a thread, nor a wait behind large ones
        return _parse_body(body, content_type, model)
    return await asyncio.to_thread(_parse_body, body, content_type, model)


def _parse_body(body: bytes, content_type: str | None, model: type[M]) -> M:
    if not _is_json(content_type):
        got = f"Content-Type {content_type!r}" if content_type else "no Content-Type"
        raise APIError.bad_request(
            f"the request body must be JSON sent with Content-Type: application/json (got {got})"
        )
    try:
        value = json.loads(body)
    except RecursionError:
        raise APIError.bad_request(too_deep_message("the request body")) from None
    except json.JSONDecodeError as e:
        raise APIError.bad_request(f"the request body is not valid JSON: {e.msg}") from None
    except ValueError as e:  # not UTF-8
        raise APIError.bad_request(f"the request body is not valid JSON: {e}") from None
    try:
        return model.model_validate(value)
    except ValidationError as e:
        raise APIError.bad_request(*_errors_message(e.errors())) from None


# Routes that answer without an API key: probes and scrapers carry none.
_OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyAuth:
    """ASGI middleware: HTTP requests outside ``_OPEN_PATHS`` must carry ``Authorization: Bearer <api_key>``.

    Otherwise they get 401 with an OpenAI error object
    (``invalid_request_error``, code ``invalid_api_key``) before the body is
    read. The key is compared in constant time.

    Args:
        app: the ASGI app.
        api_key: the key clients must send (non-empty).
    """

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self._expected):
                response = _error(
                    401,
                    "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class InternalErrors:
    """ASGI middleware: an exception the app did not turn into a response becomes a logged 500 with an
    OpenAI error object (``internal_server_error``), and goes no further.

    Starlette's own handler for ``Exception`` answers the 500 and then re-raises, and uvicorn closes
    the connection of a request that raised after its response started: the client's next request
    on that kept-alive connection was reset. A stream that fails after its headers still ends that way
    (nothing else can tell the client its body is incomplete); the streams catch their own errors.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise
            logger.exception("%s %s failed", scope["method"], scope["path"])
            response = _error(500, f"internal server error: {type(exc).__name__}", "internal_server_error")
            await response(scope, receive, send)


def build_app(
    config: EngineConfig,
    client: EngineClient,
    tokenization: Tokenization,
    stop_token_ids: tuple[int, ...],
    heartbeats: Heartbeats | None = None,
) -> FastAPI:
    """The OpenAI-compatible app.

    Its lifespan starts the client (reader thread, reply receiver) and stops
    it; closing the client and the ring is the caller's job.

    Args:
        config: server configuration.
        client: engine client, not started yet.
        tokenization: prompt encoding.
        stop_token_ids: token ids that end generation.
        heartbeats: the engines' heartbeats; ``/health`` answers 503 until
            every engine has beaten once, and ``/health`` and ``/metrics``
            while one is older than ``config.observability.step_timeout_s``.
    """
    adapters = LoraAdapters(config)
    chat = OpenAIServingChat(config, client, tokenization, stop_token_ids, adapters)
    completion = OpenAIServingCompletion(config, client, tokenization, stop_token_ids, adapters)
    tokenizer = OpenAIServingTokenization(config, client, tokenization, stop_token_ids, adapters)
    store = ResponseStore(
        config.http.responses_store_max_entries,
        config.http.responses_store_max_bytes,
        config.http.responses_store_max_age_s,
    )
    responses = ResponsesServing(chat, store)
    engine_roles = [r for r in heartbeats.roles if r != "io_proc"] if heartbeats is not None else []

    def starting() -> str | None:
        """Which engine processes cannot serve yet: each beats first once it can (a worker after its
        model, kernels and warm-up step; docs/design.md, "Readiness")."""
        waiting = [r for r in engine_roles if heartbeats.age(r) is None]
        if not waiting:
            return None
        return f"the server is starting: {', '.join(waiting)} not ready yet (loading the model, compiling kernels)"

    def hung() -> str | None:
        """What is wrong when an engine process has shown no progress within the step timeout."""
        timeout = config.observability.step_timeout_s
        if heartbeats is None or not timeout:
            return None
        stale = heartbeats.stale(timeout, engine_roles)
        if not stale:
            return None
        role, age = max(stale, key=lambda s: s[1])
        return f"{role} has shown no progress for {age:.1f} s (--step-timeout {timeout:g}): it is hung"

    lora_info = (config.lora.max_loras, adapters.names) if config.lora is not None else None
    metrics = PipelineMetrics(
        client, config.served_model_name, config.max_model_len, config.observability.metrics_compat, lora_info
    )
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            await client.stop()

    app = FastAPI(title="pipeline", lifespan=lifespan)
    # Innermost: what escapes the routes' exception handlers is answered here, below the body limit.
    app.add_middleware(InternalErrors)
    app.add_middleware(RequestBodyLimit, max_bytes=config.http.max_request_body_bytes)
    if config.http.api_key:
        # Added last, so it runs first: an unauthenticated body is never read.
        app.add_middleware(ApiKeyAuth, api_key=config.http.api_key)

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, exc: APIError) -> Response:
        return _error(exc.status_code, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> Response:
        message, param = _errors_message(exc.errors()) if exc.errors() else ("invalid request", None)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return _error(exc.status_code, str(exc.detail), _ERROR_TYPES.get(exc.status_code, "api_error"))

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        return await chat.chat(await _body(raw_request, ChatCompletionRequest), raw_request)

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        return await completion.completion(await _body(raw_request, CompletionRequest), raw_request)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        return await responses.create(await _body(raw_request, ResponsesRequest), raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> Response:
        return responses.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> Response:
        return responses.delete(response_id)

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> Response:
        return await tokenizer.tokenize(await _body(raw_request, TokenizeRequest))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> Response:
        return await tokenizer.detokenize(await _body(raw_request, DetokenizeRequest))

    @app.get("/v1/models")
    async def show_models() -> Response:
        return json_response(
            ModelList(
                data=[
                    ModelCard(
                        id=config.served_model_name,
                        created=created,
                        root=config.model,
                        max_model_len=config.max_model_len,
                    ),
                    *(
                        ModelCard(
                            id=name,
                            created=created,
                            root=path,
                            parent=config.served_model_name,
                            max_model_len=config.max_model_len,
                        )
                        for name, (_, path) in adapters.by_name.items()
                    ),
                ]
            )
        )

    # SGLang's names, read by its model gateway when it registers this server and, for its power_of_two
    # policy, every few seconds (docs/design.md, "Behind a router").
    @app.get("/server_info")
    async def show_server_info() -> Response:
        return Response(json.dumps(server_info(config)).encode(), media_type="application/json")

    @app.get("/model_info")
    async def show_model_info() -> Response:
        return Response(json.dumps(model_info(config)).encode(), media_type="application/json")

    if config.lora is not None and config.lora.allow_runtime_updating:
        loras = LoraServing(config, adapters)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw_request: Request) -> Response:
            body = await _body(raw_request, LoadLoRAAdapterRequest)
            return Response(await loras.load(body), media_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw_request: Request) -> Response:
            return Response(loras.unload(await _body(raw_request, UnloadLoRAAdapterRequest)), media_type="text/plain")

    @app.get("/health")
    async def health() -> Response:
        if not client.is_healthy():
            return _error(503, "the output reader thread is not running", "service_unavailable_error")
        if why := starting() or hung():
            return _error(503, why, "service_unavailable_error")
        return Response(b"{}", media_type="application/json")

    async def engine_stats(what: str) -> list[Stats]:
        """Every engine's ``Stats``; raises a 503 ``APIError`` saying why there are no ``what``."""
        if why := "the server is shutting down" if client.shutting_down else hung():
            raise APIError(503, f"no {what}: {why}", "service_unavailable_error")
        try:
            return await client.get_engine_stats(STATS_TIMEOUT_S)
        except TimeoutError:
            raise APIError(
                503,
                f"the scheduler did not answer a stats request within {STATS_TIMEOUT_S:g} s",
                "service_unavailable_error",
            ) from None
        except Exception as e:  # EngineUnavailable: its queue is full, or the server is stopping
            raise APIError(503, f"no {what}: {e}", "service_unavailable_error") from None

    @app.get("/metrics")
    async def show_metrics() -> Response:
        return Response(metrics.render(await engine_stats("metrics")), media_type=metrics.content_type)

    @app.get("/get_load")
    async def show_load() -> Response:
        loads = engine_loads(await engine_stats("load"), config.scheduler.block_size)
        return Response(json.dumps(loads).encode(), media_type="application/json")

    return app
