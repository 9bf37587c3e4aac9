"""Fused replay (EngineConfig.fused_replay, k3.serve.runner): a request's accepted positions stay pending and are
replayed in the same pass as its next verification (KimiDeltaAttention.verify_replay, op kda_verify_replay), or before
any other forward over it. Greedy outputs are token-identical to decoding without speculation and to speculation
without fused replay, and after every step each running request's KDA states, once its pending positions are
replayed (on a copy of the pool), are a plain run's at its num_computed: across batches of different lengths,
chunked prefill joining mid-stream (mixed forwards), prefix-cache hits and hash-block boundaries inside accepted
positions, a prefix restore after a finished request, preemption, stop strings, max_tokens near the window, the
speculative switch and verifications on static buffers (cuda_graphs="eager": a captured graph's step run directly on
CPU), whose fused step takes the pending positions in its buffers and writes nothing but the requests' pages and the
scratch page.

Tolerances (fp32 on the CPU), against the model's contiguous cache fed the same tokens in one chunk: KDA states
STATE_TOL = 1e-5 of their largest entry (the engine's chunked prefill, token recurrences and replays are the same
math in another association; measured up to 6e-6), conv tails CONV_TOL = 5e-5 (they are raw projections of each
layer's input, which carries the rounding of every layer below it: measured up to 1.5e-5, and 1.4e-5 on the same
requests without fused replay). A bug moves them by far more (`test_the_state_check_fails_on_a_lost_position`).
A fused verification against the unfused one from the same pool (replay, then verify): logits 2e-3 absolute with
1e-5 relative (they are ~1e2 here, lm_head x 40, as in test_spec_engine.py), kept inputs 1e-4, states written
STATE_TOL and conv tails CONV_TOL of their largest entry.
"""

import copy
import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import one_torch_thread, serve_flag_reaches_the_engine
from k3.ops.registry import Backends
from k3.serve import runner as runner_mod
from k3.serve.cache import views as views_mod
from k3.serve.cache.views import inputs_of
from k3.serve.cuda_graphs import DecodeGraphs
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.runner import ForwardBatch, ModelRunner
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig

