"""Host write-back and prefetch of prefix caches (report §5.3.1): a prefix written back from one engine and fetched
into another restores exactly the MLA rows and KDA checkpoints of the first (bitwise), equal to what a cold prefill
computes (1e-5), and a continuation over it hits the fetched length and generates what a cold engine generates.
Partial fetches into a small pool, eviction of fetched entries and mismatched engines are covered too."""

import functools
import random

import pytest
import torch

from helpers import one_torch_thread, randomize_
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.serve.cache.host import HostPrefixStore
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

HB, PAGE = 16, 48  # three hash blocks per page: prefixes end inside pages and span several pages
G, K = 2, 3  # the tiny preset's MLA and KDA layers (cache groups)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():  # a tiny model: more threads only contend on a busy machine
        yield


@functools.cache
def _model(vocab: int = 512):
    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0, vocab_size=vocab, eos_token_id=0)
    return randomize_(K3ForCausalLM(cfg), seed=3).eval()


def _engine(mb=4.0, page=PAGE, hb=HB, vocab=512, enable=True):
    eng = LLMEngine(_model(vocab), None, EngineConfig(
        cache_memory_mb=mb, page_tokens=page, hash_block_tokens=hb, enable_prefix_cache=enable, cuda_graphs=False,
        scheduler=SchedulerConfig(max_step_tokens=128, prefill_chunk=40, max_num_seqs=8)))
    eng.eos_id = None
    return eng


def _mb(pages: int) -> float:
    """cache_memory_mb for a pool of `pages` pages."""
    probe = _engine()
    return (pages + 0.5) * probe.cache.pool.page_bytes / 2**20


