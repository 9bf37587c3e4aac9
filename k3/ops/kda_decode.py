"""One KDA layer's single-token decode update in one kernel, reading and writing the layer's state where it lives.

A decode step of a KDA layer (report §2.1.1) takes the token's projections (the q/k/v inputs of the short convs, the
decay logits z, the beta logits and the output gate) and the request's running state, and gives the normalized,
gated output that the output projection reads. As separate ops that is: a gather of the states out of the serving
cache's pages, three short convs (each with its tail update), the gate and the L2 norms, the recurrence, the output
norm and gate, and two scatters of the new states back into the pages: about ten kernels and three round trips of
the [H, K, V] fp32 state through memory where one suffices.

`kda_decode` does it on a `KDAStore`: rows of one fp32 tensor, each row one request's state [H, K, V] followed by
its q/k/v conv tails [3, P, W-1] (oldest first), which is how the serving cache pool lays out a KDA page; `rows` says
which row holds each request of the batch. The state and tails are updated in place.

* ``composed`` (the reference, every device): the ops the layer runs otherwise (k3.ops.kda_backend's short conv and
  KDA, k3.ops.gate_norm), each dispatched as `backends` says, between a gather of the rows and a write back: the
  same math as the layer's read/update path.
* ``triton``: one program per (request, head) loads its channels' conv tails and weights, computes the three convs
  and SiLU, writes the shifted tails, L2-normalizes q and k, computes the decay gate from z, A_log and dt_bias and
  sigmoid(beta), loads the head's [K, V] state slice, decays it, does the delta-rule read and write and the output
  read, stores the slice back and writes RMSNorm(o) * weight * sigmoid(gate) in the input dtype: one kernel, the
  state read once and written once. Where the composed path rounds to the input dtype (the conv outputs and the
  recurrence's output, for bf16 inputs), the kernel rounds the same way. ``TRITON_INTERPRET=1`` runs it on CPU
  tensors (the tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.gate_norm import gate_norm
from k3.ops.kda_backend import kda, short_conv
from k3.ops.registry import Backends, Fast, Op, dispatch, keep_opaque, opaque, register

__all__ = ["KDAStore", "kda_decode", "kda_decode_composed", "kda_decode_decay_proj", "kda_decode_decay_proj_triton",
           "kda_decode_triton"]

# triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
tl = None
_SUM = None


@dataclass(frozen=True)
class KDAStore:
    """Where a batch's KDA states live: `buf` fp32 [R, E] (each row contiguous; rows may be strided, as the pages of
    a cache pool are), row `rows[b]` holding request b's state [H, K, V] then its conv tails [3, P, W-1]."""

    buf: Tensor
    rows: Tensor  # int64 [B] on buf's device

    # Both run outside a compiled decode step (registry.opaque): traced, an in-place write into rows that alias a
    # cache pool would be functionalized into a copy of the whole pool.
    def read(self, H: int, K: int, V: int, W: int) -> tuple[Tensor, Tensor]:
        """(state [B, H, K, V], conv [B, 3, H*K, W-1]) of the batch's rows, copies."""
        return opaque(_read_rows)(self.buf, self.rows, H, K, V, W)

    def write(self, state: Tensor, conv: Tensor) -> None:
        """Store the batch's new states and conv tails into their rows."""
        opaque(_write_rows)(self.buf, self.rows, state, conv)


@keep_opaque
def _read_rows(buf: Tensor, rows: Tensor, H: int, K: int, V: int, W: int) -> tuple[Tensor, Tensor]:
    raw = buf.index_select(0, rows)
    s = H * K * V
    return raw[:, :s].reshape(-1, H, K, V), raw[:, s:s + 3 * H * K * (W - 1)].reshape(-1, 3, H * K, W - 1)


@keep_opaque
def _write_rows(buf: Tensor, rows: Tensor, state: Tensor, conv: Tensor) -> None:
    s = state[0].numel()
    buf[rows, :s] = state.float().reshape(len(rows), -1)
    buf[rows, s:s + conv[0].numel()] = conv.float().reshape(len(rows), -1)


