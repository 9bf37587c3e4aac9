"""The expert-centric grouped MXFP4 kernels (k3.ops.mx_moe_grouped, op mx_moe backend triton_grouped) against the
reference k3.ops.mx_moe.mx_moe_packed.

The kernels run in Triton's interpreter on CPU (TRITON_INTERPRET=1, set in-process; tiny shapes, the interpreter is
slow) and compiled on a GPU (tests marked gpu). Tolerances are the op's registered ones: fp32 1e-5 of the largest
output entry (fp32 accumulation in another order, tanh from exponentials), bf16 2e-2 relative (the reference rounds
each GEMM's output to bf16, the kernels keep fp32 until the hidden and the output). Loads are uneven on purpose:
experts with no tokens, experts with more tokens than one tile holds (several tiles, a partial last one).
"""

import functools

import pytest
import torch

from k3.ops.mx import mxfp4_quantize
from k3.ops.mx_moe import (PackedExpertWeights, mx_moe_packed, mx_moe_packed_any,
                          mx_moe_packed_grouped, mx_moe_packed_triton, takes_gemv)
from k3.ops.mx_moe_grouped import block_tokens, tile_map
from k3.ops.registry import Backends, dispatch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
B1, B2 = 4.0, 25.0
# the grouped kernels at every token count (the op hands a few tokens to the token-centric kernels: tested below)
_grouped = functools.partial(mx_moe_packed_grouped, gemv_tokens=0)


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _skewed(N, k, E, g, used):
    """[N, k] distinct experts per token drawn from `used` only, the first of them far more often (uneven loads;
    the experts not in `used` get no tokens)."""
    p = torch.tensor([8.0] + [1.0] * (len(used) - 1))
    rows = [torch.tensor(used)[torch.multinomial(p, k, replacement=False, generator=g)] for _ in range(N)]
    return torch.stack(rows)


def _case(E=6, F=64, L=96, N=5, k=2, seed=0, device="cpu", used=None):
    g = torch.Generator().manual_seed(seed)
    w = [torch.randn(shape, generator=g) * 0.1 for shape in ((E, F, L), (E, F, L), (E, L, F))]
    packed = PackedExpertWeights(*(t.to(device) for wi in w for t in mxfp4_quantize(wi)))
    z = torch.randn(N, L, generator=g)
    if used is None:
        indices = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    else:
        indices = _skewed(N, k, E, g, used)
    weights = torch.rand(N, k, generator=g)
    return z.to(device), weights.to(device), indices.to(device), packed


def _close(got, want, rel):
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.float() - want.float()).abs().max()
    assert err <= rel * want.float().abs().max(), f"max error {err:.3g} against {want.float().abs().max():.3g}"


