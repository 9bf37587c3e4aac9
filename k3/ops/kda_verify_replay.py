"""KDA replay fused into the next verification (report §5.4.2): one recurrent pass over a request's pending accepted
positions and then its new draft window, from the committed state.

Speculative decoding verifies a window of T positions (the last sampled token and T - 1 drafts) through every KDA
layer from the committed state without writing the advanced state (k3.ops.kda_replay says why). Once n of them are
accepted, k3.ops.kda_replay rebuilds the state after those n from their kept projected inputs: the committed state
is read and written once more per layer and cycle. The report instead keeps the accepted positions pending (their
projected inputs only) and runs them at the head of the next verification: per layer and cycle the committed state
is read once, advanced through the pending positions, written once (the state after the pending positions, which
are accepted), and advanced on through the window to give the window's outputs, that part never written (its
drafts are unverified).

The seam. The op takes the pending positions as a verification kept them (post-conv k and v, decay logits z, beta
logits, the pre-conv q/k/v inputs; a row's count in `pending_lengths`, 0 for none: host ints, or an int32/int64
tensor [N] on the inputs' device, which nothing reads back to the host, so a CUDA graph can capture the op and
refill the counts before each replay, as k3.serve.cuda_graphs' verification steps do) and the window as the layer's
projections give it, BEFORE the short conv: the window's conv must start from the conv tail after the pending
positions, a tail only this op computes, so the op runs the window's conv itself and hands the window's post-conv
q, k, v back (the caller keeps them, with z, beta logits and pre-conv, as the next cycle's pending inputs). Outputs
are the recurrence's o, before the output norm and gate (k3.ops.gate_norm), as the layer's forward has them.

* `kda_verify_replay` (the reference, every device): the gather of the conv tail after the pending positions, the
  window's short conv and SiLU from it, then the token recurrence (k3.ops.kda) over the pending positions (a row's
  positions past its count run as identity steps: no decay, no write) and over the window from the state after
  them. q and k are L2-normalized in fp32 and kept there, as the layer's forward does (k3.ops.kda_backend.kda_torch;
  fla in-kernel); k3.ops.kda_replay's reference rounds the unit key to the input dtype instead, one bf16 step.
* `kda_verify_replay_triton`: the same conv tail and window conv in PyTorch, then one Triton program per (row, head,
  block of BV value columns) holding its [K, BV] slice of the state in registers: it loops over the row's pending
  positions (their count read on the device) doing the key's L2 norm, the decay gate from z, A_log and dt_bias,
  sigmoid(beta), the decay and the delta-rule read and write; stores the slice once; then loops over the window
  doing the same plus the output read o_t = S_t^T (scale * q_t / |q_t|), on a register copy that is never stored.
  Validated: ``pytest -m gpu tests/ops/test_kda_verify_replay.py`` passed on an H100 (2026-12-06: fp32, bf16, and
  no read-back of the counts), so ``auto`` takes it on CUDA; ``TRITON_INTERPRET=1`` runs it on CPU tensors (the
  tests). The report's kernel also fuses the short conv, the input projections' norms and the output
  norm; the conv is a few elementwise passes over [N, T + W - 1, 3P] here.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops import kda as ref
from k3.ops.kda_replay import _conv_tail
from k3.ops.registry import Backends, Fast, Op, dispatch, register
from k3.tensors import to_device_async

__all__ = ["VerifyReplay", "kda_verify_replay", "kda_verify_replay_any", "kda_verify_replay_triton"]

# triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
tl = None
_SUM = None


class VerifyReplay(NamedTuple):
    """What `kda_verify_replay` returns. o: the window's outputs [N, T, H, V] in the inputs' dtype (before the output
    norm); q, k, v: the window's post-conv inputs [N, T, H, K] in the inputs' dtype (q, k not L2-normalized: the
    next cycle's pending inputs); state [N, H, K, V] fp32 and conv [N, 3, P, W-1] fp32: after the pending positions."""

    o: Tensor
    q: Tensor
    k: Tensor
    v: Tensor
    state: Tensor
    conv: Tensor


def _check(pk: Tensor, pv: Tensor, pz: Tensor, pbeta: Tensor, ppre: Tensor, lengths: list[int] | Tensor,
           wpre: Tensor, wz: Tensor, wbeta: Tensor, conv_weight: Tensor, state: Tensor, conv: Tensor) -> None:
    """Shapes and counts, each error naming the argument, what it got and what it needs."""
    if wz.dim() != 4:
        raise ValueError(f"window_z has shape {tuple(wz.shape)}, expected [N, T, H, K]")
    N, T, H, K = wz.shape
    P = pk.shape[1] if pk.dim() == 4 else -1
    C = H * K
    W = conv_weight.shape[-1] if conv_weight.dim() == 3 else 0
    want = {"pending_k": (pk, (N, P, H, K)), "pending_v": (pv, (N, P, H, K)), "pending_z": (pz, (N, P, H, K)),
            "pending_beta_logits": (pbeta, (N, P, H)), "pending_pre_conv": (ppre, (N, P, 3, C)),
            "window_pre_conv": (wpre, (N, T, 3, C)), "window_beta_logits": (wbeta, (N, T, H)),
            "conv_weight": (conv_weight, (3, C, W)), "state": (state, (N, H, K, K)), "conv": (conv, (N, 3, C, W - 1))}
    for name, (x, shape) in want.items():
        if P < 0 or W < 2 or tuple(x.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {list(shape)} (N={N} rows, P={max(P, 0)} "
                             f"pending and T={T} window positions, H={H} heads of K={K}, a conv of width >= 2; "
                             "pending_k is [N, P, H, K])")
    _check_lengths(lengths, N, P, wz.device)


def _check_lengths(lengths: list[int] | Tensor, N: int, P: int, device) -> None:
    """The pending counts: N host ints in [0, P], or an int32/int64 tensor [N] on `device` (then only its shape,
    dtype and device are checked: the values are never read back)."""
    if isinstance(lengths, Tensor):
        if tuple(lengths.shape) != (N,) or lengths.dtype not in (torch.int32, torch.int64) \
                or lengths.device != device:
            raise ValueError(f"pending_lengths is a {lengths.dtype} tensor of shape {tuple(lengths.shape)} on "
                             f"{lengths.device}: need an int32 or int64 tensor [{N}] on {device}, values in "
                             f"[0, {P}]")
    elif len(lengths) != N or not all(isinstance(n, int) and 0 <= n <= P for n in lengths):
        raise ValueError(f"pending_lengths={lengths}: need {N} ints in [0, {P}]")


def _lengths_on(lengths: list[int] | Tensor, dev, dtype: torch.dtype) -> Tensor:
    """The pending counts as a `dtype` tensor on `dev`: a device tensor as it is (cast on the device), host ints
    through pinned memory (a plain copy from host memory would wait for the device)."""
    if isinstance(lengths, Tensor):
        return lengths.to(dtype)
    return to_device_async(torch.tensor(lengths, dtype=dtype), dev)


def _window_conv(wpre: Tensor, conv_weight: Tensor, conv_p: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The window's q, k, v [N, T, H, K] (input dtype): its pre-conv inputs through the depthwise conv and SiLU from
    the tail `conv_p` [N, 3, P, W-1] (the three convs as one over 3P channels: the conv is per channel)."""
    N, T, _, C = wpre.shape
    W = conv_weight.shape[-1]
    y, _ = ref.short_conv(wpre.reshape(N, T, 3 * C), conv_weight.reshape(3 * C, W), conv_p.reshape(N, 3 * C, W - 1))
    return y.view(N, T, 3, C).unbind(2)


def kda_verify_replay(pending_k: Tensor, pending_v: Tensor, pending_z: Tensor, pending_beta_logits: Tensor,
                      pending_pre_conv: Tensor, pending_lengths: list[int] | Tensor, window_pre_conv: Tensor,
                      window_z: Tensor,
                      window_beta_logits: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
                      lower_bound: float, state: Tensor, conv: Tensor) -> VerifyReplay:
    """The first pending_lengths[b] pending positions of row b, then its T window positions, from the committed
    `state` and `conv` (the module docstring).

    pending_k, pending_v, pending_z: [N, P, H, K] (k, v after the short conv and SiLU, k not L2-normalized; z the decay
    logits before dt_bias); pending_beta_logits [N, P, H]; pending_pre_conv [N, P, 3, H*K] the q/k/v inputs of the
    short convs; pending_lengths: N host ints in [0, P], or an int32/int64 tensor [N] on the inputs' device (not
    read back: positions past a row's count are masked on the device). window_pre_conv [N, T, 3, H*K], window_z
    [N, T, H, K], window_beta_logits [N, T, H]: the window's projections. conv_weight [3, H*K, W]: the q, k, v conv
    weights. A_log [H], dt_bias [H*K], lower_bound: the gate's. state [N, H, K, K] fp32 and conv [N, 3, H*K, W-1] fp32
    (oldest first): the committed ones. Returns a `VerifyReplay`."""
    _check(pending_k, pending_v, pending_z, pending_beta_logits, pending_pre_conv, pending_lengths, window_pre_conv,
           window_z, window_beta_logits, conv_weight, state, conv)
    N, P = pending_k.shape[:2]
    dev = window_z.device
    n = _lengths_on(pending_lengths, dev, torch.long)
    conv_p = _conv_tail(conv, pending_pre_conv, n)
    state_p = state.float().clone()
    if P:
        live = (torch.arange(P, device=dev)[None] < n[:, None]).float()  # [N, P]
        g = ref.kda_gate(pending_z, A_log, dt_bias, lower_bound) * live[..., None, None]
        beta = torch.sigmoid(pending_beta_logits.float()) * live[..., None]
        k = ref.l2norm(pending_k.float())
        _, state_p = ref.kda_recurrent(k, k, pending_v, g, beta, initial_state=state_p)  # the outputs are not kept
    q, k, v = _window_conv(window_pre_conv, conv_weight, conv_p)
    N, T, H, K = window_z.shape
    q, k, v = q.view(N, T, H, K), k.view(N, T, H, K), v.view(N, T, H, K)
    g = ref.kda_gate(window_z, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(window_beta_logits.float())
    o, _ = ref.kda_recurrent(ref.l2norm(q.float()), ref.l2norm(k.float()), v, g, beta, initial_state=state_p)
    return VerifyReplay(o, q, k, v, state_p, conv_p)


# --- the fused kernel ----------------------------------------------------------------------------------------------
def _verify_replay_kernel(pk_ptr, pv_ptr, pz_ptr, pb_ptr, q_ptr, k_ptr, v_ptr, z_ptr, b_ptr, a_ptr, dtb_ptr, s_ptr,
                          s_out_ptr, o_ptr, len_ptr, lower_bound, scale, P, T, H, K: tl.constexpr, V,
                          K_PAD: tl.constexpr, BV: tl.constexpr):
    """Program (row n, head h, value block j): S[n, h, :, j] through the row's first len[n] pending positions (stored
    once), then through the T window positions writing o[n, :, h, j] (the state not stored)."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    cm = cols < V
    kk = tl.arange(0, K_PAD)
    km = kk < K
    m2 = km[:, None] & cm[None, :]
    soff = ((n * H + h) * K + kk)[:, None] * V + cols[None, :]
    S = tl.load(s_ptr + soff, mask=m2, other=0.0)
    A = tl.exp(tl.load(a_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h * K + kk, mask=km, other=0.0).to(tl.float32)
    length = tl.load(len_ptr + n)
    for t in range(0, length):
        base = (n * P + t) * H + h
        kt = tl.load(pk_ptr + base * K + kk, mask=km, other=0.0).to(tl.float32)
        kt = kt * tl.rsqrt(tl.reduce(kt * kt, 0, _SUM) + 1e-6)
        x = A * (tl.load(pz_ptr + base * K + kk, mask=km, other=0.0).to(tl.float32) + dtb)
        g = lower_bound * tl.where(x >= 0, 1.0 / (1.0 + tl.exp(-tl.abs(x))),
                                   tl.exp(-tl.abs(x)) / (1.0 + tl.exp(-tl.abs(x))))
        bl = tl.load(pb_ptr + base).to(tl.float32)
        beta = tl.where(bl >= 0, 1.0 / (1.0 + tl.exp(-tl.abs(bl))), tl.exp(-tl.abs(bl)) / (1.0 + tl.exp(-tl.abs(bl))))
        vt = tl.load(pv_ptr + base * V + cols, mask=cm, other=0.0).to(tl.float32)
        S = S * tl.exp(g)[:, None]
        kS = tl.reduce(kt[:, None] * S, 0, _SUM)  # [BV]
        S = S + kt[:, None] * (beta * (vt - kS))[None, :]
    tl.store(s_out_ptr + soff, S, mask=m2)  # the accepted positions' state: written once
    for t in range(0, T):  # the window: outputs only, its state stays in registers
        base = (n * T + t) * H + h
        qt = tl.load(q_ptr + base * K + kk, mask=km, other=0.0).to(tl.float32)
        qt = qt * tl.rsqrt(tl.reduce(qt * qt, 0, _SUM) + 1e-6) * scale
        kt = tl.load(k_ptr + base * K + kk, mask=km, other=0.0).to(tl.float32)
        kt = kt * tl.rsqrt(tl.reduce(kt * kt, 0, _SUM) + 1e-6)
        x = A * (tl.load(z_ptr + base * K + kk, mask=km, other=0.0).to(tl.float32) + dtb)
        g = lower_bound * tl.where(x >= 0, 1.0 / (1.0 + tl.exp(-tl.abs(x))),
                                   tl.exp(-tl.abs(x)) / (1.0 + tl.exp(-tl.abs(x))))
        bl = tl.load(b_ptr + base).to(tl.float32)
        beta = tl.where(bl >= 0, 1.0 / (1.0 + tl.exp(-tl.abs(bl))), tl.exp(-tl.abs(bl)) / (1.0 + tl.exp(-tl.abs(bl))))
        vt = tl.load(v_ptr + base * V + cols, mask=cm, other=0.0).to(tl.float32)
        S = S * tl.exp(g)[:, None]
        kS = tl.reduce(kt[:, None] * S, 0, _SUM)
        S = S + kt[:, None] * (beta * (vt - kS))[None, :]
        tl.store(o_ptr + base * V + cols, tl.reduce(qt[:, None] * S, 0, _SUM), mask=cm)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_verify_replay_kernel)


def kda_verify_replay_triton(pending_k: Tensor, pending_v: Tensor, pending_z: Tensor, pending_beta_logits: Tensor,
                             pending_pre_conv: Tensor, pending_lengths: list[int] | Tensor, window_pre_conv: Tensor,
                             window_z: Tensor, window_beta_logits: Tensor, conv_weight: Tensor, A_log: Tensor,
                             dt_bias: Tensor, lower_bound: float, state: Tensor, conv: Tensor) -> VerifyReplay:
    """`kda_verify_replay` with both recurrent loops in one fused Triton kernel (the module docstring); the same
    arguments and results."""
    _check(pending_k, pending_v, pending_z, pending_beta_logits, pending_pre_conv, pending_lengths, window_pre_conv,
           window_z, window_beta_logits, conv_weight, state, conv)
    if window_pre_conv.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the verify-replay kernel takes fp32 or bf16 inputs, got {window_pre_conv.dtype}")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the KDA verify-replay kernel cannot run: {why}")
    N, P = pending_k.shape[:2]
    _, T, H, K = window_z.shape
    dev = window_z.device
    n = _lengths_on(pending_lengths, dev, torch.int32).contiguous()  # the kernel reads each row's count itself
    conv_p = _conv_tail(conv, pending_pre_conv, n.long())
    q, k, v = (x.reshape(N, T, H, K) for x in _window_conv(window_pre_conv, conv_weight, conv_p))
    o = torch.empty(N, T, H, K, device=dev, dtype=v.dtype)
    state_p = torch.empty(N, H, K, K, device=dev, dtype=torch.float32)
    pending = (pending_k, pending_v, pending_z, pending_beta_logits)
    if P == 0:  # nothing pending in any row (every count is 0, so nothing is read): any valid pointers will do
        pending = (k, v, window_z, window_beta_logits)
    bv = min(32, 1 << (K - 1).bit_length())
    with torch.cuda.device(dev.index if window_z.is_cuda else -1):  # the tensors' GPU; -1: no-op
        _kernel(_triton.interpret())[(N, H, -(-K // bv))](
            *(x.contiguous() for x in pending), q.contiguous(), k.contiguous(), v.contiguous(), window_z.contiguous(),
            window_beta_logits.contiguous(), A_log.contiguous(), dt_bias.reshape(H, K).contiguous(),
            state.float().contiguous(), state_p, o, n, float(lower_bound), K ** -0.5, P, T, H, K=K, V=K,
            K_PAD=1 << (K - 1).bit_length(), BV=bv, num_warps=4)
    return VerifyReplay(o, q, k, v, state_p, conv_p)


register(Op(
    "kda_verify_replay", reference=kda_verify_replay,
    # validated: its GPU tests (tests/ops/test_kda_verify_replay.py, marked gpu) passed on an H100 (2026-12-06)
    fast=(Fast("triton", kda_verify_replay_triton, _triton.available, validated=True, cpu=True),),
    tolerance="state and outputs 1e-5 of their largest entry (fp32 sums of the K-term reads in another order; "
              "sigmoid from exponentials); bf16 outputs one bf16 step; the conv tail and the window's conv are the "
              "same PyTorch code, bit for bit"))


def kda_verify_replay_any(*args, backends: Backends | None = None) -> VerifyReplay:
    """`kda_verify_replay` on the implementation the registry picks for the inputs (op ``kda_verify_replay``)."""
    return dispatch("kda_verify_replay", args[6], backends).fn(*args)