_spec = importlib.util.spec_from_file_location("spec_engine_fixtures_f",
                                               Path(__file__).with_name("test_spec_engine.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

STATE_TOL = 1e-5
CONV_TOL = 5e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with one_torch_thread():  # tiny matrices: more threads only contend on a busy machine
        yield
GRAPH_OPS = {"mla_decode": "triton", "moe": "grouped"}  # what a static-buffer step needs (on CPU: the references)


@pytest.fixture
def graph_ops():
    """The shared model on the ops a static-buffer step needs, for the test's duration."""
    model = fx._model()
    model.set_backends(Backends(per_op=GRAPH_OPS))
    try:
        yield model
    finally:
        model.set_backends(None)


def _engine(draft=None, spec="off", k=3, mb=4.0, chunk=40, step_tokens=96, fused=True, hb=fx.HB, graphs=False):
    eng = LLMEngine(fx._model(), fx._tok(), EngineConfig(
        cache_memory_mb=mb, page_tokens=fx.PAGE, hash_block_tokens=hb, speculative=spec, num_draft_tokens=k,
        fused_replay=fused, cuda_graphs="eager" if graphs else False,
        scheduler=SchedulerConfig(max_step_tokens=step_tokens, prefill_chunk=chunk, max_num_seqs=8)), draft=draft)
    eng.eos_id = None
    return eng


class Watch:
    """Counts what the fused path did, through the runner's seams: fused verifications that replayed pending
    positions, flushes before other forwards (by kind), commits that replayed up to a boundary now."""

    def __init__(self, monkeypatch):
        self.fused_with_pending = self.flush_plain = self.flush_mixed = self.flush_graph = self.split = 0
        orig_vr, orig_exec, orig_flush = runner_mod.verify_replay_on_pool, ModelRunner.execute, ModelRunner.flush
        orig_replay = ModelRunner.replay
        watch, where = self, [None]

        def vr(*args, **kwargs):
            watch.fused_with_pending += any(args[7])
            return orig_vr(*args, **kwargs)

        def execute(runner, batch):
            nv, B = batch.n_verify, len(batch.tokens)
            where[0] = "plain" if nv == 0 else "mixed" if nv < B else "graph"
            try:
                return orig_exec(runner, batch)
            finally:
                where[0] = None

        def flush(runner, ids):
            if where[0] is not None and any(i in runner.pending for i in ids):
                setattr(watch, f"flush_{where[0]}", getattr(watch, f"flush_{where[0]}") + 1)
            return orig_flush(runner, ids)

        def replay(runner, v, rows, offsets, lengths):
            watch.split += bool(rows) and runner.fused_replay
            return orig_replay(runner, v, rows, offsets, lengths)

        monkeypatch.setattr(runner_mod, "verify_replay_on_pool", vr)
        monkeypatch.setattr(ModelRunner, "execute", execute)
        monkeypatch.setattr(ModelRunner, "flush", flush)
        monkeypatch.setattr(ModelRunner, "replay", replay)


def states_after(model, tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """The KDA states [n_kda, H, K, V] and conv tails [n_kda, 3, P, W-1] after `tokens`: `model`'s contiguous cache
    fed them in one chunk (a plain run, no speculation), on the model's device."""
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.tensor([list(tokens)], device=next(model.parameters()).device), cache=cache)
    kda = [cache[i] for i, l in enumerate(model.model.layers) if l.is_kda]
    return torch.cat([c.state for c in kda]), torch.stack([torch.cat(c.conv) for c in kda])


@functools.lru_cache(maxsize=4096)
def plain_state(tokens: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """states_after on the shared fp32 CPU model."""
    return states_after(fx._model(), tokens)


def _close(what: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    err = float((got.double() - want.double()).abs().max()) / max(float(want.abs().max()), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"
    return err


@torch.no_grad()
def check_states(eng: LLMEngine, plain=plain_state, state_tol: float = STATE_TOL, conv_tol: float = CONV_TOL) -> int:
    """Every running request's KDA states in its pages, after replaying its pending positions on a copy of the pool
    (the engine goes on with them pending), against a plain run's at its num_computed. Pending positions belong to
    running requests only. Returns how many requests had pending positions."""
    runner = eng.runner
    running = {s.request_id for s in eng.scheduler.running}
    assert set(runner.pending) <= running, (set(runner.pending), running)
    held = sum(runner.pending_tokens(r) > 0 for r in running)
    pages, pending = runner.pool.pages.clone(), dict(runner.pending)
    try:
        runner.flush(list(pending))
        assert not runner.pending
        for seq in eng.scheduler.running:
            n = seq.num_computed
            if n == 0:
                continue
            state, conv = runner.pool.read_kda(torch.tensor(eng.scheduler.slots(seq).kda_pages,
                                                            device=runner.pool.pages.device))
            want_state, want_conv = plain(tuple(seq.tokens[:n]))
            _close(f"{seq.request_id} at {n}: KDA states", state, want_state, state_tol)
            _close(f"{seq.request_id} at {n}: conv tails", conv, want_conv, conv_tol)
    finally:
        runner.pool.pages.copy_(pages)
        runner.pending.clear()
        runner.pending.update(pending)
    return held


def drive(eng: LLMEngine, waves, states: bool = True, **check) -> tuple[list, int]:
    """fx._run with the state check after every step: ([(seq, streamed ids, streamed text)], the steps that had
    pending positions)."""
    seqs, streamed, held = [], {}, 0

    def step():
        nonlocal held
        for o in eng.step():
            ids, text = streamed.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            text.append(o.new_text)
        if states:
            held += check_states(eng, **check) > 0

    for wave in waves:
        for prompt, p in wave:
            seqs.append(eng.add_request(list(prompt), p))
        for _ in range(2):
            step()
    for _ in range(3000):
        if not eng.has_work():
            break
        step()
    assert not eng.has_work() and not eng.runner.pending
    return [(s, streamed[s.request_id][0], "".join(streamed[s.request_id][1])) for s in seqs], held


def _draft(kind: str):
    return {"oracle": fx.OracleDraft(), "noisy": fx.OracleDraft(wrong_every=3), "mtp": None}[kind]


@pytest.mark.parametrize("kind", ["oracle", "noisy", "mtp"])
def test_fused_replay_matches_plain_decoding_and_keeps_plain_states(kind, monkeypatch):
    # requests of different lengths, a second wave prefilling while the first decodes (its verifications join the
    # chunks' packed forward: their pending positions are replayed first)
    prompts = fx._prompts(2, 5)
    params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0, logprobs=1)] * len(prompts)
    waves = [list(zip(prompts[:3], params[:3])), list(zip(prompts[3:], params[3:]))]
    watch = Watch(monkeypatch)
    eng = _engine(_draft(kind), spec="mtp" if kind == "mtp" else "off", k=5 if kind != "mtp" else 3,
                  step_tokens=64)
    results, held = drive(eng, waves)
    fx._check(results, params)
    assert held > 0 and watch.fused_with_pending > 0 and watch.flush_mixed > 0
    # the same tokens and acceptance as speculation without fused replay
    off = _engine(_draft(kind), spec="mtp" if kind == "mtp" else "off", k=5 if kind != "mtp" else 3, step_tokens=64,
                  fused=False)
    ref, _ = drive(off, waves, states=False)
    assert [s.output_ids for s, _, _ in results] == [s.output_ids for s, _, _ in ref]
    m, mo = eng.metrics, off.metrics
    assert (m.spec_verifications, m.draft_tokens_accepted) == (mo.spec_verifications, mo.draft_tokens_accepted)
    eng.cache.prefix.check_invariants()


@torch.no_grad()
def test_a_fused_verification_equals_replay_then_verification(monkeypatch):
    # Each fused verification that replays pending positions is run again from the same pool the unfused way (the
    # pending positions replayed into the pages, then verify_on_pool): the logits, the window's kept inputs and the
    # states written agree.
    from k3.serve.pool_forward import verify_on_pool

    checked = []
    orig = ModelRunner._verify

    def both(runner, tokens, starts, slots, features, ids=None, drafts=None):
        assert drafts is None  # the oracle's drafts are host tokens
        lengths = [runner.pending_tokens(i) for i in ids]
        if not any(lengths):
            return orig(runner, tokens, starts, slots, features, ids)
        before, pending = runner.pool.pages.clone(), dict(runner.pending)
        v = orig(runner, tokens, starts, slots, features, ids)
        after = runner.pool.pages.clone()
        runner.pool.pages.copy_(before)
        runner.pending.update(pending)
        runner.flush(ids)
        kda_pages = runner._kda_pages(slots)
        state_ref, conv_ref = runner.pool.read_kda(kda_pages.flatten())
        logits, _, views = verify_on_pool(runner.model, runner.layout, runner.pool, torch.tensor(tokens),
                                          kda_pages, runner._mla_views(slots, starts), features)
        torch.testing.assert_close(v.logits, logits, rtol=1e-5, atol=2e-3)
        for g, view in enumerate(views):
            got, want = v.kda_views[g].inputs, view.inputs
            for x, y in zip([*got.pre_conv, got.q, got.k, got.v, got.z, got.beta_logits],
                            [*want.pre_conv, want.q, want.k, want.v, want.z, want.beta_logits]):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        runner.pool.pages.copy_(after)  # go on from the fused verification's pool
        state, conv = runner.pool.read_kda(kda_pages.flatten())
        _close("states after the pending positions", state, state_ref, STATE_TOL)
        _close("conv tails after the pending positions", conv, conv_ref, CONV_TOL)
        checked.append(lengths)
        return v

    monkeypatch.setattr(ModelRunner, "_verify", both)
    prompts = fx._prompts(1, 3)
    params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
    eng = _engine(fx.OracleDraft(wrong_every=4), k=4)
    results, _ = drive(eng, [list(zip(prompts, params))], states=False)
    fx._check(results, params)
    assert len(checked) >= 3, checked


@pytest.mark.parametrize("graphs", [False, True])
def test_hash_block_boundaries_inside_accepted_positions_and_a_restore_after_finish(graphs, monkeypatch, request):
    # 8-token hash blocks and 5 drafts the oracle always gets right: boundaries fall inside accepted positions, where
    # the commit replays up to the boundary now (its checkpoint holds exactly that position) and keeps the rest
    # pending. A second request continuing the first's whole text after it finished restores the first's newest
    # checkpoint (a generated position's) and outputs what a cold engine outputs. graphs: the verifications on
    # static buffers, fused there.
    if graphs:
        request.getfixturevalue("graph_ops")
    watch = Watch(monkeypatch)
    eng = _engine(fx.OracleDraft(), k=5, hb=8, graphs=graphs)
    prompts = fx._prompts(3, 3)
    params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
    results, _ = drive(eng, [list(zip(prompts, params))])
    fx._check(results, params)
    assert watch.split > 0 and _fused_pending(eng, watch) > 0 and watch.flush_graph == 0
    first = results[0][0]
    text = first.prompt_ids + first.output_ids
    cont = text + [5, 6]
    p = SamplingParams(max_tokens=12, temperature=0)
    again, _ = drive(eng, [[(cont, p)]])
    seq = again[0][0]
    assert seq.cached_tokens > len(first.prompt_ids), (seq.cached_tokens, len(first.prompt_ids))
    assert seq.output_ids == fx.reference(tuple(cont), 12, (), None)[0]
    eng.cache.prefix.check_invariants()


@pytest.mark.parametrize("graphs", [False, True])
def test_preemption_under_a_small_cache_drops_pending_positions(graphs, monkeypatch, request):
    # five prompts of their own in a 14-page pool: requests preempted with positions pending drop them (their pages
    # are freed; check_states holds pending positions to running requests) and recompute from their prefix hit
    if graphs:
        request.getfixturevalue("graph_ops")
    dropped = []
    orig = ModelRunner.drop
    monkeypatch.setattr(ModelRunner, "drop", lambda r, i: (dropped.append(r.pending_tokens(i)), orig(r, i))[1])
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, fx.VOCAB, (30 + i,), generator=g).tolist() for i in range(5)]
    params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
    eng = _engine(fx.OracleDraft(wrong_every=4), k=3, mb=0.5, step_tokens=64, graphs=graphs)
    results, held = drive(eng, [list(zip(prompts, params))])
    assert eng.metrics.preemptions > 0 and held > 0 and any(dropped)
    if graphs:
        assert eng.runner.graphs.fused_pending_steps > 0
    fx._check(results, params)


@pytest.mark.parametrize("graphs", [False, True])
def test_plain_steps_of_the_switch_and_near_max_tokens_replay_pending_first(graphs, monkeypatch, request):
    # the switch runs every other decode step plain, and max_tokens near the window leaves no room for drafts: those
    # forwards read the states as committed, so the pending positions are replayed before them (graphs: the plain
    # steps on static buffers, the verifications fused there)
    if graphs:
        request.getfixturevalue("graph_ops")
    watch = Watch(monkeypatch)
    eng = _engine(fx.OracleDraft(wrong_every=3), k=5, graphs=graphs)
    eng.spec_switch = fx.EveryThirdPlain()
    prompts = fx._prompts(4, 4)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (fx.LONGEST, 7, 8, 13)]
    results, held = drive(eng, [list(zip(prompts, params))])
    fx._check(results, params)
    assert held > 0 and watch.flush_plain > 0 and _fused_pending(eng, watch) > 0 and watch.flush_graph == 0
    if graphs:
        assert eng.runner.graphs.fused_pending_steps > 0


