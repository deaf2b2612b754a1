"""The HTTP server: one FastAPI app serving the OpenAI and the Anthropic API.

Agent middleware written for either vendor must work by changing only the base
URL, so everything a client can observe follows the vendor's documented
shapes: the routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`
from OpenAI's API reference; `/v1/messages`, `/v1/messages/count_tokens` from
Anthropic's), the auth headers (`Authorization: Bearer KEY` for OpenAI,
`x-api-key: KEY` for Anthropic; either is accepted on every route), and --
what SDKs branch on -- the error bodies and status codes. Every error, also
FastAPI's own (request validation 422 -> 400, unknown route 404, wrong method
405) and the ones raised before routing (401, 413), is reshaped by the path it
belongs to: `/v1/messages*` in Anthropic's `{"type": "error", "error": {...}}`,
everything else in OpenAI's `{"error": {"message", "type", "param", "code"}}`
(serving/errors.py). The routes receive one typed `ServerContext`
(serving/context.py: engine, renderer, limits, keys, model name).

`/health` is open (load balancers probe it without credentials); every other
route needs the key when `config.serving.api_key` is set. The body limit
(`config.serving.max_body_bytes`) is enforced before any parsing: from
Content-Length when one is sent, else while reading, so a client that streams
an oversized chunked body is cut off at the limit, not after (413 in the
API's error shape).

Ready means warm: `/health` answers 503 `{"status": "warming", "reason"}`
until the engine's jitted programs are compiled (serving/warmup.py, started by
`create_app` when `config.serving.warmup`), then 200. The other routes serve
meanwhile; generation requests queue in the engine behind the warm-up.

Beyond JSON parsing (milliseconds, bounded by the body limit), nothing that
costs time in proportion to the request runs on the event loop: rendering
(tokenization) and image decoding run in worker threads, and a prompt whose
length alone proves it cannot fit the context is refused before it is
tokenized (serving/prepare.py), so one huge request cannot stall the streams
of the others (tests/test_server_limits.py).
"""

from __future__ import annotations

import hmac
import logging
import socket
import threading
import time
from typing import Any

import fastapi
import uvicorn
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving import anthropic_api, openai_api
from serving.context import Context, ServerContext
from serving.errors import (
  ENGINE_ERRORS,
  APIError,
  engine_error,
  error_response,
  is_anthropic_path,
  validation_message,
)
from serving.warmup import Warmup

_log = logging.getLogger(__name__)


def _validation_response(request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
  path = request.url.path
  message, param = validation_message(exc.errors(), anthropic=is_anthropic_path(path))
  return error_response(path, 400, message, param=param)


def _install_error_handlers(app: fastapi.FastAPI) -> None:
  async def on_api_error(request: fastapi.Request, exc: APIError) -> JSONResponse:
    return error_response(request.url.path, exc.status, exc.message, param=exc.param, code=exc.code,
                          type_=exc.type)

  async def on_validation(request: fastapi.Request, exc: RequestValidationError) -> JSONResponse:
    return _validation_response(request, exc)

  async def on_http(request: fastapi.Request, exc: StarletteHTTPException) -> JSONResponse:
    path = request.url.path
    if exc.status_code == 404:
      message = f"Invalid URL ({request.method} {path}): no such route."
    elif exc.status_code == 405:
      message = f"Method {request.method} is not allowed on {path}."
    else:
      message = str(exc.detail)
    return error_response(path, exc.status_code, message, headers=getattr(exc, "headers", None))

  async def on_engine_error(request: fastapi.Request, exc: Exception) -> JSONResponse:
    return await on_api_error(request, engine_error(exc))

  async def on_unhandled(request: fastapi.Request, exc: Exception) -> JSONResponse:
    _log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request.url.path, 500, f"Internal server error ({type(exc).__name__}).")

  app.add_exception_handler(APIError, on_api_error)
  app.add_exception_handler(RequestValidationError, on_validation)
  app.add_exception_handler(StarletteHTTPException, on_http)
  for exc_type in ENGINE_ERRORS:
    app.add_exception_handler(exc_type, on_engine_error)
  app.add_exception_handler(Exception, on_unhandled)


class _Guard:
  """Pure ASGI middleware: API-key check and body-size limit, before any routing.

  Pure ASGI (not BaseHTTPMiddleware) so streaming responses and the
  disconnect message reach the app untouched. The body is read here up to the
  limit and replayed to the app; later `receive()` calls go to the client
  (the streaming routes listen on them for a disconnect).
  """

  def __init__(self, app, *, api_key: str, max_body_bytes: int):
    self.app = app
    self.api_key = api_key.encode() if api_key else b""
    self.max_body_bytes = max_body_bytes

  def _authorized(self, headers: dict[bytes, bytes]) -> bool:
    given = headers.get(b"x-api-key", b"")
    auth = headers.get(b"authorization", b"")
    if auth[:7].lower() == b"bearer ":
      given = given or auth[7:].strip()
    return bool(given) and hmac.compare_digest(given, self.api_key)

  async def _send_error(self, send, path: str, status: int, message: str, **kw) -> None:
    resp = error_response(path, status, message, **kw)
    await send({"type": "http.response.start", "status": resp.status_code, "headers": resp.raw_headers})
    await send({"type": "http.response.body", "body": resp.body})

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    path = scope["path"]
    headers = dict(scope.get("headers", ()))
    if self.api_key and path != "/health" and not self._authorized(headers):
      missing = not (headers.get(b"x-api-key") or headers.get(b"authorization"))
      msg = ("No API key provided: send `Authorization: Bearer KEY` or `x-api-key: KEY`." if missing
             else "Incorrect API key provided.")
      return await self._send_error(send, path, 401, msg)
    limit = self.max_body_bytes
    too_big = (f"Request body exceeds the server's limit of {limit} bytes "
               "(config.serving.max_body_bytes).")
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
      return await self._send_error(send, path, 413, too_big)
    if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
      return await self.app(scope, receive, send)
    chunks, size = [], 0
    while True:
      message = await receive()
      if message["type"] == "http.disconnect":
        return None
      body = message.get("body", b"")
      size += len(body)
      if size > limit:
        return await self._send_error(send, path, 413, too_big)
      chunks.append(body)
      if not message.get("more_body", False):
        break
    replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay_receive():
      return replay.pop() if replay else await receive()

    return await self.app(scope, replay_receive, send)


