"""The cache manager: the page pool (tensors) and the prefix cache's bookkeeping (page ids) kept in step.

The scheduler owns it (k3.serve.scheduler) and calls it for every cache decision of a scheduling step: admit a
request (restore its prefix hit: copy-on-write of a partial page, a KDA checkpoint into its running state, or a
zeroed state when nothing was hit), grow a request's block tables, release a preempted or aborted request, and
finish one. After each forward the engine reports what was computed (`computed`), which registers the new hash
blocks and persists a KDA checkpoint at a hash-aligned end; `mark_landed` closes the step. The model reads the
pages through the views of k3.serve.cache.views, which the runner builds from `slots`.
"""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.serve.cache.pool import CachePool
from k3.serve.cache.prefix import OutOfPages, PrefixCache
from k3.serve.cache.views import SeqSlots
from k3.serve.sequence import Sequence


class CacheManager:
    """num_mla / num_kda: the model's MLA and KDA layers (one cache group each). `memory_mb` sizes the pool;
    `scratch_page`: keep one extra page out of every request's reach (padding rows of CUDA-graph steps read and
    write only it), the pool's last."""

    def __init__(self, cfg: K3Config, num_mla: int, num_kda: int, memory_mb: float, page_tokens: int,
                 hash_block_tokens: int, enable_prefix_cache: bool = True, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", scratch_page: bool = False):
        probe = CachePool(cfg, 1, page_tokens, dtype=dtype, device="meta")
        extra = int(scratch_page)
        num_pages = int(memory_mb * 2**20) // probe.page_bytes - extra
        if num_pages < num_kda + num_mla:
            raise ValueError(f"cache_memory_mb={memory_mb} holds {max(num_pages, 0)} pages of {probe.page_bytes} "
                             f"bytes; one request needs at least {num_kda + num_mla}")
        self.pool = CachePool(cfg, num_pages + extra, page_tokens, dtype=dtype, device=device)
        self.prefix = PrefixCache(num_pages, num_mla, num_kda, page_tokens=page_tokens,
                                  hash_block_tokens=hash_block_tokens, enable=enable_prefix_cache)
        self.scratch_page = num_pages if scratch_page else None
        self.page_tokens, self.hash_block_tokens = page_tokens, hash_block_tokens
        self.enable_prefix_cache = enable_prefix_cache

    @property
    def num_pages(self) -> int:
        """Pages requests can get (the scratch page excluded)."""
        return self.prefix.num_pages

    def pages_needed(self, num_tokens: int) -> int:
        """The most pages a request of `num_tokens` tokens can hold at once (a copy-on-write page included)."""
        return self.prefix.num_mla_groups * (-(-num_tokens // self.page_tokens) + 1) + self.prefix.num_kda_groups

    # --- scheduling decisions (called by the scheduler) ---------------------------------------------------------
    def admit(self, seq: Sequence) -> int | None:
        """Give a waiting request its pages and restore its prefix hit on the pool: returns the tokens hit (its
        computation starts there), or None when the pool has no room (nothing changed). A request that scores
        its prompt computes every position, so it gets no hit (its blocks are still registered as computed)."""
        try:
            adm = self.prefix.admit(seq.request_id, seq.tokens, lookup=not seq.scores_prompt)
        except OutOfPages:
            return None
        for op in adm.copies:  # copy-on-write of a partial page, checkpoint -> private state
            self.pool.copy_page(op.src, op.dst, op.tokens)
        if adm.hit_tokens == 0:  # fresh pages still hold their previous owner's bytes
            self._zero_kda(adm.kda_pages)
        return adm.hit_tokens

    def grow(self, seq: Sequence, total_tokens: int) -> bool:
        """Make room for a running request's first `total_tokens` tokens (False: out of pages, nothing changed)."""
        try:
            self.prefix.ensure_capacity(seq.request_id, total_tokens)
            return True
        except OutOfPages:
            return False

    def truncate(self, seq: Sequence, total_tokens: int) -> int:
        """Shrink a running request's block tables to its first `total_tokens` tokens (after speculative
        verification, to the accepted length); returns the pages released."""
        return self.prefix.truncate(seq.request_id, total_tokens)

    def release(self, seq: Sequence) -> None:
        """Free a running request's pages without keeping what it computed past the index (preemption, abort)."""
        self.prefix.abort(seq.request_id)

    def finish(self, seq: Sequence) -> None:
        """A request is done: its pages go back, its registered blocks and checkpoints stay in the index."""
        self.prefix.finish(seq.request_id)

    # --- the engine's side of a step ----------------------------------------------------------------------------
    def slots(self, seq: Sequence) -> SeqSlots:
        tables, kda_pages = self.prefix.running_pages(seq.request_id)
        return SeqSlots(tables, kda_pages)

    def computed(self, seq: Sequence, end: int) -> None:
        """A forward over `seq` up to token `end` was launched: register its complete hash blocks, and at a
        hash-aligned end persist the KDA states there as a checkpoint (a page copy per KDA layer)."""
        if not self.enable_prefix_cache:
            return
        self.prefix.register_tokens(seq.request_id, seq.token_view(end))
        if end % self.hash_block_tokens == 0:
            pages = self.prefix.checkpoint_slots(seq.request_id, end)
            if pages:
                for src, dst in zip(self.prefix.running_pages(seq.request_id)[1], pages):
                    self.pool.copy_page(src, dst)

    def mark_landed(self) -> None:
        """The step's copies, forwards and checkpoint writes are ordered before the next step's work."""
        self.prefix.mark_landed()

    def stats(self) -> dict:
        st = dict(self.prefix.stats())
        st["pool_bytes"] = self.pool.nbytes
        st["page_bytes"] = self.pool.page_bytes
        return st

    def _zero_kda(self, pages: list[int]) -> None:
        if not pages:
            return
        dev = self.pool.pages.device
        n = len(pages)
        self.pool.write_kda(torch.tensor(pages, device=dev), torch.zeros(n, *self.pool.kda_state_shape, device=dev),
                            torch.zeros(n, *self.pool.kda_conv_shape, device=dev))
