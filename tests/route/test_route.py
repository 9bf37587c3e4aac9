"""`k3 route` in front of three real `k3 serve` processes on 127.0.0.1 (k3.route.local), serving one random tiny
checkpoint with the byte tokenizer (`k3 init --tokenizer bytes`: a prompt's tokens are its bytes, so the router's
estimate is exact at --bytes-per-token 1) and small hash blocks (16 tokens), so that short prompts hit the prefix
cache. The fleet is started once for the module; each test starts its own router in a thread (k3.serve.local) and
reads the backends' own /metrics. The instance-killing test runs last and restarts the instance it killed.

Every HTTP client here has trust_env=False and talks only to 127.0.0.1; every wait is bounded.
"""

import contextlib
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from helpers import uvicorn_in_thread

from k3.cli import main
from k3.route.app import RouterConfig, create_app
from k3.route.local import start_fleet
from k3.route.requests import KeyOptions
from k3.serve.chat import save_chat_template

MODEL = "tiny"  # k3 serve's model name: the checkpoint directory's
BLOCK = 16  # the backends' hash block (tokens = bytes)
SERVE_ARGS = ["--cache-memory-mb", "64", "--page-tokens", "32", "--hash-block-tokens", str(BLOCK)]
WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "cache", "state", "token", "prefix", "block", "query", "value", "router", "budget"]


def _text(seed, n: int) -> str:
    rng = random.Random(seed)
    out = []
    while sum(len(w) + 1 for w in out) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)[:n]


def _blocks(text: str) -> str:
    """`text` cut to whole hash blocks. A prompt that ends on a block boundary, answered with fewer than BLOCK
    tokens, leaves its prefix cache's KDA checkpoint at its own end: the backend keeps a request's newest checkpoint
    only, so one whose decode reaches the next boundary keeps one inside its generated tokens, which the next turn
    (the prompt plus new text) does not repeat."""
    assert len(text) >= BLOCK
    return text[:len(text) // BLOCK * BLOCK]


def _metrics(url: str) -> dict:
    out = {}
    for line in httpx.get(f"{url}/metrics", trust_env=False, timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("route")
    ck = root / MODEL
    assert main(["init", "--preset", "tiny", "--tokenizer", "bytes", "--out", str(ck)]) == 0
    save_chat_template(ck)
    procs = start_fleet(str(ck), 3, SERVE_ARGS, log_dir=str(root))
    yield procs
    for p in procs:
        p.stop()


@contextlib.contextmanager
def router(fleet, **kw):
    kw.setdefault("keys", KeyOptions(prefix_chars=48, bytes_per_token=1.0))
    kw.setdefault("health_interval_s", 0.5)
    app = create_app(RouterConfig(backends=[p.url for p in fleet], **kw))
    with uvicorn_in_thread(app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", trust_env=False,
                                                      timeout=120, limits=httpx.Limits(max_connections=64)) as c:
        yield SimpleNamespace(client=c, state=app.state.router)


def _complete(c, prompt, session=None, max_tokens=2, **kw):
    headers = {"X-Session-Id": session} if session else {}
    return c.post("/v1/completions", headers=headers,
                  json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **kw})


def _cached(resp) -> int:
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


# ---- malformed requests -------------------------------------------------------------------------------------------

def test_malformed_requests_are_answered_at_the_router(fleet):
    before = [_metrics(p.url) for p in fleet]
    json_type = {"content-type": "application/json"}
    cases = [
        ("/v1/completions", b"{not json", json_type, 400, None),
        ("/v1/completions", b"[1, 2]", json_type, 400, None),
        ("/v1/completions", json.dumps({"prompt": "x"}).encode(), json_type, 400, "model"),
        ("/v1/completions", json.dumps({"model": MODEL}).encode(), json_type, 400, "prompt"),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": {"a": 1}}).encode(), json_type, 400, "prompt"),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "max_tokens": "9"}).encode(), json_type, 400,
         "max_tokens"),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "stream": "yes"}).encode(), json_type, 400,
         "stream"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hi"}).encode(), json_type, 400, "messages"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"content": "x"}]}).encode(), json_type, 400,
         "messages[0].role"),
        ("/v1/completions", b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 415, None),
        ("/v1/completions", json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode(), json_type, 413, None),
        ("/v1/nothing", b"{}", json_type, 404, None),
    ]
    with router(fleet, max_request_bytes=4096) as r:
        for path, content, headers, status, param in cases:
            resp = r.client.post(path, content=content, headers=headers)
            assert resp.status_code == status, (path, content, resp.text)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert sum(b.requests for b in r.state.fleet.backends.values()) == 0
        text = r.client.get("/metrics").text
        assert f"k3_route_http_errors_total {len(cases)}" in text
    for b, a in zip(before, (_metrics(p.url) for p in fleet)):
        for name in ("k3_http_errors_total", "k3_requests_finished_total", "k3_prompt_tokens_computed_total"):
            assert a[name] == b[name], name