def _check(xq: Tensor, xk: Tensor, xv: Tensor, z: Tensor, beta_logits: Tensor, gate: Tensor, conv_w: tuple,
           A_log: Tensor, store: KDAStore) -> tuple[int, int, int, int]:
    if xq.dim() != 2:
        raise ValueError(f"xq must be [B, H*K] (one token per request), got {tuple(xq.shape)}")
    B, P = xq.shape
    H = A_log.shape[0]
    if P % H:
        raise ValueError(f"the projection width {P} does not divide by the {H} heads")
    K = P // H
    for name, t, shape in (("xk", xk, (B, P)), ("xv", xv, (B, P)), ("z", z, (B, P)), ("gate", gate, (B, P)),
                           ("beta_logits", beta_logits, (B, H))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if len(conv_w) != 3 or any(w.dim() != 2 or w.shape[0] != P for w in conv_w):
        raise ValueError(f"conv_w must be the three [{P}, W] conv weights (q, k, v)")
    W = conv_w[0].shape[1]
    if tuple(store.rows.shape) != (B,):
        raise ValueError(f"store.rows must hold one row per request ({B}), got {tuple(store.rows.shape)}")
    need = H * K * K + 3 * P * (W - 1)
    if store.buf.dtype != torch.float32 or store.buf.dim() != 2 or store.buf.shape[1] < need \
            or store.buf.stride(1) != 1:
        raise ValueError(f"store.buf must be fp32 rows of at least {need} contiguous elements, got "
                         f"{store.buf.dtype} {tuple(store.buf.shape)} strides {store.buf.stride()}")
    return B, H, K, W


def kda_decode_composed(xq: Tensor, xk: Tensor, xv: Tensor, z: Tensor, beta_logits: Tensor, gate: Tensor,
                        conv_w: tuple[Tensor, Tensor, Tensor], A_log: Tensor, dt_bias: Tensor, lower_bound: float,
                        norm_w: Tensor, eps: float, store: KDAStore,
                        backends: Backends | None = None) -> Tensor:
    """The reference: the layer's ops between a gather of the batch's rows of `store` and a write back (module
    docstring). xq, xk, xv: [B, P] the short convs' inputs; z: [B, P] decay logits before dt_bias; beta_logits
    [B, H]; gate [B, P] the output gate's logits; conv_w: the q/k/v conv weights [P, W]; norm_w [K]. Returns the
    gated, normalized output [B, P] in xq's dtype; the state and conv tails in `store` are advanced by the token."""
    B, H, K, W = _check(xq, xk, xv, z, beta_logits, gate, conv_w, A_log, store)
    state, conv = store.read(H, K, K, W)
    outs, tails = [], []
    for j, x in enumerate((xq, xk, xv)):
        y, tail = short_conv(x[:, None], conv_w[j], conv[:, j], backends=backends)
        outs.append(y.view(B, 1, H, K))
        tails.append(tail)
    o, new_state = kda(*outs, z.reshape(B, 1, H, K), beta_logits.reshape(B, 1, H).contiguous(), A_log, dt_bias,
                       lower_bound, initial_state=state, backends=backends)
    y = gate_norm(o, gate.reshape(B, 1, H, K), norm_w, eps, backends=backends)
    store.write(new_state, torch.stack(tails, 1))
    return y.reshape(B, H * K).to(xq.dtype)


# --- the fused kernel ---------------------------------------------------------------------------------------------
def _decode_kernel(xq_ptr, xk_ptr, xv_ptr, x_stride, z_ptr, z_stride, b_ptr, b_stride, g_ptr, g_stride,
                   wq_ptr, wk_ptr, wv_ptr, a_ptr, dtb_ptr, nw_ptr, buf_ptr, buf_stride, rows_ptr, rows_stride, y_ptr,
                   lower_bound, scale, eps, H, fb_ptr, fb_stride, R, K: tl.constexpr, W: tl.constexpr,
                   K_PAD: tl.constexpr, T_PAD: tl.constexpr, ROUND: tl.constexpr, OUT_BF16: tl.constexpr,
                   Z_PROJ: tl.constexpr, R_PAD: tl.constexpr):
    """Program (request b, head h): the module docstring's fused step for head h of request b. Z_PROJ: z_ptr holds
    the decay's low-rank input f_a [R] per request and fb_ptr the up-projection [P, R]; the head's decay logits are
    its K rows of fb times f_a, in fp32, rounded as the projection's GEMM rounds its output (op
    ``kda_decode_decay_proj``)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    P = H * K
    kk = tl.arange(0, K_PAD)
    km = kk < K
    c = h * K + kk  # this head's channels
    tt = tl.arange(0, T_PAD)  # the W - 1 carried inputs
    tm = tt < W - 1
    m2 = km[:, None] & tm[None, :]
    row = tl.load(rows_ptr + b * rows_stride).to(tl.int64)  # rows may be a strided view (a static step's pages)
    base = buf_ptr + row * buf_stride
    conv_base = base + H * K * K  # then [3, P, W-1]

    # q: conv over [tail, x], SiLU; the tail shifts by one (loads before stores: this program owns the channels)
    tail_off = c[:, None] * (W - 1) + tt[None, :]
    x = tl.load(xq_ptr + b * x_stride + c, mask=km, other=0.0).to(tl.float32)
    tail = tl.load(conv_base + tail_off, mask=m2, other=0.0)
    nxt = tl.load(conv_base + tail_off + 1, mask=m2 & (tt[None, :] < W - 2), other=0.0)
    wt = tl.load(wq_ptr + c[:, None] * W + tt[None, :], mask=m2, other=0.0).to(tl.float32)
    wl = tl.load(wq_ptr + c * W + (W - 1), mask=km, other=0.0).to(tl.float32)
    q = tl.reduce(tail * wt, 1, _SUM) + x * wl
    tl.store(conv_base + tail_off, tl.where(tt[None, :] == W - 2, x[:, None], nxt), mask=m2)
    # k
    kb = conv_base + P * (W - 1)
    x = tl.load(xk_ptr + b * x_stride + c, mask=km, other=0.0).to(tl.float32)
    tail = tl.load(kb + tail_off, mask=m2, other=0.0)
    nxt = tl.load(kb + tail_off + 1, mask=m2 & (tt[None, :] < W - 2), other=0.0)
    wt = tl.load(wk_ptr + c[:, None] * W + tt[None, :], mask=m2, other=0.0).to(tl.float32)
    wl = tl.load(wk_ptr + c * W + (W - 1), mask=km, other=0.0).to(tl.float32)
    k = tl.reduce(tail * wt, 1, _SUM) + x * wl
    tl.store(kb + tail_off, tl.where(tt[None, :] == W - 2, x[:, None], nxt), mask=m2)
    # v
    vb = conv_base + 2 * P * (W - 1)
    x = tl.load(xv_ptr + b * x_stride + c, mask=km, other=0.0).to(tl.float32)
    tail = tl.load(vb + tail_off, mask=m2, other=0.0)
    nxt = tl.load(vb + tail_off + 1, mask=m2 & (tt[None, :] < W - 2), other=0.0)
    wt = tl.load(wv_ptr + c[:, None] * W + tt[None, :], mask=m2, other=0.0).to(tl.float32)
    wl = tl.load(wv_ptr + c * W + (W - 1), mask=km, other=0.0).to(tl.float32)
    v = tl.reduce(tail * wt, 1, _SUM) + x * wl
    tl.store(vb + tail_off, tl.where(tt[None, :] == W - 2, x[:, None], nxt), mask=m2)

    # SiLU, rounded to the input dtype as the conv op returns it
    q = q / (1.0 + tl.exp(-q))
    k = k / (1.0 + tl.exp(-k))
    v = v / (1.0 + tl.exp(-v))
    if ROUND:
        q = q.to(tl.bfloat16).to(tl.float32)
        k = k.to(tl.bfloat16).to(tl.float32)
        v = v.to(tl.bfloat16).to(tl.float32)
    q = tl.where(km, q, 0.0)
    k = tl.where(km, k, 0.0)
    v = tl.where(km, v, 0.0)
    q = q * tl.rsqrt(tl.reduce(q * q, 0, _SUM) + 1e-6) * scale
    k = k * tl.rsqrt(tl.reduce(k * k, 0, _SUM) + 1e-6)
    # the lower-bounded decay gate and beta
    A = tl.exp(tl.load(a_ptr + h).to(tl.float32))
    if Z_PROJ:
        r = tl.arange(0, R_PAD)
        rm = r < R
        fa = tl.load(z_ptr + b * z_stride + r, mask=rm, other=0.0).to(tl.float32)
        wf = tl.load(fb_ptr + c[:, None] * fb_stride + r[None, :], mask=km[:, None] & rm[None, :],
                     other=0.0).to(tl.float32)
        zl = tl.reduce(wf * fa[None, :], 1, _SUM)
        if ROUND:
            zl = zl.to(tl.bfloat16).to(tl.float32)
    else:
        zl = tl.load(z_ptr + b * z_stride + c, mask=km, other=0.0).to(tl.float32)
    zz = A * (zl + tl.load(dtb_ptr + c, mask=km, other=0.0).to(tl.float32))
    e = tl.exp(-tl.abs(zz))
    g = lower_bound * tl.where(zz >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    bl = tl.load(b_ptr + b * b_stride + h).to(tl.float32)
    eb = tl.exp(-tl.abs(bl))
    beta = tl.where(bl >= 0, 1.0 / (1.0 + eb), eb / (1.0 + eb))
    # the recurrence on the head's [K, V] slice (V = K), read once, written once
    s_off = (h * K + kk)[:, None] * K + kk[None, :]
    sm = km[:, None] & km[None, :]
    S = tl.load(base + s_off, mask=sm, other=0.0)
    S = S * tl.exp(g)[:, None]
    kS = tl.reduce(k[:, None] * S, 0, _SUM)
    S = S + k[:, None] * (beta * (v - kS))[None, :]
    o = tl.reduce(q[:, None] * S, 0, _SUM)  # [V]
    tl.store(base + s_off, S, mask=sm)
    if ROUND:  # the recurrence returns o in the inputs' dtype
        o = o.to(tl.bfloat16).to(tl.float32)
    # RMSNorm over the head's channels, times the weight and sigmoid(gate)
    o = tl.where(km, o, 0.0)
    rs = tl.rsqrt(tl.reduce(o * o, 0, _SUM) / K + eps)
    gt = tl.load(g_ptr + b * g_stride + c, mask=km, other=0.0).to(tl.float32)
    eg = tl.exp(-tl.abs(gt))
    sg = tl.where(gt >= 0, 1.0 / (1.0 + eg), eg / (1.0 + eg))
    y = o * rs * tl.load(nw_ptr + kk, mask=km, other=0.0).to(tl.float32) * sg
    if OUT_BF16:
        tl.store(y_ptr + b * P + c, y.to(tl.bfloat16), mask=km)
    else:
        tl.store(y_ptr + b * P + c, y, mask=km)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_decode_kernel)


def _rows_of(t: Tensor, width: int) -> tuple[Tensor, int]:
    """t [B, width] as a pointer and a row stride (its columns must be contiguous)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t, (t.stride(0) if t.shape[0] > 1 else width)


def kda_decode_triton(xq: Tensor, xk: Tensor, xv: Tensor, z: Tensor, beta_logits: Tensor, gate: Tensor,
                      conv_w: tuple[Tensor, Tensor, Tensor], A_log: Tensor, dt_bias: Tensor, lower_bound: float,
                      norm_w: Tensor, eps: float, store: KDAStore, backends: Backends | None = None,
                      decay_proj: Tensor | None = None) -> Tensor:
    """`kda_decode_composed` as one Triton kernel (module docstring); the same arguments and results. With
    `decay_proj` (the decay's up-projection weight [P, R]), z is the low-rank input f_a [B, R] and the kernel
    computes the decay logits itself (op ``kda_decode_decay_proj``)."""
    if decay_proj is not None:
        _check_decay_proj(xq, z, decay_proj)
        fa = z
        z = xq  # what the checks read of z: its shape [B, P]
    B, H, K, W = _check(xq, xk, xv, z, beta_logits, gate, conv_w, A_log, store)
    if xq.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the KDA decode kernel takes fp32 or bf16 inputs, got {xq.dtype}")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the KDA decode kernel cannot run: {why}")
    P = H * K
    # xq, xk and xv usually are column slices of one stacked projection: one row stride for the three
    xs = [_rows_of(t, P) for t in (xq, xk, xv)]
    if len({s for _, s in xs}) != 1:
        xs = [(t.contiguous(), P) for t, _ in xs]
    (xq, stride), (xk, _), (xv, _) = xs
    if decay_proj is not None:
        z, zs = _rows_of(fa, fa.shape[1])
        fb = decay_proj if decay_proj.stride(1) == 1 else decay_proj.contiguous()
        R = fb.shape[1]
    else:
        z, zs = _rows_of(z, P)
        fb, R = z, 1
    beta_logits, bs = _rows_of(beta_logits, H)
    gate, gs = _rows_of(gate, P)
    y = torch.empty(B, P, device=xq.device, dtype=xq.dtype)
    if B == 0:
        return y
    with torch.cuda.device(xq.device.index if xq.is_cuda else -1):  # the tensors' GPU; -1: no-op
        _kernel(_triton.interpret())[(B, H)](
            xq, xk, xv, stride, z, zs, beta_logits, bs, gate, gs, *(w.contiguous() for w in conv_w),
            A_log.contiguous(), dt_bias.reshape(-1).contiguous(), norm_w.contiguous(), store.buf,
            store.buf.stride(0), store.rows, store.rows.stride(0), y, float(lower_bound), K ** -0.5, float(eps), H,
            fb, fb.stride(0), R, K=K, W=W, K_PAD=1 << (K - 1).bit_length(),
            T_PAD=max(1 << (W - 2).bit_length(), 2), ROUND=xq.dtype == torch.bfloat16,
            OUT_BF16=xq.dtype == torch.bfloat16, Z_PROJ=decay_proj is not None,
            R_PAD=max(1 << (R - 1).bit_length(), 2), num_warps=8 if K > 64 else 4)
    return y


