"""KDA backend selection (CPU) and the fla kernels against the reference (GPU, marked `gpu`)."""

import pytest
import torch

from helpers import rel_err
from k3.ops import kda as ref
from k3.ops.kda_backend import kda
from k3.ops.registry import Backends, Target, backends_from_env, dispatch

TORCH = Backends(default="torch")


def on(op: str, be: str) -> Backends:
    """Backends with `op` pinned to `be`."""
    return Backends(per_op={op: be})


def test_cpu_uses_the_reference_and_bad_choices_are_named():
    assert dispatch("kda", Target(torch.device("cpu"))).name == "torch"
    with pytest.raises(ValueError, match="needs CUDA"):
        dispatch("kda", Target(torch.device("cpu")), on("kda", "fla"))
    with pytest.raises(ValueError, match=r"per_op\['kda'\]='magic' is invalid: use auto, torch, fla"):
        on("kda", "magic")
    with pytest.raises(ValueError, match="K3_KDA_BACKEND"):
        backends_from_env({"K3_KDA_BACKEND": "magic"})


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
    o, s = kda(q, k, v, z, beta, A_log, dt_bias, -5.0, backends=TORCH)
    g = ref.kda_gate(z, A_log, dt_bias, -5.0)
    o2, s2 = ref.kda_recurrent(ref.l2norm(q), ref.l2norm(k), v, g, torch.sigmoid(beta))
    assert rel_err(o, o2) < 1e-5 and rel_err(s, s2) < 1e-5


def _fla_usable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        return dispatch("kda", Target(torch.device("cuda")), on("kda", "fla")).name == "fla"
    except ValueError:
        return False


@pytest.fixture
def no_host_reads(monkeypatch):
    """Make every read of a tensor's values into Python (a device sync on a GPU) raise, while the fixture is on."""
    def refuse(self, *a, **k):
        raise AssertionError("a tensor value was read back to the host")

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


def test_reference_chunk_and_short_conv_read_nothing_back_for_unpacked_rows(no_host_reads):
    # A serving step of fixed shape (rows of equal length, no cu_seqlens) can then be captured in a CUDA graph:
    # the chunk layout is worked out on the host and the gate's bound (g >= lower_bound) stands in for reading
    # g's minimum. Twice: building the chunk maps and reusing them.
    q, k, v, z, beta, A_log, dt_bias = _inputs(2, 200, 2, 16, "cpu", torch.float32)
    x = torch.randn(2, 200, 8)
    w = torch.randn(8, 1, 4)
    for _ in range(2):
        o, s = kda(q, k, v, z, beta, A_log, dt_bias, -5.0, backends=TORCH)
        ref.short_conv(x, w, torch.zeros(2, 8, 3))
    assert o.shape == (2, 200, 2, 16) and s.shape == (2, 2, 16, 16)


def test_chunk_maps_from_host_sizes_match_the_recurrence_for_packed_documents():
    # The host-side chunk layout (sorted by chunk count, longest first; empty and 1-token documents included)
    # against the token recurrence.
    q, k, v, z, beta, A_log, dt_bias = _inputs(1, 300, 2, 16, "cpu", torch.float32, seed=3)
    cu = torch.tensor([0, 0, 1, 130, 131, 300])
    o, s = kda(q, k, v, z, beta, A_log, dt_bias, -5.0, cu_seqlens=cu, backends=TORCH)
    g = ref.kda_gate(z, A_log, dt_bias, -5.0)
    o2, s2 = ref.kda_recurrent(ref.l2norm(q), ref.l2norm(k), v, g, torch.sigmoid(beta), cu_seqlens=cu)
    assert rel_err(o, o2) < 1e-5 and rel_err(s, s2) < 1e-5


DEV = "cuda"  # the device of the fla comparisons
needs_fla = pytest.mark.skipif(not _fla_usable(), reason="needs CUDA and fla-core")


def test_host_offsets_switch():
    # An option of the KDA ops (Backends.kda_host_offsets, K3_KDA_HOST_OFFSETS on the command line): on by default
    # (validated on GPU), True turns it on, False off, anything else is an error naming the field or the variable.
    from k3.ops import kda_backend

    assert kda_backend.host_offsets_enabled(Backends()) and kda_backend.host_offsets_enabled(None)
    assert kda_backend.host_offsets_enabled(Backends(kda_host_offsets=True))
    assert not kda_backend.host_offsets_enabled(Backends(kda_host_offsets=False))
    assert backends_from_env({"K3_KDA_HOST_OFFSETS": "0"}).kda_host_offsets is False
    assert backends_from_env({"K3_KDA_HOST_OFFSETS": "1"}).kda_host_offsets is True
    with pytest.raises(ValueError, match="kda_host_offsets='sometimes'"):
        Backends(kda_host_offsets="sometimes")
    with pytest.raises(ValueError, match="K3_KDA_HOST_OFFSETS"):
        backends_from_env({"K3_KDA_HOST_OFFSETS": "sometimes"})


