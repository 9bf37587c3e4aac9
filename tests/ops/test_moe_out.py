"""A LatentMoE layer's output in one kernel (op ``moe_out``, k3.ops.moe_out) against the composed ops (the latent
up-projection GEMM, the shared SiTU-GLU, addmm), and in the model and the serving engine.

CPU tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the `gpu` test runs it compiled
at k3-mini's and a release-shaped width. Tolerances, relative to the largest reference output: fp32 1e-5 (the same
products summed in another order); bf16 one bf16 step on a GPU (2^-7: the up-projection, h and y rounded where the
composed ops round them, a rounding that falls the other way moves an output by a step), two in the interpreter (it
rounds by truncation).
"""

import pytest
import torch

from helpers import assert_same_greedy, count_fast_calls, rel_err, tiny_engine_runs
from k3.ops.moe_gemv import moe_combine_norm_triton
from k3.ops.moe_out import (_TUNE_OUT, MOE_OUT_MAX_TOKENS, moe_combine_norm_out, moe_combine_norm_out_for,
                            moe_combine_norm_out_triton, moe_out, moe_out_for, moe_out_triton)
from k3.ops.registry import Backends

OUT = Backends(per_op={"moe_out": "triton"})
# the decode step's MoE kernels with the experts' combine and latent norm inside the output kernel
PAIRS_OUT = Backends(per_op={"moe_gemv": "triton", "moe_combine_norm": "triton", "moe_out": "triton",
                             "moe_combine_norm_out": "triton"})


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(N, L, I, D, dtype, device="cpu", seed=0):
    """a contiguous; gate and up as the layer hands them over: column slices of one stacked projection output."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(N, L, generator=g).to(device, dtype)
    stacked = (torch.randn(N, L + 2 * I, generator=g) * 2).to(device, dtype)
    gate, up = stacked[:, L:L + I], stacked[:, L + I:]
    w_up = (torch.randn(D, L, generator=g) / L ** 0.5).to(device, dtype)
    w_down = (torch.randn(D, I, generator=g) / I ** 0.5).to(device, dtype)
    return a, gate, up, w_up, w_down, 4.0, 25.0


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 * 2 ** -7)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,L,I,D", [(1, 48, 300, 40), (3, 260, 96, 17)])
def test_interpreted_kernel_equals_the_composed_ops(interpret, dtype, tol, N, L, I, D):
    # widths over one and several column blocks of 256, D not a multiple of the row block
    args = _inputs(N, L, I, D, dtype)
    assert N == 1 or not args[1].is_contiguous()  # gate and up read through their row stride
    got, want = moe_out_triton(*args), moe_out(*args)
    assert got.shape == want.shape == (N, D) and got.dtype == dtype
    assert rel_err(got.float(), want.float()) <= tol
    # not vacuous: gate and up swapped is far
    a, gate, up, w_up, w_down, b1, b2 = args
    assert rel_err(moe_out_triton(a, up, gate, w_up, w_down, b1, b2).float(), want.float()) > 1e-2


@pytest.mark.parametrize("tile", _TUNE_OUT, ids=lambda t: "x".join(map(str, t)))
def test_every_tile_shape_the_tuning_may_pick_computes_the_same(interpret, tile):
    # D, L and I not multiples of any block: each row of the table launched as given equals the composed ops (fp32)
    args = _inputs(2, 260, 96, 17, torch.float32)
    assert rel_err(moe_out_triton(*args, tile=tile), moe_out(*args)) <= 1e-5


def test_bad_inputs_are_named(interpret):
    a, gate, up, w_up, w_down, b1, b2 = _inputs(2, 16, 24, 8, torch.float32)
    with pytest.raises(ValueError, match="w_down must be"):
        moe_out_triton(a, gate, up, w_up, w_down[:, :5], b1, b2)
    with pytest.raises(ValueError, match="gate and up must be"):
        moe_out_triton(a, gate, up[:, :5], w_up, w_down, b1, b2)
    with pytest.raises(ValueError, match="one dtype"):
        moe_out_triton(a.double(), gate, up, w_up, w_down, b1, b2)
    with pytest.raises(ValueError, match="at most"):
        moe_out_triton(*_inputs(MOE_OUT_MAX_TOKENS + 1, 16, 24, 8, torch.float32))
    with pytest.raises(RuntimeError, match="no backward"):
        moe_out_triton(a.clone().requires_grad_(), gate, up, w_up, w_down, b1, b2)
    # the layer's gate: the kernel only without gradients and for a few tokens
    with torch.no_grad():
        assert moe_out_for(a, OUT) is not None
        assert moe_out_for(torch.zeros(MOE_OUT_MAX_TOKENS + 1, 16), OUT) is None
        assert moe_out_for(a, Backends(default="torch")) is None
    assert moe_out_for(a, OUT) is None  # gradients enabled


def _tiny_model():
    """A tiny model without MTP layers (eval), its number of MoE layers with shared experts, and 5 token ids."""
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    m = K3ForCausalLM(cfg).init_weights(seed=1).eval()
    n_moe = sum(type(x).__name__ == "LatentMoE" and x.shared_experts is not None for x in m.modules())
    return m, n_moe, torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))


def test_the_model_with_the_kernel_equals_its_usual_path(interpret, monkeypatch):
    # a tiny model's no-grad forward with its projections stacked (serving): the kernel runs once per MoE layer with
    # shared experts, the hidden states are the composed ops' (fp32, 1e-5); unstacked or training, it never runs
    from k3.model.common import stack_projections

    calls = count_fast_calls(monkeypatch, "moe_out")
    m, n_moe, ids = _tiny_model()
    with torch.no_grad():
        plain = m.set_backends(OUT).model(ids)
        assert calls == []
        stack_projections(m)
        want = m.set_backends(Backends()).model(ids)
        got = m.set_backends(OUT).model(ids)
    assert calls == ["moe_out"] * n_moe and n_moe > 0
    assert rel_err(got, want) <= 1e-5 and rel_err(got, plain) <= 1e-5
    m.train()(ids, labels=ids).loss.backward()
    assert len(calls) == n_moe


def test_the_engine_decodes_the_same_with_the_kernel(interpret, monkeypatch):
    """The serving engine (stacked projections) with the kernel for its decode steps: the same greedy tokens as the
    composed ops, log-probs within 1e-4."""
    calls = count_fast_calls(monkeypatch, "moe_out")
    ran = []
    runs = tiny_engine_runs([Backends(), OUT], 6, after=lambda b: ran.append(len(calls)))
    assert ran[0] == 0 and ran[1] > 0
    assert_same_greedy(runs, 1e-4)


def _pairs(N, k, L, I, D, dtype, device="cpu", seed=0):
    """The experts' pairs [N*k, L], their weights [N, k], the latent norm's weight and eps, then gate, up and the two
    weights as `_inputs` gives them (moe_combine_norm_out's arguments)."""
    g = torch.Generator().manual_seed(seed + 100)
    y = torch.randn(N * k, L, generator=g).to(device, dtype)
    w = torch.rand(N, k, generator=g).to(device)
    nw = (1 + 0.2 * torch.randn(L, generator=g)).to(device, dtype)
    _, gate, up, w_up, w_down, b1, b2 = _inputs(N, L, I, D, dtype, device, seed)
    return y, w, nw, 1e-6, gate, up, w_up, w_down, b1, b2


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2 * 2 ** -7)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("N,k,L,I,D", [(1, 8, 48, 300, 40), (3, 3, 260, 96, 17)])
def test_interpreted_combine_inside_equals_the_combine_norm_then_the_output_kernel(interpret, dtype, tol, N, k, L,
                                                                                   I, D):
    # op moe_combine_norm_out: the pairs combined and normed inside the output kernel give the definition's output,
    # and bit for bit what the two kernels it replaces give (the same fp32 operations in the same order); k not a
    # power of two, L over one and several column blocks
    args = _pairs(N, k, L, I, D, dtype)
    y, w, nw, eps, gate, up, w_up, w_down, b1, b2 = args
    got, want = moe_combine_norm_out_triton(*args), moe_combine_norm_out(*args)
    assert got.shape == want.shape == (N, D) and got.dtype == dtype
    assert rel_err(got.float(), want.float()) <= tol
    two = moe_out_triton(moe_combine_norm_triton(y, w, nw, eps, dtype), gate, up, w_up, w_down, b1, b2)
    assert torch.equal(got, two)
    # not vacuous: the pairs' weights in another slot order, or the norm's weight left out, are far
    assert rel_err(moe_combine_norm_out_triton(y, w.flip(1), *args[2:]).float(), want.float()) > 1e-2
    assert rel_err(moe_combine_norm_out_triton(y, w, torch.ones_like(nw), *args[3:]).float(), want.float()) > 1e-2


