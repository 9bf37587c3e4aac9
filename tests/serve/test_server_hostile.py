"""The server against hostile requests: invalid text, oversized and malformed bodies, prompts far over the context,
token ids the tokenizer cannot decode, and memory that must not ratchet up under load.

A real uvicorn server (127.0.0.1, a free port, a 1 MiB body limit) over a random tiny checkpoint from `k3 init`
answers the hostile bodies, so connection handling is the production one; the other tests drive apps in-process
with FastAPI's TestClient. Every client has trust_env=False and talks only to 127.0.0.1.
"""

import argparse
import asyncio
import json
import os
from types import SimpleNamespace

import httpx
import pytest

from helpers import uvicorn_in_thread
from fastapi.testclient import TestClient

from k3.data.tokenizer import K3Tokenizer
from k3.serve.chat import save_chat_template
from k3.serve.protocol import MAX_JSON_DEPTH, check_json_text

uvicorn = pytest.importorskip("uvicorn")

MODEL = "k3-hostile"
CONTEXT = 256
HOST = "127.0.0.1"
LIMIT = 2**20  # the live server's body limit: over-limit bodies stay cheap to send


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from k3.cli import main

    path = tmp_path_factory.mktemp("hostile") / "tiny"
    assert main(["init", "--preset", "tiny", "--out", str(path)]) == 0
    save_chat_template(path)
    return path


@pytest.fixture(scope="module")
def model(ckpt):
    """The model of the in-process apps (one at a time); the live server loads its own."""
    from k3.checkpoint import from_pretrained

    return from_pretrained(ckpt)