def _fused_pending(eng, watch) -> int:
    """Fused verifications that replayed pending positions: eager ones (the Watch) and static-buffer steps."""
    g = eng.runner.graphs
    return watch.fused_with_pending + (0 if g is None else g.fused_pending_steps)


class PagesWritten:
    """Around every static-buffer verification: the pool pages that changed are the verified requests' own (their
    KDA running-state pages and MLA block tables) and the scratch page, nothing else (padding rows write only the
    scratch page)."""

    def __init__(self, monkeypatch, eng):
        from k3.serve.cuda_graphs import DecodeGraphs

        self.checked = 0
        orig, scratch, watch = DecodeGraphs.run_verify, eng.cache.scratch_page, self

        def run_verify(graphs, tokens, starts, slots, *args, **kwargs):
            before = graphs.pool.pages.clone()
            out = orig(graphs, tokens, starts, slots, *args, **kwargs)
            if out is not None:
                changed = set((graphs.pool.pages != before).flatten(1).any(1).nonzero().flatten().tolist())
                own = {scratch} | {p for sl in slots for p in sl.kda_pages}
                own |= {p for sl in slots for t in sl.mla_tables for p in t}
                assert changed <= own, f"pages {sorted(changed - own)} written by a verification step"
                watch.checked += 1
            return out

        monkeypatch.setattr(DecodeGraphs, "run_verify", run_verify)


