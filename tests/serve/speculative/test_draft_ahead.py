"""Drafting ahead (EngineConfig.draft_ahead, k3.serve.speculative.decoder): after a verification whose requests all
accepted every draft last time, their next proposal is drafted on the draft's chains before the acceptance is read
back, and taken only where every draft was accepted again. Greedy outputs (tokens, text, finish reasons, streamed
outputs) equal plain decoding's and those of an engine that never drafts ahead, with a draft that is always right
(proposals drafted ahead taken) and a random one (drafted ahead after every verification, almost never taken), under
stop strings, max_tokens inside a verification, prefix-cache hits, chunked prefill and preemption. The draft's own
state path (the proposals and contexts after one drafted ahead, bit for bit those of the proposal after acceptance)
is tested in test_batched_draft.py. Verifications and chains run on static buffers uncaptured (cuda_graphs="eager":
a captured step's code on the CPU)."""

import copy
import functools
import importlib.util
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import load_benchmark

from k3.ops.registry import Backends
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.metrics import render_metrics
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from k3.serve.sequence import Status

_spec = importlib.util.spec_from_file_location("spec_engine_fixtures_a",
                                               Path(__file__).with_name("test_spec_engine.py"))
fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fx)

sd = load_benchmark("spec_decode")
GRAPH_OPS = {"mla_decode": "triton", "moe": "grouped"}  # what a static-buffer step needs (on CPU: the references)


@functools.lru_cache(maxsize=2)
def _model(right: bool):
    """The test model on the static-buffer ops; `right`: its MTP draft always right (`make_draft_right_`: the target's
    next token a function of its current token, the draft's the target's next after that; the tokens still differ
    from position to position)."""
    m = copy.deepcopy(fx._model())
    if right:  # benchmarks/spec_decode.py --right-draft
        layers = len(m.model.layers) + len(m.mtp)
        assert sd.make_draft_right_(m) >= 2 * layers  # at least the attention's and the MLP's output per layer
    m.set_backends(Backends(per_op=GRAPH_OPS))
    return m


def _engine(right: bool, spec="mtp", ahead=True, k=3, mb=4.0, chunk=40, step_tokens=96):
    eng = LLMEngine(_model(right), fx._tok(), EngineConfig(
        cache_memory_mb=mb, page_tokens=fx.PAGE, hash_block_tokens=fx.HB, speculative=spec, num_draft_tokens=k,
        cuda_graphs="eager", draft_ahead=ahead,
        scheduler=SchedulerConfig(max_step_tokens=step_tokens, prefill_chunk=chunk, max_num_seqs=8)))
    eng.eos_id = None
    return eng


@functools.lru_cache(maxsize=None)
def reference(right: bool, prompt: tuple, max_tokens: int, stop: tuple):
    """The request alone without speculation: (tokens, text, finish reason)."""
    p = SamplingParams(max_tokens=max_tokens, temperature=0, stop=list(stop))
    s = _engine(right, spec="off", mb=8.0).generate([list(prompt)], p)[0]
    return s.output_ids, s.text, s.finish_reason


def _stop_string(right: bool, prompt, max_tokens: int) -> list[str]:
    """A short piece of the request's reference text (a stop string it will meet), or none."""
    text = reference(right, tuple(prompt), max_tokens, ())[1]
    return [text[len(text) // 2: len(text) // 2 + 2]] if len(text) >= 4 else []


def _check(right, results, params):
    for (s, ids, text), p in zip(results, params):
        assert s.status == Status.FINISHED
        assert (s.output_ids, s.text, s.finish_reason) == reference(right, tuple(s.prompt_ids), p.max_tokens,
                                                                   tuple(p.stop)), s.request_id
        assert ids == s.output_ids and text == s.text


def test_proposals_drafted_ahead_are_taken_when_every_draft_is_accepted():
    prompts = fx._prompts(0, 4)
    params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
    got = {}
    for ahead in (True, False):
        eng = _engine(True, ahead=ahead)
        _check(True, fx._run(eng, [list(zip(prompts, params))]), params)
        m, counts = eng.metrics, sd.ahead_counts(eng)
        assert m.draft_tokens_accepted == m.draft_tokens_proposed > 0  # the draft is always right
        got[ahead] = (m.spec_verifications, dict(counts))
        if ahead:  # the metrics count requests, the draft's counts batches of them
            assert m.spec_drafted_ahead >= counts["ahead"] and m.spec_drafted_ahead_taken >= counts["taken"]
            assert 0 < m.spec_drafted_ahead_taken <= m.spec_drafted_ahead
            text = render_metrics(eng)
            assert f"k3_spec_drafted_ahead_taken_total {m.spec_drafted_ahead_taken}" in text
    text = render_metrics(eng)  # the engine without drafting ahead: zeros
    assert "k3_spec_drafted_ahead_total 0" in text and "k3_spec_drafted_ahead_taken_total 0" in text
    (verifications, counts), (plain_verifications, plain) = got[True], got[False]
    assert plain == {"ahead": 0, "taken": 0} and verifications == plain_verifications
    # after the first verification of a batch every one drafts ahead, and every proposal but the first is taken
    # from one (those drafted after a request's last verification are not: it finished)
    assert counts["taken"] > 0 and counts["ahead"] - counts["taken"] <= 2


def test_plain_steps_between_verifications_leave_proposals_drafted_ahead_untaken():
    prompts = fx._prompts(2, 3)
    params = [SamplingParams(max_tokens=fx.LONGEST, temperature=0)] * len(prompts)
    eng = _engine(True)
    eng.spec_switch = fx.EveryThirdPlain()  # the proposals drafted ahead before a plain step are never taken
    _check(True, fx._run(eng, [list(zip(prompts, params))]), params)
    counts = sd.ahead_counts(eng)
    # drafted after every verification that followed a whole acceptance; taken only by a proposal right after it
    assert 0 < counts["taken"] < counts["ahead"]


def test_a_draft_that_is_wrong_drafts_ahead_and_takes_nothing_it_should_not():
    prompts = fx._prompts(1, 3)
    params = [SamplingParams(max_tokens=12, temperature=0)] * len(prompts)
    eng = _engine(False)
    eng.speculative.ahead_after_full = False  # ahead after every verification, accepted or not
    _check(False, fx._run(eng, [list(zip(prompts, params))]), params)
    assert sd.ahead_counts(eng)["ahead"] > 0 and eng.metrics.spec_verifications > 0


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking: each example runs engines
@given(data=st.data())
def test_random_request_mixes_drafted_ahead_match_plain_decoding(data):
    right = data.draw(st.booleans())
    eng = _engine(right, k=data.draw(st.sampled_from([1, 2, 3, 5])), mb=data.draw(st.sampled_from([0.5, 0.8, 4.0])),
                  chunk=data.draw(st.sampled_from([16, 24, 40])), step_tokens=data.draw(st.sampled_from([32, 96])))
    # a wrong draft never accepts every draft: it drafts ahead only when told to after every verification
    eng.speculative.ahead_after_full = right and data.draw(st.booleans())
    waves, params = fx.random_waves(data, functools.partial(_stop_string, right))
    _check(right, fx._run(eng, waves), params)
    eng.cache.prefix.check_invariants()
