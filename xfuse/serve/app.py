"""The HTTP side of ``xfuse serve`` (FastAPI, run by uvicorn in a background thread of rank 0).

It validates, queues and waits; it never touches ``torch.distributed`` (rank 0's main thread runs the requests).

Routes: ``POST /v1/images/generations`` and ``GET /v1/models`` (OpenAI's Images API), ``GET /health`` (readiness),
``GET /live`` (liveness), ``GET /metrics`` (Prometheus), ``GET /`` (a page to try it). With an API key every route
except ``/health``, ``/live`` and the page (static, it holds no data; its form sends the key it is given) needs
``Authorization: Bearer KEY``.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import hmac
import io
import time
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from xfuse.serve.protocol import RequestError, error_body, parse_request
from xfuse.serve.service import BROKEN, Service

PUBLIC_PATHS = frozenset({"/health", "/live", "/"})


def _error_response(err: RequestError) -> JSONResponse:
    headers = {}
    retry = getattr(err, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    body = error_body(err.message, error_type=err.error_type, param=err.param, code=err.code)
    return JSONResponse(body, status_code=err.status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) more than ``limit`` bytes, whether or not a Content-Length says so."""
    too_large = RequestError(
        f"the request body must be at most {limit} bytes", param=None, status=413, code="request_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


async def _client_hung_up(request: Request) -> None:
    """Returns once the client has closed its connection. The body is read by now, so the next ASGI message is the
    server's ``http.disconnect``, which uvicorn sends as soon as it sees the socket close (no polling delay)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _wait_or_hang_up(request: Request, future: concurrent.futures.Future, service: Service):
    """The request's result; ``None`` if its client hung up first: waiting in the queue, it is cancelled (the
    engine loop skips it); generating, every rank stops it before its next step (``Service.abandon``)."""
    waiting = asyncio.wrap_future(future)
    hang_up = asyncio.ensure_future(_client_hung_up(request))
    try:
        await asyncio.wait({waiting, hang_up}, return_when=asyncio.FIRST_COMPLETED)
        if not waiting.done():
            if not future.cancel():  # cancel() fails once the loop has taken it
                service.abandon(future)
            return None
        return await waiting
    finally:
        hang_up.cancel()


def _png_b64(images) -> list[str]:
    out = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def page_html(*, model_name: str, width: int, height: int) -> str:
    """The page at ``/`` with the served model's name and default size filled in."""
    text = resources.files("xfuse.serve").joinpath("page.html").read_text(encoding="utf-8")
    for key, value in (("MODEL", model_name), ("WIDTH", width), ("HEIGHT", height)):
        text = text.replace(f"__{key}__", str(value))
    return text


def create_app(service: Service, *, api_key: str | None, max_body_bytes: int) -> FastAPI:
    """The FastAPI app of one service. ``api_key``: required as a bearer token on non-public routes."""
    app = FastAPI(title="xfuse", docs_url=None, redoc_url=None)  # no pages that load assets from elsewhere
    app.state.inflight = 0  # requests being answered: rank 0 lets them finish before it exits
    app.state.started = int(time.time())

    app.add_middleware(_Gate, state=app.state, expected=f"Bearer {api_key}".encode() if api_key else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # 404, 405 in OpenAI's envelope
        body = error_body(str(exc.detail), error_type="invalid_request_error", code=str(exc.status_code))
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        limits = service.limits
        if limits is None:
            return HTMLResponse("<p>xfuse is starting; reload in a few seconds.</p>", status_code=503)
        return page_html(model_name=limits.model_name, width=limits.default_width, height=limits.default_height)

    @app.get("/health")
    async def health():
        code, body = service.health()
        return JSONResponse(body, status_code=code)

    @app.get("/live")
    async def live():
        broken = service.state == BROKEN
        body = {"status": "dead" if broken else "alive", "state": service.state}
        return JSONResponse(body, status_code=503 if broken else 200)

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        limits = service.limits
        data = []
        if limits is not None:  # the model, then its LoRA adapters as models of their own (vLLM's cards)
            data = [_model_card(limits.model_name, app.state.started)]
            data += [_model_card(a, app.state.started, parent=limits.model_name) for a in limits.adapters]
        return {"object": "list", "data": data}

    @app.post("/v1/images/generations")
    async def generate(request: Request):
        status = 500
        try:
            body = await _read_body(request, max_body_bytes)
            service.check_accepting()  # 503 that says why (starting, draining, broken) before any parsing
            job = parse_request(body, service.limits)
            future = service.submit(job)
            result = await _wait_or_hang_up(request, future, service)
            if result is None:  # the client hung up: its request never ran, or stopped between steps
                status = 499  # nginx's "client closed request", for the metrics
                return Response(status_code=499)
            encoded = await asyncio.to_thread(_png_b64, result.images)  # off the event loop: PNG is CPU work
            service.metrics.images.inc(len(encoded))
            status = 200
            return {
                "created": int(time.time()),
                "data": [{"b64_json": data} for data in encoded],
                "seed": result.seed,
                "batch": result.batch,  # the requests generated in one pipeline call with this one (serve.max_batch)
                "stream": result.stream,  # the pipeline calls streamed with its own (serve.max_inflight)
                "timings": {"queue_s": round(result.queue_wait_s, 4), "generation_s": round(result.generation_s, 4)},
            }
        except RequestError as err:
            status = err.status
            return _error_response(err)
        except Exception as err:  # noqa: BLE001 - answered 500 in the envelope, never a dropped connection
            return _error_response(
                RequestError(f"internal error: {type(err).__name__}: {err}", param=None, status=500, code="internal")
            )
        finally:
            service.metrics.requests.labels(str(status)).inc()

    return app


class _Gate:
    """Pure ASGI middleware (it leaves ``receive`` alone, so a handler can still see its client hang up): counts the
    requests being answered and, with an API key, refuses non-public routes without it (401, constant-time)."""

    def __init__(self, app, *, state, expected: bytes | None):
        self.app, self.state, self.expected = app, state, expected

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.state.inflight += 1
        try:
            if self.expected is not None and scope["path"] not in PUBLIC_PATHS:
                given = dict(scope["headers"]).get(b"authorization", b"")
                if not hmac.compare_digest(given, self.expected):
                    body = error_body(
                        "missing or wrong API key: send 'Authorization: Bearer KEY'",
                        error_type="invalid_request_error",
                        code="invalid_api_key",
                    )
                    response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
                    return await response(scope, receive, send)
            return await self.app(scope, receive, send)
        finally:
            self.state.inflight -= 1


def _model_card(name: str, created: int, parent: str | None = None) -> dict:
    card = {"id": name, "object": "model", "created": created, "owned_by": "xfuse"}
    return card if parent is None else {**card, "parent": parent}
