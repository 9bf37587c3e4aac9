"""The OpenAI-compatible server (k3.serve.app), the chat template (k3.serve.chat) and /metrics (k3.serve.metrics).

A real uvicorn server runs in a background thread on 127.0.0.1 (a free port) over a random tiny checkpoint written by
`k3 init --tokenizer bytes` (the byte tokenizer: the prompts below are sized in bytes); it is driven with the official
`openai` client and, for malformed requests, with httpx. Every HTTP client here has trust_env=False (no proxies) and
talks only to 127.0.0.1; every wait is bounded in count and time.

The random model mostly predicts ids outside the byte-level tokenizer's 257 tokens (which decode to nothing), so the
fixture gives the loaded model's head a bias of -30 on every id but the printable ASCII bytes: outputs are then
readable text, which the stop-string and streaming tests need. Tests use greedy decoding and a few tokens.
"""

import argparse
import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest

from helpers import tiny_chat_checkpoint, uvicorn_in_thread
import torch
from openai import OpenAI

from k3.serve.chat import (CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE, ChatTemplate, load_chat_template, render_chat,
                           render_chat_ids, save_chat_template, stop_strings)
from k3.serve.engine import RequestOutput
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import Status

uvicorn = pytest.importorskip("uvicorn")

API_KEY = "k3-test-key"
MODEL = "k3-tiny-test"
CONTEXT = 256  # a short context, so "prompt longer than the context" is cheap to send
HOST = "127.0.0.1"


def _printable_ascii_only(model, tok) -> None:
    ids = sorted({tok.encode(chr(c))[0] for c in range(32, 127)})
    assert all(len(tok.encode(chr(c))) == 1 for c in range(32, 127))
    bias = torch.full((model.config.vocab_size,), -30.0)
    bias[ids] = 0.0
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.serve.app import create_app

    ckpt = tmp_path_factory.mktemp("serve") / "tiny"
    # the byte tokenizer (k3 init's default is a BPE), for which the prompts below are sized
    model, tok = tiny_chat_checkpoint(ckpt)
    _printable_ascii_only(model, tok)
    # Small pages and hash blocks, so a ~60-token prompt sent twice hits the prefix cache.
    cfg = EngineConfig(cache_memory_mb=16, page_tokens=32, hash_block_tokens=16, max_model_len=CONTEXT,
                       scheduler=SchedulerConfig(max_num_seqs=64, max_step_tokens=512, prefill_chunk=256))
    engine = LLMEngine(model, tok, cfg)
    app = create_app(engine, tok, MODEL, api_key=API_KEY, chat_template=load_chat_template(ckpt))

    async def boom():
        raise RuntimeError("a bug")

    app.add_api_route("/v1/test-boom", boom, methods=["GET"])

    with uvicorn_in_thread(app, HOST) as port:
        yield SimpleNamespace(port=port, base=f"http://{HOST}:{port}", engine=engine, tok=tok, app=app,
                              template=load_chat_template(ckpt))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, trust_env=False, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    hc = httpx.Client(trust_env=False, timeout=60, limits=httpx.Limits(max_connections=128))
    c = OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0, timeout=60, http_client=hc)
    yield c
    hc.close()


def _greedy(client, prompt, n=6, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw)


def _stream_text(client, **kw):
    parts, reasons = [], []
    for ch in client.completions.create(model=MODEL, stream=True, **kw):
        for c in ch.choices:
            parts.append(c.text)
            reasons.append(c.finish_reason)
    return "".join(parts), [r for r in reasons if r is not None]


def _cache_state(engine):
    with engine.lock:
        st = engine.cache_stats()
        return {"reclaimable": st["free_pages"] + st["evictable_pages"], "running": st["running"],
                "seqs": set(engine.seqs), "sched_running": len(engine.scheduler.running),
                "waiting": engine.scheduler.num_waiting}


def _wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = _cache_state(engine)
        if not s["seqs"] and not s["sched_running"] and not s["waiting"]:
            return s
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {s}")


def _parse_metrics(text):
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


# ---- the chat template -----------------------------------------------------------------------------------------------

