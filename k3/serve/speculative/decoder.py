"""The speculative decoder: draft, switch, propose, verify, accept and commit as one object (report §5.4.2).

A step's speculative decode steps (k3.serve.scheduler.StepPlan.verify: a request's last token and the drafts the
scheduler made room for) go through it: `propose` asks the draft for the tokens, the runner verifies them (in a
forward of their own per number of drafts, `verify`, or joined to the step's prefill forward, `mixes`), `accept`
keeps the drafts the target agrees with (k3.serve.speculative.accept: the output stays the target's) and emits the
tokens through the postprocess step, and `commit` replays the accepted positions into the KDA states (KDA rollback by
replay; checkpoints only of committed states) and truncates the MLA cache to them. The draft observes the target's
hidden states of every committed position (`observe`) and forgets a request that finished, was aborted or preempted.

With fused replay (EngineConfig.fused_replay) `commit` replays only up to the last hash-block boundary inside the
accepted positions (so the checkpoint taken there is of a committed state) and leaves the rest pending with the
runner (ModelRunner.hold), to be replayed in the same pass as the request's next verification (or before any other
forward over it); `forget` drops them.
With drafting ahead (EngineConfig.draft_ahead) a verification of one number of drafts most of whose requests accepted
every draft last time has their next proposal drafted right after it (`Draft.propose_ahead`, from its hidden states and
targets on the device, as if every draft were accepted again), before its acceptance is read back: the read-back waits
for the verification alone (`GreedyReadBack`), so on a GPU the host accepts, emits and commits while the draft runs,
and the next `propose` takes the proposal for the requests that were accepted whole (and drafts the others).
With verifying ahead too (EngineConfig.verify_ahead) the verification of that proposal is launched right after it,
before the read-back: its rows' pages grown to the next window, the accepted positions it assumes held as pending in
it (fused replay: it replays them in front of its window and writes the states after them), the KDA states it
overwrites saved first; its first token is the verification's bonus target and the others the drafts, all on the
device. At the acceptance it is kept where every request accepted every draft and none finished (the positions are
then committed without a replay: the launched verification's pass makes their states), else the saved states are
written back and it is dropped (the commit as always). The next `verify` uses it where its proposal is the one the
draft drafted ahead for every request of the step, in the same order and from the same positions; else it is dropped
(its states are the committed ones then). On a GPU the device verifies the next window while the host accepts, emits,
commits and plans.
`switch` (a k3.serve.speculative.switch.SpecSwitch, with EngineConfig.speculative_auto) turns speculation off per
decode batch size where it measures slower.

`stage_times` (a `StageTimes`, None by default) times each stage of the cycle when set: for profiling only, since it
waits for the device at every stage boundary (benchmarks/spec_decode.py --stage-times).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from k3.serve.postprocess import Postprocessor, RequestOutput, logprob_entries
from k3.serve.runner import ForwardBatch, ModelRunner, Verified
from k3.serve.scheduler import Scheduler, Work
from k3.serve.sequence import Sequence, Status
from k3.serve.speculative.accept import GreedyReadBack, accept_batch
from k3.serve.speculative.draft import Draft, Proposal
from k3.serve.speculative.switch import SpecSwitch


class StageTimes:
    """Wall time per stage of the speculative cycle, summed over the cycles (`verify` calls) it saw: `draft` (the
    proposals), `ahead` (the next proposal drafted ahead of the acceptance, EngineConfig.draft_ahead), `verify` (the
    verification forwards), `accept` (acceptance, emitting, stop rules), `commit` (the replay or holding of the
    accepted positions, the cache's bookkeeping) and `observe` (the draft told the committed hidden states, the MLA
    cache truncated). Each stage waits for `device` before and after it, so the stages' device work is counted in them
    and not in the next one; each is also a ``spec.<stage>`` range for torch.profiler (benchmarks/spec_decode.py
    --stage-kernels lists the kernels of each). `sync=False` (host mode): no waits and no profiler ranges, so each
    stage's time is the host's work in it plus any wait of its own (a read-back), and the device runs as it does
    untimed (benchmarks/spec_host.py)."""

    STAGES = ("draft", "ahead", "verify", "accept", "commit", "observe")

    def __init__(self, device: torch.device | str, sync: bool = True):
        self.device = torch.device(device)
        self.sync = sync
        self.seconds = dict.fromkeys(self.STAGES, 0.0)
        self.cycles = 0

    def _sync(self) -> None:
        if self.sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def stage(self, name: str):
        if name not in self.seconds:
            raise KeyError(f"unknown stage {name!r}: one of {', '.join(self.STAGES)}")
        self._sync()
        t0 = time.perf_counter()
        try:
            # a profiler, when one runs, sees the stage's range; it ends after the device's work of the stage (none
            # in host mode: the range's own host cost, tens of microseconds, would count in the stage)
            with torch.profiler.record_function(f"spec.{name}") if self.sync else nullcontext():
                try:
                    yield
                finally:
                    self._sync()
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def per_cycle_ms(self) -> dict[str, float]:
        """Each stage's mean milliseconds per cycle, and their sum as `cycle`."""
        n = max(self.cycles, 1)
        out = {k: round(v * 1e3 / n, 3) for k, v in self.seconds.items()}
        out["cycle"] = round(sum(self.seconds.values()) * 1e3 / n, 3)
        return out