@pytest.mark.parametrize("N, k, E, block_t", [(1, 1, 1, 16), (16, 4, 9, 16), (300, 16, 40, 16), (64, 8, 8, 64)])
def test_tile_map_covers_every_pair_once_within_its_experts_tiles(N, k, E, block_t):
    g = torch.Generator().manual_seed(N)
    used = list(range(0, E, 2)) if E > 2 * k else list(range(E))  # some experts empty where that leaves k
    indices = _skewed(N, k, E, g, used)
    order, pos, tiles = tile_map(indices, E, block_t)
    flat = indices.reshape(-1)
    M = flat.numel()
    assert torch.equal(order, torch.argsort(flat, stable=True)) and torch.equal(order[pos], torch.arange(M))
    assert tiles.shape[0] == min(E, M) + M // block_t  # the grid's bound
    covered = torch.zeros(M, dtype=torch.int64)
    counts = torch.bincount(flat, minlength=E)
    want_tiles = int(((counts + block_t - 1) // block_t).sum())
    live = tiles[tiles[:, 0] >= 0]
    assert live.shape[0] == want_tiles and bool((tiles[want_tiles:, 0] == -1).all())  # the live tiles come first
    for e, first, end in live.tolist():
        rows = torch.arange(first, min(first + block_t, end))
        assert len(rows) > 0 and bool((flat[order[rows]] == e).all())
        covered[rows] += 1
    assert bool((covered == 1).all())
    assert set(live[:, 0].tolist()) == set(torch.nonzero(counts).flatten().tolist())  # no tile for an empty expert


def test_block_tokens_grows_with_the_pairs_per_expert():
    assert block_tokens(16, 896) == 16  # one decode token, top-16
    assert block_tokens(64 * 16, 896) == 16
    assert block_tokens(2048 * 16, 896) == 64
    assert block_tokens(4096, 128) == 32


@pytest.mark.parametrize("activations", [None, "mxfp8"])
@pytest.mark.parametrize("N", [1, 16, 64])
def test_grouped_kernels_equal_the_reference_fp32(interpret, activations, N):
    # 64 tokens top-2 over 6 experts: ~21 pairs per expert, tiles of 32 rows; 16: some experts get several
    z, weights, indices, packed = _case(N=N, seed=N, used=[0, 1, 3, 4] if N > 1 else None)
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, activations)
    got = _grouped(z, weights, indices, packed, B1, B2, activations)
    _close(got, want, 1e-5)


def test_grouped_kernels_several_partial_tiles_per_expert_fp32(interpret):
    # 40 tokens top-3 on 4 of 7 experts with 16-row tiles: expert 0 gets ~35 pairs (three tiles, the last partial),
    # experts 2, 5 and 6 none; L = 160: the last step along L is partial (64 columns per step in the interpreter)
    z, weights, indices, packed = _case(E=7, F=32, L=160, N=40, k=3, seed=5, used=[0, 1, 3, 4])
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, "mxfp8")
    got = _grouped(z, weights, indices, packed, B1, B2, "mxfp8", block_t=16)
    _close(got, want, 1e-5)


@pytest.mark.parametrize("N, block_t", [(1, None), (40, 16)])
def test_nibbles_decode_equals_the_reference_fp32(interpret, N, block_t):
    # per 32-column scale block, the low nibbles against the even columns and the high ones against the odd, the
    # block's sums scaled once: 40 tokens top-3 with 16-row tiles (several per expert, the last partial) and L = 160,
    # whose last step along L (64 columns in the interpreter) holds one block and one past the end
    z, weights, indices, packed = _case(E=7, F=32, L=160, N=N, k=3, seed=30 + N, used=[0, 1, 3, 4])
    for activations in (None, "mxfp8"):
        want = mx_moe_packed(z, weights, indices, packed, B1, B2, activations)
        _close(_grouped(z, weights, indices, packed, B1, B2, activations, decode="nibbles", block_t=block_t), want,
               1e-5)


@pytest.mark.parametrize("decode", ["dot_scaled", "registers", "bits", "nibbles"])
def test_grouped_kernels_bf16(interpret, decode):
    # without the MXFP8 rounding, as tests/ops/test_mx_moe.py explains: bf16 and fp32 GEMM outputs near an MXFP8
    # rounding boundary move by a whole step; the MXFP8 path is checked in fp32 above
    z, weights, indices, packed = _case(F=32, N=16, seed=6, used=[0, 2, 3, 5])
    z = z.to(torch.bfloat16)
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, None)
    got = _grouped(z, weights, indices, packed, B1, B2, None, decode=decode)
    _close(got, want, 2e-2)
    if decode == "bits":  # the same bf16 weights as the registers decode, the same dots: the same output, bit for bit
        assert torch.equal(got, _grouped(z, weights, indices, packed, B1, B2, None, decode="registers"))


def _edge_scales(packed, e):
    """`packed` with expert e's first rows given the scales the bit-built decode cannot take (their steps fall back
    to the registers decode): w1 row 0 at 6 * 2^127 (254, code 7: +inf, the gate saturates), w1 row 1 tiny (0:
    2^-127 per unit), w3 row 2 at 4 * 2^126 (253, code 6: +inf), w2 rows 0 and 1 tiny (0 and 1). Built bit by bit
    where the scales allow, these would decode to -inf, a sign flip or garbage."""
    w1p, w1s, w3p, w3s, w2p, w2s = (t.clone() for t in packed)
    w1p[e, 0, :16], w3p[e, 2, :16] = 0, 0  # the rest of those 32-column blocks zero (no inf - inf)
    w1s[e, 0, 0], w1p[e, 0, 0] = 254, 0x07  # column 0: code 7 (6.0)
    w1s[e, 1, 0] = 0
    w3s[e, 2, 0], w3p[e, 2, 0] = 253, 0x06  # column 0: code 6 (4.0)
    w2s[e, 0, 0], w2s[e, 1, 0] = 0, 1
    return PackedExpertWeights(w1p, w1s, w3p, w3s, w2p, w2s)


