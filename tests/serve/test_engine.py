"""The engine against a cache-free reference: prefix-cache hits, chunked prefill, concurrency, preemption and
eviction never change what a request generates (greedy decoding)."""

import functools
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import randomize_
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.generate import generate_tokens
from k3.serve.runner import ForwardBatch
from k3.serve.sampling import SamplingParams, sample, sample_batch
from k3.serve.scheduler import SchedulerConfig

MAX_NEW = 5
HB, PAGE = 16, 48  # small hash blocks and pages so short prompts exercise every cache path


@functools.lru_cache(maxsize=1)
def _model():
    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=512, eos_token_id=0)
    m = randomize_(K3ForCausalLM(cfg), seed=3).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # wide logit gaps: greedy choices do not hinge on last-bit rounding
    return m


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple) -> list[int]:
    """Cache-free generation: one prefill, then token-by-token decode through the model's own cache."""
    return list(generate_tokens(_model(), list(prompt), GREEDY, eos_id=None))


def forward(eng, tokens, starts, slots):
    """The logits of one plain forward at the runner."""
    return eng.runner.execute(ForwardBatch(tokens, starts, slots)).logits


def _engine(mb=4.0, chunk=40, step_tokens=96, enable=True, max_num_seqs=8):
    eng = LLMEngine(_model(), None, EngineConfig(
        cache_memory_mb=mb, page_tokens=PAGE, hash_block_tokens=HB, enable_prefix_cache=enable,
        scheduler=SchedulerConfig(max_step_tokens=step_tokens, prefill_chunk=chunk, max_num_seqs=max_num_seqs,
                                  long_prompt_tokens=120)))
    eng.eos_id = None
    return eng


def _run(eng, waves):
    """Submit requests in waves, stepping the engine between waves; returns {id: outputs}."""
    seqs = []
    for wave in waves:
        for prompt in wave:
            seqs.append(eng.add_request(list(prompt), GREEDY))
        for _ in range(2):
            eng.step()
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work()
    return seqs


