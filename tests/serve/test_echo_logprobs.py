"""Prompt log-probabilities (SamplingParams.prompt_logprobs) and `echo` on /v1/completions, as lm-evaluation-harness's
`local-completions` model uses them for log-likelihood (multiple-choice) tasks.

Engine level, every prompt logprob is checked against log_softmax of one plain full-sequence forward
(`model(ids).logits`), in fp32, to 1e-4 absolute: over chunked prefill, in steps that mix the scored request with
ordinary decoding and prefilling requests, and for a prompt the prefix cache holds (scoring skips the lookup). Over
HTTP (a real uvicorn server on 127.0.0.1, as in test_server.py), the request bodies lm-eval sends come back in the
OpenAI/vLLM shape, and lm-eval's own parsing of them (the sum over the continuation, is_greedy) gives the reference
values. The model is random and unscaled (its logits are small), so fp32 rounding stays far below the tolerance.
"""

import functools
from types import SimpleNamespace

import httpx
import pytest
import torch
from openai import OpenAI

from helpers import randomize_, uvicorn_in_thread
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.generate import generate_tokens
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

TOL = 1e-4  # absolute, on fp32 log-probabilities
HB, PAGE = 16, 48
VOCAB = 512


@functools.lru_cache(maxsize=1)
def _model():
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=VOCAB, eos_token_id=0)
    return randomize_(K3ForCausalLM(cfg), seed=3).eval()


def _engine(chunk=40, step_tokens=96, enable=True, mb=4.0):
    eng = LLMEngine(_model(), None, EngineConfig(
        cache_memory_mb=mb, page_tokens=PAGE, hash_block_tokens=HB, enable_prefix_cache=enable,
        scheduler=SchedulerConfig(max_step_tokens=step_tokens, prefill_chunk=chunk, max_num_seqs=8,
                                  long_prompt_tokens=1000)))
    eng.eos_id = None
    return eng


