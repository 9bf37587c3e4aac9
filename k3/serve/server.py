"""The OpenAI-compatible HTTP server (`k3 serve`).

One background thread (`EngineLoop`) owns the engine: it adds submitted requests, applies aborts, and runs
`engine.step()` while there is work, sleeping on a threading.Event otherwise. Each HTTP handler submits its request
to the loop and awaits the request's outputs on an asyncio.Queue, which the engine thread fills through
`loop.call_soon_threadsafe`. The event loop therefore never waits on the engine's lock, and the engine sees every
request change between two steps, in one thread.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with server-sent-event streaming), GET /v1/models,
GET /health, GET /metrics (Prometheus text). Errors use the OpenAI shape
{"error": {"message", "type", "param", "code"}}. A client that goes away (mid-stream or while waiting for a
non-streamed answer) has its request aborted, which frees its cache pages.

Hostile input is stopped at the edge: bodies over the size limit get 413 before they are read in full
(`_BodyGuardMiddleware`), bodies are parsed by `parse_json_body` (invalid UTF-8, lone surrogates, NaN and deep
nesting get 400 naming the field), and a text too long for the context is refused before it is tokenized
(`_Server.check_text_length`).
"""

from __future__ import annotations

import asyncio
import ctypes
import hmac
import json
import logging
import os
import platform
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3.serve.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, render_chat
from k3.serve.engine_loop import EngineLoop, Failure, RequestHandle
from k3.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from k3.serve.metrics import MetricsExporter
from k3.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, _SamplingFields,
                               _validation_message, error_body, error_response, parse_json_body)
from k3.serve.sampling import SamplingParams

logger = logging.getLogger("k3.serve")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions; chat defaults to the rest of the context
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20  # request bodies above this get 413 (`k3 serve --max-request-mb`)
TRIM_AFTER_BYTES = 2**20  # after a request body this large, freed heap memory is handed back to the OS


# =====================================================================================================================
# Response helpers


def _finish_reason(reason: str | None) -> str | None:
    """The engine's reason as OpenAI spells it: "stop" (EOS or a stop string) or "length"."""
    return reason if reason in ("stop", "length", None) else "stop"


def _usage(h: RequestHandle) -> dict:
    seq = h.seq
    completion = len(seq.output_ids) if seq is not None else 0
    prompt = len(h.prompt_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(seq.cached_tokens) if seq is not None else 0}}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _failure_response(f: Failure) -> JSONResponse:
    return error_response(f.status, f.message, f.type)