def test_engine_equals_reference_and_hits_inside_pages():
    base = torch.randint(1, 512, (200,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = _engine()
    # Hits at every hash boundary, including inside 48-token pages: request i leaves a turn-boundary checkpoint at
    # the last boundary of its prompt; request i+1 extends that prompt and must hit exactly there.
    for B in range(HB, 160, HB):
        first = base[: B + 3]
        s1 = _run(eng, [[first]])[0]
        assert s1.output_ids == reference(tuple(first))
        second = base[: B + 3] + [7, 8, 9]
        s2 = _run(eng, [[second]])[0]
        assert s2.cached_tokens == B, (B, s2.cached_tokens)
        assert s2.output_ids == reference(tuple(second))
    assert eng.cache_stats()["hit_tokens"] > 0


def test_multi_turn_chat_reuses_the_conversation():
    base = torch.randint(1, 512, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    eng = _engine()
    prompt = base
    for turn in range(3):
        s = _run(eng, [[prompt]])[0]
        assert s.output_ids == reference(tuple(prompt))
        if turn:
            assert s.cached_tokens >= HB
        prompt = prompt + s.output_ids + [11 + turn, 12, 13, 14]


def test_preemption_and_eviction_under_memory_pressure():
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 512, (int(n),), generator=g).tolist() for n in torch.randint(20, 110, (8,), generator=g)]
    eng = _engine(mb=0.75, chunk=32, step_tokens=64)  # ~20 pages: not enough for all 8 at once
    assert eng.cache.pool.num_pages < 30
    seqs = _run(eng, [prompts[:4], prompts[4:]])
    for s, p in zip(seqs, prompts):
        assert s.output_ids == reference(tuple(p))
    assert eng.metrics.preemptions + eng.cache_stats()["evictions"] > 0
    st_ = eng.cache_stats()
    assert st_["running"] == 0 and st_["free_pages"] + st_["evictable_pages"] == st_["num_pages"]


def test_short_requests_are_not_starved_by_long_ones():
    g = torch.Generator().manual_seed(6)
    longs = [torch.randint(1, 512, (400,), generator=g).tolist() for _ in range(3)]
    short = torch.randint(1, 512, (10,), generator=g).tolist()
    eng = _engine(mb=16, chunk=64, step_tokens=64, enable=False)
    for p in longs:
        eng.add_request(p, GREEDY)
    eng.step()
    s = eng.add_request(short, GREEDY)
    steps = 0
    while s.first_token_at is None and steps < 50:
        eng.step()
        steps += 1
    # The long prompts need 1200 / 64 ~ 19 steps; the short one gets its first token right away.
    assert steps <= 2, steps
    assert any(q.num_computed < len(q.prompt_ids) for q in eng.scheduler.running if q is not s)


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_request_sequences_match_the_cache_free_reference(data):
    base = torch.randint(1, 512, (160,), generator=torch.Generator().manual_seed(data.draw(st.integers(0, 3)))).tolist()
    chunk = data.draw(st.sampled_from([16, 24, 40, 64]))
    mb = data.draw(st.sampled_from([0.8, 4.0]))
    eng = _engine(mb=mb, chunk=chunk, step_tokens=data.draw(st.sampled_from([48, 96])))
    waves, done = [], []
    for _ in range(data.draw(st.integers(1, 3))):
        wave = []
        for _ in range(data.draw(st.integers(1, 3))):
            kind = data.draw(st.sampled_from(["prefix", "continue"]))
            if kind == "continue" and done:
                prev = data.draw(st.sampled_from(done))
                prompt = list(prev) + reference(tuple(prev)) + data.draw(st.lists(st.integers(1, 511), min_size=1, max_size=20))
            else:
                n = data.draw(st.integers(5, 150))
                prompt = base[:n] + data.draw(st.lists(st.integers(1, 511), max_size=8))
            wave.append(prompt)
        waves.append(wave)
        done.extend(wave)
    seqs = _run(eng, waves)
    for s in seqs:
        assert s.output_ids == reference(tuple(s.prompt_ids))


def test_sampling_is_seeded_and_validated():
    eng = _engine()
    p = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=123)
    a = eng.generate([[1, 2, 3, 4]], p)[0].output_ids
    b = eng.generate([[1, 2, 3, 4]], p)[0].output_ids
    assert a == b and len(a) == 4
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request([1, 2], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="context length"):
        eng.add_request([1] * 10, SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)


def test_batched_sampling_equals_sampling_row_by_row():
    # A step samples all its requests at once; each row must get exactly what sampling it alone gives, for a
    # mix of greedy and seeded temperature / top-k / top-p rows (same generator draws per request).
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=0), SamplingParams(temperature=1.2, top_k=5, seed=2),
              SamplingParams(temperature=1.0, top_p=0.7, seed=3), SamplingParams(temperature=0)]
    gens = lambda: [torch.Generator().manual_seed(10 + i) for i in range(6)]  # noqa: E731
    g1, g2 = gens(), gens()
    batched = [sample_batch(logits, params, g1) for _ in range(3)]
    single = [[int(sample(logits[i:i + 1], p, g2[i])[0]) for i, p in enumerate(params)] for _ in range(3)]
    assert batched == single
    assert sample_batch(logits[[0, 2]], [params[0], params[2]], [None, None]) == [single[0][0], single[0][2]]


def test_default_512_token_hash_blocks_hit_inside_a_2048_token_page():
    """The release granularity: hits at 512 and 1024, both inside one 2,048-token physical page."""
    eng = LLMEngine(_model(), None, EngineConfig(cache_memory_mb=64, scheduler=SchedulerConfig(
        max_step_tokens=1024, prefill_chunk=1024)))
    eng.eos_id = None
    assert (eng.cfg.page_tokens, eng.cfg.hash_block_tokens) == (2048, 512)
    base = torch.randint(1, 512, (1100,), generator=torch.Generator().manual_seed(9)).tolist()
    for B in (512, 1024):
        first = base[: B + 5]
        assert _run(eng, [[first]])[0].output_ids == reference(tuple(first))
        second = first + [3, 4]
        s = _run(eng, [[second]])[0]
        assert s.cached_tokens == B
        assert s.output_ids == reference(tuple(second))