register(Op(
    "kda_decode", reference=kda_decode_composed,
    # validated: its GPU test (tests/ops/test_kda_decode.py, marked gpu) passed on an H100 (2026-12-06, fp32 and bf16)
    fast=(Fast("triton", kda_decode_triton, _triton.available, validated=True, cpu=True),),
    tolerance="fp32: output 1e-5 and state 1e-5 of their largest entries (sums in another order, sigmoids from "
              "exponentials); bf16: the same after the shared roundings (up to one bf16 ulp of the output); conv "
              "tails bit for bit"))


def _check_decay_proj(xq: Tensor, fa: Tensor, fb: Tensor) -> None:
    P = xq.shape[-1]
    if fa.ndim != 2 or fa.shape[0] != xq.shape[0] or fa.dtype != xq.dtype:
        raise ValueError(f"f_a must be [B={xq.shape[0]}, R] in xq's dtype {xq.dtype}, got {tuple(fa.shape)} {fa.dtype}")
    if fb.ndim != 2 or tuple(fb.shape) != (P, fa.shape[1]) or fb.dtype != xq.dtype:
        raise ValueError(f"the decay's up-projection must be [P={P}, R={fa.shape[1]}] in xq's dtype, got "
                         f"{tuple(fb.shape)} {fb.dtype}")


