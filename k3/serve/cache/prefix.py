"""KDA-aware prefix cache bookkeeping (report §5.4.1, SPEC §4).

Pure bookkeeping over integer page ids: the engine owns a tensor pool of `num_pages` equal-size pages, asks this
manager which pages to use, and copies the bytes itself. Cache *groups* share the pool, one free list and one set
of reference counts: one MLA group per Gated MLA layer (a page holds `page_tokens` tokens of latent KV) and one KDA
group per KDA layer (a page holds one recurrent state + conv tail).

A request owns, per MLA group, a block table (page j holds tokens [j*page_tokens, (j+1)*page_tokens)) and, per KDA
group, one private running-state page. Prefix hashing runs on fine hash blocks of `hash_block_tokens` inside the
coarse pages; h_i = blake2b(h_{i-1} || int64 tokens of block i), so an endpoint hash certifies its whole prefix.
A prompt with images (k3.serve.images) also gives its `MediaSpan`s: the placeholder runs of its images with each
image's content hash. Every block that holds placeholders of an image mixes that image's hash (and where its run lies
in the block) into h_i, so two prompts with the same token ids and different images never share a block, and, by
the chain, nothing after it; the same image and text sent again hash the same and hit.

* MLA index: every completed hash block i of a request is registered as endpoint hash h_i -> the request's page
  holding block i (one page per MLA group, a "unit"). A partially filled page is thus registered under its last
  complete hash block, and the registered endpoint advances as the page fills. A unit's page holds valid rows for
  every token of its page up to any endpoint registered on it.
* KDA checkpoints: read-only snapshots of the recurrent state at an endpoint, one page per KDA group, created and
  evicted together (a checkpoint exists in every KDA group or in none). A running request owns at most one
  intermediate checkpoint and recycles it when it persists a newer one; turn-boundary checkpoints are kept.
* Lookup: walk the request's chain while each endpoint is registered and landed (MLA stage), then take the longest
  of those endpoints with a landed checkpoint (KDA stage); the hit B is at most prompt_len - 1. Full pages below the
  page holding B are shared; that page itself, if B is not page-aligned, is copied on write into a fresh page.
* Landing: anything registered in the current scheduling step may still be unwritten on the device, so it is
  neither matchable nor evictable until `mark_landed()`.
* Eviction: LRU over entries held only by the index (no running request, no pin), when the free list runs dry.
* Host write-back and prefetch (report §5.3.1, k3.serve.cache.host): `peek` finds, without changing anything, the
  pages of the longest prefix of a token sequence that a lookup would restore (the same two stages over all its
  complete hash blocks); `import_prefixes` allocates pages for prefixes whose bytes come from elsewhere and registers
  them as landed index-held entries (evictable once the call returns), MLA units and the KDA checkpoint together.

Engine call order per scheduling step (see also the tests' simulator):
  1. Schedule. New request: `admit` (returns the hit and the copies), then `ensure_capacity(seq, hit + chunk)`.
     Running request: `ensure_capacity(seq, computed + chunk)`. `OutOfPages` => preempt a victim with `abort`
     (one not launched in this step), or leave the request waiting; admit/ensure_capacity change nothing on failure.
  2. Before the forward, on the forward's stream: execute every `Admission.copies` op; zero the KDA running-state
     pages of a request admitted with hit_tokens == 0 (fresh pages hold stale bytes).
  3. Launch the forward: KV rows of [start, end) into the block tables, the running state advances in place.
  4. `register_tokens(seq, tokens[:end])` once the forward is launched (it need not have completed).
  5. P = last multiple of hash_block_tokens in (start, end]: `checkpoint_slots(seq, P)`; if it returns pages, copy
     the state at P of KDA group g into page g after the forward (the kernel emits the state at P).
  6. `finish` / `abort` requests that are done (not one whose registered tokens were never launched).
  7. `mark_landed()` once the copies, forward and checkpoint writes of this step are ordered before anything the
     next step launches (same stream, or an event the next step waits on).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Hashable, NamedTuple, Sequence

_ROOT = hashlib.blake2b(b"k3 prefix cache", digest_size=16).digest()


def prompt_boundary(prompt_len: int, hash_block_tokens: int) -> int:
    """The last hash-aligned position before a prompt's last token: the longest prefix cache hit the same prompt
    can use when it comes again (a lookup leaves at least the last prompt token to compute); 0: none."""
    return (prompt_len - 1) // hash_block_tokens * hash_block_tokens if prompt_len > 0 else 0


class MediaSpan(NamedTuple):
    """An image's placeholder run in a prompt: tokens [start, end), whose embeddings the encoder computes from the
    image whose content hash is `key` (k3.serve.images.image_digest)."""

    start: int
    end: int
    key: bytes


def chain_hash(prev: bytes, block: Sequence[int], media: bytes = b"") -> bytes:
    """h_i = H(h_{i-1}, tokens of block i, the block's media salt): deterministic across processes (no Python
    `hash`). A full block's tokens are a fixed number of bytes, so the salt cannot be confused with tokens; a block
    without images has the empty salt (the hash of text is unchanged)."""
    data = array("q", block)
    if sys.byteorder == "big":
        data.byteswap()
    return hashlib.blake2b(prev + data.tobytes() + media, digest_size=16).digest()


def media_salt(media: Sequence[MediaSpan], start: int, end: int) -> bytes:
    """What the images of `media` put into the hash of the block of tokens [start, end): for each image with
    placeholders there, in order, where its run starts and ends in the block, which of its rows the block begins
    with, and its content hash. Empty for a block without images."""
    out = b""
    for m in media:
        if m.start < end and m.end > start:
            lo, hi = max(m.start, start), min(m.end, end)
            out += struct.pack("<qqq", lo - start, hi - start, lo - m.start) + m.key
    return out


class OutOfPages(RuntimeError):
    """Neither the free list nor evictable cache entries can supply the pages asked for (the scheduler preempts)."""


@dataclass
class CopyOp:
    """Copy page `src` to page `dst`: the whole page (tokens=None, a KDA state) or its first `tokens` KV rows."""

    src: int
    dst: int
    tokens: int | None


@dataclass
class Admission:
    """`mla_tables[g]` already holds the shared pages and the fresh copy-on-write page; `kda_pages[g]` is the
    private running state of KDA group g; `copies` must run before the request's first forward."""

    seq_id: Hashable
    hit_tokens: int
    mla_tables: list[list[int]]
    kda_pages: list[int]
    copies: list[CopyOp]