# ---- session affinity ---------------------------------------------------------------------------------------------

def test_a_sessions_turns_land_on_one_instance_and_hit_its_prefix_cache(fleet):
    """Sessions keyed by the header, by `user` and by their prompt's first characters: each turn (the prompt grown
    by a suffix) goes to the session's ring primary, and from the second turn on its prompt is found in that
    instance's prefix cache."""
    before = {p.url: _metrics(p.url) for p in fleet}
    reported = {p.url: 0 for p in fleet}
    with router(fleet) as r:
        ring = r.state.fleet.ring
        for i, kind in enumerate(["header", "user", "prompt", "header", "prompt"]):
            prompt = first = _blocks(f"session {i} ({kind}): " + _text(i, 160))
            key = {"header": f"session:s{i}", "user": f"user:u{i}", "prompt": "prompt:" + prompt[:48]}[kind]
            served = []
            for turn in range(3):
                extra = {"user": f"u{i}"} if kind == "user" else {}
                resp = _complete(r.client, prompt, f"s{i}" if kind == "header" else None, **extra)
                assert resp.status_code == 200, resp.text
                url = resp.headers["x-k3-backend"]
                served.append(url)
                if turn:  # the first turn's prompt is cached (from the third on, more may be)
                    assert _cached(resp) >= len(first), (turn, _cached(resp))
                reported[url] += _cached(resp)
                prompt += _blocks(f" reply {turn}. " + _text(f"{i}-{turn}", 64))
            assert served == [ring.primary(key)] * 3, (kind, served)
        hits = {b.url: b.affinity_hits for b in r.state.fleet.backends.values()}
        assert sum(hits.values()) == 15
    for url, m in before.items():
        after = _metrics(url)
        rose = after["k3_prefix_cache_hit_tokens_total"] - m["k3_prefix_cache_hit_tokens_total"]
        assert rose == after["k3_prompt_tokens_cached_total"] - m["k3_prompt_tokens_cached_total"] == reported[url]
    assert sum(reported.values()) >= 5 * 2 * 160


def test_round_robin_spreads_a_sessions_turns(fleet):
    with router(fleet, policy="round-robin") as r:
        served = [_complete(r.client, "round robin session " + _text(7, 80), "rr").headers["x-k3-backend"]
                  for _ in range(3)]
    assert sorted(served) == sorted(p.url for p in fleet)


# ---- streaming and cancellation -----------------------------------------------------------------------------------

