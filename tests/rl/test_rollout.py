"""Agent rollouts (k3.rl.rollout): token in, token out rows, partial rollouts that resume exactly where they paused,
policy versions per token, the throttle.

The model's sampled tokens are scripted (tests/rl/conftest.py): the episodes call tools, read results and submit,
through the real engine, renderer, parser, episode, tools and sandbox; the log-probs are the real model's.
"""

import pytest
import torch

from rl.oracle import _task
from k3.env.episode import Episode
from k3.rl.rollout import AgentRollouts, RolloutConfig, Sample, Throttle
from k3.serve.chat import DEFAULT_CHAT_TEMPLATE, render_chat_ids
from k3.serve.engine import EngineConfig, LLMEngine

def _rollouts(policy, **kw):
    model, tok = policy
    cfg = RolloutConfig(harness="terminal", sandbox_kind="none", max_turn_tokens=512, **kw)
    ecfg = EngineConfig(cache_memory_mb=32.0, page_tokens=64, hash_block_tokens=16, cuda_graphs=False)
    return AgentRollouts(model, tok, DEFAULT_CHAT_TEMPLATE, cfg, ecfg, Throttle(start=8))


def _samples(n=3):
    return [Sample(uid=i, group=i // 2, task=_task(i), episode=Episode(_task(i), "terminal", None, sandbox_kind="none"))
            for i in range(n)]


def test_rows_are_the_tokens_sampled_and_the_template_between(policy, scripted):
    """The row built token in, token out equals the template's rendering of the final conversation (up to the
    closing tag after the last message), and its sampled tokens are exactly the scripted message bodies."""
    _, tok = policy
    ro = _rollouts(policy)
    samples = _samples(2)
    ro.run(samples, seed=1)
    for s in samples:
        assert s.done and s.success and s.reward == 1.0, s.error
        assert len(s.rows) == 1 and s.turns == 2
        msgs = s.trajectory["messages"]
        full = render_chat_ids(msgs, tok, None, False, tools=s.episode.tool_specs())
        row = s.row.ids
        assert full[:len(row)] == row
        # after the last sampled token: the closing tag and the submit call's result (not part of the row)
        assert tok.decode(full[len(row):]).startswith("[close]assistant[sep][open]tool tool=\"submit\"")
        runs, cur = [], []
        for t, v in zip(row, s.row.versions):
            if v >= 0:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        runs.append(cur)
        assert runs == scripted
        assert s.output_tokens == sum(map(len, scripted))
        assert all(lp <= 0 for lp, v in zip(s.row.logprobs, s.row.versions) if v >= 0)
    ro.close()


def test_parking_frees_the_engine_now(policy, scripted):
    """park (before a training step) frees the engine and its page pool at once, not at the cycle collector's next
    run: the engine's parts refer to one another, and a cache pool's bytes never prompt that collector."""
    import gc
    import weakref

    ro = _rollouts(policy)
    ro.run(_samples(2), seed=1)
    gone = weakref.ref(ro.engine)
    gc.disable()
    try:
        ro.park([])
        assert gone() is None and ro._engine is None
        ro.policy_changed()
        first = weakref.ref(ro.engine)
        ro.policy_changed()
        ro.engine  # a new version: the old engine is freed before the new one is built
        assert first() is None
    finally:
        gc.enable()
    ro.close()


@pytest.mark.parametrize("write_back", [False, True])
def test_partial_rollouts_resume_exactly_where_they_paused(policy, scripted, write_back):
    """Paused mid-turn, the engine dropped (its prefixes written back to host memory, or not), the policy version
    moved, then resumed: the same tokens, the same behaviour log-probs (1e-5: the states of the resumed prefix equal
    those of the uninterrupted run), the same sandbox and verdict; tokens after the pause carry the new version."""
    if write_back and not hasattr(LLMEngine, "write_back"):
        pytest.skip("the engine has no host write-back")
    ro = _rollouts(policy)
    plain = _samples(3)
    ro.run(plain, seed=1)
    ro.close()

    ro = _rollouts(policy, write_back=write_back)
    paused = _samples(3)
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] > 40

    ro.run(paused, stop=stop, seed=1)
    mid = [s for s in paused if not s.done]
    assert mid and any(0 < s.turn_tokens for s in mid), "the pause should fall inside a turn"
    cut = {s.uid: len(s.row.ids) for s in paused}
    ro.park(paused)
    ro.policy_changed()
    stats = ro.run(paused, seed=2)
    assert stats["paused"] == 0
    if write_back:
        assert ro.counters["prefetched_tokens"] > 0
        assert stats["cached_tokens"] > 0
    for a, b in zip(plain, paused):
        assert b.done and b.success and b.reward == 1.0
        assert a.row.ids == b.row.ids
        assert torch.allclose(torch.tensor(a.row.logprobs), torch.tensor(b.row.logprobs), atol=1e-5)
        assert [m for m in a.trajectory["messages"]] == [m for m in b.trajectory["messages"]]
        vs = b.row.versions
        n = cut[b.uid]
        assert all(v in (-1, 0) for v in vs[:n]) and all(v in (-1, 1) for v in vs[n:])
    assert any(1 in s.versions() and 0 in s.versions() for s in paused)
    ro.close()