@pytest.mark.slow  # about three minutes: the kernel in Triton's interpreter, three KDA layers per verification
def test_the_verification_kernel_on_static_buffers_matches_plain_decoding(monkeypatch):
    # The fused verifications on the KDA verification step's kernel (k3.ops.kda_verify_step, in Triton's interpreter
    # on CPU), on static buffers: pending counts on the device, the rows a strided column of the step's page table,
    # padding rows; the outputs and acceptance are those of speculation without fused replay, and the states those
    # of a plain run after every step.
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    model = fx._model()
    model.set_backends(Backends(per_op={**GRAPH_OPS, "kda_verify_step": "triton"}))
    try:
        eng = _engine(fx.OracleDraft(wrong_every=3), k=3, graphs=True)
        prompts = fx._prompts(3, 5)
        params = [SamplingParams(max_tokens=n, temperature=0) for n in (10, 7, 5)]
        results, held = drive(eng, [list(zip(prompts, params))])
        fx._check(results, params)
        assert eng.runner.graphs.fused_pending_steps > 0 and held > 0 and eng.runner.graphs.padded_rows > 0
        model.set_backends(Backends(per_op=GRAPH_OPS))
        off = _engine(fx.OracleDraft(wrong_every=3), k=3, graphs=True, fused=False)
        ref, _ = drive(off, [list(zip(prompts, params))], states=False)
    finally:
        model.set_backends(None)
    assert [s.output_ids for s, _, _ in results] == [s.output_ids for s, _, _ in ref]
    m, mo = eng.metrics, off.metrics
    assert (m.spec_verifications, m.draft_tokens_accepted) == (mo.spec_verifications, mo.draft_tokens_accepted)


