"""KDA rollback by replay (report §5.4.2): rebuild the recurrent state and the short-conv tail after an accepted
prefix of verified draft tokens from the committed state and the tokens' cached projected inputs.

Speculative verification runs the draft window through KDA from the committed state without writing the advanced
state back (it would include rejected drafts). It keeps, per position, the post-conv q, k, v, the decay logits z,
the beta logits and the pre-conv q/k/v inputs: far smaller than a state per position. Once n positions are
accepted, those n are run through the recurrence again from the committed state, and the result (state and conv
tail) is written back once. No per-position snapshots exist anywhere.

`kda_replay` is the PyTorch reference and runs everywhere (op ``kda_replay``; `kda_replay_any` dispatches).
`kda_replay_triton` is the fused form for the GPU: one program per (row, head, block of BV value columns) holds
its [K, BV] slice of the state in registers, loops over the row's accepted positions (its length read on the
device) doing per position the key's L2 normalization, the decay gate from z, A_log and dt_bias, sigmoid(beta),
the decay, the delta-rule read and write, and writes the slice back once: the state is read once and written
once, whatever the number of accepted tokens (no outputs are computed: the verification already produced them).
The conv tail is a gather of W - 1 inputs per channel, done in PyTorch. `kda_replay_layers_triton` runs G layers
in one launch (a program per (layer, row, head, value block), each layer under its own A_log and dt_bias), reading
the inputs through their strides: views of a verification's kept inputs of every layer side by side (the serving
engine's replay after a static-buffer verification and its flush of pending positions: one launch and one conv-tail
gather for all KDA layers instead of a dozen operations per layer). The report goes further and fuses the
replay into the next draft window's verification (short conv, norms, gate, recurrence and output norm in one
loop): op ``kda_verify_replay`` (k3.ops.kda_verify_replay) runs both recurrences in one kernel (the conv and the
output norm still outside it; used by the engine with ``--fused-replay``). This kernel is validated on an H200
(``auto`` takes it on CUDA): 0.21-0.35 ms for 1-64 requests of k3-mini's layer shape against the reference's 2.1-2.3 ms, but
only 8-12% of a state copy's bandwidth (BENCHMARKS.md; the report's fused verify-and-replay loop is the way to the
copy). ``TRITON_INTERPRET=1`` runs it on CPU tensors (the tests).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops import kda as ref
from k3.ops.registry import Backends, Fast, Op, dispatch, register
from k3.tensors import to_device_async

# triton.language and the sum combine function, bound on first use (k3.ops._triton.bind)
tl = None
_SUM = None


def kda_replay(q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, pre_conv: Tensor, A_log: Tensor,
               dt_bias: Tensor, lower_bound: float, state: Tensor, conv: Tensor,
               lengths: list[int]) -> tuple[Tensor, Tensor]:
    """Replay the first lengths[b] positions of row b from its committed state.

    q, k, v, z: [N, L, H, K] (q, k, v after the short conv and SiLU, q and k not yet L2-normalized; z the decay
    logits before dt_bias); beta_logits [N, L, H]; pre_conv [N, L, 3, P] the q/k/v inputs of the short convs;
    state [N, H, K, V] fp32 and conv [N, 3, P, W-1] fp32 (oldest first), the committed ones; lengths: N host ints
    in [1, L]. Returns (state [N, H, K, V] fp32, conv tails [N, 3, P, W-1] fp32) after each row's prefix: the
    token recurrence, equal to feeding those tokens one at a time (a row's positions past its length run as
    identity steps: no decay, no write)."""
    N, L = q.shape[:2]
    _check_lengths(lengths, N, L)
    dev = q.device
    n = to_device_async(torch.tensor(lengths), dev)  # a plain copy from host memory would wait for the device
    live = (torch.arange(L, device=dev)[None] < n[:, None]).float()  # [N, L]
    g = ref.kda_gate(z, A_log, dt_bias, lower_bound) * live[..., None, None]
    beta = torch.sigmoid(beta_logits.float()) * live[..., None]
    _, new_state = ref.kda_recurrent(ref.l2norm(q), ref.l2norm(k), v, g, beta, initial_state=state)
    return new_state, _conv_tail(conv, pre_conv, n)


def _check_lengths(lengths: list[int], N: int, L: int) -> None:
    if len(lengths) != N or not all(1 <= n <= L for n in lengths):
        raise ValueError(f"lengths={lengths}: need {N} values in [1, {L}]")


def _conv_tail(conv: Tensor, pre_conv: Tensor, n: Tensor) -> Tensor:
    """The conv tail after each row's first n[b] inputs: the last W-1 of [committed tail, those inputs]."""
    N, dev = conv.shape[0], conv.device
    D = conv.shape[-1]
    ext = torch.cat([conv.float(), pre_conv.float().permute(0, 2, 3, 1)], dim=-1)  # [N, 3, P, D + L]
    idx = (n[:, None] + torch.arange(D, device=dev)[None])[:, None, None, :].expand(N, 3, conv.shape[2], D)
    return ext.gather(-1, idx).contiguous()


