"""The routed experts of a few tokens as GEMV kernels (op ``moe_gemv``, k3.ops.moe_gemv) against the expert loop and
the grouped path, and in the model.

CPU tests run the kernels in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the `gpu` tests run them
compiled at k3-mini's shapes and at the release's widths (fewer experts). Tolerances, relative to the largest
reference entry: fp32 1e-5 against the loop (the same products summed in another order); bf16 against the grouped
path one bf16 step on a GPU (2^-7: the same roundings of gate, up, hidden and y), three in the interpreter, which
rounds by truncation (four roundings in a row, each up to a step the same way).
"""

import pytest
import torch

from helpers import count_fast_calls, rel_err
from k3.ops.moe import moe_experts_grouped
from k3.ops.moe_gemv import (_TUNE_DOWN, _TUNE_GATE_UP, GEMV_MAX_TOKENS, moe_combine_norm, moe_combine_norm_triton,
                             moe_gemv, moe_gemv_for, moe_gemv_triton)
from k3.ops.registry import Backends
from k3.ops.situ import situ_glu

B1, B2 = 4.0, 25.0
GEMV = Backends(per_op={"moe_gemv": "triton"})


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(N, E, k, F, L, dtype, device="cpu", stacked=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(N, L, generator=g).to(device, dtype)
    w13 = (torch.randn(E, 2 * F, L, generator=g) * 2 / L ** 0.5).to(device, dtype)
    w1, w3 = (w13[:, :F], w13[:, F:]) if stacked else (w13[:, :F].contiguous(), w13[:, F:].contiguous())
    w2 = (torch.randn(E, L, F, generator=g) / F ** 0.5).to(device, dtype)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(device)
    if N > 1:
        idx[1, 0] = idx[0, 0]  # two tokens on one expert
    wt = torch.rand(N, k, generator=g).to(device)
    return z, wt, idx, w1, w3, w2


def _grouped(z, wt, idx, w1, w3, w2):
    with torch.no_grad():
        return moe_experts_grouped(z, wt, idx, w1.contiguous(), w3.contiguous(), w2,
                                   lambda a, b: situ_glu(a, b, B1, B2))


@pytest.mark.parametrize("N,E,k", [(1, 8, 2), (3, 16, 8), (GEMV_MAX_TOKENS, 16, 4)], ids=["1", "3", "max"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked-halves", "separate"])
def test_interpreted_kernels_fp32_equal_the_expert_loop(interpret, N, E, k, stacked):
    args = _inputs(N, E, k, 96, 80, torch.float32, stacked=stacked)
    got = moe_gemv_triton(*args, B1, B2)
    assert got.shape == (N, 80) and got.dtype == torch.float32
    assert rel_err(got, moe_gemv(*args, B1, B2)) <= 1e-5
    # z as the serving path hands it over, a column slice of the stacked projections' output: read through its row
    # stride, the same result
    z = args[0]
    zv = torch.cat([z, torch.randn(N, 7)], dim=1)[:, :80]
    assert zv.is_contiguous() == (N == 1)
    assert torch.equal(moe_gemv_triton(zv, *args[1:], B1, B2), got)


@pytest.mark.parametrize("gate_up,down", list(zip(_TUNE_GATE_UP, _TUNE_DOWN)), ids=lambda t: "x".join(map(str, t)))
def test_every_tile_shape_the_tuning_may_pick_computes_the_same(interpret, gate_up, down):
    # F and L not multiples of any block (masked rows and columns), tiles wider than both: each row of the tables
    # launched as given equals the expert loop (fp32)
    args = _inputs(3, 8, 4, 72, 200, torch.float32)
    assert rel_err(moe_gemv_triton(*args, B1, B2, tiles=(gate_up, down)), moe_gemv(*args, B1, B2)) <= 1e-5


def test_interpreted_kernels_bf16_equal_the_grouped_path(interpret):
    args = _inputs(5, 16, 4, 200, 72, torch.bfloat16)
    got = moe_gemv_triton(*args, B1, B2)
    assert got.dtype == torch.bfloat16
    assert rel_err(got.float(), _grouped(*args).float()) <= 3 * 2 ** -7


def _norm(L, dtype, device="cpu", seed=5):
    return (1 + 0.3 * torch.randn(L, generator=torch.Generator().manual_seed(seed))).to(device, dtype), 1e-5


@pytest.mark.parametrize("dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                           (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16-fp32w", "bf16"])
@pytest.mark.parametrize("L", [72, 1500], ids=["one-block", "two-blocks"])
def test_interpreted_combine_norm_equals_the_combine_then_the_norm(interpret, dtype, w_dtype, L):
    # op moe_combine_norm: the combine's u rounded as the combine stores it, then RMSNorm's roundings; fp32 1e-5, bf16
    # within three bf16 steps (the interpreter rounds by truncation), over one and over two column blocks of 1,024
    N, k = 5, 4
    g = torch.Generator().manual_seed(L)
    y = torch.randn(N * k, L, generator=g).to(dtype)
    wt = torch.rand(N, k, generator=g)
    nw, eps = _norm(L, w_dtype)
    got = moe_combine_norm_triton(y, wt, nw, eps, dtype)
    want = moe_combine_norm(y, wt, nw, eps, dtype)
    assert got.dtype == dtype and got.shape == (N, L)
    assert rel_err(got.float(), want.float()) <= (1e-5 if dtype == torch.float32 else 3 * 2 ** -7)
    # not vacuous: a norm over the wrong row (the slots' weights swapped between tokens) is far
    assert rel_err(moe_combine_norm_triton(y, wt.flip(0), nw, eps, dtype).float(), want.float()) > 1e-1


def test_interpreted_gemv_with_the_norm_equals_the_gemv_then_the_norm(interpret):
    args = _inputs(3, 16, 4, 96, 80, torch.float32)
    nw, eps = _norm(80, torch.float32)
    got = moe_gemv_triton(*args, B1, B2, backends=Backends(per_op={"moe_combine_norm": "triton"}), norm=(nw, eps))
    want = torch.nn.functional.rms_norm(moe_gemv(*args, B1, B2), (80,), nw, eps=eps)
    assert rel_err(got, want) <= 1e-5
    with pytest.raises(ValueError, match=r"latent norm's weight must be a floating \[80\] tensor"):
        moe_gemv_triton(*args, B1, B2, norm=(nw[:10], eps))


def test_a_wrong_kernel_is_caught(interpret):
    # the comparison is not vacuous: the routing weights of each token's slots swapped moves the output far
    z, wt, idx, w1, w3, w2 = _inputs(3, 16, 4, 64, 48, torch.float32)
    want = moe_gemv(z, wt, idx, w1, w3, w2, B1, B2)
    assert rel_err(moe_gemv_triton(z, wt.flip(1), idx, w1, w3, w2, B1, B2), want) > 1e-2


def test_bad_inputs_are_named(interpret):
    z, wt, idx, w1, w3, w2 = _inputs(2, 8, 2, 32, 16, torch.float32)
    big = _inputs(GEMV_MAX_TOKENS + 1, 8, 2, 32, 16, torch.float32)
    with pytest.raises(ValueError, match=f"at most {GEMV_MAX_TOKENS} tokens"):
        moe_gemv_triton(*big, B1, B2)
    with pytest.raises(ValueError, match="expert weights in z's dtype"):
        moe_gemv_triton(z, wt, idx, w1.double(), w3.double(), w2.double(), B1, B2)
    with pytest.raises(RuntimeError, match="no backward"):
        moe_gemv_triton(z.clone().requires_grad_(), wt, idx, w1, w3, w2, B1, B2)
    # the layer's choice: only without gradients, only for few tokens, only where the registry picks the kernels
    with torch.no_grad():
        assert moe_gemv_for(z, GEMV) is not None
        assert moe_gemv_for(big[0], GEMV) is None
        assert moe_gemv_for(z, None) is None  # CPU, auto: the reference, i.e. the layer's usual path
    assert moe_gemv_for(z, GEMV) is None  # gradients on


def test_the_model_with_the_kernels_equals_its_usual_path(interpret, monkeypatch):
    # a tiny model's no-grad forward over 2 x 3 tokens (each MoE call sees 6 <= GEMV_MAX_TOKENS rows): the kernels run
    # at every MoE layer and the hidden states are the grouped path's (fp32, 1e-5); a training forward never uses them
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM

    calls = count_fast_calls(monkeypatch, "moe_gemv", "moe_combine_norm")
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    m = K3ForCausalLM(cfg).init_weights(seed=1).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 3), generator=torch.Generator().manual_seed(0))
    grouped = Backends(per_op={"moe": "grouped"})
    with torch.no_grad():
        want = m.set_backends(grouped).model(ids)
        got = m.set_backends(Backends(per_op={"moe": "grouped", "moe_gemv": "triton"})).model(ids)
    n_moe = sum(hasattr(layer, "block_sparse_moe") for layer in m.model.layers)
    assert len(calls) == n_moe > 0
    assert rel_err(got, want) <= 1e-5
    # with the latent norm inside the combine's kernel (op moe_combine_norm) too: the same hidden states
    calls.clear()
    fused = Backends(per_op={"moe": "grouped", "moe_gemv": "triton", "moe_combine_norm": "triton"})
    with torch.no_grad():
        got = m.set_backends(fused).model(ids)
    assert calls == ["moe_gemv", "moe_combine_norm"] * n_moe
    assert rel_err(got, want) <= 1e-5
    m.train()(ids, labels=ids).loss.backward()
    assert len(calls) == 2 * n_moe  # a training forward: none of them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N", [1, 4, GEMV_MAX_TOKENS])