def test_streams_pass_through_and_a_client_that_leaves_aborts_its_request(fleet):
    with router(fleet) as r:
        c = r.client
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Say something. " + _text(3, 60)}],
                "max_tokens": 6, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "chat"}) as resp:
            events = [line for line in resp.iter_lines() if line]
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        assert events[-1] == "data: [DONE]" and events.count("data: [DONE]") == 1
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert len({ch["id"] for ch in chunks}) == 1  # one backend's stream, nothing from another
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # held back, then sent with the output
        assert sum(1 for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]) == 1
        assert chunks[-1]["usage"]["completion_tokens"] <= 6

        # A client that leaves mid-stream: the backend's request is aborted (it would run for 2,000 tokens: greedy,
        # this checkpoint's answer to this prompt has no EOS in them; sampled, one in ~30 stopped within 1.5 s).
        url = r.state.fleet.ring.primary("session:leaver")
        aborted = _metrics(url)["k3_requests_aborted_total"]
        long = {"model": MODEL, "prompt": "Go on forever. " + _text(4, 40), "max_tokens": 2000, "stream": True,
                "temperature": 0}
        with c.stream("POST", "/v1/completions", json=long, headers={"X-Session-Id": "leaver"}) as resp:
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(3)]  # output arrives while the backend still generates
        assert all(g.startswith("data: {") or not g for g in got)
        _wait(lambda: _metrics(url)["k3_requests_aborted_total"] >= aborted + 1, 15, "the streamed abort")

        # ... and one that leaves while its non-streamed answer is being computed
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={**long, "stream": False}, headers={"X-Session-Id": "leaver"},
                   timeout=1.5)
        _wait(lambda: _metrics(url)["k3_requests_aborted_total"] >= aborted + 2, 15, "the non-streamed abort")
        _wait(lambda: all(b.in_flight == 0 for b in r.state.fleet.backends.values())
              and all(cl.running == 0 for cl in r.state.admission.classes), 10, "the router to let go")


# ---- per-class budgets --------------------------------------------------------------------------------------------

def test_class_budgets_hold_under_a_long_burst(fleet):
    """A burst of eight long requests (3,000 tokens each) against a long-class budget of 6,000 tokens: two run,
    two wait, four are refused at once with 429 and Retry-After; short requests sent during the burst are admitted
    at once, never queued."""
    with router(fleet, classes=["short:256:0.25", "long:inf:0.75"], fleet_tokens=8000, queue_wait_s=1.0,
                max_queued=2) as r:
        short, long = r.state.admission.classes
        assert (short.budget, long.budget) == (2000, 6000)
        peak = []

        def burst(i):
            return _complete(r.client, f"long request {i}: " + _text(100 + i, 3000), max_tokens=60)

        with ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(burst, i) for i in range(8)]
            _wait(lambda: long.rejected >= 4, 20, "the burst to fill the long class")
            quick = []
            for i in range(4):
                peak.append(long.in_flight)
                t0 = time.monotonic()
                resp = _complete(r.client, f"short request {i}: " + _text(200 + i, 100), max_tokens=2)
                assert resp.status_code == 200, resp.text
                quick.append(time.monotonic() - t0)
            results = [f.result() for f in futures]
        refused = [x for x in results if x.status_code == 429]
        assert len(refused) >= 4 and all(x.status_code in (200, 429) for x in results)
        for x in refused:
            err = x.json()["error"]
            assert err["code"] == "rate_limit_exceeded" and "'long' request class" in err["message"]
            assert int(x.headers["retry-after"]) >= 1
        assert max(peak) <= long.budget
        assert (short.admitted, short.queued, short.rejected, short.wait_seconds) == (4, 0, 0, 0.0)
        assert long.rejected == len(refused) and long.admitted == 8 - len(refused)
        text = r.client.get("/metrics").text
        assert 'k3_route_class_rejected_total{class="long"} ' + str(len(refused)) in text
        assert 'k3_route_class_queued_total{class="short"} 0' in text


