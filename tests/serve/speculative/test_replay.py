"""KDA rollback by replay and MLA truncation: a verification leaves the committed state alone, the replay of the
accepted prefix equals feeding those tokens one at a time, and truncation returns the pages past the accepted
length."""

import pytest
import torch
from helpers import strong_kda_layer

from k3.config import K3Config
from k3.model.cache import KDACache
from k3.ops.kda_replay import kda_replay, kda_replay_triton
from k3.serve.cache.prefix import PrefixCache
from k3.serve.cache.views import KDAVerifyView

# fp32 throughout: the replay runs the same token recurrence as decoding, so they agree to fp32 rounding of a few
# dozen multiply-adds per state entry (observed ~1e-7; 1e-5 leaves room for another summation order).
TOL = 1e-5


@torch.no_grad()
def test_replay_equals_feeding_the_accepted_tokens_one_at_a_time():
    layer, cfg = strong_kda_layer()
    B, T, D = 3, 6, cfg.hidden_size
    g = torch.Generator().manual_seed(2)
    prefix = torch.randn(B, 7, D, generator=g)
    window = torch.randn(B, T, D, generator=g)  # the last token and T - 1 drafts
    committed = KDACache()
    layer(prefix, committed)  # the committed state and conv tails after 7 tokens
    state0, conv0 = committed.state.clone(), [c.clone() for c in committed.conv]

    view = KDAVerifyView(state0.clone(), torch.stack(conv0, 1))
    layer(window, view)
    assert torch.equal(view.state, state0)  # verification does not advance the committed state
    inp = view.inputs
    lengths = [1, 4, T]  # accepted drafts 0, 3 and all, plus the position before them
    state, conv = kda_replay(inp.q, inp.k, inp.v, inp.z, inp.beta_logits, torch.stack(inp.pre_conv, 2), layer.A_log,
                             layer.dt_bias, layer.lower_bound, state0, torch.stack(conv0, 1), lengths)
    for b, n in enumerate(lengths):
        ref = KDACache()
        ref.update(state0[b:b + 1].clone(), [c[b:b + 1].clone() for c in conv0])
        for t in range(n):
            layer(window[b:b + 1, t:t + 1], ref)
        scale = ref.state.abs().max()
        assert (state[b] - ref.state[0]).abs().max() <= TOL * scale, b
        ref_conv = torch.stack(ref.conv, 1)[0]
        assert (conv[b] - ref_conv).abs().max() <= TOL * ref_conv.abs().max(), b
    # a wrong length gives a different state: the test can tell
    assert (state[1] - state[2]).abs().max() > 1e-3 * state[2].abs().max()


@torch.no_grad()
def test_replay_in_two_pieces_equals_one():
    """The engine splits a replay at a hash-block boundary (to checkpoint the state there): same result."""
    layer, cfg = strong_kda_layer()
    g = torch.Generator().manual_seed(3)
    committed = KDACache()
    layer(torch.randn(2, 5, cfg.hidden_size, generator=g), committed)
    state0, conv0 = committed.state, torch.stack(committed.conv, 1)
    view = KDAVerifyView(state0, conv0)
    layer(torch.randn(2, 5, cfg.hidden_size, generator=g), view)
    x = view.inputs
    pre = torch.stack(x.pre_conv, 2)
    args = (layer.A_log, layer.dt_bias, layer.lower_bound)
    whole = kda_replay(x.q, x.k, x.v, x.z, x.beta_logits, pre, *args, state0, conv0, [5, 4])
    s1, c1 = kda_replay(x.q, x.k, x.v, x.z, x.beta_logits, pre, *args, state0, conv0, [2, 1])
    sl = (slice(None), slice(2, 5))
    s2, c2 = kda_replay(x.q[sl], x.k[sl], x.v[sl], x.z[sl], x.beta_logits[sl], pre[sl], *args, s1, c1, [3, 3])
    sl1 = (slice(1, 2), slice(1, 4))
    s3, c3 = kda_replay(x.q[sl1], x.k[sl1], x.v[sl1], x.z[sl1], x.beta_logits[sl1], pre[sl1], *args, s1[1:], c1[1:],
                        [3])
    assert (s2[0] - whole[0][0]).abs().max() <= TOL * whole[0].abs().max()
    assert torch.equal(c2[0], whole[1][0])
    assert (s3[0] - whole[0][1]).abs().max() <= TOL * whole[0].abs().max()
    assert torch.equal(c3[0], whole[1][1])


