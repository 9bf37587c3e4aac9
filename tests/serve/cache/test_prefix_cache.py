"""KDA-aware prefix cache bookkeeping (k3.serve.cache.prefix; report §5.4.1).

The property tests drive the cache from a simulated engine over a fake page pool: an MLA page holds
{row: (group, position, token)}, a KDA page holds (group, token prefix the state summarizes). Fresh pages keep
their previous owner's content, and every copy / KV write / checkpoint write of a scheduling step is deferred to the
end of the step, after everything the scheduler did in it (the most adversarial legal order: registration and
admission run before the device work lands). Each forward first checks that the request's pages hold exactly its
tokens [0, start) in every MLA group and that its running state summarizes exactly tokens[:start] in every KDA group.
"""

import os
import random
import subprocess
import sys
from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.serve.cache.prefix import CopyOp, OutOfPages, PrefixCache, chain_hash


# ---- the simulated engine ----------------------------------------------------------------------------------------

class Pool:
    def __init__(self, cache: PrefixCache):
        self.c, self.pages = cache, {}

    def row(self, page, off):
        content = self.pages.get(page)
        return content.get(off) if isinstance(content, dict) else None

    def copy(self, op: CopyOp):
        if op.tokens is None:
            self.pages[op.dst] = self.pages.get(op.src)
        else:
            dst = self.pages.get(op.dst)
            dst = dict(dst) if isinstance(dst, dict) else {}
            for off in range(op.tokens):
                dst[off] = self.row(op.src, off)
            self.pages[op.dst] = dst

    def write_kv(self, tables, start, end, tokens):
        pt = self.c.page_tokens
        for g, table in enumerate(tables):
            for pos in range(start, end):
                page = table[pos // pt]
                if not isinstance(self.pages.get(page), dict):
                    self.pages[page] = {}
                self.pages[page][pos % pt] = (g, pos, tokens[pos])

    def assert_holds(self, tables, kda_pages, tokens, n):
        """The request's view: KV rows [0, n) in every MLA group, a state of exactly tokens[:n] in every KDA group."""
        pt = self.c.page_tokens
        for g, table in enumerate(tables):
            assert len(table) * pt >= n
            for pos in range(n):
                assert self.row(table[pos // pt], pos % pt) == (g, pos, tokens[pos]), (g, pos)
        for g, page in enumerate(kda_pages):
            assert self.pages.get(page) == (g, tuple(tokens[:n])), g


@dataclass
class Req:
    sid: int
    tokens: list  # prompt + response, all known up front (the simulator has no model)
    prompt_len: int
    conv: int
    turn: int
    done: int = 0  # tokens whose forward is launched


def make_workload(rng: random.Random, n_convs: int):
    """Conversations of 1-3 turns; turn k+1's prompt = turn k's prompt + response + new text; roots are shared."""
    alphabet = rng.choice([2, 3, 1000])
    rand = lambda n: [rng.randrange(alphabet) for _ in range(n)]  # noqa: E731
    roots = [rand(rng.randint(0, 24)) for _ in range(rng.randint(1, 3))]
    convs = []
    for _ in range(n_convs):
        ctx, turns = list(rng.choice(roots)[:rng.randint(0, 24)]), []
        for _ in range(rng.randint(1, 3)):
            ctx += rand(rng.randint(1, 8))
            resp = rand(rng.randint(0, 8))
            turns.append((len(ctx), ctx + resp))
            ctx = ctx + resp
        convs.append(turns)
    return convs


def held_by_running(cache: PrefixCache, running, but=None) -> set:
    out = set()
    for sid in running:
        if sid != but:
            tables, kda = cache.running_pages(sid)
            out.update(kda, *tables)
    return out


def simulate(cache: PrefixCache, rng: random.Random, convs, exact: bool, max_running: int, max_aborts: int):
    """Runs the conversations to completion (or a step cap). exact: every checkpoint is a turn boundary and the
    pool is large, so the expected hit is known exactly (checked while no eviction has happened)."""
    pool, hb, K = Pool(cache), cache.hash_block_tokens, cache.num_kda_groups
    waiting = deque(Req(i, list(turns[0][1]), turns[0][0], i, 0) for i, turns in enumerate(convs))
    running: dict[int, Req] = {}
    landed = set()  # oracle: prefixes with a landed checkpoint (or, without KDA groups, a landed MLA block)
    next_sid, aborts, hits = len(convs), 0, 0

    def requeue(r: Req):  # preempted: re-admitted later with everything known so far as its prompt
        nonlocal next_sid
        waiting.append(Req(next_sid, r.tokens, max(r.prompt_len, r.done), r.conv, r.turn))
        next_sid += 1

    for _ in range(600):
        if not (waiting or running):
            break
        copies, zeros, forwards, ckpts = [], [], [], []
        step_prefixes = []

        def schedule(r: Req):
            start, end = r.done, min(len(r.tokens), r.done + rng.randint(1, 3 * hb + 2))
            before = held_by_running(cache, running, but=r.sid)
            old_tables = cache.block_tables(r.sid)
            old = {p for t in old_tables for p in t}
            try:
                tables = cache.ensure_capacity(r.sid, end)
            except OutOfPages:
                assert cache.block_tables(r.sid) == old_tables  # all or nothing
                cache.check_invariants()
                cache.abort(r.sid)
                del running[r.sid]
                requeue(r)
                return
            new = {p for t in tables for p in t} - old
            assert not new & before, "a running request's page was handed out again"
            cache.check_invariants()
            cache.register_tokens(r.sid, r.tokens[:end])
            forwards.append((r.sid, start, end))
            step_prefixes.extend(tuple(r.tokens[:i * hb]) for i in range(1, end // hb + 1) if not K)
            P = end // hb * hb
            if K and P > start:
                turn = exact or rng.random() < 0.3
                slots = cache.checkpoint_slots(r.sid, P, turn_boundary=turn)
                if slots is not None:
                    assert len(slots) == K and not set(slots) & held_by_running(cache, running)
                    ckpts.append((r.sid, P, slots))
                    step_prefixes.append(tuple(r.tokens[:P]))
            r.done = end
            cache.check_invariants()

        slots_for_admission = max(0, max_running - len(running))
        order = list(running) + [None] * min(len(waiting), slots_for_admission)
        rng.shuffle(order)
        for sid in order:
            if sid is None:  # admit the next waiting request, and prefill its first chunk in this same step
                r = waiting.popleft()
                prompt = r.tokens[:r.prompt_len]
                before = held_by_running(cache, running)
                evictions_before = cache.stats()["evictions"]
                try:
                    adm = cache.admit(r.sid, prompt)
                except OutOfPages:
                    cache.check_invariants()
                    waiting.appendleft(r)
                    continue
                cache.check_invariants()
                B = adm.hit_tokens
                assert B % hb == 0 and 0 <= B <= len(prompt) - 1
                assert B == 0 or tuple(prompt[:B]) in landed  # persisted, and landed before this step
                if exact and evictions_before == 0:
                    want = max((b for b in range(0, len(prompt), hb) if tuple(prompt[:b]) in landed), default=0)
                    assert B == want, (B, want)
                fresh = set(adm.kda_pages) | {c.dst for c in adm.copies if c.tokens is not None}
                assert not fresh & before and len(adm.kda_pages) == K
                hits += B > 0
                copies += [(r.sid, c) for c in adm.copies]
                if B == 0:
                    zeros.append(r.sid)
                r.done = B
                running[r.sid] = r
                schedule(r)
                continue
            if sid not in running:
                continue
            r, u = running[sid], rng.random()
            if r.done == len(r.tokens):  # done: finish, the next turn of the conversation arrives
                if not exact and u < 0.2 and r.done >= hb:
                    cache.finish(sid, turn_boundary_position=rng.randrange(hb, r.done + 1, hb))
                else:
                    cache.finish(sid)
                del running[sid]
                turns = convs[r.conv]
                if r.turn + 1 < len(turns):
                    plen, toks = turns[r.turn + 1]
                    waiting.append(Req(next_sid, list(toks), plen, r.conv, r.turn + 1))
                    next_sid += 1
            elif u < 0.05 and aborts < max_aborts:  # preemption (not yet launched in this step)
                aborts += 1
                cache.abort(sid)
                del running[sid]
                requeue(r)
            elif u < 0.2:
                continue  # not scheduled this step
            else:
                schedule(r)
            cache.check_invariants()

        # ---- the device work of the step, in launch order: copies, zeroing, forward, checkpoint persistence ------
        for sid, op in copies:
            if sid in running:  # copies of a request preempted before its launch never run
                pool.copy(op)
        for sid in zeros:
            if sid in running:
                for g, page in enumerate(cache.running_pages(sid)[1]):
                    pool.pages[page] = (g, ())
        persisted = []
        for sid, start, end in forwards:
            if sid not in running:
                continue
            r = running[sid]
            tables, kda = cache.running_pages(sid)
            pool.assert_holds(tables, kda, r.tokens, start)
            pool.write_kv(tables, start, end, r.tokens)
            for s, P, slots in ckpts:
                if s == sid:  # the kernel emits the state at P from the restored/running state
                    persisted += [(slot, (g, pool.pages[kda[g]][1] + tuple(r.tokens[start:P])))
                                  for g, slot in enumerate(slots)]
            for g, page in enumerate(kda):
                pool.pages[page] = (g, pool.pages[page][1] + tuple(r.tokens[start:end]))
        for slot, content in persisted:
            pool.pages[slot] = content
        cache.mark_landed()
        cache.check_invariants()
        landed.update(step_prefixes)

    for sid in list(running):
        cache.abort(sid)
    cache.mark_landed()
    cache.check_invariants()
    return hits


def assert_drained(cache: PrefixCache):
    """With nothing running, every page is free or index-held, and one request can take the whole pool."""
    s = cache.stats()
    assert s["running"] == 0
    assert s["free_pages"] + s["cached_mla_pages"] + s["checkpoint_pages"] == cache.num_pages
    assert cache.available_pages() == cache.num_pages
    G, K = cache.num_mla_groups, cache.num_kda_groups
    cache.admit("drain", [10**9])
    per_group = (cache.num_pages - K) // G
    tables = cache.ensure_capacity("drain", per_group * cache.page_tokens)
    assert all(len(t) == per_group for t in tables)
    # What is left is free or still held by evictable index entries (eviction only takes what it needs).
    assert cache.available_pages() == (cache.num_pages - K) % G
    with pytest.raises(OutOfPages):
        cache.ensure_capacity("drain", (per_group + 1) * cache.page_tokens)
    cache.check_invariants()
    cache.abort("drain")
    cache.check_invariants()


configs = st.fixed_dictionaries({
    "hb": st.integers(1, 4), "bpp": st.integers(1, 4), "G": st.integers(1, 2), "K": st.integers(0, 3),
    "n_convs": st.integers(1, 6), "max_running": st.integers(1, 4), "seed": st.integers(0, 2**32 - 1),
})


def _lone_request_pages(G, K, hb, bpp, convs):
    longest = max(len(toks) for turns in convs for _, toks in turns)
    return G * (-(-longest // (hb * bpp)) + 1) + 3 * K


# ---- properties 1, 2, 4: random workloads ------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(cfg=configs, extra=st.integers(0, 12))
def test_small_pool_restores_exact_prefixes_under_eviction(cfg, extra):
    rng = random.Random(cfg["seed"])
    convs = make_workload(rng, cfg["n_convs"])
    G, K, hb, bpp = cfg["G"], cfg["K"], cfg["hb"], cfg["bpp"]
    cache = PrefixCache(_lone_request_pages(G, K, hb, bpp, convs) + extra, G, K, hb * bpp, hb)
    simulate(cache, rng, convs, exact=False, max_running=cfg["max_running"], max_aborts=8)
    assert_drained(cache)


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_large_pool_hit_is_longest_valid_boundary(cfg):
    rng = random.Random(cfg["seed"])
    convs = make_workload(rng, cfg["n_convs"])
    G, K, hb, bpp = cfg["G"], cfg["K"], cfg["hb"], cfg["bpp"]
    attempts = sum(len(t) for t in convs) + 2
    longest = max(len(toks) for turns in convs for _, toks in turns)
    num_pages = attempts * (G * (-(-longest // (hb * bpp)) + 1) + K * (2 + longest // hb))
    cache = PrefixCache(num_pages, G, K, hb * bpp, hb)
    simulate(cache, rng, convs, exact=True, max_running=cfg["max_running"], max_aborts=2)
    assert cache.stats()["evictions"] == 0  # the exact oracle was checked at every admission
    assert_drained(cache)


def test_multi_turn_chat_hits_the_previous_turn():
    rng = random.Random(0)
    hb, pt = 4, 16
    cache = PrefixCache(200, 2, 3, pt, hb)
    convs = [[(10, list(range(10)) + [50, 51, 52]), (20, list(range(10)) + [50, 51, 52] + list(range(60, 67)) + [1])]]
    assert simulate(cache, rng, convs, exact=True, max_running=1, max_aborts=0) == 1
    s = cache.stats()
    assert s["hits"] == 1 and s["hit_tokens"] == 12  # turn 2 resumes at the last hash boundary of turn 1
    assert_drained(cache)


# ---- property 5 --------------------------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(cfg=configs)
def test_disabled_never_hits_and_frees_everything(cfg):
    rng = random.Random(cfg["seed"])
    convs = make_workload(rng, cfg["n_convs"])
    G, K, hb, bpp = cfg["G"], cfg["K"], cfg["hb"], cfg["bpp"]
    num_pages = _lone_request_pages(G, K, hb, bpp, convs) + 4
    cache = PrefixCache(num_pages, G, K, hb * bpp, hb, enable=False)
    assert simulate(cache, rng, convs, exact=False, max_running=cfg["max_running"], max_aborts=4) == 0
    s = cache.stats()
    assert s["hits"] == s["hit_tokens"] == s["cached_blocks"] == s["checkpoints"] == 0
    assert s["free_pages"] == cache.num_pages
    assert_drained(cache)


# ---- deterministic cases -----------------------------------------------------------------------------------------

def _prefill(cache, sid, tokens, chunks, turn=True):
    """Admit and compute `tokens` in chunks, persisting a checkpoint after every chunk; one step per chunk."""
    adm = cache.admit(sid, tokens)
    done = adm.hit_tokens
    for n in chunks:
        end = min(len(tokens), done + n)
        cache.ensure_capacity(sid, end)
        cache.register_tokens(sid, tokens[:end])
        P = end // cache.hash_block_tokens * cache.hash_block_tokens
        if P > done:
            cache.checkpoint_slots(sid, P, turn_boundary=turn)
        done = end
        cache.mark_landed()
        cache.check_invariants()
    return adm


def test_hits_at_every_hash_boundary_inside_pages():
    hb, pt, G, K = 2, 8, 2, 3
    cache = PrefixCache(100, G, K, pt, hb)
    S = [7 * i % 11 for i in range(30)]
    _prefill(cache, "a", S, [1] * 30)
    cache.finish("a")
    cache.mark_landed()
    for B in range(hb, 30, hb):
        adm = cache.admit(("hit", B), S[:B] + [99])
        assert adm.hit_tokens == B
        cow = [c for c in adm.copies if c.tokens is not None]
        restore = [c for c in adm.copies if c.tokens is None]
        assert [c.dst for c in restore] == adm.kda_pages and len(restore) == K
        assert len(cow) == (G if B % pt else 0) and all(c.tokens == B % pt for c in cow)
        assert all(len(t) == -(-B // pt) for t in adm.mla_tables)
        assert [t[-1] for t in adm.mla_tables if B % pt] == [c.dst for c in cow]
        assert cache.admit(("short", B), S[:B]).hit_tokens == B - hb  # at least one token left to compute
        cache.abort(("hit", B))
        cache.abort(("short", B))
        cache.mark_landed()
        cache.check_invariants()
    assert cache.admit("one", S[:1]).hit_tokens == 0


def test_hit_is_longest_boundary_with_both_mla_blocks_and_checkpoint():
    hb, pt = 2, 8
    cache = PrefixCache(100, 1, 2, pt, hb)
    S = list(range(20))
    # Intermediate checkpoints (4, 10, 14) are recycled: only the newest (20) survives; MLA blocks cover all 20.
    _prefill(cache, "a", S, [5, 5, 5, 5], turn=False)
    assert cache.stats()["checkpoints"] == 1
    cache.finish("a")
    cache.mark_landed()
    assert cache.admit("b", S + [1]).hit_tokens == 20
    assert cache.admit("c", S[:19] + [0, 0, 0]).hit_tokens == 0  # MLA matches 18 tokens, no checkpoint below it
    cache.abort("b")
    cache.abort("c")
    cache.mark_landed()
    _prefill(cache, "d", S[:12] + [5] * 6, [6, 6, 6], turn=True)  # turn checkpoints at 6, 12, 18
    cache.finish("d")
    cache.mark_landed()
    assert cache.admit("e", S[:19] + [0, 0, 0]).hit_tokens == 12
    cache.check_invariants()


def test_nothing_registered_in_the_current_step_is_matchable():
    hb, pt = 2, 8
    cache = PrefixCache(100, 2, 2, pt, hb)
    S = list(range(12))
    # A checkpoint persisted in this step over MLA blocks that landed earlier: still not a hit.
    Z = [100 + t for t in S]
    cache.admit("z", Z[:11])
    cache.ensure_capacity("z", 11)
    cache.register_tokens("z", Z[:11])
    cache.mark_landed()
    assert cache.checkpoint_slots("z", 10) is not None
    assert cache.admit("y", Z[:10] + [0]).hit_tokens == 0
    cache.mark_landed()
    assert cache.admit("x", Z[:10] + [0]).hit_tokens == 10
    for sid in "zyx":
        cache.abort(sid)
    cache.mark_landed()
    cache.admit("a", S)
    cache.ensure_capacity("a", 12)
    cache.register_tokens("a", S)
    assert cache.checkpoint_slots("a", 12) is not None
    assert cache.admit("b", S + [1]).hit_tokens == 0  # same step: the KV rows and the state have not landed
    cache.mark_landed()
    assert cache.admit("c", S + [1]).hit_tokens == 12
    # MLA landed, a newer checkpoint still in flight: the hit stays at the landed one.
    cache.ensure_capacity("a", 16)
    cache.register_tokens("a", S + [20, 21, 22, 23])
    assert cache.checkpoint_slots("a", 16) is not None
    assert cache.admit("d", S + [20, 21, 22, 23, 0]).hit_tokens == 0  # 12 was recycled when 16 was persisted
    cache.check_invariants()
    cache.mark_landed()
    assert cache.admit("e", S + [20, 21, 22, 23, 0]).hit_tokens == 16
    # Pending entries are not evictable either, even when held only by the index.
    T = S + [20, 21, 22, 23] + [30] * 8
    cache.ensure_capacity("a", 24)
    cache.register_tokens("a", T)
    assert cache.checkpoint_slots("a", 24) is not None  # supersedes 16; e's pin keeps its pages until landing
    cache.abort("a")  # its unit for tokens [16, 24) and the checkpoint at 24 are now held by the index only
    cache.check_invariants()
    fillers = 0
    with pytest.raises(OutOfPages):
        while True:
            cache.admit(("filler", fillers), [1000 + fillers])
            fillers += 1
    assert cache.stats()["evictable_pages"] == 0 and cache.stats()["checkpoints"] == 1
    cache.mark_landed()
    cache.check_invariants()
    assert cache.stats()["evictable_pages"] == 2 + 2  # the landed unit (one page per MLA group) + the checkpoint
    assert cache.stats()["free_pages"] == 2  # the superseded checkpoint at 16, unpinned
    assert cache.admit("f", T + [0]).hit_tokens == 24
    cache.check_invariants()


def test_checkpoint_eviction_invalidates_siblings_atomically():
    hb, pt, K = 2, 4, 3
    cache = PrefixCache(20, 1, K, pt, hb)
    S = [1, 2, 3, 4, 5, 6]
    _prefill(cache, "a", S, [6])  # table 2 pages + running state 3 + checkpoint at 6: 3 pages
    cache.finish("a")
    cache.mark_landed()
    cache.check_invariants()
    s = cache.stats()
    assert s["free_pages"] == 20 - 2 - K and s["checkpoints"] == 1 and s["evictable_pages"] == 2 + K
    cache.admit("x", [9])  # K fresh running-state pages
    n = s["free_pages"] - K
    cache.ensure_capacity("x", n * pt)  # exhausts the free list exactly
    assert cache.stats()["free_pages"] == 0
    # One more page: the least recently used entry is the checkpoint (idle since it landed; the MLA units only
    # since a finished). Evicting it frees all K sibling pages at once.
    cache.ensure_capacity("x", (n + 1) * pt)
    cache.check_invariants()
    s2 = cache.stats()
    assert s2["checkpoints"] == 0 and s2["checkpoint_pages"] == 0 and s2["free_pages"] == K - 1
    assert s2["evictions"] == 1 and s2["cached_blocks"] == 3
    cache.abort("x")
    cache.mark_landed()
    assert cache.admit("b", S + [0]).hit_tokens == 0  # the MLA blocks alone are not a hit
    cache.check_invariants()


def test_hit_pages_are_pinned_before_allocation():
    hb, pt, G, K = 2, 4, 2, 2
    S = list(range(6))
    cache = PrefixCache(3 * G + 2 * K, G, K, pt, hb)
    _prefill(cache, "a", S, [6])  # 2 pages x G, running K, checkpoint K
    cache.finish("a")
    cache.mark_landed()
    # The hit at 6 pins 2 units (4 pages) + the checkpoint; the private K pages + G CoW pages need G + K pages.
    free = cache.stats()["free_pages"]
    assert free == G + K
    adm = cache.admit("b", S + [0])
    assert adm.hit_tokens == 6 and cache.stats()["free_pages"] == 0 and cache.stats()["evictions"] == 0
    cache.check_invariants()
    before = cache.stats()
    with pytest.raises(OutOfPages):  # everything left is pinned by b: nothing may be evicted
        cache.admit("c", S + [1])
    assert cache.stats() == before  # the failed admission took its pins back
    cache.check_invariants()
    cache.abort("b")
    cache.mark_landed()
    assert cache.admit("c", S + [1]).hit_tokens == 6
    cache.check_invariants()


def test_out_of_pages_when_running_requests_hold_the_pool():
    cache = PrefixCache(10, 2, 2, 4, 2)
    cache.admit("a", [1, 2, 3])
    cache.ensure_capacity("a", 8)  # 2 pages x 2 groups; with the running state, 6 of 10 pages in use
    cache.admit("b", [4, 5, 6])
    with pytest.raises(OutOfPages):
        cache.ensure_capacity("b", 8)  # needs 4 pages, 2 left: nothing is evicted, nothing is taken
    assert cache.block_tables("b") == [[], []] and cache.stats()["free_pages"] == 2
    cache.check_invariants()
    cache.admit("c", [7])  # the last 2 pages: its running state
    with pytest.raises(OutOfPages):
        cache.admit("d", [8])
    assert cache.stats()["free_pages"] == 0
    cache.abort("a")
    cache.ensure_capacity("b", 8)
    cache.check_invariants()


def test_superseded_checkpoint_survives_until_its_reader_copied_it():
    hb, pt = 2, 4
    cache = PrefixCache(40, 1, 2, pt, hb)
    S = list(range(10))
    cache.admit("a", S)
    cache.ensure_capacity("a", 4)
    cache.register_tokens("a", S[:4])
    old = cache.checkpoint_slots("a", 4)
    cache.mark_landed()
    adm = cache.admit("b", S[:4] + [0])  # restores from a's intermediate checkpoint at 4
    assert adm.hit_tokens == 4 and [c.src for c in adm.copies if c.tokens is None] == old
    cache.ensure_capacity("a", 8)
    cache.register_tokens("a", S[:8])
    new = cache.checkpoint_slots("a", 8)  # supersedes 4; b's pin keeps its pages out of the free list
    assert not set(new) & set(old) and cache.stats()["checkpoints"] == 1
    cache.check_invariants()
    free = cache.stats()["free_pages"]
    cache.mark_landed()  # b's copy has landed: the superseded pages are recycled
    assert cache.stats()["free_pages"] == free + 2
    assert cache.admit("c", S[:4] + [0]).hit_tokens == 0
    cache.check_invariants()


def test_a_request_recycles_only_its_own_checkpoints():
    hb, pt = 2, 4
    cache = PrefixCache(40, 1, 2, pt, hb)
    S = list(range(10))
    _prefill(cache, "a", S, [4], turn=False)  # a's intermediate checkpoint at 4; a keeps running
    assert cache.admit("b", S[:4] + [0, 1, 2, 3]).hit_tokens == 4
    cache.ensure_capacity("b", 8)
    cache.register_tokens("b", S[:4] + [0, 1, 2, 3])
    assert cache.checkpoint_slots("b", 8) is not None  # b moves on from 4, which is a's to recycle
    cache.mark_landed()
    assert cache.admit("c", S[:4] + [7]).hit_tokens == 4
    cache.check_invariants()


def test_finish_retains_turn_boundary_and_recycles_the_rest():
    hb, pt = 2, 4
    cache = PrefixCache(40, 1, 1, pt, hb)
    S = list(range(12))
    cache.admit("a", S[:6])
    cache.ensure_capacity("a", 6)
    cache.register_tokens("a", S[:6])
    cache.checkpoint_slots("a", 6, turn_boundary=True)  # end of the prompt
    cache.mark_landed()
    cache.ensure_capacity("a", 10)
    cache.register_tokens("a", S[:10])
    cache.checkpoint_slots("a", 10)  # inside the response
    cache.mark_landed()
    cache.finish("a", turn_boundary_position=6)  # the client regenerates: keep the prompt boundary only
    cache.mark_landed()
    assert cache.stats()["checkpoints"] == 1
    assert cache.admit("b", S[:11]).hit_tokens == 6
    cache.check_invariants()


def test_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="page_tokens=6, hash_block_tokens=4"):
        PrefixCache(10, 1, 1, page_tokens=6, hash_block_tokens=4)
    cache = PrefixCache(10, 1, 1, 4, 2)
    with pytest.raises(ValueError, match="empty"):
        cache.admit("a", [])
    cache.admit("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already admitted"):
        cache.admit("a", [1])
    cache.ensure_capacity("a", 3)
    cache.register_tokens("a", [1, 2, 3])
    with pytest.raises(ValueError, match="position=3"):
        cache.checkpoint_slots("a", 3)
    with pytest.raises(ValueError, match="position=4"):
        cache.checkpoint_slots("a", 4)  # not reached yet
    with pytest.raises(ValueError, match="ensure_capacity"):
        cache.register_tokens("a", [1, 2, 3, 4, 5])


def test_chain_hash_is_deterministic_across_processes():
    code = "from k3.serve.cache.prefix import chain_hash as h; print(h(h(b'', [1, 2, 3]), [2**40, 0]).hex())"
    here = chain_hash(chain_hash(b"", [1, 2, 3]), [2**40, 0]).hex()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        assert out == here
    assert chain_hash(b"", [1, 2, 3]) != chain_hash(b"", [1, 2, 4]) != chain_hash(b"x", [1, 2, 4])
