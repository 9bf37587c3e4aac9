"""The OpenAI-compatible HTTP app (`k3 serve`).

One background thread (`EngineLoop`) owns the engine: it adds submitted requests, applies aborts, and runs
`engine.step()` while there is work, sleeping on a threading.Event otherwise. Each HTTP handler submits its request
to the loop and awaits the request's outputs on an asyncio.Queue, which the engine thread fills through
`loop.call_soon_threadsafe`. The event loop therefore never waits on the engine's lock, and the engine sees every
request change between two steps, in one thread.

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with server-sent-event streaming; the chat
endpoint's tools, reasoning and response formats: k3.serve.chat_api), GET /v1/models,
GET /health, GET /metrics (Prometheus text), and the tokenizer as vLLM's server exposes it: GET /tokenizer_info,
POST /tokenize, POST /detokenize (what lm-evaluation-harness's remote tokenizer reads). Errors use the OpenAI shape
{"error": {"message", "type", "param", "code"}}. A client that goes away (mid-stream or while waiting for a
non-streamed answer) has its request aborted, which frees its cache pages.

Hostile input is stopped at the edge by the guards of k3.serve.guard (body size, type and JSON text, the API
key); a text too long for the context is refused before it is tokenized (`_Server.check_text_length`).

Images: a chat message may hold OpenAI `image_url` parts with base64 data URLs (k3.serve.images: limits, decoding
off the event loop, rendering with placeholder runs); the engine encodes them at prefill. A model without a vision
encoder answers 400.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from k3.serve.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, chat_stop, encode_segments
from k3.serve.chat_api import ChatTurn, chat_options
from k3.serve.engine_loop import EngineLoop, Failure, RequestHandle
from k3.serve.guard import (DEFAULT_MAX_REQUEST_BYTES, APIKeyMiddleware, BodyGuardMiddleware, JSONRoute,
                            add_error_handlers, max_token_bytes)
from k3.serve.images import ImageLimits, decode_images, encode_with_images, find_image_parts, has_image_parts
from k3.serve.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from k3.serve.metrics import MetricsExporter
from k3.serve.protocol import (APIError, ChatCompletionRequest, CompletionRequest, _SamplingFields, error_body,
                               error_response)
from k3.serve.sampling import SamplingParams

logger = logging.getLogger("k3.serve")


class TokenizeRequest(BaseModel):
    """POST /tokenize, as vLLM's server takes it (the text form)."""
    model_config = ConfigDict(extra="ignore")
    prompt: StrictStr
    model: StrictStr | None = None
    add_special_tokens: bool = False  # k3's tokenizers add no special tokens to a text either way


class DetokenizeRequest(BaseModel):
    """POST /detokenize, as vLLM's server takes it."""
    model_config = ConfigDict(extra="ignore")
    tokens: list[StrictInt]
    model: StrictStr | None = None

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the OpenAI default for /v1/completions; chat defaults to the rest of the context
DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there


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

    def __init__(self, engine, tokenizer, model_name: str, chat_template: ChatTemplate | None,
                 image_limits: ImageLimits | None = None):
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.image_limits = (image_limits or ImageLimits()).validate()
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

    def tokenizer_info(self) -> dict:
        """The tokenizer as vLLM's /tokenizer_info describes one: lm-evaluation-harness's remote tokenizer (its
        default `tokenizer_backend=auto` for local-completions) takes the end-of-text token from `eos_token` and its
        id from /tokenize of that text. k3's chat template is not a Jinja template: `chat_template` is None."""
        eos = getattr(self.tokenizer, "eos_token", None)
        return {"tokenizer_class": type(self.tokenizer).__name__, "name_or_path": self.model_name,
                "eos_token": eos, "eos_token_id": getattr(self.tokenizer, "eos_id", None),
                "bos_token": None, "bos_token_id": None, "pad_token": eos, "unk_token": None,
                "add_bos_token": False, "add_eos_token": False, "vocab_size": self.vocab_size,
                "model_max_length": int(self.engine.max_model_len), "chat_template": None}

    async def tokenize(self, text: str) -> list[int]:
        """/tokenize: the ids a completion prompt of `text` gets (special-token text inside a text stays ordinary
        text, as in a prompt), except that a text that is exactly one special token's (the end-of-text token, the
        chat markup) is that token's id, which is how a remote-tokenizer client learns the id of `eos_token`."""
        special = getattr(self.tokenizer, "special_token_id", None)
        sid = special(text) if special is not None else None
        if sid is not None:
            return [int(sid)]
        return await self.encode(text) if text else []

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

    async def chat_prompt(self, messages, opts) -> tuple[list[int], list | None]:
        """A chat request's prompt ids, and its images (k3.serve.sequence.PromptImage; None without image parts).
        APIError names a bad message, image or limit."""
        if not has_image_parts(messages):
            segments = opts.render(messages, self.template)
            self.check_text_length("".join(s.text for s in segments), "messages")
            # The markup as special ids, message text as ordinary text (k3.serve.chat: escaping); long prompts are
            # tokenized off the event loop.
            if sum(len(s.text) for s in segments) > 16384:
                return await asyncio.to_thread(encode_segments, self.tokenizer, segments, self.template), None
            return encode_segments(self.tokenizer, segments, self.template), None
        vision = getattr(self.engine.model, "vision", None)
        if vision is None:
            raise APIError(400, "the request has image_url parts, but this model has no vision encoder: send text "
                                "only", param="messages", code="images_not_supported")
        messages, parts, sentinel = find_image_parts(messages, self.image_limits)
        segments = opts.render(messages, self.template)
        self.check_text_length("".join(s.text for s in segments), "messages")
        pid = self.engine.model.config.media_placeholder_token_id

        def build():  # decoding, resizing and hashing the images, and tokenizing, off the event loop
            pixels = decode_images(parts, vision.config, self.image_limits)
            return encode_with_images(segments, sentinel, pixels, self.tokenizer, pid, vision.config, self.template)

        return await asyncio.to_thread(build)

    async def run(self, request: Request, prompt_ids: list[int], params: SamplingParams, turn: ChatTurn | None,
                  stream: bool, include_usage: bool, want_logprobs: bool, echo: str | None = None,
                  images: list | None = None) -> Response:
        """`turn`: a chat completion's reply side (None for a completion). `echo`: the prompt's text, returned
        before the generated text (completions, not streamed); its token logprobs come from the engine when
        params.prompt_logprobs is set. `images`: the prompt's images (PromptImage)."""
        chat = turn is not None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        h = self.loop.submit(prompt_ids, params, request_id=rid, images=images)
        if stream:
            return _EngineStream(self._stream(request, h, created, turn, include_usage, want_logprobs),
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
            turn.update(list(h.seq.output_ids), text, True, reason)
            choice = {"index": 0, "message": turn.message(), "finish_reason": turn.finish_reason(reason),
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

    async def _stream(self, request: Request, h: RequestHandle, created: int, turn: ChatTurn | None,
                      include_usage: bool, want_logprobs: bool):
        chat = turn is not None
        base = {"id": h.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name}

        def chunk(text, reason: str | None, lps: list[dict] | None, offset: int, first: bool = False):
            """`text`: the new text (a completion) or the delta (chat)."""
            if chat:
                delta = {"role": "assistant"} if first else (text or {})
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
            reason = _finish_reason(item.finish_reason)
            if chat:  # the parser's deltas; the item's logprobs ride on the first
                sent = h.seq.text if item.finished else sent + delta
                deltas = turn.update(item.new_token_ids, sent, item.finished, reason)
                for k, d in enumerate((deltas or [None]) if lps else deltas):
                    yield chunk(d, None, lps if k == 0 else None, 0)
                if not item.finished:
                    continue
                h.finished = True
                yield chunk(None, turn.finish_reason(reason), None, 0)
            elif item.finished:
                h.finished = True
                final = h.seq.text if h.seq is not None else sent + delta
                # The engine may hold back a tail (a partial stop string) until the end: send what is left.
                rest = final[len(sent):] if final.startswith(sent) else delta
                if rest or lps:
                    yield chunk(rest, None, lps, len(sent))
                    sent += rest
                yield chunk(None, reason, None, len(sent))
            if item.finished:
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(h)})
                yield "data: [DONE]\n\n"
                return
            if delta or lps:
                yield chunk(delta, None, lps, len(sent))
                sent += delta