def test_truncate_releases_the_pages_past_the_accepted_length():
    pc = PrefixCache(num_pages=40, num_mla_groups=2, num_kda_groups=1, page_tokens=8, hash_block_tokens=4)
    pc.admit("a", list(range(1, 12)))
    pc.ensure_capacity("a", 11)
    pc.register_tokens("a", list(range(1, 12)))  # 11 computed tokens: 2 pages per MLA group
    free = pc.stats()["free_pages"]
    pc.ensure_capacity("a", 11 + 1 + 7)  # a verification of 1 + 7 positions: up to 19 tokens, 3 pages per group
    assert pc.stats()["free_pages"] == free - 2
    tables = pc.block_tables("a")
    assert pc.truncate("a", 13) == 2  # 2 accepted: 13 tokens fit in 2 pages per group
    assert pc.stats()["free_pages"] == free
    assert pc.block_tables("a") == [t[:2] for t in tables]
    assert pc.truncate("a", 13) == 0  # nothing more to release
    pc.check_invariants()
    try:
        pc.truncate("a", 10)
    except ValueError as e:
        assert "registered" in str(e)
    else:
        raise AssertionError("truncating below the registered tokens must fail")


# --- the fused replay kernel (k3.ops.kda_replay.kda_replay_triton) ------------------------------------------------
# Run in Triton's interpreter on CPU (TRITON_INTERPRET=1, set in-process) and compiled on a GPU. fp32: 1e-5 of the
# largest state entry (the op's tolerance: the K-term reads summed in another order). bf16 inputs in the
# interpreter: 1e-2, because the interpreter truncates the normalized key to bf16 where the reference (and the
# compiled kernel) rounds it, one bf16 step in some key entries; compiled, bf16 is held to 1e-5 like fp32.