def _ids(n, seed):
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _ref(model, ids):
    """log_softmax of a plain full-sequence forward: row j scores the token after position j. [T, V] fp32."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _check_prompt_logprobs(entries, ids, ref, k):
    """Every prompt entry against the reference: the token's logprob, and the top-k (values, and the ids' own
    reference logprobs), all to TOL."""
    assert len(entries) == len(ids) and entries[0] is None
    assert [e["token"] for e in entries[1:]] == ids[1:]
    got = torch.tensor([e["logprob"] for e in entries[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() <= TOL
    assert all(len(e["top"]) == k for e in entries[1:])
    if k:
        top_ids = torch.tensor([[i for i, _ in e["top"]] for e in entries[1:]])
        top_v = torch.tensor([[v for _, v in e["top"]] for e in entries[1:]])
        assert (ref[:-1].gather(1, top_ids) - top_v).abs().max().item() <= TOL
        assert (ref[:-1].topk(k).values - top_v).abs().max().item() <= TOL


def _run(eng, seqs):
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work() and all(s.finish_reason in ("length", "stop") for s in seqs)


# ---- engine level ----------------------------------------------------------------------------------------------------

def test_prompt_logprobs_over_chunked_prefill_equal_a_full_forward():
    model, eng = _model(), _engine(chunk=40)
    prompt = _ids(130, 1)  # four prefill chunks of at most 40 tokens (each split again at hash boundaries)
    ref = _ref(model, prompt)
    s0 = eng.add_request(prompt, SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=3))
    s1 = eng.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=0))
    _run(eng, [s0, s1])
    # max_tokens=0: the prompt is scored, nothing is generated.
    assert s0.finish_reason == "length" and s0.output_ids == [] and s0.logprobs == []
    _check_prompt_logprobs(s0.prompt_logprobs, prompt, ref, 3)
    _check_prompt_logprobs(s1.prompt_logprobs, prompt, ref, 0)
    assert s1.cached_tokens == 0
    # The generated tokens are the greedy reference, and their logprobs continue the prompt's.
    assert s1.output_ids == list(generate_tokens(model, prompt, SamplingParams(max_tokens=4, temperature=0)))
    full = _ref(model, prompt + s1.output_ids)
    for i, e in enumerate(s1.logprobs):
        assert e["token"] == s1.output_ids[i]
        assert abs(e["logprob"] - full[len(prompt) - 1 + i, e["token"]].item()) <= TOL


@pytest.mark.parametrize("step_tokens, other_len, mix", [
    # 2 decode tokens + the other prompt's 33-token chunk leave 1 token of the 36-token budget to the scored
    # prompt: its 1-token chunks run as rows of the decode steps' batch.
    (36, 99, "rows with decode steps"),
    # A 96-token budget: the scored prompt's chunks are packed into one row with the other prompt's.
    (96, 20, "packed with a prefill"),
])
def test_scored_request_in_steps_mixed_with_other_requests(step_tokens, other_len, mix):
    model = _model()
    eng = _engine(chunk=33, step_tokens=step_tokens)
    calls = []
    execute = eng.runner.execute

    def spy(batch):
        tokens, scores = batch.tokens, batch.scores
        if scores is not None:
            calls.append((len(set(map(len, tokens))) > 1, max(map(len, tokens)), [s is not None for s in scores]))
        return execute(batch)

    eng.runner.execute = spy
    greedy = SamplingParams(max_tokens=8, temperature=0)
    decoding = [eng.add_request(p, greedy) for p in (_ids(20, 2), _ids(25, 3))]
    for _ in range(2):
        eng.step()
    assert all(s.output_ids for s in decoding)  # decoding by now
    other = eng.add_request(_ids(other_len, 5), greedy)  # prefills beside the scored prompt
    prompt = _ids(130, 4)
    echo = eng.add_request(prompt, SamplingParams(max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=2))
    _run(eng, decoding + [echo, other])
    mixed = [c for c in calls if any(c[2]) and not all(c[2])]  # forwards of scored and unscored requests
    if mix == "rows with decode steps":
        assert any(not packed and longest == 1 and len(flags) >= 3 for packed, longest, flags in mixed), calls
    else:
        assert any(packed for packed, _, _ in mixed), calls
    _check_prompt_logprobs(echo.prompt_logprobs, prompt, _ref(model, prompt), 2)
    for s in decoding + [other, echo]:
        assert s.output_ids == list(generate_tokens(model, s.prompt_ids, SamplingParams(
            max_tokens=s.params.max_tokens, temperature=0)))


def test_a_prompt_the_prefix_cache_holds_is_still_scored():
    model, eng = _model(), _engine(chunk=40)
    greedy = SamplingParams(max_tokens=2, temperature=0)
    scored = SamplingParams(max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    prompt = _ids(65, 6)  # four hash blocks + 1: an ordinary request hits all but the last token
    ref = _ref(model, prompt)
    a = eng.add_request(prompt, greedy)
    _run(eng, [a])
    b = eng.add_request(prompt, greedy)
    _run(eng, [b])
    assert b.cached_tokens == 64  # the cache holds the whole prompt
    queries = eng.cache_stats()["queries"]
    c = eng.add_request(prompt, scored)
    _run(eng, [c])
    assert c.cached_tokens == 0 and eng.cache_stats()["queries"] == queries  # no lookup
    _check_prompt_logprobs(c.prompt_logprobs, prompt, ref, 1)
    assert c.output_ids == a.output_ids[:1]
    # A scored request still writes its blocks into the cache for later requests.
    fresh = _ids(65, 7)
    d = eng.add_request(fresh, scored)
    _run(eng, [d])
    e = eng.add_request(fresh, greedy)
    _run(eng, [e])
    assert d.cached_tokens == 0 and e.cached_tokens == 64
    _check_prompt_logprobs(d.prompt_logprobs, fresh, _ref(model, fresh), 1)


def test_sampling_params_allow_max_tokens_0_only_with_prompt_logprobs():
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
    with pytest.raises(ValueError, match="max_tokens must be a positive integer .0 only with prompt_logprobs., got 0"):
        SamplingParams(max_tokens=0).validate()
    with pytest.raises(ValueError, match="prompt_logprobs must be None or a non-negative integer, got -1"):
        SamplingParams(prompt_logprobs=-1).validate()


# ---- HTTP ------------------------------------------------------------------------------------------------------------

MODEL = "k3-echo-test"
CONTEXT = 160
HOST = "127.0.0.1"


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("uvicorn")
    from k3.data.tokenizer import K3Tokenizer
    from k3.serve.app import create_app

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=VOCAB, eos_token_id=0)
    model = randomize_(K3ForCausalLM(cfg), seed=5).eval()
    tok = K3Tokenizer.byte_level()
    # Only printable ASCII bytes are likely (bias -30 elsewhere): every likely token has its own one-character
    # string, so top_logprobs dicts keep every alternative and texts are readable.
    printable = [tok.encode(chr(c))[0] for c in range(32, 127)]
    bias = torch.full((VOCAB,), -30.0)
    bias[printable] = 0.0
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    ecfg = EngineConfig(cache_memory_mb=16, page_tokens=32, hash_block_tokens=16, max_model_len=CONTEXT,
                        scheduler=SchedulerConfig(max_num_seqs=16, max_step_tokens=256, prefill_chunk=48))
    engine = LLMEngine(model, tok, ecfg)
    app = create_app(engine, tok, MODEL)
    with uvicorn_in_thread(app, HOST) as port:
        yield SimpleNamespace(base=f"http://{HOST}:{port}", engine=engine, model=model, tok=tok,
                              ecfg=ecfg)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, trust_env=False, timeout=60) as c:
        yield c


def _lm_eval_parse(choice, ctxlen, n_generated):
    """lm-eval's LocalCompletionsAPI.parse_logprobs for one choice: the continuation is everything after the
    context but the generated tokens (it slices [ctxlen:-1] for its max_tokens=1 requests)."""
    end = len(choice["logprobs"]["token_logprobs"]) - n_generated
    lps = choice["logprobs"]["token_logprobs"][ctxlen:end]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:end]
    return sum(lps), all(lp == max(top.values()) for lp, top in zip(lps, tops))


CONTEXT_TEXT = "Question: which colour is the sky? Answer:"


@pytest.mark.parametrize("form", ["string", "ids", "batch of one ids", "batch of one string"])
@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("logprobs", [1, 5])
def test_lm_eval_request_shapes(server, http, form, max_tokens, logprobs):
    tok, model = server.tok, server.model
    text = CONTEXT_TEXT + " blue"
    ids = tok.encode(text)
    ctxlen = len(tok.encode(CONTEXT_TEXT))
    prompt = {"string": text, "ids": ids, "batch of one ids": [ids], "batch of one string": [text]}[form]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": logprobs, "max_tokens": max_tokens,
            "temperature": 0, "seed": 1234}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    P = len(ids)
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == max_tokens
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert all(len(v) == P + max_tokens for v in lp.values())
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    # text = prompt + generated text; the token strings cover it, offsets count them from 0.
    assert choice["text"].startswith(text) and "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(P + max_tokens)]
    ref = _ref(model, ids)
    for i in range(1, P + max_tokens):
        row = ref[i - 1]
        tid = ids[i] if i < P else tok.encode(lp["tokens"][i])[0]
        assert abs(lp["token_logprobs"][i] - row[tid].item()) <= TOL
        top = lp["top_logprobs"][i]
        # The top-`logprobs` alternatives, plus the token itself when it is not among them.
        want = row.topk(logprobs)
        want_strs = [tok.decode([int(j)]) for j in want.indices]
        assert set(top) == set(want_strs) | {lp["tokens"][i]}
        assert all(abs(top[s] - v.item()) <= TOL for s, v in zip(want_strs, want.values))
        assert abs(top[lp["tokens"][i]] - lp["token_logprobs"][i]) <= TOL
    if max_tokens:  # greedy: the generated token is the argmax after the prompt
        assert tok.encode(lp["tokens"][P])[0] == int(ref[P - 1].argmax())
    # lm-eval's log-likelihood of " blue" equals the engine's own prompt logprobs of it and the plain forward's.
    eng = LLMEngine(model, None, server.ecfg)
    s, = eng.generate([ids], SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=0))
    engine_sum = sum(e["logprob"] for e in s.prompt_logprobs[ctxlen:])
    total, _ = _lm_eval_parse(choice, ctxlen, max_tokens)
    assert abs(total - engine_sum) <= TOL
    assert abs(total - ref[torch.arange(ctxlen - 1, P - 1), torch.tensor(ids[ctxlen:])].sum().item()) <= TOL


def test_is_greedy_follows_the_models_argmax(server, http):
    tok, model = server.tok, server.model
    ctx = tok.encode(CONTEXT_TEXT)
    greedy = list(generate_tokens(model, ctx, SamplingParams(max_tokens=3, temperature=0)))
    ref = _ref(model, ctx)
    second = int(ref[-1].topk(2).indices[1])  # a continuation whose first token is not the argmax
    for cont, want_greedy in ((greedy, True), ([second] + greedy[1:], False)):
        ids = ctx + cont
        for max_tokens in (0, 1):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "echo": True, "logprobs": 1,
                                                   "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
            assert r.status_code == 200, r.text
            total, is_greedy = _lm_eval_parse(r.json()["choices"][0], len(ctx), max_tokens)
            assert is_greedy is want_greedy
            full = _ref(model, ids)
            want = full[torch.arange(len(ctx) - 1, len(ids) - 1), torch.tensor(cont)].sum().item()
            assert abs(total - want) <= TOL


def test_a_stop_token_keeps_its_logprob_entry(server, http):
    """A max_tokens=1 request whose one token is the end-of-text token still answers prompt + 1 entries (the text
    leaves the token out), so lm-eval's [ctxlen:-1] still drops exactly the generated entry."""
    tok, model, engine = server.tok, server.model, server.engine
    ids = tok.encode(CONTEXT_TEXT + " blue")
    nxt = int(_ref(model, ids)[-1].argmax())
    old = engine.eos_id
    engine.eos_id = nxt  # the greedy next token ends the request (the engine is idle between tests)
    try:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [ids], "echo": True, "logprobs": 1,
                                               "max_tokens": 1, "temperature": 0})
    finally:
        engine.eos_id = old
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == CONTEXT_TEXT + " blue"
    assert len(choice["logprobs"]["tokens"]) == len(ids) + 1
    assert tok.encode(choice["logprobs"]["tokens"][-1])[0] == nxt