def test_episode_wall_clock_stops_while_waiting_for_the_policy(policy, scripted):
    """The wall budget counts the environment's time: a sample that waits (here: paused for 1.5 s) is not timed
    out by a 1-second budget."""
    import time

    ro = _rollouts(policy)
    s = _samples(1)[0]
    s.task.budget.wall_seconds = 1.0
    calls = {"n": 0}

    def stop():
        calls["n"] += 1
        return calls["n"] > 5

    ro.run([s], stop=stop, seed=1)
    time.sleep(1.5)
    ro.run([s], seed=1)
    assert s.done and s.success, s.trajectory["end_reason"]
    ro.close()


def test_throttle_backs_off_under_pressure_and_grows_with_room():
    class Eng:
        def __init__(self, used, queued=0, pre=0):
            self.cache = type("C", (), {"stats": lambda _s: {"num_pages": 100, "free_pages": 100 - used,
                                                              "evictable_pages": 0}})()
            self.scheduler = type("S", (), {"num_waiting": queued})()
            self.metrics = type("M", (), {"preemptions": pre})()

    t = Throttle(start=16, every=1)
    assert t.update(Eng(10)) == 18  # room: additive increase
    assert t.update(Eng(95)) == 12  # cache above 85%: multiplicative decrease
    assert t.update(Eng(10, queued=3)) == 8  # requests queue in the engine
    assert t.update(Eng(10, pre=1)) == 5  # a preemption happened
    assert t.update(Eng(80)) == 5  # between the watermarks: hold
    assert t.update(Eng(10), demand=3) == 5  # room, but the limit does not bind: hold
    assert t.update(Eng(10), demand=9) == 7
    f = Throttle(start=16, fixed=True)
    assert f.update(Eng(99, queued=5)) == 16
    with pytest.raises(ValueError, match="throttle"):
        Throttle(start=0)


def _row_logprobs(model, ids: list[int], autocast: bool) -> torch.Tensor:
    """The model's log-prob of each token of `ids` given the ones before (position 0 has none: 0), one forward as
    the trainer runs it (bf16 autocast with its step's weight casts, or fp32)."""
    from k3.model.common import use_weight_casts
    from k3.ops.weight_cast import WeightCasts

    x = torch.tensor([ids])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            use_weight_casts(model, WeightCasts() if autocast else None):
        logits = model(input_ids=x).logits.float()
    lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, x[0, 1:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


@pytest.mark.slow
def test_bf16_rollouts_sample_as_the_trainer_forward_computes(policy, scripted):
    """With autocast_bf16 (on for CUDA runs, whose trainer forward runs under bf16 autocast) the engine's forwards run
    under bf16 autocast with each weight cast once per policy version: the behaviour log-probs are the bf16 trainer
    forward's (within 0.01 nats: the engine's chunked prefill and decode order the bf16 sums differently), closer
    to it than the fp32 rollouts' are; the casts are made once for all engine steps, and made again after the
    policy changes."""
    model, _ = policy
    ro32 = _rollouts(policy)
    plain = _samples(2)
    ro32.run(plain, seed=1)
    ro32.close()
    ro = _rollouts(policy, autocast_bf16=True)
    samples = _samples(2)
    ro.run(samples, seed=1)
    casts = ro.weight_casts()
    made = casts.casts
    n_weights = sum(1 for p in model.parameters() if p.dim() >= 2)
    assert 0 < made <= n_weights, (made, n_weights)  # once per weight, not once per engine step
    for a, s in zip(plain, samples):
        assert s.done and s.success and s.row.ids == a.row.ids
        sampled = torch.tensor([v >= 0 for v in s.row.versions])
        bf16 = _row_logprobs(model, s.row.ids, autocast=True)[sampled]
        behaviour = torch.tensor(s.row.logprobs)[sampled]
        fp32_behaviour = torch.tensor(a.row.logprobs)[sampled]
        gap = (behaviour - bf16).abs().max().item()
        assert gap < 0.01, gap
        assert gap < (fp32_behaviour - bf16).abs().max().item()
    more = _samples(1)
    ro.run(more, seed=3)
    assert ro.weight_casts() is casts and casts.casts == made  # the same version reuses its casts
    ro.policy_changed()
    assert ro.weight_casts() is not casts
    ro.close()
    assert _rollouts(policy).weight_casts() is None  # off: fp32 weights, no copies