class _EngineStream(StreamingResponse):
    """A streaming response that aborts its request when the response ends early, however it ends
    (client disconnect, cancellation, error)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Server:
    """The state behind the endpoints of one app."""

    def __init__(self, engine, tokenizer, model_name: str, chat_template: ChatTemplate | None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.template = chat_template or DEFAULT_CHAT_TEMPLATE
        self.loop = EngineLoop(engine)
        self.exporter = MetricsExporter(engine)
        self.created = int(time.time())
        # Ids a prompt may hold: the model must embed them and the tokenizer decode them (for echo, logprobs).
        self.model_vocab_size = int(engine.model.config.vocab_size)
        self.tokenizer_vocab_size = int(getattr(tokenizer, "vocab_size", None) or self.model_vocab_size)
        self.vocab_size = min(self.model_vocab_size, self.tokenizer_vocab_size)
        self.max_token_bytes = max_token_bytes(tokenizer)
        self.http_errors = 0
        self._tok_cache: dict[int, str] = {}

    def count_error(self) -> None:
        self.http_errors += 1

    # --- validation -----------------------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{self.model_name}'",
                           "invalid_request_error", "model", "model_not_found")

    @staticmethod
    def check_unsupported(body: _SamplingFields) -> None:
        if body.n not in (None, 1):
            raise APIError(400, f"n={body.n} is not supported: only one choice per request (n=1)", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(body, name)
            if v not in (None, 0, 0.0):
                raise APIError(400, f"{name} is not supported (only 0)", param=name)
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")

    def check_text_length(self, text: str, param: str) -> None:
        """Reject a text that cannot fit the context without tokenizing it. No token stands for more than
        `max_token_bytes` bytes of text (see max_token_bytes), so a text of B UTF-8 bytes has at least B / that
        many tokens; when that is more than the whole context, the token count cannot pass any context check.
        A character is at least one byte, so len(text) is a lower bound of B that costs nothing to compute."""
        per = self.max_token_bytes
        if per is None:
            return
        ctx = int(self.engine.max_model_len)
        n, unit = len(text), "characters"
        if n <= ctx * per and not text.isascii():
            n, unit = len(text.encode("utf-8")), "UTF-8 bytes"
        if n > ctx * per:
            raise APIError(400, f"the prompt is too long: its {n} {unit} make at least {-(-n // per)} tokens (a token "
                                f"of this model's tokenizer covers at most {per} bytes), more than this model's "
                                f"context of {ctx} tokens", param=param, code="context_length_exceeded")

    async def encode(self, text: str, param: str = "prompt") -> list[int]:
        self.check_text_length(text, param)
        if len(text) > 16384:  # long texts are tokenized off the event loop
            return await asyncio.to_thread(self.tokenizer.encode, text)
        return self.tokenizer.encode(text)

    def sampling_params(self, body: _SamplingFields, prompt_len: int, prompt_param: str, max_tokens: int | None,
                        default_max_tokens: int | None, extra_stop: list[str], logprobs: int | None,
                        max_tokens_param: str = "max_tokens", prompt_logprobs: int | None = None) -> SamplingParams:
        ctx = int(self.engine.max_model_len)
        least_new = 0 if max_tokens == 0 else 1  # max_tokens=0 (echo: score the prompt only) generates nothing
        if prompt_len + least_new > ctx:
            raise APIError(400, f"the prompt is too long: it has {prompt_len} tokens, and this model's context of "
                                f"{ctx} tokens must hold the prompt"
                                f"{' and at least one generated token' if least_new else ''}",
                           param=prompt_param, code="context_length_exceeded")
        room = ctx - prompt_len
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"{max_tokens_param} ({max_tokens}) is too large: the prompt has {prompt_len} tokens "
                                f"and the context holds {ctx}, so at most {room} new tokens fit",
                           param=max_tokens_param, code="context_length_exceeded")
        top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
        stop = list(dict.fromkeys(list(body.stop or []) + list(extra_stop)))
        p = SamplingParams(max_tokens=int(max_tokens), temperature=float(1.0 if body.temperature is None
                                                                          else body.temperature),
                           top_k=int(top_k), top_p=float(1.0 if body.top_p is None else body.top_p),
                           seed=body.seed, stop=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            p.validate()
        except ValueError as e:
            raise APIError(400, str(e)) from None
        return p

    # --- token strings for logprobs --------------------------------------------------------------------------------
    def token_str(self, tid: int) -> str:
        s = self._tok_cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid])
            if len(self._tok_cache) < 1 << 16:
                self._tok_cache[tid] = s
        return s

    def completion_logprobs(self, entries: list[dict], offset: int, text_len: int | None) -> dict:
        """OpenAI completions logprobs; tokens starting at or past `text_len` (cut by a stop string) are left out."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            if text_len is not None and offset >= text_len:
                break
            s = self.token_str(e["token"])
            out["tokens"].append(s)
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append({self.token_str(i): lp for i, lp in e.get("top", [])})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def top_with_token(self, e: dict) -> dict:
        """An entry's top alternatives by token string, with the entry's own token in them (as vLLM answers echo
        requests; lm-eval's is_greedy compares a token's logprob with the best of these). Ids that decode to the
        same string keep the highest logprob."""
        top: dict[str, float] = {}
        for i, lp in [(e["token"], e["logprob"])] + list(e.get("top", [])):
            s = self.token_str(i)
            top[s] = max(lp, top.get(s, lp))
        return top

    def echo_logprobs(self, prompt_ids: list[int], prompt_entries: list, entries: list[dict],
                      text_len: int | None) -> dict:
        """OpenAI completions logprobs of an echo request: the prompt tokens (None for the first, which nothing
        predicts), then the generated ones; text_offset counts the token strings from 0. Generated tokens starting
        at or past `text_len` characters of generated text (cut by a stop string) are left out."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for tid, e in zip(prompt_ids, prompt_entries):
            s = self.token_str(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if e is None else e["logprob"])
            out["top_logprobs"].append(None if e is None else self.top_with_token(e))
            out["text_offset"].append(offset)
            offset += len(s)
        start = offset
        for e in entries:
            if text_len is not None and offset - start >= text_len:
                break
            s = self.token_str(e["token"])
            out["tokens"].append(s)
            out["token_logprobs"].append(e["logprob"])
            out["top_logprobs"].append(self.top_with_token(e))
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def chat_logprobs(self, entries: list[dict], offset: int, text_len: int | None) -> dict:
        """OpenAI chat logprobs ({"content": [...]}), cut like completion_logprobs."""
        content = []
        for e in entries:
            if text_len is not None and offset >= text_len:
                break
            s = self.token_str(e["token"])
            content.append({"token": s, "logprob": e["logprob"], "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": self.token_str(i), "logprob": lp,
                                              "bytes": list(self.token_str(i).encode("utf-8"))}
                                             for i, lp in e.get("top", [])]})
            offset += len(s)
        return {"content": content}

    # --- running a request ----------------------------------------------------------------------------------------
    async def next_item(self, h: RequestHandle, request: Request):
        """The request's next output, or None when the client has gone away (checked every DISCONNECT_POLL_S,
        whether or not outputs keep coming)."""
        while True:
            now = time.monotonic()
            if now - h.checked_at >= DISCONNECT_POLL_S:
                h.checked_at = now
                if await request.is_disconnected():
                    return None
            if not h.queue.empty():
                return h.queue.get_nowait()
            try:
                return await asyncio.wait_for(h.queue.get(), timeout=DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                pass

    async def run(self, request: Request, prompt_ids: list[int], params: SamplingParams, chat: bool,
                  stream: bool, include_usage: bool, want_logprobs: bool, echo: str | None = None) -> Response:
        """`echo`: the prompt's text, returned before the generated text (completions, not streamed); its token
        logprobs come from the engine when params.prompt_logprobs is set."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        h = self.loop.submit(prompt_ids, params, request_id=rid)
        if stream:
            return _EngineStream(self._stream(request, h, created, chat, include_usage, want_logprobs),
                                 on_close=lambda: None if h.finished else self.loop.abort(rid),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            lps: list[dict] = []
            prompt_lps: list | None = None
            while True:
                item = await self.next_item(h, request)
                if item is None:  # the client left: free the request's pages
                    self.loop.abort(rid)
                    return Response(status_code=499)
                if isinstance(item, Failure):
                    h.finished = True
                    return _failure_response(item)
                lps.extend(item.logprobs)
                if item.prompt_logprobs is not None:
                    prompt_lps = item.prompt_logprobs
                if item.finished:
                    h.finished = True
                    break
        finally:
            if not h.finished:  # cancelled (e.g. server shutdown)
                self.loop.abort(rid)
        text = h.seq.text
        reason = _finish_reason(item.finish_reason)
        cut = len(text) if reason == "stop" else None  # logprobs of tokens past a stop string are left out
        base = {"id": rid, "created": created, "model": self.model_name}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                      "logprobs": self.chat_logprobs(lps, 0, cut) if want_logprobs else None}
            body = {**base, "object": "chat.completion", "choices": [choice], "usage": _usage(h)}
        elif echo is not None:
            # A stop token ends the text but keeps its logprob entry (as vLLM does): a client that drops the
            # generated entries by count (lm-eval drops the last one of a max_tokens=1 request) stays aligned.
            stop_token = reason == "stop" and len(lps) > len(h.seq.output_ids)
            lp = None
            if want_logprobs:
                lp = self.echo_logprobs(h.prompt_ids, prompt_lps or [], lps, None if stop_token else cut)
            choice = {"index": 0, "text": echo + text, "finish_reason": reason, "logprobs": lp}
            body = {**base, "object": "text_completion", "choices": [choice], "usage": _usage(h)}
        else:
            choice = {"index": 0, "text": text, "finish_reason": reason,
                      "logprobs": self.completion_logprobs(lps, 0, cut) if want_logprobs else None}
            body = {**base, "object": "text_completion", "choices": [choice], "usage": _usage(h)}
        return JSONResponse(body)

    async def _stream(self, request: Request, h: RequestHandle, created: int, chat: bool, include_usage: bool,
                      want_logprobs: bool):
        base = {"id": h.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}

        def chunk(text: str | None, reason: str | None, lps: list[dict] | None, offset: int, first: bool = False):
            if chat:
                delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
                lp = self.chat_logprobs(lps, offset, None) if lps else None
                choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                lp = self.completion_logprobs(lps, offset, None) if lps else None
                choice = {"index": 0, "text": text or "", "logprobs": lp, "finish_reason": reason}
            c = {**base, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        sent = ""
        if chat:
            yield chunk(None, None, None, 0, first=True)
        while True:
            item = await self.next_item(h, request)
            if item is None:  # the client left; _EngineStream aborts the request
                return
            if isinstance(item, Failure):
                h.finished = True
                yield _sse(error_body(item.message, item.type))
                yield "data: [DONE]\n\n"
                return
            lps = item.logprobs if want_logprobs else None
            delta = item.new_text
            if item.finished:
                h.finished = True
                final = h.seq.text if h.seq is not None else sent + delta
                # The engine may hold back a tail (a partial stop string) until the end: send what is left.
                rest = final[len(sent):] if final.startswith(sent) else delta
                if rest or lps:
                    yield chunk(rest, None, lps, len(sent))
                    sent += rest
                yield chunk(None, _finish_reason(item.finish_reason), None, len(sent))
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(h)})
                yield "data: [DONE]\n\n"
                return
            if delta or lps:
                yield chunk(delta, None, lps, len(sent))
                sent += delta


