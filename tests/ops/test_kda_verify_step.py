"""A KDA layer's verification step in one kernel on the cache's rows (k3.ops.kda_verify_step): the reference is the
composition the layer ran (the rows read, k3.ops.kda_verify_replay, the output norm and gate, the rows written); the
fused Triton kernel (Triton's interpreter on CPU, compiled on a GPU) equals it.

Tolerances. fp32: outputs, kept q/k/v and state 1e-5 of their largest entries (the conv's taps and the K-term reads
summed in another order, sigmoids from exponentials); the conv tails bit for bit (the same inputs moved). bf16 inputs:
the kernel rounds where the reference rounds (the conv outputs, the recurrence's output) and the pending positions'
inputs are the same bf16 values, so the state is held to 1e-5 as in fp32; the kept q/k/v to 8e-3 of the largest entry
(one bf16 step: the taps' fp32 sum in another order can land on the other side of a rounding boundary, and Triton's
interpreter truncates where torch rounds); the outputs, which carry such a step of q, k or v through the recurrence
and the norm before their own rounding, to 2e-2 (observed up to 1.3e-2). Rows of the store the batch does not name
are never touched (bit for bit).
"""

import pytest
import torch

from k3.ops.kda_decode import KDAStore
from k3.ops.kda_verify_step import _inner_contiguous, _strided, kda_verify_step, kda_verify_step_triton


def _case(N=4, Pn=3, T=3, H=2, K=16, W=4, dtype=torch.float32, seed=0, device="cpu", lengths=None, spare=2,
          side_by_side=False):
    """Random pending inputs (with `side_by_side`, views of one tensor [N, Pn, 7 * H * K + H + 3] as a pending request
    keeps them, k3.serve.cache.views.flat_inputs: one row and position stride for all seven), a window's projections
    (pre-conv q/k/v as column slices of one stacked tensor, as the layer's projection gives them), gate and norm
    parameters, and a store of N + `spare` rows (wider than a state, as pool pages are) whose rows are the batch's in
    shuffled order."""
    g = torch.Generator().manual_seed(seed)
    C = H * K

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(device, dtype)

    stacked = r(N, T, 3 * C + 5)  # q, k, v and other projections side by side
    window_pre = tuple(stacked[..., i * C:(i + 1) * C] for i in range(3))
    if side_by_side:
        kept = r(N, Pn, 7 * C + H + 3)
        part = [kept[..., i * C:(i + 1) * C] for i in range(7)]
        pending = (*(x.unflatten(-1, (H, K)) for x in part[4:]), kept[..., 7 * C:7 * C + H], tuple(part[:3]))
    else:
        pending = (r(N, Pn, H, K), r(N, Pn, H, K), r(N, Pn, H, K), r(N, Pn, H), tuple(r(N, Pn, C) for _ in range(3)))
    wz, wb = r(N, T, H, K), stacked[..., 3 * C:3 * C + H] if H <= 5 else r(N, T, H)
    gate = r(N, T, C)
    conv_w = tuple(r(3, C, W, s=0.5).unbind(0))
    A_log, dt_bias = (torch.randn(H, generator=g) * 0.5).to(device), torch.randn(C, generator=g).to(device)
    norm_w = (1 + 0.1 * torch.randn(K, generator=g)).to(device, dtype)
    E = H * K * K + 3 * C * (W - 1)
    buf = torch.randn(N + spare, E + 7, generator=g).to(device)
    rows = torch.randperm(N + spare, generator=g)[:N].to(device)
    lengths = [min(i, Pn) for i in range(N)] if lengths is None else lengths
    args = (*pending, lengths, window_pre, wz, wb, gate, conv_w, A_log, dt_bias, -5.0, norm_w, 1e-5)
    return args, buf, rows


def _run(fn, args, buf, rows):
    b = buf.clone()
    out = fn(*args, KDAStore(b, rows))
    return out, b


