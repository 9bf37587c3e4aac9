"""The KDA replay fused into the next verification (k3.ops.kda_verify_replay): equal to replaying the pending
positions (k3.ops.kda_replay) and then running the window's short conv and recurrence from that state and tail; the
fused Triton kernel (in Triton's interpreter on CPU, compiled on a GPU) equal to that reference; the layer's
`verify_replay` equal to `replay` followed by a verification forward.

Tolerances. fp32: 1e-5 of the largest state / output entry (the same token recurrence, K-term sums in another order,
sigmoid from exponentials). bf16 inputs: the op normalizes q and k in fp32 (as the layer's forward does), so the
composition it is compared with runs kda_replay on the inputs widened to fp32 (exact) and the state is held to 1e-5
as well; the outputs come back in bf16, held to 8e-3 of the largest entry (one bf16 step, at most 2^-7 of the
value, where two fp32 values within 1e-5 round apart). Against kda_replay on the bf16 inputs themselves (which
rounds the unit key to bf16) the state differs by about one bf16 step (observed ~1e-3): held to 1e-2. The conv tail
is the same gather, bit for bit.
"""

import dataclasses

import pytest
import torch
from helpers import strong_kda_layer

from k3.ops import kda as ref
from k3.ops import registry
from k3.ops.kda_replay import kda_replay
from k3.ops.kda_verify_replay import kda_verify_replay, kda_verify_replay_triton
from k3.ops.registry import Target, dispatch, ops


def _case(N=4, P=3, T=3, H=2, K=16, W=4, dtype=torch.float32, seed=0, device="cpu"):
    """Random pending inputs [N, P, ...], a window's projections [N, T, ...], gate and conv parameters, a committed
    state and conv tail. Decays and writes strong enough that a wrong count of pending positions shows."""
    g = torch.Generator().manual_seed(seed)
    C = H * K

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device, dtype)

    pending = (r(N, P, H, K), r(N, P, H, K), r(N, P, H, K), r(N, P, H), r(N, P, 3, C))
    window = (r(N, T, 3, C), r(N, T, H, K), r(N, T, H))
    conv_weight = r(3, C, W, s=0.5)
    A_log, dt_bias = (torch.randn(H, generator=g) * 0.5).to(device), torch.randn(C, generator=g).to(device)
    state, conv = torch.randn(N, H, K, K, generator=g).to(device), torch.randn(N, 3, C, W - 1, generator=g).to(device)
    return pending, window, conv_weight, A_log, dt_bias, -5.0, state, conv


def _args(case, lengths):
    pending, window, conv_weight, A_log, dt_bias, lb, state, conv = case
    return (*pending, lengths, *window, conv_weight, A_log, dt_bias, lb, state, conv)


def _composed(case, lengths, widen: bool = True):
    """kda_replay of each row's pending positions (none: the committed state and tail), then the window's three
    short convs from the tail after them and the plain token recurrence from the state after them."""
    (pk, pv, pz, pb, ppre), (wpre, wz, wb), cw, A_log, dt_bias, lb, state, conv = case
    f = (lambda x: x.float()) if widen else (lambda x: x)
    states, tails = [], []
    for b, n in enumerate(lengths):
        if n == 0:
            states.append(state[b]), tails.append(conv[b])
            continue
        s, c = kda_replay(*(f(x[b:b + 1, :n]) for x in (pk, pk, pv, pz, pb)), ppre[b:b + 1, :n], A_log, dt_bias, lb,
                          state[b:b + 1], conv[b:b + 1], [n])
        states.append(s[0]), tails.append(c[0])
    state_p, conv_p = torch.stack(states), torch.stack(tails)
    N, T, H, K = wz.shape
    q, k, v = (ref.short_conv(wpre[:, :, i], cw[i], conv_p[:, i])[0].view(N, T, H, K) for i in range(3))
    o, _ = ref.kda_recurrent(ref.l2norm(q.float()), ref.l2norm(k.float()), v, ref.kda_gate(wz, A_log, dt_bias, lb),
                             torch.sigmoid(wb.float()), initial_state=state_p)
    return o, q, k, v, state_p, conv_p


