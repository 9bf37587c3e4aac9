"""A serving step's new MLA latent rows written into the page pool, and the lengths the paged decode reads, as one
kernel (op ``mla_append``, inference).

Before the paged decode attention (k3.ops.mla_decode) each Gated MLA layer writes its new rows [c | k_rope] at the
requests' positions and hands the kernel each query's length. In PyTorch that is the positions (an arange and an
add), the page of each (a division and a gather from the block tables), the row in it (a remainder), the row
itself (a concatenation and a cast) and the write (an indexed store), then the lengths (an add): about eight
kernels per MLA layer and step for a few rows. Here one Triton program per new row reads its request's position
and block table entry, writes c and k_rope (cast to the pool's dtype) into the slot, and writes the row's length.

Reference (`mla_append`): exactly that PyTorch. The kernel (`mla_append_triton`) writes the same values: the same
casts of the same rows, bit for bit. No backward (the pool is not differentiable), nothing read back to the host
(a CUDA graph can capture it).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.registry import Backends, Fast, Op, dispatch, keep_opaque, opaque, register

__all__ = ["mla_append", "mla_append_any", "mla_append_triton"]

tl = None  # triton.language, bound on first use (k3.ops._triton.bind)


def _check(kv: Tensor, tables: Tensor, pos: Tensor, c: Tensor, k_rope: Tensor) -> None:
    if kv.ndim != 3 or tables.ndim != 2 or pos.ndim != 1 or c.ndim != 3 or k_rope.ndim != 3:
        raise ValueError(f"mla_append takes kv [pages, page_tokens, R + Dr], tables [B, W], pos [B], c [B, T, R] and "
                         f"k_rope [B, T, Dr], got {tuple(kv.shape)}, {tuple(tables.shape)}, {tuple(pos.shape)}, "
                         f"{tuple(c.shape)}, {tuple(k_rope.shape)}")
    B, T, R = c.shape
    if tables.shape[0] != B or pos.shape[0] != B or k_rope.shape[:2] != (B, T) or kv.shape[2] != R + k_rope.shape[2]:
        raise ValueError(f"mla_append: c {tuple(c.shape)} and k_rope {tuple(k_rope.shape)} need B={B} tables and "
                         f"positions (got {tables.shape[0]} and {pos.shape[0]}) and pool rows of R + Dr = "
                         f"{R + k_rope.shape[2]} (got {kv.shape[2]})")
    if tables.dtype.is_floating_point or pos.dtype.is_floating_point:
        raise ValueError(f"tables and pos must be integer tensors, got {tables.dtype} and {pos.dtype}")


def mla_append(kv: Tensor, tables: Tensor, pos: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
    """Write row t of request b ([c[b, t] | k_rope[b, t]], cast to kv's dtype) at position pos[b] + t of its pages
    (row (pos[b] + t) % page_tokens of page tables[b, (pos[b] + t) // page_tokens]) of the typed pool view kv
    [pages, page_tokens, R + Dr]; return each row's length pos[b] + t + 1, [B * T] request-major (int64)."""
    _check(kv, tables, pos, c, k_rope)
    pt = kv.shape[1]
    B, T = c.shape[:2]
    p = pos[:, None] + torch.arange(T, device=pos.device)  # [B, T] positions of the new rows
    opaque(_store)(kv, tables.gather(1, p // pt).reshape(-1), (p % pt).reshape(-1),
                   torch.cat([c, k_rope], -1).reshape(B * T, -1))
    return (p + 1).reshape(-1)


@keep_opaque
def _store(kv: Tensor, pages: Tensor, rows: Tensor, values: Tensor) -> None:
    """The indexed store, outside a compiled decode step (traced, an in-place write into a typed view of the pool's
    bytes is functionalized into a copy of the whole pool)."""
    kv[pages, rows] = values.to(kv.dtype)


def _append_kernel(kv_ptr, tab_ptr, pos_ptr, c_ptr, kr_ptr, len_ptr, T, R, DR, s_kp, s_kt, s_tb, s_pos, s_cb, s_ct,
                   s_rb, s_rt, PT: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    p = tl.load(pos_ptr + b * s_pos).to(tl.int64) + t
    page = tl.load(tab_ptr + b * s_tb + p // PT).to(tl.int64)
    row = kv_ptr + page * s_kp + (p % PT) * s_kt
    rr = tl.arange(0, BR)
    for r0 in range(0, R, BR):
        m = r0 + rr < R
        v = tl.load(c_ptr + b * s_cb + t * s_ct + r0 + rr, mask=m, other=0.0)
        tl.store(row + r0 + rr, v.to(kv_ptr.dtype.element_ty), mask=m)
    dd = tl.arange(0, BD)
    md = dd < DR
    v = tl.load(kr_ptr + b * s_rb + t * s_rt + dd, mask=md, other=0.0)
    tl.store(row + R + dd, v.to(kv_ptr.dtype.element_ty), mask=md)
    tl.store(len_ptr + b * T + t, p + 1)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_append_kernel)


def mla_append_triton(kv: Tensor, tables: Tensor, pos: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
    """`mla_append` as one Triton kernel (the module docstring); the same arguments and result."""
    _check(kv, tables, pos, c, k_rope)
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MLA append kernel cannot run: {why}")
    if kv.stride(2) != 1:
        raise ValueError("mla_append: the pool view's rows must be contiguous (unit stride along R + Dr)")
    B, T, R = c.shape
    Dr = k_rope.shape[2]
    c = c if c.stride(2) == 1 else c.contiguous()
    k_rope = k_rope if k_rope.stride(2) == 1 else k_rope.contiguous()
    tables = tables if tables.stride(1) == 1 else tables.contiguous()
    lengths = torch.empty(B * T, device=c.device, dtype=torch.long)
    if B and T:
        with torch.cuda.device(c.device.index if c.is_cuda else -1):
            _kernel(_triton.interpret())[(B, T)](
                kv, tables, pos, c, k_rope, lengths, T, R, Dr, kv.stride(0), kv.stride(1), tables.stride(0),
                pos.stride(0), c.stride(0), c.stride(1), k_rope.stride(0), k_rope.stride(1), PT=kv.shape[1],
                BR=min(512, 1 << max(R - 1, 1).bit_length()), BD=1 << max(Dr - 1, 1).bit_length(), num_warps=4)
    return lengths


register(Op(
    "mla_append", reference=mla_append,
    # validated: its GPU tests (tests/ops/test_mla_append.py, marked gpu) passed on an H100 (2026-12-06)
    fast=(Fast("triton", mla_append_triton, _triton.available, validated=True, cpu=True),),
    tolerance="exact: the same rows cast to the pool's dtype, written to the same slots; the same lengths"))


def mla_append_any(kv: Tensor, tables: Tensor, pos: Tensor, c: Tensor, k_rope: Tensor,
                   backends: Backends | None = None) -> Tensor:
    """`mla_append` on the implementation the registry picks (op ``mla_append``)."""
    return dispatch("mla_append", c, backends).fn(kv, tables, pos, c, k_rope)