def test_echo_without_logprobs_and_a_prompt_filling_the_context(server, http):
    tok, model = server.tok, server.model
    # 70 tokens: the last checkpoint (at 64) stays, as the 3 new tokens reach no later hash boundary.
    text = ("abcdefghijklmnopqrstuvwxyz" * 3)[:70]
    for _ in range(2):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "echo": True, "max_tokens": 3,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["logprobs"] is None and choice["text"].startswith(text) and len(choice["text"]) == len(text) + 3
    # Nothing to score: the repeat may hit the prefix cache.
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "echo": True, "logprobs": 0,
                                           "max_tokens": 0})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # scored: no hit
    assert all(len(t) == 1 for t in r.json()["choices"][0]["logprobs"]["top_logprobs"][1:])
    # max_tokens=0 lets the prompt fill the whole context; one more token does not fit.
    ids = [tok.encode(chr(32 + i % 95))[0] for i in range(CONTEXT)]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1,
                                           "max_tokens": 0})
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    ref = _ref(model, ids)
    assert len(got) == CONTEXT and got[0] is None
    assert max(abs(g - ref[i - 1, ids[i]].item()) for i, g in enumerate(got) if i) <= TOL
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1,
                                           "max_tokens": 1})
    assert r.status_code == 400 and "prompt is too long" in r.json()["error"]["message"]


