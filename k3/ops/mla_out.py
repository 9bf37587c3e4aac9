"""The steps between Gated MLA's decode attention and its output projection, one Triton kernel each (inference).

After the paged decode kernel (k3.ops.mla_decode) has the latent output o_lat [B, H, R] in fp32, a serving step
of a Gated MLA layer still runs

    o = bf16(einsum("bhr,hvr->bhv", o_lat, fp32(w_vc)))     the value absorption (op ``mla_absorb_v``)
    y = bf16(sigmoid(fp32(gate)) * fp32(o))                 the output gate (op ``mla_gate``)

which PyTorch computes as a cast of w_vc, the batched GEMM, a cast, then two casts, the sigmoid, the product and a
cast: about eight kernels per MLA layer and step. Here each line is one kernel with the same roundings (o rounded
to the activations' dtype once, then y once; fp32 products and sums inside):

* `mla_absorb_v_triton`: program (row b, head h, block of value columns) sums ``o_lat[b, h, r] * w_vc[h, v, r]``
  over r in fp32 (IEEE products, no TF32), reading w_vc through its strides (a view of ``kv_b_proj.weight``,
  k3.ops.mla.split_kv_b) in its own dtype;
* `mla_gate_triton`: program (row, block of columns) reads the gate through its row stride (a slice of the stacked
  projections' output) and o, and writes y;

and, where the decode cuts a request's tokens into splits, its combine kernel (the partials weighted by the softmax
of their log-sum-exps) runs before the absorption:

* `mla_combine_absorb_v_triton` (op ``mla_combine_absorb_v``): the absorption's kernel takes the split partials
  [B, S, H, R] and their lse [B, S, H] instead, and each program combines the partials of the block of latent
  columns it is about to multiply, with the combine kernel's fp32 operations per column: one kernel fewer per MLA
  layer and step (k3.ops.mla_decode.mla_decode_absorbed asks the registry for it);
* `mla_combine_absorb_v_gate_triton` (op ``mla_combine_absorb_v_gate``): the same kernel applying the output gate
  to the columns it writes (the absorbed value rounded once, then the gate's fp32 product rounded again, as the
  two kernels do): one more kernel fewer, where a serving step hands the gate to the attention
  (`MLALayerCache.attend_gated`).

None has a backward: the model calls them in forwards without gradients only (k3.model.gated_mla), through the
registry (ops ``mla_absorb_v``, ``mla_gate``, ``mla_combine_absorb_v`` and ``mla_combine_absorb_v_gate``), whose
references are the lines above written out.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from k3.ops import _triton
from k3.ops.registry import Backends, Fast, Op, dispatch, register

__all__ = ["combine_splits", "mla_absorb_v", "mla_absorb_v_any", "mla_absorb_v_triton", "mla_combine_absorb_v",
           "mla_combine_absorb_v_gate", "mla_combine_absorb_v_gate_triton", "mla_combine_absorb_v_triton", "mla_gate",
           "mla_gate_any", "mla_gate_triton"]

tl = None  # triton.language and the combine functions, bound on first use (k3.ops._triton.bind)
_SUM = None
_MAX = None


# --- references ----------------------------------------------------------------------------------------------------
def _check_absorb(o_lat: Tensor, w_vc: Tensor, dtype: torch.dtype) -> None:
    if not isinstance(o_lat, Tensor) or o_lat.ndim != 3 or o_lat.dtype != torch.float32:
        raise ValueError(f"o_lat must be an fp32 tensor [B, H, R], got "
                         f"{(tuple(o_lat.shape), o_lat.dtype) if isinstance(o_lat, Tensor) else type(o_lat).__name__}")
    _, H, R = o_lat.shape
    if not isinstance(w_vc, Tensor) or w_vc.ndim != 3 or w_vc.shape[0] != H or w_vc.shape[2] != R \
            or not w_vc.dtype.is_floating_point:
        raise ValueError(f"w_vc must be a floating tensor [H={H}, Dv, R={R}], got "
                         f"{tuple(w_vc.shape) if isinstance(w_vc, Tensor) else type(w_vc).__name__}")
    if not dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating dtype, got {dtype}")


def mla_absorb_v(o_lat: Tensor, w_vc: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The value absorption of the latent decode output: o [B, H, Dv] = o_lat [B, H, R] (fp32) times w_vc [H, Dv, R]
    per head, in fp32, rounded to `out_dtype`."""
    _check_absorb(o_lat, w_vc, out_dtype)
    return torch.einsum("bhr,hvr->bhv", o_lat, w_vc.float()).to(out_dtype)


