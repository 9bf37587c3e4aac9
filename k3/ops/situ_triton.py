"""Fused SiTU-GLU Triton kernels (forward and backward) for GPU training.

The reference, :func:`k3.ops.situ.situ_glu`, computes

    y = [beta1 * tanh(g / beta1) * sigmoid(g)] * [beta2 * tanh(u / beta2)]

as a chain of eager ops (upcasts, three transcendentals, several multiplies), each reading and writing a
full [N, F] tensor, and autograd keeps several of those intermediates for the backward pass. The activation
is elementwise, so its cost is memory traffic, and fusing it removes all but the essential traffic:

* forward: one kernel reads gate and up once (bf16/fp16/fp32), computes in fp32 in registers and writes y
  once: 2F elements read + F written per row.
* backward: one kernel reads gate, up and dy, recomputes the activations in fp32 (only the input is saved
  for backward) and writes d(gate) and d(up): 3F read + 2F written.

:func:`situ_glu_fused` takes the [N, 2F] output of one grouped GEMM against the concatenated [w1; w3]
weights (gate columns first) and writes its gradient as one [N, 2F] tensor, so neither pass needs a
split/cat copy. :func:`situ_glu_split` is the same math for separate gate and up tensors. Both run one
kernel (a forward and a backward specialization) that takes a pointer and a row stride per operand; columns
must be unit-stride. Row offsets are int64, so N * 2F may exceed 2^31.

With t1 = tanh(g / b1), s = sigmoid(g), t2 = tanh(u / b2), A = b1*t1*s, B = b2*t2:

    dA/dg = (1 - t1^2) * s + A * (1 - s),   dB/du = 1 - t2^2
    dg = dy * B * dA/dg,                    du = dy * A * dB/du

Numerics. Triton has no portable tanh (``libdevice.tanh`` exists on CUDA, not in the interpreter), so the
kernel builds everything from exponentials of non-positive numbers, which cannot overflow:
e = exp(-2|x|) gives tanh x = sign(x) (1 - e) / (1 + e) and 1 - tanh^2 x = 4e / (1 + e)^2, with the series
x - x^3/3 + 2x^5/15 below |x| = 0.1 where 1 - e cancels; en = exp(-|g|) gives sigmoid(g) and 1 - sigmoid(g)
without cancellation on either side. Outputs agree with a float64 evaluation to ~1e-6 relative (a few
times that where sigmoid(g) < 1e-20 and the rounding of exp's argument dominates; and excepting the
gradient near dA/dg = 0, where its two terms cancel in any fp32 evaluation). Unlike the eager fp32
reference, the gradient does not lose accuracy to 1 - t^2 and 1 - s cancelling at large |x|.

Speed. Written naively (a division per tanh and per sigmoid), the kernel is limited by arithmetic, not memory;
it therefore takes one reciprocal per element, of (1 + e1)(1 + e2)(1 + en), every factor in [1, 2]. Compiled for
CUDA that reciprocal is PTX's rcp.approx.ftz.f32 (at most 1 ulp off; the product lies in [1, 8], so flushing
denormals never applies), one instruction where an IEEE or full-range division compiles to eight with their range
checks (``benchmarks/situ_sass.py`` counts the instructions offline; BENCHMARKS.md). Triton's interpreter divides.
On a GPU the tile (2K-8K elements) and warp count are autotuned per shape class (``autotune=False``, or
``Backends(situ_autotune=False)`` through k3.ops.situ: a fixed 4K-element tile, 8 warps). ``benchmarks/situ_bench.py``
measures it against the copy bandwidth.

Triton is imported lazily (k3.ops._triton): this module imports on a CPU-only machine without Triton, and
``k3.ops._triton.runnable`` says whether the kernels can run. ``TRITON_INTERPRET=1`` runs them on CPU tensors in
Triton's interpreter (for tests); the flag is read at each call.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from k3.ops import _triton

__all__ = ["situ_glu_fused", "situ_glu_split"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_BLOCK_F = 1024  # columns per program
_TILE = 4096  # elements per program (BLOCK_N * BLOCK_F when the rows allow it) without autotuning
_NUM_WARPS = 8
# On GPU the tile and warp count are autotuned per (columns, rows bucket, pass, dtypes) among these (Triton keeps
# the results on disk with TRITON_CACHE_AUTOTUNING=1, which k3 sets); autotune=False keeps the fixed choice.
_TUNE_TILES = (2048, 4096, 8192)
_TUNE_WARPS = (4, 8, 16)

tl = None  # triton.language, bound by _kernel() on first use (k3.ops._triton.bind)


def _situ_glu_kernel(g_ptr, u_ptr, y_ptr, dy_ptr, dg_ptr, du_ptr, n_rows, n_cols,
                     stride_g, stride_u, stride_y, stride_dy, stride_dg, stride_du,
                     beta1, beta2, inv_beta1, inv_beta2, rows_log2,
                     BACKWARD: tl.constexpr, TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_F: tl.constexpr,
                     APPROX_RCP: tl.constexpr):
    """One [BLOCK_N, BLOCK_F] tile of y = situ_glu(g, u) (forward: y_ptr set, the d*_ptr None) or of
    (dg, du) from dy (BACKWARD: y_ptr None). Row offsets are int64; columns are unit-stride. `rows_log2` and TILE
    (= BLOCK_N * BLOCK_F, the autotuned size) only key the autotuning. APPROX_RCP (compiled for CUDA): the one
    reciprocal per element by PTX's rcp.approx.ftz.f32, else an IEEE division (the interpreter)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows = rows.to(tl.int64)[:, None]
    cols = cols[None, :]
    g = tl.load(g_ptr + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows * stride_u + cols, mask=mask, other=0.0).to(tl.float32)

    # The tanh arguments x = (g / beta1, u / beta2), joined to write the tanh formulas once. Every exp is of a
    # non-positive number (nothing overflows): e = exp(-2|x|) for tanh, en = exp(-|g|) for the sigmoid.
    x = tl.join(g * inv_beta1, u * inv_beta2)
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # -2 log2(e)
    en = tl.exp2(tl.abs(g) * -1.4426950408889634)
    p = 1.0 + e
    q = 1.0 + en
    p1, p2 = tl.split(p)
    # tanh x = sign(x) (1 - e) / p, and below |x| = 0.1, where 1 - e cancels, the series x - x^3/3 + 2x^5/15
    # (truncation < 6e-8 relative). sigmoid(g) = sn / q.
    small = tl.abs(x) < 0.1
    x2 = x * x
    series = x + x * x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0))
    signed = tl.where(x < 0.0, e - 1.0, 1.0 - e)
    pos = g >= 0.0
    sn = tl.where(pos, 1.0, en)
    # The one reciprocal per element, of p1 p2 q (see the module docstring, Speed).
    p12 = p1 * p2
    if APPROX_RCP:
        rcp = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [p12 * q], dtype=tl.float32,
                                        is_pure=True, pack=1)
    else:
        rcp = 1.0 / (p12 * q)
    if BACKWARD:
        dy = tl.load(dy_ptr + rows * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rcp_q = rcp * q
        r = tl.join(rcp_q * p2, rcp_q * p1)  # 1 / p
        rq = rcp * p12  # 1 / q
        t = tl.where(small, series, signed * r)
        t1, t2 = tl.split(t)
        s = sn * rq
        a = beta1 * t1 * s
        b = beta2 * t2
        # 1 - sigmoid and 1 - tanh^2 = 4e / p^2 without cancellation as sigmoid -> 1 and tanh -> +-1.
        one_minus_s = tl.where(pos, en, 1.0) * rq
        sech2_1, sech2_2 = tl.split(tl.where(small, 1.0 - t * t, 4.0 * e * r * r))
        da = sech2_1 * s + a * one_minus_s  # b1*t1*s*(1-s) = A*(1-s)
        tl.store(dg_ptr + rows * stride_dg + cols, (dy * b * da).to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + rows * stride_du + cols, (dy * a * sech2_2).to(du_ptr.dtype.element_ty), mask=mask)
    else:
        n1, n2 = tl.split(tl.where(small, series * p, signed))  # tanh * p
        y = (beta1 * beta2) * (n1 * n2 * sn) * rcp
        tl.store(y_ptr + rows * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernel(interpret: bool, tune: bool):
    """The jitted kernel. ``triton.jit`` picks compiled or interpreted when it wraps the function, so there is
    one per interpreter setting (``interpret`` is part of the cache key). With `tune`, wrapped in
    ``triton.autotune`` over the tile sizes and warp counts of _TUNE_TILES x _TUNE_WARPS; every config writes the
    same outputs from the same inputs, so the timing runs leave nothing behind."""
    import triton

    _triton.bind(globals())
    kernel = triton.jit(_situ_glu_kernel)
    if not tune:
        return kernel
    configs = [triton.Config({"TILE": t}, num_warps=w) for t in _TUNE_TILES for w in _TUNE_WARPS]
    rows_per_tile = triton.heuristics({"BLOCK_N": lambda a: a["TILE"] // a["BLOCK_F"]})
    tuned = triton.autotune(configs, key=["n_cols", "rows_log2", "BACKWARD"], do_bench=_triton.bench)
    return tuned(rows_per_tile(kernel))


def _launch(g: Tensor, u: Tensor, beta1: float, beta2: float, *, y: Tensor | None = None,
            dy: Tensor | None = None, dg: Tensor | None = None, du: Tensor | None = None,
            tune: bool | None = None) -> None:
    """Forward (y given) or backward (dy, dg, du given) over [rows, cols] tensors with unit column stride.
    `tune`: through the autotuner (default: when compiled, not in the interpreter)."""
    n_rows, n_cols = g.shape
    if n_rows == 0 or n_cols == 0:
        return
    block_f = min(1 << (n_cols - 1).bit_length(), _MAX_BLOCK_F)
    rows_log2 = (n_rows - 1).bit_length()  # n_rows <= 2^rows_log2
    tensors = (g, u, y, dy, dg, du)
    strides = (0 if t is None else t.stride(0) for t in tensors)
    args = (*tensors, n_rows, n_cols, *strides, beta1, beta2, 1.0 / beta1, 1.0 / beta2, rows_log2)
    interpret = _triton.interpret()
    approx = not interpret and torch.version.hip is None  # PTX's reciprocal: compiled for CUDA only
    if tune is None:
        tune = not interpret
    with torch.cuda.device(g.device.index if g.is_cuda else -1):  # launch on the tensors' GPU; -1: no-op
        if tune:
            grid = lambda meta: (-(-n_rows // (meta["TILE"] // block_f)), -(-n_cols // block_f))  # noqa: E731
            _kernel(interpret, True)[grid](*args, BACKWARD=y is None, BLOCK_F=block_f, APPROX_RCP=approx)
        else:
            # a tile of at most _TILE elements, no taller than the rows
            tile = block_f * max(1, min(1 << rows_log2, _TILE // block_f))
            grid = (-(-n_rows // (tile // block_f)), -(-n_cols // block_f))
            _kernel(interpret, False)[grid](*args, BACKWARD=y is None, TILE=tile, BLOCK_N=tile // block_f,
                                            BLOCK_F=block_f, APPROX_RCP=approx, num_warps=_NUM_WARPS)


def _rows(x: Tensor, n_cols: int) -> Tensor:
    """x as [rows, n_cols] with unit column stride (a view when possible)."""
    x = x.reshape(math.prod(x.shape[:-1]), n_cols)
    return x if x.stride(1) == 1 else x.contiguous()


class _SituGLUFused(torch.autograd.Function):
    """h13 [N, 2F] -> y [N, F]; saves only h13."""

    @staticmethod
    def forward(ctx, h13: Tensor, beta1: float, beta2: float, tune: bool | None) -> Tensor:
        F = h13.shape[1] // 2
        y = h13.new_empty(h13.shape[0], F)
        _launch(h13[:, :F], h13[:, F:], beta1, beta2, y=y, tune=tune)
        ctx.save_for_backward(h13)
        ctx.betas, ctx.tune = (beta1, beta2), tune
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        (h13,) = ctx.saved_tensors
        F = h13.shape[1] // 2
        dh13 = h13.new_empty(h13.shape)
        _launch(h13[:, :F], h13[:, F:], *ctx.betas, dy=_rows(dy, F), dg=dh13[:, :F], du=dh13[:, F:], tune=ctx.tune)
        return dh13, None, None, None


class _SituGLUSplit(torch.autograd.Function):
    """gate, up [N, F] -> y [N, F] in gate.dtype; saves gate and up."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor, beta1: float, beta2: float, tune: bool | None) -> Tensor:
        y = gate.new_empty(gate.shape)
        _launch(gate, up, beta1, beta2, y=y, tune=tune)
        ctx.save_for_backward(gate, up)
        ctx.betas, ctx.tune = (beta1, beta2), tune
        return y

    @staticmethod
    def backward(ctx, dy: Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = gate.new_empty(gate.shape), up.new_empty(up.shape)
        _launch(gate, up, *ctx.betas, dy=_rows(dy, gate.shape[1]), dg=dgate, du=dup, tune=ctx.tune)
        return ((dgate if ctx.needs_input_grad[0] else None), (dup if ctx.needs_input_grad[1] else None),
                None, None, None)


def _check_tensor(x: Tensor, name: str) -> None:
    if not torch.is_floating_point(x):
        raise ValueError(f"{name} must be a floating tensor, got dtype {x.dtype}")
    if x.dtype not in _DTYPES:
        raise ValueError(f"{name} must be bfloat16, float16 or float32 for the Triton kernels, got {x.dtype} "
                         "(k3.ops.situ.situ_glu handles float64)")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension, got a scalar")


def _check_runnable(x: Tensor, beta1: float, beta2: float) -> None:
    if not beta1 > 0:
        raise ValueError(f"beta1 must be > 0, got {beta1}")
    if not beta2 > 0:
        raise ValueError(f"beta2 must be > 0, got {beta2}")
    ok, why = _triton.runnable()
    if not ok:
        raise RuntimeError(f"the SiTU-GLU Triton kernels cannot run: {why}")
    if x.device.type != "cuda" and not _triton.interpret():
        raise ValueError(
            f"the SiTU-GLU Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got device {x.device}"
        )


def situ_glu_fused(h13: Tensor, beta1: float = 4.0, beta2: float = 25.0, autotune: bool = True) -> Tensor:
    """SiTU-GLU of a concatenated projection: ``situ_glu(h13[..., :F], h13[..., F:], beta1, beta2)``.

    Args:
        h13: [..., 2F] bf16/fp16/fp32, gate in the first F columns and up in the last F (the output of one
            GEMM against concatenated [w1; w3]). Rows may be strided; columns are made unit-stride if not.
        beta1: soft cap of the gate branch (> 0).
        beta2: soft cap of the up branch (> 0).
        autotune: pick the tile and warps by measurement per shape class (compiled kernels); False: a fixed tile.

    Returns:
        [..., F] in ``h13.dtype``, computed in fp32. Differentiable: the backward writes d(h13) as one
        [..., 2F] tensor, recomputing the activations from h13 (the only tensor saved).
    """
    _check_tensor(h13, "h13")
    if h13.shape[-1] % 2:
        raise ValueError(f"h13's last dimension must be even ([gate | up], 2F columns), got {h13.shape[-1]}")
    _check_runnable(h13, beta1, beta2)
    two_f = h13.shape[-1]
    y = _SituGLUFused.apply(_rows(h13, two_f), float(beta1), float(beta2), None if autotune else False)
    return y.reshape(*h13.shape[:-1], two_f // 2)


def situ_glu_split(gate: Tensor, up: Tensor, beta1: float = 4.0, beta2: float = 25.0,
                    autotune: bool = True) -> Tensor:
    """SiTU-GLU of separate gate and up tensors: the fused kernels' version of :func:`k3.ops.situ.situ_glu`.

    Args:
        gate: [..., F] bf16/fp16/fp32.
        up: [..., F], same shape and device as ``gate`` (its dtype may differ).
        beta1: soft cap of the gate branch (> 0).
        beta2: soft cap of the up branch (> 0).
        autotune: as in :func:`situ_glu_fused`.

    Returns:
        [..., F] in ``gate.dtype``, computed in fp32. Differentiable; gradients come back in each input's dtype.
    """
    _check_tensor(gate, "gate")
    _check_tensor(up, "up")
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape, got gate {tuple(gate.shape)} and up {tuple(up.shape)}"
        )
    if gate.device != up.device:
        raise ValueError(f"gate and up must be on the same device, got {gate.device} and {up.device}")
    _check_runnable(gate, beta1, beta2)
    F = gate.shape[-1]
    y = _SituGLUSplit.apply(_rows(gate, F), _rows(up, F), float(beta1), float(beta2), None if autotune else False)
    return y.reshape(gate.shape)