@pytest.mark.parametrize("tile", _TUNE_OUT, ids=lambda t: "x".join(map(str, t)))
def test_every_tile_shape_computes_the_same_with_the_combine_inside(interpret, tile):
    args = _pairs(2, 8, 260, 96, 17, torch.float32)
    assert rel_err(moe_combine_norm_out_triton(*args, tile=tile), moe_combine_norm_out(*args)) <= 1e-5


def test_bad_pairs_are_named(interpret):
    y, w, nw, eps, gate, up, w_up, w_down, b1, b2 = _pairs(2, 4, 16, 24, 8, torch.float32)
    with pytest.raises(ValueError, match="pairs must be"):
        moe_combine_norm_out_triton(y[:5], w, nw, eps, gate, up, w_up, w_down, b1, b2)
    with pytest.raises(ValueError, match="pairs must be"):
        moe_combine_norm_out_triton(y.double(), w, nw, eps, gate, up, w_up, w_down, b1, b2)
    with pytest.raises(ValueError, match="latent norm's weight"):
        moe_combine_norm_out_triton(y, w, nw[:3], eps, gate, up, w_up, w_down, b1, b2)
    with pytest.raises(ValueError, match="weights must be"):
        moe_combine_norm_out_triton(y, w.view(-1), nw, eps, gate, up, w_up, w_down, b1, b2)
    with pytest.raises(ValueError, match="gate and up must be"):
        moe_combine_norm_out_triton(y, w, nw, eps, gate[:1], up, w_up, w_down, b1, b2)
    with pytest.raises(ValueError, match="w_up must be"):
        moe_combine_norm_out_triton(y, w, nw, eps, gate, up, w_up[:, :3], w_down, b1, b2)
    with pytest.raises(ValueError, match="at most"):
        moe_combine_norm_out_triton(*_pairs(MOE_OUT_MAX_TOKENS + 1, 2, 16, 24, 8, torch.float32))
    with pytest.raises(RuntimeError, match="no backward"):
        moe_combine_norm_out_triton(y.clone().requires_grad_(), w, nw, eps, gate, up, w_up, w_down, b1, b2)
    a = torch.zeros(2, 16)
    with torch.no_grad():
        assert moe_combine_norm_out_for(a, PAIRS_OUT) is not None
        assert moe_combine_norm_out_for(torch.zeros(MOE_OUT_MAX_TOKENS + 1, 16), PAIRS_OUT) is None
        assert moe_combine_norm_out_for(a, Backends(default="torch")) is None
    assert moe_combine_norm_out_for(a, PAIRS_OUT) is None  # gradients enabled


