"""The optimized PyTorch KDA (op kda's reference and k3.ops.kda.kda_chunk) against the naive definitions of
k3.ops.kda_naive, and the two naive forms against each other.

Tolerances, as the largest error relative to the largest entry (helpers.rel_err):
* naive recurrent vs naive chunk, both fp64: 1e-10. The two are the same algebra evaluated in another order; fp64
  rounding (1e-16 per operation, grown by the sums over channels, tokens and the triangular solve) stays many
  orders below it, while any mistake in either form is an O(1) error.
* optimized (fp32 math) vs naive (fp64): 1e-5. fp32 rounds at 6e-8; the chunk form's dot products over K channels,
  its (I + A)^-1 and the state carried over a few chunks grow that by a small factor (the existing chunk-vs-
  recurrent tests hold the same bound).
"""

import pytest
import torch

from helpers import one_torch_thread, rel_err
from k3.ops import kda as ref
from k3.ops.kda_naive import kda_chunk_naive, kda_recurrent_naive
from k3.ops.registry import Backends, Target, dispatch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread: the matrices are tiny, and batched fp64 matmuls split over threads crawl on a busy CPU."""
    with one_torch_thread():
        yield


H, K, V = 2, 16, 12  # K != V, so a transposed state would not fit
TIGHT, FP32 = 1e-10, 1e-5


def _raw(B, T, seed, N=None):
    """Op kda's raw inputs (before gate, norms and sigmoid) and an initial state for N sequences (default B)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, z = (r(B, T, H, K) for _ in range(3))
    v, beta_logits = r(B, T, H, V), r(B, T, H)
    A_log, dt_bias = 0.5 * r(H), r(H * K)
    h0 = 0.5 * r(B if N is None else N, H, K, V)
    return (q, k, v, z, beta_logits, A_log, dt_bias), h0


def _kda_torch():
    """The registry's PyTorch reference of op kda (what CPU runs)."""
    impl = dispatch("kda", Target(torch.device("cpu")), Backends(default="torch"))
    assert impl.name == "torch"
    return impl.fn


def _chunk_optimized(raw, lower_bound, h0, cu, chunk_size):
    """k3.ops.kda.kda_chunk at `chunk_size` after op kda's preprocessing (k3.ops.kda's gate and L2 norm)."""
    q, k, v, z, beta_logits, A_log, dt_bias = raw
    g = ref.kda_gate(z, A_log, dt_bias, lower_bound)
    return ref.kda_chunk(ref.l2norm(q), ref.l2norm(k), v, g, torch.sigmoid(beta_logits), initial_state=h0,
                         cu_seqlens=cu, chunk_size=chunk_size)


CU = torch.tensor([0, 37, 40, 40, 105, 170])  # lengths 37, 3, 0 (an empty sequence), 65, 65


@pytest.mark.parametrize("cu", [None, CU], ids=["rows", "packed"])
@pytest.mark.parametrize("chunk", [1, 7, 16, 64])
def test_naive_chunk_equals_naive_recurrence(chunk, cu):
    raw, h0 = _raw(1, 170, seed=chunk, N=5) if cu is not None else _raw(2, 50, seed=chunk)
    o_r, s_r = kda_recurrent_naive(*raw, -5.0, h0, cu)
    o_c, s_c = kda_chunk_naive(*raw, -5.0, h0, cu, chunk_size=chunk)
    assert o_r.dtype == s_r.dtype == torch.float64 and s_r.shape == h0.shape
    assert rel_err(o_c, o_r) < TIGHT and rel_err(s_c, s_r) < TIGHT


def test_naive_recurrence_is_the_update_rule():
    # One token from a known state, by hand: the state and output follow the formula of the module docstring.
    raw, h0 = _raw(1, 1, seed=3)
    q, k, v, z, beta_logits, A_log, dt_bias = (x.double() for x in raw)
    o, s = kda_recurrent_naive(*raw, -5.0, h0)
    alpha = torch.exp(-5.0 * torch.sigmoid(A_log.exp()[:, None] * (z[0, 0] + dt_bias.view(H, K))))
    kn = k[0, 0] / k[0, 0].norm(dim=-1, keepdim=True)
    qn = q[0, 0] / q[0, 0].norm(dim=-1, keepdim=True)
    b = torch.sigmoid(beta_logits[0, 0])
    S = alpha[..., None] * h0.double()[0]
    S = S - b[:, None, None] * kn[:, :, None] * torch.einsum("hk,hkv->hv", kn, S)[:, None, :]
    S = S + b[:, None, None] * kn[:, :, None] * v[0, 0][:, None, :]
    assert rel_err(s[0], S) < 1e-6  # 1e-6: the naive norm's eps (1e-6 under the root), absent here
    assert rel_err(o[0, 0], torch.einsum("hkv,hk->hv", S, qn) * K**-0.5) < 1e-6


@pytest.mark.parametrize("lower_bound", [-5.0, -8.0], ids=["tiled-pairs", "direct-pairs"])
@pytest.mark.parametrize("B,T", [(2, 1), (2, 37), (1, 130)])
def test_op_reference_matches_the_naive_forms(B, T, lower_bound):
    # The registry's reference: the token recurrence for T = 1, the chunk form (64 tokens) otherwise, T not a
    # multiple of the chunk. A bound below -5 makes the chunk form take its direct pair scores instead of tiles.
    raw, h0 = _raw(B, T, seed=T)
    o, s = _kda_torch()(*raw, lower_bound, h0)
    o_r, s_r = kda_recurrent_naive(*raw, lower_bound, h0)
    o_c, s_c = kda_chunk_naive(*raw, lower_bound, h0)
    assert rel_err(o, o_r) < FP32 and rel_err(s, s_r) < FP32
    assert rel_err(o, o_c) < FP32 and rel_err(s, s_c) < FP32


def test_op_reference_matches_the_naive_forms_on_packed_sequences():
    raw, h0 = _raw(1, 170, seed=11, N=5)
    o, s = _kda_torch()(*raw, -5.0, h0, CU)
    o_r, s_r = kda_recurrent_naive(*raw, -5.0, h0, CU)
    assert rel_err(o, o_r) < FP32 and rel_err(s, s_r) < FP32
    assert torch.equal(s[2], h0[2])  # the empty sequence leaves its state as it was


@pytest.mark.parametrize("cu", [None, CU], ids=["rows", "packed"])
@pytest.mark.parametrize("chunk", [16, 20, 64, 128])
def test_optimized_chunk_sizes_match_the_naive_forms(chunk, cu):
    # Chunk sizes that do and do not divide the lengths (and a tile-ragged 20), against the naive chunk form at
    # the same size and the recurrence; no initial state for the rows, to cover the zero default.
    raw, h0 = _raw(1, 170, seed=chunk, N=5) if cu is not None else _raw(2, 100, seed=chunk)
    h0 = h0 if cu is not None else None
    o, s = _chunk_optimized(raw, -5.0, h0, cu, chunk)
    o_c, s_c = kda_chunk_naive(*raw, -5.0, h0, cu, chunk_size=chunk)
    o_r, s_r = kda_recurrent_naive(*raw, -5.0, h0, cu)
    assert rel_err(o, o_c) < FP32 and rel_err(s, s_c) < FP32
    assert rel_err(o, o_r) < FP32 and rel_err(s, s_r) < FP32