# =====================================================================================================================
# Hostile input: body size and type, JSON text, prompt length, memory


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


class _BodyError(StarletteHTTPException):
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
                raise _BodyError(e) from None
        return self._json


class _JSONRoute(APIRoute):
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


class _BodyGuardMiddleware:
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
# The app


class _APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1/* (before the body is read, so a client without the key learns
    nothing else). /health and /metrics stay open."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode("utf-8")

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope.get("method") != "OPTIONS":
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


def create_app(engine, tokenizer, model_name: str, api_key: str | None = None,
               chat_template: ChatTemplate | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The OpenAI-compatible app over `engine`. Its engine loop starts with the app (lifespan) or at the first
    request, and stops when the app shuts down. Request bodies over `max_request_bytes` get 413."""
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    srv = _Server(engine, tokenizer, model_name, chat_template)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(srv.loop.stop)

    app = FastAPI(title="k3", summary="OpenAI-compatible API of a K3 model", lifespan=lifespan)
    app.state.server = srv
    app.state.engine = engine
    app.state.engine_loop = srv.loop
    app.router.route_class = _JSONRoute
    app.add_middleware(_BodyGuardMiddleware, max_bytes=max_request_bytes, on_error=srv.count_error)
    if api_key:  # added last, so it runs first: a client without the key gets nothing else, not even a size check
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)

    # --- errors ---------------------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        srv.http_errors += 1
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        srv.http_errors += 1
        message, param = _validation_message(list(exc.errors()))
        return error_response(400, message, "invalid_request_error", param, None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        srv.http_errors += 1
        if isinstance(exc, _BodyError):
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
        srv.http_errors += 1
        logger.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"internal server error: {type(exc).__name__}", "server_error", None, None)

    # --- endpoints ------------------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if srv.loop.fatal is not None:
            return JSONResponse({"status": "error", "message": f"the engine loop stopped: {srv.loop.fatal!r}"},
                                status_code=503)
        return {"status": "ok"}

    def _model_card() -> dict:
        return {"id": srv.model_name, "object": "model", "created": srv.created, "owned_by": "k3",
                "max_model_len": int(engine.max_model_len)}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        srv.check_model(model)
        return _model_card()

    @app.get("/metrics")
    def metrics():  # a plain def: FastAPI runs it in a worker thread, as it waits for the engine's lock
        extra = {
            "k3_requests_aborted_total": ("Requests aborted (the client went away).", srv.loop.aborted),
            "k3_requests_rejected_total": ("Requests the engine refused at submission.", srv.loop.rejected),
            "k3_engine_steps_total": ("Engine steps run.", srv.loop.steps),
            "k3_engine_step_failures_total": ("Engine steps that raised.", srv.loop.step_failures),
            "k3_http_errors_total": ("HTTP requests answered with an error.", srv.http_errors),
        }
        return Response(srv.exporter.render(extra), media_type=METRICS_CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        srv.check_model(body.model)
        srv.check_unsupported(body)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens=0 is allowed only with echo=true (the prompt and its logprobs come back, "
                                "nothing is generated); without echo max_tokens must be at least 1",
                           param="max_tokens")
        if body.echo and body.stream:
            raise APIError(400, "echo is not supported with stream=true: send stream=false to get the prompt back "
                                "(with its logprobs) in one response", param="echo")
        if body.best_of not in (None, 1):
            raise APIError(400, f"best_of={body.best_of} is not supported (only 1)", param="best_of")
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if isinstance(body.prompt, str):
            ids = await srv.encode(body.prompt)
            if not ids:
                raise APIError(400, "the prompt encodes to no tokens", param="prompt")
        else:
            ids = list(body.prompt)
            bad = next((x for x in ids if not 0 <= x < srv.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"prompt token id {bad} is out of range [0, {srv.vocab_size})", param="prompt")
        # echo with logprobs scores the prompt in the forwards that prefill it (SamplingParams.prompt_logprobs).
        params = srv.sampling_params(body, len(ids), "prompt", body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, [],
                                     body.logprobs, prompt_logprobs=body.logprobs if body.echo else None)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        echo = None
        if body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else srv.tokenizer.decode(ids)
        return await srv.run(request, ids, params, chat=False, stream=bool(body.stream), include_usage=include_usage,
                             want_logprobs=body.logprobs is not None, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        srv.check_model(body.model)
        srv.check_unsupported(body)
        if body.tools:
            raise APIError(400, "tool definitions are not supported by this server (tool-role messages are)",
                           param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {body.response_format.get('type')!r} is not supported "
                                f"(only 'text')", param="response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        try:
            text = render_chat(body.messages, srv.template)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        ids = await srv.encode(text, "messages")
        use_mct = body.max_completion_tokens is not None  # the newer name wins
        max_tokens = body.max_completion_tokens if use_mct else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = srv.sampling_params(body, len(ids), "messages", max_tokens, None, list(srv.template.stop), logprobs,
                                     "max_completion_tokens" if use_mct else "max_tokens")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await srv.run(request, ids, params, chat=True, stream=bool(body.stream), include_usage=include_usage,
                             want_logprobs=bool(body.logprobs))

    return app


# =====================================================================================================================
# `k3 serve`


def build_engine(ckpt_dir: str, cache_memory_mb: float | None = None, page_tokens: int | None = None,
                 hash_block_tokens: int | None = None, max_num_seqs: int | None = None,
                 max_step_tokens: int | None = None, prefill_chunk: int | None = None, device: str = "auto",
                 max_model_len: int | None = None, backends=None, cuda_graphs: bool | str = True,
                 verify: bool = True):
    """Load a checkpoint, its tokenizer and chat template; returns (engine, tokenizer, chat_template). `backends`
    (k3.ops.registry.Backends) picks the ops' implementations, `cuda_graphs` is EngineConfig.cuda_graphs.
    `verify`: check the shards against the SHA-256 digests their index records."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.serve.chat import load_chat_template
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.train.run import pick_device

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    dev = pick_device(device)
    sched = SchedulerConfig(**{k: v for k, v in (("max_num_seqs", max_num_seqs), ("max_step_tokens", max_step_tokens),
                                                 ("prefill_chunk", prefill_chunk)) if v is not None})
    ecfg = EngineConfig(scheduler=sched, max_model_len=max_model_len, cuda_graphs=cuda_graphs,
                        **{k: v for k, v in (("cache_memory_mb", cache_memory_mb), ("page_tokens", page_tokens),
                                             ("hash_block_tokens", hash_block_tokens)) if v is not None})
    ecfg.validate()  # before the (possibly slow) load
    tokenizer = load_any_tokenizer(ckpt_dir)
    template = load_chat_template(ckpt_dir)
    model = from_pretrained(ckpt_dir, device=dev, backends=backends, verify=verify)
    return LLMEngine(model, tokenizer, ecfg), tokenizer, template


def serve(ckpt_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          cache_memory_mb: float | None = None, page_tokens: int | None = None, hash_block_tokens: int | None = None,
          max_num_seqs: int | None = None, max_step_tokens: int | None = None, prefill_chunk: int | None = None,
          device: str = "auto", model_name: str | None = None, log_level: str = "info", backends=None,
          cuda_graphs: bool | str = True, max_request_mb: float | None = None, verify: bool = True) -> None:
    """Load `ckpt_dir` and serve it until interrupted. Binds 127.0.0.1 unless told otherwise. Engine options left
    as None take EngineConfig / SchedulerConfig defaults; `max_request_mb` (MiB) defaults to
    DEFAULT_MAX_REQUEST_BYTES."""
    import uvicorn

    max_request_bytes = DEFAULT_MAX_REQUEST_BYTES if max_request_mb is None else int(max_request_mb * 2**20)
    if not max_request_bytes >= 1:  # checked before the (possibly slow) load
        raise ValueError(f"--max-request-mb must be positive, got {max_request_mb!r}")
    engine, tokenizer, template = build_engine(ckpt_dir, cache_memory_mb, page_tokens, hash_block_tokens,
                                               max_num_seqs, max_step_tokens, prefill_chunk, device,
                                               backends=backends, cuda_graphs=cuda_graphs, verify=verify)
    if engine.runner.graphs is not None and engine.runner.graphs.capture:
        t0 = time.perf_counter()
        n = engine.runner.graphs.warm_up()  # captured now, so no request waits for a capture
        print(f"k3 serve: {n} CUDA graphs captured in {time.perf_counter() - t0:.1f} s", flush=True)
    name = model_name or os.path.basename(os.path.normpath(ckpt_dir)) or "k3"
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    app = create_app(engine, tokenizer, name, api_key=api_key, chat_template=template,
                     max_request_bytes=max_request_bytes)
    stats = engine.cache_stats()
    print(f"k3 serve: model '{name}' from {ckpt_dir}; context {engine.max_model_len} tokens; cache "
          f"{stats['num_pages']} pages x {stats['page_bytes']} bytes; http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)


def cmd_serve(args) -> int:
    import sys

    from k3.checkpoint import CheckpointError
    from k3.train.run import latest_checkpoint

    ckpt = args.ckpt
    if os.path.isdir(ckpt) and not os.path.exists(os.path.join(ckpt, "config.json")):
        ckpt = latest_checkpoint(ckpt) or ckpt  # a training run directory
    if not 0 <= args.port <= 65535:
        print(f"k3 serve: --port {args.port} is not a port number", file=sys.stderr)
        return 2
    try:
        serve(ckpt, host=args.host, port=args.port, api_key=args.api_key, cache_memory_mb=args.cache_memory_mb,
              page_tokens=args.page_tokens, hash_block_tokens=args.hash_block_tokens, max_num_seqs=args.max_num_seqs,
              max_step_tokens=args.max_step_tokens, prefill_chunk=args.prefill_chunk, device=args.device,
              model_name=args.model_name, log_level=getattr(args, "log_level", "info"),
              backends=getattr(args, "backends", None), cuda_graphs=getattr(args, "cuda_graphs", True),
              max_request_mb=getattr(args, "max_request_mb", None), verify=getattr(args, "verify", True))
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"k3 serve: {e}", file=sys.stderr)
        return 2
    return 0