def test_bits_decode_takes_the_registers_decode_where_a_scale_is_out_of_its_range(interpret):
    z, weights, indices, packed = _case(F=32, N=4, k=2, seed=8, used=[0, 1, 2, 3])
    z = z.to(torch.bfloat16)
    z[:, 0] = z[:, 0].abs() + 0.5  # x_0 > 0: the +inf weights make the gate and up +inf, saturating SiTU-GLU
    packed = _edge_scales(packed, int(indices[0, 0]))
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, None)
    got = _grouped(z, weights, indices, packed, B1, B2, None, decode="bits")
    assert bool(torch.isfinite(want).all())
    _close(got, want, 2e-2)
    assert torch.equal(got, _grouped(z, weights, indices, packed, B1, B2, None, decode="registers"))
    # the nibbles decode scales each block's sums instead of the weights: the same saturation, the same tiny values
    _close(_grouped(z, weights, indices, packed, B1, B2, None, decode="nibbles"), want, 2e-2)


def test_no_tokens_and_bad_options(interpret):
    z, weights, indices, packed = _case()
    out = _grouped(z[:0], weights[:0], indices[:0], packed, B1, B2)
    assert out.shape == (0, z.shape[1]) and out.dtype == z.dtype
    with pytest.raises(ValueError, match="decode='dot_scaled' multiplies bf16 or fp16"):
        _grouped(z, weights, indices, packed, B1, B2, decode="dot_scaled")
    with pytest.raises(ValueError, match="decode='bits' builds bf16 weights"):
        _grouped(z, weights, indices, packed, B1, B2, decode="bits")
    with pytest.raises(ValueError, match="decode='fp4'"):
        _grouped(z, weights, indices, packed, B1, B2, decode="fp4")
    with pytest.raises(ValueError, match="block_t=24"):
        _grouped(z, weights, indices, packed, B1, B2, block_t=24)
    with pytest.raises(ValueError, match="activations"):
        _grouped(z, weights, indices, packed, B1, B2, "mxfp6")


def test_few_tokens_take_the_token_centric_kernels(interpret):
    # while the pairs number at most 3/4 of the experts (or up to gemv_tokens tokens) the op runs the token-centric
    # kernels, above that the grouped ones
    assert takes_gemv(1, 16, 384) and takes_gemv(18, 16, 384) and not takes_gemv(19, 16, 384)
    assert takes_gemv(3, 2, 8) and not takes_gemv(4, 2, 8) and not takes_gemv(1, 1, 8, gemv_tokens=0)
    for N, limit in ((3, None), (4, None), (2, 2), (3, 2), (3, 0)):
        z, weights, indices, packed = _case(E=8, F=32, N=N, k=2, seed=20 + N)
        got = mx_moe_packed_grouped(z, weights, indices, packed, B1, B2, "mxfp8", gemv_tokens=limit)
        want = (mx_moe_packed_triton(z, weights, indices, packed, B1, B2, "mxfp8") if takes_gemv(N, 2, 8, limit)
                else _grouped(z, weights, indices, packed, B1, B2, "mxfp8"))
        assert torch.equal(got, want), (N, limit)
        _close(got, mx_moe_packed(z, weights, indices, packed, B1, B2, "mxfp8"), 1e-5)
    for bad in (-1, 2.0, "4", True):
        with pytest.raises(ValueError, match="gemv_tokens"):
            mx_moe_packed_grouped(z, weights, indices, packed, B1, B2, gemv_tokens=bad)