@pytest.mark.parametrize("E,k,F,L", [(128, 8, 768, 512), (32, 16, 3072, 3584)], ids=["k3-mini", "release-widths"])
def test_gpu_kernels_match_the_grouped_path_and_the_loop(N, E, k, F, L):
    args = _inputs(N, E, k, F, L, torch.bfloat16, device="cuda")
    with torch.no_grad():
        got = moe_gemv_triton(*args, B1, B2)
        assert rel_err(got.float(), _grouped(*args).float()) <= 2 ** -7
        zv = torch.cat([args[0], torch.ones_like(args[0][:, :16])], dim=1)[:, :L]  # z as a strided view: the same
        assert torch.equal(moe_gemv_triton(zv, *args[1:], B1, B2), got)
        args32 = _inputs(N, E, k, F, L, torch.float32, device="cuda")
        assert rel_err(moe_gemv_triton(*args32, B1, B2), moe_gemv(*args32, B1, B2)) <= 1e-5
        # with the latent norm in the combine's kernel (op moe_combine_norm): bf16 within one bf16 step of the
        # kernels' u normed by RMSNorm (fp32 and bf16 weights), fp32 within 1e-5
        fused = Backends(per_op={"moe_combine_norm": "triton"})
        for w_dtype in (torch.float32, torch.bfloat16):
            nw, eps = _norm(L, w_dtype, device="cuda")
            got_normed = moe_gemv_triton(*args, B1, B2, backends=fused, norm=(nw, eps))
            assert rel_err(got_normed.float(), _normed(got, nw, eps).float()) <= 2 ** -7
        nw, eps = _norm(L, torch.float32, device="cuda")
        assert rel_err(moe_gemv_triton(*args32, B1, B2, backends=fused, norm=(nw, eps)),
                       _normed(moe_gemv(*args32, B1, B2), nw, eps)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_autotuned_launch_equals_its_pick_launched_as_given():
    from k3.ops.moe_gemv import _kernels

    args = _inputs(1, 128, 8, 768, 512, torch.bfloat16, device="cuda")
    with torch.no_grad():
        got = moe_gemv_triton(*args, B1, B2)  # tuned on first use
        gate_up, down, _ = _kernels(False, True)
        tiles = tuple((*c.kwargs.values(), c.num_warps) for c in (gate_up.best_config, down.best_config))
        assert tiles[0] in _TUNE_GATE_UP and tiles[1] in _TUNE_DOWN
        assert torch.equal(moe_gemv_triton(*args, B1, B2, tiles=tiles), got)


def _normed(u, nw, eps):
    """k3.model.common.RMSNorm(u) with weight nw."""
    from k3.model.common import RMSNorm

    norm = RMSNorm(u.shape[-1], eps=eps).to(u.device)
    norm.weight.data = nw
    return norm(u)