@pytest.mark.parametrize("kind", ["noisy", "mtp"])
def test_verifications_on_static_buffers_run_fused(kind, monkeypatch, graph_ops):
    # cuda_graphs="eager": the verifications run as static-buffer steps (a captured graph's code on CPU) with the
    # pending positions copied into the step's buffers, replayed there, not flushed first. Five requests of different
    # lengths finishing one by one: batches of 5, 4, 3, 2, 1 in buckets of 8, 4, 2 and 1 (padding rows); the switch's
    # plain steps flush. Outputs are those of plain decoding and of speculation without fused replay on the same
    # static buffers, with the same acceptance; the states those of a plain run after every step.
    watch = Watch(monkeypatch)
    spec, draft = ("mtp", None) if kind == "mtp" else ("off", fx.OracleDraft(wrong_every=3))
    eng = _engine(draft, spec=spec, k=3, graphs=True)
    pages = PagesWritten(monkeypatch, eng)
    loads = []  # how each step's pending inputs reached its buffers: per request in one piece, or per layer
    orig_load = DecodeGraphs._load_pending

    def load(graphs, b, B, pending, lengths):
        loads.append("rows" if pending is not None else "none")
        return orig_load(graphs, b, B, pending, lengths)

    monkeypatch.setattr(DecodeGraphs, "_load_pending", load)
    eng.spec_switch = fx.EveryThirdPlain()
    prompts = fx._prompts(5, 5)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (fx.LONGEST, 9, 14, 19, 5)]
    results, held = drive(eng, [list(zip(prompts, params))])
    fx._check(results, params)
    g = eng.runner.graphs
    assert g.fused_replay and g.fused_pending_steps > 0 and watch.flush_graph == 0 and held > 0
    assert g.padded_rows > 0 and len({k[0] for k in g._static if len(k) == 3}) >= 2 and pages.checked > 0
    # held positions come back as one piece per request (those held from an eager or mixed verification too)
    assert loads.count("rows") > loads.count("layers")
    off = _engine(_draft(kind), spec=spec, k=3, graphs=True, fused=False)
    off.spec_switch = fx.EveryThirdPlain()
    ref, _ = drive(off, [list(zip(prompts, params))], states=False)
    assert [s.output_ids for s, _, _ in results] == [s.output_ids for s, _, _ in ref]
    m, mo = eng.metrics, off.metrics
    assert (m.spec_verifications, m.draft_tokens_accepted) == (mo.spec_verifications, mo.draft_tokens_accepted)
    assert off.runner.graphs.verify_steps > 0 and not off.runner.graphs.fused_replay


def test_static_buffer_verifications_make_no_per_layer_views_of_pending_inputs(monkeypatch, graph_ops):
    # a static-buffer verification copies a request's pending inputs in one piece (Pending.flat), and a replay up to
    # a hash-block boundary (or a flush) replays every layer from the flat inputs at once: neither the pending
    # positions' per-layer views (Pending.inputs, ~0.4 ms of host time per request at k3-mini) nor the verification's
    # own (KeptInputsView.inputs) are made at every hold; Pending.inputs is made where an eager forward reads it (here
    # the windows near max_tokens shorter than the pending positions)
    made, holds, verified, read = [], [], [], []
    monkeypatch.setattr(runner_mod, "inputs_of", lambda *a: made.append(a[1]) or inputs_of(*a))
    monkeypatch.setattr(views_mod, "inputs_of", lambda *a: read.append(a[1]) or inputs_of(*a))
    replay = ModelRunner.replay
    monkeypatch.setattr(ModelRunner, "replay", lambda self, v, rows, *a: verified.append(len(rows)) or
                        replay(self, v, rows, *a))
    hold = ModelRunner.hold
    monkeypatch.setattr(ModelRunner, "hold", lambda self, rid, *a: holds.append(rid) or hold(self, rid, *a))
    eng = _engine(fx.OracleDraft(wrong_every=3), spec="off", k=3, graphs=True)
    prompts = fx._prompts(3, 5)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (fx.LONGEST, 9, 14)]
    results, held = drive(eng, [list(zip(prompts, params))], states=False)
    fx._check(results, params)
    layers = len(eng.runner.layout.kda)
    assert eng.runner.graphs.fused_pending_steps > 0 and any(verified) and len(made) % layers == 0
    assert len(made) // layers < len(holds) // 2 and not read, (made, len(holds), read)
    # read, they are the views of `flat` per layer
    seq = eng.add_request(list(prompts[0]), SamplingParams(max_tokens=fx.LONGEST, temperature=0))
    while not eng.runner.pending_tokens(seq.request_id):
        eng.step()
    p = eng.runner.pending[seq.request_id]
    cfg = eng.runner.model.config
    for g, got in enumerate(p.inputs):
        want = inputs_of(p.flat, g, cfg.kda_num_heads, cfg.kda_head_dim)
        fields = lambda i: (*i.pre_conv, i.q, i.k, i.v, i.z, i.beta_logits)  # noqa: E731
        assert all(a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                   for a, b in zip(fields(got), fields(want)))
    assert made[-layers:] == list(range(layers))


