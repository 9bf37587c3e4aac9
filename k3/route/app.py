"""The router's OpenAI-compatible app (`k3 route`): one front for several `k3 serve` instances (report §5.4.3,
fleet-level scheduling), which it talks to over HTTP only.

A request to POST /v1/completions or /v1/chat/completions is
1. checked (k3.route.requests): a malformed body gets an OpenAI-shaped 4xx here and never reaches a backend;
2. admitted by its class's budget of in-flight prompt tokens (k3.route.budget), or queued, or refused with 429;
3. sent to its session's instance, with failover to the session's secondary (k3.route.fleet, k3.route.proxy).

GET /v1/models is answered by the first healthy backend; GET /health is 200 while at least one backend is up (503
when none is), with each backend's state; GET /metrics is the router's Prometheus text (k3.route.metrics). The
guards of `k3 serve` stand at the edge here too: body size and type (413, 415), the API key when one is set.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from k3.route.budget import DEFAULT_CLASSES, Admission, Rejected, parse_classes
from k3.route.defaults import DEFAULT_TOKENS_PER_BACKEND
from k3.route.fleet import Fleet
from k3.route.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from k3.route.metrics import Histogram, render
from k3.route.proxy import ClientGone, Proxy, _Relay, until_disconnect
from k3.route.requests import KeyOptions, parse_request
from k3.route.ring import DEFAULT_VNODES
from k3.serve.guard import DEFAULT_MAX_REQUEST_BYTES, APIKeyMiddleware, BodyGuardMiddleware, add_error_handlers
from k3.serve.protocol import error_response

logger = logging.getLogger("k3.route")

CONNECT_TIMEOUT_S = 5.0


@dataclass
class RouterConfig:
    backends: list[str]
    policy: str = "affinity"
    vnodes: int = DEFAULT_VNODES
    keys: KeyOptions = field(default_factory=KeyOptions)
    classes: list[str] = field(default_factory=lambda: list(DEFAULT_CLASSES))
    fleet_tokens: int | None = None  # None: DEFAULT_TOKENS_PER_BACKEND x the number of backends
    queue_wait_s: float = 30.0
    max_queued: int = 256  # per class
    health_interval_s: float = 1.0
    read_timeout_s: float = 600.0  # the longest a backend may stay silent inside an answer
    api_key: str | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class _Router:
    """The state behind the endpoints of one app."""

    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.fleet = Fleet(cfg.backends, cfg.policy, cfg.vnodes, cfg.health_interval_s)
        tokens = cfg.fleet_tokens or DEFAULT_TOKENS_PER_BACKEND * len(cfg.backends)
        self.admission = Admission(parse_classes(cfg.classes), tokens, cfg.queue_wait_s, cfg.max_queued)
        self.first_output = {c.name: Histogram() for c in self.admission.classes}
        self.client: httpx.AsyncClient | None = None
        self.proxy: Proxy | None = None
        self.http_errors = 0

    def count_error(self) -> None:
        self.http_errors += 1

    async def start(self) -> None:
        self.client = httpx.AsyncClient(
            trust_env=False,  # the backends are reached directly, never through a proxy of the environment
            timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=self.cfg.read_timeout_s, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.proxy = Proxy(self.fleet, self.client)
        await self.fleet.check_all(self.client)

    async def route(self, request: Request, path: str, chat: bool) -> Response:
        t0 = time.monotonic()
        routed = parse_request(await request.body(), chat, request.headers, self.cfg.keys)
        try:
            ticket = await until_disconnect(request, self.admission.admit(routed.prompt_tokens))
        except Rejected as e:
            self.http_errors += 1
            return error_response(429, e.message, "requests", None, "rate_limit_exceeded",
                                  headers={"Retry-After": str(e.retry_after)})
        except ClientGone:
            return Response(status_code=499)
        ended = False

        def done(first: float | None) -> None:
            nonlocal ended
            if ended:
                return
            ended = True
            ticket.release()
            if first is not None:
                self.first_output[ticket.class_name].observe(first - t0)

        resp = None
        try:
            resp = await until_disconnect(request, self.proxy.forward(request, path, routed, done))
        except ClientGone:
            return Response(status_code=499)
        finally:
            if not isinstance(resp, _Relay):  # a stream calls done when it closes
                done(None)
        if resp.status_code >= 400:
            self.http_errors += 1
        return resp

    async def models(self, path: str, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        for b in (b for b in self.fleet.backends.values() if b.healthy):
            try:
                r = await self.client.get(f"{b.url}{path}", headers=headers)
            except httpx.TransportError:
                await self.fleet.check(self.client, b)
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return error_response(503, "no backend is healthy; retry later", "server_error", code="no_healthy_backend",
                              headers={"Retry-After": "1"})


def create_app(cfg: RouterConfig) -> FastAPI:
    """The router over `cfg.backends`. Its HTTP client and health poller start with the app (lifespan): the first
    health check of every backend runs before the first request is served."""
    if isinstance(cfg.max_request_bytes, bool) or not isinstance(cfg.max_request_bytes, int) \
            or cfg.max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {cfg.max_request_bytes!r}")
    r = _Router(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await r.start()
        poller = asyncio.create_task(r.fleet.poll(r.client))
        try:
            yield
        finally:
            poller.cancel()
            with suppress(asyncio.CancelledError):
                await poller
            await r.client.aclose()

    app = FastAPI(title="k3 route", summary="One OpenAI-compatible front for several k3 serve instances",
                  lifespan=lifespan)
    app.state.router = r
    app.add_middleware(BodyGuardMiddleware, max_bytes=cfg.max_request_bytes, on_error=r.count_error)
    if cfg.api_key:  # added last, so it runs first
        app.add_middleware(APIKeyMiddleware, api_key=cfg.api_key)

    def _count_error() -> None:
        r.http_errors += 1

    add_error_handlers(app, _count_error, logger)

    @app.get("/health")
    async def health():
        states = {b.url: "up" if b.healthy else "down" for b in r.fleet.backends.values()}
        ok = "up" in states.values()
        return JSONResponse({"status": "ok" if ok else "error", "backends": states}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        extra = {"k3_route_http_errors_total": ("HTTP requests answered with an error.", r.http_errors)}
        return Response(render(r.fleet, r.admission, r.first_output, extra), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models(request: Request):
        return await r.models("/v1/models", request)

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request):
        return await r.models(request.url.path, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await r.route(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await r.route(request, "/v1/chat/completions", chat=True)

    return app