def _model_card(ctx: ServerContext) -> dict[str, Any]:
  """One model in a shape both SDKs parse: OpenAI's `Model` and Anthropic's `ModelInfo`."""
  created = int(ctx.created)
  return {
      "id": ctx.model_name, "object": "model", "created": created, "owned_by": "horizon",
      "type": "model", "display_name": ctx.model_name,
      "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
      "lifecycle": "active", "max_input_tokens": ctx.limits.max_context,
      "max_tokens": ctx.limits.max_context,
  }


def _add_operational_routes(app: fastapi.FastAPI) -> None:
  @app.api_route("/health", methods=["GET", "HEAD"])  # probes that send HEAD got 405
  async def health(request: fastapi.Request) -> JSONResponse:
    """200 once the engine runs and its programs are compiled; 503 with the reason before."""
    status, body = request.app.state.warmup.health()
    return JSONResponse(body, status_code=status, headers=None if status == 200 else {"Retry-After": "5"})

  @app.get("/metrics")
  async def metrics(request: fastapi.Request, ctx: Context) -> Response:
    """Prometheus exposition (serving/metrics.py), in the format the scraper's Accept asks for."""
    body, content_type = ctx.metrics.exposition(request.headers.get("accept"))
    return Response(body, headers={"Content-Type": content_type})

  @app.get("/v1/models")
  async def list_models(ctx: Context) -> dict[str, Any]:
    card = _model_card(ctx)
    return {"object": "list", "data": [card], "has_more": False, "first_id": card["id"],
            "last_id": card["id"]}

  @app.get("/v1/models/{model_id:path}")
  async def get_model(model_id: str, ctx: Context) -> dict[str, Any]:
    if model_id != ctx.model_name:
      raise APIError(404, f"The model '{model_id}' does not exist; this server serves "
                     f"'{ctx.model_name}'.", param="model", code="model_not_found")
    return _model_card(ctx)


def create_app(engine, tokenizer, config) -> fastapi.FastAPI:
  """The server app over a started `serving.engine.Engine`.

  Args:
    engine: the engine (the caller starts and stops it).
    tokenizer: the engine's tokenizer.
    config: the full serving ConfigDict (`.serving` and `.model`), configs/serve.py.

  Returns:
    A FastAPI app; its routes receive the `ServerContext` built here
    (serving/context.py), kept as `app.state.context`. The warm-up
    (serving/warmup.py) starts here, in a background thread, kept as
    `app.state.warmup`; `/health` is 200 once it is done.
  """
  ctx = ServerContext.build(engine, tokenizer, config)
  app = fastapi.FastAPI(title="Horizon", docs_url=None, redoc_url=None, openapi_url=None)
  app.state.context = ctx
  app.state.warmup = Warmup(ctx, enabled=bool(config.serving.get("warmup", True))).start()
  _install_error_handlers(app)
  _add_operational_routes(app)
  app.include_router(openai_api.router)
  app.include_router(anthropic_api.router)
  app.add_middleware(_Guard, api_key=ctx.api_key, max_body_bytes=ctx.limits.max_body_bytes)
  return app


class BackgroundServer:
  """uvicorn serving `app` from a daemon thread (tests, benchmarks, notebooks).

  Args:
    app: the ASGI app (create_app).
    host: interface to bind.
    port: TCP port; 0 picks a free one.
    log_level: uvicorn's log level.
  """

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    if port == 0:
      with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    self.url = f"http://{host}:{port}"
    self.app = app
    self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                 lifespan="off"))
    self._thread = threading.Thread(target=self._server.run, name="horizon-server", daemon=True)

  def start(self, timeout: float = 60.0) -> "BackgroundServer":
    """Starts the thread; returns once the server accepts connections."""
    self._thread.start()
    deadline = time.monotonic() + timeout
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError(f"the server at {self.url} did not start within {timeout} s (port taken?).")
      time.sleep(0.02)
    return self

  def wait_ready(self, timeout: float = 600.0) -> "BackgroundServer":
    """Returns once the app's warm-up is done (/health is 200); raises if it failed or timed out."""
    warmup = getattr(self.app.state, "warmup", None)
    if warmup is None:
      return self
    if not warmup.wait(timeout):
      raise RuntimeError(f"the server at {self.url} did not warm up within {timeout} s.")
    if not warmup.ready:
      raise RuntimeError(f"the server at {self.url} failed to warm up: {warmup.error}")
    return self

  def stop(self, timeout: float = 10.0) -> None:
    """Asks uvicorn to exit and joins its thread."""
    self._server.should_exit = True
    self._thread.join(timeout=timeout)