def _replay_case(N=3, L=5, H=2, K=16, V=24, P=40, W=4, dtype=torch.float32, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q, k, z = (torch.randn(N, L, H, K, generator=g).to(device, dtype) for _ in range(3))
    v = torch.randn(N, L, H, V, generator=g).to(device, dtype)
    beta = torch.randn(N, L, H, generator=g).to(device, dtype)
    pre = torch.randn(N, L, 3, P, generator=g).to(device, dtype)
    A_log, dt_bias = (torch.randn(H, generator=g) * 0.5).to(device), torch.randn(H * K, generator=g).to(device)
    state, conv = torch.randn(N, H, K, V, generator=g).to(device), torch.randn(N, 3, P, W - 1, generator=g).to(device)
    return q, k, v, z, beta, pre, A_log, dt_bias, -5.0, state, conv


@pytest.fixture
def interpret(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("shape", [dict(), dict(K=12, V=40, H=3), dict(N=1, L=1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_kernel_equals_the_reference(interpret, shape, dtype):
    args = _replay_case(**shape, dtype=dtype)
    N, L = args[0].shape[:2]
    lengths = [1 + (i * 2) % L for i in range(N)]
    want_state, want_conv = kda_replay(*args, lengths)
    state, conv = kda_replay_triton(*args, lengths)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert state.dtype == torch.float32 and (state - want_state).abs().max() <= tol * want_state.abs().max()
    assert torch.equal(conv, want_conv)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_replay_kernel_in_the_engine_keeps_greedy_output(interpret, graphs, monkeypatch):
    # "static": verifications on static buffers (cuda_graphs="eager"), replayed after acceptance, every layer in one
    # launch of the kernel from the flat kept inputs (ModelRunner._replay_layers); the paged attention on its
    # reference (interpreted, its kernel would be most of the time; it has tests of its own)
    import k3.ops.mla_decode
    from k3.ops.registry import Backends

    import k3.ops.kda_replay

    monkeypatch.setattr(k3.ops.mla_decode, "_use_triton", lambda kv: False)
    launches = []  # the replays of every layer at once: their inputs' shapes [G, N, L, H, K]
    real = k3.ops.kda_replay.kda_replay_layers_triton
    monkeypatch.setattr(k3.ops.kda_replay, "kda_replay_layers_triton",
                        lambda *a: launches.append(tuple(a[0].shape)) or real(*a))
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=1, vocab_size=256)
    torch.manual_seed(0)
    from k3.model.model import K3ForCausalLM

    model = K3ForCausalLM(cfg).init_weights(seed=3).eval()
    prompt = torch.randint(1, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    per_op = {"kda_replay": "triton"} | ({"mla_decode": "triton", "moe": "grouped"} if graphs else {})
    for spec, backends in (("off", None), ("mtp", Backends(per_op=per_op))):
        model.set_backends(backends)
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=4.0, page_tokens=32, hash_block_tokens=16,
                                                  speculative=spec, num_draft_tokens=2, fused_replay=False,
                                                  cuda_graphs="eager" if graphs and spec != "off" else False))
        eng.eos_id = None
        seq = eng.add_request(prompt, SamplingParams(max_tokens=8, temperature=0))
        while eng.has_work():
            eng.step()
        outs.append(seq.output_ids)
    assert eng.metrics.spec_verifications > 0 and outs[0] == outs[1]
    n_kda = sum(cfg.is_kda_layer(i) for i in range(cfg.num_hidden_layers))
    assert not graphs or (eng.runner.graphs.verify_steps > 0 and launches and {s[0] for s in launches} == {n_kda})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_replay_kernel_equals_the_reference(dtype):
    args = _replay_case(N=16, L=8, H=8, K=128, V=128, P=1024, dtype=dtype, device="cuda")
    lengths = [1 + i % 8 for i in range(16)]
    want_state, want_conv = kda_replay(*args, lengths)
    state, conv = kda_replay_triton(*args, lengths)
    assert (state - want_state).abs().max() <= 1e-5 * want_state.abs().max()
    assert torch.equal(conv, want_conv)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_replay_does_not_wait_for_the_device():
    # The fused replay's host list (lengths) reaches the GPU through pinned memory: a copy from pageable memory would
    # make the host wait for the device's queue, once per KDA layer and verification
    import warnings

    args = _replay_case(N=4, L=4, H=8, K=128, V=128, P=1024, device="cuda")
    lengths = [1, 2, 3, 4]
    kda_replay_triton(*args, lengths)  # warm-up: the kernel's compile, the pinned-memory pool
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kda_replay_triton(*args, lengths)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]


def test_replayed_positions_of_one_row_are_views_equal_to_the_gather():
    # batch 1 replays from views of its row (no kernel); several rows gather; both give [R, L, ...] equal to picking
    # each row's positions (clamped to the T verified ones) by hand, strided members included
    from k3.model.cache import KDAInputs
    from k3.serve.runner import ReplayedPositions

    g = torch.Generator().manual_seed(4)
    B, T, H, K = 3, 5, 2, 4
    wide = torch.randn(B, T, 3 * H * K + H, generator=g)  # a stacked GEMM's output: its splits are strided views
    pre = tuple(wide[..., i * H * K:(i + 1) * H * K] for i in range(3))
    inp = KDAInputs(pre, *(torch.randn(B, T, H, K, generator=g) for _ in range(4)), wide[..., 3 * H * K:])

    def by_hand(rows, offsets, L):
        pos = [[min(o + t, T - 1) for t in range(L)] for o in offsets]
        pick = lambda x: torch.stack([x[r, p] for r, p in zip(rows, pos)])  # noqa: E731
        return [pick(x) for x in (*inp.pre_conv, inp.q, inp.k, inp.v, inp.z, inp.beta_logits)]

    for rows, offsets, lengths in (([1], [2], [3]), ([2], [0], [5]), ([0, 2], [1, 0], [2, 4]), ([1], [3], [3])):
        pick = ReplayedPositions(rows, offsets, lengths, T, torch.device("cpu"))
        got = pick(inp)
        flat = [*got.pre_conv, got.q, got.k, got.v, got.z, got.beta_logits]
        for a, b in zip(flat, by_hand(rows, offsets, max(lengths))):
            assert torch.equal(a, b)
        one_in_range = len(rows) == 1 and offsets[0] + lengths[0] <= T
        assert pick.view == one_in_range
        if pick.view:  # views of the verification's tensors: nothing copied
            assert got.q.data_ptr() == inp.q[rows[0], offsets[0]].data_ptr()
            assert pick.rows == slice(rows[0], rows[0] + 1)
        else:
            assert pick.rows.tolist() == rows


def test_flat_inputs_put_every_layers_kept_inputs_side_by_side_and_views_give_them_back():
    """k3.serve.cache.views.flat_inputs / inputs_of: one tensor [B, T, layers * width] holding each KDA layer's kept
    inputs (strided ones, as the stacked projection's slices are, included), and views of it equal to them."""
    from k3.model.cache import KDAInputs
    from k3.serve.cache.views import flat_inputs, inputs_of, kept_width

    g = torch.Generator().manual_seed(0)
    B, T, H, K = 2, 3, 2, 4
    C = H * K
    layers = []
    for _ in range(3):
        stacked = torch.randn(B, T, 3 * C + H + 5, generator=g)
        pre = tuple(stacked[..., i * C:(i + 1) * C] for i in range(3))
        layers.append(KDAInputs(pre, *(torch.randn(B, T, H, K, generator=g) for _ in range(4)),
                                stacked[..., 3 * C:3 * C + H]))
    flat = flat_inputs(layers)
    assert flat.shape == (B, T, 3 * kept_width(H, K)) and kept_width(H, K) == 7 * C + H
    for i, want in enumerate(layers):
        got = inputs_of(flat, i, H, K)
        assert all(torch.equal(a, b) for a, b in zip(got.pre_conv, want.pre_conv))
        for a, b in ((got.q, want.q), (got.k, want.k), (got.v, want.v), (got.z, want.z),
                     (got.beta_logits, want.beta_logits)):
            assert a.shape == b.shape and torch.equal(a, b)
        assert got.q.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # a view, not a copy
    row = flat[1, 1:]  # a request's held positions: the views of a slice are the slices of the views
    assert torch.equal(inputs_of(row, 2, H, K).z, layers[2].z[1, 1:])


def _layers_case(G=3, N=2, L=4, H=2, K=16, W=4, dtype=torch.float32, device="cpu", seed=0):
    """G layers' kept inputs side by side (flat [N, L, G * width]) with their gate parameters and committed states."""
    from k3.serve.cache.views import kept_width

    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(N, L, G * kept_width(H, K), generator=g).to(device, dtype)
    A_log, dt_bias = (torch.randn(G, H, generator=g) * 0.5).to(device), torch.randn(G, H * K, generator=g).to(device)
    state = torch.randn(G * N, H, K, K, generator=g).to(device)
    conv = torch.randn(G * N, 3, H * K, W - 1, generator=g).to(device)
    return flat, A_log, dt_bias, state, conv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_of_every_layer_at_once_equals_each_layer_alone(interpret, dtype):
    # kda_replay_layers_triton: G layers in one launch, reading each layer's inputs through the strides of views of the
    # flat kept inputs (k3.serve.cache.views.replay_inputs_of: nothing copied), each under its own A_log and dt_bias;
    # equal to the reference layer by layer (kda_replay_layers) and to the one-layer kernel on each layer's inputs
    from k3.ops.kda_replay import kda_replay_layers, kda_replay_layers_triton
    from k3.serve.cache.views import inputs_of, replay_inputs_of

    G, N, L, H, K = 3, 2, 4, 2, 16
    flat, A_log, dt_bias, state, conv = _layers_case(G, N, L, H, K, dtype=dtype)
    k, v, z, beta, pre = replay_inputs_of(flat, G, H, K)
    assert k.shape == (G, N, L, H, K) and pre.shape == (G, N, L, 3, H * K)
    assert k.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views
    lengths = [3, 1]
    want_state, want_conv = kda_replay_layers(k, v, z, beta, pre, A_log, dt_bias, -5.0, state, conv, lengths)
    got_state, got_conv = kda_replay_layers_triton(k, v, z, beta, pre, A_log, dt_bias, -5.0, state, conv, lengths)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got_state - want_state).abs().max() <= tol * want_state.abs().max()
    assert torch.equal(got_conv, want_conv)
    for g in range(G):  # each layer alone, from its own views (inputs_of), as the per-layer path replays it
        i = inputs_of(flat, g, H, K)
        s, c = kda_replay_triton(i.q, i.k, i.v, i.z, i.beta_logits, torch.stack(i.pre_conv, 2), A_log[g], dt_bias[g],
                                 -5.0, state[g * N:(g + 1) * N], conv[g * N:(g + 1) * N], lengths)
        assert torch.equal(s, got_state[g * N:(g + 1) * N]) and torch.equal(c, got_conv[g * N:(g + 1) * N])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_replay_of_every_layer_at_once_equals_the_reference(dtype):
    from k3.ops.kda_replay import kda_replay_layers, kda_replay_layers_triton
    from k3.serve.cache.views import replay_inputs_of

    G, N, L, H, K = 9, 4, 4, 8, 128
    flat, A_log, dt_bias, state, conv = _layers_case(G, N, L, H, K, dtype=dtype, device="cuda")
    args = (*replay_inputs_of(flat, G, H, K), A_log, dt_bias, -5.0, state, conv, [1, 2, 3, 4])
    want_state, want_conv = kda_replay_layers(*args)
    got_state, got_conv = kda_replay_layers_triton(*args)
    assert (got_state - want_state).abs().max() <= 1e-5 * want_state.abs().max()
    assert torch.equal(got_conv, want_conv)