@pytest.mark.parametrize("body, words, param", [
    ({"max_tokens": 0}, "max_tokens=0 is allowed only with echo=true", "max_tokens"),
    ({"max_tokens": 0, "echo": False, "logprobs": 1}, "max_tokens=0 is allowed only with echo=true", "max_tokens"),
    ({"max_tokens": -1, "echo": True}, "greater than or equal to 0", "max_tokens"),
    ({"echo": True, "stream": True}, "echo is not supported with stream=true", "echo"),
])
def test_bad_echo_requests(server, http, body, words, param):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["param"] == param, err


def test_openai_client_echo(server):
    tok, model = server.tok, server.model
    hc = httpx.Client(trust_env=False, timeout=60)
    try:
        client = OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60, http_client=hc)
        prompt = "The quick brown fox"
        r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    finally:
        hc.close()
    c = r.choices[0]
    ids = tok.encode(prompt)
    assert c.text == prompt and c.finish_reason == "length" and r.usage.completion_tokens == 0
    assert c.logprobs.tokens == [tok.decode([i]) for i in ids] and c.logprobs.text_offset == list(range(len(ids)))
    assert c.logprobs.token_logprobs[0] is None and c.logprobs.top_logprobs[0] is None
    ref = _ref(model, ids)
    assert max(abs(c.logprobs.token_logprobs[i] - ref[i - 1, ids[i]].item()) for i in range(1, len(ids))) <= TOL
