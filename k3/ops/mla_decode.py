"""Paged MLA decode attention in absorbed form: a split-K ("flash decoding") Triton kernel over the page pool.

One decode step of an MLA layer attends each request's single new query to all of its cached tokens. In the
absorbed form (:func:`k3.ops.mla.mla_absorbed`) the per-head up-projections are folded into the query and the
output, so the attention itself runs in latent space, every head against the same cached rows:

    score_hj = scale * (q_lat_h . c_j + q_rope_h . k_rope_j),   q_lat_h = q_nope_h @ w_kc[h]     [R]
    o_lat_h  = sum_j softmax_j(score_h)_j c_j,                   o_h     = o_lat_h @ w_vc[h]^T    [Dv]

What is fused. :func:`mla_decode_paged` computes o_lat from q_lat/q_rope in one pass over the cache: each
token row [c (R) | k_rope (Dr)] is loaded once, in its stored dtype, straight from the page it lives in, and
used for both products (the scores and the weighted sum of c) while it is in registers; the softmax is
online (running max and sum per head, rescaled as blocks arrive). All heads of a request are the M dimension
of both matrix products (q [H, R] x c^T [R, BLOCK_N], p [H, BLOCK_N] x c [BLOCK_N, R]), so the cache is read
once per request, not once per head.

Why paged. The serving cache (:class:`k3.serve.cache.pool.CachePool`) keeps tokens in fixed-size pages
scattered through one pool; token t of a request lives in page ``block_table[b, t // page_tokens]`` at row
``t % page_tokens``. Gathering a request's pages into a contiguous tensor (and upcasting it) every step, as
the eager path does, costs a copy of the whole context per layer per step; here each block of BLOCK_N tokens
looks its pages up through the block table, token by token (a block may straddle pages; page_tokens need not
be a multiple of BLOCK_N), and reads only the valid tokens. Nothing depends on the lengths but the loop
bounds: tensor shapes are fixed by (B, H, R, num_splits), so with a fixed ``num_splits`` a step can be
captured in a CUDA graph and replayed with other lengths and block tables.

How splits combine. With few requests, one program per request would leave most of the GPU idle, so each
request's tokens are cut into ``num_splits`` contiguous pieces (of ceil(kv_len / num_splits) tokens, rounded
up to BLOCK_N) and one program handles one (request, split, head group). A program writes its piece's
normalized partial output o_s [H, R] and log-sum-exp lse_s [H] (base 2) in fp32; a second small kernel
combines them: o = sum_s 2^(lse_s - LSE) o_s with LSE = log2 sum_s 2^lse_s. A split with no tokens (more
splits than a request has blocks) writes lse = -inf and o = 0 and so gets weight 0 (never 0 * inf or a
division by zero). With one split the first kernel writes the result directly and the second is skipped.

Numerics. Scores, softmax and accumulation are fp32. For an fp32 pool the products are exact fp32
(``input_precision="ieee"``). For a bf16/fp16 pool they run on the tensor cores in the pool dtype with fp32
accumulation: the cached rows are already in that dtype, so only the query and the probabilities are
rounded. A query rounded to bf16 would shift a score by up to 2^-9 sum_r |q_r c_r| (an absolute error that
exp turns into a relative one, growing with the size of the scores), so the query is split into hi + lo
parts in the pool dtype and both are multiplied (two products for the scores instead of one): the scores
then carry ~16 bits of the query. The probabilities
are rounded to the pool dtype for p @ c (a relative error of at most one rounding, 2^-9 in bf16 on GPU, not
amplified), and the row sums are taken over the same rounded values, so the output is an exact convex
combination of the cached c rows. (In an fp16 pool the query parts are fp16: |q| must stay below 65504.)

Garbage. Slots past a request's length, pages past its last page, and block-table entries past its pages
may hold anything (stale data, NaN, inf, out-of-range page ids): every load of a table entry or a cache row
is masked by ``t < kv_len[b]`` and masked lanes read as 0, so such memory is never even read.

Which path a layer takes. This is op ``mla_decode`` of k3.ops.registry: its reference is the absorbed form over
a gathered copy of the cache (:func:`k3.ops.mla.mla_absorbed`), its fast implementation ``triton`` this paged form,
which runs anywhere: Triton is imported lazily (k3.ops._triton), so the module imports on a CPU-only machine
without Triton, and :func:`mla_decode_paged` then falls back to :func:`mla_decode_paged_reference` (plain torch);
``TRITON_INTERPRET=1`` (read at each call) runs the kernels on CPU tensors in Triton's interpreter (tests).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.mla import mla_absorbed
from k3.ops.mla_out import mla_absorb_v_any, mla_gate_any
from k3.ops.registry import REFERENCE, Backends, Fast, Op, Target, dispatch, register, runs_on

__all__ = [
    "default_num_splits",
    "paged_available",
    "paged_kernel_used",
    "mla_decode_absorbed",
    "mla_decode_paged",
    "mla_decode_paged_reference",
    "mla_decode_paged_triton",
]

_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
_MAX_BLOCK_H = 64  # heads per program; more heads are split over several head groups (the grid's third axis)
_MIN_SPLIT_TOKENS = 256  # a split's partial output (H x R fp32) should stay small next to the cache it reads
_MAX_SPLITS = 128  # the default's upper bound
_MAX_FIXED_SPLITS = 1024  # the combine step holds every split of one head and column block at once
_COMBINE_TILE = 8192  # partial-output elements one combine program holds
_PROGRAMS_PER_SM = 4
_DEFAULT_SMS = 132  # H200; used when no CUDA device says otherwise (the interpreter)
_LOG2E = 1.4426950408889634

# triton.language and the combine functions of tl.reduce, bound by _kernels() on first use (k3.ops._triton.bind:
# the kernels call only Triton builtins, which the interpreter can run)
tl = None
_MAX = None
_SUM = None


def _pow2(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return max(least, 1 << max(0, n - 1).bit_length())


# --- kernels --------------------------------------------------------------------------------------------------


def _mla_decode_split_kernel(
        q_ptr, qr_ptr, kv_ptr, table_ptr, len_ptr, o_ptr, lse_ptr,
        H, R, DR, num_splits, qk_scale,
        stride_qb, stride_qh, stride_qr,
        stride_qrb, stride_qrh, stride_qrd,
        stride_kvp, stride_kvt, stride_kvd,
        stride_tb, stride_tp, stride_len,
        stride_ob, stride_os, stride_oh, stride_or,
        stride_lb, stride_ls, stride_lh,
        PAGE_TOKENS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_DR: tl.constexpr, SPLIT_Q: tl.constexpr, MMA_F32: tl.constexpr, DOT_PRECISION: tl.constexpr,
        WRITE_LSE: tl.constexpr):
    """One (request b, split s, head group g): online softmax over the split's tokens for BLOCK_H heads.

    SPLIT_Q: the pool is 16-bit and the query is multiplied as hi + lo parts in the pool dtype. MMA_F32: the
    products take fp32 operands (an fp32 pool; or the interpreter, whose dot cannot multiply bf16 tensors:
    there the pool-dtype values are upcast exactly, and only the accumulation order differs from the GPU).

    Writes o_ptr[b, s, heads, :R] = the split's normalized output (0 if it has no tokens) and, with WRITE_LSE,
    lse_ptr[b, s, heads] = log2 of its softmax denominator in the base-2 score domain (-inf if no tokens).
    ``qk_scale`` is scale * log2(e): scores are kept in base 2 so the exponentials are exp2.
    """
    b = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.program_id(2)
    kv_dtype = kv_ptr.dtype.element_ty

    length = tl.load(len_ptr + b * stride_len).to(tl.int32)
    # Tokens per split: ceil(length / num_splits) rounded up to whole blocks.
    per_split = (length + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, length)

    heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    rr = tl.arange(0, BLOCK_R)
    rmask = rr < R
    dd = tl.arange(0, BLOCK_DR)
    dmask = dd < DR

    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + rr[None, :] * stride_qr,
                mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
    qr = tl.load(qr_ptr + b.to(tl.int64) * stride_qrb + heads[:, None] * stride_qrh + dd[None, :] * stride_qrd,
                 mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    if SPLIT_Q:  # q = q_hi + q_lo in the pool dtype (see the module docstring, Numerics)
        q_hi = q.to(kv_dtype)
        q_lo = (q - q_hi.to(tl.float32)).to(kv_dtype)
        qr_hi = qr.to(kv_dtype)
        qr_lo = (qr - qr_hi.to(tl.float32)).to(kv_dtype)
        if MMA_F32:
            q_hi, q_lo = q_hi.to(tl.float32), q_lo.to(tl.float32)
            qr_hi, qr_lo = qr_hi.to(tl.float32), qr_lo.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_R], 0.0, tl.float32)
    table_row = table_ptr + b.to(tl.int64) * stride_tb
    # A while loop, not `for n0 in range(start, end, BLOCK_N)`: Triton 3.6's interpreter cannot take a tensor
    # as a range() bound with numpy >= 2.4, and one loop form keeps the interpreted and the compiled kernel the
    # same code.
    n0 = start
    while n0 < end:
        t = n0 + tl.arange(0, BLOCK_N)
        tmask = t < end
        # Per token: its page through the block table, its row in the page. Masked lanes (past the valid
        # length) read page 0 row 0 as their address but load nothing: garbage there is never read.
        page = tl.load(table_row + (t // PAGE_TOKENS) * stride_tp, mask=tmask, other=0).to(tl.int64)
        row = (t % PAGE_TOKENS).to(tl.int64)
        tok = kv_ptr + page * stride_kvp + row * stride_kvt  # [BLOCK_N] row starts
        c = tl.load(tok[:, None] + rr[None, :] * stride_kvd, mask=tmask[:, None] & rmask[None, :], other=0.0)
        kr = tl.load(tok[:, None] + (R + dd)[None, :] * stride_kvd, mask=tmask[:, None] & dmask[None, :],
                     other=0.0)
        if MMA_F32:
            c = c.to(tl.float32)
            kr = kr.to(tl.float32)
        c_t = tl.trans(c)
        kr_t = tl.trans(kr)
        if SPLIT_Q:
            qk = tl.dot(q_hi, c_t, input_precision=DOT_PRECISION)
            qk = tl.dot(q_lo, c_t, qk, input_precision=DOT_PRECISION)
            qk = tl.dot(qr_hi, kr_t, qk, input_precision=DOT_PRECISION)
            qk = tl.dot(qr_lo, kr_t, qk, input_precision=DOT_PRECISION)
        else:
            qk = tl.dot(q, c_t, input_precision=DOT_PRECISION)
            qk = tl.dot(qr, kr_t, qk, input_precision=DOT_PRECISION)
        qk = tl.where(tmask[None, :], qk * qk_scale, float("-inf"))
        # Every block starts at a valid token (n0 < end), so m_new is finite and no exponent is inf - inf.
        m_new = tl.maximum(m_i, tl.reduce(qk, 1, _MAX))
        alpha = tl.exp2(m_i - m_new)  # 0 on the first block (m_i = -inf)
        # p rounded to the pool dtype (masked tokens: exp2(-inf) = 0); the row sums add the same rounded values.
        p = tl.exp2(qk - m_new[:, None]).to(kv_dtype).to(c.dtype)
        l_i = l_i * alpha + tl.reduce(p.to(tl.float32), 1, _SUM)
        acc = tl.dot(p, c, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
        n0 += BLOCK_N

    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    o = acc / l_safe[:, None]
    o_off = b.to(tl.int64) * stride_ob + s * stride_os + heads[:, None] * stride_oh + rr[None, :] * stride_or
    tl.store(o_ptr + o_off, o, mask=hmask[:, None] & rmask[None, :])
    if WRITE_LSE:
        lse = tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + b.to(tl.int64) * stride_lb + s * stride_ls + heads * stride_lh, lse, mask=hmask)


def _mla_decode_combine_kernel(
        part_ptr, lse_ptr, o_ptr, R, num_splits,
        stride_pb, stride_ps, stride_ph, stride_pr,
        stride_lb, stride_ls, stride_lh,
        stride_ob, stride_oh, stride_or,
        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr):
    """One (request b, head h, column block): o[b, h] = sum_s w_s part[b, s, h] with w = softmax_s(lse[b, :, h])
    in base 2, for BLOCK_R columns of R, all splits at once.

    Empty splits (lse = -inf) get weight 0; a request with no tokens at all (every lse -inf) gets o = 0.
    """
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    smask = ss < num_splits
    lse = tl.load(lse_ptr + b * stride_lb + ss * stride_ls + h * stride_lh, mask=smask, other=float("-inf"))
    big = tl.reduce(lse, 0, _MAX)
    big = tl.where(big == float("-inf"), 0.0, big)  # all splits empty: every weight below is 0
    w = tl.exp2(lse - big)
    total = tl.reduce(w, 0, _SUM)
    w = w / tl.where(total > 0.0, total, 1.0)
    rr = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rr < R
    part = tl.load(part_ptr + b * stride_pb + ss[:, None] * stride_ps + h * stride_ph + rr[None, :] * stride_pr,
                   mask=smask[:, None] & rmask[None, :], other=0.0)
    o = tl.reduce(w[:, None] * part, 0, _SUM)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + rr * stride_or, o, mask=rmask)


@functools.cache
def _kernels(interpret: bool):
    """(split kernel, combine kernel), jitted. ``triton.jit`` picks compiled or interpreted when it wraps the
    function, so there is one pair per interpreter setting (``interpret`` is the cache key)."""
    import triton

    _triton.bind(globals())
    return triton.jit(_mla_decode_split_kernel), triton.jit(_mla_decode_combine_kernel)


# --- validation -------------------------------------------------------------------------------------------


def _check_int(name: str, value, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _validate(q_lat: Tensor, q_rope: Tensor, kv: Tensor, block_table: Tensor, kv_len: Tensor, scale: float,
              kv_rank: int, num_splits: int | None) -> None:
    """Shapes, dtypes and devices (no reads of device values)."""
    for name, t in (("q_lat", q_lat), ("q_rope", q_rope), ("kv", kv), ("block_table", block_table),
                    ("kv_len", kv_len)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if q_lat.ndim != 3:
        raise ValueError(f"q_lat must be 3-D [B, H, R], got shape {tuple(q_lat.shape)}")
    B, H, R = q_lat.shape
    if not q_lat.dtype.is_floating_point:
        raise ValueError(f"q_lat must be a floating tensor, got dtype {q_lat.dtype}")
    if q_rope.ndim != 3 or q_rope.shape[:2] != (B, H):
        raise ValueError(f"q_rope must have shape [B={B}, H={H}, Dr] to match q_lat, got {tuple(q_rope.shape)}")
    if not q_rope.dtype.is_floating_point:
        raise ValueError(f"q_rope must be a floating tensor, got dtype {q_rope.dtype}")
    _check_int("kv_rank", kv_rank, 1)
    if R != kv_rank:
        raise ValueError(f"q_lat's last dimension must be kv_rank={kv_rank}, got q_lat shape {tuple(q_lat.shape)}")
    Dr = q_rope.shape[2]
    if kv.ndim != 3:
        raise ValueError(f"kv must be 3-D [num_pages, page_tokens, R + Dr], got shape {tuple(kv.shape)}")
    if kv.shape[2] != R + Dr:
        raise ValueError(f"kv's rows must be [c (kv_rank={R}) | k_rope (Dr={Dr})] = {R + Dr} wide, "
                         f"got kv shape {tuple(kv.shape)}")
    if kv.dtype not in _KV_DTYPES:
        raise ValueError(f"kv must be bfloat16, float16 or float32, got dtype {kv.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must have shape [B={B}, max_pages], got {tuple(block_table.shape)}")
    if block_table.dtype not in _INDEX_DTYPES:
        raise ValueError(f"block_table must be int32 or int64, got dtype {block_table.dtype}")
    if kv_len.shape != (B,):
        raise ValueError(f"kv_len must have shape [B={B}], got {tuple(kv_len.shape)}")
    if kv_len.dtype not in _INDEX_DTYPES:
        raise ValueError(f"kv_len must be int32 or int64, got dtype {kv_len.dtype}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float, got {scale!r}")
    if num_splits is not None:
        _check_int("num_splits", num_splits, 1)
        if num_splits > _MAX_FIXED_SPLITS:
            raise ValueError(f"num_splits must be at most {_MAX_FIXED_SPLITS}, got {num_splits}")
    for name, t in (("q_rope", q_rope), ("kv", kv), ("block_table", block_table), ("kv_len", kv_len)):
        if t.device != q_lat.device:
            raise ValueError(f"{name} must be on q_lat's device {q_lat.device}, got {t.device}")


def _check_lengths(kv_len: Tensor, capacity: int) -> int:
    """Check 0 <= kv_len <= capacity (a device read); returns max(kv_len)."""
    if kv_len.numel() == 0:
        return 0
    lo, hi = (int(v) for v in torch.aminmax(kv_len.long()))
    if lo < 0 or hi > capacity:
        raise ValueError(f"kv_len must be in [0, max_pages * page_tokens = {capacity}], got {kv_len.tolist()}")
    return hi


# --- torch reference -------------------------------------------------------------------------------------


def mla_decode_paged_reference(q_lat: Tensor, q_rope: Tensor, kv: Tensor, block_table: Tensor, kv_len: Tensor,
                               scale: float, kv_rank: int, num_splits: int | None = None) -> Tensor:
    """:func:`mla_decode_paged` in plain torch: gather the valid tokens, mask, fp32 math (CPU, and the oracle).

    Same arguments and result; ``num_splits`` is accepted for a uniform signature and ignored (the result
    does not depend on it). Reads the lengths and the used block-table entries on the host to check them
    (page ids in [0, num_pages)), so it is not for CUDA-graph capture.
    """
    _validate(q_lat, q_rope, kv, block_table, kv_len, scale, kv_rank, num_splits)
    B, H, R = q_lat.shape
    num_pages, page_tokens, _ = kv.shape
    L = _check_lengths(kv_len, block_table.shape[1] * page_tokens)
    if L == 0:
        return q_lat.new_zeros(B, H, R, dtype=torch.float32)
    t = torch.arange(L, device=kv.device)
    valid = t[None, :] < kv_len.long()[:, None]  # [B, L]
    pages = block_table.long().gather(1, (t // page_tokens)[None, :].expand(B, L))
    used = pages[valid]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_pages):
        raise ValueError(f"block_table holds page ids outside [0, num_pages={num_pages}) for valid tokens")
    pages = torch.where(valid, pages, 0)  # entries past a request's pages may hold anything
    rows = kv[pages, (t % page_tokens)[None, :].expand(B, L)].float()  # [B, L, R + Dr], a gather copy
    rows = rows.masked_fill(~valid[:, :, None], 0.0)  # slots past kv_len may hold NaN/inf
    c, k_rope = rows[..., :R], rows[..., R:]
    scores = torch.einsum("bhr,blr->bhl", q_lat.float(), c) + torch.einsum("bhd,bld->bhl", q_rope.float(), k_rope)
    scores = (scale * scores).masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).masked_fill(~valid[:, None, :], 0.0)  # kv_len 0: NaN row -> 0
    return torch.einsum("bhl,blr->bhr", probs, c)


# --- Triton path -----------------------------------------------------------------------------------------


def _head_block(H: int) -> int:
    """Heads per program: a power of two in [16, 64] with the fewest padded heads, the largest on ties
    (H=8 -> 16, 64 -> 64, 96 -> 32)."""
    sizes = [bh for bh in (16, 32, 64) if bh <= _MAX_BLOCK_H]
    return min(sizes, key=lambda bh: (-(-H // bh) * bh, -bh))


def default_num_splits(batch: int, num_heads: int, max_len: int, device: torch.device | str | None = None) -> int:
    """The split count :func:`mla_decode_paged` uses when none is given.

    Enough (request, split, head group) programs to fill the GPU a few times over (4 per SM), but no split
    shorter than 256 tokens (each writes an H x R fp32 partial) and at most 128. A CUDA-graph caller should
    fix one value (e.g. from its largest context) and pass it on every step.
    """
    _check_int("batch", batch, 1)
    _check_int("num_heads", num_heads, 1)
    _check_int("max_len", max_len, 0)
    sms = _DEFAULT_SMS
    if device is not None and torch.device(device).type == "cuda":
        sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    groups = -(-num_heads // _head_block(num_heads))
    by_occupancy = -(-_PROGRAMS_PER_SM * sms // (batch * groups))
    by_length = -(-max_len // _MIN_SPLIT_TOKENS)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def mla_decode_paged_triton(q_lat: Tensor, q_rope: Tensor, kv: Tensor, block_table: Tensor, kv_len: Tensor,
                            scale: float, kv_rank: int, num_splits: int | None = None, *,
                            block_n: int | None = None, partials: bool = False):
    """:func:`mla_decode_paged` on the Triton kernels (CUDA tensors, or any with ``TRITON_INTERPRET=1``).

    ``partials``: return the split kernel's (part [B, S, H, R] fp32, lse [B, S, H] fp32) uncombined, for a consumer
    that combines them itself (k3.ops.mla_out.mla_combine_absorb_v); (o_lat viewed [B, 1, H, R], None) when the
    request's tokens are not split (S = 1).

    ``block_n``: tokens per inner step (a power of two >= 16; default 64 for R <= 256, else 32). With
    ``num_splits`` given nothing is read back from the device (the lengths and the block table are not
    checked: lengths must be in [0, max_pages * page_tokens] and the used table entries valid page ids), so
    the call can be captured in a CUDA graph. Without it, max(kv_len) is read to choose the split count.
    """
    _validate(q_lat, q_rope, kv, block_table, kv_len, scale, kv_rank, num_splits)
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the MLA decode Triton kernels cannot run: {why}")
    interpret = _triton.interpret()
    if not kv.is_cuda and not interpret:
        raise ValueError(f"the MLA decode Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {kv.device}")
    B, H, R = q_lat.shape
    Dr = q_rope.shape[2]
    num_pages, page_tokens, _ = kv.shape
    block_r, block_dr = _pow2(R, _MIN_DOT), _pow2(Dr, _MIN_DOT)
    if block_n is None:
        block_n = 64 if block_r <= 256 else 32
    elif not isinstance(block_n, int) or isinstance(block_n, bool) or block_n < _MIN_DOT or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= {_MIN_DOT}, got {block_n!r}")
    out = torch.empty(B, H, R, device=kv.device, dtype=torch.float32)
    if B == 0:
        return (out.unsqueeze(1), None) if partials else out
    if num_splits is None:
        num_splits = default_num_splits(B, H, _check_lengths(kv_len, block_table.shape[1] * page_tokens), kv.device)
    block_h = _head_block(H)
    groups = -(-H // block_h)
    split_kernel, combine_kernel = _kernels(interpret)
    single = num_splits == 1
    if single:  # the split kernel writes the result: out viewed as [B, 1, H, R]
        part, part_strides = out, (out.stride(0), 0, out.stride(1), out.stride(2))
        lse, lse_strides = None, (0, 0, 0)
    else:
        part = torch.empty(B, num_splits, H, R, device=kv.device, dtype=torch.float32)
        lse = torch.empty(B, num_splits, H, device=kv.device, dtype=torch.float32)
        part_strides, lse_strides = part.stride(), lse.stride()
    big = block_h * block_r >= 64 * 256
    split_q = kv.dtype != torch.float32
    # fp32 products: exact ("ieee"); 16-bit products: tensor cores ("tf32" is the default and means nothing
    # for 16-bit operands). The interpreter multiplies 16-bit values in fp32 (its dot cannot take bf16).
    mma_f32 = not split_q or interpret
    with torch.cuda.device(kv.device.index if kv.is_cuda else -1):  # launch on the tensors' GPU; -1: no-op
        split_kernel[(B, num_splits, groups)](
            q_lat, q_rope, kv, block_table, kv_len, part, lse,
            H, R, Dr, num_splits, float(scale) * _LOG2E,
            *q_lat.stride(), *q_rope.stride(), *kv.stride(), *block_table.stride(), kv_len.stride(0),
            *part_strides, *lse_strides,
            PAGE_TOKENS=page_tokens, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_DR=block_dr,
            SPLIT_Q=split_q, MMA_F32=mma_f32, DOT_PRECISION="ieee" if mma_f32 else "tf32", WRITE_LSE=not single,
            num_warps=8 if big else 4, num_stages=2)
        if partials:
            return (out.unsqueeze(1), None) if single else (part, lse)
        if not single:
            block_s = _pow2(num_splits)
            block_rc = min(block_r, _pow2(_COMBINE_TILE // block_s))  # a [splits, columns] tile per program
            combine_kernel[(B, H, -(-R // block_rc))](
                part, lse, out, R, num_splits, *part.stride(), *lse.stride(), *out.stride(),
                BLOCK_S=block_s, BLOCK_R=block_rc, num_warps=4)
    return out


# --- public API ------------------------------------------------------------------------------------------


def _use_triton(kv: Tensor) -> bool:
    return _triton.available(Target(kv.device))[0]


def mla_decode_paged(q_lat: Tensor, q_rope: Tensor, kv: Tensor, block_table: Tensor, kv_len: Tensor,
                     scale: float, kv_rank: int, num_splits: int | None = None, *,
                     block_n: int | None = None) -> Tensor:
    """Single-token MLA decode attention in latent space, straight from the page pool.

    Args:
        q_lat: [B, H, R] absorbed queries ``q_nope_h @ w_kc[h]`` (any float dtype; used in fp32).
        q_rope: [B, H, Dr] query dims meeting the shared ``k_rope`` dims.
        kv: [num_pages, page_tokens, R + Dr] the pool's typed MLA view (bf16, fp16 or fp32), each token row
            ``[c | k_rope]``; any strides (the page stride may exceed page_tokens * (R + Dr)), e.g.
            ``pool.pages[:, :pool.mla_page_bytes].view(dtype).view(num_pages, page_tokens, -1)``.
        block_table: [B, max_pages] int32/int64: token t of request b is row ``t % page_tokens`` of page
            ``block_table[b, t // page_tokens]``. Entries past a request's pages may hold anything.
        kv_len: [B] int32/int64 valid tokens per request; the request's query sits at position
            ``kv_len[b] - 1`` and sees all of them. 0 marks a padding row (its output is 0).
        scale: softmax scale.
        kv_rank: R, where each row splits into c and k_rope.
        num_splits: pieces each request's tokens are cut into (see the module docstring); default
            :func:`default_num_splits` of the batch and max(kv_len) (a device read). Fix it for CUDA graphs.
        block_n: tokens per inner step of the Triton kernel (a power of two >= 16); None picks one.

    Returns:
        o_lat: [B, H, R] fp32, ``sum_j softmax_j(scale * (q_lat . c_j + q_rope . k_rope_j)) c_j``.

    Runs the Triton kernels on CUDA tensors (or on any with ``TRITON_INTERPRET=1``) when Triton is
    importable, else :func:`mla_decode_paged_reference`.
    """
    if isinstance(kv, Tensor) and _use_triton(kv):
        return mla_decode_paged_triton(q_lat, q_rope, kv, block_table, kv_len, scale, kv_rank, num_splits,
                                       block_n=block_n)
    return mla_decode_paged_reference(q_lat, q_rope, kv, block_table, kv_len, scale, kv_rank, num_splits)


def mla_decode_absorbed(q_nope: Tensor, q_rope: Tensor, kv: Tensor, block_table: Tensor, kv_len: Tensor,
                        w_kc: Tensor, w_vc: Tensor, scale: float, num_splits: int | None = None,
                        backends: Backends | None = None, gate: Tensor | None = None) -> Tensor:
    """:func:`k3.ops.mla.mla_absorbed` for one query per request (Tq = 1, at position kv_len - 1) against the
    paged cache: absorbs ``w_kc`` into the query and ``w_vc`` into the output around :func:`mla_decode_paged`.

    Args:
        q_nope: [B, H, Dn]; q_rope: [B, H, Dr].
        kv, block_table, kv_len, scale, num_splits: as in :func:`mla_decode_paged`.
        w_kc: [H, Dn, R], w_vc: [H, Dv, R] (see :func:`k3.ops.mla.split_kv_b`).
        backends: picks the value absorption's implementation (op ``mla_absorb_v``, k3.ops.mla_out).
        gate: [B, H * Dv] or None: Gated MLA's output gate applied to o (``sigmoid(gate) * o``, op ``mla_gate``
            on o rounded to ``q_nope.dtype``), inside the absorption's kernel where the registry picks op
            ``mla_combine_absorb_v_gate``.

    Returns:
        o: [B, H, Dv] in ``q_nope.dtype`` (everything up to the cast in fp32), gated with ``gate``.
    """
    if not isinstance(q_nope, Tensor) or q_nope.ndim != 3:
        raise ValueError(f"q_nope must be a 3-D tensor [B, H, Dn], got {getattr(q_nope, 'shape', q_nope)}")
    if not q_nope.dtype.is_floating_point:
        raise ValueError(f"q_nope must be a floating tensor, got dtype {q_nope.dtype}")
    _, H, Dn = q_nope.shape
    if not isinstance(w_kc, Tensor) or w_kc.ndim != 3 or w_kc.shape[:2] != (H, Dn):
        raise ValueError(f"w_kc must have shape [H={H}, Dn={Dn}, R], got {getattr(w_kc, 'shape', w_kc)}")
    R = w_kc.shape[2]
    if not isinstance(w_vc, Tensor) or w_vc.ndim != 3 or w_vc.shape[0] != H or w_vc.shape[2] != R:
        raise ValueError(f"w_vc must have shape [H={H}, Dv, R={R}], got {getattr(w_vc, 'shape', w_vc)}")
    for name, t in (("w_kc", w_kc), ("w_vc", w_vc)):
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating tensor, got dtype {t.dtype}")
    if gate is not None and (not isinstance(gate, Tensor) or gate.shape != (q_nope.shape[0], H * w_vc.shape[1])):
        raise ValueError(f"gate must have shape [B={q_nope.shape[0]}, H * Dv={H * w_vc.shape[1]}], got "
                         f"{getattr(gate, 'shape', gate)}")
    if q_nope.is_cuda and q_nope.dtype in (torch.bfloat16, torch.float16) and w_kc.dtype == q_nope.dtype:
        # one batched GEMM accumulating and writing fp32 (aten bmm.dtype, CUDA): the products of two bf16 values are
        # exact in fp32, so this is the fp32 einsum below up to summation order, without its casts (an fp32 copy of
        # w_kc, [H, Dn, R], per layer and step). The kernel reads q_lat through its strides.
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_kc, out_dtype=torch.float32).transpose(0, 1)
    else:
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope.float(), w_kc.float())
    if gate is not None and _use_triton(kv):
        gated = dispatch("mla_combine_absorb_v_gate", q_lat, backends)
        if gated.name != REFERENCE:  # the split partials combined, absorbed and gated in one kernel
            part, lse = mla_decode_paged_triton(q_lat, q_rope, kv, block_table, kv_len, scale, R, num_splits,
                                                partials=True)
            return gated.fn(part, lse, w_vc, gate, q_nope.dtype)
    fused = dispatch("mla_combine_absorb_v", q_lat, backends) if _use_triton(kv) else None
    if fused is not None and fused.name != REFERENCE:
        # the split partials combined inside the absorption's kernel: one kernel fewer per layer and step
        part, lse = mla_decode_paged_triton(q_lat, q_rope, kv, block_table, kv_len, scale, R, num_splits,
                                            partials=True)
        o = fused.fn(part, lse, w_vc, q_nope.dtype)
    else:
        o_lat = mla_decode_paged(q_lat, q_rope, kv, block_table, kv_len, scale, R, num_splits)
        o = mla_absorb_v_any(o_lat, w_vc, q_nope.dtype, backends)
    return o if gate is None else mla_gate_any(gate, o.reshape(gate.shape), q_nope.dtype, backends).view(o.shape)


def paged_available(target: Target) -> tuple[bool, str]:
    """The paged decode runs its Triton kernel on CUDA (or in Triton's interpreter) and its gather-based reference
    elsewhere, so off CUDA it is always available."""
    if target.device.type != "cuda":
        return True, ""
    return _triton.available(target)


register(Op(
    "mla_decode", reference=mla_absorbed,
    fast=(Fast("triton", mla_decode_absorbed, paged_available, validated=True, cpu=True),),
    tolerance="fp32 pool: 1e-5 (exact fp32 products, only the summation order differs); bf16/fp16 pool against the "
              "same rounded cache in fp32: rtol 1e-2, atol 1e-2 x max |expected| (the probabilities are rounded to "
              "the pool dtype for p @ c, one rounding, not amplified)"))


def paged_kernel_used(device: torch.device, backends: Backends | None = None) -> bool:
    """Whether a decode step on `device` attends straight from the page pool (:func:`mla_decode_absorbed`) under
    `backends`, rather than through a gathered copy of each request's cache (op ``mla_decode``). The model asks
    when it runs a step; the serving engine asks ahead, since only the paged form can be captured in a CUDA graph
    (the reference reads the lengths back to the host)."""
    return runs_on("mla_decode", "triton", Target(device), backends)