def test_host_chunk_indices_list_each_documents_chunks():
    # fla's varlen chunk list from host offsets: (document, chunk) for every 64-token chunk of every document, built
    # once per offsets tensor (the same object again returns the same list; the tensor changed in place does not).
    from k3.ops.kda_backend import host_chunk_indices

    cu = torch.tensor([0, 5, 69, 200, 201])
    idx = host_chunk_indices(cu, torch.device("cpu"), torch.int32)
    assert idx.dtype == torch.int32
    assert idx.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2], [3, 0]]  # lengths 5, 64, 131, 1
    assert host_chunk_indices(cu, torch.device("cpu"), torch.int32) is idx
    cu[1] = 64
    assert host_chunk_indices(cu, torch.device("cpu"), torch.int32).tolist()[:3] == [[0, 0], [1, 0], [2, 0]]


def _fla_vs_reference(B, T, H, cu, dtype, seed=0, host=False):
    """fla (inputs in `dtype`) and the fp32 reference on the same random inputs and output gradient:
    {name: (fla value, reference value)} for o, the final state and the gradients of all seven inputs
    (A_log and dt_bias included) and of the initial state. `host`: fla also gets the offsets on the host
    (cu_seqlens_cpu: its fixed-shape chunk list, nothing read back from the device)."""
    K = 128
    cu_t = torch.tensor(cu, device=DEV) if cu else None
    cu_host = torch.tensor(cu) if (cu and host) else None
    N = len(cu) - 1 if cu else B
    base = _inputs(B, T, H, K, DEV, torch.float32, seed=seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    s0 = (torch.randn(N, H, K, K, generator=g) * 0.1).to(DEV)
    do = torch.randn(B, T, H, K, generator=g).to(DEV)
    res = {}
    for be in ("fla", "torch"):
        ins = [t.to(dtype if i < 5 else torch.float32).detach().requires_grad_() for i, t in enumerate(base)]
        h0 = s0.clone().requires_grad_()
        o, s = kda(*ins, -5.0, initial_state=h0, cu_seqlens=cu_t, backends=Backends(per_op={"kda": be}),
                   cu_seqlens_cpu=cu_host if be == "fla" else None)
        (o.float() * do).sum().backward()
        res[be] = [o.float(), s] + [t.grad.float() for t in ins] + [h0.grad]
    names = ["o", "state", "dq", "dk", "dv", "dz", "dbeta", "dA_log", "ddt_bias", "dh0"]
    return {n: (a, b) for n, a, b in zip(names, res["fla"], res["torch"])}


def _assert_close(pairs: dict, tol: float):
    errs = {n: rel_err(a, b) for n, (a, b) in pairs.items()}
    bad = {n: round(e, 4) for n, e in errs.items() if not e < tol}
    assert not bad, f"relative error above {tol}: {bad} (all: { {n: round(e, 5) for n, e in errs.items()} })"


@pytest.mark.gpu
@needs_fla
# Every case has k3-mini's 8 heads of 128: fla autotunes each kernel per (heads, head size, varlen, dtype), a few
# minutes per new combination on a fresh machine, so the tests share their tuning with training and serving.
@pytest.mark.parametrize("B,T,H,cu", [(1, 2048, 8, [0, 300, 1024, 1724, 2048]), (2, 256, 8, None),
                                      (1, 1000, 8, [0, 300, 301, 1000])],
                         ids=["k3-mini-packed", "batch", "varlen-with-1-token-doc"])
def test_fla_chunk_matches_reference_forward_and_backward(B, T, H, cu):
    # bf16 q/k/v/z/beta against the fp32 reference (fp32 gate parameters and states on both sides); outputs,
    # states and every gradient (A_log, dt_bias and the initial state included) within 5e-2 relative to the
    # largest reference entry: bf16 rounding of q/k/v/o inside the kernel.
    _assert_close(_fla_vs_reference(B, T, H, cu, torch.bfloat16), 5e-2)


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("B,T,H,cu", [(1, 2048, 8, [0, 300, 1024, 1724, 2048]), (1, 1000, 8, [0, 300, 301, 1000])],
                         ids=["k3-mini-packed", "varlen-with-1-token-doc"])
def test_fla_chunk_with_host_offsets_matches_reference_forward_and_backward(B, T, H, cu):
    # As above, with the offsets also on the host, as the trainer gives them: fla's fixed-shape chunk list
    # (use_graph, Backends.kda_host_offsets on by default) instead of one built on the device; the same 5e-2.
    _assert_close(_fla_vs_reference(B, T, H, cu, torch.bfloat16, host=True), 5e-2)


@pytest.mark.gpu
@needs_fla
def test_host_chunk_indices_equal_flas_own():
    from fla.ops.utils.index import prepare_chunk_indices

    from k3.ops.kda_backend import host_chunk_indices

    cu = [0, 300, 301, 1000, 1064, 1065, 2048]
    dev = torch.tensor(cu, device="cuda")
    assert torch.equal(host_chunk_indices(torch.tensor(cu), dev.device, dev.dtype), prepare_chunk_indices(dev, 64))


@pytest.mark.gpu
@needs_fla
def test_fla_decode_step_matches_reference():
    H, K = 8, 128
    q, k, v, z, beta, A_log, dt_bias = _inputs(8, 1, H, K, "cuda", torch.bfloat16)
    s0 = torch.randn(8, H, K, K, device="cuda") * 0.1
    with torch.no_grad():
        o, s = kda(q, k, v, z, beta, A_log, dt_bias, -5.0, initial_state=s0.clone(), backends=on("kda", "fla"))
        o_r, s_r = kda(q.float(), k.float(), v.float(), z.float(), beta.float(), A_log, dt_bias, -5.0,
                       initial_state=s0.clone(), backends=TORCH)
    assert rel_err(o.float(), o_r) < 2e-2 and rel_err(s, s_r) < 2e-2


@pytest.mark.gpu
@needs_fla
@pytest.mark.parametrize("packed", [False, True])
def test_fla_short_conv_matches_reference_forward_backward_and_states(packed):
    # bf16 input, fp32 weight (as in the model under autocast); outputs and gradients 2e-2 relative, carried
    # states exact up to bf16 storage of the inputs.
    from k3.ops.kda_backend import short_conv

    g = torch.Generator().manual_seed(0)
    C, W = 1024, 4  # k3-mini's q/k/v width (8 x 128)
    T = 300
    x = torch.randn(1 if packed else 2, T, C, generator=g).cuda().to(torch.bfloat16).requires_grad_()
    w = (0.5 * torch.randn(C, 1, W, generator=g)).cuda().requires_grad_()
    cu = torch.tensor([0, 100, 101, 300], device="cuda") if packed else None
    n = 3 if packed else 2
    state = torch.randn(n, C, W - 1, generator=g).cuda().to(torch.bfloat16).float()
    dy = torch.randn(x.shape, generator=g).cuda()
    res = {}
    for be in ("fla", "torch"):
        y, s = short_conv(x, w, state, cu_seqlens=cu, backends=on("short_conv", be))
        res[be] = (y, s, *torch.autograd.grad((y.float() * dy).sum(), [x, w]))
    for a, b in zip(res["fla"], res["torch"]):
        assert rel_err(a.float(), b.float()) < 2e-2


@pytest.mark.gpu
@needs_fla
def test_fla_short_conv_of_q_k_v_together_with_host_offsets_matches_reference():
    # The training form: q, k and v side by side (3 x 1,024 channels, a strided view of a wider GEMM output), packed
    # documents with their offsets also on the host (fla gets its chunk list from there), no state; 2e-2 relative.
    from k3.ops.kda_backend import short_conv

    g = torch.Generator().manual_seed(1)
    C, W, T = 3 * 1024, 4, 1000
    wide = torch.randn(1, T, C + 128, generator=g).cuda().to(torch.bfloat16)
    x = wide[..., :C].requires_grad_(False)
    w = (0.5 * torch.randn(C, 1, W, generator=g)).cuda().requires_grad_()
    cu_host = torch.tensor([0, 300, 301, 1000])
    cu = cu_host.cuda()
    dy = torch.randn(1, T, C, generator=g).cuda()
    res = {}
    for be in ("fla", "torch"):
        xx = x.detach().requires_grad_()
        backends = Backends(per_op={"short_conv": be}, kda_host_offsets=True)
        y, s = short_conv(xx, w, None, cu_seqlens=cu, backends=backends,
                          cu_seqlens_cpu=cu_host if be == "fla" else None, output_state=False)
        assert s is None
        res[be] = (y, *torch.autograd.grad((y.float() * dy).sum(), [xx, w]))
    for a, b in zip(res["fla"], res["torch"]):
        assert rel_err(a.float(), b.float()) < 2e-2


@pytest.mark.gpu
@needs_fla
def test_fla_chunk_in_fp32_matches_reference_closely():
    # Last in the file: fp32 inputs are a new autotuning set for every fla kernel (minutes on a fresh machine).
    # The same comparison with fp32 inputs separates the kernel's math from bf16 rounding: 5e-3 relative
    # (the kernel's own dot products run in reduced precision).
    _assert_close(_fla_vs_reference(1, 2048, 8, [0, 300, 1024, 1724, 2048], torch.float32), 5e-3)


@pytest.mark.parametrize("B,T,C", [(1, 1, 64), (3, 200, 64), (2, 64, 64), (4, 130, 16)])
def test_uniform_rows_chunk_maps_equal_the_general_ones(B, T, C):
    # Rows of one length take maps computed on the device alone (capturable); they are the general maps.
    u = ref._uniform_chunk_index(B, T, C, torch.device("cpu"))
    g = ref._chunk_index_cached(tuple(i * T for i in range(B)), (T,) * B, B * T, C, torch.device("cpu"))
    assert u[2] == g[2]
    for a, b in zip(u[:2] + u[3:], g[:2] + g[3:]):
        assert torch.equal(a, b)
