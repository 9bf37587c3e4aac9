"""Speculation on or off per decode batch size, by measurement (`EngineConfig.speculative_auto`).

Speculative decoding pays when the target's forward is bound by reading its weights (small batches: K + 1 positions
cost about what one costs) and loses when it is bound by compute (large batches: every rejected draft position is
work thrown away), and where the crossover lies depends on the model, the hardware and how often the drafts are
accepted. So the engine measures instead of guessing. Decode batches are grouped by size into power-of-two buckets
(1, 2, 3-4, 5-8, ...); in each bucket `SpecSwitch`:

1. probes: the bucket's first decode-only steps alternate speculative and plain, until each has `probe_steps`
   measured steps after one unmeasured warm-up step each (first steps include allocation and compilation);
2. then runs the arm with the higher median rate (tokens emitted per second of step time, over each arm's last
   `window` measurements), and at the next multiple of `reprobe_every` steps of the bucket runs one step of the
   other arm, so that a change of content (acceptance) or load is noticed; while the decision holds from one
   re-probe to the next the interval doubles, up to `reprobe_max` steps, and a decision that changes sets it back
   to `reprobe_every`. A re-probe costs more than a step of its arm usually does (speculating after plain steps
   first drafts over every position they committed, eagerly: ~13 ms against 1.1 ms per plain step at batch 1 on
   an H100), so a fixed one step in 32 cost a decided-plain bucket about a third of its speed. For the same reason
   a re-probe runs two steps of the other arm and measures only the second: the first catches the draft up, and
   measured it would make speculation look slower than it runs, so a bucket once decided plain would stay so.

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
    warmed: bool = False  # the unmeasured warm-up step has run
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
    probe_left: int = 0  # steps of the current re-probe still to run
    skip: int = 0  # measurements of the current re-probe not to count (its first step's)


class SpecSwitch:
    def __init__(self, probe_steps: int = 3, window: int = 8, reprobe_every: int = 32, reprobe_max: int = 256):
        for name, v in (("probe_steps", probe_steps), ("window", window), ("reprobe_every", reprobe_every),
                        ("reprobe_max", reprobe_max)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if reprobe_every < 2:
            raise ValueError(f"reprobe_every={reprobe_every} must be >= 2 (one step in it runs the other arm)")
        if reprobe_max < reprobe_every:
            raise ValueError(f"reprobe_max={reprobe_max} must be >= reprobe_every={reprobe_every} (equal: a fixed "
                             "interval)")
        self.probe_steps, self.window = probe_steps, window
        self.reprobe_every, self.reprobe_max = reprobe_every, reprobe_max
        self._buckets: dict[int, _Bucket] = {}

    def _bucket(self, batch: int) -> _Bucket:
        return self._buckets.setdefault(bucket_of(batch), _Bucket())

    def decide(self, batch: int) -> bool:
        """Whether this step's decode batch of `batch` requests speculates; counts as one of the bucket's steps."""
        b = self._bucket(batch)
        b.steps += 1
        if b.choice is None:  # probing: the arm with fewer measurements (spec first), warm-up steps included
            done_spec = b.spec.measured + b.spec.warmed
            done_plain = b.plain.measured + b.plain.warmed
            return done_spec <= done_plain
        if b.probe_left:  # the re-probe's second step: the one it measures
            b.probe_left -= 1
            return not b.choice
        if b.next_probe is None:  # just decided: the next multiple of reprobe_every (this step if it is one)
            b.next_probe = -(-b.steps // self.reprobe_every) * self.reprobe_every
        if b.steps < b.next_probe:
            return b.choice
        held = b.choice == b.probed_choice  # the decision held since the last re-probe: wait twice as long
        b.interval = min(2 * b.interval, self.reprobe_max) if held else self.reprobe_every
        b.probed_choice = b.choice
        b.next_probe = b.steps + b.interval
        b.probe_left, b.skip = 1, 1
        return not b.choice

    def record(self, batch: int, speculative: bool, tokens: int, seconds: float) -> None:
        """A decode-only step's measurement: `tokens` emitted in `seconds` of step time, speculating or not."""
        b = self._bucket(batch)
        arm = b.spec if speculative else b.plain
        if not arm.warmed:
            arm.warmed = True
            return
        if seconds <= 0 or tokens < 0:
            return
        if b.skip and speculative != b.choice:  # a re-probe's first step (the catch-up): not its arm's rate
            b.skip -= 1
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