def test_render_chat_and_stop_strings():
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello."}, {"role": "tool", "content": "42"},
            {"role": "user", "content": "And?"}]
    # format_version 2 (XTML): the assistant message holds channels; instruct mode's generation prefix opens the
    # response channel inside a new assistant message (tests/serve/test_chat_template.py covers the rest).
    assert render_chat(msgs) == (
        "[open]system[sep]Be brief.[end_of_msg][close]system[sep]"
        "[open]user[sep]Hi there[end_of_msg][close]user[sep]"
        "[open]assistant[sep][open]response[sep]Hello.[close]response[sep][end_of_msg][close]assistant[sep]"
        "[open]tool[sep]42[end_of_msg][close]tool[sep]"
        "[open]user[sep]And?[end_of_msg][close]user[sep]"
        "[open]assistant[sep][open]response[sep]")
    assert render_chat([{"role": "assistant", "content": None}], add_generation_prompt=False).endswith(
        "[open]response[sep][close]response[sep][end_of_msg][close]assistant[sep]")
    assert stop_strings() == ["[end_of_msg]", "[close]response[sep]"]


@pytest.mark.parametrize("messages, words", [
    ("hi", "list"), ([], "at least one"), (["hi"], "messages[0]"), ([{"role": "wizard", "content": "x"}], "role"),
    ([{"content": "x"}], "role"), ([{"role": "user"}], "content"), ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": None}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "image_url"),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "text"),
])
def test_render_chat_rejects_bad_messages(messages, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        render_chat(messages)


def test_chat_template_file(tmp_path):
    assert load_chat_template(tmp_path) == DEFAULT_CHAT_TEMPLATE  # no file: the default
    custom = ChatTemplate(end_of_message="<eom>")
    path = save_chat_template(tmp_path, custom)
    assert path.endswith(CHAT_TEMPLATE_FILE)
    loaded = load_chat_template(tmp_path)
    assert loaded == custom and render_chat([{"role": "user", "content": "x"}], loaded).count("<eom>") == 1
    (tmp_path / CHAT_TEMPLATE_FILE).write_text('{"format_version": 2, "open": 5}')
    with pytest.raises(ValueError, match="'open'"):
        load_chat_template(tmp_path)
    (tmp_path / CHAT_TEMPLATE_FILE).write_text('{"stop": "oops"}')  # a format_version 1 field that cannot map
    with pytest.raises(ValueError, match="stop.*k3 chat-template migrate"):
        load_chat_template(tmp_path)
    (tmp_path / CHAT_TEMPLATE_FILE).write_text('{"colour": 1}')
    with pytest.raises(ValueError, match="unknown chat template fields"):
        load_chat_template(tmp_path)


# ---- the engine loop, over a fake engine ----------------------------------------------------------------------------

class _FakeEngine:
    """Finishes each request after one token; the first step raises."""

    def __init__(self):
        self.lock = threading.RLock()
        self.seqs, self.aborted, self.steps = {}, [], 0

    def add_request(self, prompt_ids, params, request_id=None):
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        seq = SimpleNamespace(request_id=request_id, prompt_ids=prompt_ids, params=params, status=Status.WAITING,
                              finish_reason=None, output_ids=[], text="", cached_tokens=0)
        self.seqs[request_id] = seq
        return seq

    def abort_request(self, rid):
        self.aborted.append(rid)
        self.seqs.pop(rid, None)

    def has_work(self):
        return bool(self.seqs)

    def step(self):
        self.steps += 1
        if self.steps == 1:
            raise RuntimeError("simulated failure")
        outs = []
        for rid, seq in list(self.seqs.items()):
            del self.seqs[rid]
            if seq.prompt_ids == [9]:  # as the engine drops a request that cannot fit the cache: no output
                seq.status, seq.finish_reason = Status.FINISHED, "error: the request does not fit in the cache"
                continue
            seq.status, seq.text = Status.FINISHED, "x"
            outs.append(RequestOutput(rid, [1], "x", True, "length"))
        return outs


def test_engine_loop_survives_a_failing_step():
    from k3.serve.engine_loop import EngineLoop, Failure

    fake = _FakeEngine()
    loop = EngineLoop(fake, idle_wait_s=5.0)  # a long idle wait: submissions must wake the thread

    async def main():
        h1 = loop.submit([1, 2], SamplingParams(max_tokens=1), request_id="a")
        first = await asyncio.wait_for(h1.queue.get(), 10)
        assert isinstance(first, Failure) and first.status == 500 and "simulated failure" in first.message
        assert fake.aborted == ["a"]  # its pages were freed
        h2 = loop.submit([1, 2], SamplingParams(max_tokens=1), request_id="b")
        out = await asyncio.wait_for(h2.queue.get(), 2)  # well under idle_wait_s
        assert isinstance(out, RequestOutput) and out.finished and out.request_id == "b"
        h3 = loop.submit([], SamplingParams(max_tokens=1), request_id="c")
        bad = await asyncio.wait_for(h3.queue.get(), 2)
        assert isinstance(bad, Failure) and bad.status == 400 and "empty" in bad.message
        h4 = loop.submit([9], SamplingParams(max_tokens=1), request_id="d")
        unfit = await asyncio.wait_for(h4.queue.get(), 2)
        assert isinstance(unfit, Failure) and unfit.status == 400 and "does not fit" in unfit.message

    try:
        asyncio.run(main())
    finally:
        loop.stop(10)
    assert not loop.alive and loop.step_failures == 1


def test_serve_arguments():
    from k3.serve.options import add_serve_arguments

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    a = p.parse_args(["--ckpt", "some/dir"])
    assert (a.ckpt, a.host, a.port, a.device) == ("some/dir", "127.0.0.1", 8000, "auto")
    a = p.parse_args(["--ckpt", "d", "--page-tokens", "64", "--hash-block-tokens", "16", "--max-num-seqs", "4",
                      "--max-step-tokens", "128", "--prefill-chunk", "32", "--cache-memory-mb", "8",
                      "--api-key", "k", "--model-name", "m", "--port", "9"])
    assert (a.page_tokens, a.hash_block_tokens, a.max_num_seqs, a.max_step_tokens, a.prefill_chunk) == \
        (64, 16, 4, 128, 32)
    assert (a.cache_memory_mb, a.api_key, a.model_name, a.port) == (8.0, "k", "m", 9)
    with pytest.raises(SystemExit):
        p.parse_args([])


# ---- the server -------------------------------------------------------------------------------------------------

def test_health_and_models(server, client, http):
    r = httpx.get(f"{server.base}/health", trust_env=False, timeout=10)  # no API key needed
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    r = http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "no such endpoint" in r.json()["error"]["message"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_completion(server, client):
    prompt = "The quick brown fox"
    r = _greedy(client, prompt, n=5)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and isinstance(c.text, str) and len(c.text) == 5
    n_prompt = len(server.tok.encode(prompt))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 5, n_prompt + 5)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # The same prompt as token ids gives the same greedy text; logprobs have one entry per token.
    r2 = client.completions.create(model=MODEL, prompt=server.tok.encode(prompt), max_tokens=5, temperature=0,
                                   logprobs=2)
    assert r2.choices[0].text == c.text
    lp = r2.choices[0].logprobs
    assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == 5 and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.text_offset == [0, 1, 2, 3, 4]
    # Seeded sampling is reproducible.
    a, b = (client.completions.create(model=MODEL, prompt="seeded", max_tokens=4, temperature=1.0, top_p=0.9,
                                      seed=7, extra_body={"top_k": 20}) for _ in range(2))
    assert a.choices[0].text == b.choices[0].text


def test_chat_completion(server, client):
    msgs = [{"role": "system", "content": "Answer."}, {"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    (c,) = r.choices
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("length", "stop")
    n_prompt = len(render_chat_ids(msgs, server.tok, server.template))  # the markup as special ids
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens <= 4
    assert not any(s in c.message.content for s in server.template.stop)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)
    assert r.choices[0].message.content == c.message.content
    lps = r.choices[0].logprobs.content
    assert "".join(x.token for x in lps) == c.message.content
    assert all(len(x.top_logprobs) == 3 and x.top_logprobs[0].logprob >= x.logprob - 1e-6 for x in lps)


def test_streaming_matches_non_streaming(server, client):
    prompt = "Once upon a"  # under one hash block: no prefix-cache hit, identical computation both times
    text, reasons = _stream_text(client, prompt=prompt, max_tokens=6, temperature=0)
    full = _greedy(client, prompt, n=6).choices[0]
    assert text == full.text and len(text) == 6 and reasons == [full.finish_reason] == ["length"]

    msgs = [{"role": "user", "content": "Tell"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    ref = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    assert streamed == ref.choices[0].message.content and finals == [ref.choices[0].finish_reason]
    assert chunks[-1].choices == [] and usage.completion_tokens == ref.usage.completion_tokens
    assert usage.prompt_tokens == ref.usage.prompt_tokens


def test_stop_sequences(server, client):
    prompt = "Stop here:"
    base = _greedy(client, prompt, n=12).choices[0].text
    assert len(base) == 12
    # A stop string taken from the output, if possible one whose first occurrence is not at the start.
    stop = next((base[i:i + k] for k in (2, 1) for i in range(1, 11) if base.find(base[i:i + k]) > 0), base[:2])
    want = base[: base.find(stop)]
    r = _greedy(client, prompt, n=12, stop=stop, logprobs=1).choices[0]
    assert r.text == want and stop not in r.text and r.finish_reason == "stop"
    assert "".join(r.logprobs.tokens) == want  # no logprobs for the tokens of the stop string
    text, reasons = _stream_text(client, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "\u2603"])
    assert text == want and reasons == ["stop"]
    # A stop string that never occurs changes nothing.
    r = _greedy(client, prompt, n=12, stop=["\u2603"]).choices[0]
    assert r.text == base and r.finish_reason == "length"
    # The output ends with a prefix of a stop string: the engine holds that tail back while generating; at a length
    # finish the text is complete, streamed or not.
    tail_stop = base[-1] + "\u2603"
    r = _greedy(client, prompt, n=12, stop=tail_stop).choices[0]
    assert r.text == base and r.finish_reason == "length"
    text, reasons = _stream_text(client, prompt=prompt, max_tokens=12, temperature=0, stop=tail_stop)
    assert text == base and reasons == ["length"]


def test_64_concurrent_streaming_clients(server, client):
    engine, n = server.engine, 64
    peak = [0]
    done = threading.Event()

    def watch():
        while not done.wait(0.01):
            peak[0] = max(peak[0], len(engine.scheduler.running) + engine.scheduler.num_waiting)

    def one(i):
        return _stream_text(client, prompt=f"client {i}", max_tokens=4, temperature=0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        with ThreadPoolExecutor(n) as pool:
            results = list(pool.map(one, range(n), timeout=120))
    finally:
        done.set()
        watcher.join(5)
    assert len(results) == n
    for text, reasons in results:
        assert reasons in (["length"], ["stop"]) and len(text) <= 4
    assert peak[0] > 1  # they really were in the engine together
    _wait_idle(engine)


def test_client_disconnect_frees_the_request(server, http, monkeypatch):
    engine = server.engine
    before = _wait_idle(engine)
    # steps of 10 ms at least, so the 200 tokens take seconds: on a loaded machine the tiny model could otherwise
    # finish them before this client has read two chunks, and there would be nothing left to abort
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.01), step())[1])
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 200, "temperature": 0, "stream": True}
    rid, got = None, 0
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                rid = json.loads(line[6:])["id"]
                got += 1
                if got >= 2:
                    break
        assert rid is not None and rid in engine.seqs  # still generating
    # Leaving the block closed the connection mid-stream: the server aborts the request and frees its pages.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = _cache_state(engine)
        if rid not in s["seqs"] and s["running"] == 0 and s["reclaimable"] == before["reclaimable"]:
            break
        time.sleep(0.05)
    assert rid not in s["seqs"] and s["sched_running"] == 0 and s["running"] == 0
    assert s["reclaimable"] == before["reclaimable"]
    m = _parse_metrics(http.get("/metrics").text)
    assert m["k3_requests_aborted_total"] >= 1


