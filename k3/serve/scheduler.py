"""Continuous batching with chunked prefill and budget-based admission.

Each step has a token budget. Every running request that is decoding gets one token; the rest of the budget
goes to prefill chunks. Requests whose prompt is at least `long_prompt_tokens` are "long": while any short
request is waiting or prefilling, long ones together get at most `long_share` of the prefill budget, so a
burst of long-context requests cannot starve short ones (report §5.4.3). When the cache runs out of pages
the most recently admitted request is preempted: its pages are released and it is recomputed later.

The scheduler owns the cache manager (k3.serve.cache.manager): admission, growth, preemption, abort and finish
all go through it, so no request changes state without its pages changing with it.

`Scheduler.plan()` returns the whole step as a `StepPlan`: the plain work cut into segments at hash-block boundaries
(a prefill chunk is split at the last hash-aligned position inside it, so the KDA state there can be persisted as a
checkpoint without recomputation) and grouped into forwards, round by round (a request's second segment runs only
after its first; in a round the single-token segments run as one forward and the longer ones as another), and the
speculative decode steps whose drafts are verified (k3.serve.speculative). Nothing outside the scheduler touches its
queues.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from k3.serve.cache.manager import CacheManager
from k3.serve.cache.prefix import prompt_boundary
from k3.serve.sequence import Sequence, Status


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_step_tokens: int = 2048  # tokens processed per step (decode tokens + prefill chunks)
    prefill_chunk: int = 512  # largest prefill chunk of one request in one step
    long_prompt_tokens: int = 8192
    long_share: float = 0.5

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_step_tokens", "prefill_chunk", "long_prompt_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"scheduler option '{name}' = {v!r} must be a positive integer")
        if not 0 < self.long_share <= 1:
            raise ValueError(f"scheduler option 'long_share' = {self.long_share!r} must lie in (0, 1]")


@dataclass
class Work:
    seq: Sequence
    start: int
    end: int  # feed tokens[start:end]; sample a token when end == len(tokens)
    draft: int = 0  # a decode step with this many draft tokens to verify after tokens[start] (k3.serve.speculative)


@dataclass
class Segment:
    """Feed seq.tokens[start:end] in one forward (a whole Work, or the piece of a prefill chunk on one side of a
    hash-block boundary)."""
    seq: Sequence
    start: int
    end: int

    @property
    def single(self) -> bool:
        return self.end - self.start == 1


@dataclass
class StepPlan:
    """One step. `forwards`: round r's forwards (each a list of segments that run as one forward: the single-token
    ones, the longer ones), in order. `verify`: the speculative decode steps (a request's last token and w.draft
    drafts). `due`: the requests whose next token is drawn after the forwards (their prompt or decode step
    completes). `decode`: the decode steps of the step (plain and speculative), `decode_only`: nothing else ran.
    `refused`: nothing could be scheduled and this waiting request cannot fit even in an empty pool (finished with
    an error)."""
    work: list[Work] = field(default_factory=list)  # the plain work, as the segments' source
    forwards: list[list[list[Segment]]] = field(default_factory=list)
    verify: list[Work] = field(default_factory=list)
    due: list[Sequence] = field(default_factory=list)
    decode: int = 0
    decode_only: bool = False
    refused: Sequence | None = None

    @property
    def empty(self) -> bool:
        return not self.work and not self.verify


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, cache: CacheManager, draft_tokens: int = 0):
        cfg.validate()
        self.cfg, self.cache = cfg, cache
        self.draft_tokens = draft_tokens  # speculative decoding: drafts per decode step (0: off)
        self.waiting: dict[str, deque[Sequence]] = {"short": deque(), "long": deque()}
        self.running: list[Sequence] = []

    def kind(self, seq: Sequence) -> str:
        return "long" if len(seq.prompt_ids) >= self.cfg.long_prompt_tokens else "short"

    def add(self, seq: Sequence, front: bool = False) -> None:
        q = self.waiting[self.kind(seq)]
        q.appendleft(seq) if front else q.append(seq)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def finish(self, seq: Sequence) -> None:
        """A request is done: its pages go back to the cache (its blocks stay indexed) and it leaves the queues."""
        self.cache.finish(seq)
        self.remove(seq)

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is (running: its pages are released)."""
        if seq.status == Status.RUNNING:
            self.cache.release(seq)
        self.remove(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        for q in self.waiting.values():
            if seq in q:
                q.remove(seq)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def slots(self, seq: Sequence):
        """Where seq's cache lives (k3.serve.cache.views.SeqSlots)."""
        return self.cache.slots(seq)

    def computed(self, seq: Sequence, end: int) -> None:
        """seq's tokens up to `end` are in the cache (KDA checkpoints at hash-aligned positions are taken)."""
        seq.num_computed = end
        self.cache.computed(seq, end)

    def grow(self, seq: Sequence, end: int) -> bool:
        """Room in the cache for a running request's tokens up to `end` ahead of a step that plans them (a
        verification launched ahead, k3.serve.speculative.decoder); False: out of pages, nothing changed."""
        return seq.status == Status.RUNNING and self.cache.grow(seq, end)

    def plan(self, speculate: Callable[[int], bool] | None = None) -> StepPlan:
        """The step (`StepPlan`). With speculative decode steps planned, `speculate(number of decode steps)` says
        whether this step speculates (k3.serve.speculative.switch); when not, they run as plain decode steps."""
        work = self._work()
        if not work:
            return StepPlan(refused=self._refuse_unschedulable())
        decode = [w for w in work if _is_decode(w)]
        if any(w.draft for w in work) and speculate is not None and not speculate(len(decode)):
            for w in work:  # this batch size measures faster without speculation: a plain decode step
                w.draft = 0
        plain = [w for w in work if not w.draft]
        segs = [self._segments(w) for w in plain]
        forwards = []
        for r in range(max(map(len, segs), default=0)):
            groups: dict[bool, list[Segment]] = {}
            for ss in segs:
                if r < len(ss):
                    groups.setdefault(ss[r].single, []).append(ss[r])
            forwards.append(list(groups.values()))
        due = [w.seq for w in plain if w.end == w.seq.num_tokens]
        return StepPlan(plain, forwards, [w for w in work if w.draft], due, len(decode), len(decode) == len(work))

    def _segments(self, w: Work) -> list[Segment]:
        """w cut at the last hash-aligned position inside it, and at its prompt's last hash-aligned position short
        of the prompt's end (`prompt_boundary`), where the cache keeps a checkpoint that the same prompt sent again
        can start from (a lookup must leave at least the last prompt token to compute)."""
        hb = self.cache.hash_block_tokens
        cuts = {(w.end // hb) * hb, prompt_boundary(len(w.seq.prompt_ids), hb)}
        bounds = [w.start, *sorted(c for c in cuts if w.start < c < w.end), w.end]
        return [Segment(w.seq, a, b) for a, b in zip(bounds, bounds[1:])]

    def _refuse_unschedulable(self) -> Sequence | None:
        """Nothing could be scheduled: with no request running, the oldest waiting one cannot fit even in an empty
        pool; it leaves the queue finished with an error."""
        if self.running:
            return None
        for q in self.waiting.values():
            if q:
                seq = q.popleft()
                seq.status, seq.finish_reason = Status.FINISHED, "error: the request does not fit in the cache"
                return seq
        return None

    def _work(self, admit: bool = True) -> list[Work]:
        """One step's work: decode tokens of running requests, their prefill chunks, then new admissions (unless
        `admit` is False), each given its pages by the cache manager (a request that cannot get them waits, or a
        victim is preempted)."""
        c, grow = self.cfg, self.cache.grow
        work: list[Work] = []
        budget = c.max_step_tokens
        # 1. Decode: one token for every running request past its prompt; with speculation, that token and up to
        # draft_tokens drafts, when the budget and free pages allow (drafts never preempt anyone).
        for seq in list(self.running):
            if seq.pending == 1 and budget > 0:
                k = min(self.draft_tokens, seq.params.max_tokens - len(seq.output_ids) - 1, budget - 1)
                if k > 0 and grow(seq, seq.num_computed + 1 + k):
                    work.append(Work(seq, seq.num_computed, seq.num_computed + 1, draft=k))
                    budget -= 1 + k
                    continue
                while not grow(seq, seq.num_computed + 1):
                    if not self._preempt_one(exclude=seq, work=work):
                        break
                else:
                    work.append(Work(seq, seq.num_computed, seq.num_computed + 1))
                    budget -= 1
        # 2. Prefill chunks of running requests, then new admissions, under per-class budgets.
        short_busy = self.waiting["short"] or any(self.kind(s) == "short" and s.pending > 1 for s in self.running)
        long_cap = int(budget * c.long_share) if short_busy else budget
        used = {"short": 0, "long": 0}

        def room(kind: str) -> int:
            left = budget - used["short"] - used["long"]
            return min(left, long_cap - used["long"]) if kind == "long" else left

        def schedule_chunk(seq: Sequence) -> bool:
            kind = self.kind(seq)
            n = min(seq.pending, c.prefill_chunk, room(kind))
            if n <= 0:
                return False
            if not grow(seq, seq.num_computed + n):
                return False
            work.append(Work(seq, seq.num_computed, seq.num_computed + n))
            used[kind] += n
            return True

        for seq in [s for s in self.running if s.pending > 1]:
            schedule_chunk(seq)
        for kind in ("short", "long") if admit else ():
            q = self.waiting[kind]
            while q and len(self.running) < c.max_num_seqs and room(kind) > 0:
                seq = q[0]
                hit = self.cache.admit(seq)
                if hit is None:
                    break
                seq.num_computed = hit
                self.on_admit(seq, hit)
                q.popleft()
                seq.status = Status.RUNNING
                self.running.append(seq)
                if seq.pending > 0 and not schedule_chunk(seq):
                    break
        if not work and len(self.running) > 1:
            # Every running request is mid-prefill and waits for pages the others hold: release the most recently
            # admitted one (recomputed later) so the older ones can go on; it is not readmitted in this step.
            self._preempt_one(exclude=self.running[0], work=work)
            return self._work(admit=False)
        return work

    def _preempt_one(self, exclude: Sequence, work: list[Work]) -> bool:
        """Release the most recently admitted running request that has no work this step."""
        busy = {id(w.seq) for w in work} | {id(exclude)}
        for seq in reversed(self.running):
            if id(seq) not in busy:
                self.running.remove(seq)
                self.cache.release(seq)
                seq.num_computed = 0
                self.on_preempt(seq)
                seq.status = Status.WAITING
                seq.preemptions += 1
                self.add(seq, front=True)
                return True
        return False

    def on_admit(self, seq: Sequence, hit_tokens: int) -> None:
        """Called when a request is admitted with `hit_tokens` from the prefix cache (the engine's metrics)."""

    def on_preempt(self, seq: Sequence) -> None:
        """Called when a request was preempted, after its pages were released (the engine's metrics)."""


def _is_decode(w: Work) -> bool:
    """A decode step (one position past the prompt, its token sampled by the last step), not a prefill chunk."""
    return w.end - w.start == 1 and w.start >= len(w.seq.prompt_ids)