@dataclass
class _Launched:
    """A verification launched ahead (`SpeculativeDecoder._verify_ahead`): `v` (its Verified), launched after the
    verification `after` for requests `ids` from positions `starts` with `k` drafts, the proposal drafted ahead that
    it verifies (`source`), the KDA pages it writes [n_kda * R] and their saved states (state, conv; dropped once
    kept); `ready` once the acceptance of `after` kept it."""
    v: Verified
    after: Verified
    ids: list[str]
    starts: list[int]
    k: int
    source: object
    pages: Tensor
    saved: tuple[Tensor, Tensor] | None
    ready: bool = False


class SpeculativeDecoder:
    """`cfg`: the engine's EngineConfig (read at each step: `mix_verify`, `hash_block_tokens`; fused replay is the
    runner's `fused_replay`, which the engine resolves from the config's);
    `release`: ends a finished request's life in the engine (its pages, its entry)."""

    def __init__(self, draft: Draft, switch: SpecSwitch | None, runner: ModelRunner, scheduler: Scheduler,
                 post: Postprocessor, cfg, release: Callable[[Sequence], None]):
        self.draft, self.switch = draft, switch
        self.runner, self.scheduler, self.post, self.cfg, self.release = runner, scheduler, post, cfg, release
        # AttnRes blocks whose outputs the draft reads beside the hidden state (an EAGLE-3 draft's)
        self.features: tuple[int, ...] = tuple(getattr(draft, "features", ()))
        # whether the draft can leave greedy drafts on the device (MTPDraft.propose's on_device: its captured chains)
        self.device_drafts = getattr(draft, "chains", None) is not None
        self.stage_times: StageTimes | None = None
        # drafting ahead (`_draft_ahead`): whether a request's last verification accepted every draft, and the
        # policy (False: ahead after any verification, for tests)
        self._full: dict[str, bool] = {}
        self.ahead_after_full = True
        # verifying ahead (`_verify_ahead`): the verification launched ahead (counted per request in the metrics)
        self._launched: _Launched | None = None

    def _stage(self, name: str):
        return nullcontext() if self.stage_times is None else self.stage_times.stage(name)

    # --- what the draft is told ----------------------------------------------------------------------------------
    def observe(self, seq: Sequence, start: int, hidden: Tensor) -> None:
        self.draft.observe(seq, start, hidden)

    def forget(self, seq: Sequence) -> None:
        """The request left the running set (finished, aborted, preempted): the draft forgets it, and its pending
        accepted positions (fused replay) are dropped: its running pages are freed, never read as committed again."""
        self.draft.forget(seq)
        self.runner.drop(seq.request_id)
        self._full.pop(seq.request_id, None)
        if self._launched is not None and self._launched.ready and seq.request_id in self._launched.ids:
            self._launched = None  # its states are the committed ones (a ready one's acceptance kept them)

    # --- the step ------------------------------------------------------------------------------------------------
    def decide(self, decode_batch: int) -> bool:
        """Whether a step of `decode_batch` decode steps speculates (always, without a switch)."""
        return self.switch is None or self.switch.decide(decode_batch)

    def record(self, decode_batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step's time, for the switch."""
        if self.switch is not None:
            self.switch.record(decode_batch, speculated, tokens, seconds)

    def mixes(self, first_forwards: list) -> bool:
        """Whether this step's verifications join its first round's prefill forward (one pass over the weights
        instead of two): when there is such a forward, and it runs eagerly anyway (no CUDA graphs, or segments of
        different lengths, which are packed); a forward that would be a graph replay keeps its graph and the
        verifications theirs. `first_forwards`: the plan's first round."""
        if not self.cfg.mix_verify:
            return False
        lengths = [s.end - s.start for f in first_forwards for s in f if not s.single]
        return bool(lengths) and (self.runner.graphs is None or len(set(lengths)) > 1)

    def propose(self, work: list[Work], on_device: bool = False) -> list[Proposal]:
        """The draft's proposals for the speculating works, checked against the number each asked for. `on_device`
        (a verification of its own follows): greedy drafts of a captured chain may stay on the device
        (`Proposal.on_device`), where the draft offers that (`device_drafts`)."""
        seqs, ks = [w.seq for w in work], [w.draft for w in work]
        props = self.draft.propose(seqs, ks, on_device=True) if on_device and self.device_drafts else \
            self.draft.propose(seqs, ks)
        for w, p in zip(work, props):
            if len(p) != w.draft:
                raise RuntimeError(f"the draft proposed {len(p)} tokens for {w.seq.request_id}, "
                                   f"{w.draft} were asked for")
        self.post.metrics.spec_drafted_ahead_taken += sum(p.ahead for p in props)
        return props

    def rows(self, work: list[Work], props: list[Proposal]) -> ForwardBatch:
        """The verification rows of `work` as a forward (each request's last token and its drafts). Drafts on the
        device go as `ForwardBatch.drafts` (placeholders in the tokens) when every request of the forward has
        them; mixed with host drafts (not a case the draft makes), they are read back."""
        dev = [p.on_device for p in props if p.tokens is None]
        drafts = torch.stack(dev) if dev and len(dev) == len(props) else None
        if dev and drafts is None:
            for p in props:
                if p.tokens is None:
                    p.tokens = p.on_device.tolist()
        return ForwardBatch([w.seq.token_range(w.start, w.end) + (p.tokens if drafts is None else [0] * len(p))
                             for w, p in zip(work, props)],
                            [w.start for w in work], [self.scheduler.slots(w.seq) for w in work],
                            n_verify=len(work), features=self.features, ids=[w.seq.request_id for w in work],
                            drafts=drafts)

    def verify(self, work: list[Work]) -> list[RequestOutput]:
        """Draft, verify, accept and commit the speculative decode steps of this step. Requests with the same
        number of drafts are verified as the rows of one batched forward (all of them, but near max_tokens)."""
        if self.stage_times is not None:
            self.stage_times.cycles += 1
        with self._stage("draft"):
            props = self.propose(work, on_device=True)
        groups: dict[int, list[int]] = {}
        for i, w in enumerate(work):
            groups.setdefault(w.draft, []).append(i)
        launched, self._launched = self._launched, None
        outputs = []
        for idx in groups.values():
            ws, ps = [work[i] for i in idx], [props[i] for i in idx]
            with self._stage("verify"):
                v = self._launched_for(launched, ws, ps) if len(groups) == 1 else None
                if v is None:
                    v = self.runner.execute(self.rows(ws, ps)).verified
            targets = self._targets(ws, ps, v)
            if len(groups) == 1:  # one group (the steady state): its next proposal drafted now, where it may be
                with self._stage("ahead"):
                    if self._draft_ahead(ws, v, targets):
                        self._verify_ahead(ws, v, targets)
            outputs += self.accept(ws, ps, v, targets)
        return outputs

    def _launched_for(self, launched: _Launched | None, work: list[Work], props: list[Proposal]) -> Verified | None:
        """The verification launched ahead, where it is this step's: kept by its acceptance, for the same requests
        in the same order from the same positions with as many drafts, and every proposal taken from the proposal
        drafted ahead that it verifies (`_Chains.taken`); else None (it is dropped: its states are the committed
        ones)."""
        if launched is None or not launched.ready:
            return None
        chains = getattr(self.draft, "chains", None)
        if chains is None or chains.taken is not launched.source or not all(p.ahead for p in props) \
                or [w.seq.request_id for w in work] != launched.ids or [w.start for w in work] != launched.starts \
                or any(w.draft != launched.k for w in work):
            return None
        self.post.metrics.spec_verified_ahead_used += len(work)
        return launched.v

    @staticmethod
    def _targets(work: list[Work], props: list[Proposal], v: Verified) -> GreedyReadBack:
        """The greedy rows' targets (and drafts left on the device), their read-back begun."""
        return GreedyReadBack(v.logits, [i for i, w in enumerate(work) if w.seq.params.temperature == 0],
                              {i: p.on_device for i, p in enumerate(props) if p.tokens is None})

    def _draft_ahead(self, work: list[Work], v: Verified, targets: GreedyReadBack) -> None:
        """Draft the next proposal of `work` now, before the acceptance is read back, as if every draft were accepted
        (`Draft.propose_ahead`: the verified positions' hidden states and targets are what the draft observes then):
        on a GPU it runs while the host accepts, emits and commits. Only for greedy requests, at least half of which
        had every draft of their previous verification accepted (`ahead_after_full`; the next proposal takes it for
        the requests accepted whole this time, and drafts the others then), where the draft offers it and
        `EngineConfig.draft_ahead` is on."""
        if not (self.cfg.draft_ahead and self.device_drafts) or targets.top is None or \
                len(targets.rows) != len(work):
            return False
        if self.ahead_after_full and 2 * sum(bool(self._full.get(w.seq.request_id)) for w in work) < len(work):
            return False
        k, R = work[0].draft, len(work)
        if self.draft.propose_ahead([w.seq for w in work], [w.start for w in work], k, v.hidden[:R, :k + 1],
                                    targets.top[:, :k + 1]):
            self.post.metrics.spec_drafted_ahead += R
            return True
        return False

    def _verify_ahead(self, work: list[Work], v: Verified, targets: GreedyReadBack) -> None:
        """Launch the verification of the proposal just drafted ahead (the module docstring), where
        EngineConfig.verify_ahead is on with fused replay, for requests whose accepted positions end before the next
        hash-block boundary (a checkpoint there must hold the state at it), that have room for a whole next window
        under max_tokens, and whose pages can grow to it."""
        chains = getattr(self.draft, "chains", None)
        source = None if chains is None else chains.pending
        if not (self.cfg.verify_ahead and self.runner.fused_replay) or source is None:
            return
        k, R, hb = work[0].draft, len(work), self.cfg.hash_block_tokens
        if tuple(source.tokens.shape) != (R, k) or any(self.runner.pending_tokens(w.seq.request_id) for w in work):
            return
        for w in work:
            s = w.seq
            if (w.start + k + 1) // hb * hb > w.start or len(s.output_ids) + 2 * (k + 1) > s.params.max_tokens:
                return
        if not all(self.scheduler.grow(w.seq, w.start + 2 * (k + 1)) for w in work):
            return
        slots = [self.scheduler.slots(w.seq) for w in work]
        pages = v.kda_pages[:, :R].flatten()
        saved = self.runner.pool.read_kda(pages)  # what the launched verification overwrites
        for i, (w, sl) in enumerate(zip(work, slots)):  # the positions it assumes accepted, pending in it
            self.runner.hold(w.seq.request_id, sl.kda_pages, v, i, 0, k + 1)
        ids = [w.seq.request_id for w in work]
        # its tokens on the device: each row's bonus target, then the drafts
        tokens = torch.cat([targets.top[:R, k:k + 1].to(source.tokens.dtype), source.tokens], 1)
        batch = ForwardBatch([[0] * (k + 1) for _ in work], [w.start + k + 1 for w in work], slots, n_verify=R,
                             features=self.features, ids=ids, drafts=tokens)
        self._launched = _Launched(self.runner.execute(batch).verified, v, ids, [w.start + k + 1 for w in work], k,
                                   source, pages, saved)
        self.post.metrics.spec_verified_ahead += R

    def accept(self, work: list[Work], props: list[Proposal], v: Verified,
               targets: GreedyReadBack | None = None) -> list[RequestOutput]:
        """Accept each verified request's drafts (row i of the verification `v`), emit the tokens, commit the
        accepted positions' KDA states by replay and truncate the MLA cache to them. `targets`: the greedy rows'
        read-back, begun already (else begun here)."""
        seqs = [w.seq for w in work]
        with self._stage("accept"):
            outs, emitted = self._accept(seqs, work, props, v, targets or self._targets(work, props, v))
        for w, n in zip(work, emitted):  # every draft accepted (tokens emitted: the drafts and the bonus)
            self._full[w.seq.request_id] = n == w.draft + 1
        launched = self._launched if self._launched is not None and self._launched.after is v else None
        with self._stage("commit"):
            if launched is not None and all(n == w.draft + 1 and w.seq.status != Status.FINISHED
                                            for w, n in zip(work, emitted)):
                # kept: its pass replays these positions (the states after them are its to write)
                launched.ready, launched.saved = True, None
                for w, n in zip(work, emitted):
                    self.scheduler.computed(w.seq, w.start + n)
            else:
                if launched is not None:  # dropped: the states it overwrites as they were, the commit as always
                    self._launched = None
                    self.runner.pool.write_kda(launched.pages, *launched.saved)
                self.commit(work, v, emitted)
        with self._stage("observe"):
            for i, s in enumerate(seqs):
                if s.status == Status.FINISHED:
                    self.release(s)
                else:
                    self.draft.observe(s, work[i].start, v.hidden[i, :emitted[i]])
                    # a kept launched verification's window stays in the pages (its rows are written there)
                    end = s.num_computed + (launched.k + 1 if launched is not None and launched.ready else 0)
                    self.scheduler.cache.truncate(s, end)
        return outs

    def _accept(self, seqs: list[Sequence], work: list[Work], props: list[Proposal],
                v: Verified, targets: GreedyReadBack) -> tuple[list[RequestOutput], list[int]]:
        """The acceptance of each row and the tokens emitted: (outputs, tokens emitted per request)."""
        outs, emitted = [], []
        greedy = targets.result()
        for i, p in enumerate(props):  # drafts left on the device: read back with the targets (one read-back)
            if p.tokens is None:
                greedy[i], p.tokens = greedy[i][:len(p) + 1], greedy[i][-len(p):] if len(p) else []
        m = self.post.metrics
        # a mixed forward's rows are padded to its longest verification: each request's first k + 1 rows
        n = [len(p.tokens) + 1 for p in props]
        accepted = accept_batch([v.logits[i, :n[i]] for i in range(len(seqs))], [p.tokens for p in props],
                                [p.q for p in props], [s.params for s in seqs], [s.generator for s in seqs],
                                {i: t[:n[i]] for i, t in greedy.items()})
        lps = self._logprobs(seqs, accepted, v)
        for i, (s, w, toks) in enumerate(zip(seqs, work, accepted)):
            out, n = self.post.emit_many(s, toks, lps[i])  # the stop rules in order: nothing after a stop is kept
            emitted.append(n)  # tokens emitted = verified positions committed (each one's input)
            outs.append(out)
            m.spec_verifications += 1
            m.draft_tokens_proposed += w.draft
            m.draft_tokens_accepted += len(toks) - 1
        return outs, emitted

    @staticmethod
    def _logprobs(seqs: list[Sequence], accepted: list[list[int]], v: Verified) -> list[list[dict] | None]:
        """Per request, the logprob entries of its accepted tokens (token j drawn from verified position j), for the
        requests that ask for logprobs (else None): all of them at once, one read-back."""
        want = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        out: list[list[dict] | None] = [None] * len(seqs)
        if want:
            rows = torch.cat([v.logits[i, :len(accepted[i])] for i in want])
            flat = logprob_entries(rows, [t for i in want for t in accepted[i]],
                                   [seqs[i].params.logprobs for i in want for _ in accepted[i]])
            for i in want:
                out[i], flat = flat[:len(accepted[i])], flat[len(accepted[i]):]
        return out

    def commit(self, work: list[Work], v: Verified, emitted: list[int]) -> None:
        """Replay each request's committed positions into its KDA state and register them with the cache. A
        hash-block boundary inside them splits the replay there, so the checkpoint taken at it holds the state at
        exactly that position (checkpoints only of committed states)."""
        if self.runner.fused_replay:  # the engine's resolved choice (EngineConfig.fused_replay None: on here)
            self._commit_pending(work, v, emitted)
            return
        hb = self.cfg.hash_block_tokens
        first = []
        for w, n in zip(work, emitted):
            cut = (w.start + n) // hb * hb - w.start
            first.append(cut if 0 < cut < n else n)
        self.runner.replay(v, list(range(len(work))), [0] * len(work), first)
        for w, n in zip(work, first):
            self.scheduler.computed(w.seq, w.start + n)
        rest = [i for i, (n, f) in enumerate(zip(emitted, first)) if f < n]
        self.runner.replay(v, rest, [first[i] for i in rest], [emitted[i] - first[i] for i in rest])
        for i in rest:
            self.scheduler.computed(work[i].seq, work[i].start + emitted[i])

    def _commit_pending(self, work: list[Work], v: Verified, emitted: list[int]) -> None:
        """`commit` with fused replay: each request's accepted positions up to the last hash-block boundary among
        them are replayed now (the checkpoint `computed` takes at the boundary holds exactly that position), the rest
        are left pending with the runner (`hold`) and registered as computed: their MLA rows are in the pages (the
        complete hash blocks enter the prefix index), and their end is past the last boundary, so no checkpoint is
        taken there (the KDA state there is first needed by the next forward over the request, which replays them
        in its own pass or before it)."""
        stale = [w.seq.request_id for w in work if self.runner.pending_tokens(w.seq.request_id)]
        if stale:  # the verification starts from the state after them: it must have replayed them
            raise RuntimeError(f"requests {stale} still have pending positions after their verification")
        hb = self.cfg.hash_block_tokens
        now = [max((w.start + n) // hb * hb - w.start, 0) for w, n in zip(work, emitted)]
        rows = [i for i, c in enumerate(now) if c]
        self.runner.replay(v, rows, [0] * len(rows), [now[i] for i in rows])
        for i in rows:
            self.scheduler.computed(work[i].seq, work[i].start + now[i])
        for i, (w, n) in enumerate(zip(work, emitted)):
            if n > now[i]:
                self.runner.hold(w.seq.request_id, self.scheduler.slots(w.seq).kda_pages, v, i, now[i], n - now[i])
                self.scheduler.computed(w.seq, w.start + n)
