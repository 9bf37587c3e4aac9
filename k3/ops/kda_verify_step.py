"""A KDA layer's speculative verification step in one kernel, on the states where the serving cache keeps them.

With the replay fused into the next verification (report §5.4.2, k3.ops.kda_verify_replay) one kernel runs a
request's recurrence over its pending accepted positions and then its new window; around it, per KDA layer and
cycle, the layer still ran a gather of the committed states and conv tails out of the cache's pages, the stacking of
the pending and window inputs, the gather of the conv tail after the pending positions, the window's short conv and
SiLU (elementwise passes over [N, T + W - 1, 3P]), copies of strided inputs, the output norm and gate, and the write
of the state after the pending positions back into the pages: about twenty kernels where a decode step runs one
(k3.ops.kda_decode). `kda_verify_step` is that whole stage on a `KDAStore` (each request's row of the pages: its
fp32 state [H, K, V] then its q/k/v conv tails [3, P, W-1]), the row advanced in place through the pending positions.

* `kda_verify_step` (the reference, every device): the composition the layer ran: a read of the rows,
  k3.ops.kda_verify_replay and k3.ops.gate_norm (each dispatched as `backends` says), a write of the rows.
* `kda_verify_step_triton`: one program per (request, head) with the head's [K, V] state in registers: it loads the
  state, runs the pending positions (their count read on the device), stores the state once; then for each window
  position computes the three short convs and SiLU from the taps of [committed tail, pending inputs, window inputs]
  (stores the post-conv q, k, v: the next cycle's pending inputs), the L2 norms, the decay gate and beta, the
  delta-rule step and the output read, and writes RMSNorm(o) * weight * sigmoid(gate) in the input dtype; last it
  stores the conv tail after the pending positions. Where the reference rounds to the input dtype (the conv outputs,
  the recurrence's output, for bf16 inputs) the kernel rounds the same way. Validated: ``pytest -m gpu
  tests/ops/test_kda_verify_step.py`` passed on an H100 (2026-12-07), so ``auto`` takes it on CUDA;
  ``TRITON_INTERPRET=1`` runs it on CPU tensors (the tests).

Inputs as the layer's projections give them: the window's pre-conv q, k, v [N, T, P] each (column slices of one
stacked projection: read through their strides, not copied), decay logits z [N, T, H, K], beta logits [N, T, H] and
the output gate [N, T, P]; the pending positions as a verification kept them (k3.model.cache.KDAInputs: post-conv k
and v, z and beta logits [N, Pn, ...], the pre-conv q/k/v [N, Pn, P] each; read in place where the seven share their
row and position strides, as views of a request's kept inputs side by side do, else put side by side in one copy)
with a row's count in `pending_lengths` (host ints, or an int tensor [N] on the device that nothing reads back: a
CUDA graph captures the op and refills the counts before each replay).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.gate_norm import gate_norm
from k3.ops.kda_decode import KDAStore
from k3.ops.kda_verify_replay import _check_lengths, _lengths_on, kda_verify_replay_any
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = ["VerifyStep", "kda_verify_step", "kda_verify_step_any", "kda_verify_step_triton"]

# triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
tl = None
_SUM = None


class VerifyStep(NamedTuple):
    """What `kda_verify_step` returns. y: the window's normalized, gated outputs [N, T, P] in the inputs' dtype (what
    the output projection reads); q, k, v: the window's post-conv inputs [N, T, H, K] in the inputs' dtype (q, k not
    L2-normalized: the next cycle's pending inputs)."""

    y: Tensor
    q: Tensor
    k: Tensor
    v: Tensor


def _check(pending_k: Tensor, pending_v: Tensor, pending_z: Tensor, pending_beta_logits: Tensor,
           pending_pre: tuple, lengths: list[int] | Tensor, window_pre: tuple, window_z: Tensor,
           window_beta_logits: Tensor, gate: Tensor, conv_w: tuple, norm_w: Tensor,
           store: KDAStore) -> tuple[int, int, int, int]:
    """Shapes and counts, each error naming the argument, what it got and what it needs."""
    if window_z.dim() != 4:
        raise ValueError(f"window_z has shape {tuple(window_z.shape)}, expected [N, T, H, K]")
    N, T, H, K = window_z.shape
    C = H * K
    Pn = pending_k.shape[1] if pending_k.dim() == 4 else -1
    W = conv_w[0].shape[-1] if len(conv_w) == 3 and conv_w[0].dim() == 2 else 0
    want = {"pending_k": (pending_k, (N, Pn, H, K)), "pending_v": (pending_v, (N, Pn, H, K)),
            "pending_z": (pending_z, (N, Pn, H, K)), "pending_beta_logits": (pending_beta_logits, (N, Pn, H)),
            "window_beta_logits": (window_beta_logits, (N, T, H)), "gate": (gate, (N, T, C)),
            "conv_w[0]": (conv_w[0], (C, W)), "conv_w[1]": (conv_w[1], (C, W)), "conv_w[2]": (conv_w[2], (C, W)),
            "norm_w": (norm_w, (K,))}
    for name, (x, shape) in want.items():
        if Pn < 0 or W < 2 or tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {list(shape)} (N={N} rows, "
                             f"Pn={max(Pn, 0)} pending and T={T} window positions, H={H} heads of K={K}, a conv of "
                             "width >= 2; pending_k is [N, Pn, H, K])")
    for name, group, L in (("pending_pre_conv", pending_pre, Pn), ("window_pre_conv", window_pre, T)):
        if len(group) != 3 or any(tuple(x.shape) != (N, L, C) for x in group):
            raise ValueError(f"{name} must be the q, k, v inputs of the short convs, three [{N}, {L}, {C}] tensors, "
                             f"got {[tuple(x.shape) for x in group]}")
    _check_lengths(lengths, N, Pn, window_z.device)
    need = H * K * K + 3 * C * (W - 1)
    buf = store.buf
    if tuple(store.rows.shape) != (N,):
        raise ValueError(f"store.rows must hold one row per request ({N}), got {tuple(store.rows.shape)}")
    if buf.dtype != torch.float32 or buf.dim() != 2 or buf.shape[1] < need or buf.stride(1) != 1:
        raise ValueError(f"store.buf must be fp32 rows of at least {need} contiguous elements, got {buf.dtype} "
                         f"{tuple(buf.shape)} strides {buf.stride()}")
    return N, T, H, K


def kda_verify_step(pending_k: Tensor, pending_v: Tensor, pending_z: Tensor, pending_beta_logits: Tensor,
                    pending_pre_conv: tuple[Tensor, Tensor, Tensor], pending_lengths: list[int] | Tensor,
                    window_pre_conv: tuple[Tensor, Tensor, Tensor], window_z: Tensor, window_beta_logits: Tensor,
                    gate: Tensor, conv_w: tuple[Tensor, Tensor, Tensor], A_log: Tensor, dt_bias: Tensor,
                    lower_bound: float,
                    norm_w: Tensor, eps: float, store: KDAStore, backends: Backends | None = None) -> VerifyStep:
    """The reference (module docstring): the first pending_lengths[n] pending positions of row n advance its state
    and conv tail in `store` (written back in place: a row with nothing pending gets its own values again), then the
    window's outputs from there. pending_k, pending_v, pending_z [N, Pn, H, K], pending_beta_logits [N, Pn, H],
    pending_pre_conv three [N, Pn, P]: a verification's kept inputs; window_pre_conv three [N, T, P], window_z
    [N, T, H, K], window_beta_logits [N, T, H], gate [N, T, P]: the window's projections; conv_w: the q, k, v conv
    weights [P, W] each;
    A_log [H], dt_bias [P], lower_bound: the decay gate's; norm_w [K], eps: the output norm's. Returns a
    `VerifyStep`."""
    N, T, H, K = _check(pending_k, pending_v, pending_z, pending_beta_logits, pending_pre_conv, pending_lengths,
                        window_pre_conv, window_z, window_beta_logits, gate, conv_w, norm_w, store)
    W = conv_w[0].shape[-1]
    state, conv = store.read(H, K, K, W)
    r = kda_verify_replay_any(pending_k, pending_v, pending_z, pending_beta_logits, torch.stack(pending_pre_conv, 2),
                              pending_lengths, torch.stack(window_pre_conv, 2), window_z,
                              window_beta_logits.contiguous(), torch.stack(conv_w), A_log, dt_bias, lower_bound, state,
                              conv,
                              backends=backends)
    y = gate_norm(r.o, gate.view(N, T, H, K), norm_w, eps, backends=backends)
    store.write(r.state, r.conv)
    return VerifyStep(y.reshape(N, T, H * K).to(window_z.dtype), r.q, r.k, r.v)


# --- the fused kernel ----------------------------------------------------------------------------------------------
def _verify_step_kernel(pq0_ptr, pk0_ptr, pv0_ptr, pk_ptr, pv_ptr, pz_ptr, pb_ptr, pp_sn, pp_st,
                        xq_ptr, xk_ptr, xv_ptr, x_sn, x_st, z_ptr, z_sn, z_st, b_ptr, b_sn, b_st, g_ptr, g_sn, g_st,
                        wq_ptr, wk_ptr, wv_ptr, a_ptr, dtb_ptr, nw_ptr, buf_ptr, buf_stride, rows_ptr, rows_stride,
                        len_ptr, y_ptr, qo_ptr, ko_ptr, vo_ptr, lower_bound, scale, eps, H, T,
                        K: tl.constexpr, W: tl.constexpr, K_PAD: tl.constexpr, W_PAD: tl.constexpr,
                        D_PAD: tl.constexpr, ROUND: tl.constexpr, OUT_BF16: tl.constexpr):
    """Program (request n, head h): the module docstring's verification step for head h of request n."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    P = H * K
    kk = tl.arange(0, K_PAD)
    km = kk < K
    c = h * K + kk  # this head's channels
    row = tl.load(rows_ptr + n * rows_stride).to(tl.int64)  # rows may be a strided view (a static step's pages)
    base = buf_ptr + row * buf_stride
    conv_base = base + H * K * K  # then [3, P, W-1]
    length = tl.load(len_ptr + n).to(tl.int64)
    A = tl.exp(tl.load(a_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + c, mask=km, other=0.0).to(tl.float32)
    s_off = (h * K + kk)[:, None] * K + kk[None, :]
    sm = km[:, None] & km[None, :]
    S = tl.load(base + s_off, mask=sm, other=0.0)
    for t in range(0, length):  # the pending positions (accepted): their post-conv k and v as kept
        pt = n * pp_sn + t * pp_st  # position t of request n (the seven pending inputs share their strides)
        kt = tl.load(pk_ptr + pt + c, mask=km, other=0.0).to(tl.float32)
        kt = kt * tl.rsqrt(tl.reduce(kt * kt, 0, _SUM) + 1e-6)
        x = A * (tl.load(pz_ptr + pt + c, mask=km, other=0.0).to(tl.float32) + dtb)
        e = tl.exp(-tl.abs(x))
        g = lower_bound * tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        bl = tl.load(pb_ptr + pt + h).to(tl.float32)
        eb = tl.exp(-tl.abs(bl))
        beta = tl.where(bl >= 0, 1.0 / (1.0 + eb), eb / (1.0 + eb))
        vt = tl.load(pv_ptr + pt + c, mask=km, other=0.0).to(tl.float32)
        S = S * tl.exp(g)[:, None]
        kS = tl.reduce(kt[:, None] * S, 0, _SUM)
        S = S + kt[:, None] * (beta * (vt - kS))[None, :]
    tl.store(base + s_off, S, mask=sm)  # the state after the accepted positions: written once

    # The conv taps: index i of [committed tail (W-1), pending inputs (length), window inputs (T)] per channel.
    ww = tl.arange(0, W_PAD)
    wm = km[:, None] & (ww < W)[None, :]
    w_q = tl.load(wq_ptr + c[:, None] * W + ww[None, :], mask=wm, other=0.0).to(tl.float32)
    w_k = tl.load(wk_ptr + c[:, None] * W + ww[None, :], mask=wm, other=0.0).to(tl.float32)
    w_v = tl.load(wv_ptr + c[:, None] * W + ww[None, :], mask=wm, other=0.0).to(tl.float32)
    tail_q = conv_base + c[:, None] * (W - 1)
    tail_k = tail_q + P * (W - 1)
    tail_v = tail_q + 2 * P * (W - 1)
    nw = tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32)
    for t in range(0, T):
        i = length + t + ww[None, :]  # [1, W_PAD]: tap w of window position t
        in_tail = wm & (i < W - 1)
        in_pend = wm & (i >= W - 1) & (i < W - 1 + length)
        in_win = wm & (i >= W - 1 + length)
        po = n * pp_sn + (i - (W - 1)) * pp_st + c[:, None]
        xo = n * x_sn + (i - (W - 1) - length) * x_st + c[:, None]
        xq = tl.load(tail_q + i, mask=in_tail, other=0.0) \
            + tl.load(pq0_ptr + po, mask=in_pend, other=0.0).to(tl.float32) \
            + tl.load(xq_ptr + xo, mask=in_win, other=0.0).to(tl.float32)
        xk = tl.load(tail_k + i, mask=in_tail, other=0.0) \
            + tl.load(pk0_ptr + po, mask=in_pend, other=0.0).to(tl.float32) \
            + tl.load(xk_ptr + xo, mask=in_win, other=0.0).to(tl.float32)
        xv = tl.load(tail_v + i, mask=in_tail, other=0.0) \
            + tl.load(pv0_ptr + po, mask=in_pend, other=0.0).to(tl.float32) \
            + tl.load(xv_ptr + xo, mask=in_win, other=0.0).to(tl.float32)
        q = tl.reduce(xq * w_q, 1, _SUM)
        k = tl.reduce(xk * w_k, 1, _SUM)
        v = tl.reduce(xv * w_v, 1, _SUM)
        q = q / (1.0 + tl.exp(-q))  # SiLU, rounded to the input dtype as the conv op returns it
        k = k / (1.0 + tl.exp(-k))
        v = v / (1.0 + tl.exp(-v))
        out = ((n * T + t) * H + h) * K + kk
        if OUT_BF16:
            q = q.to(tl.bfloat16)
            k = k.to(tl.bfloat16)
            v = v.to(tl.bfloat16)
        tl.store(qo_ptr + out, q, mask=km)
        tl.store(ko_ptr + out, k, mask=km)
        tl.store(vo_ptr + out, v, mask=km)
        q = tl.where(km, q.to(tl.float32), 0.0)
        k = tl.where(km, k.to(tl.float32), 0.0)
        v = tl.where(km, v.to(tl.float32), 0.0)
        q = q * tl.rsqrt(tl.reduce(q * q, 0, _SUM) + 1e-6) * scale
        k = k * tl.rsqrt(tl.reduce(k * k, 0, _SUM) + 1e-6)
        x = A * (tl.load(z_ptr + n * z_sn + t * z_st + c, mask=km, other=0.0).to(tl.float32) + dtb)
        e = tl.exp(-tl.abs(x))
        g = lower_bound * tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        bl = tl.load(b_ptr + n * b_sn + t * b_st + h).to(tl.float32)
        eb = tl.exp(-tl.abs(bl))
        beta = tl.where(bl >= 0, 1.0 / (1.0 + eb), eb / (1.0 + eb))
        S = S * tl.exp(g)[:, None]  # the window's state stays in registers: its drafts are unverified
        kS = tl.reduce(k[:, None] * S, 0, _SUM)
        S = S + k[:, None] * (beta * (v - kS))[None, :]
        o = tl.reduce(q[:, None] * S, 0, _SUM)  # [V]
        if ROUND:  # the recurrence returns o in the inputs' dtype
            o = o.to(tl.bfloat16).to(tl.float32)
        o = tl.where(km, o, 0.0)
        rs = tl.rsqrt(tl.reduce(o * o, 0, _SUM) / K + eps)
        gt = tl.load(g_ptr + n * g_sn + t * g_st + c, mask=km, other=0.0).to(tl.float32)
        eg = tl.exp(-tl.abs(gt))
        y = o * rs * nw * tl.where(gt >= 0, 1.0 / (1.0 + eg), eg / (1.0 + eg))
        if OUT_BF16:
            tl.store(y_ptr + (n * T + t) * P + c, y.to(tl.bfloat16), mask=km)
        else:
            tl.store(y_ptr + (n * T + t) * P + c, y, mask=km)

    # last, the conv tail after the pending positions (the window read the committed one above): [tail, pending][n:]
    dd = tl.arange(0, D_PAD)
    i = length + dd[None, :]
    dm = km[:, None] & (dd < W - 1)[None, :]
    in_tail = dm & (i < W - 1)
    in_pend = dm & (i >= W - 1)
    po = n * pp_sn + (i - (W - 1)) * pp_st + c[:, None]
    nq = tl.load(tail_q + i, mask=in_tail, other=0.0) + tl.load(pq0_ptr + po, mask=in_pend, other=0.0).to(tl.float32)
    nk = tl.load(tail_k + i, mask=in_tail, other=0.0) + tl.load(pk0_ptr + po, mask=in_pend, other=0.0).to(tl.float32)
    nv = tl.load(tail_v + i, mask=in_tail, other=0.0) + tl.load(pv0_ptr + po, mask=in_pend, other=0.0).to(tl.float32)
    tl.debug_barrier()  # every lane's loads of the committed tail before any store over it
    tl.store(tail_q + dd[None, :], nq, mask=dm)
    tl.store(tail_k + dd[None, :], nk, mask=dm)
    tl.store(tail_v + dd[None, :], nv, mask=dm)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_verify_step_kernel)


def _inner_contiguous(x: Tensor) -> bool:
    """Whether x [N, L, ...]'s dims after the first two are laid out contiguously (any row and position stride)."""
    want = 1
    for d in range(x.dim() - 1, 1, -1):
        if x.shape[d] != 1 and x.stride(d) != want:
            return False
        want *= x.shape[d]
    return True


def _strided(group: tuple[Tensor, ...]) -> tuple[tuple[Tensor, ...], int, int]:
    """Tensors [N, L, ...] (one N and L) as pointers with one (row, position) stride pair, the rest of each
    contiguous: as given when they share their strides (column slices of one stacked projection, or of the kept
    inputs a pending request holds side by side), else put side by side in one new tensor (one copy) as its views."""
    # a dim of size 1 is never stepped over, so its stride is no constraint (a view's may be anything: unflatten's)
    pairs = {tuple(st if size > 1 else 0 for size, st in zip(x.shape[:2], x.stride()[:2])) for x in group}
    if all(_inner_contiguous(x) for x in group) and len(pairs) == 1:
        return group, *pairs.pop()
    N, L = group[0].shape[:2]
    flat = torch.cat([x.reshape(N, L, -1) for x in group], -1)
    views, at = [], 0
    for x in group:
        w = math.prod(x.shape[2:])
        views.append(flat[..., at:at + w].view(x.shape))
        at += w
    return tuple(views), flat.stride(0), flat.stride(1)


def _nt(x: Tensor) -> tuple[Tensor, int, int]:
    """x [N, T, ...] with its trailing dims contiguous, as (x, row stride, position stride)."""
    inner = x[0, 0] if x.shape[0] and x.shape[1] else None
    if inner is not None and not inner.is_contiguous():
        x = x.contiguous()
    return x, x.stride(0), x.stride(1)


def kda_verify_step_triton(pending_k: Tensor, pending_v: Tensor, pending_z: Tensor, pending_beta_logits: Tensor,
                           pending_pre_conv: tuple[Tensor, Tensor, Tensor], pending_lengths: list[int] | Tensor,
                           window_pre_conv: tuple[Tensor, Tensor, Tensor], window_z: Tensor,
                           window_beta_logits: Tensor, gate: Tensor, conv_w: tuple[Tensor, Tensor, Tensor],
                           A_log: Tensor, dt_bias: Tensor, lower_bound: float, norm_w: Tensor, eps: float,
                           store: KDAStore,
                           backends: Backends | None = None) -> VerifyStep:
    """`kda_verify_step` as one Triton kernel (the module docstring); the same arguments and results."""
    N, T, H, K = _check(pending_k, pending_v, pending_z, pending_beta_logits, pending_pre_conv, pending_lengths,
                        window_pre_conv, window_z, window_beta_logits, gate, conv_w, norm_w, store)
    dtype = window_pre_conv[0].dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the KDA verification kernel takes fp32 or bf16 inputs, got {dtype}")
    W = conv_w[0].shape[-1]
    buf = store.buf
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the KDA verification kernel cannot run: {why}")
    dev = window_z.device
    P = H * K
    Pn = pending_k.shape[1]
    lengths = _lengths_on(pending_lengths, dev, torch.int32).contiguous()
    (wq, wk, wv), x_sn, x_st = _strided(window_pre_conv)
    z, z_sn, z_st = _nt(window_z)
    beta, b_sn, b_st = _nt(window_beta_logits)
    gate, g_sn, g_st = _nt(gate)
    if Pn == 0:  # nothing pending in any row (every count is 0, so nothing is read): any valid pointers will do
        pend, pp_sn, pp_st = (wq, wk, wv, window_z, window_z, window_z, window_beta_logits), 0, 0
    else:  # views of a request's kept inputs side by side (`k3.serve.cache.views.flat_inputs`): read in place
        pend, pp_sn, pp_st = _strided((*pending_pre_conv, pending_k, pending_v, pending_z, pending_beta_logits))
    y = torch.empty(N, T, P, device=dev, dtype=dtype)
    q, k, v = (torch.empty(N, T, H, K, device=dev, dtype=dtype) for _ in range(3))
    if N == 0:
        return VerifyStep(y, q, k, v)
    w = [x.contiguous() for x in conv_w]
    with torch.cuda.device(dev.index if window_z.is_cuda else -1):  # the tensors' GPU; -1: no-op
        _kernel(_triton.interpret())[(N, H)](
            *pend, pp_sn, pp_st, wq, wk, wv, x_sn, x_st, z, z_sn, z_st, beta, b_sn, b_st,
            gate, g_sn, g_st, w[0], w[1], w[2], A_log.contiguous(), dt_bias.reshape(-1).contiguous(),
            norm_w.contiguous(), buf, buf.stride(0), store.rows, store.rows.stride(0), lengths, y, q, k, v,
            float(lower_bound), K ** -0.5, float(eps), H, T, K=K, W=W, K_PAD=1 << (K - 1).bit_length(),
            W_PAD=_triton.pow2(W), D_PAD=_triton.pow2(W - 1), ROUND=dtype == torch.bfloat16,
            OUT_BF16=dtype == torch.bfloat16, num_warps=8 if K > 64 else 4)
    return VerifyStep(y, q, k, v)


register(Op(
    "kda_verify_step", reference=kda_verify_step,
    # validated: its GPU tests (tests/ops/test_kda_verify_step.py, marked gpu) passed on an H100 (2026-12-07, fp32 and
    # bf16 at k3-mini's layer shape, counts on the host and on the device, pending inputs as separate tensors and as
    # views of one tensor read in place)
    fast=(Fast("triton", kda_verify_step_triton, _triton.available, validated=True, cpu=True),),
    tolerance="fp32: outputs, kept inputs and state 1e-5 of their largest entries (the conv's taps and the K-term "
              "reads summed in another order, sigmoids from exponentials); bf16: the state the same, the kept inputs "
              "one bf16 step (a tap sum on the other side of a rounding boundary), the outputs 2e-2 of their largest "
              "entry (such a step carried through the recurrence and the norm); the conv tail bit for bit"))


def kda_verify_step_any(*args, backends: Backends | None = None) -> VerifyStep:
    """`kda_verify_step` on the implementation the registry picks for the inputs (op ``kda_verify_step``)."""
    return dispatch("kda_verify_step", args[7], backends).fn(*args, backends=backends)