def _check_gate(gate: Tensor, o: Tensor) -> None:
    if not isinstance(gate, Tensor) or not isinstance(o, Tensor) or gate.shape != o.shape \
            or not gate.dtype.is_floating_point or not o.dtype.is_floating_point:
        raise ValueError(f"gate and o must be floating tensors of one shape, got "
                         f"{getattr(gate, 'shape', type(gate).__name__)} and {getattr(o, 'shape', type(o).__name__)}")


def mla_gate(gate: Tensor, o: Tensor, out_dtype: torch.dtype) -> Tensor:
    """Gated MLA's output gate: sigmoid(gate) * o in fp32, rounded to `out_dtype` (gate and o of one shape)."""
    _check_gate(gate, o)
    return (torch.sigmoid(gate.float()) * o.float()).to(out_dtype)


# --- kernels -------------------------------------------------------------------------------------------------------
def _absorb_kernel(o_ptr, w_ptr, y_ptr, H, R, DV, s_ob, s_oh, s_wh, s_wv, s_yb, s_yh, lse_ptr, S, s_os, s_lb, s_ls,
                   s_lh, g_ptr, s_gb, BV: tl.constexpr, BR: tl.constexpr, COMBINE: tl.constexpr,
                   BLOCK_S: tl.constexpr, GATE: tl.constexpr):
    """Program (row b, head h, block of BV value columns). COMBINE: o_ptr holds the paged decode's S split partials
    [B, S, H, R] (split stride s_os) and lse_ptr their base-2 log-sum-exps [B, S, H]; the latent output is their
    combine, as k3.ops.mla_decode's combine kernel computes it, made here for each block of R it multiplies. GATE:
    the output gate too (g_ptr [B, H * DV], row stride s_gb): the absorbed value rounded to y's dtype, then
    sigmoid(gate) times it in fp32, rounded again, as the gate kernel computes it from the rounded output."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    vs = tl.program_id(2) * BV + tl.arange(0, BV)
    vm = vs < DV
    acc = vs * 0.0
    if COMBINE:  # the splits' weights softmax_s(lse) in base 2; empty splits (-inf) weigh 0, all empty: o = 0
        ss = tl.arange(0, BLOCK_S)
        sm = ss < S
        lse = tl.load(lse_ptr + b * s_lb + ss * s_ls + h * s_lh, mask=sm, other=float("-inf"))
        big = tl.reduce(lse, 0, _MAX)
        big = tl.where(big == float("-inf"), 0.0, big)
        wt = tl.exp2(lse - big)
        total = tl.reduce(wt, 0, _SUM)
        wt = wt / tl.where(total > 0.0, total, 1.0)
    for r0 in range(0, R, BR):
        rs = r0 + tl.arange(0, BR)
        rm = rs < R
        if COMBINE:
            part = tl.load(o_ptr + b * s_ob + ss[:, None] * s_os + h * s_oh + rs[None, :],
                           mask=sm[:, None] & rm[None, :], other=0.0)
            o = tl.reduce(wt[:, None] * part, 0, _SUM)
        else:
            o = tl.load(o_ptr + b * s_ob + h * s_oh + rs, mask=rm, other=0.0)
        w = tl.load(w_ptr + h * s_wh + vs[:, None] * s_wv + rs[None, :], mask=vm[:, None] & rm[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.reduce(w * o[None, :], 1, _SUM)
    if GATE:
        g = tl.load(g_ptr + b * s_gb + h * DV + vs, mask=vm, other=0.0).to(tl.float32)
        e = tl.exp(-tl.abs(g))
        sig = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
        acc = sig * acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + b * s_yb + h * s_yh + vs, acc.to(y_ptr.dtype.element_ty), mask=vm)


def _gate_kernel(g_ptr, o_ptr, y_ptr, C, s_g, s_o, s_y, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    g = tl.load(g_ptr + r * s_g + cols, mask=m, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + r * s_o + cols, mask=m, other=0.0).to(tl.float32)
    e = tl.exp(-tl.abs(g))  # the sigmoid from exp(-|g|) <= 1: no overflow at either end
    sig = tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(y_ptr + r * s_y + cols, (sig * o).to(y_ptr.dtype.element_ty), mask=m)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):
    import triton

    _triton.bind(globals())
    return triton.jit(_absorb_kernel), triton.jit(_gate_kernel)


def _runnable(what: str, *tensors: Tensor) -> None:
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"the {what} kernel has no backward: call it without gradients (inference forwards)")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the {what} kernel cannot run: {why}")


def mla_absorb_v_triton(o_lat: Tensor, w_vc: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`mla_absorb_v` as one Triton kernel (the module docstring). Forward only."""
    _check_absorb(o_lat, w_vc, out_dtype)
    _runnable("value absorption", o_lat, w_vc)
    return _absorb(o_lat.unsqueeze(1), None, w_vc, out_dtype)