# =====================================================================================================================
# The app


def create_app(engine, tokenizer, model_name: str, api_key: str | None = None,
               chat_template: ChatTemplate | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, image_limits: ImageLimits | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine`. Its engine loop starts with the app (lifespan) or at the first
    request, and stops when the app shuts down. Request bodies over `max_request_bytes` get 413. `image_limits`:
    what a chat request's images may be (k3.serve.images.ImageLimits; default its defaults)."""
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    srv = _Server(engine, tokenizer, model_name, chat_template, image_limits)

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
    app.router.route_class = JSONRoute
    app.add_middleware(BodyGuardMiddleware, max_bytes=max_request_bytes, on_error=srv.count_error)
    if api_key:  # added last, so it runs first: a client without the key gets nothing else, not even a size check
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    # --- errors ---------------------------------------------------------------------------------------------------
    def _count_error() -> None:
        srv.http_errors += 1

    add_error_handlers(app, _count_error, logger)

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

    # --- the tokenizer, as vLLM's server exposes it (lm-evaluation-harness's remote tokenizer reads these) ------
    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return srv.tokenizer_info()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None:
            srv.check_model(body.model)
        ids = await srv.tokenize(body.prompt)
        return {"count": len(ids), "max_model_len": int(engine.max_model_len), "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None:
            srv.check_model(body.model)
        bad = next((x for x in body.tokens if not 0 <= x < srv.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {srv.vocab_size})", param="tokens")
        return {"prompt": srv.tokenizer.decode(body.tokens)}

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
        return await srv.run(request, ids, params, None, stream=bool(body.stream), include_usage=include_usage,
                             want_logprobs=body.logprobs is not None, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        srv.check_model(body.model)
        srv.check_unsupported(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        opts = chat_options(srv.template, body.tools, body.tool_choice, body.parallel_tool_calls,
                            body.response_format, body.reasoning_effort, body.chat_template_kwargs)
        ids, images = await srv.chat_prompt(body.messages, opts)
        use_mct = body.max_completion_tokens is not None  # the newer name wins
        max_tokens = body.max_completion_tokens if use_mct else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        # The message ends at [end_of_msg]; the parser reads its channels and calls from the generated ids.
        stop, stop_ids = chat_stop(srv.tokenizer, srv.template)
        params = srv.sampling_params(body, len(ids), "messages", max_tokens, None, stop, logprobs,
                                     "max_completion_tokens" if use_mct else "max_tokens")
        params.stop_token_ids = stop_ids
        if engine.draft is None:  # a forced call is decoded under its grammar; speculative steps would skip it
            params.constraint = opts.constraint(srv.tokenizer, srv.template, params.max_tokens, engine.eos_id,
                                                "max_completion_tokens" if use_mct else "max_tokens")
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        turn = ChatTurn(opts, srv.template, srv.tokenizer, stops=bool(params.stop))
        return await srv.run(request, ids, params, turn, stream=bool(body.stream), include_usage=include_usage,
                             want_logprobs=bool(body.logprobs), images=images)

    return app