def test_a_short_window_after_a_long_acceptance_stays_on_the_static_buffers(monkeypatch, graph_ops):
    # drafts the oracle always gets right: 6 positions accepted per verification, pending, then max_tokens leaves
    # room for one draft only: a window of 2, shorter than the pending count; the buffers hold the longest
    # verification's pending positions (max_pending), so that verification runs there too, fused, the outputs and
    # states as plain decoding's (it used to run eagerly: a whole eager forward near the end of every request)
    watch = Watch(monkeypatch)
    eng = _engine(fx.OracleDraft(), k=5, graphs=True)
    g = eng.runner.graphs
    assert g.max_pending == 6
    seen = []
    orig = type(g).run_verify

    def run_verify(graphs, tokens, starts, slots, pending=None, lengths=None, drafts=None):
        out = orig(graphs, tokens, starts, slots, pending, lengths, drafts)
        seen.append((len(tokens[0]), max(lengths or [0]), out is None))
        return out

    monkeypatch.setattr(type(g), "run_verify", run_verify)
    prompts = fx._prompts(6, 3)
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (9, 10, 16)]
    results, held = drive(eng, [list(zip(prompts, params))])
    fx._check(results, params)
    assert any(n > T for T, n, _ in seen), seen  # such windows came
    assert not any(fell for _, _, fell in seen), seen  # and none ran eagerly
    assert watch.fused_with_pending == 0 and g.fused_pending_steps > 0 and watch.flush_graph == 0
    # more pending positions than any verification leaves: refused (the runner verifies eagerly)
    assert orig(g, [[1, 2]], [0], [None], [None], [7]) is None


def test_graphs_built_without_fused_replay_replay_pending_first(monkeypatch, graph_ops):
    # static-buffer verification steps without the pending buffers (DecodeGraphs.fused_replay off) under a fused
    # runner: the pending positions are replayed before them (flush), the states and outputs as plain decoding's
    watch = Watch(monkeypatch)
    eng = _engine(fx.OracleDraft(wrong_every=3), k=3, graphs=True)
    eng.runner.graphs.fused_replay = False  # before any bucket is made
    prompts = fx._prompts(5, 3)
    params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
    results, _ = drive(eng, [list(zip(prompts, params))])
    fx._check(results, params)
    assert eng.runner.graphs.verify_steps > 0 and watch.flush_graph > 0 and eng.runner.graphs.fused_pending_steps == 0
    with pytest.raises(ValueError, match="without fused replay"):
        eng.runner.graphs.run_verify([[1, 2]], [0], [None], [None], [1])


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking: each example runs engines
@given(data=st.data())
def test_random_requests_with_fused_replay_match_plain_decoding(data):
    kind = data.draw(st.sampled_from(["oracle", "noisy", "mtp"]))
    draft = {"oracle": fx.OracleDraft(), "noisy": fx.OracleDraft(wrong_every=data.draw(st.integers(2, 4))),
             "mtp": None}[kind]
    eng = _engine(draft, spec="mtp" if kind == "mtp" else "off", k=data.draw(st.sampled_from([1, 2, 3, 5])),
                  mb=data.draw(st.sampled_from([0.5, 4.0])), chunk=data.draw(st.sampled_from([16, 40])),
                  step_tokens=data.draw(st.sampled_from([32, 96])), hb=data.draw(st.sampled_from([8, 16])))
    if data.draw(st.booleans()):
        eng.spec_switch = fx.EveryThirdPlain()
    waves, params = fx.random_waves(data, fx._stop_string, waves=2, per_wave=3, longest=80, extra=4)
    results, _ = drive(eng, waves)
    fx._check(results, params)
    eng.cache.prefix.check_invariants()


def test_an_eagle3_draft_reads_the_fused_verifications_features(monkeypatch):
    # an EAGLE-3 draft observes the target's AttnRes block features beside the hidden states: a fused verification
    # hands them out as the unfused one does (the same drafts and acceptance, and the same output)
    from k3.model.eagle3 import Eagle3Layer
    from k3.serve.speculative.draft import Eagle3Draft

    watch = Watch(monkeypatch)
    layer = Eagle3Layer.from_target(fx._model())
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the fused features matter: W_E3 away from [0 0 I]
        layer.fc.weight.add_(torch.randn(layer.fc.weight.shape, generator=g) * 0.05)
    prompts = fx._prompts(1, 3)
    params = [SamplingParams(max_tokens=12, temperature=0)] * len(prompts)
    runs = []
    for fused in (True, False):
        eng = _engine(Eagle3Draft(fx._model(), layer), k=3, fused=fused)
        assert eng.draft.features == (1, 2)
        results, _ = drive(eng, [list(zip(prompts, params))], states=fused)
        fx._check(results, params)
        m = eng.metrics
        runs.append((m.spec_verifications, m.draft_tokens_proposed, m.draft_tokens_accepted))
    # (a random draft is rarely right: each verification commits about one position, which stays pending)
    assert runs[0] == runs[1] and runs[0][0] > 0 and watch.fused_with_pending > 0


