"""The unified page pool (report §5.4.1): MLA latent KV pages and KDA state pages share one pool of
equal-size pages. Storage is raw bytes; each page type is a typed view, so a page handed to the wrong group
reads as garbage rather than plausible data.

  MLA page (one MLA layer):  page_tokens x (kv_lora_rank + qk_rope_head_dim) values of the cache dtype
  KDA page (one KDA layer):  fp32 recurrent state [H, K, V] followed by the fp32 q/k/v conv tails [3, P, W-1]
"""

from __future__ import annotations

import torch

from k3.config import K3Config
from k3.ops.registry import keep_opaque, opaque


class CachePool:
    def __init__(self, cfg: K3Config, num_pages: int, page_tokens: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        if num_pages < 1 or page_tokens < 1:
            raise ValueError(f"num_pages ({num_pages}) and page_tokens ({page_tokens}) must be positive")
        self.cfg, self.num_pages, self.page_tokens, self.dtype = cfg, num_pages, page_tokens, dtype
        self.mla_width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        self.kda_state_shape = (H, K, K)
        self.kda_conv_shape = (3, H * K, cfg.kda_short_conv_kernel_size - 1)
        esize = torch.empty((), dtype=dtype).element_size()
        self.mla_page_bytes = page_tokens * self.mla_width * esize
        self.kda_elems = H * K * K + 3 * H * K * (cfg.kda_short_conv_kernel_size - 1)
        self.kda_page_bytes = self.kda_elems * 4
        # One byte size for every page, rounded to 64 bytes so typed views stay aligned.
        self.page_bytes = -(-max(self.mla_page_bytes, self.kda_page_bytes) // 64) * 64
        self.pages = torch.zeros(num_pages, self.page_bytes, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        return self.pages.numel()

    # --- typed views ------------------------------------------------------------------------------
    def mla_pages(self, page_ids: torch.Tensor) -> torch.Tensor:
        """Gather MLA pages -> [n, page_tokens, width] (a copy)."""
        raw = self.pages.index_select(0, page_ids)[:, : self.mla_page_bytes].contiguous()
        return raw.view(self.dtype).view(len(page_ids), self.page_tokens, self.mla_width)

    def mla_view(self) -> torch.Tensor:
        """The whole pool as MLA pages [num_pages, page_tokens, width] (a view, no copy; the page stride is
        page_bytes, which can exceed one MLA page). Made outside a compiled decode step: traced, reinterpreting the
        strided bytes as another dtype is materialized, a copy of every MLA page per layer and step."""
        return opaque(_mla_view)(self)

    # The writes below run outside a compiled decode step (registry.opaque): traced, each in-place write into a
    # typed view of the pool's bytes is functionalized into a fresh copy of the whole pool, every step.
    def write_mla(self, page_ids: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
        """Write token rows `values` [n, width] at (page_ids[i], offsets[i])."""
        opaque(_write_mla)(self, page_ids, offsets, values)

    def zero_page(self, page: int) -> None:
        """Zero one page (the scratch page a static decode step starts from)."""
        opaque(_zero_page)(self, page)

    def read_kda(self, page_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (state [n, H, K, V] fp32, conv [n, 3, P, W-1] fp32), copies. One gather of the KDA bytes only (a
        page can be larger than one KDA state: pages fit the larger of the two page kinds)."""
        raw = self.pages[:, : self.kda_page_bytes].index_select(0, page_ids).view(torch.float32)
        n, s = len(page_ids), self.kda_state_shape[0] * self.kda_state_shape[1] * self.kda_state_shape[2]
        return raw[:, :s].reshape(n, *self.kda_state_shape), raw[:, s:].reshape(n, *self.kda_conv_shape)

    def kda_store(self, page_ids: torch.Tensor):
        """Pages `page_ids` as the rows a fused KDA decode step updates in place (k3.ops.kda_decode.KDAStore: each
        page's fp32 state [H, K, V] then its conv tails [3, P, W-1], the layout `read_kda` reads)."""
        from k3.ops.kda_decode import KDAStore

        return KDAStore(opaque(_kda_rows)(self), page_ids)

    def write_kda(self, page_ids: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> None:
        """Write states and conv tails into pages `page_ids`, each straight from its tensor (no staging copy)."""
        if len(page_ids):
            opaque(_write_kda)(self, page_ids, state, conv)

    def copy_page(self, src: int, dst: int, tokens: int | None = None) -> None:
        """Copy a whole page, or only the first `tokens` token rows of an MLA page (copy-on-write)."""
        if tokens is None:
            self.pages[dst].copy_(self.pages[src])
        else:
            nb = tokens * self.mla_width * (self.mla_page_bytes // (self.page_tokens * self.mla_width))
            self.pages[dst, :nb].copy_(self.pages[src, :nb])


@keep_opaque
def _mla_view(pool: CachePool) -> torch.Tensor:
    return pool.pages[:, : pool.mla_page_bytes].view(pool.dtype).view(pool.num_pages, pool.page_tokens, -1)


@keep_opaque
def _write_mla(pool: CachePool, page_ids: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor) -> None:
    pool.mla_view()[page_ids, offsets] = values.to(pool.dtype)


@keep_opaque
def _kda_rows(pool: CachePool) -> torch.Tensor:
    return pool.pages[:, : pool.kda_page_bytes].view(torch.float32)


@keep_opaque
def _write_kda(pool: CachePool, page_ids: torch.Tensor, state: torch.Tensor, conv: torch.Tensor) -> None:
    n, sb = len(page_ids), state[0].numel() * 4
    pool.pages[page_ids, :sb] = state.float().contiguous().view(torch.uint8).view(n, -1)
    pool.pages[page_ids, sb: pool.kda_page_bytes] = conv.float().contiguous().view(torch.uint8).view(n, -1)


@keep_opaque
def _zero_page(pool: CachePool, page: int) -> None:
    pool.pages[page].zero_()