@dataclass
class PrefixHit:
    """What `peek` found: a cached prefix of `tokens` tokens (hash blocks 1..len(hashes)). `pages[j]` (one page per
    MLA group) holds valid rows of every token of coarse page j up to the hit; `ckpt_pages` (one per KDA group) hold
    the KDA checkpoint at the hit's end."""

    tokens: int
    hashes: list[bytes]
    pages: list[tuple[int, ...]]
    ckpt_pages: tuple[int, ...]


@dataclass
class Imported:
    """What `import_prefixes` registered for one prefix of `tokens` tokens: the caller fills `units` (coarse page j,
    one fresh page per MLA group: rows of the prefix's page j, up to the prefix's end or the page's) and
    `ckpt_pages` (one per KDA group: the state at the prefix's end; empty when the index already had it). Pages of
    the prefix that the index already held are not allocated again."""

    tokens: int
    units: list[tuple[int, tuple[int, ...]]]
    ckpt_pages: tuple[int, ...]


@dataclass
class _Unit:  # one page per MLA group holding the same token rows; the eviction unit of the MLA index
    pages: tuple[int, ...]
    hashes: set[bytes]


@dataclass
class _Block:  # one registered endpoint: hash block i lives in unit `head`
    head: int
    step: int


@dataclass
class _Checkpoint:
    position: int
    pages: tuple[int, ...]  # one per KDA group: siblings, created and evicted together
    step: int
    turn: bool  # a conversation-turn boundary: never recycled by supersession
    # The running requests whose newest checkpoint this intermediate one is (its creator, and any that reached the
    # same endpoint while it was theirs); it is recycled when the last of them persists a newer one. Empty: an
    # ordinary LRU entry (a turn boundary, an imported one, or one whose holders all left).
    owners: set = field(default_factory=set)