# --- the fused replay kernel ---------------------------------------------------------------------------------------
def _replay_kernel(k_ptr, v_ptr, z_ptr, b_ptr, a_ptr, dtb_ptr, s_ptr, out_ptr, len_ptr, lower_bound, N, H,
                   s_kg, s_kn, s_kt, s_vg, s_vn, s_vt, s_zg, s_zn, s_zt, s_bg, s_bn, s_bt, s_ag, s_dg,
                   K: tl.constexpr, V, K_PAD: tl.constexpr, BV: tl.constexpr, ROUND_BF16: tl.constexpr):
    """Program (row r = layer g * N + request n, head h, value block j): S[r, h, :, j] through request n's first
    len[n] positions of layer g's inputs (k, z [G, N, L, H, K], v [G, N, L, H, V], beta [G, N, L, H], any strides
    over layers, requests and positions; a position's heads and their entries contiguous) under layer g's A_log
    [G, H] and dt_bias [G, H * K] (rows `s_ag`, `s_dg` apart)."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = r // N
    n = r % N
    cols = tl.program_id(2) * BV + tl.arange(0, BV)
    cm = cols < V
    kk = tl.arange(0, K_PAD)
    km = kk < K
    m2 = km[:, None] & cm[None, :]
    soff = ((r * H + h) * K + kk)[:, None] * V + cols[None, :]
    S = tl.load(s_ptr + soff, mask=m2, other=0.0)
    A = tl.exp(tl.load(a_ptr + g * s_ag + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + g * s_dg + h * K + kk, mask=km, other=0.0).to(tl.float32)
    length = tl.load(len_ptr + n)
    for t in range(0, length):
        kt = tl.load(k_ptr + g * s_kg + n * s_kn + t * s_kt + h * K + kk, mask=km, other=0.0).to(tl.float32)
        kt = kt * tl.rsqrt(tl.reduce(kt * kt, 0, _SUM) + 1e-6)
        if ROUND_BF16:  # the reference's l2norm returns the input's dtype
            kt = kt.to(tl.bfloat16).to(tl.float32)
        x = A * (tl.load(z_ptr + g * s_zg + n * s_zn + t * s_zt + h * K + kk, mask=km, other=0.0).to(tl.float32)
                 + dtb)
        sig = tl.where(x >= 0, 1.0 / (1.0 + tl.exp(-tl.abs(x))), tl.exp(-tl.abs(x)) / (1.0 + tl.exp(-tl.abs(x))))
        gt = lower_bound * sig
        bl = tl.load(b_ptr + g * s_bg + n * s_bn + t * s_bt + h).to(tl.float32)
        beta = tl.where(bl >= 0, 1.0 / (1.0 + tl.exp(-tl.abs(bl))), tl.exp(-tl.abs(bl)) / (1.0 + tl.exp(-tl.abs(bl))))
        vt = tl.load(v_ptr + g * s_vg + n * s_vn + t * s_vt + h * V + cols, mask=cm, other=0.0).to(tl.float32)
        S = S * tl.exp(gt)[:, None]
        kS = tl.reduce(kt[:, None] * S, 0, _SUM)  # [BV]
        S = S + kt[:, None] * (beta * (vt - kS))[None, :]
    tl.store(out_ptr + soff, S, mask=m2)


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_replay_kernel)


def _heads_packed(x: Tensor) -> Tensor:
    """x [..., H, D] with its last two dims packed (entry stride 1, head stride D), as the kernel reads a position;
    a copy only where they are not."""
    return x if x.stride(-1) == 1 and (x.shape[-2] == 1 or x.stride(-2) == x.shape[-1]) else x.contiguous()


def kda_replay_triton(q: Tensor, k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, pre_conv: Tensor,
                      A_log: Tensor, dt_bias: Tensor, lower_bound: float, state: Tensor, conv: Tensor,
                      lengths: list[int]) -> tuple[Tensor, Tensor]:
    """`kda_replay` with the recurrence in one fused Triton kernel (the module docstring); the same arguments and
    results. `q` is not read: the replay needs only the state. The inputs are read through their strides (views
    of a verification's kept inputs need no copy)."""
    return kda_replay_layers_triton(k[None], v[None], z[None], beta_logits[None], pre_conv[None], A_log[None],
                                    dt_bias.reshape(1, -1), lower_bound, state, conv, lengths)


def kda_replay_layers_triton(k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, pre_conv: Tensor,
                             A_log: Tensor, dt_bias: Tensor, lower_bound: float, state: Tensor, conv: Tensor,
                             lengths: list[int]) -> tuple[Tensor, Tensor]:
    """The replay of G KDA layers at once, one kernel launch for all of them (`kda_replay_layers`): k, z [G, N, L,
    H, K], v [G, N, L, H, V], beta_logits [G, N, L, H], pre_conv [G, N, L, 3, P] (any strides over layers, requests
    and positions: views of a verification's kept inputs); layer g's A_log [G, H] and dt_bias [G, H * K]; state
    [G * N, H, K, V] fp32 and conv [G * N, 3, P, W-1] fp32 (layer-major); lengths: N host ints in [1, L], the same
    for every layer. Returns (state [G * N, H, K, V] fp32, conv tails [G * N, 3, P, W-1] fp32)."""
    G, N, L, H, K = k.shape
    V = v.shape[-1]
    _check_lengths(lengths, N, L)
    if k.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the replay kernel takes fp32 or bf16 inputs, got {k.dtype}")
    if state.shape != (G * N, H, K, V) or A_log.shape != (G, H) or dt_bias.shape != (G, H * K):
        raise ValueError(f"kda_replay_layers: state {tuple(state.shape)}, A_log {tuple(A_log.shape)} and dt_bias "
                         f"{tuple(dt_bias.shape)} for G={G} layers of N={N} requests, H={H}, K={K}, V={V}: need "
                         f"[{G * N}, {H}, {K}, {V}], [{G}, {H}] and [{G}, {H * K}]")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the KDA replay kernel cannot run: {why}")
    dev = k.device
    n = to_device_async(torch.tensor(lengths, dtype=torch.int32), dev)  # without waiting for the device
    out = torch.empty(G * N, H, K, V, device=dev, dtype=torch.float32)
    k, v, z = _heads_packed(k), _heads_packed(v), _heads_packed(z)
    beta = beta_logits if beta_logits.stride(-1) == 1 else beta_logits.contiguous()
    A = A_log if A_log.stride(-1) == 1 else A_log.contiguous()
    dtb = dt_bias if dt_bias.stride(-1) == 1 else dt_bias.contiguous()
    bv = min(32, 1 << (V - 1).bit_length())
    with torch.cuda.device(dev.index if k.is_cuda else -1):  # the tensors' GPU; -1: no-op
        _kernel(_triton.interpret())[(G * N, H, -(-V // bv))](
            k, v, z, beta, A, dtb, state.float().contiguous(), out, n, float(lower_bound), N, H,
            *k.stride()[:3], *v.stride()[:3], *z.stride()[:3], *beta.stride()[:3], A.stride(0), dtb.stride(0),
            K=K, V=V, K_PAD=1 << (K - 1).bit_length(), BV=bv, ROUND_BF16=k.dtype == torch.bfloat16, num_warps=4)
    return out, _conv_tail(conv, pre_conv.flatten(0, 1), n.long().repeat(G))


def kda_replay_layers(k: Tensor, v: Tensor, z: Tensor, beta_logits: Tensor, pre_conv: Tensor, A_log: Tensor,
                      dt_bias: Tensor, lower_bound: float, state: Tensor, conv: Tensor,
                      lengths: list[int]) -> tuple[Tensor, Tensor]:
    """`kda_replay` of G layers (the shapes of `kda_replay_layers_triton`), layer by layer: its reference."""
    G, N = k.shape[:2]
    # q only shapes the outputs, which a replay does not compute: k stands in for it
    got = [kda_replay(k[g], k[g], v[g], z[g], beta_logits[g], pre_conv[g], A_log[g], dt_bias[g], lower_bound,
                      state[g * N:(g + 1) * N], conv[g * N:(g + 1) * N], lengths) for g in range(G)]
    return torch.cat([s for s, _ in got]), torch.cat([c for _, c in got])


register(Op(
    "kda_replay", reference=kda_replay,
    fast=(Fast("triton", kda_replay_triton, _triton.available, validated=True, cpu=True),),
    tolerance="state 1e-5 of its largest entry (fp32 sums of the K-term reads in another order; sigmoid from "
              "exponentials); the conv tail is the same gather, bit for bit"))


def kda_replay_layers_any(*args, backends: Backends | None = None) -> tuple[Tensor, Tensor]:
    """`kda_replay_layers` where op ``kda_replay`` runs its reference, `kda_replay_layers_triton` where it runs the
    kernel: G layers in one launch."""
    if dispatch("kda_replay", args[0], backends).name == "triton":
        return kda_replay_layers_triton(*args)
    return kda_replay_layers(*args)


def kda_replay_any(*args, backends: Backends | None = None) -> tuple[Tensor, Tensor]:
    """`kda_replay` on the implementation the registry picks for the inputs (op ``kda_replay``)."""
    return dispatch("kda_replay", args[1], backends).fn(*args)
