"""An engine with a speculative draft runs its plain decode steps and its verifications on static-buffer steps
(`DecodeGraphs` with keep_hidden and verify_lengths: the hidden states the draft observes and the KDA inputs the
replay reads come out of the step, as they would out of a captured graph), in "eager" mode on CPU: greedy outputs
equal decoding without speculation, and the draft sees the same hidden states as on the eager runner (the same
drafts, the same acceptance)."""

import importlib.util
from pathlib import Path

import pytest
import torch

from helpers import DECODE_KERNELS
from k3.ops.registry import Backends
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from k3.serve.speculative.switch import SpecSwitch

_spec = importlib.util.spec_from_file_location("spec_engine_fixtures_g", Path(__file__).with_name("test_spec_engine.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

GRAPH_OPS = {"mla_decode": "triton", "moe": "grouped"}  # what a captured step needs (on CPU: the paged reference)


class AlternatingSwitch(SpecSwitch):
    """Speculates on every other decode step: both kinds of step, over and over."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def decide(self, batch):
        self.n += 1
        return self.n % 2 == 0


class AlwaysSpeculate(SpecSwitch):
    def decide(self, batch):
        return True


def _engine(graphs, draft=None, fused=False):
    eng = LLMEngine(fx._model(), fx._tok(), EngineConfig(
        cache_memory_mb=4.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, speculative="mtp", num_draft_tokens=3,
        cuda_graphs="eager" if graphs else False, fused_replay=fused,
        scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=8)), draft=draft)
    eng.eos_id = None
    eng.spec_switch = AlternatingSwitch()
    return eng


@pytest.mark.parametrize("draft", ["mtp", "oracle"])
def test_plain_steps_on_static_buffers_feed_the_draft_as_the_eager_runner_does(draft):
    model = fx._model()
    model.set_backends(Backends(per_op=GRAPH_OPS))
    try:
        prompts = fx._prompts(7, 3)
        params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
        runs, observed = {}, {}
        for graphs in (True, False):
            # the oracle accepts a prefix of each verification (every third draft wrong): replays of every length
            eng = _engine(graphs, fx.OracleDraft(wrong_every=3) if draft == "oracle" else None)
            seen = []  # what the draft observes: (request, first position, hidden states)
            on_device = []  # per verification forward: whether its drafts came on the device (ForwardBatch.drafts)
            execute = eng.runner.execute
            eng.runner.execute = lambda batch, execute=execute, on_device=on_device: (
                on_device.append(batch.drafts is not None) if batch.n_verify else None, execute(batch))[1]
            observe = eng.draft.observe
            eng.draft.observe = lambda seq, start, h, observe=observe, seen=seen: (
                seen.append((seq.prompt_ids[0], start, h.clone())), observe(seq, start, h))[1]
            assert (eng.runner.graphs is not None) is graphs
            if graphs:
                assert eng.runner.graphs.keep_hidden
            fx._check(fx._run(eng, [list(zip(prompts, params))]), params)
            m = eng.metrics
            runs[graphs] = (m.spec_verifications, m.draft_tokens_proposed, m.draft_tokens_accepted)
            observed[graphs] = sorted(seen, key=lambda r: (r[0], r[1]))
            if graphs:
                g = eng.runner.graphs
                assert g.verify_lengths == (2, 3, 4)
                assert g.verify_steps > 0 and g.steps > g.verify_steps  # verifications and plain decode steps
                if draft == "mtp":  # the MTP draft's greedy steps after the first ran on chains of static buffers
                    assert eng.draft.chains is not None and eng.draft.chains.made
                    # and whole proposals on one chain left their tokens on the device for the verification, which
                    # read them back with its targets: the same drafts and acceptance as the host's (below)
                    assert any(on_device) and not all(on_device)
            if draft == "oracle" or not graphs:
                assert not any(on_device)
        assert runs[True][0] > 0
        assert runs[True] == runs[False]  # the same drafts were proposed and accepted
        # the same hidden states observed at the same positions (the static step's fixed-split paged attention sums in
        # another order than the eager runner's: fp32 rounding)
        assert [(r, a) for r, a, _ in observed[True]] == [(r, a) for r, a, _ in observed[False]]
        for (_, _, x), (_, _, y) in zip(observed[True], observed[False]):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    finally:
        model.set_backends(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_plain_steps_of_a_speculating_engine():
    """On the GPU: a bf16 engine with the MTP draft captures its plain decode steps with the hidden states as an
    output, and its verifications, and replays them; greedy outputs equal the same engine without graphs, and so do the drafts' acceptance
    counts."""
    import copy

    model = copy.deepcopy(fx._model()).cuda().set_dtype(torch.bfloat16).set_backends(Backends(per_op=GRAPH_OPS))
    prompts = fx._prompts(8, 4)
    params = SamplingParams(max_tokens=16, temperature=0)
    runs = []
    for graphs in (True, False):
        eng = LLMEngine(model, None, EngineConfig(
            cache_memory_mb=16.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, speculative="mtp",
            cuda_graphs=graphs, scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=8)))
        eng.eos_id = None
        eng.spec_switch = AlternatingSwitch()
        seqs = eng.generate([list(p) for p in prompts], params)
        m = eng.metrics
        assert m.spec_verifications > 0
        runs.append([s.output_ids for s in seqs])
        if graphs:
            g = eng.runner.graphs
            assert g.disabled is None, g.disabled
            assert g.keep_hidden and g.replays > 0 and g.verify_steps > 0
            assert any(len(k) == 3 and b.graph is not None for k, b in g._static.items())  # a captured verification
    assert runs[0] == runs[1]


def test_warm_up_sets_up_the_verification_buckets_too():
    model = fx._model()
    model.set_backends(Backends(per_op=GRAPH_OPS))
    try:
        eng = _engine(True)
        g = eng.runner.graphs
        n = g.warm_up()
        verify = {k for k in g._static if len(k) == 3}
        assert verify == {(s, t, "verify") for s in g.buckets for t in (2, 3, 4)} and n == len(g._static)
    finally:
        model.set_backends(None)


def test_fused_verification_buckets_hold_pending_buffers_filled_in_place():
    # with fused replay every verification bucket holds, per KDA layer, pending inputs [Bb, P, ...] (P the longest
    # verification's positions, whatever the bucket's T: the most a verification leaves pending) and the counts
    # [Bb] int32 (decode and prefill buckets none); the steps copy into them: the same storage after a run in which
    # verifications replayed pending positions, and no bucket made past the warm-up
    model = fx._model()
    model.set_backends(Backends(per_op=GRAPH_OPS))
    try:
        eng = _engine(True, fx.OracleDraft(wrong_every=3), fused=True)
        eng.spec_switch = AlwaysSpeculate()  # verifications after verifications: pending positions to fuse
        g = eng.runner.graphs
        n = g.warm_up()
        cfg, n_kda = model.config, len(g.layout.kda)
        ptrs = {}
        for key, b in g._static.items():
            if len(key) != 3:
                assert b.pending is None and b.pending_lengths is None
                continue
            size, P = key[0], g.max_pending
            assert P == max(g.verify_lengths) == 4
            assert len(b.pending) == n_kda and b.pending_lengths.shape == (size,)
            assert b.pending_lengths.dtype == torch.int32
            for inp in b.pending:
                assert inp.k.shape == (size, P, cfg.kda_num_heads, cfg.kda_head_dim)
                assert inp.pre_conv[0].shape == (size, P, cfg.kda_num_heads * cfg.kda_head_dim)
                assert inp.beta_logits.shape == (size, P, cfg.kda_num_heads)
            ptrs[key] = [b.pending_lengths.data_ptr()] + [x.data_ptr() for i in b.pending
                                                          for x in (*i.pre_conv, i.q, i.k, i.v, i.z, i.beta_logits)]
        prompts = fx._prompts(7, 3)
        params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
        fx._check(fx._run(eng, [list(zip(prompts, params))]), params)
        assert g.fused_pending_steps > 0 and g.made == n
        for key, want in ptrs.items():
            b = g._static[key]
            assert [b.pending_lengths.data_ptr()] + [x.data_ptr() for i in b.pending for x in (
                *i.pre_conv, i.q, i.k, i.v, i.z, i.beta_logits)] == want
    finally:
        model.set_backends(None)


@pytest.mark.slow
def test_speculation_on_static_buffers_with_every_fused_decode_kernel(interpreted_kernels):
    # Plain steps and verifications on static buffers (as captured) with every fused decode kernel in Triton's
    # interpreter (verification rows through the latent append's T > 1 rows, the GEMV experts for a few rows, the
    # fused AttnRes sites), the oracle draft accepting prefixes, the replay fused into the next verification: greedy
    # outputs equal decoding without speculation (one short request: the interpreter runs every kernel program in
    # Python; the paged attention on its reference)
    model = fx._model()
    model.set_backends(Backends(per_op={**GRAPH_OPS, **DECODE_KERNELS, "kda_verify_replay": "triton"}))
    try:
        prompts = fx._prompts(5, 1)
        params = [SamplingParams(max_tokens=8, temperature=0)] * len(prompts)
        eng = LLMEngine(model, fx._tok(), EngineConfig(  # one request: bucket 1 only (each bucket is set up)
            cache_memory_mb=4.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, speculative="mtp", num_draft_tokens=3,
            cuda_graphs="eager", fused_replay=True,
            scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=1)),
            draft=fx.OracleDraft(wrong_every=3))
        eng.eos_id = None
        eng.spec_switch = AlternatingSwitch()
        fx._check(fx._run(eng, [list(zip(prompts, params))]), params)
        assert eng.metrics.spec_verifications > 0 and eng.runner.graphs.steps > 0
    finally:
        model.set_backends(None)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static"])
def test_a_verification_of_drafts_on_the_device_equals_one_of_host_tokens(graphs):
    # ForwardBatch.drafts (a proposal's tokens left on the device): the verification, eager or on static buffers,
    # runs the same ids as one whose tokens hold the drafts (the same logits, bit for bit); a mixed forward or a
    # misshapen tensor is refused by name
    from k3.serve.runner import ForwardBatch

    model = fx._model()
    model.set_backends(Backends(per_op=GRAPH_OPS))
    try:
        eng = _engine(graphs)
        eng.spec_switch = None
        eng.speculative.switch = None
        seq = eng.add_request(list(fx._prompts(1, 5)[0]), SamplingParams(max_tokens=8, temperature=0))
        eng.step()  # the prefill: its first token sampled, not yet run through the model
        start, slots = seq.num_computed, eng.scheduler.slots(seq)
        last = seq.token_range(start, start + 1)

        def verify(tokens, drafts=None):
            return eng.runner.execute(ForwardBatch([tokens], [start], [slots], n_verify=1, ids=[seq.request_id],
                                                   drafts=drafts)).verified.logits

        want = verify(last + [5, 6, 7])
        assert torch.equal(verify(last + [0, 0, 0], torch.tensor([[5, 6, 7]])), want)
        assert not graphs or eng.runner.graphs.verify_steps == 2  # both on the static buffers
        with pytest.raises(ValueError, match=r"ForwardBatch.drafts of shape \(1, 2\)"):
            verify(last + [0, 0, 0], torch.tensor([[5, 6]]))
        plain = ForwardBatch([last], [start], [slots], ids=[seq.request_id])
        with pytest.raises(ValueError, match="mixed forward"):
            plain.joined(ForwardBatch([last + [0]], [start], [slots], n_verify=1, ids=[seq.request_id],
                                      drafts=torch.tensor([[5]])))
    finally:
        model.set_backends(None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_captured_verification_of_drafts_on_the_device_does_not_wait_for_the_device():
    # the verification a whole proposal's drafts go into (ForwardBatch.drafts) as a graph replay: its inputs reach the
    # buffers through pinned memory and device copies, so nothing in it synchronizes with the device (torch's sync
    # debug mode); its logits equal the verification of the same tokens from the host
    import copy
    import warnings

    from k3.serve.runner import ForwardBatch

    model = copy.deepcopy(fx._model()).cuda().set_dtype(torch.bfloat16).set_backends(Backends(per_op=GRAPH_OPS))
    eng = LLMEngine(model, None, EngineConfig(
        cache_memory_mb=16.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, speculative="mtp", num_draft_tokens=3,
        cuda_graphs=True, scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=8)))
    eng.eos_id = None
    seq = eng.add_request(list(fx._prompts(1, 5)[0]), SamplingParams(max_tokens=8, temperature=0))
    eng.step()
    start, slots = seq.num_computed, eng.scheduler.slots(seq)
    last = seq.token_range(start, start + 1)

    def verify(tokens, drafts=None):
        return eng.runner.execute(ForwardBatch([tokens], [start], [slots], n_verify=1, ids=[seq.request_id],
                                               drafts=drafts)).verified.logits

    want = verify(last + [5, 6, 7]).clone()  # the bucket captured
    drafts = torch.tensor([[5, 6, 7]], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = verify(last + [0, 0, 0], drafts)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert eng.runner.graphs.replays >= 2 and torch.equal(got, want)


@pytest.mark.parametrize("graphs", [True, False], ids=["static", "eager"])
def test_every_layers_replay_at_once_writes_the_states_of_the_layer_by_layer_replay(monkeypatch, graphs):
    # the replay of a verification's accepted positions (ModelRunner.replay: every KDA layer's kept inputs side by
    # side, a view of a static-buffer verification's Verified.flat or one copy of an eager one's per-layer inputs,
    # replayed at once by k3.model.kda.replay_layers) writes the same states and conv tails into the pages as each
    # layer's own KimiDeltaAttention.replay of its inputs from the same pool; and the unfused engine it runs in
    # decodes as plain decoding does
    from k3.serve.runner import ModelRunner, ReplayedPositions

    model = fx._model()
    model.set_backends(Backends(per_op=GRAPH_OPS))
    checked = []
    real = ModelRunner.replay

    def both(runner, v, rows, offsets, lengths):
        if not rows:
            return real(runner, v, rows, offsets, lengths)
        before = runner.pool.pages.clone()
        pick = ReplayedPositions(rows, offsets, lengths, v.logits.shape[1], runner.device)
        pages = v.kda_pages[:, pick.rows]
        for g, li in enumerate(runner.layout.kda):  # the reference: layer by layer
            state, conv = runner.pool.read_kda(pages[g])
            layer = runner.model.model.layers[li].self_attn
            runner.pool.write_kda(pages[g], *layer.replay(pick(v.kda_views[g].inputs), state, conv, lengths))
        want = runner.pool.pages.clone()
        runner.pool.pages.copy_(before)
        real(runner, v, rows, offsets, lengths)
        ids = pages.flatten()
        for a, b, name in zip(runner.pool.read_kda(ids), _read(runner, want, ids), ("states", "conv tails")):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)
        assert torch.equal(runner.pool.pages[:, runner.pool.kda_page_bytes:], want[:, runner.pool.kda_page_bytes:])
        checked.append((v.flat is not None, len(rows)))

    def _read(runner, pages, ids):
        now = runner.pool.pages.clone()
        runner.pool.pages.copy_(pages)
        got = [t.clone() for t in runner.pool.read_kda(ids)]
        runner.pool.pages.copy_(now)
        return got

    monkeypatch.setattr(ModelRunner, "replay", both)
    try:
        eng = _engine(graphs, fx.OracleDraft(wrong_every=3), fused=False)
        prompts = fx._prompts(7, 3)
        params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
        fx._check(fx._run(eng, [list(zip(prompts, params))]), params)
        # one request's replay (views) and several (gathers) both ran, from the verifications' kind of inputs
        assert {n > 1 for _, n in checked} == {False, True} and {f for f, _ in checked} == {graphs}, checked
    finally:
        model.set_backends(None)


@pytest.mark.parametrize("fused", [None, False], ids=["default", "replay-after"])
def test_a_model_without_kda_layers_speculates_on_static_buffers(fused):
    # the all-MLA ablation: its static-buffer verification keeps no KDA inputs (an empty [B, T, 0]; flat_inputs of
    # no layer failed), and a commit has no state to replay; greedy output equals plain decoding
    from helpers import randomize_
    from k3.config import K3Config
    from k3.model.model import K3ForCausalLM

    cfg = K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, kda_layers=[],
                                               full_attn_layers=list(range(1, 6)))
    model = randomize_(K3ForCausalLM(cfg), seed=4).eval()
    model.set_backends(Backends(per_op=GRAPH_OPS))
    outs = []
    for spec in ("off", "mtp"):
        eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=8.0, speculative=spec, num_draft_tokens=3,
                                                  fused_replay=fused, cuda_graphs="eager" if spec == "mtp" else False))
        eng.eos_id = None
        outs.append(eng.generate([list(range(3, 40))], SamplingParams(max_tokens=12, temperature=0))[0].output_ids)
    assert eng.runner.graphs.verify_steps > 0 and outs[0] == outs[1]
