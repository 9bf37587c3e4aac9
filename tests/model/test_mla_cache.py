"""The contiguous MLA decode cache (k3.model.cache.MLACache) against the plain form it replaced: every held row a
torch.cat of the rows appended, truncation and window views of that. Random sequences of appends, truncations,
windows and forks, each cache's rows checked after every operation; and an append within the room writes only its
new rows."""

import random

import torch

from k3.model.cache import MLACache

R, DR = 6, 3


class _Plain:
    """The reference: the rows as one tensor, each append a concatenation."""

    def __init__(self, c=None, kr=None, start=0):
        self.c, self.kr, self.start = c, kr, start

    def append(self, c, kr):
        self.c = c.clone() if self.c is None else torch.cat([self.c, c], 1)
        self.kr = kr.clone() if self.kr is None else torch.cat([self.kr, kr], 1)

    def truncate(self, n):
        if self.c is not None:
            self.c, self.kr = self.c[:, :n], self.kr[:, :n]

    def keep_last(self, n):
        if self.c is not None and self.c.shape[1] > n:
            self.start += self.c.shape[1] - n
            self.c, self.kr = self.c[:, -n:], self.kr[:, -n:]

    def fork(self):
        return _Plain(self.c, self.kr, self.start)


def _same(cache: MLACache, plain: _Plain) -> bool:
    if plain.c is None:
        return cache.c is None and cache.length == 0
    return (torch.equal(cache.c, plain.c) and torch.equal(cache.k_rope, plain.kr) and cache.start == plain.start
            and cache.length == plain.c.shape[1])


def test_random_operations_equal_the_concatenating_cache():
    for seed in range(40):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        B = rng.choice([1, 3])
        pairs = [(MLACache(), _Plain())]
        for _ in range(60):
            i = rng.randrange(len(pairs))
            cache, plain = pairs[i]
            op = rng.random()
            if op < 0.55:
                T = rng.choice([1, 1, 1, 2, 5, 17, 40])
                c, kr = torch.randn(B, T, R, generator=g), torch.randn(B, T, DR, generator=g)
                cache.append(c, kr)
                plain.append(c, kr)
                c.fill_(0.0)  # the caller's tensors reused: the cache holds its own copy
            elif op < 0.7:
                n = rng.randrange(cache.length + 1)
                cache.truncate(n)
                plain.truncate(n)
            elif op < 0.85:
                n = rng.randrange(1, cache.length + 2)
                cache.keep_last(n)
                plain.keep_last(n)
            elif op < 0.93:  # every cache at once (MLACache.append_each), rows of its own length each
                rows = [(torch.randn(B, T, R, generator=g), torch.randn(B, T, DR, generator=g))
                        for T in (rng.choice([1, 2, 9, 40]) for _ in pairs)]
                MLACache.append_each([cc for cc, _ in pairs], rows)
                for (_, pp), (c, kr) in zip(pairs, rows):
                    pp.append(c, kr)
                    c.fill_(0.0)
            elif len(pairs) < 4:
                pairs.append((cache.fork(), plain.fork()))
            for j, (cc, pp) in enumerate(pairs):  # every cache, forks and their origins alike, still its own rows
                assert _same(cc, pp), (seed, j)


def test_an_append_within_the_room_writes_only_its_rows():
    cache = MLACache()
    cache.append(torch.randn(2, 100, R), torch.randn(2, 100, DR))
    ptr = cache.c.data_ptr()
    for _ in range(20):  # a decode step's rows go after the held ones, in the same backing tensor
        cache.append(torch.randn(2, 1, R), torch.randn(2, 1, DR))
        assert cache.c.data_ptr() == ptr
    assert cache.length == 120
    cache.truncate(110)  # a draft's guesses dropped: their room is written again, with no new tensors
    cache.append(torch.randn(2, 3, R), torch.randn(2, 3, DR))
    assert cache.c.data_ptr() == ptr and cache.length == 113
    fork = cache.fork()
    held = fork.c.clone()
    cache.truncate(100)  # below the rows the fork views: the next append moves this cache's rows first
    cache.append(torch.randn(2, 4, R), torch.randn(2, 4, DR))
    assert cache.c.data_ptr() != ptr and torch.equal(fork.c, held)
    fork.append(torch.randn(2, 1, R), torch.randn(2, 1, DR))  # a fork never writes into what it views
    assert fork.c.data_ptr() != ptr and torch.equal(fork.c[:, :113], held)


def test_the_benchmark_compares_the_two_caches(capsys):
    import json

    from helpers import load_benchmark

    assert load_benchmark("mla_cache_bench").main(["--context", "64", "300", "--appends", "8"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["context"] for r in lines] == [64, 300]
    assert all(r["capacity_us_per_append"] > 0 and r["concat_us_per_append"] > 0 for r in lines)


@torch.no_grad()
def test_a_cache_without_the_prefill_form_attends_absorbed_from_the_first_forward():
    """A serving draft's context (prefill_form=False): its first forward into an empty cache runs the absorbed form
    (plain ops, nothing compiled per length) and gives what the prefill form gives (fp32, 1e-5 of the largest entry:
    the same attention, the up-projections absorbed); a fork keeps the setting; the default cache still expands."""
    from k3.config import K3Config
    from k3.model.gated_mla import GatedMLA

    cfg = K3Config.from_preset("tiny")
    attn = GatedMLA(cfg, 0).eval()
    g = torch.Generator().manual_seed(0)
    B, T = 2, 7
    H, dq = attn.num_heads, attn.dn + attn.dr
    q = torch.randn(B, T, H, dq, generator=g)
    c, kr = torch.randn(B, T, cfg.kv_lora_rank, generator=g), torch.randn(B, T, attn.dr, generator=g)
    forms = []
    expanded = attn.expanded

    def watch(*a):
        forms.append("expanded")
        return expanded(*a)

    attn.expanded = watch
    want = MLACache().attend(attn, q, c, kr)
    assert forms == ["expanded"]
    draft = MLACache(prefill_form=False)
    got = draft.attend(attn, q, c, kr)
    assert forms == ["expanded"]  # not called again
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert draft.fork().prefill_form is False and MLACache().fork().prefill_form is True
    from k3.serve.speculative.draft import _Context

    assert _Context().cache.prefill_form is False  # the MTP and EAGLE-3 drafts' contexts
