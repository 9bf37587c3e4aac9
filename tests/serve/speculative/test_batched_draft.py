"""The batched draft (MTPDraft.propose, Eagle3Draft.propose: each request's first step alone, the later steps of all
requests in one forward per step over contexts of different lengths) equals the one-request-at-a-time reference
(`propose_sequential`): the same tokens, and distributions within 1e-5, greedy and sampled, with different numbers
of drafts per request; and a request's context is left as the reference leaves it."""

import contextlib
import warnings

import pytest
import torch

from helpers import randomize_
from k3.config import K3Config
from k3.model.eagle3 import Eagle3Layer
from k3.model.model import K3ForCausalLM
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import Sequence
from k3.serve.speculative.draft import Eagle3Draft, MTPDraft

VOCAB = 512


def _model():
    cfg = K3Config.from_preset("tiny").replace(vocab_size=VOCAB, eos_token_id=0)
    return randomize_(K3ForCausalLM(cfg), seed=4).eval()


def _draft(kind, model, window=40, chain_graphs=False):
    if kind == "mtp":
        return MTPDraft(model, window=window, chain_graphs=chain_graphs)
    p = next(model.parameters())
    layer = Eagle3Layer(model.config).to(device=p.device, dtype=p.dtype)
    layer.mtp.load_state_dict(model.mtp[0].state_dict())  # the target's MTP layer, and a random fusion W_E3
    with torch.no_grad():
        layer.fc.weight.copy_(torch.randn(layer.fc.weight.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    layer.eval()
    return Eagle3Draft(model, layer, window=window, chain_graphs=chain_graphs)


def _width(draft):
    """The width of what the draft observes per position: the hidden state, or (EAGLE-3) the block features too."""
    return draft.layer.feature_width if isinstance(draft, Eagle3Draft) else draft.model.config.hidden_size


def _seqs(lengths, temperature, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        s = Sequence(torch.randint(1, VOCAB, (n + 1,), generator=g).tolist(),
                     SamplingParams(max_tokens=16, temperature=temperature, top_k=50 if temperature else None),
                     request_id=f"r{i}")
        s.num_computed = n  # positions 0 .. n-1 computed; token n sampled, not yet run through the target
        s.generator = torch.Generator().manual_seed(100 + i)
        out.append(s)
    return out


def _observe(draft, seqs, width, seed=1):
    g = torch.Generator().manual_seed(seed)
    for s in seqs:
        # observed in two pieces, as a prefill chunk and a decode step would hand them over
        h = torch.randn(s.num_computed, width, generator=g)
        draft.observe(s, 0, h[:-1])
        draft.observe(s, s.num_computed - 1, h[-1:])


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batched_proposals_equal_the_sequential_reference(kind, temperature):
    model = _model()
    width = model.config.hidden_size * (1 + (len(Eagle3Layer(model.config).blocks) if kind == "eagle3" else 0))
    lengths, ks = [7, 30, 1, 55, 12], [3, 1, 4, 4, 2]  # 55 > the window: a bounded context
    runs = {}
    for mode in ("batched", "sequential"):
        torch.manual_seed(0)
        draft = _draft(kind, model)
        seqs = _seqs(lengths, temperature)
        _observe(draft, seqs, width)
        groups = []  # the batched first step's rows, in groups of at most first_tokens() positions (64 here)
        draft._first_step = lambda prep, n, d=draft: (groups.append(len(n) * max(n)),
                                                      type(d)._first_step(d, prep, n))[1]
        props = (draft.propose if mode == "batched" else draft.propose_sequential)(seqs, ks)
        if mode == "batched":
            assert draft.first_tokens() == 64 and len(groups) > 1 and max(groups) <= 64
        # a second round after one more committed position each: the contexts were left alike
        for s in seqs:
            s.prompt_ids.append(1)
            s.num_computed += 1
        _observe_more = torch.Generator().manual_seed(9)
        for s in seqs:
            draft.observe(s, s.num_computed - 1, torch.randn(1, width, generator=_observe_more))
        props2 = (draft.propose if mode == "batched" else draft.propose_sequential)(seqs, ks)
        runs[mode] = (props + props2, [draft._ctx[s.request_id].cache.length for s in seqs],
                      [s.generator.get_state() for s in seqs])
    (pa, la, ga), (pb, lb, gb) = runs["batched"], runs["sequential"]
    assert la == lb  # contexts of the same length (committed rows only, within the window)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))  # each request's generator drew the same number of times
    for a, b in zip(pa, pb):
        assert a.tokens == b.tokens
        if temperature == 0:
            assert a.q is None and b.q is None
        else:
            torch.testing.assert_close(a.q, b.q, atol=1e-5, rtol=0)


def test_first_step_groups_keep_rows_times_the_longest_within_the_bound():
    from k3.serve.speculative.draft import _first_groups

    assert _first_groups([7, 30, 1, 40, 12], 64) == [[0, 1], [2], [3], [4]]
    assert _first_groups([4] * 64, 64) == [list(range(16)), list(range(16, 32)), list(range(32, 48)),
                                           list(range(48, 64))]
    assert _first_groups([100, 3], 64) == [[0], [1]]  # a row longer than the bound runs alone
    assert _first_groups([5, 5, 5], 4096) == [[0, 1, 2]] and _first_groups([], 64) == []


def test_a_request_with_nothing_observed_gets_placeholder_drafts_beside_batched_ones():
    model = _model()
    draft = _draft("mtp", model)
    seqs = _seqs([5, 9], 0.0)
    _observe(draft, seqs[:1], model.config.hidden_size)
    props = draft.propose(seqs, [3, 2])
    assert len(props[0].tokens) == 3
    assert props[1].tokens == [seqs[1].tokens[9]] * 2


def _host_greedy(draft, seq, k):
    """The greedy drafts chosen one at a time on the host (each token read back, then embedded for the next step):
    the reference of the draft's on-device chain."""
    h, cache = draft._first(seq)
    committed = cache.length
    emb = draft.model.model.embed_tokens
    tokens = []
    with torch.no_grad():
        for i in range(k):
            tokens.append(int(draft.model.head(h)[0, -1].argmax()))
            if i + 1 < k:
                h = draft._step(h, emb(torch.tensor([[tokens[-1]]])), False, cache)
    cache.truncate(committed)
    return tokens


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_greedy_drafts_chained_on_the_device_equal_host_choices(kind):
    # the greedy drafts are chained on the device (argmax feeding the next embedding, one read-back per proposal),
    # alone (one request) and batched; a host loop choosing each token is the reference
    model = _model()
    width = model.config.hidden_size * (1 + (len(Eagle3Layer(model.config).blocks) if kind == "eagle3" else 0))
    lengths, ks = [7, 30, 12], [3, 4, 2]
    ref, ref_seqs = _draft(kind, model), _seqs(lengths, 0.0)
    _observe(ref, ref_seqs, width)
    want = [_host_greedy(ref, s, k) for s, k in zip(ref_seqs, ks)]
    assert len(set(map(tuple, want))) == 3  # distinct drafts: a row mix-up would show
    draft = _draft(kind, model)
    seqs = _seqs(lengths, 0.0)
    _observe(draft, seqs, width)
    assert [p.tokens for p in draft.propose(seqs, ks)] == want
    draft = _draft(kind, model)
    seqs = _seqs(lengths[:1], 0.0)
    _observe(draft, seqs, width)
    assert draft.propose(seqs, ks[:1])[0].tokens == want[0]


@pytest.mark.parametrize("paged", [False, True], ids=["absorbed", "paged"])
@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_greedy_chains_on_static_buffers_equal_the_eager_drafts(kind, paged, monkeypatch):
    # The greedy drafting steps after the first run on a chain of static buffers (what a CUDA graph captures;
    # here uncaptured, "eager"): contexts copied into [rows bucket, length bucket] buffers, padding rows of length 0,
    # lengths never read back. The drafts equal the eager ones, alone and batched (3 requests in a bucket of 4),
    # across two proposals (the buffers refilled), and in a larger context bucket once the window passes 64 rows.
    # An EAGLE-3 draft's whole-proposal chain takes its observed block features ((n + 1) D wide) in its first step.
    # `paged`: the paged decode attention on (op mla_decode, as the fast backends take it): the chain's attention
    # reads its buffers as the paged decode kernel's page pool (on a CPU the kernel's reference: the same gathers and
    # masks its tests hold the kernel to), against the eager drafts' absorbed form; every chained drafting step then
    # takes the paged form, the first step's several queries per row included.
    from k3.model.common import set_backends
    from k3.model.gated_mla import GatedMLA
    from k3.ops.registry import Backends

    model = _model()
    queries = []
    if paged:
        model.set_backends(Backends(per_op={"mla_decode": "triton"}))
        real = GatedMLA.paged

        def counted(self, q, *a, **kw):
            queries.append(q.shape[1])
            return real(self, q, *a, **kw)

        monkeypatch.setattr(GatedMLA, "paged", counted)
    for window, lengths, ks in [(40, [7, 30, 12], [3, 4, 2]), (100, [90, 5], [3, 3])]:
        eager, chained = _draft(kind, model, window), _draft(kind, model, window, chain_graphs="eager")
        assert eager.chains is None and chained.chains is not None
        # a chain computes the layer's AttnRes site queries once and every drafting step of it takes them
        made_q, given = [], []
        chained.site_queries = lambda d=chained, q=made_q: q.append(type(d).site_queries(d)) or q[-1]
        chained._step = lambda *a, d=chained, g=given, **kw: (g.append(a[4] if len(a) > 4 else None),
                                                              type(d)._step(d, *a, **kw))[1]
        for d in (eager, chained):  # an EAGLE-3 layer takes the target's backends, as load_draft sets them
            set_backends(d.layer, model.backends)
        width = _width(eager)
        for group in (lengths[:1], lengths):
            got = {}
            for name, draft in (("eager", eager), ("chained", chained)):
                seqs = _seqs(group, 0.0, seed=len(group))
                _observe(draft, seqs, width)
                got[name] = [p.tokens for p in draft.propose(seqs, ks[:len(group)])]
                g = torch.Generator().manual_seed(7)
                # then rounds of 1-3 newly committed positions per request (accepted drafts and the bonus token),
                # different per request, each followed by a proposal that reads the rows the last one kept
                for r, more in enumerate([[1, 3, 2], [2, 1, 3], [1, 1, 1]]):
                    for s, m in zip(seqs, more):
                        s.prompt_ids.extend(torch.randint(1, VOCAB, (m,), generator=g).tolist())
                        draft.observe(s, s.num_computed, torch.randn(m, width, generator=g))
                        s.num_computed += m
                    got[name] += [p.tokens for p in draft.propose(seqs, ks[:len(group)])]
                for s in seqs:
                    draft.forget(s)
            assert got["chained"] == got["eager"]
        assert made_q and sum(any(x is q for q in made_q) for x in given) > len(made_q)
        # both forms ran: the chain after an eager first step (first proposals: whole prompts observed), and the
        # whole proposal on one chain (second proposals: one new position each, at most k + 1 pending)
        k = max(ks)
        made = chained.chains.made
        want_rows = {1, 4} if len(lengths) == 3 else {1, 2}
        assert {rows for rows, _, _, _ in made} == want_rows
        assert {length for _, length, _, first in made if not first} == ({64} if window == 40 else {128})
        assert {first for *_, first in made} == {0} | {max(ks[:len(g)]) + 1 for g in (lengths[:1], lengths)}
        assert all(kk <= k for _, _, kk, _ in made)
        for (r, n, _, _), chain in made.items():  # chains of one (rows, length) share their context buffers
            assert all(other.cache.c is chain.cache.c for (r2, n2, _, _), other in made.items() if (r2, n2) == (r, n))
        assert any(sum((r2, n2) == (r, n) for r2, n2, _, _ in made) > 1 for r, n, _, _ in made)
    assert (1 in queries and max(queries) == 5) if paged else not queries  # 5: a first step of k + 1 = 5
    with pytest.raises(ValueError, match="chain_graphs"):
        MTPDraft(model, chain_graphs="yes")
    assert MTPDraft(model, chain_graphs=True).chains is None  # capture is for CUDA: a CPU model drafts eagerly


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_gpu_captured_greedy_chains_equal_the_eager_drafts(kind):
    # the chains captured as CUDA graphs (a bf16 model on the fast backends the engine's graphs need), one request
    # and three, two proposals each: the same drafts as the same static buffers uncaptured (which the CPU test holds
    # equal to drafting without them)
    from k3.ops.registry import Backends

    model = _model().cuda().to(torch.bfloat16)
    model.set_backends(Backends(default="fast"))
    eager, chained = _draft(kind, model, chain_graphs="eager"), _draft(kind, model, chain_graphs=True)
    width = _width(eager)
    for group in ([7], [7, 30, 12]):
        got = {}
        for name, draft in (("eager", eager), ("chained", chained)):
            seqs = _seqs(group, 0.0, seed=len(group))
            g = torch.Generator().manual_seed(1)
            for s in seqs:
                draft.observe(s, 0, torch.randn(s.num_computed, width, generator=g).cuda().to(torch.bfloat16))
            got[name] = [p.tokens for p in draft.propose(seqs, [3] * len(group))]
            for s in seqs:
                s.prompt_ids.append(1)
                s.num_computed += 1
                draft.observe(s, s.num_computed - 1, torch.randn(1, width, generator=g).cuda().to(torch.bfloat16))
            got[name] += [p.tokens for p in draft.propose(seqs, [3] * len(group))]
            for s in seqs:
                draft.forget(s)
        assert got["chained"] == got["eager"]
    assert chained.chains.made and all(c.graph is not None for c in chained.chains.made.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_whole_proposal_on_device_does_not_wait_for_the_device():
    # the steady state's whole proposal on one captured chain, asked for on the device (what the speculative decoder
    # does before a verification of its own): no synchronization with the device (torch's sync debug mode), and the
    # tokens, read back afterwards, are those the host-read proposal gives from the same state
    import copy
    import warnings

    from k3.ops.registry import Backends

    model = _model().cuda().to(torch.bfloat16)
    model.set_backends(Backends(default="fast"))
    draft = _draft("mtp", model, chain_graphs=True)
    width = _width(draft)
    seqs = _seqs([7, 30, 12], 0.0, seed=2)
    g = torch.Generator().manual_seed(1)
    for s in seqs:
        draft.observe(s, 0, torch.randn(s.num_computed, width, generator=g).cuda().to(torch.bfloat16))
    draft.propose(seqs, [3] * 3)

    def advance():
        for s in seqs:
            s.prompt_ids.append(1)
            s.num_computed += 1
            draft.observe(s, s.num_computed - 1, torch.randn(1, width, generator=g).cuda().to(torch.bfloat16))

    advance()
    draft.propose(seqs, [3] * 3)  # the whole-proposal chain captured
    advance()
    ctx = copy.deepcopy(draft._ctx)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = draft.propose(seqs, [3] * 3, on_device=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert all(p.tokens is None and p.on_device.shape == (3,) for p in got)
    draft._ctx = ctx  # the same state again, read back on the host
    assert [p.on_device.tolist() for p in got] == [p.tokens for p in draft.propose(seqs, [3] * 3)]


def test_a_failed_chain_capture_drafts_eagerly_with_the_same_drafts(monkeypatch):
    # a capture that fails (on a GPU: an op that reads back under capture) says so once and drafts eagerly from the
    # positions the chain had taken, with the same drafts; later proposals stay eager
    from k3.serve.speculative import draft as draft_mod

    model = _model()
    eager, failing = MTPDraft(model, window=40), MTPDraft(model, window=40, chain_graphs="eager")
    failing.chains.eager = False  # as on CUDA, where a failure is caught

    real = draft_mod._Chain

    def broken(draft, rows, length, k, h, c, kr, eager, pool, first=0, shared=None, owner=None):
        # the chain after an eager first step is made (uncaptured); the whole-proposal chain's capture fails, after
        # the proposal took the pending positions
        if first:
            raise RuntimeError("operation not permitted when stream is capturing")
        return real(draft, rows, length, k, h, c, kr, True, pool, first=0, shared=shared, owner=owner)

    monkeypatch.setattr(draft_mod, "_Chain", broken)
    notices = []
    monkeypatch.setattr(draft_mod, "notice", notices.append)
    got = {}
    for name, draft in (("eager", eager), ("failing", failing)):
        seqs = _seqs([7, 30], 0.0, seed=3)
        _observe(draft, seqs, model.config.hidden_size)
        got[name] = [p.tokens for p in draft.propose(seqs, [3, 3])]
        for s in seqs:
            s.prompt_ids.append(1)
            draft.observe(s, s.num_computed, torch.randn(1, model.config.hidden_size,
                                                         generator=torch.Generator().manual_seed(2)))
            s.num_computed += 1
        got[name] += [p.tokens for p in draft.propose(seqs, [3, 3])]
    assert got["failing"] == got["eager"]
    assert len(notices) == 1 and "capturing them failed" in notices[0]
    assert [first for *_, first in failing.chains.made] == [0] and not failing.chains.nope


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_warm_up_runs_every_count_bucket_and_leaves_nothing_behind(kind):
    """MTPDraft.warm_up: the first step at 1, 2, 4, ... up to the bucket of the window (a count of 40 runs in the
    bucket of 64), on scratch contexts: the proposals after it equal a fresh draft's, the global generator is not
    drawn from, and no request's context is made."""
    model = _model()
    lengths, ks = [7, 30], [3, 2]
    props = []
    for warm in (False, True):
        draft = _draft(kind, model)
        if warm:
            state = torch.random.get_rng_state()
            assert draft.warm_up() == [1, 2, 4, 8, 16, 32, 64]
            assert draft.warm_up(5) == [1, 2, 4, 8]
            assert torch.equal(torch.random.get_rng_state(), state) and not draft._ctx
        seqs = _seqs(lengths, 0.0)
        _observe(draft, seqs, _width(draft))
        props.append([p.tokens for p in draft.propose(seqs, ks)])
    assert props[0] == props[1]


def test_the_engine_warm_up_tunes_the_draft_on_a_gpu_only(monkeypatch):
    """LLMEngine.warm_up: the graph buckets where the engine captures (none on CPU) and the draft's counts where its
    kernels are tuned (a GPU): on CPU neither runs, on a (pretended) GPU the draft's does."""
    from k3.serve.engine import EngineConfig, LLMEngine

    eng = LLMEngine(_model(), None, EngineConfig(cache_memory_mb=4, speculative="mtp"))
    calls = []
    monkeypatch.setattr(MTPDraft, "warm_up", lambda self, longest=None: calls.append(longest) or [1, 2])
    assert eng.warm_up() == {"graphs": 0, "draft_counts": []} and not calls
    monkeypatch.setattr(eng.runner, "device", torch.device("cuda"))
    assert eng.warm_up() == {"graphs": 0, "draft_counts": [1, 2]} and calls == [None]


def test_greedy_chains_on_the_paged_kernel_interpreted_equal_the_eager_drafts(monkeypatch):
    # The chain's paged attention on the Triton kernel itself (Triton's interpreter on the CPU): its buffers as a
    # page pool of one page per row (PAGE_TOKENS = the length bucket), the first step's 4 queries per row with their
    # own lengths (a causal window), then single queries; the drafts equal the eager absorbed form's, one request
    # and two.
    pytest.importorskip("triton")
    from k3.model.gated_mla import GatedMLA
    from k3.ops import mla_decode
    from k3.ops.registry import Backends

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = []
    real = mla_decode.mla_decode_paged_triton
    monkeypatch.setattr(mla_decode, "mla_decode_paged_triton",
                        lambda *a, **kw: kernel.append(a[2].shape) or real(*a, **kw))
    model = _model()
    model.set_backends(Backends(per_op={"mla_decode": "triton"}))
    assert GatedMLA.paged_kernel_used(model.mtp[0].block.self_attn)
    for group in ([9], [9, 21]):
        got = {}
        for name, draft in (("eager", _draft("mtp", model)), ("chained", _draft("mtp", model, chain_graphs="eager"))):
            seqs = _seqs(group, 0.0, seed=2)
            _observe(draft, seqs, model.config.hidden_size)
            got[name] = [p.tokens for p in draft.propose(seqs, [3] * len(group))]
            for s in seqs:
                s.prompt_ids.extend([5, 6])
                draft.observe(s, s.num_computed, torch.randn(2, model.config.hidden_size,
                                                             generator=torch.Generator().manual_seed(3)))
                s.num_computed += 2
            got[name] += [p.tokens for p in draft.propose(seqs, [3] * len(group))]
        assert got["chained"] == got["eager"]
    assert kernel and {tuple(shape)[:2] for shape in kernel} <= {(1, 64), (2, 64)}


def _verified(draft, seqs, k, cycle, width, accept=None, device="cpu", dtype=torch.float32):
    """A verification of k + 1 positions per request (random hidden states and greedy targets, on `device`): (hidden,
    targets, starts, commit), commit() its drafts all accepted (or, per request, its first accept[i] positions): the
    targets committed, the positions observed."""
    g = torch.Generator().manual_seed(10 + cycle)
    hidden = torch.randn(len(seqs), k + 1, width, generator=g).to(device, dtype)
    targets = torch.randint(1, VOCAB, (len(seqs), k + 1), generator=g).to(device)
    starts = [s.num_computed for s in seqs]
    return hidden, targets, starts, lambda: [_commit(draft, s, starts[i], hidden[i], targets[i],
                                                     (accept or {}).get(i, k + 1)) for i, s in enumerate(seqs)]


def _commit(draft, seq, start, hidden, targets, n):
    seq.prompt_ids[start + 1:] = targets[:n].tolist()
    draft.observe(seq, start, hidden[:n])
    seq.num_computed = start + n


def _state(draft, seqs):
    return [(draft._ctx[s.request_id].cache.length, draft._ctx[s.request_id].cache.start,
             draft._ctx[s.request_id].cache.c.clone(), draft._ctx[s.request_id].cache.k_rope.clone()) for s in seqs]


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
@pytest.mark.parametrize("case", ["all accepted", "one rejected", "chain ran between", "fewer drafts"])
def test_a_proposal_drafted_ahead_equals_the_proposal_after_acceptance(kind, case):
    """MTPDraft.propose_ahead drafts the next proposal before the verification's acceptance, as if all its drafts are
    accepted; the next propose takes it for the requests where they were and drafts the others as always: the
    proposals and the contexts after them equal those of a draft that never drafted ahead over several cycles (bit
    for bit: one request's rows of a chain do not depend on the others'), and a proposal drafted ahead is taken
    exactly where it holds."""
    model = _model()
    runs = {}
    for mode in ("ahead", "after"):
        draft = _draft(kind, model, window=200, chain_graphs="eager")
        width = _width(draft)
        seqs = _seqs([7, 30, 12], 0.0)
        _observe(draft, seqs, width)
        out = [[p.tokens for p in draft.propose(seqs, [3] * 3)]]
        other = _seqs([9], 0.0, seed=7)  # another batch, drafted on the chains too
        other[0].request_id = "other"
        _observe(draft, other, width)
        draft.propose(other, [3])
        for cycle in range(3):
            hidden, targets, starts, commit = _verified(draft, seqs, 3, cycle, width,
                                                        {1: 2} if case == "one rejected" and cycle == 1 else None)
            if mode == "ahead":
                assert draft.propose_ahead(seqs, starts, 3, hidden, targets)
            commit()
            if case == "chain ran between" and cycle == 1:  # the other batch's chain ran in between
                _commit(draft, other[0], other[0].num_computed, torch.randn(1, width), torch.tensor([5]), 1)
                with torch.no_grad():
                    assert draft.chains.propose(other, [3]) is not None
            ks = [3, 2, 1] if case == "fewer drafts" else [3] * 3
            out.append([p.tokens for p in draft.propose(seqs, ks)])
            out.append(_state(draft, seqs))
        runs[mode] = (out, draft.chains.counts)
    (ahead, counts), (after, plain) = runs["ahead"], runs["after"]
    assert plain == {"ahead": 0, "taken": 0}
    # per request (3 requests, 3 cycles): a rejected one drafts then, a chain in between drops its whole cycle
    assert counts["ahead"] == 9
    assert counts["taken"] == {"one rejected": 8, "chain ran between": 6}.get(case, 9)
    assert len(ahead) == len(after)
    for a, b in zip(ahead, after):
        if a and isinstance(a[0], tuple):  # the contexts: (length, start, c, k_rope) per request
            for x, y in zip(a, b):
                assert x[:2] == y[:2] and torch.equal(x[2], y[2]) and torch.equal(x[3], y[3])
        else:
            assert a == b


@contextlib.contextmanager
def _no_sync(check: bool):
    """Fails if the block synchronizes with the device (torch's sync debug mode), where `check`."""
    if not check:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_gpu_a_proposal_drafted_ahead_on_captured_chains_equals_the_proposal_after_acceptance(kind):
    # as the CPU test, on captured chains (bf16, the fast backends): the proposals and contexts bit for bit those of
    # drafting after acceptance, and drafting ahead and taking it never wait for the device
    from k3.ops.registry import Backends

    model = _model().cuda().to(torch.bfloat16)
    model.set_backends(Backends(default="fast"))
    runs = {}
    for mode in ("ahead", "after"):
        draft = _draft(kind, model, window=200, chain_graphs=True)
        width = _width(draft)
        seqs = _seqs([7, 30, 12], 0.0)
        g = torch.Generator().manual_seed(1)
        for s in seqs:
            draft.observe(s, 0, torch.randn(s.num_computed, width, generator=g).cuda().to(torch.bfloat16))
        out = [[p.tokens for p in draft.propose(seqs, [3] * 3)]]
        for cycle in range(3):
            hidden, targets, starts, commit = _verified(draft, seqs, 3, cycle, width, device="cuda",
                                                        dtype=torch.bfloat16)
            watch = mode == "ahead" and cycle  # the first one captures its chain; the others run on it
            if mode == "ahead":
                with _no_sync(watch):
                    assert draft.propose_ahead(seqs, starts, 3, hidden, targets)
            commit()  # the acceptance's read-back
            with _no_sync(watch):
                props = draft.propose(seqs, [3] * 3, on_device=True)
            out.append([p.on_device.tolist() for p in props])
            out.append(_state(draft, seqs))
        runs[mode] = (out, draft.chains.counts)
    (ahead, counts), (after, _) = runs["ahead"], runs["after"]
    assert counts == {"ahead": 9, "taken": 9}
    for a, b in zip(ahead, after):
        if a and isinstance(a[0], tuple):
            for x, y in zip(a, b):
                assert x[:2] == y[:2] and torch.equal(x[2], y[2]) and torch.equal(x[3], y[3])
        else:
            assert a == b