def _absorb(part: Tensor, lse: Tensor | None, w_vc: Tensor, out_dtype: torch.dtype,
            gate: Tensor | None = None) -> Tensor:
    """The absorption kernel over part [B, S, H, R] fp32: S = 1 and no lse, the latent output itself; else split
    partials combined by their lse [B, S, H]. `gate` [B, H * Dv]: the output gate applied too."""
    B, S, H, R = part.shape
    Dv = w_vc.shape[1]
    if part.stride(3) != 1:
        part = part.contiguous()
    if w_vc.stride(2) != 1:
        w_vc = w_vc.contiguous()
    y = torch.empty(B, H, Dv, device=part.device, dtype=out_dtype)
    combine = lse is not None
    block_s = 1 << max(S - 1, 0).bit_length()
    bv = min(64, 1 << max(Dv - 1, 1).bit_length())
    # a [splits, columns] tile of partials per step when combining (as the decode's own combine holds at most)
    br = min(128, 1 << max(R - 1, 1).bit_length(), max(16, 8192 // block_s) if combine else 128)
    ls = lse.stride() if combine else (0, 0, 0)
    if gate is not None and gate.stride(-1) != 1:
        gate = gate.contiguous()
    if B:
        with torch.cuda.device(part.device.index if part.is_cuda else -1):
            _kernels(_triton.interpret())[0][(B, H, -(-Dv // bv))](
                part, w_vc, y, H, R, Dv, part.stride(0), part.stride(2), w_vc.stride(0), w_vc.stride(1),
                y.stride(0), y.stride(1), lse if combine else part, S, part.stride(1), *ls,
                part if gate is None else gate, 0 if gate is None else gate.stride(0), BV=bv, BR=br,
                COMBINE=combine, BLOCK_S=block_s, GATE=gate is not None, num_warps=4)
    return y


def _check_partials(part: Tensor, lse: Tensor | None, w_vc: Tensor, dtype: torch.dtype) -> None:
    if not isinstance(part, Tensor) or part.ndim != 4 or part.dtype != torch.float32:
        raise ValueError(f"part must be an fp32 tensor [B, S, H, R], got "
                         f"{(tuple(part.shape), part.dtype) if isinstance(part, Tensor) else type(part).__name__}")
    B, S, H, R = part.shape
    if lse is None and S != 1:
        raise ValueError(f"{S} split partials need their lse [B, S, H] (None only for one split)")
    if lse is not None and (not isinstance(lse, Tensor) or lse.shape != (B, S, H) or lse.dtype != torch.float32):
        raise ValueError(f"lse must be an fp32 tensor [B={B}, S={S}, H={H}], got "
                         f"{(tuple(lse.shape), lse.dtype) if isinstance(lse, Tensor) else type(lse).__name__}")
    _check_absorb(part[:, 0], w_vc, dtype)


def combine_splits(part: Tensor, lse: Tensor | None) -> Tensor:
    """The paged decode's latent output [B, H, R] from its split partials part [B, S, H, R] and their base-2
    log-sum-exps lse [B, S, H] (None: one split, the output itself): sum_s softmax_s(lse) part_s in fp32, empty
    splits (-inf) weighing 0 and a row with every split empty giving 0 (k3.ops.mla_decode's combine)."""
    if lse is None:
        return part[:, 0]
    big = lse.amax(1, keepdim=True)
    big = torch.where(big == float("-inf"), torch.zeros_like(big), big)
    w = torch.exp2(lse - big)
    total = w.sum(1, keepdim=True)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    return torch.einsum("bsh,bshr->bhr", w, part)


def mla_combine_absorb_v(part: Tensor, lse: Tensor | None, w_vc: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The definition (op ``mla_combine_absorb_v``): the split partials combined (`combine_splits`), then the value
    absorption (`mla_absorb_v`): o [B, H, Dv] in `out_dtype`."""
    _check_partials(part, lse, w_vc, out_dtype)
    return mla_absorb_v(combine_splits(part, lse), w_vc, out_dtype)


def mla_combine_absorb_v_triton(part: Tensor, lse: Tensor | None, w_vc: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`mla_combine_absorb_v` as one kernel: each absorption program combines the partials of the latent columns it
    multiplies (the module docstring). Forward only."""
    _check_partials(part, lse, w_vc, out_dtype)
    _runnable("value absorption", part, w_vc)
    return _absorb(part, lse, w_vc, out_dtype)


def _check_gated(part: Tensor, lse: Tensor | None, w_vc: Tensor, gate: Tensor, dtype: torch.dtype) -> None:
    _check_partials(part, lse, w_vc, dtype)
    B, _, H, _ = part.shape
    C = H * w_vc.shape[1]
    if not isinstance(gate, Tensor) or gate.shape != (B, C) or not gate.dtype.is_floating_point:
        raise ValueError(f"gate must be a floating tensor [B={B}, H * Dv={C}], got "
                         f"{tuple(gate.shape) if isinstance(gate, Tensor) else type(gate).__name__}")


def mla_combine_absorb_v_gate(part: Tensor, lse: Tensor | None, w_vc: Tensor, gate: Tensor,
                              out_dtype: torch.dtype) -> Tensor:
    """The definition (op ``mla_combine_absorb_v_gate``): `mla_combine_absorb_v`, then the output gate (`mla_gate`)
    with gate [B, H * Dv] (a row-strided slice of the stacked projections' output): y [B, H, Dv] in `out_dtype`."""
    _check_gated(part, lse, w_vc, gate, out_dtype)
    o = mla_combine_absorb_v(part, lse, w_vc, out_dtype)
    return mla_gate(gate, o.reshape(gate.shape), out_dtype).view(o.shape)


def mla_combine_absorb_v_gate_triton(part: Tensor, lse: Tensor | None, w_vc: Tensor, gate: Tensor,
                                     out_dtype: torch.dtype) -> Tensor:
    """`mla_combine_absorb_v_gate` as one kernel: the absorption's programs apply the gate to the columns they
    write (the module docstring). Forward only."""
    _check_gated(part, lse, w_vc, gate, out_dtype)
    _runnable("value absorption", part, w_vc, gate)
    return _absorb(part, lse, w_vc, out_dtype, gate)


def mla_gate_triton(gate: Tensor, o: Tensor, out_dtype: torch.dtype) -> Tensor:
    """`mla_gate` as one Triton kernel (the module docstring). Forward only."""
    _check_gate(gate, o)
    _runnable("output gate", gate, o)
    C = gate.shape[-1]
    g2, o2 = gate.reshape(-1, C), o.reshape(-1, C)  # a row-strided gate (a slice of the stacked output) stays a view
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if o2.stride(-1) != 1:
        o2 = o2.contiguous()
    y = torch.empty(gate.shape, device=gate.device, dtype=out_dtype)
    n = g2.shape[0]
    block = min(1024, 1 << max(C - 1, 1).bit_length())
    if n:
        with torch.cuda.device(gate.device.index if gate.is_cuda else -1):
            _kernels(_triton.interpret())[1][(n, -(-C // block))](g2, o2, y, C, g2.stride(0), o2.stride(0), C,
                                                                 BLOCK=block, num_warps=4)
    return y


register(Op(
    "mla_absorb_v", reference=mla_absorb_v,
    # validated: its GPU tests (tests/ops/test_mla_out.py, marked gpu) passed on an H100 (2026-12-06)
    fast=(Fast("triton", mla_absorb_v_triton, _triton.available, validated=True, cpu=True),),
    tolerance="fp32 outputs 1e-5 of the largest entry (the same fp32 products summed in another order); bf16 one "
              "bf16 step (the same fp32 sum rounded once), two in the interpreter (it truncates)"))

register(Op(
    "mla_combine_absorb_v", reference=mla_combine_absorb_v,
    # validated: its GPU tests (tests/ops/test_mla_out.py, marked gpu) passed on an H100 (2026-12-07)
    fast=(Fast("triton", mla_combine_absorb_v_triton, _triton.available, validated=True, cpu=True),),
    tolerance="the latent output combined as the decode's combine kernel combines it (the same fp32 operations per "
              "column), then absorbed as mla_absorb_v: fp32 1e-5 of the largest entry, bf16 one bf16 step (two in "
              "the interpreter, which truncates)"))

register(Op(
    "mla_combine_absorb_v_gate", reference=mla_combine_absorb_v_gate,
    # validated: its GPU tests (tests/ops/test_mla_out.py, marked gpu) passed on an H100 (2026-12-08)
    fast=(Fast("triton", mla_combine_absorb_v_gate_triton, _triton.available, validated=True, cpu=True),),
    tolerance="the combine-absorption kernel's output rounded to the activations' dtype, then the gate kernel's "
              "fp32 sigmoid product rounded once: equal to the two kernels run one after the other (the same "
              "operations), fp32 1e-5 / bf16 two bf16 steps of the largest entry against the reference"))

register(Op(
    "mla_gate", reference=mla_gate,
    # validated: its GPU tests (tests/ops/test_mla_out.py, marked gpu) passed on an H100 (2026-12-06)
    fast=(Fast("triton", mla_gate_triton, _triton.available, validated=True, cpu=True),),
    tolerance="fp32 1e-6 relative (the sigmoid from one exponential of -|gate|); bf16 one bf16 step (the same fp32 "
              "product up to the sigmoid's last bit, rounded once), two in the interpreter (it truncates)"))


def mla_absorb_v_any(o_lat: Tensor, w_vc: Tensor, out_dtype: torch.dtype, backends: Backends | None = None) -> Tensor:
    """`mla_absorb_v` on the implementation the registry picks (op ``mla_absorb_v``)."""
    return dispatch("mla_absorb_v", o_lat, backends).fn(o_lat, w_vc, out_dtype)


def mla_gate_any(gate: Tensor, o: Tensor, out_dtype: torch.dtype, backends: Backends | None = None) -> Tensor:
    """`mla_gate` on the implementation the registry picks (op ``mla_gate``) in forwards without gradients; the
    reference (differentiable) otherwise."""
    if torch.is_grad_enabled() and (gate.requires_grad or o.requires_grad):
        return mla_gate(gate, o, out_dtype)
    return dispatch("mla_gate", gate, backends).fn(gate, o, out_dtype)