def test_the_model_combines_inside_the_output_kernel(interpret, monkeypatch):
    # a tiny stacked model's no-grad forward with the decode step's MoE kernels: with op moe_combine_norm_out on,
    # each MoE layer with shared experts runs it in place of the combine-norm kernel and the output kernel, and the
    # hidden states are what those two give (fp32, 1e-6)
    from k3.model.common import stack_projections

    calls = count_fast_calls(monkeypatch, "moe_combine_norm_out", "moe_combine_norm", "moe_out")
    m, n_moe, ids = _tiny_model()
    two = Backends(per_op={**PAIRS_OUT.per_op, "moe_combine_norm_out": "torch"})
    with torch.no_grad():
        stack_projections(m)
        want = m.set_backends(two).model(ids)
        assert calls == ["moe_combine_norm", "moe_out"] * n_moe and n_moe > 0
        calls.clear()
        got = m.set_backends(PAIRS_OUT).model(ids)
        assert calls == ["moe_combine_norm_out"] * n_moe
        plain = m.set_backends(Backends()).model(ids)
    assert rel_err(got, want) <= 1e-6 and rel_err(got, plain) <= 1e-5


def test_packed_mxfp4_experts_hand_their_pairs_to_the_output_kernel(interpret, monkeypatch):
    # experts served from MXFP4 storage: at a decode step's few tokens the token-centric kernels give their pairs to
    # the output kernel (one combine fewer), and the hidden states are what the separate combine gives (fp32, 1e-5)
    from k3.model.common import stack_projections
    from k3.model.mx_experts import pack_experts

    calls = count_fast_calls(monkeypatch, "moe_combine_norm_out", "moe_out")
    m, n_moe, ids = _tiny_model()
    on = Backends(per_op={"mx_moe": "triton_grouped", "moe_out": "triton", "moe_combine_norm_out": "triton"})
    two = Backends(per_op={**on.per_op, "moe_combine_norm_out": "torch"})
    with torch.no_grad():
        pack_experts(m, activations=None)
        stack_projections(m)
        want = m.set_backends(two).model(ids[:, :2])
        assert calls == ["moe_out"] * n_moe and n_moe > 0
        calls.clear()
        got = m.set_backends(on).model(ids[:, :2])
        assert calls == ["moe_combine_norm_out"] * n_moe
        plain = m.set_backends(Backends()).model(ids[:, :2])
    assert rel_err(got, want) <= 1e-5 and rel_err(got, plain) <= 1e-5