def test_non_streaming_client_that_leaves_is_aborted(server):
    engine, loop = server.engine, server.app.state.engine_loop
    before = _wait_idle(engine)
    finished, aborted = engine.metrics.requests_finished, loop.aborted
    body = {"model": MODEL, "prompt": "Waiting", "max_tokens": 245, "temperature": 0}
    with httpx.Client(base_url=server.base, trust_env=False, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=httpx.Timeout(10, read=0.3)) as c:
        with pytest.raises(httpx.ReadTimeout):  # gives up and closes the connection
            c.post("/v1/completions", json=body)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        s = _cache_state(engine)
        if not s["seqs"] and s["running"] == 0 and s["reclaimable"] == before["reclaimable"]:
            break
        time.sleep(0.05)
    assert not s["seqs"] and s["sched_running"] == 0 and s["reclaimable"] == before["reclaimable"]
    assert loop.aborted == aborted + 1 and engine.metrics.requests_finished == finished


BAD_REQUESTS = [
    # (path, body (bytes: sent raw), status, words in the message, param)
    ("/v1/completions", b'{"model": "k3", "prompt": ', 400, "not valid JSON", None),
    ("/v1/completions", [1, 2], 400, "JSON object", None),
    ("/v1/completions", {"model": MODEL}, 400, "'prompt' is a required field", "prompt"),
    ("/v1/completions", {"prompt": "x"}, 400, "'model' is a required field", "model"),
    ("/v1/completions", {"model": MODEL, "prompt": 12}, 400, "prompt must be a string", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "batched prompts", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [5000]}, 400, "out of range", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "empty", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2.5}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "greater than or equal to 0",
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**12}, 400, "at most 255 new tokens",
     "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10**30}, 400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 300}, 400, "prompt is too long", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 200, "max_tokens": 100}, 400, "at most 56", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 5}, 400, "temperature", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "top_k": -5}, 400, "top_k", "top_k"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": 5}, 400, "stop must be a string", "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "non-empty", "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "n=2 is not supported", "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "stream": True}, 400,
     "echo is not supported with stream=true", "echo"),
    ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "'gpt-9' does not exist", "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "'messages' is a required field", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "list", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "at least one", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}]}, 400,
     "prompt is too long", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
     400, "max_tokens", "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 10**6}, 400, "max_completion_tokens (1000000) is too large",
     "max_completion_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400,
     "tools[0] must be {\"type\": \"function\"", "tools"),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404,
     "does not exist", "model"),
]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, client, http):
    for path, body, status, words, param in BAD_REQUESTS:
        if isinstance(body, bytes):
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post(path, json=body)
        assert r.status_code == status, (body, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert words in err["message"], (body, err)
        assert err["param"] == param, (body, err)
    # The official client sees them as the matching exceptions, with our message.
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10**9)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    # An unexpected exception is a 500 in the same shape.
    r = http.get("/v1/test-boom")
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    # And a normal request still works.
    r = _greedy(client, "still alive", n=3)
    assert len(r.choices[0].text) == 3 and r.choices[0].finish_reason == "length"
    _wait_idle(server.engine)


