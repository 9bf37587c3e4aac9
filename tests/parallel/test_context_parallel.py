"""KDA context parallelism (KCP, report §5.1.2) and Gated MLA / the short conv under context parallelism.

(a) the single-process simulation kcp_reference against single-device KDA on the whole packed row; (b) in gloo
process groups of 2 and 4 ranks, kda_context_parallel (and the layer's op entry kda_cp) against single-device KDA;
(c) there too, MLA with the latent gathered across ranks against single-device attention (and its per-head max
logits, QK-Clip's signal, exactly: the same dot products), the short conv with its carried inputs from the previous
rank against the single-device conv, and the rows after each segment (the MTP layer's next tokens). Forward outputs
and gradients.

Tolerances: everything is fp32. KCP is the same math as the whole-row forms, reassociated (chunks restart at every
segment start, the fragments fold in another order), so the results agree to fp32 rounding, measured as the max
error relative to the largest entry: outputs and states within 1e-5 (fp32 epsilon 1.2e-7 grown over a few hundred
tokens); gradients within 5e-5, as a gradient sums contributions from every later token (g's through the cumulative
decay), and single-device kda_chunk and kda_recurrent differ from each other by as much (tests/ops/test_kda.py
bounds their gradients by 1e-4). MLA and the short conv: 1e-5 for outputs and gradients (softmax rows and
convolution taps, no long accumulation).
"""

import datetime
import functools
import random

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from helpers import rel_err

from k3.ops.kda import kda_chunk, kda_recurrent, l2norm, short_conv
from k3.ops.kda_backend import kda_torch
from k3.ops.mla import max_logit, mla_attention
from k3.parallel.context_parallel import (compose_incoming, conv_halo, cp_plan, even_split_points, kcp_reference,
                                          kda_context_parallel, kda_cp, merge_rows, mla_context_parallel,
                                          rows_after, segment_fragments, split_packed_batch, split_rows)

TOL, GRAD_TOL = 1e-5, 5e-5
H, K, V = 2, 16, 16