def test_prefill_chunks_of_several_requests_run_as_one_batch():
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, 512, (90,), generator=g).tolist() for _ in range(4)]
    eng = _engine(mb=8, chunk=32, step_tokens=128, enable=False)
    shapes = []
    orig = eng.runner.execute

    def spy(batch):
        shapes.append((len(batch.tokens), len(batch.tokens[0])))
        return orig(batch)

    eng.runner.execute = spy
    seqs = _run(eng, [prompts])
    assert (4, 32) in shapes  # four requests' 32-token prefill chunks in one forward
    for s, p in zip(seqs, prompts):
        assert s.output_ids == reference(tuple(p))


def test_a_request_that_can_never_fit_is_refused_at_submission():
    eng = _engine(mb=0.3)
    with pytest.raises(ValueError, match="cache pages"):
        eng.add_request([1] * 600, SamplingParams(max_tokens=400))
    assert not eng.has_work()


def test_prefill_chunks_of_different_lengths_run_packed_in_one_forward():
    # Prompts of different lengths with cache hits at different depths: the prefill chunks of one step differ in
    # length and start, so they are packed into one row (KDA as separate sequences, MLA per request).
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(1, 512, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(1, 512, (n,), generator=g).tolist() for n in (7, 29, 50)]
    prompts.append(torch.randint(1, 512, (23,), generator=g).tolist())
    eng = _engine(mb=8, chunk=32, step_tokens=160)
    calls = []
    orig = eng.runner.execute

    def spy(batch):
        calls.append(([len(t) for t in batch.tokens], list(batch.starts)))
        return orig(batch)

    eng.runner.execute = spy
    seqs = _run(eng, [[shared + [9]], prompts])  # the first wave caches the shared prefix
    packed = [c for c in calls if len(set(c[0])) > 1]
    assert packed and any(len(set(starts)) > 1 for _, starts in packed)
    for s, p in zip(seqs[1:], prompts):
        assert s.output_ids == reference(tuple(p))
    assert seqs[0].output_ids == reference(tuple(shared + [9]))


def test_packed_runner_forward_equals_separate_forwards():
    # At the runner: three requests with a 10-token prefix already computed add 7, 35 and 2 tokens, packed into
    # one forward vs one forward each, on two identical engines. Logits 1e-5 relative (fp32; the packed KDA
    # chunks are tiled differently).
    from helpers import rel_err

    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (17, 45, 12)]
    results = []
    for packed in (True, False):
        eng = _engine(mb=8, enable=False)
        seqs = [eng.add_request(p, GREEDY) for p in prompts]
        for s in seqs:  # give each request its pages directly (no scheduler step)
            assert eng.cache.admit(s) is not None and eng.cache.grow(s, len(s.prompt_ids))
        slots = [eng.cache.slots(s) for s in seqs]
        first = torch.cat([forward(eng, [p[:10]], [0], [sl]) for p, sl in zip(prompts, slots)])
        rest = [p[10:] for p in prompts]
        if packed:
            out = forward(eng, rest, [10, 10, 10], slots)
        else:
            out = torch.cat([forward(eng, [r], [10], [sl]) for r, sl in zip(rest, slots)])
        results.append((first, out))
    assert rel_err(results[0][0], results[1][0]) < 1e-5
    assert rel_err(results[0][1], results[1][1]) < 1e-5


@pytest.mark.parametrize("interpret", [False, True], ids=["reference", "triton-interpreter"])
def test_decode_through_the_paged_kernel_matches_the_reference(monkeypatch, interpret):
    # Decode steps attend straight from the page pool (k3.ops.mla_decode): with its gather-based reference on CPU,
    # and with the Triton kernel itself in Triton's CPU interpreter. Greedy outputs equal the cache-free run.
    from k3.model import gated_mla
    from k3.ops.registry import Backends

    if interpret:
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    orig = gated_mla.mla_decode_absorbed
    monkeypatch.setattr(gated_mla, "mla_decode_absorbed", lambda *a, **k: calls.append(1) or orig(*a, **k))
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, 512, (n,), generator=g).tolist() for n in (5, 60)]
    _model().set_backends(Backends(per_op={"mla_decode": "triton"}))
    try:
        seqs = _run(_engine(mb=8), [prompts])
    finally:
        _model().set_backends(None)
    assert calls
    for s, p in zip(seqs, prompts):
        assert s.output_ids == reference(tuple(p))