@pytest.mark.slow  # ~13 s on 2 cores; its parts have faster tests: the model's forward with the combine inside (above)
# and the engine with the output kernel (test_the_engine_decodes_the_same_with_the_kernel)
def test_the_engine_decodes_the_same_with_the_combine_inside(interpret, monkeypatch):
    calls = count_fast_calls(monkeypatch, "moe_combine_norm_out")
    ran = []
    runs = tiny_engine_runs([Backends(), PAIRS_OUT], 6, after=lambda b: ran.append(len(calls)))
    assert ran[0] == 0 and ran[1] > 0
    assert_same_greedy(runs, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N", [1, 4, 8])
@pytest.mark.parametrize("L,I,D", [(512, 1536, 1024), (3584, 3072, 7168)], ids=["k3-mini", "release"])
def test_gpu_combine_inside_equals_the_definition_and_the_two_kernels(N, L, I, D):
    # autotuned as served: against the definition (one bf16 step; fp32 1e-5) and against the combine-norm kernel
    # then the output kernel (the same fp32 operations: equal up to the tiles the two tunings pick, one bf16 step)
    k = 8 if L == 512 else 16
    for dtype, tol in ((torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)):
        args = _pairs(N, k, L, I, D, dtype, device="cuda", seed=N)
        y, w, nw, eps, gate, up, w_up, w_down, b1, b2 = args
        with torch.no_grad():
            got = moe_combine_norm_out_triton(*args)
            assert rel_err(got.float(), moe_combine_norm_out(*args).float()) <= tol
            two = moe_out_triton(moe_combine_norm_triton(y, w, nw, eps, dtype), gate, up, w_up, w_down, b1, b2)
            assert rel_err(got.float(), two.float()) <= tol


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N", [1, 4, 8])
@pytest.mark.parametrize("L,I,D", [(512, 1536, 1024), (3584, 3072, 7168)], ids=["k3-mini", "release"])
def test_gpu_kernel_equals_the_composed_ops(N, L, I, D):
    for dtype, tol in ((torch.bfloat16, 2 ** -7), (torch.float32, 1e-5)):
        args = _inputs(N, L, I, D, dtype, device="cuda", seed=N)
        with torch.no_grad():
            assert rel_err(moe_out_triton(*args).float(), moe_out(*args).float()) <= tol