def kda_decode_decay_proj(xq: Tensor, xk: Tensor, xv: Tensor, f_a: Tensor, decay_proj: Tensor, beta_logits: Tensor,
                          gate: Tensor, conv_w: tuple[Tensor, Tensor, Tensor], A_log: Tensor, dt_bias: Tensor,
                          lower_bound: float, norm_w: Tensor, eps: float, store: KDAStore,
                          backends: Backends | None = None) -> Tensor:
    """The definition (op ``kda_decode_decay_proj``): the decay logits z = f_a decay_proj^T as their own GEMM, then
    `kda_decode` (on the implementation the registry picks)."""
    _check_decay_proj(xq, f_a, decay_proj)
    z = torch.nn.functional.linear(f_a, decay_proj)
    return kda_decode(xq, xk, xv, z, beta_logits, gate, conv_w, A_log, dt_bias, lower_bound, norm_w, eps, store,
                      backends)


def kda_decode_decay_proj_triton(xq: Tensor, xk: Tensor, xv: Tensor, f_a: Tensor, decay_proj: Tensor,
                                 beta_logits: Tensor, gate: Tensor, conv_w: tuple[Tensor, Tensor, Tensor],
                                 A_log: Tensor, dt_bias: Tensor, lower_bound: float, norm_w: Tensor, eps: float,
                                 store: KDAStore, backends: Backends | None = None) -> Tensor:
    """`kda_decode_decay_proj` as the decode kernel with the decay's up-projection inside (one GEMM fewer)."""
    return kda_decode_triton(xq, xk, xv, f_a, beta_logits, gate, conv_w, A_log, dt_bias, lower_bound, norm_w, eps,
                             store, backends, decay_proj=decay_proj)