def test_sequence_token_range_equals_slicing_the_tokens():
    from k3.serve.sequence import Sequence

    seq = Sequence([1, 2, 3, 4], SamplingParams(), output_ids=[5, 6, 7])
    assert seq.num_tokens == len(seq.tokens) == 7
    for a in range(8):
        for b in range(a, 8):
            assert seq.token_range(a, b) == seq.tokens[a:b]


def test_token_view_reads_like_the_token_list():
    from k3.serve.sequence import Sequence

    seq = Sequence([1, 2, 3, 4], SamplingParams(), output_ids=[5, 6, 7])
    for end in range(8):
        view, ref = seq.token_view(end), seq.tokens[:end]
        assert len(view) == len(ref)
        assert [view[i] for i in range(-end, end)] == [ref[i] for i in range(-end, end)]
        for a in range(-9, 10):
            for b in range(-9, 10):
                assert view[a:b] == ref[a:b]
        assert view[::2] == ref[::2]
        with pytest.raises(IndexError):
            view[end]
    with pytest.raises(ValueError, match="outside"):
        seq.token_view(8)


def test_due_rows_are_a_view_of_the_batch_when_in_order_else_stacked():
    # A decode batch's logits are sampled straight from the forward's output (no per-row copy); rows from two
    # forwards, or out of order, are stacked.
    from types import SimpleNamespace

    from k3.serve.postprocess import _rows_of

    out, other = torch.randn(4, 10), torch.randn(2, 10)
    seqs = [SimpleNamespace(request_id=f"r{i}") for i in range(4)]
    logits = {f"r{i}": (out, i) for i in range(4)}
    rows = _rows_of(logits, seqs[1:3])
    assert rows.data_ptr() == out[1].data_ptr() and torch.equal(rows, out[1:3])
    shuffled = _rows_of(logits, [seqs[2], seqs[0]])
    assert torch.equal(shuffled, out[[2, 0]])
    logits["r3"] = (other, 0)
    mixed = _rows_of(logits, seqs[2:4])
    assert torch.equal(mixed, torch.stack([out[2], other[0]]))


def test_requests_all_mid_prefill_without_pages_do_not_deadlock():
    # Three requests admitted with their first chunks, each needing a page the others hold for its next one: the
    # most recently admitted is preempted so the older ones go on (before, no step had any work, forever).
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 512, (60 + i,), generator=g).tolist() for i in range(4)]
    eng = _engine(mb=0.5)
    seqs = _run(eng, [prompts])
    assert eng.metrics.preemptions > 0
    for s in seqs:
        assert s.output_ids == reference(tuple(s.prompt_ids))


def test_held_back_text_keeps_a_stop_prefix_before_an_incomplete_character():
    from k3.serve.postprocess import _held_back

    assert _held_back("abq", ["qz"]) == 1  # a stop prefix
    assert _held_back("ab\ufffd", []) == 1  # an incomplete UTF-8 character
    # "q" then the first byte of a two-byte character: with the stop string "qҗ" the "q" may start it
    assert _held_back("q\ufffdDq\ufffd", ["q\u0497"]) == 2
    assert _held_back("q\ufffdDx\ufffd", ["q\u0497"]) == 1
    assert _held_back("abc", ["xyz"]) == 0


def test_the_plan_cuts_prefill_chunks_at_hash_block_boundaries_and_groups_them_into_forwards():
    # Scheduler.plan() returns the whole step: a 50-token prompt's first 40-token chunk is cut at the last hash-block
    # boundary inside it (HB tokens), a 3-token prompt's chunk is not; round 0 runs both first pieces as one forward,
    # round 1 the rest; only the short prompt is due to sample after the step.
    eng = _engine()
    long, short = eng.add_request(list(range(1, 51)), GREEDY), eng.add_request([5, 6, 7], GREEDY)
    plan = eng.scheduler.plan()
    cut = 40 // HB * HB
    pieces = [[[(s.seq.request_id, s.start, s.end) for s in f] for f in r] for r in plan.forwards]
    assert pieces == [[[(long.request_id, 0, cut), (short.request_id, 0, 3)]], [[(long.request_id, cut, 40)]]]
    assert plan.due == [short] and not plan.verify and plan.decode == 0 and not plan.decode_only


