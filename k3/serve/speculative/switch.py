"""Speculation on or off per decode batch size, by measurement (`EngineConfig.speculative_auto`).

Speculative decoding pays when the target's forward is bound by reading its weights (small batches: K + 1 positions
cost about what one costs) and loses when it is bound by compute (large batches: every rejected draft position is
work thrown away), and where the crossover lies depends on the model, the hardware and how often the drafts are
accepted. So the engine measures instead of guessing. Decode batches are grouped by size into power-of-two buckets
(1, 2, 3-4, 5-8, ...); in each bucket `SpecSwitch`:

1. probes: the bucket's first decode-only steps alternate pairs of speculative and plain steps, measuring the
   second step of each pair, until each arm has `probe_steps` measured steps. The first step of an arm after the
   other catches up and is not counted: speculation first drafts over the positions plain steps committed, and a
   plain step first replays the positions speculation left pending (fused replay), eagerly (9-10 ms against 1.1 ms
   per plain step at batch 1 on an H100: measured, it made a random model's speculation, 0.28x plain, look twice
   as fast). The very first steps (allocation, compilation) are such first steps too, and so is the decided arm's
   first step after a re-probe;
2. then runs the arm with the higher median rate (tokens emitted per second of step time, over each arm's last
   `window` measurements), and at the next multiple of `reprobe_every` steps of the bucket runs a pair of steps of
   the other arm, so that a change of content (acceptance) or load is noticed; while the decision holds from one
   re-probe to the next the interval doubles, up to `reprobe_max` steps, and a decision that changes sets it back
   to `reprobe_every`. A re-probe costs more than a step of its arm usually does (speculating after plain steps
   first drafts over every position they committed, eagerly: ~13 ms against 1.1 ms per plain step at batch 1 on
   an H100), so a fixed one step in 32 cost a decided-plain bucket about a third of its speed. For the same reason
   as the probes' pairs a re-probe runs two steps of the other arm and measures only the second: measured, the
   draft's catch-up would make speculation look slower than it runs, so a bucket once decided plain would stay so.

Only steps that decode and nothing else are measured (a step with a prefill chunk has a time that is not the
decode's); every step follows the bucket's current decision. Both arms emit exactly the tokens decoding without
speculation would (greedy), or tokens of the same distribution (sampling): switching never changes an output.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


def bucket_of(batch: int) -> int:
    """The power-of-two bucket of a decode batch size: the smallest power of two >= batch."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be >= 1")
    return 1 << (batch - 1).bit_length()


@dataclass
class _Arm:
    rates: deque = field(default_factory=deque)  # tokens per second of the last measured steps
    measured: int = 0

    def rate(self) -> float | None:
        return statistics.median(self.rates) if self.rates else None


@dataclass
class _Bucket:
    spec: _Arm = field(default_factory=_Arm)
    plain: _Arm = field(default_factory=_Arm)
    steps: int = 0  # decisions taken in this bucket
    choice: bool | None = None  # after probing: True speculative, False plain
    next_probe: int | None = None  # the step of the next re-probe (after probing)
    interval: int = 0  # steps from the last re-probe to the next
    probed_choice: bool | None = None  # the decision at the last re-probe
    pair_arm: bool = True  # the arm of the current pair of steps (a probe's or a re-probe's)
    pair_left: int = 0  # steps of the current pair still to run after the one decided
    last: bool | None = None  # the arm of the last step decided
    skip: bool = False  # the next measurement (of arm `last`) is a catch-up: not counted


class SpecSwitch:
    def __init__(self, probe_steps: int = 3, window: int = 8, reprobe_every: int = 32, reprobe_max: int = 256):
        for name, v in (("probe_steps", probe_steps), ("window", window), ("reprobe_every", reprobe_every),
                        ("reprobe_max", reprobe_max)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if reprobe_every < 2:
            raise ValueError(f"reprobe_every={reprobe_every} must be >= 2 (a re-probe runs two steps)")
        if reprobe_max < reprobe_every:
            raise ValueError(f"reprobe_max={reprobe_max} must be >= reprobe_every={reprobe_every} (equal: a fixed "
                             "interval)")
        self.probe_steps, self.window = probe_steps, window
        self.reprobe_every, self.reprobe_max = reprobe_every, reprobe_max
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        return self._buckets.setdefault(bucket_of(batch), _Bucket())

    def decide(self, batch: int) -> bool:
        """Whether this step's decode batch of `batch` requests speculates; counts as one of the bucket's steps. A
        step of the other arm than the last step's (or the bucket's first) catches up and is not measured."""
        b = self._bucket(batch)
        b.steps += 1
        arm = self._decide(b)
        if arm != b.last:
            b.last, b.skip = arm, True
        return arm

    def _decide(self, b: _Bucket) -> bool:
        if b.pair_left:  # a pair's second step: the one it measures
            b.pair_left -= 1
            return b.pair_arm
        if b.choice is None:  # probing: a pair of the arm with fewer measurements (spec first)
            return self._pair(b, b.spec.measured <= b.plain.measured)
        if b.next_probe is None:  # just decided: the next multiple of reprobe_every (this step if it is one)
            b.next_probe = -(-b.steps // self.reprobe_every) * self.reprobe_every
        if b.steps < b.next_probe:
            return b.choice
        held = b.choice == b.probed_choice  # the decision held since the last re-probe: wait twice as long
        b.interval = min(2 * b.interval, self.reprobe_max) if held else self.reprobe_every
        b.probed_choice = b.choice
        b.next_probe = b.steps + b.interval
        return self._pair(b, not b.choice)

    @staticmethod
    def _pair(b: _Bucket, arm: bool) -> bool:
        """Start a pair of steps of `arm` (True: speculative): the first catches up, the second is measured."""
        b.pair_arm, b.pair_left = arm, 1
        return arm

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A decode-only step's measurement: `tokens` emitted in `seconds` of step time, speculating or not."""
        b = self._bucket(batch)
        arm = b.spec if speculative else b.plain
        if b.skip and speculative == b.last:  # the first step after the other arm's (or the first ever): a catch-up
            b.skip = False
            return
        if seconds <= 0 or tokens < 0:
            return
        arm.rates.append(tokens / seconds)
        if len(arm.rates) > self.window:
            arm.rates.popleft()
        arm.measured += 1
        if b.spec.measured >= self.probe_steps and b.plain.measured >= self.probe_steps:
            b.choice = b.spec.rate() > b.plain.rate()

    def state(self) -> dict[int, dict]:
        """Per bucket (its largest batch size): the decision (None while probing) and each arm's median rate."""
        return {k: {"speculative": b.choice, "spec_tokens_per_s": b.spec.rate(), "plain_tokens_per_s": b.plain.rate(),
                    "steps": b.steps} for k, b in sorted(self._buckets.items())}
