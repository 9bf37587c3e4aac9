"""The guards of the HTTP API against hostile input, applied at its edge.

A body over the size limit gets 413 before it is read in full, another Content-Type than JSON on POST /v1/* gets
415 (`BodyGuardMiddleware`); JSON bodies are parsed by `parse_json_body` (invalid UTF-8, lone surrogates, NaN and
deep nesting get 400 naming the field) through `JSONRoute`; /v1/* needs the API key when one is set
(`APIKeyMiddleware`). `max_token_bytes` bounds the text one token stands for, so that a prompt too long for the
context can be refused before it is tokenized (k3.serve.app). After a large body, freed heap memory is handed back
to the OS (`release_free_memory`).
"""

from __future__ import annotations

import ctypes
import hmac
import json
import platform

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.serve.protocol import APIError, _validation_message, error_response, parse_json_body

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # request bodies above this get 413 (`k3 serve --max-request-mb`)
TRIM_AFTER_BYTES = 2**20  # after a request body this large, freed heap memory is handed back to the OS


# =====================================================================================================================
# Prompt length, memory


def max_token_bytes(tokenizer) -> int | None:
    """The most bytes of text one token of `tokenizer` can stand for, or None when that cannot be bounded (then
    every prompt is tokenized in full; the request size limit still bounds the work).

    It is bounded for byte-level BPE (all of ours): no normalizer changes the text, the pre-tokenizer keeps every
    byte (ByteLevel, or Split pieces that are not removed), and each token is the byte-level spelling of the bytes
    it covers, one character per byte; added tokens match their own text. So a token covers at most the UTF-8
    length of its vocabulary string (byte-level characters above U+007F take two bytes, so this can overestimate,
    which only makes the length check of check_text_length looser)."""
    raw = getattr(tokenizer, "tokenizer", None)  # the `tokenizers.Tokenizer` inside a K3Tokenizer
    try:
        spec = json.loads(raw.to_str())
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
        byte_level = (spec.get("normalizer") is None and (spec.get("decoder") or {}).get("type") == "ByteLevel"
                      and any(p.get("type") == "ByteLevel" for p in steps)
                      and all(p.get("type") == "ByteLevel" or (p.get("type") == "Split"
                                                               and p.get("behavior") != "Removed") for p in steps))
        if not byte_level:
            return None
        return max(1, max(len(t.encode("utf-8")) for t in raw.get_vocab(with_added_tokens=True)))
    except Exception:  # not a `tokenizers` tokenizer (or an unexpected layout): no bound
        return None


_malloc_trim = None


def release_free_memory() -> None:
    """Hand freed heap memory back to the OS (glibc only; elsewhere a no-op). glibc raises its mmap threshold to
    the size of the largest block freed, so after one large request, later large buffers come from the heap, and
    the heap's free pages are kept: RSS would stay at its peak. malloc_trim(0) returns them."""
    global _malloc_trim
    if _malloc_trim is None:
        fn = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
            except (OSError, AttributeError):
                fn = False
        _malloc_trim = fn
    if _malloc_trim:
        _malloc_trim(0)


# =====================================================================================================================
# Request bodies: size, type, JSON text


class BodyError(StarletteHTTPException):
    """An APIError found while FastAPI reads the body: FastAPI hands HTTPExceptions raised there on to the
    exception handlers (anything else it turns into a generic 400)."""

    def __init__(self, error: APIError):
        super().__init__(error.status, error.message)
        self.error = error


class _JSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            try:
                self._json = parse_json_body(await self.body())
            except APIError as e:
                raise BodyError(e) from None
        return self._json


