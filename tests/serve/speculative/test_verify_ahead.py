"""Verifying ahead (EngineConfig.verify_ahead, k3.serve.speculative.decoder): the verification of a proposal drafted
ahead is launched before the acceptance of the one before it is read back, with the accepted positions it assumes
pending in it and the KDA states it overwrites saved; kept where every request accepted every draft and none finished,
used by the next step where its proposal is that step's, else restored and dropped. Greedy outputs (tokens, text,
finish reasons, streamed outputs) equal plain decoding's, and after every step each running request's KDA states
(its pending positions replayed on a copy of the pool) are a plain run's at its num_computed (test_fused_replay's
check, same tolerances): with a draft that is always right (launched and used), with a random one (launched after
every verification and dropped: the restore), with plain steps of the switch in between, an abort, requests joining
mid-stream, an EAGLE-3 draft (whose launched verifications carry the AttnRes features), and random request mixes
(stop strings, max_tokens inside a verification, prefix-cache hits, chunked prefill, preemption). Verifications and
chains run on static buffers uncaptured (cuda_graphs="eager")."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import serve_flag_reaches_the_engine
from k3.serve.engine import EngineConfig
from k3.serve.metrics import render_metrics
from k3.serve.sampling import SamplingParams


def _load(name: str, alias: str):
    spec = importlib.util.spec_from_file_location(alias, Path(__file__).with_name(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


da = _load("test_draft_ahead.py", "draft_ahead_fixtures_v")  # the right-draft model, engines, references
fr = _load("test_fused_replay.py", "fused_replay_fixtures_v")  # the per-step KDA state check
fx = da.fx


@functools.lru_cache(maxsize=4096)
def _plain_state(right: bool, tokens: tuple):
    return fr.states_after(da._model(right), tokens)


def _engine(right: bool, **kw):
    eng = da._engine(right, **kw)
    eng.cfg.verify_ahead = True
    return eng


def _drive(eng, right: bool, waves):
    return fr.drive(eng, waves, plain=functools.partial(_plain_state, right))


def test_launched_verifications_are_used_when_every_draft_is_accepted():
    prompts = fx._prompts(0, 3)
    params = [SamplingParams(max_tokens=40, temperature=0)] * len(prompts)
    eng = _engine(True)
    results, _ = _drive(eng, True, [list(zip(prompts, params))])
    da._check(True, results, params)
    m = eng.metrics
    assert m.draft_tokens_accepted == m.draft_tokens_proposed > 0  # the draft is always right
    # launched where no hash-block boundary lies in the accepted window and a whole next window fits max_tokens,
    # and then used (the same requests go on speculating)
    assert 0 < m.spec_verified_ahead_used <= m.spec_verified_ahead
    assert m.spec_verified_ahead - m.spec_verified_ahead_used <= len(prompts)
    text = render_metrics(eng)
    assert f"k3_spec_verified_ahead_used_total {m.spec_verified_ahead_used}" in text
    assert not eng.runner.pending and eng.speculative._launched is None


def test_a_wrong_draft_launches_and_restores():
    # a random draft accepts almost nothing: with drafting ahead after every verification, a verification is
    # launched after every one and dropped at its acceptance (the saved states written back), never used
    prompts = fx._prompts(1, 3)
    params = [SamplingParams(max_tokens=16, temperature=0)] * len(prompts)
    eng = _engine(False)
    eng.speculative.ahead_after_full = False
    restored = []
    pool = eng.runner.pool
    orig = type(pool).write_kda
    pool.write_kda = lambda ids, state, conv: (restored.append(len(ids)), orig(pool, ids, state, conv))[1]
    results, _ = _drive(eng, False, [list(zip(prompts, params))])
    da._check(False, results, params)
    m = eng.metrics
    assert m.spec_verified_ahead > 0 and m.spec_verified_ahead_used == 0 and restored


def test_plain_steps_and_an_abort_between_drop_what_was_launched():
    prompts = fx._prompts(2, 3)
    params = [SamplingParams(max_tokens=40, temperature=0)] * len(prompts)
    eng = _engine(True)
    eng.spec_switch = fx.EveryThirdPlain()  # a plain step after a kept launch: dropped (its states committed)
    seqs = [eng.add_request(list(p), q) for p, q in zip(prompts, params)]
    check = functools.partial(fr.check_states, eng, plain=functools.partial(_plain_state, True))
    for _ in range(6):
        eng.step()
        check()
    eng.abort_request(seqs[1].request_id)  # whatever was launched with it is dropped
    assert eng.speculative._launched is None or seqs[1].request_id not in eng.speculative._launched.ids
    while eng.has_work():
        eng.step()
        check()
    for s in (seqs[0], seqs[2]):
        assert (s.output_ids, s.text, s.finish_reason) == da.reference(True, tuple(s.prompt_ids), 40, ())
    assert eng.metrics.spec_verified_ahead > 0


def test_an_eagle3_draft_verified_ahead_reads_the_launched_verifications_features():
    # an EAGLE-3 draft on the chains (it observes AttnRes block features beside the hidden states): a verification
    # launched ahead carries them as any other; its random draft makes every launch a restore
    from k3.model.eagle3 import Eagle3Layer
    from k3.serve.engine import LLMEngine
    from k3.serve.scheduler import SchedulerConfig
    from k3.serve.speculative.draft import Eagle3Draft

    model = da._model(False)
    layer = Eagle3Layer.from_target(model)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the fused features matter: W_E3 away from [0 0 I]
        layer.fc.weight.add_(torch.randn(layer.fc.weight.shape, generator=g) * 0.05)
    eng = LLMEngine(model, fx._tok(), EngineConfig(
        cache_memory_mb=4.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, num_draft_tokens=3, cuda_graphs="eager",
        verify_ahead=True, scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=8)),
        draft=Eagle3Draft(model, layer, chain_graphs="eager"))
    eng.eos_id = None
    assert eng.draft.features == (1, 2) and eng.draft.chains is not None
    spec = eng.speculative
    spec.ahead_after_full = False
    widths, real = [], spec._verify_ahead

    def launch(work, v, targets):  # each launched verification's hidden rows hold the features, as `v`'s do
        real(work, v, targets)
        if spec._launched is not None:
            widths.append((spec._launched.v.hidden.shape[-1], v.hidden.shape[-1]))

    spec._verify_ahead = launch
    prompts = fx._prompts(1, 3)
    params = [SamplingParams(max_tokens=16, temperature=0)] * len(prompts)
    results, _ = _drive(eng, False, [list(zip(prompts, params))])
    da._check(False, results, params)
    D = model.config.hidden_size
    assert eng.metrics.spec_verified_ahead > 0 and widths and all(a == b == 3 * D for a, b in widths)


def test_verify_ahead_is_checked_and_off_by_default():
    assert EngineConfig().verify_ahead is False
    with pytest.raises(ValueError, match="verify_ahead"):
        EngineConfig(verify_ahead=1).validate()


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking: each example runs engines
@given(data=st.data())
def test_random_request_mixes_verified_ahead_match_plain_decoding(data):
    right = data.draw(st.booleans())
    eng = _engine(right, k=data.draw(st.sampled_from([1, 2, 3])), mb=data.draw(st.sampled_from([0.5, 0.8, 4.0])),
                  chunk=data.draw(st.sampled_from([16, 40])), step_tokens=data.draw(st.sampled_from([32, 96])))
    eng.speculative.ahead_after_full = right and data.draw(st.booleans())
    waves, params = fx.random_waves(data, functools.partial(da._stop_string, right))
    results, _ = _drive(eng, right, waves)
    da._check(right, results, params)
    eng.cache.prefix.check_invariants()
    assert not eng.runner.pending


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_verifications_launched_ahead_on_captured_graphs_equal_those_launched_after():
    """On the GPU, captured graphs and chains, bf16, the draft always right: an engine that verifies ahead (the
    launched verification's tokens all on the device: the bonus target and the drafts) gives the same greedy tokens,
    bit for bit, as one that only drafts ahead (the same kernels on the same inputs: every launched verification's
    pending positions are what the acceptance then commits), and uses what it launched; nothing in a launch waits for
    the device."""
    import copy
    import warnings

    from k3.serve.engine import LLMEngine
    from k3.serve.scheduler import SchedulerConfig

    model = copy.deepcopy(da._model(True)).cuda().set_dtype(torch.bfloat16)
    prompts = fx._prompts(3, 3)
    params = SamplingParams(max_tokens=40, temperature=0)
    runs, syncs = [], []
    for ahead in (True, False):
        eng = LLMEngine(model, None, EngineConfig(
            cache_memory_mb=16.0, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, speculative="mtp",
            cuda_graphs=True, verify_ahead=ahead,
            scheduler=SchedulerConfig(max_step_tokens=96, prefill_chunk=40, max_num_seqs=8)))
        eng.eos_id = None
        eng.warm_up()
        if ahead:
            spec, real = eng.speculative, eng.speculative._verify_ahead

            def watched(*a):
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        real(*a)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                syncs.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))

            spec._verify_ahead = watched
        seqs = eng.generate([list(p) for p in prompts], params)
        runs.append([s.output_ids for s in seqs])
        assert eng.runner.graphs.disabled is None and eng.runner.graphs.replays > 0
        if ahead:
            assert eng.metrics.spec_verified_ahead_used > 0
    assert runs[0] == runs[1] and not syncs


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_the_verify_ahead_flag(tmp_path, monkeypatch):
    import argparse

    from k3 import cli
    from k3.serve.build import build_engine
    from k3.serve.options import add_speculative_arguments

    parser = argparse.ArgumentParser()
    add_speculative_arguments(parser)
    assert parser.parse_args([]).verify_ahead is False
    assert parser.parse_args(["--speculative", "mtp", "--verify-ahead"]).verify_ahead is True
    for kw in (dict(speculative="off"), dict(speculative="mtp", fused_replay=False)):  # refused before any load
        with pytest.raises(ValueError, match="--verify-ahead .*needs --speculative mtp or eagle3 with the fused"):
            build_engine(str(tmp_path), verify_ahead=True, **kw)
    serve_flag_reaches_the_engine(monkeypatch, tmp_path, "verify_ahead",
                                  [([], False), (["--speculative", "mtp", "--verify-ahead"], True)])
    parse = cli.build_parser().parse_args
    assert parse(["generate", "--ckpt", str(tmp_path), "x", "--verify-ahead"]).verify_ahead is True