def test_api_key(server, client):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    with httpx.Client(base_url=server.base, trust_env=False, timeout=30) as anon:
        r = anon.post("/v1/completions", json=body)
        assert r.status_code == 401 and "missing API key" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "authentication_error"
        r = anon.post("/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "invalid API key" in r.json()["error"]["message"]
        r = anon.post("/v1/completions", content=b"{not json", headers={"Authorization": "Basic abc"})
        assert r.status_code == 401  # the key is checked before the body is looked at
        assert anon.get("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200 and anon.get("/metrics").status_code == 200
    hc = httpx.Client(trust_env=False, timeout=30)
    try:
        wrong = OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0, http_client=hc)
        with pytest.raises(openai.AuthenticationError, match="invalid API key"):
            wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
    finally:
        hc.close()
    assert len(_greedy(client, "x", n=1).choices[0].text) == 1


def test_metrics_show_prefix_cache_hits(server, client, http):
    prompt = "Prefix caching: the first request computes this prompt, the second one reuses it."
    assert 60 <= len(server.tok.encode(prompt)) < 100
    first = _greedy(client, prompt, n=1)
    second = _greedy(client, prompt, n=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 48  # whole 16-token hash blocks of the first request's prompt
    assert second.choices[0].text == first.choices[0].text
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for name, kind in [("k3_time_to_first_token_seconds", "histogram"), ("k3_time_per_output_token_seconds",
                       "histogram"), ("k3_queue_time_seconds", "histogram"),
                       ("k3_prompt_tokens_cached_total", "counter"), ("k3_prompt_tokens_computed_total", "counter"),
                       ("k3_generation_tokens_total", "counter"), ("k3_requests_finished_total", "counter"),
                       ("k3_preemptions_total", "counter"), ("k3_requests_running", "gauge"),
                       ("k3_requests_waiting", "gauge"), ("k3_cache_pages_total", "gauge"),
                       ("k3_cache_pages_free", "gauge"), ("k3_cache_bytes", "gauge")]:
        assert f"# TYPE {name} {kind}" in text, name
    m = _parse_metrics(text)
    assert m["k3_prompt_tokens_cached_total"] >= cached
    assert m["k3_prompt_tokens_computed_total"] > 0 and m["k3_generation_tokens_total"] > 0
    ttft_count = m["k3_time_to_first_token_seconds_count"]
    assert ttft_count >= 2 and m['k3_time_to_first_token_seconds_bucket{le="+Inf"}'] == ttft_count
    assert m["k3_requests_finished_total"] >= 2
    st = server.engine.cache_stats()
    assert m["k3_cache_pages_total"] == st["num_pages"] and m["k3_cache_bytes"] == st["pool_bytes"]
    assert 0 <= m["k3_cache_pages_free"] <= m["k3_cache_pages_total"]
