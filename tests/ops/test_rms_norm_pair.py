"""Gated MLA's two low-rank norms in one kernel (op ``rms_norm_pair``, k3.ops.rms_norm_pair) against the two RMSNorms,
and in the model.

CPU tests run the kernel in Triton's interpreter (TRITON_INTERPRET=1, set in-process); the `gpu` test runs it compiled
at k3-mini's and the release's widths. Tolerances, relative to the largest reference entry: fp32 1e-6 (the sum of
squares in another order); bf16 one bf16 step on a GPU (2^-7: both round the same fp32 values), two in the
interpreter (it rounds by truncation).
"""

import pytest
import torch

from helpers import count_fast_calls, rel_err
from k3.ops.registry import Backends
from k3.ops.rms_norm_pair import rms_norm_pair, rms_norm_pair_any, rms_norm_pair_triton

PAIR = Backends(per_op={"rms_norm_pair": "triton"})


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _inputs(N, DA, DB, dtype, w_dtype, device="cpu", seed=0):
    """a and b as the layer hands them over: column slices of one stacked projection output [N, DA + DB + 8]."""
    g = torch.Generator().manual_seed(seed)
    out = (torch.randn(N, DA + DB + 8, generator=g) * 3).to(device, dtype)
    a, b = out[:, :DA], out[:, DA:DA + DB]
    wa = (1 + 0.3 * torch.randn(DA, generator=g)).to(device, w_dtype)
    wb = (1 + 0.3 * torch.randn(DB, generator=g)).to(device, w_dtype)
    return a, wa, 1e-6, b, wb, 1e-6


@pytest.mark.parametrize("dtype,w_dtype,tol", [(torch.float32, torch.float32, 1e-6),
                                               (torch.bfloat16, torch.float32, 2 * 2 ** -7),
                                               (torch.bfloat16, torch.bfloat16, 2 * 2 ** -7)],
                         ids=["fp32", "bf16-fp32w", "bf16"])
@pytest.mark.parametrize("N", [1, 5])
def test_interpreted_kernel_equals_the_two_norms(interpret, dtype, w_dtype, tol, N):
    args = _inputs(N, 96, 40, dtype, w_dtype)
    assert not args[0].is_contiguous() or N == 1  # read through the row stride
    got, want = rms_norm_pair_triton(*args), rms_norm_pair(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == dtype and g.is_contiguous()
        assert rel_err(g.float(), w.float()) <= tol
    # not vacuous: the two weights swapped between the slices (same widths) is far
    a, wa, ea, b, wb, eb = _inputs(N, 64, 64, dtype, w_dtype)
    swapped = rms_norm_pair_triton(a, wb, ea, b, wa, eb)[0]
    assert rel_err(swapped.float(), rms_norm_pair(a, wa, ea, b, wb, eb)[0].float()) > 1e-2


def test_bad_inputs_are_named(interpret):
    a, wa, ea, b, wb, eb = _inputs(3, 32, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"weight of b must be a floating \[16\] tensor"):
        rms_norm_pair_triton(a, wa, ea, b, wa, eb)
    with pytest.raises(ValueError, match="share their leading shape"):
        rms_norm_pair_triton(a, wa, ea, b[:2], wb, eb)
    with pytest.raises(RuntimeError, match="no backward"):
        rms_norm_pair_triton(a.clone().requires_grad_(), wa, ea, b, wb, eb)
    # the dispatching form: with gradients always the definition (differentiable)
    x = a.clone().requires_grad_()
    ya, _ = rms_norm_pair_any(x, wa, ea, b, wb, eb, backends=PAIR)
    ya.sum().backward()
    assert x.grad is not None


def test_the_model_with_the_kernel_equals_its_usual_path(interpret, monkeypatch):
    # a tiny model's no-grad forward: the kernel runs once per MLA layer, the hidden states are the two norms' (fp32,
    # 1e-5); a training forward never uses it
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM

    calls = count_fast_calls(monkeypatch, "rms_norm_pair")
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    m = K3ForCausalLM(cfg).init_weights(seed=1).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = m.set_backends(Backends()).model(ids)
        got = m.set_backends(PAIR).model(ids)
    assert len(calls) == len(cfg.full_attn_layers) > 0
    assert rel_err(got, want) <= 1e-5
    m.train()(ids, labels=ids).loss.backward()
    assert len(calls) == len(cfg.full_attn_layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("N", [1, 16, 64])
@pytest.mark.parametrize("DA,DB", [(384, 256), (1536, 512)], ids=["k3-mini", "release"])
def test_gpu_kernel_equals_the_two_norms(N, DA, DB):
    for dtype, w_dtype, tol in ((torch.bfloat16, torch.float32, 2 ** -7), (torch.bfloat16, torch.bfloat16, 2 ** -7),
                                (torch.float32, torch.float32, 1e-6)):
        args = _inputs(N, DA, DB, dtype, w_dtype, device="cuda", seed=N)
        with torch.no_grad():
            for g, w in zip(rms_norm_pair_triton(*args), rms_norm_pair(*args)):
                assert rel_err(g.float(), w.float()) <= tol