def _build(ckpt, model=None, tokenizer=None, **app_kw):
    """A fresh engine (each app's engine loop must own its engine) and app over the tiny checkpoint."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.serve.chat import load_chat_template
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.serve.app import create_app

    model = model if model is not None else from_pretrained(ckpt)
    tok = tokenizer or load_any_tokenizer(ckpt)
    cfg = EngineConfig(cache_memory_mb=16, page_tokens=32, hash_block_tokens=16, max_model_len=CONTEXT,
                       scheduler=SchedulerConfig(max_num_seqs=16, max_step_tokens=512, prefill_chunk=256))
    engine = LLMEngine(model, tok, cfg)
    app = create_app(engine, tok, MODEL, chat_template=load_chat_template(ckpt), **app_kw)
    return SimpleNamespace(app=app, engine=engine, tok=tok)


@pytest.fixture(scope="module")
def live(ckpt):
    s = _build(ckpt, max_request_bytes=LIMIT)
    with uvicorn_in_thread(s.app, HOST) as port:
        with httpx.Client(base_url=f"http://{HOST}:{port}", trust_env=False, timeout=60) as http:
            yield SimpleNamespace(http=http, **vars(s))


def _client_addr(r: httpx.Response):
    """The client-side address of the connection that carried `r` (same address: same kept-alive connection)."""
    stream = r.extensions.get("network_stream")
    return stream.get_extra_info("client_addr") if stream is not None else None


def _raw(obj) -> bytes:
    """JSON bytes of `obj`, lone surrogates kept as escapes (json.dumps writes them as \\udxxx)."""
    return json.dumps(obj).encode("ascii")


def _chunks(data: bytes, n: int = 64 * 1024):
    for i in range(0, len(data), n):
        yield data[i:i + n]


def _served(r: httpx.Response, max_tokens: int) -> bool:
    """A 200 completion that generated max_tokens tokens, or fewer because the random model sampled its EOS."""
    if r.status_code != 200:
        return False
    (choice,), n = r.json()["choices"], r.json()["usage"]["completion_tokens"]
    return (choice["finish_reason"], n) == ("length", max_tokens) or (choice["finish_reason"] == "stop"
                                                                     and n < max_tokens)


def _nested(depth: int) -> bytes:
    return b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * depth + b"1" + b"]" * depth + b"}"


def _chat(content) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


C, CHAT = "/v1/completions", "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
BIG = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"x" * LIMIT + b'"}'

HOSTILE = [
    # (id, path, body, headers, status, words in the message, param)
    ("surrogate-prompt", C, _raw({"model": MODEL, "prompt": "\ud800abc"}), JSON, 400,
     "prompt contains a lone surrogate (U+D800) at character 0; text must be valid Unicode", "prompt"),
    ("surrogate-prompt-middle", C, _raw({"model": MODEL, "prompt": "ab\udfffc"}), JSON, 400,
     "prompt contains a lone surrogate (U+DFFF) at character 2", "prompt"),
    ("surrogate-pair-reversed", C, _raw({"model": MODEL, "prompt": "\udc00\ud800"}), JSON, 400,
     "(U+DC00) at character 0", "prompt"),
    ("surrogate-chat-content", CHAT, _raw(_chat("\ud800")), JSON, 400,
     "messages[0].content contains a lone surrogate (U+D800) at character 0; text must be valid Unicode",
     "messages"),
    ("surrogate-chat-part", CHAT, _raw({"model": MODEL, "messages": [
        {"role": "system", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "hi\ud83d"}]}]}),
     JSON, 400, "messages[1].content[0].text contains a lone surrogate (U+D83D) at character 2", "messages"),
    ("surrogate-chat-role", CHAT, _raw({"model": MODEL, "messages": [{"role": "us\ud800", "content": "x"}]}), JSON,
     400, "messages[0].role contains a lone surrogate", "messages"),
    ("surrogate-stop", C, _raw({"model": MODEL, "prompt": "abc", "stop": "\ud800"}), JSON, 400,
     "stop contains a lone surrogate (U+D800)", "stop"),
    ("surrogate-stop-list", CHAT, _raw({**_chat("hi"), "stop": ["ok", "x\ud800"]}), JSON, 400,
     "stop[1] contains a lone surrogate (U+D800) at character 1", "stop"),
    ("surrogate-model", C, _raw({"model": "\ud800", "prompt": "abc"}), JSON, 400,
     "model contains a lone surrogate", "model"),
    ("surrogate-user", C, _raw({"model": MODEL, "prompt": "abc", "user": "\udbff"}), JSON, 400,
     "user contains a lone surrogate (U+DBFF)", "user"),
    ("surrogate-key", C, _raw({"model": MODEL, "prompt": "abc", "\ud800": 1}), JSON, 400,
     "a key of the request body contains a lone surrogate", None),
    ("utf8-invalid-byte", C, b'{"model": "%s", "prompt": "ab\xffc"}' % MODEL.encode(), JSON, 400,
     "prompt is not valid UTF-8: byte 0xFF at character 2; the request body must be UTF-8", "prompt"),
    ("utf8-overlong", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "\xc0\xaf"}]}'
     % MODEL.encode(), JSON, 400, "messages[0].content is not valid UTF-8: byte 0xC0 at character 0", "messages"),
    ("utf8-truncated", C, b'{"model": "%s", "prompt": "\xe2\x82"}' % MODEL.encode(), JSON, 400,
     "prompt is not valid UTF-8: byte 0xE2", "prompt"),
    ("utf8-latin1-body", C, '{"model": "%s", "prompt": "café"}'.encode("latin-1") % MODEL.encode(), JSON, 400,
     "prompt is not valid UTF-8: byte 0xE9 at character 3", "prompt"),
    ("json-array", C, b"[1, 2]", JSON, 400, "the request body must be a JSON object", None),
    ("json-number", C, b"5", JSON, 400, "the request body must be a JSON object", None),
    ("json-string", CHAT, b'"hello"', JSON, 400, "the request body must be a JSON object", None),
    ("json-syntax", C, b'{"model": "k3", "prompt": ', JSON, 400, "not valid JSON", None),
    ("json-nested-deep", C, _nested(100_000), JSON, 400, "nests arrays and objects too deeply", None),
    ("json-nested-65", C, _nested(MAX_JSON_DEPTH), JSON, 400,
     f"more than {MAX_JSON_DEPTH} levels deep (at prompt[0][0]", "prompt"),
    ("json-nan", C, b'{"model": "%s", "prompt": "x", "temperature": NaN}' % MODEL.encode(), JSON, 400,
     "NaN is not a JSON number", None),
    ("json-infinity", C, b'{"model": "%s", "prompt": "x", "max_tokens": -Infinity}' % MODEL.encode(), JSON, 400,
     "-Infinity is not a JSON number", None),
    ("max-tokens-1e30", C, _raw({"model": MODEL, "prompt": "x", "max_tokens": 10**30}), JSON, 400, "max_tokens",
     "max_tokens"),
    ("max-tokens-5000-digits", C, b'{"model": "%s", "prompt": "x", "max_tokens": 1%s}'
     % (MODEL.encode(), b"0" * 5000), JSON, 400, "a number with more than", None),
    ("max-tokens-float-overflow", C, b'{"model": "%s", "prompt": "x", "max_tokens": 1e999}' % MODEL.encode(), JSON,
     400, "max_tokens", "max_tokens"),
    ("seed-2**64", C, _raw({"model": MODEL, "prompt": "x", "seed": 2**64}), JSON, 400, "seed", "seed"),
    ("seed-below-int64", C, _raw({"model": MODEL, "prompt": "x", "seed": -(2**63) - 1}), JSON, 400, "seed", "seed"),
    ("token-id-negative", C, _raw({"model": MODEL, "prompt": [5, -1]}), JSON, 400,
     "prompt token id -1 is out of range [0, ", "prompt"),
    ("token-id-float", C, _raw({"model": MODEL, "prompt": [5, 1.5]}), JSON, 400, "list of integer token ids",
     "prompt"),
    ("token-id-bool", C, _raw({"model": MODEL, "prompt": [True]}), JSON, 400, "list of integer token ids", "prompt"),
    ("token-id-huge", C, _raw({"model": MODEL, "prompt": [10**30]}), JSON, 400,
     f"prompt token id {10**30} is out of range", "prompt"),
    ("body-over-limit", C, BIG, JSON, 413, f"larger than this server's limit of {LIMIT} bytes", None),
    ("body-over-limit-chunked", CHAT, lambda: _chunks(BIG), JSON, 413, "--max-request-mb", None),
    ("content-type-text", C, _raw({"model": MODEL, "prompt": "x"}), {"Content-Type": "text/plain"}, 415,
     "its Content-Type is 'text/plain'; send 'Content-Type: application/json'", None),
    ("content-type-form", CHAT, _raw(_chat("x")), {"Content-Type": "application/x-www-form-urlencoded"}, 415,
     "the request body must be JSON", None),
]


@pytest.mark.parametrize("path, body, headers, status, words, param", [c[1:] for c in HOSTILE],
                         ids=[c[0] for c in HOSTILE])
def test_hostile_request_gets_an_openai_error_and_the_server_stays_up(live, path, body, headers, status, words,
                                                                      param):
    content = body() if callable(body) else body
    r = live.http.post(path, content=content, headers=headers)
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    assert words in err["message"], err
    assert err["param"] == param, err
    h = live.http.get("/health")
    assert h.status_code == 200 and h.json() == {"status": "ok"}
    if status == 400:  # an ordinary error answer: the kept-alive connection carried the next request
        assert _client_addr(h) == _client_addr(r) is not None


def test_the_server_still_generates_after_the_hostile_requests(live):
    for path, body in ((C, {"model": MODEL, "prompt": "still here", "max_tokens": 2}),
                       (CHAT, {**_chat("still here"), "max_tokens": 2})):
        r = live.http.post(path, json=body)
        assert _served(r, 2), r.text
    # A body without a Content-Type is taken as JSON (the /v1 endpoints take nothing else).
    r = live.http.post(C, content=_raw({"model": MODEL, "prompt": "untyped", "max_tokens": 1}))
    assert _served(r, 1), r.text

    def errors():
        m = live.http.get("/metrics").text
        return next(float(line.split()[1]) for line in m.splitlines() if line.startswith("k3_http_errors_total "))

    before = errors()
    assert live.http.post(C, content=b"x", headers={"Content-Type": "text/csv"}).status_code == 415
    assert errors() == before + 1  # the guard's answers are counted with the others


def test_valid_unicode_is_accepted():
    # Proper surrogate pairs, escaped or raw, and non-BMP text are fine; only lone surrogates are refused.
    assert check_json_text({"prompt": "\U0001F600 caf\u00e9", "stop": ["\u2603"]}) is None
    assert check_json_text(json.loads('{"prompt": "\\ud83d\\ude00"}')) is None
    assert check_json_text({"prompt": list(range(100_000))}) is None
    msg, param = check_json_text({"messages": [{"role": "user", "content": "ok"}, {"content": "x\udc80"}]})
    assert msg.startswith("messages[1].content contains a lone surrogate (U+DC80) at character 1") and \
        param == "messages"


# ---- size limit ---------------------------------------------------------------------------------------------------

def test_body_limit_by_content_length_and_streamed_bytes(ckpt, model):
    s = _build(ckpt, model, max_request_bytes=1000)
    pad = lambda n: _raw({"model": MODEL, "prompt": "x", "max_tokens": 1, "pad": "p" * n})  # noqa: E731
    base = len(pad(0))
    with TestClient(s.app) as c:
        at_limit, over = pad(1000 - base), pad(1001 - base)
        assert (len(at_limit), len(over)) == (1000, 1001)
        r = c.post(C, content=at_limit, headers=JSON)
        assert _served(r, 1), r.text
        r = c.post(C, content=over, headers=JSON)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.json()["error"]["message"] == (
            "the request body (1001 bytes) is larger than this server's limit of 1000 bytes (0.000953674 MiB); send a "
            "smaller request, or start the server with a larger --max-request-mb")
        # Streamed without a Content-Length: counted as it arrives.
        r = c.post(C, content=_chunks(over, 100), headers=JSON)
        assert r.status_code == 413 and "(streamed) is larger" in r.json()["error"]["message"]
        r = c.post(C, content=_chunks(at_limit, 100), headers=JSON)
        assert r.status_code == 200
        # Too large is answered before the body is parsed: invalid JSON over the limit is a 413, not a 400.
        assert c.post(C, content=b"{" * 2000, headers=JSON).status_code == 413
    with pytest.raises(ValueError, match="max_request_bytes must be a positive integer, got 0"):
        _build(ckpt, model, max_request_bytes=0)


def test_body_over_the_content_length_limit_is_never_read():
    from k3.serve.guard import BodyGuardMiddleware

    calls, payload = [], [b"x" * 2000]

    async def app(scope, receive, send):
        calls.append("app")

    async def receive():
        calls.append("receive")
        return {"type": "http.request", "body": payload[0], "more_body": False}

    sent = []

    async def send(message):
        sent.append(message)

    guard = BodyGuardMiddleware(app, max_bytes=1000)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-length", b"2000"), (b"content-type", b"application/json")]}
    asyncio.run(guard(scope, receive, send))
    assert calls == [] and sent[0]["status"] == 413
    # Under the limit the app gets the whole body in one message, then the client's own messages.
    scope["headers"][0] = (b"content-length", b"20")
    payload[0] = b"y" * 20
    got = []

    async def app2(scope, receive, send):
        got.append(await receive())

    asyncio.run(BodyGuardMiddleware(app2, max_bytes=1000)(scope, receive, send))
    assert got[0] == {"type": "http.request", "body": b"y" * 20, "more_body": False} and calls == ["receive"]


def test_max_request_mb_flag_reaches_the_app(ckpt, model, monkeypatch):
    import k3.serve.cli as serve_cli
    from k3.serve.guard import DEFAULT_MAX_REQUEST_BYTES
    from k3.serve.options import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert p.parse_args(["--ckpt", "d"]).max_request_mb is None
    assert p.parse_args(["--ckpt", "d", "--max-request-mb", "0.5"]).max_request_mb == 0.5
    for bad in ("0", "-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit):
            p.parse_args(["--ckpt", "d", "--max-request-mb", bad])

    s = _build(ckpt, model)
    seen = {}
    real_create_app = serve_cli.create_app

    def spy(*a, **kw):
        seen.update(kw)
        return real_create_app(*a, **kw)

    monkeypatch.setattr(serve_cli, "build_engine", lambda *a, **kw: (s.engine, s.tok, None))
    monkeypatch.setattr(serve_cli, "create_app", spy)
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.setdefault("app", app))
    assert serve_cli.cmd_serve(p.parse_args(["--ckpt", str(ckpt), "--max-request-mb", "3"])) == 0
    assert seen["max_request_bytes"] == 3 * 2**20 and seen["app"] is not None
    assert serve_cli.cmd_serve(p.parse_args(["--ckpt", str(ckpt)])) == 0
    assert seen["max_request_bytes"] == DEFAULT_MAX_REQUEST_BYTES == 8 * 2**20


# ---- prompt length bound before tokenizing --------------------------------------------------------------------------

class _CountingEncode:
    def __init__(self, tok):
        self.calls, self._encode = 0, tok.encode

    def __call__(self, text):
        self.calls += 1
        return self._encode(text)


def test_max_token_bytes_bounds_every_token(ckpt):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    from k3.data.tokenizer import load_any_tokenizer
    from k3.serve.guard import max_token_bytes

    tok = load_any_tokenizer(ckpt)
    per = max_token_bytes(tok)
    longest = max(len(tok.decode([i]).encode("utf-8")) for i in range(tok.vocab_size))
    assert per is not None and longest <= per  # no token decodes to more bytes than the bound
    assert per == max(len(t.encode("utf-8")) for t in tok.tokenizer.get_vocab(with_added_tokens=True))
    assert max_token_bytes(K3Tokenizer.byte_level()) == len("<|endoftext|>")
    # Where a tokenizer may drop or shrink text before splitting it, there is no bound: prompts are tokenized.
    shrinking = K3Tokenizer.byte_level()
    shrinking.tokenizer.normalizer = normalizers.NFKC()
    assert max_token_bytes(shrinking) is None
    dropping = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1}, unk_token="<|endoftext|>"))
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()
    assert max_token_bytes(K3Tokenizer(dropping)) is None
    assert max_token_bytes(object()) is None


def test_ten_megabyte_prompt_is_rejected_without_tokenizing(ckpt, model, monkeypatch):
    s = _build(ckpt, model, max_request_bytes=16 * 2**20)
    srv = s.app.state.server
    per = srv.max_token_bytes
    counter = _CountingEncode(s.tok)
    monkeypatch.setattr(s.tok, "encode", counter)
    n = 10_000_000
    with TestClient(s.app) as c:
        r = c.post(C, json={"model": MODEL, "prompt": "x" * n})
        assert r.status_code == 400 and counter.calls == 0
        err = r.json()["error"]
        assert (err["param"], err["code"]) == ("prompt", "context_length_exceeded")
        assert err["message"] == (f"the prompt is too long: its {n} characters make at least {-(-n // per)} tokens "
                                  f"(a token of this model's tokenizer covers at most {per} bytes), more than this "
                                  f"model's context of {CONTEXT} tokens")
        r = c.post(CHAT, json=_chat("y" * n))
        assert r.status_code == 400 and counter.calls == 0
        assert r.json()["error"]["param"] == "messages" and "the prompt is too long" in r.json()["error"]["message"]
        r = c.post(C, json={"model": MODEL, "prompt": "short", "max_tokens": 1})
        assert r.status_code == 200 and counter.calls == 1  # the wrapper does see the encodes that happen


def test_length_bound_at_its_edge(ckpt, model, monkeypatch):
    s = _build(ckpt, model)
    per = s.app.state.server.max_token_bytes
    edge = CONTEXT * per  # the longest text the bound lets through to the tokenizer
    counter = _CountingEncode(s.tok)
    monkeypatch.setattr(s.tok, "encode", counter)
    with TestClient(s.app) as c:
        r = c.post(C, json={"model": MODEL, "prompt": "x" * edge})
        assert r.status_code == 400 and counter.calls == 1  # tokenized: the token count decides
        n_tokens = len(counter._encode("x" * edge))
        assert CONTEXT < n_tokens <= edge and f"it has {n_tokens} tokens" in r.json()["error"]["message"]
        r = c.post(C, json={"model": MODEL, "prompt": "x" * (edge + 1)})
        assert r.status_code == 400 and counter.calls == 1
        assert f"its {edge + 1} characters make at least" in r.json()["error"]["message"]
        # Few characters but many bytes: two-byte characters are counted in bytes.
        chars = edge // 2 + 1
        r = c.post(C, json={"model": MODEL, "prompt": "\u00e9" * chars})
        assert r.status_code == 400 and counter.calls == 1
        assert f"its {2 * chars} UTF-8 bytes make at least" in r.json()["error"]["message"]


# ---- token ids must decode ------------------------------------------------------------------------------------------

def _padded_tokenizer(vocab_size: int) -> K3Tokenizer:
    tok = K3Tokenizer.byte_level()
    tok.tokenizer.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - tok.vocab_size)])
    return K3Tokenizer(tok.tokenizer)


@pytest.mark.parametrize("tok_vocab", [261, 5000])  # the bare byte-level tokenizer (eos, bytes, chat markup), or more
def test_prompt_ids_must_be_in_the_model_and_the_tokenizer(ckpt, model, tok_vocab):
    tok = _padded_tokenizer(tok_vocab)
    assert tok.vocab_size == tok_vocab
    s = _build(ckpt, model, tokenizer=tok)
    model_vocab = s.engine.model.config.vocab_size
    assert model_vocab == 4096
    valid = min(model_vocab, tok_vocab)
    assert s.app.state.server.vocab_size == valid
    with TestClient(s.app) as c:
        r = c.post(C, json={"model": MODEL, "prompt": [5, valid], "max_tokens": 1})
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": f"prompt token id {valid} is out of range [0, {valid})",
                                     "type": "invalid_request_error", "param": "prompt", "code": None}
        r = c.post(C, json={"model": MODEL, "prompt": [5, valid - 1], "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2


# ---- memory ----------------------------------------------------------------------------------------------------------

def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads RSS from /proc")
def test_memory_returns_near_its_baseline_after_load(ckpt, model):
    """200 requests after 50 warm-up ones: small completions and chats, invalid text, 3 MiB prompts (under the 4 MiB
    limit; refused by the length bound) and 5 MiB bodies (413). RSS may grow by at most 30 MB: Python's and
    glibc's free lists, caches filled on first use and the bounded server structures (prefix-cache index, latency
    windows) account for a few MB, while a leak of the large requests alone (20 x 3 MiB body + its 3 MiB text)
    would be over 100 MB, and one of 150 KB per request 30 MB. The big bodies are built once, so the client
    (in this same process) allocates little per request."""
    s = _build(ckpt, model, max_request_bytes=4 * 2**20)
    big_prompt = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"x" * (3 * 2**20) + b'"}'
    over_limit = b"z" * (5 * 2**20)
    bad_text = _raw({"model": MODEL, "prompt": "\ud800"})

    def one(c, i):
        kind = i % 10
        if kind in (0, 1, 2, 3):
            r = c.post(C, json={"model": MODEL, "prompt": f"request {i}", "max_tokens": 1})
        elif kind in (4, 5, 6):
            r = c.post(CHAT, json={**_chat(f"message {i}"), "max_tokens": 1})
        elif kind == 7:
            r = c.post(C, content=bad_text, headers=JSON)
        elif kind == 8:
            r = c.post(C, content=big_prompt, headers=JSON)
        else:
            r = c.post(C, content=over_limit, headers=JSON)
        return r.status_code

    with TestClient(s.app) as c:
        warm = [one(c, i % 8) for i in range(50)]  # small requests only: the large ones are the load
        base = _rss_mb()
        codes = [one(c, i) for i in range(200)]
        grown = _rss_mb() - base
    assert sorted(set(warm)) == [200, 400] and sorted(set(codes)) == [200, 400, 413]
    assert codes.count(413) == 20 and codes.count(200) == 140
    assert grown < 30, f"RSS grew by {grown:.1f} MB over 200 requests (baseline {base:.0f} MB)"