@dataclass
class _Request:
    tables: list[list[int]]
    kda_pages: list[int]
    hashes: list[bytes]  # chained hash of every complete hash block known so far
    registered: int  # hash blocks already offered to the MLA index
    num_tokens: int  # tokens whose KV and state are computed (hit + registered)
    ckpt: bytes | None = None  # endpoint hash of its newest checkpoint
    ckpt_pos: int = 0
    media: tuple[MediaSpan, ...] = ()  # its prompt's images, salted into the hashes of their blocks


class PrefixCache:
    def __init__(self, num_pages: int, num_mla_groups: int, num_kda_groups: int, page_tokens: int = 2048,
                 hash_block_tokens: int = 512, enable: bool = True):
        if num_mla_groups < 1 and enable:
            raise ValueError(f"num_mla_groups={num_mla_groups}: the prefix cache needs at least one MLA group (hashes "
                             "index its pages); a model without MLA layers serves with enable=False")
        if num_mla_groups < 0:
            raise ValueError(f"num_mla_groups={num_mla_groups}: must be >= 0")
        if num_kda_groups < 0:
            raise ValueError(f"num_kda_groups={num_kda_groups}: must be >= 0")
        if hash_block_tokens < 1 or page_tokens < 1 or page_tokens % hash_block_tokens:
            raise ValueError(f"page_tokens={page_tokens}, hash_block_tokens={hash_block_tokens}: page_tokens must be "
                             "a positive multiple of hash_block_tokens")
        if num_pages < num_mla_groups + num_kda_groups:
            raise ValueError(f"num_pages={num_pages}: too small for one page per cache group")
        self.num_pages, self.enable = num_pages, enable
        self.num_mla_groups, self.num_kda_groups = num_mla_groups, num_kda_groups
        self.page_tokens, self.hash_block_tokens = page_tokens, hash_block_tokens
        self.blocks_per_page = page_tokens // hash_block_tokens
        self._free: deque[int] = deque(range(num_pages))
        self._ref = [0] * num_pages
        self._units: dict[int, _Unit] = {}  # head page (MLA group 0) -> unit
        self._blocks: dict[bytes, _Block] = {}  # endpoint hash -> unit holding that hash block
        self._ckpts: dict[bytes, _Checkpoint] = {}
        self._entry_of: dict[int, tuple] = {}  # index-held page -> ("mla", head) | ("kda", endpoint hash)
        self._lru: OrderedDict[tuple, None] = OrderedDict()  # evictable entries, least recently used first
        self._pending: dict[tuple, None] = {}  # entries registered this step (ordered): unmatchable, unevictable
        self._pins: list[int] = []  # copy sources pinned until their copies land (mark_landed)
        self._reqs: dict[Hashable, _Request] = {}
        self._step = 0
        self._counts = Counter()

    # ---- reference counts, LRU, allocation, eviction -------------------------------------------------------------

    def _entry_pages(self, key: tuple) -> tuple[int, ...]:
        return self._units[key[1]].pages if key[0] == "mla" else self._ckpts[key[1]].pages

    def _refresh(self, key: tuple) -> None:
        """An entry is evictable iff landed and the index's reference is the only one on all its pages."""
        if key not in self._pending and all(self._ref[p] == 1 for p in self._entry_pages(key)):
            self._lru.setdefault(key, None)  # newly idle: most recently used
        else:
            self._lru.pop(key, None)

    def _incref(self, pages) -> None:
        for p in pages:
            self._ref[p] += 1
        for key in dict.fromkeys(self._entry_of[p] for p in pages if p in self._entry_of):
            self._refresh(key)

    def _decref(self, pages) -> None:
        for p in pages:
            self._ref[p] -= 1
            if self._ref[p] == 0:
                self._free.append(p)
        for key in dict.fromkeys(self._entry_of[p] for p in pages if p in self._entry_of):
            self._refresh(key)

    def _alloc(self, n: int) -> list[int]:
        """n fresh pages with one reference each, evicting LRU entries as needed; all or nothing."""
        out: list[int] = []
        try:
            while len(out) < n:
                if not self._free:
                    self._evict_one()
                p = self._free.popleft()
                self._ref[p] = 1
                out.append(p)
        except OutOfPages:
            for p in reversed(out):
                self._ref[p] = 0
                self._free.appendleft(p)
            raise
        return out

    def _drop_entry(self, key: tuple) -> None:
        if key[0] == "mla":
            unit = self._units.pop(key[1])
            for h in unit.hashes:  # later endpoints of chains through it become unreachable: lookups stop here
                del self._blocks[h]
        else:
            unit = self._ckpts.pop(key[1])  # every KDA group's sibling goes at once
        for p in unit.pages:
            del self._entry_of[p]
        self._lru.pop(key, None)
        self._pending.pop(key, None)
        self._decref(unit.pages)

    def _evict_one(self) -> None:
        if not self._lru:
            raise OutOfPages(f"all {self.num_pages} pages are held by running requests, pins or unlanded entries")
        key = next(iter(self._lru))
        self._drop_entry(key)
        self._counts["evictions"] += 1

    # ---- hashing and lookup --------------------------------------------------------------------------------------

    def _extend_hashes(self, hashes: list[bytes], tokens: Sequence[int], n_blocks: int,
                       media: Sequence[MediaSpan] = ()) -> None:
        hb = self.hash_block_tokens
        for i in range(len(hashes), n_blocks):
            salt = media_salt(media, i * hb, (i + 1) * hb) if media else b""
            hashes.append(chain_hash(hashes[-1] if hashes else _ROOT, tokens[i * hb:(i + 1) * hb], salt))

    def _lookup(self, hashes: list[bytes], max_blocks: int) -> list[int]:
        """Heads of the units holding hash blocks 1..n of the longest hit of at most `max_blocks` blocks."""
        heads = []
        for h in hashes[:max_blocks]:  # MLA stage
            b = self._blocks.get(h)
            if b is None or b.step >= self._step:
                break
            heads.append(b.head)
        if self.num_kda_groups:  # KDA stage: the longest endpoint with a landed checkpoint in every group
            while heads and not ((c := self._ckpts.get(hashes[len(heads) - 1])) and c.step < self._step):
                heads.pop()
        return heads

    # ---- the engine's API ----------------------------------------------------------------------------------------

    def admit(self, seq_id: Hashable, prompt_tokens: Sequence[int], lookup: bool = True,
              media: Sequence[MediaSpan] = ()) -> Admission:
        """Look up the longest cached prefix, pin every hit page, then allocate the private KDA pages and the CoW
        page. Raises OutOfPages (with nothing changed but evictions) if those pages cannot be found.
        lookup=False admits with no hit (every prompt token is computed, e.g. to score the prompt); the request's
        blocks still enter the index as they are computed. `media`: the prompt's images (MediaSpan), salted into
        the hashes of the blocks that hold them, for the lookup and for every block the request registers."""
        media = tuple(media)
        for m in media:
            if not 0 <= m.start < m.end <= len(prompt_tokens):
                raise ValueError(f"media span [{m.start}, {m.end}) lies outside the {len(prompt_tokens)}-token prompt")
        if seq_id in self._reqs:
            raise ValueError(f"seq_id={seq_id!r} is already admitted")
        if not prompt_tokens:
            raise ValueError("prompt_tokens is empty: at least one token must be computed to produce logits")
        G, K, hb = self.num_mla_groups, self.num_kda_groups, self.hash_block_tokens
        hashes: list[bytes] = []
        heads: list[int] = []
        if self.enable and lookup:
            self._extend_hashes(hashes, prompt_tokens, len(prompt_tokens) // hb, media)
            heads = self._lookup(hashes, (len(prompt_tokens) - 1) // hb)  # at least one token left to compute
        n = len(heads)
        full, partial = divmod(n, self.blocks_per_page)
        shared = [self._units[heads[(j + 1) * self.blocks_per_page - 1]].pages for j in range(full)]
        cow_src = self._units[heads[-1]].pages if partial else ()
        ckpt = self._ckpts[hashes[n - 1]] if n and K else None
        # Pin every hit page in every group before allocating anything: an allocation may evict (§5.4.1).
        pins = cow_src + (ckpt.pages if ckpt else ())
        for pages in shared:
            self._incref(pages)
        self._incref(pins)
        try:
            fresh = self._alloc(K + (G if partial else 0))
        except OutOfPages:
            for pages in shared:
                self._decref(pages)
            self._decref(pins)
            raise
        self._pins.extend(pins)
        tables = [[pages[g] for pages in shared] for g in range(G)]
        kda_pages, copies = fresh[:K], []
        if partial:
            for g, (src, dst) in enumerate(zip(cow_src, fresh[K:])):
                tables[g].append(dst)
                copies.append(CopyOp(src, dst, (n * hb) % self.page_tokens))
        if ckpt:
            copies += [CopyOp(src, dst, None) for src, dst in zip(ckpt.pages, kda_pages)]
        req = _Request(tables, kda_pages, hashes, registered=n, num_tokens=n * hb, media=media)
        if ckpt:
            req.ckpt, req.ckpt_pos = hashes[n - 1], n * hb
        self._reqs[seq_id] = req
        if lookup:  # an admission that skips the lookup is not a query: it must not lower the hit rate
            self._counts.update(queries=1, query_tokens=len(prompt_tokens), hits=int(n > 0), hit_tokens=n * hb)
        return Admission(seq_id, n * hb, [list(t) for t in tables], list(kda_pages), copies)

    def ensure_capacity(self, seq_id: Hashable, total_tokens: int) -> list[list[int]]:
        """Grow every MLA block table to hold `total_tokens`; all or nothing (OutOfPages leaves them as they were)."""
        tables = self._reqs[seq_id].tables
        if not tables:  # no MLA group: nothing grows with the tokens
            return []
        need = -(-total_tokens // self.page_tokens) - len(tables[0])
        if need > 0:
            fresh = self._alloc(need * self.num_mla_groups)
            for j in range(need):
                for g, t in enumerate(tables):
                    t.append(fresh[j * self.num_mla_groups + g])
        return [list(t) for t in tables]

    def truncate(self, seq_id: Hashable, total_tokens: int) -> int:
        """Shrink every MLA block table to the pages `total_tokens` need (speculative rows past the accepted length
        are dropped); returns the pages released. Only private pages past the request's registered tokens go: an
        indexed or shared page always lies within them."""
        req = self._reqs[seq_id]
        if total_tokens < req.num_tokens:
            raise ValueError(f"truncate: {total_tokens} tokens, fewer than the {req.num_tokens} already registered")
        keep = -(-total_tokens // self.page_tokens)
        released = 0
        for t in req.tables:
            tail, t[keep:] = t[keep:], []
            assert all(self._ref[p] == 1 and p not in self._entry_of for p in tail), "a released page is shared"
            self._decref(tail)
            released += len(tail)
        return released

    def register_tokens(self, seq_id: Hashable, tokens: Sequence[int]) -> None:
        """`tokens`: the request's sequence so far (prompt + outputs) whose KV writes are launched. Newly completed
        hash blocks enter the MLA index, matchable after the next mark_landed."""
        req = self._reqs[seq_id]
        if len(tokens) < req.num_tokens:
            raise ValueError(f"register_tokens: {len(tokens)} tokens, fewer than the {req.num_tokens} already known")
        if req.tables and -(-len(tokens) // self.page_tokens) > len(req.tables[0]):
            raise ValueError(f"register_tokens: {len(tokens)} tokens exceed the block tables; ensure_capacity first")
        req.num_tokens = len(tokens)
        if not self.enable:
            return
        n_blocks = len(tokens) // self.hash_block_tokens
        self._extend_hashes(req.hashes, tokens, n_blocks, req.media)
        for i in range(req.registered, n_blocks):
            h = req.hashes[i]
            if h in self._blocks:  # someone else's copy of the same prefix is already indexed: keep it
                continue
            pages = tuple(t[i // self.blocks_per_page] for t in req.tables)
            head = pages[0]
            if head not in self._units:
                self._units[head] = _Unit(pages, set())
                for p in pages:
                    self._entry_of[p] = ("mla", head)
                self._incref(pages)  # the index's own reference
            self._units[head].hashes.add(h)
            self._blocks[h] = _Block(head, self._step)
            self._pending[("mla", head)] = None
            self._lru.pop(("mla", head), None)
        req.registered = max(req.registered, n_blocks)

    def checkpoint_slots(self, seq_id: Hashable, position: int, turn_boundary: bool = False) -> list[int] | None:
        """Fresh pages (one per KDA group) to persist the state at hash-aligned `position` into, or None when there is
        nothing to copy (the endpoint already has a checkpoint, caching is off, or no page could be found). Recycles
        this request's previous intermediate checkpoint. Call after register_tokens covered `position`."""
        req, K = self._reqs[seq_id], self.num_kda_groups
        if position <= 0 or position % self.hash_block_tokens or position > req.num_tokens:
            raise ValueError(f"checkpoint position={position}: must be a positive multiple of hash_block_tokens="
                             f"{self.hash_block_tokens} within the {req.num_tokens} registered tokens")
        if position < req.ckpt_pos:
            raise ValueError(f"checkpoint position={position}: behind this request's newest one at {req.ckpt_pos}")
        if not self.enable or K == 0:
            return None
        h = req.hashes[position // self.hash_block_tokens - 1]
        if (c := self._ckpts.get(h)) is not None:
            if h != req.ckpt:
                self._supersede(seq_id, req)
                req.ckpt, req.ckpt_pos = h, position
                if c.owners and not c.turn:
                    c.owners.add(seq_id)  # shared: recycled only when every holder has moved past it
            if turn_boundary:
                c.turn = True
                c.owners.clear()
            return None
        self._supersede(seq_id, req)
        try:
            pages = self._alloc(K)
        except OutOfPages:
            return None  # a checkpoint is an optimization: skip it rather than preempt anyone
        self._ckpts[h] = _Checkpoint(position, tuple(pages), self._step, turn_boundary,
                                     set() if turn_boundary else {seq_id})
        for p in pages:
            self._entry_of[p] = ("kda", h)
        self._pending[("kda", h)] = None
        req.ckpt, req.ckpt_pos = h, position
        return pages

    def _supersede(self, seq_id: Hashable, req: _Request) -> None:
        """Recycle the request's newest checkpoint if it is its own intermediate one (a reader's pin keeps the
        pages alive until its copy lands)."""
        c = self._ckpts.get(req.ckpt) if req.ckpt else None
        if c is not None and seq_id in c.owners and not c.turn:
            c.owners.discard(seq_id)
            if not c.owners:
                self._drop_entry(("kda", req.ckpt))
        req.ckpt = None

    def mark_landed(self) -> None:
        """End of a scheduling step: every copy, KV write and checkpoint launched so far is ordered before anything
        launched later, so entries registered so far become matchable and pinned copy sources are released."""
        self._step += 1
        pending, self._pending = self._pending, {}
        pins, self._pins = self._pins, []
        self._decref(pins)
        for key in pending:
            if key[1] in (self._units if key[0] == "mla" else self._ckpts):
                self._refresh(key)

    def finish(self, seq_id: Hashable, turn_boundary_position: int | None = None) -> None:
        """Release the request. Its newest checkpoint (or the one at `turn_boundary_position`, in which case the
        newest intermediate one is recycled) is kept as a turn boundary; its indexed MLA pages stay cached."""
        req = self._reqs[seq_id]
        if turn_boundary_position is not None:
            i = turn_boundary_position // self.hash_block_tokens
            if turn_boundary_position % self.hash_block_tokens or not 0 < turn_boundary_position <= req.num_tokens:
                raise ValueError(f"turn_boundary_position={turn_boundary_position}: not a hash endpoint within the "
                                 f"{req.num_tokens} tokens this request has computed")
            if self.enable and req.hashes[i - 1] != req.ckpt:
                self._supersede(seq_id, req)
                req.ckpt = req.hashes[i - 1]
        if req.ckpt and (c := self._ckpts.get(req.ckpt)) is not None:
            c.turn = True
            c.owners.clear()
        self.abort(seq_id)

    def abort(self, seq_id: Hashable) -> None:
        """Release the request (preemption, disconnect). Its newest checkpoint stays cached as an ordinary LRU entry
        (a preempted request re-admitted later resumes from it); unindexed pages return to the free list."""
        req = self._reqs.pop(seq_id)
        if req.ckpt and (c := self._ckpts.get(req.ckpt)) is not None:
            c.owners.discard(seq_id)  # the only checkpoint a request can hold is its newest
        for t in req.tables:
            self._decref(t)
        self._decref(req.kda_pages)

    # ---- host write-back and prefetch (k3.serve.cache.host) ------------------------------------------------------

    def peek(self, tokens: Sequence[int]) -> PrefixHit:
        """The longest cached prefix of `tokens` that `admit` would restore, found by the same two stages (landed MLA
        blocks, then the longest of them with a landed KDA checkpoint) over all len(tokens) // hash_block_tokens
        complete blocks (admit also leaves one prompt token to compute; a prompt that extends `tokens` hits all of
        it). Read-only: no reference, LRU position or counter changes. tokens == 0 when nothing is cached. Token ids
        alone carry no image: blocks a prompt with images registered (their hashes salted) are not found here."""
        hb, bpp = self.hash_block_tokens, self.blocks_per_page
        hashes: list[bytes] = []
        heads: list[int] = []
        if self.enable:
            self._extend_hashes(hashes, tokens, len(tokens) // hb)
            heads = self._lookup(hashes, len(hashes))
        n = len(heads)
        pages = [self._units[heads[min((j + 1) * bpp, n) - 1]].pages for j in range(-(-n // bpp))]
        ckpt = self._ckpts[hashes[n - 1]].pages if n and self.num_kda_groups else ()
        return PrefixHit(n * hb, hashes[:n], pages, ckpt)

    def import_prefixes(self, chains: Sequence[Sequence[bytes]]) -> list[Imported | None]:
        """Register prefixes whose bytes the caller copies in (host prefetch). `chains[i]`: the chain hashes of hash
        blocks 1..n of prefix i (as `peek` reported them where it was written back). Each prefix gets, for every
        coarse page holding a block the index lacks, a fresh unit (one page per MLA group) that registers those
        blocks, and a KDA checkpoint at its end unless the index has one: all or nothing per prefix. Entries are
        registered landed (matchable at once) and index-held; pages are taken from the free list or by evicting
        idle entries, never from running requests or entries this call relies on. A prefix whose pages cannot be
        found is skipped (None) without evicting anything; so is an empty chain, or every chain when caching is
        off. Entries of this call become evictable when it returns (the caller must fill their pages before
        anything reads them: call it between scheduling steps)."""
        G, K, bpp = self.num_mla_groups, self.num_kda_groups, self.blocks_per_page
        held: list[int] = []  # pages this call relies on or created: unevictable until it returns
        out: list[Imported | None] = []
        landed = self._step - 1
        try:
            for chain in chains:
                n = len(chain)
                if not self.enable or n == 0:
                    out.append(None)
                    continue
                new_pages = [j for j in range(-(-n // bpp)) if any(h not in self._blocks
                                                                 for h in chain[j * bpp:min((j + 1) * bpp, n)])]
                need_ckpt = K > 0 and chain[n - 1] not in self._ckpts
                pins = [p for head in dict.fromkeys(self._blocks[h].head for h in chain if h in self._blocks)
                        for p in self._units[head].pages]
                if K and not need_ckpt:
                    pins += self._ckpts[chain[n - 1]].pages
                need = G * len(new_pages) + (K if need_ckpt else 0)
                self._incref(pins)
                if self.available_pages() < need:  # skipped without evicting anything for it
                    self._decref(pins)
                    out.append(None)
                    continue
                fresh = self._alloc(need)
                held += pins
                units = []
                for k, j in enumerate(new_pages):  # the allocation's reference is the index's own
                    pages = tuple(fresh[k * G:(k + 1) * G])
                    head = pages[0]
                    self._units[head] = _Unit(pages, set())
                    for p in pages:
                        self._entry_of[p] = ("mla", head)
                    for h in chain[j * bpp:min((j + 1) * bpp, n)]:
                        if h not in self._blocks:
                            self._units[head].hashes.add(h)
                            self._blocks[h] = _Block(head, landed)
                    units.append((j, pages))
                ckpt_pages = tuple(fresh[G * len(new_pages):])
                if need_ckpt:
                    self._ckpts[chain[n - 1]] = _Checkpoint(n * self.hash_block_tokens, ckpt_pages, landed, False)
                    for p in ckpt_pages:
                        self._entry_of[p] = ("kda", chain[n - 1])
                self._incref(fresh)  # held until the call returns: a later prefix's allocation must not evict them
                held += fresh
                out.append(Imported(n * self.hash_block_tokens, units, ckpt_pages))
        finally:
            self._decref(held)  # now evictable (LRU), most recently used last
        return out

    # ---- introspection -------------------------------------------------------------------------------------------

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        return [list(t) for t in self._reqs[seq_id].tables]

    def running_pages(self, seq_id: Hashable) -> tuple[list[list[int]], list[int]]:
        req = self._reqs[seq_id]
        return [list(t) for t in req.tables], list(req.kda_pages)

    def available_pages(self) -> int:
        """Pages an allocation could obtain right now: free plus evictable."""
        return len(self._free) + sum(len(self._entry_pages(k)) for k in self._lru)

    def stats(self) -> dict:
        c = self._counts
        return {
            "num_pages": self.num_pages, "free_pages": len(self._free), "evictable_pages": self.available_pages()
            - len(self._free), "cached_mla_pages": sum(len(u.pages) for u in self._units.values()),
            "cached_blocks": len(self._blocks), "checkpoints": len(self._ckpts),
            "checkpoint_pages": self.num_kda_groups * len(self._ckpts), "running": len(self._reqs),
            "queries": c["queries"], "hits": c["hits"], "query_tokens": c["query_tokens"],
            "hit_tokens": c["hit_tokens"], "evictions": c["evictions"],
        }

    def check_invariants(self) -> None:
        """Refcounts equal actual holders; free pages are held by nobody; pages are never shared across cache kinds;
        checkpoints are sibling-complete; the LRU holds exactly the evictable entries."""
        G, K = self.num_mla_groups, self.num_kda_groups
        holders: Counter = Counter(self._pins)
        mla_pages, kda_pages = set(), set()
        for sid, req in self._reqs.items():
            assert len(req.tables) == G and len({len(t) for t in req.tables}) == 1, sid
            assert len(req.kda_pages) == K and req.registered <= len(req.hashes), sid
            for t in req.tables:
                holders.update(t)
                mla_pages.update(t)
            holders.update(req.kda_pages)
            kda_pages.update(req.kda_pages)
        for head, unit in self._units.items():
            assert len(unit.pages) == G and unit.pages[0] == head and unit.hashes, head
            assert all(self._blocks[h].head == head for h in unit.hashes), head
            holders.update(unit.pages)
            mla_pages.update(unit.pages)
        assert all(h in self._units[b.head].hashes for h, b in self._blocks.items())
        for h, c in self._ckpts.items():
            assert len(c.pages) == K and len(set(c.pages)) == K, "a checkpoint must hold one page per KDA group"
            assert all(self._entry_of[p] == ("kda", h) for p in c.pages)
            assert not c.owners or (not c.turn and all(self._reqs[o].ckpt == h for o in c.owners)), h
            holders.update(c.pages)
            kda_pages.update(c.pages)
        assert not mla_pages & kda_pages, "a page is used as both MLA KV and KDA state"
        for p in range(self.num_pages):
            assert self._ref[p] == holders[p], (p, self._ref[p], holders[p])
        assert len(set(self._free)) == len(self._free) and set(self._free) == {p for p, r in enumerate(self._ref)
                                                                              if r == 0}
        for sid, req in self._reqs.items():
            assert all(self._ref[p] == 1 for p in req.kda_pages), "a running state page must be private"
        keys = [("mla", h) for h in self._units] + [("kda", h) for h in self._ckpts]
        assert len(self._entry_of) == sum(len(self._entry_pages(k)) for k in keys)
        for key in keys:
            evictable = key not in self._pending and all(self._ref[p] == 1 for p in self._entry_pages(key))
            assert evictable == (key in self._lru), key
        assert set(self._lru) <= set(keys) and set(self._pending) <= set(keys)