register(Op(
    "kda_decode_decay_proj", reference=kda_decode_decay_proj,
    # validated: its GPU tests (tests/ops/test_kda_decode.py, marked gpu) passed on an H100 (2026-12-07: fp32 and bf16,
    # the bf16 state within the 1e-3 bound it was given after a 3.4e-4 miss of the earlier 1e-4 on 2026-12-06: a decay
    # logit rounded the other way); it was no faster than the separate GEMM at batch 1 then (BENCHMARKS.md)
    fast=(Fast("triton", kda_decode_decay_proj_triton, _triton.available, validated=True, cpu=True),),
    tolerance="kda_decode's, after the decay logits rounded as the projection's GEMM rounds them (fp32 sums in "
              "another order: a logit one bf16 step off moves the decay by about 0.4% of that step)"))


def kda_decode(xq: Tensor, xk: Tensor, xv: Tensor, z: Tensor, beta_logits: Tensor, gate: Tensor,
               conv_w: tuple[Tensor, Tensor, Tensor], A_log: Tensor, dt_bias: Tensor, lower_bound: float,
               norm_w: Tensor, eps: float, store: KDAStore, backends: Backends | None = None) -> Tensor:
    """One KDA decode step on the implementation the registry picks for xq (op ``kda_decode``; module docstring)."""
    return dispatch("kda_decode", xq, backends).fn(xq, xk, xv, z, beta_logits, gate, conv_w, A_log, dt_bias,
                                                   lower_bound, norm_w, eps, store, backends)
