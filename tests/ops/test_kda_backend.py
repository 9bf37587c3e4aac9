"""KDA backend selection (CPU) and the fla kernels against the reference (GPU, marked `gpu`)."""

import pytest
import torch

from helpers import rel_err
from k3.ops import kda as ref
from k3.ops.kda_backend import kda, resolve_backend


def test_cpu_uses_the_reference_and_bad_choices_are_named(monkeypatch):
    assert resolve_backend(torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_backend(torch.device("cpu"), "fla")
    monkeypatch.setenv("K3_KDA_BACKEND", "magic")
    with pytest.raises(ValueError, match="K3_KDA_BACKEND"):
        resolve_backend(torch.device("cpu"))


def _inputs(B, T, H, K, device, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v, z = (r(B, T, H, K).to(device, dtype) for _ in range(4))
    beta = r(B, T, H).to(device, dtype)
    A_log = (0.5 * r(H)).to(device)
    dt_bias = r(H * K).to(device)
    return q, k, v, z, beta, A_log, dt_bias


def test_layer_op_reference_matches_the_plain_ops():
    q, k, v, z, beta, A_log, dt_bias = _inputs(2, 70, 2, 16, "cpu", torch.float32)
    o, s = kda(q, k, v, z, beta, A_log, dt_bias, -5.0, backend="torch")
    g = ref.kda_gate(z, A_log, dt_bias, -5.0)
    o2, s2 = ref.kda_recurrent(ref.l2norm(q), ref.l2norm(k), v, g, torch.sigmoid(beta))
    assert rel_err(o, o2) < 1e-5 and rel_err(s, s2) < 1e-5


def _fla_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return resolve_backend(torch.device("cuda"), "fla") == "fla"
    except ValueError:
        return False


needs_fla = pytest.mark.skipif(not _fla_usable(), reason="needs CUDA and fla-core")


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("T,cu", [(256, None), (1000, [0, 300, 301, 1000])])
def test_fla_chunk_matches_reference_forward_and_backward(T, cu):
    # bf16 inputs, fp32 state; tolerance 2e-2 relative (bf16 rounding of q/k/v/o inside the kernel).
    H, K = 4, 128
    B = 1 if cu else 2
    cu_t = torch.tensor(cu, device="cuda") if cu else None
    N = len(cu) - 1 if cu else B
    ins = [t.requires_grad_() for t in _inputs(B, T, H, K, "cuda", torch.bfloat16)[:5]]
    rest = _inputs(B, T, H, K, "cuda", torch.bfloat16)[5:]
    s0 = torch.randn(N, H, K, K, device="cuda") * 0.1
    o, s = kda(*ins, *rest, -5.0, initial_state=s0, cu_seqlens=cu_t, backend="fla")
    ins_r = [t.detach().float().requires_grad_() for t in ins]
    o_r, s_r = kda(*ins_r, *rest, -5.0, initial_state=s0, cu_seqlens=cu_t, backend="torch")
    assert rel_err(o.float(), o_r) < 2e-2 and rel_err(s, s_r) < 2e-2
    do = torch.randn_like(o_r)
    (o.float() * do).sum().backward()
    (o_r * do).sum().backward()
    for a, b in zip(ins, ins_r):
        assert rel_err(a.grad.float(), b.grad) < 5e-2


@pytest.mark.gpu
@needs_fla
def test_fla_decode_step_matches_reference():
    H, K = 4, 128
    q, k, v, z, beta, A_log, dt_bias = _inputs(8, 1, H, K, "cuda", torch.bfloat16)
    s0 = torch.randn(8, H, K, K, device="cuda") * 0.1
    with torch.no_grad():
        o, s = kda(q, k, v, z, beta, A_log, dt_bias, -5.0, initial_state=s0.clone(), backend="fla")
        o_r, s_r = kda(q.float(), k.float(), v.float(), z.float(), beta.float(), A_log, dt_bias, -5.0,
                       initial_state=s0.clone(), backend="torch")
    assert rel_err(o.float(), o_r) < 2e-2 and rel_err(s, s_r) < 2e-2


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("packed", [False, True])
def test_fla_short_conv_matches_reference_forward_backward_and_states(packed):
    # bf16 input, fp32 weight (as in the model under autocast); outputs and gradients 2e-2 relative, carried
    # states exact up to bf16 storage of the inputs.
    from k3.ops.kda_backend import short_conv

    g = torch.Generator().manual_seed(0)
    C, W = 256, 4
    T = 300
    x = torch.randn(1 if packed else 2, T, C, generator=g).cuda().to(torch.bfloat16).requires_grad_()
    w = (0.5 * torch.randn(C, 1, W, generator=g)).cuda().requires_grad_()
    cu = torch.tensor([0, 100, 101, 300], device="cuda") if packed else None
    n = 3 if packed else 2
    state = torch.randn(n, C, W - 1, generator=g).cuda().to(torch.bfloat16).float()
    dy = torch.randn(x.shape, generator=g).cuda()
    res = {}
    for be in ("fla", "torch"):
        y, s = short_conv(x, w, state, cu_seqlens=cu, backend=be)
        res[be] = (y, s, *torch.autograd.grad((y.float() * dy).sum(), [x, w]))
    for a, b in zip(res["fla"], res["torch"]):
        assert rel_err(a.float(), b.float()) < 2e-2