def _close(got, want, tol):
    return (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()


def _compare(got, want, bg, bw, rows, H, K, W, dtype):
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    assert got.y.dtype == want.y.dtype == dtype
    assert _close(got.y, want.y, 1e-5 if dtype == torch.float32 else 2e-2)
    for a, b in zip(got[1:], want[1:]):
        assert a.shape == b.shape and a.dtype == b.dtype and _close(a, b, tol)
    s = H * K * K
    assert _close(bg[rows, :s], bw[rows, :s], 1e-5)
    assert torch.equal(bg[rows, s:], bw[rows, s:])  # the conv tails (and the page's bytes past them)
    others = torch.ones(bg.shape[0], dtype=torch.bool)
    others[rows.cpu()] = False
    assert torch.equal(bg[others.to(bg.device)], bw[others.to(bw.device)])


def test_reference_advances_the_rows_through_the_pending_positions_only():
    """The state written is the one after each row's pending positions: a row with none keeps its bytes, and a
    second verification of another window from the written rows with nothing pending writes nothing new."""
    args, buf, rows = _case(lengths=[0, 1, 3, 2])
    out, b = _run(kda_verify_step, args, buf, rows)
    assert torch.equal(b[rows[0]], buf[rows[0]])  # nothing pending: written back unchanged
    assert not torch.equal(b[rows[2]], buf[rows[2]])
    again = list(args)
    again[5] = [0, 0, 0, 0]
    _, b2 = _run(kda_verify_step, again, b, rows)
    assert torch.equal(b2, b)
    assert out.y.shape == (4, 3, 32) and out.q.shape == (4, 3, 2, 16)


def test_bad_inputs_are_named():
    args, buf, rows = _case()
    bad = list(args)
    bad[8] = args[8][..., :1]
    with pytest.raises(ValueError, match="window_beta_logits"):
        kda_verify_step(*bad, KDAStore(buf, rows))
    bad = list(args)
    bad[6] = args[6][:2]
    with pytest.raises(ValueError, match="window_pre_conv"):
        kda_verify_step(*bad, KDAStore(buf, rows))
    bad = list(args)
    bad[5] = [0, 1, 4, 2]
    with pytest.raises(ValueError, match="pending_lengths"):
        kda_verify_step(*bad, KDAStore(buf, rows))
    with pytest.raises(ValueError, match="store.rows"):
        kda_verify_step(*args, KDAStore(buf, rows[:2]))
    with pytest.raises(ValueError, match="store.buf"):
        kda_verify_step(*args, KDAStore(buf[:, :10], rows))


# --- the fused kernel, in Triton's interpreter (TRITON_INTERPRET=1, set in-process) -----------------------------------

@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


SHAPES = [dict(Pn=3, T=3), dict(Pn=2, T=4, lengths=[2, 0, 1, 2]), dict(N=2, Pn=5, T=2, lengths=[5, 3]),
          dict(N=1, Pn=1, T=1), dict(N=2, Pn=2, T=2, K=12, H=3), dict(N=2, Pn=0, T=2, lengths=[0, 0]),
          dict(N=2, Pn=4, T=3, W=2, lengths=[4, 1]), dict(N=2, Pn=1, T=2, W=5, lengths=[1, 0])]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_reference(interpret, shape, dtype):
    """Also K not a power of two (masked channels), nothing pending anywhere, conv widths 2 and 5 (a tail of one,
    and taps reaching past the pending positions into the committed tail)."""
    args, buf, rows = _case(**shape, dtype=dtype)
    want, bw = _run(kda_verify_step, args, buf, rows)
    got, bg = _run(kda_verify_step_triton, args, buf, rows)
    H, K = args[7].shape[2:]
    _compare(got, want, bg, bw, rows, H, K, args[10][0].shape[-1], dtype)


def test_kernel_reads_device_counts_and_strided_rows(interpret):
    """The counts as an int tensor (a captured step's buffer) and the rows as a strided view (a static step's pages:
    a column of a [B, layers] table), with copies of the pending inputs that are not contiguous."""
    args, buf, rows = _case(N=3, Pn=3, T=2, lengths=[3, 0, 2])
    table = torch.stack([rows, rows + 100], 1)  # [N, 2]: column 0 the rows
    dev_args = list(args)
    dev_args[5] = torch.tensor([3, 0, 2], dtype=torch.int32)
    dev_args[4] = tuple(torch.cat([x, x], -1)[..., :x.shape[-1]] for x in args[4])  # strided pending inputs
    want, bw = _run(kda_verify_step, args, buf, rows)
    got, bg = _run(kda_verify_step_triton, dev_args, buf, table[:, 0])
    _compare(got, want, bg, bw, rows, 2, 16, 4, torch.float32)


@pytest.mark.parametrize("shape", [dict(Pn=3, T=3), dict(N=2, Pn=2, T=2, K=12, H=3, lengths=[2, 1]),
                                   dict(N=2, Pn=1, T=2, W=5, lengths=[1, 0]), dict(N=1, Pn=3, T=4, lengths=[2])])
def test_kernel_reads_pending_inputs_kept_side_by_side(interpret, shape):
    """The serving form: the seven pending inputs are views of one tensor per request batch (a static-buffer
    verification's output), read through their shared strides as they are."""
    args, buf, rows = _case(**shape, side_by_side=True)
    pend = (*args[4], *args[:4])
    got_views, sn, st = _strided(pend)
    assert all(a is b for a, b in zip(got_views, pend))  # nothing copied (a size-1 dim's stride is no constraint)
    assert (sn, st) == tuple(x if n > 1 else 0 for n, x in zip(pend[0].shape[:2], pend[-1].stride()[:2]))
    want, bw = _run(kda_verify_step, args, buf, rows)
    got, bg = _run(kda_verify_step_triton, args, buf, rows)
    H, K = args[7].shape[2:]
    _compare(got, want, bg, bw, rows, H, K, args[10][0].shape[-1], torch.float32)


def test_inputs_of_other_strides_go_side_by_side_in_one_copy():
    """Pending inputs that do not share their strides (separate tensors, or a view with its inner dims apart) are
    put side by side once, equal to what was given, under one stride pair."""
    args, _, _ = _case(N=3, Pn=2, T=2)
    pend = (*args[4], *args[:4])
    views, sn, st = _strided(pend)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
    assert all(v.stride()[:2] == (sn, st) and torch.equal(v, p) for v, p in zip(views, pend))
    k = args[0]
    apart = torch.cat([k, k], -1)[..., :k.shape[-1]]  # [N, Pn, H, K] whose heads are 2K apart
    assert not _inner_contiguous(apart) and _inner_contiguous(k) and _inner_contiguous(k[:, :1])
    views, _, _ = _strided((apart, args[3]))
    assert torch.equal(views[0], k) and views[0].stride()[2:] == (k.shape[-1], 1)


# --- on a GPU (marked gpu: passed on an H100, 2026-12-07, which validated the op) ------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("T", [4, 2])
@pytest.mark.parametrize("side_by_side", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_equals_the_reference(dtype, side_by_side, T):
    """k3-mini's layer shape (8 heads of 128, conv 4): 16 requests with 0 .. 4 pending positions and a window of T
    (4: the last token and 3 drafts; 2: one draft near max_tokens, after an acceptance of 4 positions, as the static
    buffers of the short window hold them), counts as host ints and as a device tensor; the pending inputs as separate
    tensors and as the serving engine keeps them (views of one tensor)."""
    args, buf, rows = _case(N=16, Pn=4, T=T, H=8, K=128, W=4, dtype=dtype, device="cuda",
                            lengths=[i % 5 for i in range(16)], side_by_side=side_by_side)
    want, bw = _run(kda_verify_step, args, buf, rows)
    for lengths in (args[5], torch.tensor(args[5], dtype=torch.int32, device="cuda")):
        a = list(args)
        a[5] = lengths
        got, bg = _run(kda_verify_step_triton, a, buf, rows)
        _compare(got, want, bg, bw, rows, 8, 128, 4, dtype)