class JSONRoute(APIRoute):
    """Routes whose JSON bodies are parsed by `parse_json_body` (valid text, bounded nesting)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def run(request: Request):
            return await handler(_JSONRequest(request.scope, request.receive))

        return run


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers", ()):
        if k == name:
            return v
    return None


class BodyGuardMiddleware:
    """Reads each request body before the app does, up to `max_bytes`: a larger body gets 413 without being read
    (by its Content-Length) or as soon as its streamed (chunked) bytes pass the limit, before anything parses it.
    POST /v1/* bodies must be JSON: another Content-Type gets 415, none is taken as JSON. After a large body
    the freed memory is handed back to the OS (release_free_memory)."""

    def __init__(self, app, max_bytes: int, on_error=None):
        self.app, self.max_bytes, self.on_error = app, int(max_bytes), on_error or (lambda: None)

    def _error(self, status: int, message: str, code: str | None = None) -> JSONResponse:
        self.on_error()
        return error_response(status, message, code=code)

    def _too_large(self, size: str) -> JSONResponse:
        mb = self.max_bytes / 2**20
        return self._error(413, f"the request body{size} is larger than this server's limit of {self.max_bytes} "
                                   f"bytes ({mb:g} MiB); send a smaller request, or start the server with a larger "
                                   f"--max-request-mb", "request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _header(scope, b"content-length")
        chunked = b"chunked" in (_header(scope, b"transfer-encoding") or b"").lower()
        if length is not None:
            try:
                length = int(length)
            except ValueError:
                await self._error(400, "the Content-Length header is not a number")(scope, receive, send)
                return
        if not chunked and not length:  # no body (GET, or an empty POST: the endpoint says what is missing)
            await self.app(scope, receive, send)
            return
        if length is not None and length > self.max_bytes:
            await self._too_large(f" ({length} bytes)")(scope, receive, send)
            return
        if scope.get("method") == "POST" and scope["path"].startswith("/v1/"):
            ctype = _header(scope, b"content-type")
            if ctype is None:  # the /v1 endpoints only take JSON; FastAPI would not parse an untyped body
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
            else:
                mime = ctype.split(b";")[0].strip().lower()
                if not (mime == b"application/json" or (mime.startswith(b"application/") and mime.endswith(b"+json"))):
                    shown = ctype.decode("latin-1")[:100]
                    await self._error(415, f"the request body must be JSON: its Content-Type is '{shown}'; send "
                                           f"'Content-Type: application/json'",
                                      "unsupported_media_type")(scope, receive, send)
                    return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                await self._too_large(" (streamed)")(scope, receive, send)
                if size >= TRIM_AFTER_BYTES:
                    release_free_memory()
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        chunks.clear()

        async def replay():
            return pending.pop() if pending else await receive()

        try:
            await self.app(scope, replay, send)
        finally:
            pending.clear()
            if size >= TRIM_AFTER_BYTES:
                release_free_memory()


# =====================================================================================================================
# The API key


PROTECTED_PATHS = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")  # what APIKeyMiddleware guards


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1/* and the tokenizer's endpoints (PROTECTED_PATHS; before the
    body is read, so a client without the key learns nothing else). /health and /metrics stay open."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED_PATHS) and scope.get("method") != "OPTIONS":
            auth = ""
            for k, v in scope.get("headers", ()):
                if k == b"authorization":
                    auth = v.decode("latin-1")
                    break
            scheme, _, token = auth.strip().partition(" ")
            if not auth:
                msg = "missing API key: send it as the header 'Authorization: Bearer <key>'"
            elif scheme.lower() != "bearer":
                msg = "the Authorization header must be 'Bearer <key>'"
            elif not hmac.compare_digest(token.strip().encode("utf-8"), self.key):
                msg = "invalid API key"
            else:
                msg = None
            if msg is not None:
                resp = error_response(401, msg, "authentication_error", None, "invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_error_handlers(app, on_error, logger) -> None:
    """OpenAI-shaped answers for every error an app raises (k3 serve's and k3 route's): an APIError as it says, a
    request that fails validation 400 naming the field, the body guard's errors, 404/405 naming the endpoint and
    method, anything unexpected 500 (logged to `logger`). `on_error()` is called once per error answered (the
    app's error counter)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        on_error()
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        on_error()
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, "invalid_request_error", param, None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        on_error()
        if isinstance(exc, BodyError):
            e = exc.error
            return error_response(e.status, e.message, e.type, e.param, e.code, e.headers)
        if exc.status_code == 404:
            msg = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(exc.status_code, msg, "invalid_request_error", None, None,
                              getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        on_error()
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}", "server_error", None, None)
