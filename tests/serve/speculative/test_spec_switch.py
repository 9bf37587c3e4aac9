"""Speculation on or off per decode batch size (k3.serve.speculative.switch): the switch probes both arms, keeps the one
with more tokens per second and re-probes the other; in the engine it turns speculation off where plain decoding
measures faster and keeps it where speculation does, per bucket, with every output unchanged."""

import importlib.util
from pathlib import Path

import pytest

from k3.serve.metrics import render_metrics
from k3.serve.sampling import SamplingParams
from k3.serve.speculative.switch import SpecSwitch, bucket_of

# the engine fixtures of the speculative-decoding tests: the same tiny target, oracle draft and reference outputs
_spec = importlib.util.spec_from_file_location("spec_engine_fixtures", Path(__file__).with_name("test_spec_engine.py"))
_fx = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fx)
LONGEST, OracleDraft, _check, _engine, _prompts, _run = (_fx.LONGEST, _fx.OracleDraft, _fx._check, _fx._engine,
                                                         _fx._prompts, _fx._run)


def test_buckets_are_powers_of_two():
    assert [bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]
    with pytest.raises(ValueError, match="batch"):
        bucket_of(0)
    for bad in (dict(probe_steps=0), dict(window=True), dict(reprobe_every=1), dict(reprobe_every=8, reprobe_max=4),
                dict(reprobe_max=0)):
        with pytest.raises(ValueError):
            SpecSwitch(**bad)


def _drive(sw, batch, steps, rate):
    """Run `steps` decode-only steps of `batch` requests; rate(speculative) -> tokens per second. Returns the
    decisions taken."""
    seen = []
    for _ in range(steps):
        spec = sw.decide(batch)
        seen.append(spec)
        sw.record(batch, spec, 100, 100 / rate(spec))
    return seen


def test_probes_both_arms_then_keeps_the_faster_and_reprobes_the_other():
    sw = SpecSwitch(probe_steps=3, window=4, reprobe_every=10)
    # probing alternates pairs of steps, spec first, each pair's second step measured: 3 measured steps of each arm
    seen = _drive(sw, 1, 12, lambda spec: 300.0 if spec else 100.0)
    assert seen == [True, True, False, False] * 3
    assert sw.state()[1]["speculative"] is True
    assert sw.state()[1]["spec_tokens_per_s"] == pytest.approx(300.0)
    seen = _drive(sw, 1, 30, lambda spec: 300.0 if spec else 100.0)
    # bucket step counts 13..42: re-probes of two steps each at the 20th and the 30th, then (the decision held) not
    # before the 50th
    assert [i + 13 for i, s in enumerate(seen) if not s] == [20, 21, 30, 31]
    # batch 2 is its own bucket: plain is faster there
    _drive(sw, 2, 12, lambda spec: 50.0 if spec else 100.0)
    assert sw.state()[2]["speculative"] is False and sw.state()[1]["speculative"] is True
    # the content changes (acceptance falls): the re-probes and the current arm's own measurements move the medians
    _drive(sw, 1, 40, lambda spec: 60.0 if spec else 100.0)
    assert sw.state()[1]["speculative"] is False
    # a bucket's first step is never measured: its time (compilation) does not count
    sw2 = SpecSwitch(probe_steps=1)
    assert sw2.decide(4) is True
    sw2.record(4, True, 100, 1000.0)
    assert sw2.state()[4]["spec_tokens_per_s"] is None


def test_reprobes_back_off_while_the_decision_holds_and_come_back_when_it_changes():
    sw = SpecSwitch(probe_steps=1, window=1, reprobe_every=4, reprobe_max=16)
    rate = {"spec": 50.0}
    _drive(sw, 1, 4, lambda spec: rate["spec"] if spec else 100.0)  # probing: a pair of each arm, one measured
    assert sw.state()[1]["speculative"] is False
    seen = _drive(sw, 1, 60, lambda spec: rate["spec"] if spec else 100.0)  # bucket steps 5..64
    # two-step re-probes at the next multiple of 4, 4 steps later, then (the decision held) 8 and 16 (the cap) apart
    assert [i + 5 for i, s in enumerate(seen) if s] == [8, 9, 12, 13, 20, 21, 36, 37, 52, 53]
    # speculation becomes faster: the re-probe at 68-69 measures it and the decision changes; the re-probe after it
    # (of plain, at 84) finds a changed decision, so the next comes 4 steps later, then 8, 16 while it holds
    rate["spec"] = 400.0
    seen = _drive(sw, 1, 60, lambda spec: rate["spec"] if spec else 100.0)  # steps 65..124
    assert [i + 65 for i, s in enumerate(seen) if not s] == [65, 66, 67, 84, 85, 88, 89, 96, 97, 112, 113]
    assert sw.state()[1]["speculative"] is True
    # a fixed interval, as before: reprobe_max == reprobe_every
    fixed = SpecSwitch(probe_steps=1, window=1, reprobe_every=4, reprobe_max=4)
    _drive(fixed, 1, 4, lambda spec: 50.0 if spec else 100.0)
    seen = _drive(fixed, 1, 20, lambda spec: 50.0 if spec else 100.0)
    assert [i + 5 for i, s in enumerate(seen) if s] == [8, 9, 12, 13, 16, 17, 20, 21, 24]