def _close(got, want, tol):
    return (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


# lengths: rows with nothing pending, different counts, all P; shapes: P = T, P < T, P > T
CASES = [(dict(P=3, T=3), [0, 1, 3, 2]), (dict(P=2, T=4), [2, 0, 1, 2]), (dict(P=5, T=2, N=2), [5, 3]),
         (dict(P=1, T=1, N=1), [1])]


@pytest.mark.parametrize("shape,lengths", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_replay_then_the_window(shape, lengths, dtype):
    case = _case(**shape, dtype=dtype)
    got = kda_verify_replay(*_args(case, lengths))
    want = _composed(case, lengths)
    out_tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert got.o.dtype == dtype and got.state.dtype == torch.float32 and got.conv.dtype == torch.float32
    assert _close(got.o, want[0], out_tol)
    for x, w in zip((got.q, got.k, got.v), want[1:4]):
        assert x.dtype == dtype and torch.equal(x, w)  # the window's conv: the same math, one call for three
    assert _close(got.state, want[4], 1e-5)
    assert torch.equal(got.conv, want[5])
    if dtype == torch.bfloat16:  # kda_replay's own convention (the unit key rounded to bf16): one bf16 step apart
        assert _close(got.state, _composed(case, lengths, widen=False)[4], 1e-2)


def test_the_count_of_pending_positions_matters():
    """A wrong count gives a different state and different outputs: the comparisons above can tell."""
    case = _case(N=1, P=3, T=2)
    a, b = kda_verify_replay(*_args(case, [2])), kda_verify_replay(*_args(case, [3]))
    assert not _close(a.state, b.state, 1e-3) and not _close(a.o, b.o, 1e-3)
    assert not torch.equal(a.conv, b.conv)
    none = kda_verify_replay(*_args(case, [0]))
    assert torch.equal(none.state, case[6]) and torch.equal(none.conv, case[7])


def test_nothing_pending_at_all():
    """P = 0 (no row has pending positions): a plain verification from the committed state."""
    case = _case(N=2, P=0, T=3)
    got = kda_verify_replay(*_args(case, [0, 0]))
    want = _composed(case, [0, 0])
    assert _close(got.o, want[0], 1e-5) and torch.equal(got.state, case[6]) and torch.equal(got.conv, case[7])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_counts_as_a_device_tensor_equal_the_host_list(backend, dtype, monkeypatch):
    """pending_lengths as a tensor (what a captured graph refills before each replay) gives exactly the host list's
    results, on random inputs and random counts with zeros among them (all zero in one case), on the reference and
    (in Triton's interpreter) on the kernel."""
    fn = kda_verify_replay
    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        fn = kda_verify_replay_triton
    N, P, T = 5, 4, 3
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        case = _case(N=N, P=P, T=T, seed=10 + seed)
        lengths = [0] * N if seed == 2 else torch.randint(0, P + 1, (N,), generator=g).tolist()
        if seed == 0:
            lengths[1] = 0
        want = fn(*_args(case, lengths))
        got = fn(*_args(case, torch.tensor(lengths, dtype=dtype)))
        for name, a, b in zip(want._fields, got, want):
            assert torch.equal(a, b), f"{backend}: {name} differs with the counts as a tensor ({lengths})"


def test_device_counts_of_the_wrong_shape_or_dtype_are_named():
    case = _case()
    with pytest.raises(ValueError, match=r"pending_lengths is a torch.float32 tensor of shape \(4,\).*int32 or int64"):
        kda_verify_replay(*_args(case, torch.zeros(4)))
    with pytest.raises(ValueError, match=r"pending_lengths is a torch.int64 tensor of shape \(3,\).*\[4\]"):
        kda_verify_replay(*_args(case, torch.zeros(3, dtype=torch.long)))


def test_bad_inputs_are_named():
    case = _case()
    with pytest.raises(ValueError, match=r"pending_lengths=\[0, 1, 4, 2\]: need 4 ints in \[0, 3\]"):
        kda_verify_replay(*_args(case, [0, 1, 4, 2]))
    with pytest.raises(ValueError, match=r"pending_lengths=\[1, 1\]: need 4"):
        kda_verify_replay(*_args(case, [1, 1]))
    args = list(_args(case, [0, 1, 2, 3]))
    args[7] = args[7][:, :2]  # window_z of 2 positions, the rest of 3
    with pytest.raises(ValueError, match=r"window_pre_conv has shape \(4, 3, 3, 32\), expected \[4, 2, 3, 32\]"):
        kda_verify_replay(*args)
    args = list(_args(case, [0, 1, 2, 3]))
    args[-2] = args[-2][..., :8]
    with pytest.raises(ValueError, match=r"state has shape \(4, 2, 16, 8\), expected \[4, 2, 16, 16\]"):
        kda_verify_replay(*args)


def test_auto_takes_the_validated_kernel_on_cuda_and_the_reference_on_cpu(monkeypatch):
    op = ops()["kda_verify_replay"]
    assert [(f.name, f.validated, f.cpu) for f in op.fast] == [("triton", True, True)]
    fast = tuple(dataclasses.replace(f, available=lambda t: (True, "")) for f in op.fast)
    monkeypatch.setitem(registry._ops, "kda_verify_replay", dataclasses.replace(op, fast=fast))
    monkeypatch.setattr(registry, "_notices", set())
    cuda = Target(torch.device("cuda"), torch.bfloat16)
    assert dispatch("kda_verify_replay", cuda).name == "triton"
    assert dispatch("kda_verify_replay", cuda, registry.Backends(default="torch")).name == "torch"
    assert dispatch("kda_verify_replay", Target(torch.device("cpu"))).name == "torch"


# --- the fused kernel, in Triton's interpreter (TRITON_INTERPRET=1, set in-process) -----------------------------------
# bf16 inputs: the kernel normalizes in fp32 like the reference, so the state is held to 1e-5 as in fp32; the outputs
# are stored in bf16 by the kernel (the interpreter may truncate where torch rounds): one bf16 step, 8e-3.

@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("shape,lengths", CASES[:3] + [(dict(N=2, P=2, T=2, K=12, H=3), [2, 1]),
                                                       (dict(N=2, P=2, T=2, K=40, H=1), [1, 2]),
                                                       (dict(N=2, P=0, T=2), [0, 0])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference(interpret, shape, lengths, dtype):
    """Also K not a power of two (masked key channels) and K = 40 (two value blocks of 32, the second masked)."""
    case = _case(**shape, dtype=dtype)
    want = kda_verify_replay(*_args(case, lengths))
    got = kda_verify_replay_triton(*_args(case, lengths))
    assert got.o.dtype == dtype and got.state.dtype == torch.float32
    assert _close(got.o, want.o, 1e-5 if dtype == torch.float32 else 8e-3)
    assert _close(got.state, want.state, 1e-5)
    assert torch.equal(got.conv, want.conv) and all(torch.equal(a, b) for a, b in zip(got[1:4], want[1:4]))


# --- the layer: KimiDeltaAttention.verify_replay against replay + a verification forward -----------------------------

@torch.no_grad()
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_layer_verify_replay_equals_replay_then_verification(backend, monkeypatch):
    """Cycle 1 verifies window 1 from the committed state; rows accepted 0 (nothing pending: say the row was flushed),
    2 and all T of its positions. Cycle 2 verifies window 2 with those pending: outputs, state and conv tail after the
    pending positions, and the window's kept inputs as replay-then-verify gives them. fp32: outputs and state 1e-5 of
    the largest entry (the forward runs the chunkwise form for T > 1, the op the token recurrence); on the kernels
    (`triton`: both fused ops) the kept q, k, v too (the conv in the kernel, its taps summed in its own order)."""
    from k3.model.cache import KDACache
    from k3.ops.kda_decode import KDAStore
    from k3.ops.registry import Backends
    from k3.serve.cache.views import KDAVerifyView

    if backend == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer, cfg = strong_kda_layer()
    B, T, D = 3, 4, cfg.hidden_size
    g = torch.Generator().manual_seed(2)
    committed = KDACache()
    layer(torch.randn(B, 7, D, generator=g), committed)
    state0, conv0 = committed.state.clone(), torch.stack(committed.conv, 1)
    view1 = KDAVerifyView(state0.clone(), conv0.clone())
    layer(torch.randn(B, T, D, generator=g), view1)
    pending, lengths = view1.inputs, [0, 2, T]
    window = torch.randn(B, T, D, generator=g)

    replayed = [layer.replay(pending, state0, conv0, [max(n, 1)] * B) for n in lengths]  # per row, from row b's
    state1 = torch.stack([state0[b] if n == 0 else replayed[b][0][b] for b, n in enumerate(lengths)])
    conv1 = torch.stack([conv0[b] if n == 0 else replayed[b][1][b] for b, n in enumerate(lengths)])
    view2 = KDAVerifyView(state1.clone(), conv1.clone())
    want = layer(window, view2)

    # the committed states as the rows of a store (each row: state, then conv tails), advanced in place
    store = KDAStore(torch.cat([state0.flatten(1), conv0.flatten(1)], 1), torch.arange(B))
    layer.backends = Backends(per_op={"kda_verify_replay": backend, "kda_verify_step": backend})
    try:
        y, kept = layer.verify_replay(window, pending, lengths, store)
    finally:
        layer.backends = None
    state, conv = store.read(*state0.shape[1:3], state0.shape[-1], conv0.shape[-1] + 1)
    assert _close(y, want, 1e-5)
    assert _close(state, state1, 1e-5) and torch.equal(conv, conv1)
    w = view2.inputs
    assert all(torch.equal(a, b) for a, b in zip(kept.pre_conv, w.pre_conv))
    for a, b in ((kept.z, w.z), (kept.beta_logits, w.beta_logits)):
        assert torch.equal(a, b)
    for a, b in ((kept.q, w.q), (kept.k, w.k), (kept.v, w.v)):  # the kernel's conv: its taps summed in its order
        assert torch.equal(a, b) if backend == "torch" else _close(a, b, 1e-5)
    # the state after the pending positions differs row by row from the committed one where something was pending
    assert torch.equal(state[0], state0[0]) and not _close(state[1], state0[1], 1e-3)


# --- on a GPU (marked gpu: passed on an H100, 2026-12-06, which validated the op) ---------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_equals_the_reference(dtype):
    """k3-mini's layer shape (8 heads of 128, conv 4), 16 requests with 0 .. 4 pending positions and a window of 4
    (the last token and 3 drafts). Compiled, the bf16 outputs round as torch does: one bf16 step at most."""
    case = _case(N=16, P=4, T=4, H=8, K=128, W=4, dtype=dtype, device="cuda")
    lengths = [i % 5 for i in range(16)]
    want = kda_verify_replay(*_args(case, lengths))
    got = kda_verify_replay_triton(*_args(case, lengths))
    assert _close(got.o, want.o, 1e-5 if dtype == torch.float32 else 8e-3)
    assert _close(got.state, want.state, 1e-5)
    assert torch.equal(got.conv, want.conv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_kernel_does_not_wait_for_the_device():
    """The host counts reach the GPU through pinned memory: no synchronization per KDA layer and verification."""
    import warnings

    case = _case(N=4, P=4, T=4, H=8, K=128, W=4, device="cuda")
    kda_verify_replay_triton(*_args(case, [0, 1, 2, 4]))  # warm-up: the kernel's compile, the pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kda_verify_replay_triton(*_args(case, [0, 1, 2, 4]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]
