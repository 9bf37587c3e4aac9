"""Budget-based admission control (report §5.4.3): each request class holds at most its share of the fleet's
in-flight prompt tokens, so a burst of long-context requests consumes its own budget and short requests arriving
after it are still admitted at once.

A class is `NAME:MAX_TOKENS:SHARE`: requests whose (estimated) prompt has at most MAX_TOKENS tokens and more than
the previous class's belong to it, and together they may hold at most SHARE x the fleet's capacity in flight. The
classes are listed from the shortest; the last one's MAX_TOKENS is `inf`, and the shares sum to at most 1 (the
budgets are strict: a class never borrows another's idle share, which is what keeps the other classes' latency
when a burst arrives).

A request that does not fit waits in its class's queue, first come first served, for at most `queue_wait_s`; then,
or at once when `max_queued` requests already wait, it is refused (`Rejected`, answered 429 with Retry-After). A
request larger than its whole budget is admitted when its class holds nothing else, so that it is never refused
for its size alone.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import time
from dataclasses import dataclass

DEFAULT_CLASSES = ("short:2048:0.5", "long:inf:0.5")  # the report's split: short requests are under 2K tokens
RETRY_AFTER_SMOOTHING = 0.2  # weight of the newest request in the mean hold time behind Retry-After


@dataclass(frozen=True)
class RequestClass:
    name: str
    max_tokens: float  # the longest prompt (tokens) of the class; math.inf for the last
    share: float  # of the fleet's in-flight prompt tokens


def parse_class(spec: str) -> RequestClass:
    """'NAME:MAX_TOKENS:SHARE', e.g. 'short:2048:0.5' or 'long:inf:0.5'."""
    parts = spec.split(":")
    form = "NAME:MAX_TOKENS:SHARE (e.g. short:2048:0.5 or long:inf:0.5)"
    if len(parts) != 3 or not parts[0]:
        raise ValueError(f"request class {spec!r}: expected {form}")
    name, max_text, share_text = parts
    if not all(c.isalnum() or c in "_-" for c in name):
        raise ValueError(f"request class {spec!r}: the name {name!r} may hold only letters, digits, '_' and '-'")
    if max_text == "inf":
        max_tokens = math.inf
    else:
        try:
            max_tokens = int(max_text)
        except ValueError:
            max_tokens = 0
        if max_tokens < 1:
            raise ValueError(f"request class {spec!r}: MAX_TOKENS must be a positive integer or 'inf', "
                             f"got {max_text!r}")
    try:
        share = float(share_text)
    except ValueError:
        share = math.nan
    if not 0 < share <= 1:
        raise ValueError(f"request class {spec!r}: SHARE must be a number in (0, 1], got {share_text!r}")
    return RequestClass(name, max_tokens, share)


def parse_classes(specs) -> list[RequestClass]:
    """The classes of `specs` (see parse_class), checked as a whole: ascending MAX_TOKENS, the last 'inf', distinct
    names, shares summing to at most 1."""
    classes = [parse_class(s) for s in specs]
    if not classes:
        raise ValueError("at least one request class is needed (e.g. all:inf:1)")
    names = [c.name for c in classes]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"request class {dup!r} is given twice")
    for a, b in itertools.pairwise(classes):
        if not a.max_tokens < b.max_tokens:
            raise ValueError(f"request classes must be listed from the shortest: {a.name} (up to {a.max_tokens}) "
                             f"comes before {b.name} (up to {b.max_tokens})")
    if classes[-1].max_tokens != math.inf:
        raise ValueError(f"the last request class ({classes[-1].name}) must take every longer prompt: give it "
                         f"MAX_TOKENS 'inf', e.g. {classes[-1].name}:inf:{classes[-1].share:g}")
    total = sum(c.share for c in classes)
    if total > 1 + 1e-9:
        raise ValueError(f"the request classes' shares sum to {total:g}; at most 1 is allowed (the budgets are "
                         f"strict shares of --fleet-tokens)")
    return classes


class Rejected(Exception):
    """The request was not admitted: answered 429 with `retry_after` seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