def test_catch_up_steps_are_never_measured():
    # the first step of an arm after the other's catches up: speculating after plain steps first drafts over what
    # they committed, and a plain step after speculation first replays the positions it left pending (fused replay).
    # Both are slow; measured, they decided a random model's buckets for speculation at 0.28x plain (the plain
    # catch-up, 9-10 ms against 1.1 ms per step on an H100, looked slower than speculation)
    def steady(spec_rate, plain_rate):
        last = [None]

        def rate(spec):
            catch_up = last[0] is not None and spec != last[0]
            last[0] = spec
            return (5.0 if catch_up else spec_rate) if spec else (2.0 if catch_up else plain_rate)
        return rate

    for spec_rate, plain_rate, want in ((400.0, 100.0, True), (100.0, 400.0, False)):
        sw = SpecSwitch(probe_steps=2, window=1, reprobe_every=4, reprobe_max=4)
        seen = _drive(sw, 1, 24, steady(spec_rate, plain_rate))
        # probing: pairs (spec, spec, plain, plain, ...), then the decision, kept through the re-probes (a pair of
        # the other arm at every 4th step) and the decided arm's own catch-up after each
        assert seen[:8] == [True, True, False, False] * 2
        assert sw.state()[1]["speculative"] is want
        assert [i + 1 for i, s in enumerate(seen) if i >= 8 and s != want] == [12, 13, 16, 17, 20, 21, 24]
        assert sw.state()[1]["spec_tokens_per_s"] == spec_rate and sw.state()[1]["plain_tokens_per_s"] == plain_rate


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _timed(eng, spec_cost, plain_cost):
    """The engine's step times from a cost model: each verification group costs spec_cost, each plain forward
    plain_cost (fake seconds)."""
    clock = FakeClock()
    eng.clock = clock
    execute = eng.runner.execute

    def timed(batch):
        clock.now += spec_cost if batch.n_verify else plain_cost
        return execute(batch)

    eng.runner.execute = timed
    return eng


@pytest.mark.parametrize("oracle", [True, False])
def test_engine_keeps_speculation_where_it_is_faster_and_drops_it_where_not(oracle):
    """A verification costs twice a plain step. With the oracle draft (4 tokens per verification) speculation
    wins at batch 1; with the MTP draft of random weights (~1 token per verification) it loses, and the switch turns
    it off after probing. Greedy outputs equal decoding without speculation either way."""
    eng = _engine(OracleDraft() if oracle else None, spec="off" if oracle else "mtp", k=3)
    eng.cfg.speculative_auto = True
    from k3.serve.speculative.switch import SpecSwitch as S

    eng.spec_switch = S(probe_steps=2, reprobe_every=8)
    _timed(eng, spec_cost=2.0, plain_cost=1.0)
    prompts = _prompts(5, 1)
    params = [SamplingParams(max_tokens=LONGEST, temperature=0)]
    _check(_run(eng, [list(zip(prompts, params))]), params)
    st = eng.spec_switch.state()[1]
    assert st["speculative"] is oracle
    m = eng.metrics
    assert m.spec_verifications > 0
    text = render_metrics(eng)
    assert f'k3_spec_auto_enabled{{le="1"}} {int(oracle)}' in text
    assert 'k3_spec_auto_tokens_per_second{le="1",arm="plain"}' in text
    if not oracle:  # after probing only the re-probes speculate
        assert m.spec_verifications <= 2 + 1 + LONGEST // 8 + 1


def test_mixed_batches_greedy_outputs_unchanged_under_switching():
    """Many requests at once, with chunked prefill and a switch whose decisions flip: outputs equal decoding
    without speculation."""
    eng = _engine(OracleDraft(wrong_every=3), k=3)
    flips = iter([True, False, False, True] * 1000)

    class Flipping(SpecSwitch):
        def decide(self, batch):
            super().decide(batch)
            return next(flips)

    eng.spec_switch = Flipping()
    prompts = _prompts(6, 5)
    params = [SamplingParams(max_tokens=LONGEST - 4 + i, temperature=0, stop=["\x07"] if i == 2 else [])
              for i in range(len(prompts))]
    _check(_run(eng, [list(zip(prompts[:3], params[:3])), list(zip(prompts[3:], params[3:]))]), params)
    assert eng.metrics.spec_verifications > 0
    assert any(st["plain_tokens_per_s"] is not None for st in eng.spec_switch.state().values())


def test_the_flag_reaches_the_engine():
    from k3 import cli
    from k3.serve.engine import EngineConfig

    parse = cli.build_parser().parse_args
    assert parse(["serve", "--ckpt", "x"]).speculative_auto is True
    assert parse(["generate", "--ckpt", "x", "hi", "--no-speculative-auto"]).speculative_auto is False
    with pytest.raises(ValueError, match="speculative_auto"):
        EngineConfig(speculative_auto="yes").validate()
    eng = _engine(spec="mtp")
    assert eng.spec_switch is None  # off unless asked for