def test_registry_names_the_grouped_backend_and_auto_keeps_the_reference_on_cpu(interpret):
    z, weights, indices, packed = _case(F=32, seed=7)
    assert dispatch("mx_moe", z, Backends()).name == "torch"
    pinned = Backends(per_op={"mx_moe": "triton_grouped"})
    assert dispatch("mx_moe", z, pinned).name == "triton_grouped"
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, None)
    _close(mx_moe_packed_any(z, weights, indices, packed, B1, B2, None, backends=pinned), want, 1e-5)


# --- compiled, on a GPU --------------------------------------------------------------------------------------------
def _gpu_case(N, **kw):
    return _case(E=32, F=256, L=512, N=N, k=8, seed=10 + N, device="cuda", **kw)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N", [1, 16, 64, 512])
def test_grouped_kernels_on_gpu(N):
    # 512 tokens top-8 over 32 experts: ~128 pairs per expert, 64-row tiles (prefill); experts 1, 5, .. empty below
    used = None if N < 64 else [e for e in range(32) if e % 4 != 1]
    z, weights, indices, packed = _gpu_case(N, used=used)
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, "mxfp8")
    _close(_grouped(z, weights, indices, packed, B1, B2, "mxfp8"), want, 1e-5)
    want = mx_moe_packed(z, weights, indices, packed, B1, B2, None)
    _close(_grouped(z, weights, indices, packed, B1, B2, None), want, 1e-5)
    zb = z.to(torch.bfloat16)
    ref = mx_moe_packed(zb, weights, indices, packed, B1, B2, None)
    for decode in ("dot_scaled", "registers", "bits", "nibbles"):
        _close(_grouped(zb, weights, indices, packed, B1, B2, None, decode=decode), ref, 2e-2)
    for activations in (None, "mxfp8"):  # fp32 tokens: IEEE dots
        want = mx_moe_packed(z, weights, indices, packed, B1, B2, activations)
        _close(_grouped(z, weights, indices, packed, B1, B2, activations, decode="nibbles"), want, 1e-5)
    # untuned (one config for both), the bit-built weights are the registers decode's: the same output
    regs, bits = (_grouped(zb, weights, indices, packed, B1, B2, None, decode=d, autotune=False)
                  for d in ("registers", "bits"))
    assert torch.equal(regs, bits)


@pytest.mark.gpu
@needs_cuda
def test_bits_decode_with_out_of_range_scales_on_gpu():
    z, weights, indices, packed = _gpu_case(16)
    zb = z.to(torch.bfloat16)
    zb[:, 0] = zb[:, 0].abs() + 0.5
    packed = _edge_scales(packed, int(indices[0, 0]))
    ref = mx_moe_packed(zb, weights, indices, packed, B1, B2, None)
    got = _grouped(zb, weights, indices, packed, B1, B2, None, decode="bits", autotune=False)
    assert bool(torch.isfinite(ref).all())
    _close(got, ref, 2e-2)
    assert torch.equal(got, _grouped(zb, weights, indices, packed, B1, B2, None, decode="registers",
                                                  autotune=False))
    _close(_grouped(zb, weights, indices, packed, B1, B2, None, decode="nibbles", autotune=False), ref, 2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N, gemv_tokens", [(16, 0), (2, None)], ids=["grouped", "token-centric"])
def test_kernels_capture_in_a_cuda_graph(N, gemv_tokens):
    # nothing reads back to the host: the whole path captures (the grouped kernels, and the token-centric ones the op
    # hands a decode step's few tokens to), and a replay on new routing gives the new result
    z, weights, indices, packed = _gpu_case(N)
    zb = z.to(torch.bfloat16)
    op = functools.partial(mx_moe_packed_grouped, gemv_tokens=gemv_tokens)
    fn = lambda: op(zb, weights, indices, packed, B1, B2, "mxfp8")  # noqa: E731
    fn()  # autotuning and compilation happen outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    _, _, new_indices, _ = _gpu_case(N, used=[0, 3, 7, 8, 9, 12, 20, 21, 30])
    indices.copy_(new_indices)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn())
    ref = mx_moe_packed(zb, weights, indices, packed, B1, B2, None)
    _close(op(zb, weights, indices, packed, B1, B2, None), ref, 2e-2)