def _lose_one_position(monkeypatch):
    """A mutation: the runner's hold keeps one accepted position fewer than it was given (a state one token behind
    from then on)."""
    orig = ModelRunner.hold

    def short(runner, rid, pages, v, row, offset, n):
        return orig(runner, rid, pages, v, row, offset, n - 1) if n > 1 else orig(runner, rid, pages, v, row, offset, n)

    monkeypatch.setattr(ModelRunner, "hold", short)


def test_the_state_check_fails_on_a_lost_position(monkeypatch):
    # the check above has teeth: a hold that keeps one accepted position fewer than it was given (a state one token
    # behind from then on) fails it
    _lose_one_position(monkeypatch)
    eng = _engine(fx.OracleDraft(), k=4)
    with pytest.raises(AssertionError, match="KDA states: relative error"):
        drive(eng, [[(fx._prompts(1, 1)[0], SamplingParams(max_tokens=fx.LONGEST, temperature=0))]])


# --- the switch and its errors ---------------------------------------------------------------------------------------
def test_fused_replay_is_on_with_speculation_by_default_and_needs_it_when_asked_for(monkeypatch):
    assert EngineConfig().fused_replay is None
    with pytest.raises(ValueError, match="fused_replay"):
        EngineConfig(fused_replay="yes").validate()
    with pytest.raises(ValueError, match="fused_replay .*needs speculative decoding"):
        _engine(None, spec="off")
    for spec, draft, fused, want in (("mtp", None, None, True), ("off", fx.OracleDraft(), None, True),
                                     ("off", None, None, False), ("mtp", None, False, False)):
        assert _engine(draft, spec=spec, fused=fused).runner.fused_replay is want
    # and the default engine's cycle holds its accepted positions to the next verification (the commit reads the
    # engine's resolved choice, not the config's None)
    watch = Watch(monkeypatch)
    prompts = fx._prompts(1, 2)
    p = SamplingParams(max_tokens=fx.LONGEST, temperature=0)
    results, held = drive(_engine(fx.OracleDraft(), fused=None), [[(q, p) for q in prompts]])
    assert held > 0 and watch.fused_with_pending > 0
    fx._check(results, [p] * len(prompts))


def test_a_forward_that_does_not_name_its_requests_is_refused_while_positions_are_pending():
    eng = _engine(fx.OracleDraft(), k=3)
    seq = eng.add_request(fx._prompts(0, 1)[0], SamplingParams(max_tokens=fx.LONGEST, temperature=0))
    for _ in range(20):
        eng.step()
        if eng.runner.pending:
            break
    assert eng.runner.pending_tokens(seq.request_id) > 0
    batch = ForwardBatch([[seq.tokens[seq.num_computed]]], [seq.num_computed], [eng.scheduler.slots(seq)])
    with pytest.raises(ValueError, match=r"ForwardBatch\.ids"):
        eng.runner.execute(batch)
    eng.abort_request(seq.request_id)
    assert not eng.runner.pending  # an aborted request's pending positions are dropped
    off = _engine(fx.OracleDraft(), k=3, fused=False)
    with pytest.raises(RuntimeError, match="fused replay"):
        off.runner.hold("r", [0], None, 0, 0, 1)


def test_the_fused_replay_flag(tmp_path, monkeypatch):
    import argparse

    from k3 import cli
    from k3.serve.build import build_engine
    from k3.serve.options import add_speculative_arguments

    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    assert parser.parse_args([]).fused_replay is None  # the engine's default: on with speculation
    assert parser.parse_args(["--speculative", "mtp", "--fused-replay"]).fused_replay is True
    assert parser.parse_args(["--speculative", "mtp", "--no-fused-replay"]).fused_replay is False
    assert "default: on with --speculative" in " ".join(parser.format_help().split())
    with pytest.raises(ValueError, match="--fused-replay .*needs --speculative mtp or eagle3"):
        build_engine(str(tmp_path), speculative="off", fused_replay=True)  # refused before anything is loaded
    # `k3 serve` hands it to the engine's builder; `k3 generate` takes it too
    serve_flag_reaches_the_engine(monkeypatch, tmp_path, "fused_replay",
                                  [([], None), (["--speculative", "mtp", "--fused-replay"], True),
                                   (["--speculative", "mtp", "--no-fused-replay"], False)])
    parse = cli.build_parser().parse_args
    assert parse(["generate", "--ckpt", str(tmp_path), "x", "--fused-replay"]).fused_replay is True