# ---- failover -----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_killed_instance_loses_no_request_and_its_sessions_move_to_their_secondaries(fleet):
    """kill -9 of one instance while it prefills: every request is answered once (retried on the session's
    secondary when nothing had been sent; a stream that had output ends with one error event and no [DONE]), its
    sessions go on on their secondaries, which are both survivors, and come back when it is up again."""
    victim, survivors = fleet[2], fleet[:2]
    with router(fleet) as r:
        ring, c = r.state.fleet.ring, r.client
        moved = {p.url: [] for p in survivors}  # the victim's sessions, by secondary
        others = []
        for i in range(10_000):
            s = f"k{i}"
            primary, secondary = ring.owners(f"session:{s}", 2)
            if primary == victim.url and len(moved[secondary]) < 4:
                moved[secondary].append(s)
            elif primary != victim.url and len(others) < 4:
                others.append(s)
            if len(others) == 4 and all(len(v) == 4 for v in moved.values()):
                break
        victims = [s for v in moved.values() for s in v]
        prompts = {s: _blocks(f"session {s}: " + _text(s, 400)) for s in victims + others}

        with ThreadPoolExecutor(12) as ex:
            first = dict(zip(prompts, ex.map(lambda s: _complete(c, prompts[s], s), prompts)))
        assert all(x.status_code == 200 for x in first.values())
        assert {first[s].headers["x-k3-backend"] for s in victims} == {victim.url}

        def stream(s):
            body = {"model": MODEL, "prompt": prompts[s], "max_tokens": 8, "temperature": 0, "stream": True}
            ids, done, errors = set(), 0, []
            with c.stream("POST", "/v1/completions", json=body, headers={"X-Session-Id": s}) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        done += 1
                    elif line.startswith("data: "):
                        obj = json.loads(line[len("data: "):])
                        (errors.append(obj["error"]) if "error" in obj else ids.add(obj["id"]))
                return SimpleNamespace(status_code=resp.status_code, headers=resp.headers, ids=ids, done=done,
                                       errors=errors)

        # a stream that has sent output when the victim dies
        talker = next(f"t{i}" for i in range(10_000) if ring.primary(f"session:t{i}") == victim.url)
        body = {"model": MODEL, "prompt": "Talk. " + _text(5, 40), "max_tokens": 2000, "stream": True}
        with c.stream("POST", "/v1/completions", json=body, headers={"X-Session-Id": talker}) as talking:
            lines = talking.iter_lines()
            heard = [next(lines) for _ in range(4)]
            for s in prompts:
                prompts[s] += _blocks(" next turn: " + _text(f"{s}-2", 1000))  # long: the victim dies prefilling
            with ThreadPoolExecutor(12) as ex:
                futures = {s: ex.submit(stream, s) if k % 3 == 0 else ex.submit(_complete, c, prompts[s], s)
                           for k, s in enumerate(prompts)}
                _wait(lambda: r.state.fleet.backends[victim.url].in_flight >= 4, 30, "requests on the victim")
                victim.kill()
                second = {s: f.result() for s, f in futures.items()}
            rest = [line for line in lines if line]
        events = [json.loads(x[len("data: "):]) for x in heard + rest if x.startswith("data: {")]
        assert "data: [DONE]" not in rest and len({e["id"] for e in events[:-1]}) == 1  # its own output only
        assert events[-1]["error"]["code"] == "backend_failed" and "send the request again" in \
            events[-1]["error"]["message"]

        resent = []
        for s, x in second.items():
            assert x.status_code == 200, s
            if getattr(x, "errors", None):  # output had reached the client: one error event, no [DONE], no more
                assert len(x.ids) == 1 and x.done == 0 and len(x.errors) == 1, x
                assert x.errors[0]["code"] == "backend_failed" and x.headers["x-k3-backend"] == victim.url
                resent.append(s)
            elif isinstance(x, SimpleNamespace):
                assert len(x.ids) == 1 and x.done == 1, x
        for s in resent:  # what the error says to do: send it again
            second[s] = _complete(c, prompts[s], s)
            assert second[s].status_code == 200
        for secondary, sessions in moved.items():  # the victim's sessions went on on their own secondaries
            assert {second[s].headers["x-k3-backend"] for s in sessions} == {secondary}
        for s in others:
            assert second[s].headers["x-k3-backend"] == ring.primary(f"session:{s}")
        b = r.state.fleet.backends[victim.url]
        assert not b.healthy and b.marked_down >= 1 and b.errors >= 1
        assert b.retries + b.failovers >= len(victims) - len(resent)
        assert all(r.state.fleet.backends[p.url].errors == 0 for p in survivors)

        # the next turn stays on the secondary, whose cache now holds the session
        for s in victims:
            before = len(prompts[s])
            prompts[s] += _blocks(" third turn. " + _text(f"{s}-3", 40))
            x = _complete(c, prompts[s], s)
            assert x.headers["x-k3-backend"] == ring.owners(f"session:{s}", 2)[1]
            assert _cached(x) == before

        victim.start()  # the primary comes back and takes its sessions again
        victim.wait_ready()
        _wait(lambda: r.state.fleet.backends[victim.url].healthy, 10, "the router to see the victim up")
        for s in victims:
            assert _complete(c, prompts[s], s).headers["x-k3-backend"] == victim.url