class ClassBudget:
    """One class's budget, in-flight tokens, queue and counters."""

    def __init__(self, cls: RequestClass, budget: int):
        self.cls, self.budget = cls, budget
        self.in_flight = 0  # tokens of admitted requests not yet finished
        self.running = 0  # admitted requests not yet finished
        self.waiters: collections.deque = collections.deque()  # (tokens, future), first come first served
        self.admitted = 0
        self.queued = 0  # requests that had to wait (admitted later or not)
        self.rejected = 0
        self.wait_seconds = 0.0  # summed over admitted requests
        self.mean_hold_s = 1.0  # smoothed time an admitted request holds its tokens

    @property
    def name(self) -> str:
        return self.cls.name

    def fits(self, tokens: int) -> bool:
        return self.in_flight + tokens <= self.budget or self.running == 0

    def _take(self, tokens: int) -> None:
        self.in_flight += tokens
        self.running += 1
        self.admitted += 1

    def pump(self) -> None:
        """Admit waiters from the head of the queue while they fit."""
        while self.waiters:
            tokens, fut = self.waiters[0]
            if fut.done():  # timed out or cancelled
                self.waiters.popleft()
                continue
            if not self.fits(tokens):
                return
            self.waiters.popleft()
            self._take(tokens)
            fut.set_result(None)

    def give_back(self, tokens: int, held_s: float | None) -> None:
        self.in_flight -= tokens
        self.running -= 1
        if held_s is not None:
            self.mean_hold_s += RETRY_AFTER_SMOOTHING * (held_s - self.mean_hold_s)
        self.pump()

    def retry_after(self) -> int:
        return max(1, math.ceil(self.mean_hold_s))


class Ticket:
    """An admitted request's hold on its class's budget; `release()` (idempotent) when the request ends."""

    def __init__(self, budget: ClassBudget, tokens: int, waited_s: float):
        self.budget, self.tokens, self.waited_s = budget, tokens, waited_s
        self._start = time.monotonic()
        self._released = False

    @property
    def class_name(self) -> str:
        return self.budget.name

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.budget.give_back(self.tokens, time.monotonic() - self._start)


class Admission:
    """Admission of requests by class (module docstring). Used from one event loop."""

    def __init__(self, classes: list[RequestClass], fleet_tokens: int, queue_wait_s: float = 30.0,
                 max_queued: int = 256):
        if isinstance(fleet_tokens, bool) or not isinstance(fleet_tokens, int) or fleet_tokens < 1:
            raise ValueError(f"fleet_tokens must be a positive integer, got {fleet_tokens!r}")
        if not queue_wait_s >= 0:
            raise ValueError(f"queue_wait_s must be >= 0, got {queue_wait_s!r}")
        if isinstance(max_queued, bool) or not isinstance(max_queued, int) or max_queued < 0:
            raise ValueError(f"max_queued must be an integer >= 0, got {max_queued!r}")
        self.fleet_tokens, self.queue_wait_s, self.max_queued = fleet_tokens, float(queue_wait_s), max_queued
        self.classes = [ClassBudget(c, max(1, int(c.share * fleet_tokens))) for c in classes]

    def classify(self, tokens: int) -> ClassBudget:
        return next(b for b in self.classes if tokens <= b.cls.max_tokens)

    async def admit(self, tokens: int) -> Ticket:
        """Wait for room in the class of a `tokens`-token prompt; raises Rejected when none comes in time."""
        b = self.classify(tokens)
        t0 = time.monotonic()
        if not b.waiters and b.fits(tokens):
            b._take(tokens)
            return Ticket(b, tokens, 0.0)
        if len(b.waiters) >= self.max_queued:
            b.rejected += 1
            raise Rejected(f"the '{b.name}' request class is full: {b.in_flight} of its {b.budget} prompt tokens are "
                           f"in flight and {len(b.waiters)} requests wait; retry later", b.retry_after())
        fut = asyncio.get_running_loop().create_future()
        b.waiters.append((tokens, fut))
        b.queued += 1
        try:
            await asyncio.wait({fut}, timeout=self.queue_wait_s)
        except asyncio.CancelledError:  # the client went away while queued
            if fut.done() and not fut.cancelled():  # admitted just now: hand the tokens back
                b.give_back(tokens, None)
            else:
                fut.cancel()
                b.pump()  # it may have blocked the head of the queue
            raise
        if not fut.done():
            fut.cancel()
            b.pump()
            b.rejected += 1
            raise Rejected(f"the '{b.name}' request class stayed full for {self.queue_wait_s:g} s ({b.in_flight} of "
                           f"its {b.budget} prompt tokens in flight); retry later", b.retry_after())
        waited = time.monotonic() - t0
        b.wait_seconds += waited
        return Ticket(b, tokens, waited)
