"""Host (CPU) copies of cached prefixes: write-back and prefetch across engines (report §5.3.1, "External KV cache
pool").

The RL trainer pauses unfinished multi-turn rollouts when it trains and rebuilds the engine afterwards (the old
one's pool would be evicted by training memory anyway). Before the old engine goes, the prefixes of the paused
rollouts are written back to host memory (`LLMEngine.write_back`); the next engine prefetches them
(`LLMEngine.prefetch`) before the rollouts continue, so that their prompts (the rollouts' tokens so far) hit the
prefix cache instead of being prefilled again. A prefix is restorable only as a whole: the latent KV rows of every
MLA layer for its tokens together with the KDA checkpoint (recurrent state + conv tails of every KDA layer) at its
end, which is where `HostPrefixStore` keeps them.

What is written back for a token sequence is the longest prefix the cache can restore exactly as an admission
would look it up (landed MLA blocks, then the longest of them with a KDA checkpoint; a multiple of
hash_block_tokens, possibly shorter than the sequence, 0 when nothing is cached: recorded, not an error). The bytes
are copied as they are in the pool (the cache dtype, the KDA states in fp32), into pinned memory when the pool is
on CUDA. Pages shared by several prefixes (a common head) are stored once, keyed by the chain hash of the last
cached hash block they hold (a chain hash certifies every token before it).

The fetching engine must have the same model config, page_tokens, hash_block_tokens and cache dtype
(`check_compatible` raises ValueError naming what differs). The weights are not compared: in RL they differ by a
policy update, and the fetched states are then the older policy's, which partial rollouts accept (their earlier
tokens were sampled by that policy too). Prefetched entries are ordinary index-held entries: evictable, and
replaced as usual when the fetching engine computes the same prefix itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class HostPrefix:
    """One written-back sequence: `requested` tokens were asked for, `tokens` (a multiple of hash_block_tokens,
    empty on a miss) are held. `hashes`: the chain hash of each of its hash blocks; `page_keys[j]`: the key in
    `HostPrefixStore.pages` of its coarse page j's rows; `kda_state` [K, H, Dk, Dv] and `kda_conv` [K, 3, P, W-1]
    (fp32, one row per KDA layer): the KDA checkpoint at its end (None on a miss, or with no KDA layer)."""

    requested: int
    tokens: list[int]
    hashes: list[bytes]
    page_keys: list[bytes]
    kda_state: Tensor | None = None
    kda_conv: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class PrefetchReport:
    """What one prefetch did: `fetched` / `skipped` (no room in the pool, or the fetching engine's prefix cache is
    off) / `empty` (written back with 0 tokens): indices into the store's prefixes; `tokens`: tokens made
    available (the fetched prefixes' lengths, parts the index already held included); `bytes`: bytes copied into
    the pool (parts the index already held are not copied again)."""

    fetched: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    empty: list[int] = field(default_factory=list)
    tokens: int = 0
    skipped_tokens: int = 0
    bytes: int = 0


class HostPrefixStore:
    """Written-back prefixes in host memory. `signature`: what a fetching engine must match (model config,
    page_tokens, hash_block_tokens, cache dtype, cache groups); `pages`: key -> MLA rows [G, n, width] of one coarse
    page of some prefix (n <= page_tokens rows, every MLA layer, the cache dtype); `prefixes`: one HostPrefix per
    written-back sequence, in the order given. `pin`: allocate pinned memory (the pool is on CUDA)."""

    def __init__(self, signature: dict, pin: bool = False):
        self.signature = signature
        self.pin = pin
        self.pages: dict[bytes, Tensor] = {}
        self.prefixes: list[HostPrefix] = []

    # --- filling (the writing engine's cache manager) ------------------------------------------------------------
    def to_host(self, t: Tensor) -> Tensor:
        """A host copy of `t` owning exactly its bytes (pinned, copied asynchronously, when the store pins: call
        `synchronize` before reading it)."""
        if t.device.type == "cpu":
            return t.clone(memory_format=torch.contiguous_format)
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        out.copy_(t, non_blocking=self.pin)
        return out

    # --- reading ---------------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.prefixes)

    @property
    def tokens(self) -> int:
        """Tokens held over all prefixes (a shared head counts once per prefix)."""
        return sum(p.num_tokens for p in self.prefixes)

    @property
    def nbytes(self) -> int:
        """Host bytes held (shared pages once)."""
        n = sum(t.numel() * t.element_size() for t in self.pages.values())
        return n + sum(t.numel() * t.element_size() for p in self.prefixes for t in (p.kda_state, p.kda_conv)
                       if t is not None)

    def mla_rows(self, i: int) -> Tensor:
        """Prefix i's latent KV rows [G, tokens, width] (every MLA layer, the cache dtype)."""
        p = self.prefixes[i]
        if not p.page_keys:
            width = next(iter(self.pages.values())).shape[-1] if self.pages else 0
            return torch.empty(self.signature["mla_groups"], 0, width, dtype=_dtype(self.signature["cache_dtype"]))
        return torch.cat([self.pages[k] for k in p.page_keys], dim=1)

    def summary(self) -> dict:
        return {"prefixes": len(self.prefixes), "hits": sum(p.num_tokens > 0 for p in self.prefixes),
                "tokens": self.tokens, "requested_tokens": sum(p.requested for p in self.prefixes),
                "pages": len(self.pages), "bytes": self.nbytes}

    def check_compatible(self, signature: dict) -> None:
        """Raise ValueError naming every difference between the writing engine's `self.signature` and the fetching
        engine's `signature`."""
        bad = []
        for key in self.signature.keys() | signature.keys():
            mine, theirs = self.signature.get(key), signature.get(key)
            if key == "model_config" and isinstance(mine, dict) and isinstance(theirs, dict):
                fields = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
                bad += [f"model config {k}: written {mine.get(k)!r}, this engine {theirs.get(k)!r}" for k in fields]
            elif mine != theirs:
                bad.append(f"{key}: written {mine!r}, this engine {theirs!r}")
        if bad:
            raise ValueError("cannot prefetch these prefixes: the engine that wrote them back differs from this one "
                             "(" + "; ".join(sorted(bad)) + ")")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