def _gpu_engine_runs(backend, dtype):
    """Greedy outputs of an eager CUDA engine with the MTP draft, with and without fused replay (ops
    kda_verify_replay and kda_verify_step on `backend`)."""
    model = copy.deepcopy(fx._model()).cuda().set_dtype(dtype)
    model.set_backends(Backends(per_op={"kda_verify_replay": backend, "kda_verify_step": backend}))
    params = SamplingParams(max_tokens=16, temperature=0)
    runs, held = [], []
    for fused in (True, False):
        eng = LLMEngine(model, None, EngineConfig(
            cache_memory_mb=16.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, speculative="mtp", fused_replay=fused,
            cuda_graphs=False, scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=8)))
        eng.eos_id = None
        seqs = [eng.add_request(list(p), params) for p in fx._prompts(8, 4)]
        n = 0
        while eng.has_work():
            eng.step()
            n += bool(eng.runner.pending)
        held.append(n)
        runs.append([s.output_ids for s in seqs])
    assert held[0] > 0  # the fused engine held pending positions
    return runs


# On the GPU: fp32 engines must give the same greedy tokens with and without fused replay (the same math in another
# association, as on the CPU). In bf16, greedy outputs part at near-ties whether or not the replay is fused (on the
# CPU this model's bf16 speculative and plain runs part at top-2 margins of 2-3% of the top logit, and a quarter of
# its positions have margins under 2%), so the bf16 test checks the states instead: after every step, each running
# request's KDA states equal a plain bf16 run's over the same tokens within BF16_STATE_TOL of their largest entry and
# conv tails within BF16_CONV_TOL (bf16 activations through chunked and recurrent forms, each layer's input carrying
# the rounding of the layers below; measured on the CPU up to 0.024 and 0.056; a hold that loses one position moves
# them by 0.95 and 1.40).
BF16_STATE_TOL = 0.06
BF16_CONV_TOL = 0.15


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_fused_replay_keeps_greedy_output_fp32(backend):
    """A fp32 CUDA engine with the MTP draft and eager verifications outputs the same greedy tokens with and without
    fused replay. (Captured steps need the grouped expert GEMM, bf16 only on CUDA: the bf16 test below covers them.)"""
    runs = _gpu_engine_runs(backend, torch.float32)
    assert runs[0] == runs[1]


def _bf16_fused_states(device: str, backend: str, cuda_graphs):
    """A bf16 engine with fused replay on `device` and the oracle draft (the fp32 model's greedy tokens: most are
    accepted, so several positions are pending at a time), states checked after every step against the
    same model's plain bf16 run; returns the steps that held pending positions."""
    model = copy.deepcopy(fx._model()).to(device).set_dtype(torch.bfloat16)
    model.set_backends(Backends(per_op={**(GRAPH_OPS if cuda_graphs else {}), "kda_verify_replay": backend,
                                        "kda_verify_step": backend}))
    eng = LLMEngine(model, None, EngineConfig(
        cache_memory_mb=16.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, num_draft_tokens=4, fused_replay=True,
        cuda_graphs=cuda_graphs, scheduler=SchedulerConfig(max_step_tokens=64, prefill_chunk=40, max_num_seqs=8)),
        draft=fx.OracleDraft())
    eng.eos_id = None
    prompts = fx._prompts(2, 5)
    params = SamplingParams(max_tokens=fx.LONGEST, temperature=0)
    waves = [[(p, params) for p in prompts[:3]], [(p, params) for p in prompts[3:]]]
    # the plain runs on the reference ops (no kernel compiled or autotuned for each new length)
    plain_model = copy.deepcopy(model).set_backends(Backends(default="torch"))
    _, held = drive(eng, waves, plain=functools.lru_cache(maxsize=None)(lambda t: states_after(plain_model, t)),
                    state_tol=BF16_STATE_TOL, conv_tol=BF16_CONV_TOL)
    return held


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cuda_graphs", [True, False], ids=["captured", "eager"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_fused_replay_bf16_keeps_plain_states(backend, cuda_graphs):
    """A bf16 CUDA engine with fused replay (eager or captured verifications): after every step each running
    request's KDA states and conv tails are a plain bf16 run's over its tokens (BF16_STATE_TOL)."""
    assert _bf16_fused_states("cuda", backend, cuda_graphs) > 0


def test_the_bf16_state_check_holds_and_fails_on_a_lost_position(monkeypatch):
    # the bf16 tolerances on the CPU: the fused path passes them, and a hold that keeps one position fewer fails them
    assert _bf16_fused_states("cpu", "torch", False) > 0
    _lose_one_position(monkeypatch)
    with pytest.raises(AssertionError, match="relative error"):
        _bf16_fused_states("cpu", "torch", False)
