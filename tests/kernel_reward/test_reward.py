"""The reward formula at its anchor points: the expert's time -> 0.5, the roofline -> 1, monotone in between and
beyond, and the harness's degenerate roofline (not below the expert) keeping the expert at 0.5."""

import math

import pytest

from k3.kernel_reward.reward import effective_roofline, reward


def test_anchors():
    assert reward(1.0, 1.0, 0.1) == 0.5
    assert reward(0.1, 1.0, 0.1) == 1.0
    assert reward(0.01, 1.0, 0.1) == 1.0  # faster than the roofline: clipped
    assert reward(2.0, 1.0, 0.1) == 0.25 and reward(10.0, 1.0, 0.1) == pytest.approx(0.05)
    # halfway to the roofline in log-time
    assert reward(math.sqrt(0.1), 1.0, 0.1) == pytest.approx(0.75)


def test_monotone_and_continuous():
    ts = [10 ** (k / 20) for k in range(-40, 41)]  # 0.01 .. 100 x the expert
    rs = [reward(t, 1.0, 0.05) for t in ts]
    assert all(a >= b for a, b in zip(rs, rs[1:]))
    assert reward(1.0 - 1e-9, 1.0, 0.05) == pytest.approx(0.5) == reward(1.0 + 1e-9, 1.0, 0.05)


def test_expert_at_or_past_the_roofline_still_scores_half():
    assert effective_roofline(1.0, 2.0) == 0.5
    assert reward(1.0, 1.0, 2.0) == 0.5
    assert reward(0.5, 1.0, 2.0) == 1.0


def test_rejects_nonpositive_times():
    with pytest.raises(ValueError, match="positive"):
        reward(0.0, 1.0, 0.1)


def test_expert_time_is_measured_once_per_process_unless_refreshed():
    from k3.kernel_reward import expert_time

    first = expert_time("softmax", "cpu")
    assert expert_time("softmax", "cpu") is first  # kept for the process
    again = expert_time("softmax", "cpu", refresh=True)  # a new measurement in a new process, now kept
    assert again is not first and again[0] == first[0] and again[1] > 0
    assert expert_time("softmax", "cpu") is again


def _record_runs(monkeypatch, scoring) -> list:
    """scoring.Run recording each process's phases, in the order they start."""
    started = []

    class Recorded(scoring.Run):
        def __init__(self, *a, phases=("check", "time"), **k):
            started.append(tuple(phases))
            super().__init__(*a, phases=phases, **k)

    monkeypatch.setattr(scoring, "Run", Recorded)
    return started


def test_the_expert_is_checked_then_timed_in_one_process_like_a_candidate(monkeypatch):
    """The anchor's process runs the checks before its timed calls, as every candidate's does, so that what the checks
    leave behind (compiled kernels, the allocator's pool) is the same on both sides of the ratio."""
    from k3.kernel_reward import scoring

    started = _record_runs(monkeypatch, scoring)
    impl, t = scoring.expert_time("softmax", "cpu", refresh=True, timing={"warmup": 1, "repeats": 5})
    alone = scoring.expert_time("softmax", "cpu", refresh=True, timing={"warmup": 1, "repeats": 5}, checked=False)
    assert started == [("check", "time"), ("time",)]
    assert impl == alone[0] and t > 0 and alone[1] > 0


def test_the_anchor_is_the_median_of_several_fresh_processes(monkeypatch):
    """One process's time of a small kernel varies too much to anchor the reward alone: the anchor is the median of
    `processes` fresh processes' medians, each checked then timed (3 by default on CUDA, 1 on CPU)."""
    from k3.kernel_reward import scoring

    started = _record_runs(monkeypatch, scoring)
    seen = []
    one = scoring._expert_process_time
    monkeypatch.setattr(scoring, "_expert_process_time", lambda *a: seen.append(one(*a)) or seen[-1])
    impl, t = scoring.expert_time("softmax", "cpu", refresh=True, processes=3, timing={"warmup": 1, "repeats": 5})
    assert started == [("check", "time")] * 3 and len(seen) == 3 and all(x > 0 for x in seen)
    assert impl == scoring.get("softmax").expert("cpu") and t == sorted(seen)[1]
    assert scoring.ANCHOR_PROCESSES == {"cuda": 3, "cpu": 1}
    with pytest.raises(ValueError, match="processes must be at least 1"):
        scoring.expert_time("softmax", "cpu", refresh=True, processes=0)


def test_an_expert_that_fails_its_checks_is_no_anchor():
    """An expert whose output is wrong on this device raises with the failing check, rather than giving a time."""
    import dataclasses

    from k3.kernel_reward import scoring
    from k3.kernel_reward.tasks import get

    wrong = dataclasses.replace(get("softmax"), experts={"cpu": "torch:exp"})  # exp(x), not softmax(x)
    with pytest.raises(RuntimeError, match=r"expert of softmax \(torch:exp\) failed its checks on cpu: wrong result"):
        scoring.expert_time(wrong, "cpu", refresh=True)


def test_batch_scoring_times_the_anchor_as_it_times_the_candidates(monkeypatch):
    """score_many checks candidates in parallel processes and times each passing one in a fresh process that runs
    only the timed calls; the expert's anchor is then timed by that procedure too, not after checks."""
    from k3.kernel_reward import scoring

    started = _record_runs(monkeypatch, scoring)
    monkeypatch.setattr(scoring, "_expert_times", {})
    honest = "import torch\n\ndef kernel(x):\n    return torch.softmax(x, dim=-1)\n"  # the expert's code, not it
    results = scoring.score_many("softmax", [("a", honest), ("b", honest)], "cpu", jobs=2,
                                 timing={"warmup": 1, "repeats": 5})
    assert all(r.passed and r.reward is not None and r.reward > 0 for r in results), [r.reason for r in results]
    assert sorted(started[:2]) == [("check",), ("check",)]
    assert started[2:] == [("time",), ("time",), ("time",)]  # the anchor, then each candidate: timed calls only


def test_timing_warms_up_for_a_count_and_a_time_then_times_fresh_calls():
    # At least `warmup` untimed calls and, when asked, at least `warmup_s` seconds of them (a GPU's clocks rise under
    # load); then `repeats` timed calls. Every call gets its own index, so inputs are never reused.
    import time

    from k3.kernel_reward.timing import Timing, time_calls

    def kernel(x):
        time.sleep(0.002)
        return x

    for warmup_s, least in ((None, 3), (0.0, 3), (0.1, 25)):
        seen = []
        times = time_calls(kernel, lambda i: (i,), "cpu", Timing(warmup=3, warmup_s=warmup_s, repeats=7),
                           lambda i, args, out: seen.append((i, args[0], out)))
        warm = [i for i, _, _ in seen if i < 0]
        assert all(i == a == o for i, a, o in seen)
        assert len(times) == 7 and all(t >= 0.002 for t in times)
        assert [i for i, _, _ in seen if i >= 0] == list(range(7)) and len(set(warm)) == len(warm)
        assert len(warm) >= least and (warmup_s or len(warm) == 3)  # on CPU the default is count-only
        assert len(warm) < 60  # no more than the time asked for (0.1 s of 2 ms calls, with room for a slow machine)
