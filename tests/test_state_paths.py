"""One equivalence suite over every state path (issue 45): on random tiny configs and random packed sequences with
document boundaries, every way k3 computes the same logits and recurrent states agrees.

The reference is the training forward: the documents packed into one row (`BatchInfo.from_segment_ids`, KDA in its
chunkwise form with a state reset at every document start, MLA masked per document), with no cache. Each path is
held to it on the same tokens:

* the model's own decode cache, token by token (`model.new_cache()`, one-token forwards: KDA's token recurrence)
  and in chunks of random sizes (chunked prefill through the contiguous cache);
* the serving engine (public API: `LLMEngine.add_request / step / write_back / prefetch`, with the EngineConfig
  settings that force each path): chunked prefill of several requests packed into one forward and batched decode,
  prefix-cache restores at random split points (hash-block boundaries inside and at the edges of pages), speculative
  verification with random acceptance (wrong drafts at random; sampled requests' rejection sampling) followed by
  replay, verification mixed into a prefill forward, preemption and re-prefill in a pool too small for every
  request, host write-back and prefetch into a second engine. One look inside the engine, `mixed_forwards`, only
  shows that the mixed path ran;
* KDA context parallelism (with the short conv's halo and Gated MLA's gathered latent) at random split points, its
  ranks run one after another in this process (`SequentialRanks`).

What is compared: logits as log-probabilities (the engine reports those: each generated token's and its top
alternatives, and with `prompt_logprobs` every prompt position's) against the training forward's log-softmax at the
same position (the engine's tokens are fed to the reference, so no greedy tie can make the two diverge); the KDA
recurrent states, short-conv tails and MLA latent rows the engine's cache holds for each request's longest
restorable prefix (its newest checkpoint, read through `write_back`, which copies exactly what a later prefix hit
restores) against the training forward's state and the contiguous cache's tails and rows after the same prefix;
under context parallelism, the logits and every document's final KDA state.

Tolerances (fp32 on the CPU; every path is the same math in another association):
* LOGP_TOL = 2e-4 absolute on log-probabilities. The paths differ in KDA's form (chunkwise with chunks restarting
  at every forward's start, or the token recurrence, or replay) and MLA's (expanded prefill against absorbed
  attention over a gathered or paged cache); over these 3-5 layer models the rounding of those reorderings was
  measured up to 3e-5 (token-by-token decode, the longest chain of roundings).
* STATE_TOL = 1e-4 of the largest entry for KDA states and conv tails: fp32 rounding of the reordered
  recurrences over <= 200 tokens, measured below 1e-5 (tests/parallel/test_context_parallel.py bounds KCP's
  against single-device KDA by 1e-5; the layers above the first add their inputs' rounding).
* MLA_TOL = 5e-4 of the largest entry for the MLA latent rows: RMS-normalized projections of each MLA layer's
  input, which carries the rounding of every layer below it; measured up to 5e-5.
A bug moves these by far more: the mutations below move log-probabilities by 0.1 to 0.9 and rows by O(1).

Each path has a mutation below (`MUTATIONS`): one bug injected at the model or cache level with monkeypatch (an
index off by one, a state not written, a restore from the wrong block), and `test_mutation_fails_the_suite` shows
that the same check function fails under it on a fixed case that passes without it (the fixed cases are explicit
examples of the property tests).

Found on the way and fixed: a request whose newest checkpoint another request created lost it when that one
recycled it, so a continuation of its tokens missed the hit (`test_a_request_keeps_a_newest_checkpoint_another_created`;
a lost hit, not a wrong state).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from helpers import one_torch_thread, randomize_
from k3.config import K3Config
from k3.model.batch import BatchInfo
from k3.model.model import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.generate import generate_tokens
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

try:  # the speculative-decoding package, before and after its move from k3.serve.spec to k3.serve.speculative
    from k3.serve.speculative.draft import Proposal
except ImportError:
    from k3.serve.spec.draft import Proposal

LOGP_TOL = 2e-4
STATE_TOL = 1e-4
MLA_TOL = 5e-4
TOP = 4  # alternatives per position whose log-probabilities are compared besides the token's own

PROPERTY = settings(max_examples=3, deadline=None, derandomize=True, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate))  # no shrinking: every example runs engines


class StateMismatch(AssertionError):
    """Two paths disagree beyond the stated tolerance (what the mutation tests expect, and nothing else)."""


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():  # tiny matrices: more threads only contend on a busy machine
        yield


# --- tiny configs and models ---------------------------------------------------------------------------------------

# (KDA heads, KDA head dim, short-conv width, layers) of the tiny preset at half its width (hidden 64): its layer
# pattern (every 4th and the last layer Gated MLA, the others KDA) at 3, 4 and 5 layers
VARIANTS = [(2, 16, 4, 5), (1, 32, 2, 4), (2, 8, 3, 3)]
VOCABS = [128, 256]


@functools.cache
def tiny_model(variant: int = 0, vocab: int = 256, seed: int = 3) -> K3ForCausalLM:
    heads, dim, width, layers = VARIANTS[variant]
    full = [i for i in range(1, layers + 1) if i % 4 == 0 or i == layers]
    cfg = K3Config.from_preset("tiny").replace(
        num_nextn_predict_layers=0, vocab_size=vocab, eos_token_id=0, hidden_size=64, num_hidden_layers=layers,
        kda_layers=[i for i in range(1, layers + 1) if i not in full], full_attn_layers=full,
        kda_num_heads=heads, kda_head_dim=dim, kda_short_conv_kernel_size=width)
    torch.manual_seed(seed)
    return randomize_(K3ForCausalLM(cfg), seed=seed).eval()


def _close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float, relative: bool = True) -> None:
    """max |got - want| <= tol, relative to max |want| unless `relative` is False."""
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        raise StateMismatch(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    err = float((got - want).abs().max()) if got.numel() else 0.0
    if relative and got.numel():
        err /= max(float(want.abs().max()), 1e-30)
    if not err <= tol:
        raise StateMismatch(f"{what}: {'relative ' if relative else ''}error {err:.3g} > {tol}")


# --- the reference: the training forward ---------------------------------------------------------------------------

@contextmanager
def kda_final_states():
    """Record every KDA layer's final states [N, H, K, V] (one per document) of the forwards inside, in call order.
    (The layer's op entry, as k3.model.kda calls it; the training forward keeps no state otherwise.)"""
    import k3.model.kda as kda_mod

    seen: list[torch.Tensor] = []
    orig = kda_mod.kda_mix

    def spy(*args, **kwargs):
        o, state = orig(*args, **kwargs)
        seen.append(state.detach())
        return o, state

    kda_mod.kda_mix = spy
    try:
        yield seen
    finally:
        kda_mod.kda_mix = orig


@dataclasses.dataclass
class Reference:
    logp: list[torch.Tensor]  # per document [n, V]: log-softmax of the logits at each position
    state: list[torch.Tensor]  # per document [n_kda, H, K, V]: the KDA states after its last token


@torch.no_grad()
def training_forward(model, docs: list[list[int]]) -> Reference:
    """The documents packed into one row, run as the trainer runs a packed batch."""
    lengths = [len(d) for d in docs]
    ids = torch.tensor([[t for d in docs for t in d]])
    seg = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(lengths))[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    with kda_final_states() as states:
        logits = model(ids, batch=BatchInfo.from_segment_ids(seg, cu_seqlens_cpu=cu)).logits[0]
    per_doc = torch.stack(states, 1)  # [N, n_kda, H, K, V]
    return Reference(list(torch.log_softmax(logits.double(), -1).split(lengths)), list(per_doc.unbind(0)))


@dataclasses.dataclass
class CachedRun:
    logp: torch.Tensor  # [n, V]
    state: torch.Tensor  # [n_kda, H, K, V]
    conv: torch.Tensor  # [n_kda, 3, P, W - 1]
    mla: torch.Tensor  # [n_mla, n, kv_lora_rank + qk_rope_head_dim]


@torch.no_grad()
def cached_forward(model, tokens: list[int], chunks: list[int] | None = None) -> CachedRun:
    """The model's contiguous decode cache fed `tokens` in chunks of the given sizes (None: one chunk); chunks of 1
    are token-by-token decode."""
    chunks = chunks or [len(tokens)]
    assert sum(chunks) == len(tokens)
    cache, logits, a = model.new_cache(), [], 0
    for n in chunks:
        logits.append(model(torch.tensor([tokens[a:a + n]]), cache=cache).logits[0])
        a += n
    layers = model.model.layers
    kda = [cache[i] for i, l in enumerate(layers) if l.is_kda]
    mla = [cache[i] for i, l in enumerate(layers) if not l.is_kda]
    return CachedRun(torch.log_softmax(torch.cat(logits).double(), -1),
                     torch.cat([c.state for c in kda]), torch.stack([torch.cat(c.conv) for c in kda]),
                     torch.stack([torch.cat([c.c[0], c.k_rope[0]], -1) for c in mla]))


# --- path 1: the model's own forms (training, token-by-token decode, chunked prefill) ------------------------------

@dataclasses.dataclass(frozen=True)
class ModelCase:
    variant: int
    vocab: int
    docs: tuple[tuple[int, ...], ...]
    chunks: tuple[tuple[int, ...], ...]  # per document: a random split into prefill chunks


def _split(draw, n: int, most: int) -> tuple[int, ...]:
    out = []
    while n:
        k = draw(st.integers(1, min(n, most)))
        out.append(k)
        n -= k
    return tuple(out)


@st.composite
def model_cases(draw):
    vocab = draw(st.sampled_from(VOCABS))
    docs = tuple(tuple(draw(st.lists(st.integers(1, vocab - 1), min_size=n, max_size=n)))
                 for n in draw(st.lists(st.integers(1, 48), min_size=1, max_size=3)))
    return ModelCase(draw(st.integers(0, len(VARIANTS) - 1)), vocab, docs,
                     tuple(_split(draw, len(d), 24) for d in docs))


def _tokens(n: int, seed: int, vocab: int = 256) -> tuple[int, ...]:
    return tuple(torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


MODEL_CASE = ModelCase(0, 256, (_tokens(30, 1), _tokens(7, 2), _tokens(41, 3)), ((13, 17), (1, 6), (5, 1, 20, 15)))


def check_model_paths(case: ModelCase) -> None:
    model = tiny_model(case.variant, case.vocab)
    ref = training_forward(model, [list(d) for d in case.docs])
    for i, (doc, chunks) in enumerate(zip(case.docs, case.chunks)):
        decode = cached_forward(model, list(doc), [1] * len(doc))
        prefill = cached_forward(model, list(doc), list(chunks))
        for name, run in (("token-by-token decode", decode), ("chunked prefill", prefill)):
            _close(f"doc {i} ({chunks}): {name} log-probs", run.logp, ref.logp[i], LOGP_TOL, relative=False)
            _close(f"doc {i} ({chunks}): {name} KDA state", run.state, ref.state[i], STATE_TOL)
        _close(f"doc {i}: chunked prefill conv tails", prefill.conv, decode.conv, STATE_TOL)
        _close(f"doc {i}: chunked prefill MLA rows", prefill.mla, decode.mla, MLA_TOL)


@PROPERTY
@given(model_cases())
@example(MODEL_CASE)
def test_training_forward_decode_and_chunked_prefill_agree(case):
    check_model_paths(case)


# --- the serving engine: the public API, configured to force each path -------------------------------------------

def engine(model, hb: int, page_blocks: int, chunk: int, step_tokens: int, mb: float = 4.0, pages: int | None = None,
           draft=None, k: int = 3, mix_verify: bool = True, prefix_cache: bool = True) -> LLMEngine:
    """An eager engine over `model` (hash blocks of `hb` tokens, pages of `page_blocks` of them); `pages`: a pool of
    that many pages instead of `mb` (a small one preempts)."""
    def make(mb):
        eng = LLMEngine(model, None, EngineConfig(
            cache_memory_mb=mb, page_tokens=hb * page_blocks, hash_block_tokens=hb, enable_prefix_cache=prefix_cache,
            cuda_graphs=False, num_draft_tokens=k, mix_verify=mix_verify,
            scheduler=SchedulerConfig(max_num_seqs=8, max_step_tokens=step_tokens, prefill_chunk=chunk,
                                      long_prompt_tokens=1 << 20)), draft=draft)
        eng.eos_id = None  # every request runs to max_tokens
        return eng

    eng = make(mb)
    if pages is not None:
        eng = make((pages + 0.5) * eng.cache_stats()["page_bytes"] / 2**20)
        assert eng.cache_stats()["num_pages"] == pages
    return eng


def pages_needed(model, hb: int, page_blocks: int, tokens: int) -> int:
    """The most pages one request of `tokens` tokens holds: per MLA layer its pages and a copy-on-write page, one
    running state per KDA layer."""
    cfg = model.config
    return len(cfg.full_attn_layers) * (-(-tokens // (hb * page_blocks)) + 1) + len(cfg.kda_layers)


def drive(eng: LLMEngine, waves, gap: int = 2) -> list:
    """Submit the waves of (prompt, params), `gap` steps apart, and step until every request finished."""
    seqs = []
    for wave in waves:
        for prompt, params in wave:
            seqs.append(eng.add_request(list(prompt), params))
        for _ in range(gap):
            eng.step()
    for _ in range(10_000):
        if not eng.has_work():
            break
        eng.step()
    assert not eng.has_work()
    assert all(s.finish_reason == "length" for s in seqs), [s.finish_reason for s in seqs]
    return seqs


def params(max_tokens: int, score_prompt: bool = False, temperature: float = 0.0, seed: int = 0) -> SamplingParams:
    """Greedy, or sampled at `temperature` from `seed` (speculation then accepts drafts by rejection sampling); the
    reported log-probabilities are the logits' either way."""
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=TOP,
                          prompt_logprobs=TOP if score_prompt else None)


def _entry(what: str, e: dict, row: torch.Tensor) -> None:
    """A logprob entry of the engine ({"token", "logprob", "top": [(id, logprob)]}) against the reference's log-probs
    [V] at that position: every value, and the alternatives being the top ones."""
    pairs = [(e["token"], e["logprob"]), *e["top"]]
    ids = torch.tensor([i for i, _ in pairs])
    _close(f"{what}: log-probs", torch.tensor([v for _, v in pairs], dtype=torch.float64), row[ids], LOGP_TOL,
           relative=False)
    top = torch.tensor([v for _, v in e["top"]], dtype=torch.float64)
    _close(f"{what}: top log-probs", top, row.topk(len(top)).values, LOGP_TOL, relative=False)


def check_requests(model, eng: LLMEngine, seqs, deepest: bool = True) -> object:
    """Every finished request's logprobs (generated tokens, and the prompt's when it asked) against the training
    forward over its tokens, and the states the engine's cache holds at each request's newest restorable prefix
    (written back: KDA states, conv tails, MLA rows) against the training forward's state and the contiguous
    cache's tails and rows after that prefix. `deepest`: that prefix must be the last hash-block boundary the
    request computed (its last token is sampled, never computed), as it is when the pool has room for every
    checkpoint. Returns the store written back."""
    docs = [s.prompt_ids + s.output_ids for s in seqs]
    store = eng.write_back(docs)
    cut = [p.num_tokens for p in store.prefixes]
    if deepest:
        hb = eng.cfg.hash_block_tokens
        want = [(len(d) - 1) // hb * hb if eng.cfg.enable_prefix_cache else 0 for d in docs]
        # A later request over the same tokens can have gone deeper. A request whose newest checkpoint another one
        # created loses it when that one recycles it (test_a_request_keeps_a_newest_checkpoint_another_created):
        # such requests (sharing the tokens up to it with another) are not held to it.
        short = [i for i, (w, c) in enumerate(zip(want, cut)) if c < w
                 and not any(j != i and docs[j][:w] == docs[i][:w] for j in range(len(docs)))]
        assert not short, f"newest checkpoints at {cut}, before the last boundaries computed {want}"
    ref = training_forward(model, docs + [d[:n] for d, n in zip(docs, cut) if n])
    for i, s in enumerate(seqs):
        P = len(s.prompt_ids)
        if len(s.logprobs) != len(s.output_ids):
            raise StateMismatch(f"request {i}: {len(s.logprobs)} logprob entries for {len(s.output_ids)} tokens")
        for j, e in enumerate(s.logprobs):
            _entry(f"request {i} ({P} + {len(s.output_ids)} tokens, {s.cached_tokens} cached, {s.preemptions} "
                   f"preemptions) output {j}", e, ref.logp[i][P - 1 + j])
        if s.params.prompt_logprobs is not None:
            if len(s.prompt_logprobs) != P or s.prompt_logprobs[0] is not None:
                raise StateMismatch(f"request {i}: {len(s.prompt_logprobs)} prompt logprob entries for {P} tokens")
            for j in range(1, P):
                _entry(f"request {i} prompt {j}", s.prompt_logprobs[j], ref.logp[i][j - 1])
    check_store(model, store, ref.state[len(docs):])
    return store


def check_store(model, store, ref_states: list[torch.Tensor]) -> None:
    """A host store's prefixes (those of > 0 tokens, in order; `ref_states` their training-forward states)."""
    held = [(i, p) for i, p in enumerate(store.prefixes) if p.num_tokens]
    assert len(held) == len(ref_states)
    for (i, p), state in zip(held, ref_states):
        run = cached_forward(model, p.tokens)
        n = p.num_tokens
        _close(f"prefix {i} ({n} tokens): KDA state", p.kda_state, state, STATE_TOL)
        _close(f"prefix {i} ({n} tokens): conv tails", p.kda_conv, run.conv, STATE_TOL)
        _close(f"prefix {i} ({n} tokens): MLA rows", store.mla_rows(i), run.mla, MLA_TOL)


# path 2: chunked prefill of several requests (packed into one forward when their chunks differ) and batched decode

@dataclasses.dataclass(frozen=True)
class EngineCase:
    variant: int
    vocab: int
    hb: int
    page_blocks: int
    chunk: int
    step_tokens: int
    waves: tuple  # of waves of (prompt, max_tokens, score the prompt)
    gap: int = 2
    prefix_cache: bool = True


def _prompt(draw, vocab: int, lo: int, hi: int) -> tuple[int, ...]:
    n = draw(st.integers(lo, hi))
    return tuple(draw(st.lists(st.integers(1, vocab - 1), min_size=n, max_size=n)))


@st.composite
def chunked_cases(draw):
    vocab = draw(st.sampled_from(VOCABS))
    waves = tuple(tuple((_prompt(draw, vocab, 1, 60), draw(st.integers(1, 8)), draw(st.booleans()))
                        for _ in range(draw(st.integers(1, 3))))
                  for _ in range(draw(st.integers(1, 2))))
    chunk = draw(st.integers(1, 24))  # 1: every prompt token a forward of its own
    return EngineCase(draw(st.integers(0, len(VARIANTS) - 1)), vocab, draw(st.sampled_from([4, 8])),
                      draw(st.integers(1, 3)), chunk, draw(st.integers(chunk, 64)), waves, draw(st.integers(1, 3)),
                      draw(st.booleans()))


CHUNKED_CASE = EngineCase(0, 256, 8, 2, 12, 40, (((_tokens(37, 4), 6, True), (_tokens(21, 5), 5, False)),
                                                 ((_tokens(50, 6), 4, True),)))


def run_case(case: EngineCase, temperature: float = 0.0, **kw):
    model = tiny_model(case.variant, case.vocab)
    eng = engine(model, case.hb, case.page_blocks, case.chunk, case.step_tokens, prefix_cache=case.prefix_cache, **kw)
    waves = [[(p, params(m, score, temperature, seed)) for seed, (p, m, score) in enumerate(wave)]
             for wave in case.waves]
    return model, eng, drive(eng, waves, case.gap)


def check_chunked_prefill(case: EngineCase) -> None:
    model, eng, seqs = run_case(case)
    check_requests(model, eng, seqs)


@PROPERTY
@given(chunked_cases())
@example(CHUNKED_CASE)
def test_engine_chunked_prefill_and_decode_agree_with_training(case):
    check_chunked_prefill(case)


# path 3: prefix-cache restores at random split points (multi-turn continuations and a sibling on a shorter prefix)

@dataclasses.dataclass(frozen=True)
class PrefixCase:
    engine: EngineCase  # its waves: the first turn's requests
    turns: tuple  # later turns: (new tokens after the previous turn's tokens, max_tokens), one request each
    sibling: tuple  # with the second turn: (length of a prefix of the first turn's tokens, new tokens, max_tokens)


@st.composite
def prefix_cases(draw):
    vocab = draw(st.sampled_from(VOCABS))
    hb = draw(st.sampled_from([4, 8]))
    chunk = draw(st.integers(2, 24))
    waves = (((_prompt(draw, vocab, 2, 40), draw(st.integers(1, 8)), False),),)
    first = EngineCase(draw(st.integers(0, len(VARIANTS) - 1)), vocab, hb, draw(st.integers(1, 3)), chunk,
                       draw(st.integers(chunk, 64)), waves)
    turns = tuple((_prompt(draw, vocab, 1, 12), draw(st.integers(1, 6))) for _ in range(draw(st.integers(1, 2))))
    return PrefixCase(first, turns, (draw(st.integers(1, 40)), _prompt(draw, vocab, 1, 4), draw(st.integers(1, 4))))


# hb 4, pages of 3 blocks (12 tokens): turn 1 computes 29 tokens (checkpoint at 28, inside the third page: a
# copy-on-write hit for turn 2), turn 2 computes to 38 (checkpoint at 36, a page boundary: turn 3's hit); the sibling
# hits turn 1's checkpoint at 28 and leaves one at 32 (its twin scores its prompt: no hit)
PREFIX_CASE = PrefixCase(EngineCase(1, 256, 4, 3, 10, 32, (((_tokens(26, 7), 4, False),),)),
                         ((_tokens(3, 8), 6), (_tokens(3, 9), 3)), (31, _tokens(2, 10), 3))


def check_prefix_restore(case: PrefixCase) -> None:
    model, eng, seqs = run_case(case.engine)
    hb = case.engine.hb
    prev = seqs[0]
    for t, (new, max_tokens) in enumerate(case.turns):
        wave = [(prev.prompt_ids + prev.output_ids + list(new), params(max_tokens))]
        if t == 0:
            n, extra, m = case.sibling
            first = seqs[0].prompt_ids + seqs[0].output_ids
            wave += [(first[:n] + list(extra), params(m)), (first[:n] + list(extra), params(m, score_prompt=True))]
        got = drive(eng, [wave])
        want = (prev.num_tokens - 1) // hb * hb  # the previous turn's newest checkpoint
        assert got[0].cached_tokens == want, (t, got[0].cached_tokens, want)
        seqs += got
        prev = got[0]
    check_requests(model, eng, seqs)


@PROPERTY
@given(prefix_cases())
@example(PREFIX_CASE)
def test_prefix_cache_restores_agree_with_training(case):
    check_prefix_restore(case)


def test_a_request_keeps_a_newest_checkpoint_another_created():
    model = tiny_model(0, 256)
    eng = engine(model, hb=8, page_blocks=2, chunk=64, step_tokens=128)
    a_prompt = list(_tokens(15, 30))
    b_prompt = a_prompt[:8] + [5, 6, 7]
    # Step 1: A and B both compute to 8 (A creates the checkpoint there, B takes it as its newest). Step 2: A computes
    # to 16 and recycles its checkpoint at 8. B finishes at 15 (its last boundary 8). Alone, B's continuation hits 8.
    _, b = drive(eng, [[(a_prompt, params(8)), (b_prompt, params(5))]])
    tokens = b.prompt_ids + b.output_ids
    assert len(tokens) - 1 == 15
    cont = drive(eng, [[(tokens + [9], params(1))]])[0]
    assert cont.cached_tokens == 8

# path 4: speculative verification with random acceptance, then replay; verifications mixed into prefill forwards

@functools.lru_cache(maxsize=4096)
def greedy(variant: int, vocab: int, prompt: tuple, n: int) -> list[int]:
    return list(generate_tokens(tiny_model(variant, vocab), list(prompt), SamplingParams(max_tokens=n, temperature=0)))


class RandomAcceptDraft:
    """Proposes the target's greedy continuation of the request's tokens (from the model's own decode cache) with
    each token replaced by a wrong one with probability `p_wrong`: the verifications accept random prefixes of their
    drafts (sampled requests also reject right ones at random)."""

    def __init__(self, variant: int, vocab: int, seed: int, p_wrong: float):
        import random

        self.variant, self.vocab, self.p_wrong = variant, vocab, p_wrong
        self.rng = random.Random(seed)

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            toks = greedy(self.variant, self.vocab, tuple(s.prompt_ids + s.output_ids), k)
            out.append(Proposal([t % (self.vocab - 1) + 1 if self.rng.random() < self.p_wrong else t for t in toks]))
        return out

    def observe(self, seq, start, hidden):
        pass

    def forget(self, seq):
        pass


@dataclasses.dataclass(frozen=True)
class SpecCase:
    engine: EngineCase
    k: int
    p_wrong: float
    seed: int
    mix_verify: bool = True
    temperature: float = 0.0  # > 0: sampled requests, whose drafts are accepted by rejection sampling (the models'
    # logits are nearly flat: 0.03 accepts some and rejects others)


@st.composite
def spec_cases(draw, mixed: bool = False):
    base = draw(chunked_cases())
    if mixed:  # decoding requests first, then prompts longer than a chunk: their prefill overlaps the verifications
        vocab, chunk = base.vocab, max(base.chunk, 2)
        # (prompts of one chunk, and more tokens than verifications of every draft accepted emit in two steps)
        waves = (tuple((_prompt(draw, vocab, 1, min(12, chunk)), draw(st.integers(12, 20)), False)
                       for _ in range(draw(st.integers(1, 2)))),
                 tuple((_prompt(draw, vocab, chunk + 2, chunk + 40), draw(st.integers(1, 6)), draw(st.booleans()))
                       for _ in range(draw(st.integers(1, 2)))))
        base = dataclasses.replace(base, waves=waves, chunk=chunk, step_tokens=max(base.step_tokens, chunk + 16),
                                   gap=1)
    k = draw(st.integers(1, 4))
    base = dataclasses.replace(base, step_tokens=max(base.step_tokens, k + 1))  # room for a verification
    return SpecCase(base, k, draw(st.sampled_from([0.0, 0.3, 0.6])), draw(st.integers(0, 99)),
                    mixed or draw(st.booleans()), draw(st.sampled_from([0.0, 0.0, 0.03])))


SPEC_CASE = SpecCase(EngineCase(0, 256, 4, 2, 16, 64, (((_tokens(13, 11), 10, False), (_tokens(29, 12), 8, True)),)),
                     3, 0.3, 0)
# sampled requests with drafts that are always the greedy tokens: rejection sampling accepts them at random (at a low
# temperature: these random models' logits are nearly flat, and at 1.0 hardly any draft would be accepted)
SAMPLED_SPEC_CASE = SpecCase(EngineCase(1, 256, 8, 2, 24, 64, (((_tokens(20, 25), 12, False),
                                                                  (_tokens(9, 26), 9, False)),)),
                             4, 0.0, 2, mix_verify=False, temperature=0.03)
MIXED_CASE = SpecCase(EngineCase(2, 128, 8, 1, 8, 32, (((_tokens(5, 13, 128), 12, False),),
                                                       ((_tokens(30, 14, 128), 3, True),)), gap=2), 3, 0.3, 1)


def run_spec(case: SpecCase):
    e = case.engine
    draft = RandomAcceptDraft(e.variant, e.vocab, case.seed, case.p_wrong)
    model, eng, seqs = run_case(e, case.temperature, draft=draft, k=case.k, mix_verify=case.mix_verify)
    # (a request speculates from its second token on, while at least two more are due)
    assert eng.metrics.spec_verifications > 0 or all(s.params.max_tokens <= 2 for s in seqs), "nothing was verified"
    return model, eng, seqs


def check_speculative(case: SpecCase) -> None:
    model, eng, seqs = run_spec(case)
    check_requests(model, eng, seqs)


def mixed_forwards(eng: LLMEngine) -> list:
    """The one look inside the engine: a record of its mixed forwards (prefill chunks and verifications in one
    packed forward), to show that the mixed path ran. Everything else here goes through the public API."""
    calls = []
    execute = eng.runner.execute

    def counted(batch):
        if 0 < batch.n_verify < len(batch.tokens):  # some of the requests are verifications, not all
            calls.append(batch.n_verify)
        return execute(batch)

    eng.runner.execute = counted
    return calls


def check_mixed_verification(case: SpecCase) -> None:
    e = case.engine
    draft = RandomAcceptDraft(e.variant, e.vocab, case.seed, case.p_wrong)
    model = tiny_model(e.variant, e.vocab)
    eng = engine(model, e.hb, e.page_blocks, e.chunk, e.step_tokens, draft=draft, k=case.k, mix_verify=True)
    mixed = mixed_forwards(eng)
    seqs = drive(eng, [[(p, params(m, score, case.temperature, seed)) for seed, (p, m, score) in enumerate(wave)]
                       for wave in e.waves], e.gap)
    assert mixed, "no verification ran inside a prefill forward"
    check_requests(model, eng, seqs)


@PROPERTY
@given(spec_cases())
@example(SPEC_CASE)
@example(SAMPLED_SPEC_CASE)
def test_speculative_verification_and_replay_agree_with_training(case):
    check_speculative(case)


@PROPERTY
@given(spec_cases(mixed=True))
@example(MIXED_CASE)
def test_verification_mixed_into_prefill_agrees_with_training(case):
    check_mixed_verification(case)


# path 5: preemption and re-prefill in a pool too small for every request at once

@dataclasses.dataclass(frozen=True)
class PreemptCase:
    engine: EngineCase
    spare: int  # pages beyond what the largest request needs


@st.composite
def preempt_cases(draw):
    vocab = draw(st.sampled_from(VOCABS))
    chunk = draw(st.integers(4, 24))
    waves = (tuple((_prompt(draw, vocab, 12, 48), draw(st.integers(2, 8)), draw(st.booleans()))
                   for _ in range(draw(st.integers(3, 5)))),)
    return PreemptCase(EngineCase(draw(st.integers(0, len(VARIANTS) - 1)), vocab, draw(st.sampled_from([4, 8])),
                                  draw(st.integers(1, 2)), chunk, draw(st.integers(chunk, 64)), waves, 1,
                                  draw(st.booleans())), draw(st.integers(0, 3)))


PREEMPT_CASE = PreemptCase(EngineCase(0, 256, 4, 2, 8, 32, (((_tokens(40, 15), 6, False), (_tokens(33, 16), 5, True),
                                                              (_tokens(45, 17), 4, False),
                                                              (_tokens(20, 18), 8, False)),), gap=1), 1)


def check_preemption(case: PreemptCase) -> None:
    e = case.engine
    model = tiny_model(e.variant, e.vocab)
    need = max(pages_needed(model, e.hb, e.page_blocks, len(p) + m) for w in e.waves for p, m, _ in w)
    eng = engine(model, e.hb, e.page_blocks, e.chunk, e.step_tokens, pages=need + case.spare,
                 prefix_cache=e.prefix_cache)
    seqs = drive(eng, [[(p, params(m, score)) for p, m, score in wave] for wave in e.waves], e.gap)
    check_requests(model, eng, seqs, deepest=False)  # a checkpoint is skipped when no page is free
    return eng.metrics.preemptions


@PROPERTY
@given(preempt_cases())
@example(PREEMPT_CASE)
def test_preemption_and_reprefill_agree_with_training(case):
    check_preemption(case)


# path 6: host write-back of cached prefixes and their prefetch into a second engine

@dataclasses.dataclass(frozen=True)
class HostCase:
    engine: EngineCase  # engine A's requests
    extra: tuple  # per request of A: the new tokens of its continuation on engine B
    chunk_b: int


@st.composite
def host_cases(draw):
    base = dataclasses.replace(draw(chunked_cases()), prefix_cache=True)  # (what is written back is the cache's)
    n = sum(len(w) for w in base.waves)
    return HostCase(base, tuple(_prompt(draw, base.vocab, 1, 6) for _ in range(n)), draw(st.integers(2, 24)))


HOST_CASE = HostCase(EngineCase(0, 256, 4, 3, 16, 48, (((_tokens(30, 19), 5, False), (_tokens(45, 20), 3, False)),
                                                       ((_tokens(9, 21), 2, False),))),
                     ((5, 6), (7,), (8, 9, 10)), 8)


def check_host_writeback(case: HostCase) -> None:
    e = case.engine
    model, a, seqs = run_case(e)
    store = check_requests(model, a, seqs)  # the store written back holds the states the training forward has
    b = engine(model, e.hb, e.page_blocks, case.chunk_b, max(case.chunk_b, e.step_tokens))
    assert b.prefetch(store) == store.tokens
    cont = drive(b, [[(s.prompt_ids + s.output_ids + list(x), params(2)) for s, x in zip(seqs, case.extra)]])
    # each continuation hits its prefetched prefix at least (or deeper: B's own blocks, when one request extends
    # another's tokens)
    hits = [(s.cached_tokens, p.num_tokens) for s, p in zip(cont, store.prefixes)]
    assert all(got >= fetched for got, fetched in hits), hits
    check_requests(model, b, cont)


@PROPERTY
@given(host_cases())
@example(HOST_CASE)
def test_host_write_back_and_prefetch_agree_with_training(case):
    check_host_writeback(case)


# path 7: KDA context parallelism (with the short conv's halo and Gated MLA's gathered latent) at random split points

class SequentialRanks:
    """torch.distributed as k3.parallel.context_parallel calls it, for P ranks of one CP group run one after another
    in this process. A forward's collectives are all-gathers in which a rank reads only the earlier ranks' parts
    and its own (the fragments fold over earlier segments, the conv halo is the previous segment's tail, MLA
    attends to earlier keys; only the MTP layer reads later ranks, and these models have none), so running rank 0's
    whole forward, then rank 1's, ... gives every rank what the group would: each gather records this rank's part
    under its call number and returns the earlier ranks' parts recorded under the same number (later ranks' read as
    zeros, which no rank uses)."""

    def __init__(self, P: int):
        self.P, self.rank, self.calls, self.parts = P, 0, 0, []

    def start(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def get_rank(self, group=None) -> int:
        return self.rank

    def get_world_size(self, group=None) -> int:
        return self.P

    def all_gather_into_tensor(self, out: torch.Tensor, x: torch.Tensor, group=None) -> None:
        if self.calls == len(self.parts):
            self.parts.append({})
        parts = self.parts[self.calls]
        self.calls += 1
        parts[self.rank] = x.detach().clone()
        out.copy_(torch.cat([parts.get(j, torch.zeros_like(x)).reshape(-1) for j in range(self.P)]))

    def all_reduce(self, *args, **kwargs):
        raise AssertionError("a forward without labels all-reduces nothing")


@dataclasses.dataclass(frozen=True)
class CPCase:
    variant: int
    vocab: int
    docs: tuple[tuple[int, ...], ...]
    cuts: tuple[int, ...]  # split points of the packed row (one fewer than the ranks)


@st.composite
def cp_cases(draw):
    vocab = draw(st.sampled_from(VOCABS))
    variant = draw(st.integers(0, len(VARIANTS) - 1))
    docs = tuple(tuple(draw(st.lists(st.integers(1, vocab - 1), min_size=n, max_size=n)))
                 for n in draw(st.lists(st.integers(1, 40), min_size=1, max_size=4)))
    if sum(map(len, docs)) < 12:  # room for three segments of at least the halo each
        docs += (_prompt(draw, vocab, 12, 20),)
    T, halo = sum(map(len, docs)), VARIANTS[variant][2] - 1  # every segment holds at least the conv's halo
    P = draw(st.integers(2, 3))
    cuts = draw(st.lists(st.integers(max(halo, 1), T - max(halo, 1)), min_size=P - 1, max_size=P - 1, unique=True)
                .map(sorted).filter(lambda c: all(b - a >= max(halo, 1) for a, b in itertools.pairwise(c))))
    return CPCase(variant, vocab, docs, tuple(cuts))


# three ranks: a document across both cuts (its state enters rank 2 through rank 1), one starting at a cut
CP_CASE = CPCase(0, 256, (_tokens(9, 22), _tokens(50, 23), _tokens(12, 24)), (24, 47))


@torch.no_grad()
def context_parallel_forward(model, docs, cuts):
    """The packed row split at `cuts`, every rank's segment run through the model with its context-parallel record:
    (log-probs [T, V], the KDA states [n_kda, H, K, V] of each document at its end)."""
    import k3.parallel.context_parallel as cp

    lengths = [len(d) for d in docs]
    ids = torch.tensor([[t for d in docs for t in d]])
    seg = torch.repeat_interleave(torch.arange(len(docs)), torch.tensor(lengths))[None]
    parts = cp.split_packed_batch(ids, seg, len(cuts) + 1, split_points=list(cuts))
    ranks = SequentialRanks(len(parts))
    finals: list[list[torch.Tensor]] = [[] for _ in parts]
    orig = cp.kda_context_parallel

    def spy(*args, **kwargs):
        o, state = orig(*args, **kwargs)
        finals[ranks.rank].append(state)
        return o, state

    logits = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cp, "dist", ranks)
        mp.setattr(cp, "kda_context_parallel", spy)
        for r, part in enumerate(parts):
            ranks.start(r)
            logits.append(model(part.input_ids, batch=cp.cp_batch_info(part, group=None)).logits[0])
    states = [None] * len(docs)
    for r, part in enumerate(parts):
        first = int(seg[0, part.segment.start])  # the global document of the segment's first local one
        n_local = len(part.segment.cu_seqlens) - 1
        for d in range(n_local):
            ends_here = d < n_local - 1 or r + 1 == len(parts) or not parts[r + 1].segment.continued
            if ends_here:
                states[first + d] = torch.stack([f[d] for f in finals[r]])
    return torch.log_softmax(torch.cat(logits).double(), -1), states


def check_context_parallel(case: CPCase) -> None:
    model = tiny_model(case.variant, case.vocab)
    ref = training_forward(model, [list(d) for d in case.docs])
    logp, states = context_parallel_forward(model, case.docs, case.cuts)
    _close(f"cuts {case.cuts}: log-probs", logp, torch.cat(ref.logp), LOGP_TOL, relative=False)
    for i, (got, want) in enumerate(zip(states, ref.state)):
        _close(f"cuts {case.cuts}, doc {i}: KDA state", got, want, STATE_TOL)


@PROPERTY
@given(cp_cases())
@example(CP_CASE)
def test_context_parallel_agrees_with_training(case):
    check_context_parallel(case)


# --- mutations: one bug per path, each caught by the same check functions ------------------------------------------

def _decode_state_not_written(mp):
    """k3.model.kda: a one-token step (KDA's token recurrence) hands its cache the state it started from (on the
    read/update path, and in the fused in-place step of k3.ops.kda_decode that the engine's pool takes)."""
    import k3.model.kda as kda_mod
    import k3.ops.kda_decode as decode_mod

    orig = kda_mod.kda_mix

    def mutated(q, *args, initial_state=None, **kwargs):
        o, state = orig(q, *args, initial_state=initial_state, **kwargs)
        return o, (initial_state if q.shape[1] == 1 and initial_state is not None else state)

    mp.setattr(kda_mod, "kda_mix", mutated)
    mp.setattr(decode_mod, "kda", mutated)


def _conv_tail_one_input_early(mp):
    """k3.model.kda: a cached forward keeps as its short-conv tail the W - 1 inputs ending one before its last."""
    import k3.model.kda as kda_mod

    orig = kda_mod.short_conv

    def mutated(x, weight, conv_state=None, cu_seqlens=None, **kwargs):
        y, tail = orig(x, weight, conv_state, cu_seqlens=cu_seqlens, **kwargs)
        if tail is not None and cu_seqlens is None:
            B, _, C = x.shape
            prev = conv_state if conv_state is not None else x.new_zeros(B, C, tail.shape[-1])
            tail = torch.cat([prev.float(), x.float().transpose(1, 2)], -1)[..., -tail.shape[-1] - 1:-1]
        return y, tail

    mp.setattr(kda_mod, "short_conv", mutated)


def _packed_states_one_request_off(mp):
    """k3.model.kda: a packed forward of several requests over their cached states (the engine's prefill chunks of
    different lengths, verifications mixed into them) starts each request from the state of the one before it."""
    import k3.model.kda as kda_mod

    orig = kda_mod.kda_mix

    def mutated(*args, initial_state=None, cu_seqlens=None, **kwargs):
        if initial_state is not None and cu_seqlens is not None and initial_state.shape[0] > 1:
            initial_state = initial_state.roll(1, 0)
        return orig(*args, initial_state=initial_state, cu_seqlens=cu_seqlens, **kwargs)

    mp.setattr(kda_mod, "kda_mix", mutated)


def _restore_from_wrong_block(mp):
    """k3.serve.cache.prefix: an admission copies into the running state the checkpoint of an earlier hash block
    than the one its MLA hit ends at (the newest older checkpoint in the index)."""
    from k3.serve.cache.prefix import PrefixCache

    orig = PrefixCache.admit

    def mutated(self, seq_id, prompt_tokens, lookup=True, **kw):
        adm = orig(self, seq_id, prompt_tokens, lookup, **kw)
        older = [c for c in self._ckpts.values() if 0 < c.position < adm.hit_tokens]
        if older:
            src = max(older, key=lambda c: c.position).pages
            for op, page in zip([op for op in adm.copies if op.tokens is None], src):
                op.src = page
        return adm

    mp.setattr(PrefixCache, "admit", mutated)


def _replay_conv_tail_one_early(mp):
    """k3.ops.kda_replay: the replay of an accepted prefix takes its conv tail one input early."""
    import k3.ops.kda_replay as replay

    orig = replay._conv_tail
    mp.setattr(replay, "_conv_tail", lambda conv, pre_conv, n: orig(conv, pre_conv, n - 1))


def _fresh_state_not_zeroed(mp):
    """k3.serve.cache.manager: a request admitted with no hit (a new one, or a preempted one re-prefilled from its
    first token) starts from whatever state its running-state page last held."""
    from k3.serve.cache.manager import CacheManager

    mp.setattr(CacheManager, "_zero_kda", lambda self, pages: None)


def _host_rows_one_token_late(mp):
    """k3.serve.cache.host: the MLA rows of a page written back to host memory land one token late."""
    from k3.serve.cache.host import HostPrefixStore

    orig = HostPrefixStore.to_host

    def mutated(self, t):
        out = orig(self, t)
        return torch.cat([out[:, :1], out[:, :-1]], 1) if out.dim() == 3 else out

    mp.setattr(HostPrefixStore, "to_host", mutated)


def _cp_incoming_from_previous_rank(mp):
    """k3.parallel.context_parallel: a continued segment starts from the state entering the previous segment (the
    fold stops one segment early)."""
    import k3.parallel.context_parallel as cp

    orig = cp.compose_incoming
    mp.setattr(cp, "compose_incoming", lambda fragments, rank: orig(fragments, rank - 1))


MUTATIONS = {
    "decode-state-not-written": _decode_state_not_written,
    "conv-tail-one-input-early": _conv_tail_one_input_early,
    "packed-states-one-request-off": _packed_states_one_request_off,
    "prefix-restore-from-wrong-block": _restore_from_wrong_block,
    "replay-conv-tail-one-input-early": _replay_conv_tail_one_early,
    "fresh-running-state-not-zeroed": _fresh_state_not_zeroed,
    "host-rows-one-token-late": _host_rows_one_token_late,
    "cp-incoming-state-one-segment-early": _cp_incoming_from_previous_rank,
}

CHECKS = {  # the fixed cases (explicit examples of the property tests above, so they pass unmutated)
    "model-paths": (check_model_paths, MODEL_CASE),
    "engine-chunked-prefill": (check_chunked_prefill, CHUNKED_CASE),
    "prefix-restore": (check_prefix_restore, PREFIX_CASE),
    "speculative": (check_speculative, SPEC_CASE),
    "mixed-verification": (check_mixed_verification, MIXED_CASE),
    "preemption": (check_preemption, PREEMPT_CASE),
    "host-write-back": (check_host_writeback, HOST_CASE),
    "context-parallel": (check_context_parallel, CP_CASE),
}


@pytest.fixture
def mutation(request, monkeypatch):
    """Inject the mutation named by the test's parameter; the greedy continuations the draft proposes from are
    forgotten after (a mutated model computed some)."""
    MUTATIONS[request.param](monkeypatch)
    yield request.param
    greedy.cache_clear()


@pytest.mark.parametrize("mutation,check", [
    ("decode-state-not-written", "model-paths"),
    ("decode-state-not-written", "engine-chunked-prefill"),
    ("conv-tail-one-input-early", "model-paths"),
    ("packed-states-one-request-off", "engine-chunked-prefill"),
    ("packed-states-one-request-off", "mixed-verification"),
    ("prefix-restore-from-wrong-block", "prefix-restore"),
    ("replay-conv-tail-one-input-early", "speculative"),
    ("replay-conv-tail-one-input-early", "mixed-verification"),
    ("fresh-running-state-not-zeroed", "preemption"),
    ("host-rows-one-token-late", "host-write-back"),
    ("cp-incoming-state-one-segment-early", "context-parallel"),
], indirect=["mutation"])
def test_mutation_fails_the_suite(mutation, check):
    fn, case = CHECKS[check]
    with pytest.raises(StateMismatch):
        fn(case)