def kda_inputs(T: int, seed: int = 0):
    """Leaf fp32 KDA inputs [1, T, ...]: unit-norm q/k, log-decay in (-5, 0) (kda_gate's range), beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    xs = (l2norm(torch.randn(1, T, H, K, generator=gen)), l2norm(torch.randn(1, T, H, K, generator=gen)),
          torch.randn(1, T, H, V, generator=gen), -5 * torch.randn(1, T, H, K, generator=gen).sigmoid(),
          torch.randn(1, T, H, generator=gen).sigmoid())
    return [x.requires_grad_() for x in xs]


def loss_weights(T: int, N: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, H, V, generator=gen), torch.randn(N, H, K, V, generator=gen)


def outputs_and_grads(fn, inputs, w_o, w_s):
    """fn(*inputs) -> (o, final states); returns [o, S, d q, d k, d v, d g, d beta] for a random linear loss."""
    for x in inputs:
        x.grad = None
    o, S = fn(*inputs)
    ((o * w_o).sum() + (S * w_s).sum()).backward()
    return [o.detach(), S.detach()] + [x.grad.clone() for x in inputs]


NAMES = ["o", "final_state", "dq", "dk", "dv", "dg", "dbeta"]


def assert_all_close(got, want):
    for name, a, b in zip(NAMES, got, want):
        assert rel_err(a, b) < (GRAD_TOL if name.startswith("d") else TOL), (name, rel_err(a, b))


# ---------------------------------------------------------------------------------------------
# (a) single process: the fragments, the plan, kcp_reference == single-device KDA
# ---------------------------------------------------------------------------------------------


def token_matrix(k, g, beta, t, h):
    """M_t = (I - beta_t k_t k_t^T) Diag(alpha_t) of head h (report Eq. 17), explicitly."""
    kt = k[0, t, h].double()
    return (torch.eye(K, dtype=torch.float64) - beta[0, t, h].double() * torch.outer(kt, kt)) @ torch.diag(
        g[0, t, h].double().exp())


def test_fragments_are_the_transition_and_the_zero_start_state():
    T = 40
    q, k, v, g, beta = (x.detach() for x in kda_inputs(T))
    M, S_t, has_start = segment_fragments(k, v, g, beta, [0, T], continued=True)
    _, S_zero = kda_recurrent(q, k, v, g, beta)
    assert not has_start and rel_err(S_t, S_zero[0]) < TOL
    for h in range(H):
        want = torch.eye(K, dtype=torch.float64)
        for t in range(T):
            want = token_matrix(k, g, beta, t, h) @ want
        assert rel_err(M[h], want) < TOL
    S0 = torch.randn(1, H, K, V)
    _, S_end = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    assert rel_err(M @ S0[0] + S_t, S_end[0]) < TOL  # S_out = M S_in + S~ (Eq. 17)

    # a document start inside the segment: M = 0, S~ = the last document's state from zero
    M, S_t, has_start = segment_fragments(k, v, g, beta, [0, 15, T], continued=True)
    _, S_doc = kda_recurrent(q[:, 15:], k[:, 15:], v[:, 15:], g[:, 15:], beta[:, 15:])
    assert has_start and not M.any() and rel_err(S_t, S_doc[0]) < TOL
    # ... or at its first token (not continued)
    M, S_t, has_start = segment_fragments(k, v, g, beta, [0, T], continued=False)
    assert has_start and not M.any() and rel_err(S_t, S_zero[0]) < TOL


def test_compose_restarts_at_a_document_start():
    A = [torch.randn(H, K, K) for _ in range(3)]
    B = [torch.randn(H, K, V) for _ in range(3)]
    frags = [(A[0], B[0], False), (torch.zeros(H, K, K), B[1], True), (A[2], B[2], False)]
    want = A[2] @ B[1] + B[2]
    assert rel_err(compose_incoming(frags, 3), want) < 1e-6
    # without the flags (None: not known), M = 0 restarts the fold by itself
    assert rel_err(compose_incoming([(m, s, None) for m, s, _ in frags], 3), want) < 1e-6
    assert not compose_incoming(frags, 0).any()


def test_plan_and_batch_split():
    plan = cp_plan(torch.tensor([0, 30, 100, 110, 150]), [45, 100, 120])
    assert [(s.start, s.end, s.cu_seqlens.tolist(), s.continued) for s in plan] == [
        (0, 45, [0, 30, 45], False), (45, 100, [0, 55], True), (100, 120, [0, 10, 20], False),
        (120, 150, [0, 30], True)]
    assert even_split_points(10, 3) == [3, 6]
    ids = torch.arange(12)[None]
    seg = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 2]])
    parts = split_packed_batch(ids, seg, 3, labels=ids + 100)
    assert [p.segment.cu_seqlens.tolist() for p in parts] == [[0, 4], [0, 1, 3, 4], [0, 4]]
    assert [p.segment.continued for p in parts] == [False, True, True]
    assert torch.equal(merge_rows([p.labels for p in parts]), ids + 100)
    assert torch.equal(merge_rows([p.segment_ids for p in parts]), seg)  # document ids stay global
    x = torch.randn(1, 150, 3)
    assert torch.equal(merge_rows(split_rows(x, plan)), x)
    for bad in ([0], [5, 5], [12]):
        with pytest.raises(ValueError, match="split_points"):
            cp_plan([0, 12], bad)


def random_case(seed: int):
    """A random packed row (T in 64 ... 200, documents of random lengths) and random cuts for P in {2, 3, 4}."""
    rng = random.Random(seed)
    T, P = rng.randint(64, 200), rng.choice([2, 3, 4])
    starts = sorted(rng.sample(range(1, T), rng.randint(0, 5)))
    return T, [0, *starts, T], sorted(rng.sample(range(1, T), P - 1))


CASES = [
    (64, [0, 64], [37]),  # one document across the boundary
    (64, [0, 32, 64], [32]),  # a document starting exactly at the boundary
    (150, [0, 30, 100, 110, 150], [45, 120]),  # starts mid-segment, a document ending one segment later
    (200, [0, 10, 190, 200], [50, 100, 150]),  # two segments hold only the middle of a long document
    (97, [0, 1, 2, 60, 97], [2, 3, 61]),  # one-token documents and segments
] + [random_case(s) for s in range(4)]


@pytest.mark.parametrize("T,cu,cuts", CASES)
def test_kcp_reference_matches_single_device_chunk(T, cu, cuts):
    inputs = kda_inputs(T, seed=T)
    cu_t = torch.tensor(cu)
    w_o, w_s = loss_weights(T, len(cu) - 1)
    want = outputs_and_grads(lambda *x: kda_chunk(*x, cu_seqlens=cu_t), inputs, w_o, w_s)
    got = outputs_and_grads(lambda *x: kcp_reference(*x, None, cu_t, cuts), inputs, w_o, w_s)
    assert_all_close(got, want)


def test_kcp_reference_matches_the_recurrence():
    T, cu, cuts = CASES[2]
    inputs = kda_inputs(T, seed=7)
    cu_t = torch.tensor(cu)
    w_o, w_s = loss_weights(T, len(cu) - 1)
    want = outputs_and_grads(lambda *x: kda_recurrent(*x, cu_seqlens=cu_t), inputs, w_o, w_s)
    got = outputs_and_grads(lambda *x: kcp_reference(*x, None, cu_t, cuts, kda_fn=kda_recurrent), inputs, w_o, w_s)
    assert_all_close(got, want)
    got = outputs_and_grads(lambda *x: kcp_reference(*x, None, cu_t, cuts), inputs, w_o, w_s)  # chunked segments
    assert_all_close(got, want)


# ---------------------------------------------------------------------------------------------
# (b, c) gloo process groups: kda_context_parallel, mla_context_parallel, conv_halo
# ---------------------------------------------------------------------------------------------

MLA = dict(H=2, Dn=16, Dr=8, Dv=16, R=32)
ROWS_AFTER = 45
CONV_W, CONV_C = 4, 12


def distributed_inputs(T: int, cu: list[int]):
    gen = torch.Generator().manual_seed(3)
    N = len(cu) - 1
    seg = torch.repeat_interleave(torch.arange(N), torch.tensor(cu).diff())[None]
    m = MLA
    return dict(
        kda=[x.detach() for x in kda_inputs(T, seed=5)], kda_w=loss_weights(T, N),
        q=torch.randn(1, T, m["H"], m["Dn"] + m["Dr"], generator=gen), c=torch.randn(1, T, m["R"], generator=gen),
        k_rope=torch.randn(1, T, m["Dr"], generator=gen),
        w_kv=torch.randn(m["H"] * (m["Dn"] + m["Dv"]), m["R"], generator=gen) * m["R"] ** -0.5,
        mla_w=torch.randn(1, T, m["H"], m["Dv"], generator=gen), segment_ids=seg,
        layer=[torch.randn(1, T, H, K, generator=gen), torch.randn(1, T, H, K, generator=gen),
               torch.randn(1, T, H, V, generator=gen), torch.randn(1, T, H, K, generator=gen),
               torch.randn(1, T, H, generator=gen)],
        layer_params=[0.5 * torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)],
        x=torch.randn(1, T, CONV_C, generator=gen), conv_w=torch.randn(CONV_C, CONV_W, generator=gen),
        conv_out_w=torch.randn(1, T, CONV_C, generator=gen))


def leaf(x):
    return x.detach().clone().requires_grad_()


def final_slices(plan) -> list[slice]:
    """Which of the row's documents end in each segment (the last local one continues where the next does)."""
    ends = [len(s.cu_seqlens) - 1 - (r + 1 < len(plan) and plan[r + 1].continued) for r, s in enumerate(plan)]
    first = [sum(ends[:r]) for r in range(len(plan))]
    return [slice(a, a + n) for a, n in zip(first, ends)]