def _tokens(n, seed):
    return torch.randint(1, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


GREEDY = SamplingParams(max_tokens=4, temperature=0, logprobs=1)


@pytest.fixture(scope="module")
def written():
    """Engine A after three requests: S1 (prompt 70 tokens + 25 generated: cached to 80, a page and a third),
    S2 (shares S1's first 56 tokens, i.e. its whole first page: cached to 64) and S3 (S1's first 50 tokens: a
    checkpoint at 48, one page). Written back with two misses: 3 tokens (no hash block) and S1's first 40 tokens
    (MLA blocks cached, no checkpoint at 16 or 32)."""
    head = _tokens(56, 1)
    p1, p2 = head + _tokens(14, 2), head + _tokens(10, 3)
    a = _engine()
    s1, s2, s3 = a.generate([p1, p2, p1[:50]], [SamplingParams(max_tokens=n, temperature=0) for n in (25, 4, 1)])
    seqs = [s.prompt_ids + s.output_ids for s in (s1, s2, s3)]
    before = (a.cache_stats(), list(a.cache.prefix._lru), list(a.cache.prefix._ref), a.cache.pool.pages.clone())
    store = a.write_back([seqs[0], seqs[1], seqs[2], [7, 8, 9], seqs[0][:40]])
    after = (a.cache_stats(), list(a.cache.prefix._lru), list(a.cache.prefix._ref), a.cache.pool.pages)
    for k in ("written_back_prefixes", "written_back_tokens", "written_back_bytes"):
        after[0].pop(k)
        before[0].pop(k)
    assert before[:3] == after[:3] and torch.equal(before[3], after[3]), "write_back changed the cache"
    a.cache.prefix.check_invariants()
    return a, seqs, store


def _pages_of(eng, tokens):
    """(MLA rows [G, n, width], KDA state, KDA conv) the engine's cache restores for `tokens`."""
    pool, hit = eng.cache.pool, eng.cache.prefix.peek(tokens)
    rows = torch.cat([pool.mla_pages(torch.tensor(p)) for p in hit.pages], 1)[:, :hit.tokens]
    return (rows, *pool.read_kda(torch.tensor(hit.ckpt_pages))) if hit.tokens else (rows, None, None)


def test_write_back_contents(written):
    a, seqs, store = written
    assert isinstance(store, HostPrefixStore) and len(store) == 5
    assert [p.num_tokens for p in store.prefixes] == [80, 64, 48, 0, 0]
    assert [p.requested for p in store.prefixes] == [95, 70, 51, 3, 40]
    assert store.prefixes[0].tokens == seqs[0][:80] and len(store.prefixes[0].hashes) == 5
    assert store.tokens == 192 and store.summary()["hits"] == 3
    assert len(store.pages) == 3, "the shared first page is held once"  # S1's two, S2's second
    assert store.prefixes[0].page_keys[0] == store.prefixes[1].page_keys[0] == store.prefixes[2].page_keys[0]
    width = a.cache.pool.mla_width
    assert store.mla_rows(0).shape == (G, 80, width) and store.mla_rows(3).shape == (G, 0, width)
    assert store.prefixes[0].kda_state.shape == (K, *a.cache.pool.kda_state_shape)
    assert store.prefixes[3].kda_state is None
    for i in range(3):
        rows, state, conv = _pages_of(a, seqs[i])
        assert torch.equal(store.mla_rows(i), rows)
        assert torch.equal(store.prefixes[i].kda_state, state) and torch.equal(store.prefixes[i].kda_conv, conv)
    # rows: S1's first page (48) and its second (32), S2's second (16); three checkpoints; fp32 on the CPU
    assert store.nbytes == G * (48 + 32 + 16) * width * 4 + 3 * K * a.cache.pool.kda_elems * 4
    st = a.cache_stats()
    assert st["written_back_tokens"] == 192 and st["written_back_bytes"] == store.nbytes
    assert st["written_back_prefixes"] == 3 and a.metrics.written_back_tokens == 192


def test_prefetch_restores_bitwise_and_equals_cold_prefill(written):
    a, seqs, store = written
    b = _engine()
    assert b.prefetch(store) == 192
    b.cache.prefix.check_invariants()
    rep = b.last_prefetch
    assert rep.fetched == [0, 1, 2] and rep.skipped == [] and rep.empty == [3, 4]
    assert rep.bytes == store.nbytes
    st = b.cache_stats()
    assert st["prefetched_tokens"] == 192 and st["prefetched_bytes"] == store.nbytes and st["prefetch_skipped"] == 0
    assert st["cached_mla_pages"] == 3 * G and st["checkpoints"] == 3 and st["running"] == 0
    assert st["evictable_pages"] == 3 * G + 3 * K and b.metrics.prefetched_tokens == 192
    for i, n in enumerate((80, 64, 48)):
        ra, sa, ca = _pages_of(a, seqs[i])
        rb, sb, cb = _pages_of(b, seqs[i])
        assert rb.shape[1] == n and torch.equal(ra, rb) and torch.equal(sa, sb) and torch.equal(ca, cb), i
    # a cold prefill of S1's first 80 tokens (and one more, to leave the checkpoint at 80) in a fresh engine
    c = _engine()
    c.generate([seqs[0][:81]], SamplingParams(max_tokens=1, temperature=0))
    rc, sc, cc = _pages_of(c, seqs[0][:80])
    rb, sb, cb = _pages_of(b, seqs[0])
    assert rc.shape == rb.shape
    # 1e-5 on the tensor's scale: the latent rows reach ~4 in the last MLA layer, where the rounding of A's
    # other chunking and decode steps (not the write-back: that is bitwise) leaves up to ~2e-5 (5e-6 relative)
    for got, cold in ((rb, rc), (sb, sc), (cb, cc)):
        assert float((got - cold).abs().max()) <= 1e-5 * max(1.0, float(cold.abs().max()))


def test_continuation_on_prefetched_prefix_equals_cold(written):
    _, seqs, store = written
    b = _engine()
    b.prefetch(store)
    prompts = [seqs[0] + [11, 12, 13], seqs[1][:64] + [5]]  # hits 80 (5 blocks, a partial page), 64 (4 blocks)
    warm = b.generate(prompts, GREEDY)
    b.cache.prefix.check_invariants()
    assert [s.cached_tokens for s in warm] == [80, 64]
    cold = _engine().generate(prompts, GREEDY)
    assert [s.cached_tokens for s in cold] == [0, 0]
    for w, c in zip(warm, cold):
        assert w.output_ids == c.output_ids
        assert max(abs(x["logprob"] - y["logprob"]) for x, y in zip(w.logprobs, c.logprobs)) <= 1e-5
    assert b.cache_stats()["hit_tokens"] == 144


def test_partial_prefetch_into_small_pool_then_eviction(written):
    _, _, store = written
    b = _engine(mb=_mb(10))
    assert b.cache.num_pages == 10
    # S1 needs 2 units + a checkpoint (7 pages), S2 a unit + a checkpoint (5: its first page is S1's), S3 a
    # checkpoint (3): S2 does not fit beside S1 (S1's entries are not evicted for it), S3 does.
    assert b.prefetch(store) == 128
    b.cache.prefix.check_invariants()
    rep = b.last_prefetch
    assert rep.fetched == [0, 2] and rep.skipped == [1] and rep.skipped_tokens == 64
    st = b.cache_stats()
    assert st["prefetch_skipped"] == 1 and st["prefetched_tokens"] == 128 and st["free_pages"] == 0
    assert st["evictable_pages"] == 10
    # fetching again copies nothing: the index holds every part already
    assert b.prefetch(store) == 128 and b.last_prefetch.bytes == 0 and b.last_prefetch.skipped == [1]
    b.cache.prefix.check_invariants()
    # the fetched entries are ordinary evictable ones: an unrelated request evicts what it needs
    other = _tokens(40, 9)
    s = b.generate([other], SamplingParams(max_tokens=2, temperature=0))[0]
    b.cache.prefix.check_invariants()
    assert b.cache_stats()["evictions"] > 0 and s.cached_tokens == 0
    assert s.output_ids == _engine().generate([other], SamplingParams(max_tokens=2, temperature=0))[0].output_ids
    # and a pool the whole store fits in after evicting older entries: everything fetched, the old entries gone
    c = _engine(mb=_mb(15))
    c.generate([other], SamplingParams(max_tokens=1, temperature=0))
    assert c.prefetch(store) == 192 and c.last_prefetch.skipped == []
    c.cache.prefix.check_invariants()
    assert c.cache_stats()["evictions"] > 0


def test_prefetch_with_prefix_cache_off_skips_everything(written):
    _, _, store = written
    b = _engine(enable=False)
    assert b.prefetch(store) == 0
    assert b.last_prefetch.skipped == [0, 1, 2] and b.last_prefetch.empty == [3, 4]
    b.cache.prefix.check_invariants()


@pytest.mark.parametrize("kwargs,named", [({"page": 32}, "page_tokens: written 48, this engine 32"),
                                          ({"hb": 8}, "hash_block_tokens: written 16, this engine 8"),
                                          ({"vocab": 256}, "model config vocab_size: written 512, this engine 256")])
def test_prefetch_refuses_a_different_engine(written, kwargs, named):
    _, _, store = written
    b = _engine(**kwargs)
    with pytest.raises(ValueError, match="the engine that wrote them back differs") as e:
        b.prefetch(store)
    assert named in str(e.value)
    b.cache.prefix.check_invariants()
    assert b.cache_stats()["cached_blocks"] == 0


def test_import_bookkeeping_randomized():
    """PrefixCache.import_prefixes against a fake pool (page -> the tokens its content stands for): prefixes
    sharing heads, imported into pools of every size beside existing entries, one call or one per prefix. After
    every call the invariants hold; a fetched prefix is found whole by `peek` (each page holding its tokens, the
    checkpoint its prefix) and by `admit` of a longer prompt; a skipped one evicted nothing."""
    from k3.serve.cache.prefix import _ROOT, OutOfPages, PrefixCache, chain_hash

    rng = random.Random(0)
    hb, pt = 4, 12
    admitted = fetched = skipped = 0
    for trial in range(150):
        c = PrefixCache(rng.randint(5, 40), 2, 3, page_tokens=pt, hash_block_tokens=hb)
        content: dict[int, tuple] = {}
        heads = [[rng.randint(1, 9) for _ in range(rng.randint(0, 30))] for _ in range(3)]
        seqs = [rng.choice(heads) + [rng.randint(1, 9) for _ in range(rng.randint(0, 30))] for _ in range(6)]
        seqs = [s[:len(s) // hb * hb] for s in seqs]

        def chain(toks):
            hs, h = [], _ROOT
            for i in range(0, len(toks), hb):
                h = chain_hash(h, toks[i:i + hb])
                hs.append(h)
            return hs

        def fill(toks, r, content=content):
            for j, pages in r.units:
                for p in pages:
                    content[p] = tuple(toks[j * pt:min((j + 1) * pt, r.tokens)])
            for p in r.ckpt_pages:
                content[p] = ("state", tuple(toks[:r.tokens]))

        groups = [seqs[:3], seqs[3:]] if trial % 2 else [[s] for s in seqs]
        for group in groups:
            evictions = c.stats()["evictions"]
            res = c.import_prefixes([chain(s) for s in group])
            c.check_invariants()
            for s, r in zip(group, res):
                if r is not None:
                    assert r.tokens == len(s)
                    fill(s, r)
                fetched += r is not None and len(s) > 0
                skipped += r is None and len(s) > 0
            if len(group) == 1 and res[0] is None:
                assert c.stats()["evictions"] == evictions, "a skipped prefix evicted entries"
            for s, r in zip(group, res):
                if r is None or not s:
                    continue
                hit = c.peek(s)  # no later prefix of the call evicted any of it
                assert hit.tokens == len(s)
                for j, pages in enumerate(hit.pages):
                    end = min((j + 1) * pt, len(s))
                    assert all(content[p][:end - j * pt] == tuple(s[j * pt:end]) for p in pages), (trial, j)
                assert all(content[p] == ("state", tuple(s)) for p in hit.ckpt_pages)
        for k, s in enumerate(seqs):
            hit = c.peek(s)
            if not hit.tokens:
                continue
            try:
                adm = c.admit(("probe", k), s + [1])
            except OutOfPages:  # its own hit is pinned: no room left for its running state
                c.check_invariants()
                continue
            assert adm.hit_tokens == hit.tokens
            admitted += 1
            c.abort(("probe", k))
            c.mark_landed()
            c.check_invariants()
    assert admitted > 100 and fetched > 200 and skipped > 50, (admitted, fetched, skipped)