@pytest.mark.parametrize("seed", range(4))
def test_incremental_detokenization_streams_what_the_whole_decode_streams(seed):
    # Byte-level tokens of UTF-8 text with 2-4 byte characters (split across tokens), stray continuation and lead
    # bytes (U+FFFD), the end-of-text id and stop strings that straddle tokens: every step's output (ids, text delta,
    # finish) and the request's text equal those of decoding the whole output per token.
    from k3.data.tokenizer import K3Tokenizer
    from k3.serve.metrics import EngineMetrics
    from k3.serve.postprocess import Postprocessor
    from k3.serve.sampling import SamplingParams
    from k3.serve.sequence import Sequence

    tok = K3Tokenizer.byte_level()
    rng = random.Random(seed)
    pieces = ["a", "q", " ", "\u0497", "\u20ac", "\U0001f600", "z\u0497", "\n"]
    text = "".join(rng.choice(pieces) for _ in range(120))
    ids = tok.encode(text)
    for _ in range(6):  # stray bytes: a continuation byte alone, a lead byte before ASCII
        i = rng.randrange(len(ids))
        ids[i:i] = tok.encode(rng.choice(["\u0497", "\u20ac"]))[:1 + rng.randrange(1)]
    stops = [["q\u0497"], ["\u20acz", "zz"], [], ["\U0001f600 "]][seed]
    eos = tok.eos_id if seed == 2 else None
    if eos is not None:
        ids.insert(len(ids) * 2 // 3, eos)
    runs = []
    for incremental in (True, False):
        post = Postprocessor(tok, eos, EngineMetrics())
        post.incremental = incremental
        seq = Sequence([1], SamplingParams(max_tokens=len(ids), stop=stops))
        outs = []
        for t in ids:
            o = post.emit(seq, t)
            outs.append((o.new_token_ids, o.new_text, o.finished, o.finish_reason))
            if o.finished:
                break
        runs.append((outs, seq.text, seq.output_ids))
    assert Postprocessor(tok, None, EngineMetrics()).incremental
    assert runs[0] == runs[1]
    assert "".join(o[1] for o in runs[0][0]) == runs[0][1]


def test_decode_growing_equals_the_whole_decode_and_falls_back_for_other_decoders():
    from tokenizers import Tokenizer, decoders, models

    from k3.data.tokenizer import K3Tokenizer
    from k3.serve.detok import byte_level, decode_growing

    tok = K3Tokenizer.byte_level()
    ids = tok.encode("ab \u0497\u20ac\U0001f600 x") + tok.encode("\u20ac")[:2] + tok.encode("yz")
    state, stray = (0, ""), len(ids) - 2  # ids[:stray] ends with two bytes of a 3-byte character
    for i in range(1, len(ids) + 1):
        text, state = decode_growing(tok, True, ids[:i], state)
        assert text == tok.decode(ids[:i])
        assert state[1] == tok.decode(ids[:state[0]]) and not state[1].endswith("\ufffd")
        if i == stray:
            assert state[0] < i  # an incomplete character at the end: not a resting point
    assert state[0] == len(ids)  # "yz" after it: the U+FFFD is the stray bytes' own, the text ends whole
    # a decoder that joins around token boundaries (SentencePiece's Metaspace): the whole list, every time
    sp = Tokenizer(models.WordLevel({"\u2581a": 0, "b": 1, "\u2581c": 2}, unk_token="b"))
    sp.decoder = decoders.Metaspace()
    assert byte_level(tok) and byte_level(tok.tokenizer) and not byte_level(sp) and not byte_level(None)
    assert decode_growing(sp, False, [0, 1, 2], (0, "")) == (sp.decode([0, 1, 2]), (0, ""))