def cp_worker(rank: int, P: int, store: str, plan, d: dict, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    try:
        s = plan[rank]
        res = {}

        def local(x):
            return leaf(x[:, s.start:s.end])

        # KDA: the loss sees the outputs and the final states of the documents that end in this segment
        xs = [local(x) for x in d["kda"]]
        o, S = kda_context_parallel(*xs, None, s.cu_seqlens, None, s.continued)
        ends = final_slices(plan)[rank]
        S = S[: ends.stop - ends.start]
        w_o, w_s = d["kda_w"]
        ((o * w_o[:, s.start:s.end]).sum() + (S * w_s[ends]).sum()).backward()
        res["kda"] = [o.detach(), S.detach()] + [x.grad for x in xs]

        # the layer's op entry (raw logits) under KCP; A_log and dt_bias are replicated, their gradients partial
        xs, params = [local(x) for x in d["layer"]], [leaf(p) for p in d["layer_params"]]
        o, _ = kda_cp(*xs, *params, -5.0, s.cu_seqlens, None, s.continued)
        (o * w_o[:, s.start:s.end]).sum().backward()
        res["layer"] = [o.detach()] + [x.grad for x in xs + params]

        # MLA with the latent gathered from the earlier ranks
        q, c, kr, w = local(d["q"]), local(d["c"]), local(d["k_rope"]), leaf(d["w_kv"])
        scale = (MLA["Dn"] + MLA["Dr"]) ** -0.5
        o, top = mla_context_parallel(q, c, kr, lambda x: F.linear(x, w), scale, d["segment_ids"][:, s.start:s.end],
                                      None, s.lengths, return_max_logit=True)
        (o * d["mla_w"][:, s.start:s.end]).sum().backward()
        dist.all_reduce(top, op=dist.ReduceOp.MAX)  # QK-Clip's maxima over the ranks' queries
        res["mla"] = [o.detach(), q.grad, c.grad, kr.grad, w.grad, top]

        # the rows after this segment (the MTP layer's next tokens), here more than the next segment holds
        res["after"] = rows_after(torch.arange(s.start, s.end)[None], ROWS_AFTER, None, s.lengths)

        # short conv with the previous segment's last W - 1 inputs
        x, cw = local(d["x"]), leaf(d["conv_w"])
        y, _ = short_conv(x, cw, conv_halo(x, CONV_W, s.cu_seqlens, None, s.continued), cu_seqlens=s.cu_seqlens)
        (y * d["conv_out_w"][:, s.start:s.end]).sum().backward()
        res["conv"] = [y.detach(), x.grad, cw.grad]
        torch.save(res, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("T,cu,cuts", [
    (120, [0, 50, 120], [70]),  # P = 2, unequal segments, a document crossing
    (140, [0, 20, 64, 100, 140], [30, 60, 100]),  # P = 4: a segment inside one document, a start at a boundary
])
def test_distributed_gloo_matches_single_device(tmp_path, T, cu, cuts):
    plan, d = cp_plan(cu, cuts), distributed_inputs(T, cu)
    P = len(plan)
    # fork: the children inherit the imported modules (a spawned interpreter re-imports torch, seconds each)
    mp.start_processes(cp_worker, args=(P, str(tmp_path / "store"), plan, d, str(tmp_path)), nprocs=P,
                       start_method="fork")
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(P)]

    def merged(key, i, dim=1):
        return torch.cat([r[key][i] for r in res], dim=dim)

    # KDA against the single-device chunked form
    cu_t = torch.tensor(cu)
    want = outputs_and_grads(lambda *x: kda_chunk(*x, cu_seqlens=cu_t), [leaf(x) for x in d["kda"]], *d["kda_w"])
    got = [merged("kda", 0), merged("kda", 1, dim=0)] + [merged("kda", i) for i in range(2, 7)]
    assert_all_close(got, want)

    # the layer's op entry against its single-device reference
    xs, params = [leaf(x) for x in d["layer"]], [leaf(p) for p in d["layer_params"]]
    o, _ = kda_torch(*xs, *params, -5.0, cu_seqlens=cu_t)
    (o * d["kda_w"][0]).sum().backward()
    assert rel_err(merged("layer", 0), o) < TOL
    for i, (name, x) in enumerate(zip(["q", "k", "v", "z", "beta_logits"], xs), start=1):
        assert rel_err(merged("layer", i), x.grad) < GRAD_TOL, name
    for i, (name, p) in enumerate(zip(["A_log", "dt_bias"], params), start=6):
        assert rel_err(sum(r["layer"][i] for r in res), p.grad) < GRAD_TOL, name  # summed like a replicated param

    # MLA against single-device attention over the whole row
    m = MLA
    q, c, kr, w = leaf(d["q"]), leaf(d["c"]), leaf(d["k_rope"]), leaf(d["w_kv"])
    k_nope, v = F.linear(c, w).view(1, T, m["H"], m["Dn"] + m["Dv"]).split([m["Dn"], m["Dv"]], dim=-1)
    k = torch.cat([k_nope, kr[:, :, None].expand(1, T, m["H"], m["Dr"])], dim=-1)
    o = mla_attention(q, k, v, (m["Dn"] + m["Dr"]) ** -0.5, segment_ids=d["segment_ids"])
    (o * d["mla_w"]).sum().backward()
    for name, a, b in [("o", merged("mla", 0), o), ("dq", merged("mla", 1), q.grad), ("dc", merged("mla", 2), c.grad),
                       ("dk_rope", merged("mla", 3), kr.grad), ("dw_kv", sum(r["mla"][4] for r in res), w.grad)]:
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))
    top = max_logit(q, k, (m["Dn"] + m["Dr"]) ** -0.5, d["segment_ids"])
    for r in res:  # the same dot products, so the same maxima
        assert torch.equal(r["mla"][5], top), (r["mla"][5], top)
    for s, r in zip(plan, res):
        assert torch.equal(r["after"], torch.arange(s.end, min(s.end + ROWS_AFTER, T))[None]), s.rank

    # short conv against the single-device packed conv
    x, cw = leaf(d["x"]), leaf(d["conv_w"])
    y, _ = short_conv(x, cw, None, cu_seqlens=cu_t)
    (y * d["conv_out_w"]).sum().backward()
    for name, a, b in [("y", merged("conv", 0), y), ("dx", merged("conv", 1), x.grad),
                       ("dw", sum(r["conv"][2] for r in res), cw.grad)]:
        assert rel_err(a, b) < TOL, (name, rel_err(a, b))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T,cu,cuts", CASES[:3])
def test_kcp_on_fla_chunks_matches_single_device_chunk_on_cuda(T, cu, cuts):
    # op kda_chunk's fla path (fla-core's chunk_kda in KCP's fragment pass, of value width K + V, and in its
    # segments) against the fp32 reference over the whole row; tolerance as the registry states for op kda_chunk
    from k3.ops.kda_backend import kda_chunk_fla
    from k3.ops.registry import importable

    ok, why = importable("fla.ops.kda")
    if not ok:
        pytest.skip(why)
    inputs = [x.detach().cuda().requires_grad_() for x in kda_inputs(T, seed=T)]
    cu_t = torch.tensor(cu, device="cuda")
    w_o, w_s = (w.cuda() for w in loss_weights(T, len(cu) - 1))
    want = outputs_and_grads(lambda *x: kda_chunk(*x, cu_seqlens=cu_t), inputs, w_o, w_s)
    fla = functools.partial(kda_chunk_fla, g_min=-5.0)
    got = outputs_and_grads(lambda *x: kcp_reference(*x, None, cu_t, cuts, kda_fn=fla), inputs, w_o, w_s)
    for i, (a, b) in enumerate(zip(got, want)):
        assert rel_err(a, b) < (5e-3 if i < 2 else 1e-2), i
