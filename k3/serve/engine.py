"""The serving engine: request -> scheduler -> runner -> sampler -> request (report §5.4).

`LLMEngine.step()` runs one scheduling step: plan the work (decode tokens and prefill chunks under the token
budget), restore prefix-cache hits, run the model against the paged pool, persist KDA checkpoints at
hash-aligned positions, sample, and apply stop rules. It is synchronous; the HTTP server drives it from a
background thread. A request with `SamplingParams.prompt_logprobs` has its prompt scored in the same forwards that
prefill it (the runner scores the chunk's positions, `PromptScore`), and so never takes a prefix-cache hit.

Speculative decoding (`EngineConfig.speculative`, k3.serve.speculative): a decoding request's step feeds its last token
and up to `num_draft_tokens` draft tokens. When the step also prefills chunks (and they run eagerly), the
verifications join the chunks' packed forward, so the step passes over the weights once for both; otherwise they
run as one batched forward of their own (plain decode steps run in the step's other forward). The verification
leaves the KDA states as they were; the accepted prefix is then replayed into them (KDA rollback by replay, report
§5.4.2), KDA checkpoints are taken only of those committed states, and the MLA block tables shrink to the accepted
length.
Greedy output is token-identical to decoding without speculation and sampled output has the target's
distribution. With CUDA graphs, the verifications run as graph replays (one graph per batch bucket and number of
positions) and the plain decode steps on graphs that also output the hidden states the draft observes.

Host write-back and prefetch (report §5.3.1, k3.serve.cache.host): `write_back(prefixes)` copies the cached
prefixes of token sequences (MLA rows and KDA checkpoints together) to host memory, `prefetch(store)` brings them
into another engine of the same model config and cache geometry, whose next requests starting with them hit them.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch

from k3.model.common import stack_projections
from k3.ops.registry import notice
from k3.serve.cache.host import HostPrefixStore, PrefetchReport
from k3.serve.cache.manager import CacheManager
from k3.serve.cuda_graphs import DecodeGraphs, decode_graphs_mode, prefill_graph_lengths
from k3.serve.metrics import SampleWindow
from k3.serve.runner import ModelRunner, PromptScore, RunOutput
from k3.serve.sampling import SamplingParams, sample_batch
from k3.serve.scheduler import Scheduler, SchedulerConfig, Work
from k3.serve.sequence import Sequence, Status
from k3.serve.speculative.accept import accept, greedy_targets
from k3.serve.speculative.draft import Draft, Eagle3Draft, MTPDraft
from k3.serve.speculative.switch import SpecSwitch

SPECULATIVE = ("off", "mtp", "eagle3")
MAX_DRAFT_TOKENS = 16


@dataclass
class EngineConfig:
    cache_memory_mb: float = 512.0  # the page pool (MLA latent KV + KDA states + checkpoints)
    page_tokens: int = 2048  # physical page (allocation unit) in tokens
    hash_block_tokens: int = 512  # prefix-hash granularity; KDA checkpoints sit on these boundaries
    enable_prefix_cache: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    cuda_graphs: bool | str = True  # CUDA-graph decode steps where possible; False: off; "eager": no capture (tests)
    # torch.compile the static decode step before its capture (fewer, fused kernels; a compile per bucket at warm-up).
    # Needs the static-buffer steps (cuda_graphs True or "eager"); k3.serve.cuda_graphs
    compile_decode: bool = False
    # The projections a layer computes from one input (KDA's six, MLA's three, an MoE layer's latent down-projection
    # and shared gate and up, with the router on CUDA) as one GEMM per layer against their weights stacked in place
    # (k3.model.common.stack_projections: same bytes, fewer kernels); False undoes it on the model.
    stack_projections: bool = True
    speculative: str = "off"  # "mtp": draft with the model's MTP layer and verify (k3.serve.speculative); "eagle3": with
    # the EAGLE-3 draft in directory `draft` (k3 train-draft; k3.draft_checkpoint)
    draft: str | None = None
    num_draft_tokens: int = 3  # drafts per speculative step (K: K + 1 positions verified)
    # With speculation: measure speculative against plain decode steps per decode batch size and keep to the faster
    # (k3.serve.speculative.switch). `k3 serve` and `k3 generate` turn it on (--no-speculative-auto: off); off here, so
    # that an engine built in code speculates on every step it can, as configured.
    speculative_auto: bool = False
    # With speculation: verifications join the step's prefill forward when it runs eagerly (one pass over the weights
    # for both, `ModelRunner.run_mixed`); False: they always run as a forward of their own.
    mix_verify: bool = True
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> None:
        if self.page_tokens < 1 or self.hash_block_tokens < 1 or self.page_tokens % self.hash_block_tokens:
            raise ValueError(f"page_tokens ({self.page_tokens}) must be a positive multiple of hash_block_tokens "
                             f"({self.hash_block_tokens})")
        if not self.cache_memory_mb > 0:
            raise ValueError(f"cache_memory_mb must be positive, got {self.cache_memory_mb}")
        if not (isinstance(self.cuda_graphs, bool) or self.cuda_graphs == "eager"):
            raise ValueError(f"cuda_graphs={self.cuda_graphs!r} is invalid: use True, False or 'eager'")
        if self.speculative not in SPECULATIVE:
            raise ValueError(f"speculative={self.speculative!r} is invalid: use {' or '.join(SPECULATIVE)}")
        for name in ("speculative_auto", "mix_verify", "compile_decode", "stack_projections"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: use True or False")
        if self.draft is not None and self.speculative != "eagle3":
            raise ValueError(f"a draft directory ({self.draft}) is for speculative='eagle3', not "
                             f"{self.speculative!r}")
        k = self.num_draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise ValueError(f"num_draft_tokens={k!r} is invalid: use an integer in [1, {MAX_DRAFT_TOKENS}]")
        self.scheduler.validate()


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict] = field(default_factory=list)
    # On a request's first output, when its params ask for prompt_logprobs: Sequence.prompt_logprobs.
    prompt_logprobs: list[dict | None] | None = None


class EngineMetrics:
    """Counters and latency samples for /metrics (Prometheus text)."""

    def __init__(self) -> None:
        # Bounded: the most recent samples (the /metrics histograms count every sample ever added).
        self.ttft = SampleWindow()
        self.tpot = SampleWindow()
        self.queue_time = SampleWindow()
        self.prompt_tokens_cached = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.requests_finished = 0
        self.preemptions = 0
        # speculative decoding: verified request-steps, drafts proposed and accepted (mean accepted length, tokens
        # emitted per verification: (accepted + verifications) / verifications)
        self.spec_verifications = 0
        self.draft_tokens_proposed = 0
        self.draft_tokens_accepted = 0
        # host write-back (prefixes copied to host memory) and prefetch (copied back into the pool)
        self.written_back_tokens = 0
        self.written_back_bytes = 0
        self.prefetched_tokens = 0
        self.prefetched_bytes = 0

    @property
    def mean_accepted_length(self) -> float:
        n = self.spec_verifications
        return (self.draft_tokens_accepted + n) / n if n else 0.0


class LLMEngine:
    """`draft`: a draft model for speculative decoding (k3.serve.speculative.draft.Draft) in place of the one
    `config.speculative` names (e.g. an EAGLE draft, or a test's); it turns speculation on."""

    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, draft: Draft | None = None):
        self.cfg = config or EngineConfig()
        self.cfg.validate()
        self.model, self.tokenizer = model.eval(), tokenizer
        stack_projections(model, self.cfg.stack_projections)
        mcfg = model.config
        device = next(model.parameters()).device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        if draft is None and self.cfg.speculative == "mtp":
            draft = MTPDraft(model)
        if draft is None and self.cfg.speculative == "eagle3":
            if self.cfg.draft is None:
                raise ValueError("speculative='eagle3' needs the draft's directory (EngineConfig.draft; --draft DIR)")
            from k3.draft_checkpoint import load_draft

            draft = Eagle3Draft(model, load_draft(self.cfg.draft, model))
        self.draft = draft
        self.spec_switch = SpecSwitch() if draft is not None and self.cfg.speculative_auto else None
        self.clock = time.perf_counter  # what the switch's step times are read from (a test's fake clock)
        # AttnRes blocks whose outputs the draft reads beside the hidden state (an EAGLE-3 draft's)
        self._draft_features = tuple(getattr(draft, "features", ())) if draft is not None else ()
        # With a draft, the plain decode steps (and hash-block prefill chunks) run on graphs that also output the
        # hidden states the draft observes; the verifications themselves run eagerly (no graph of them yet).
        graphs = decode_graphs_mode(model, self.cfg.cuda_graphs)
        n_kda = sum(1 for l in model.model.layers if l.is_kda)
        cache = CacheManager(mcfg, len(model.model.layers) - n_kda, n_kda, self.cfg.cache_memory_mb,
                             self.cfg.page_tokens, self.cfg.hash_block_tokens, self.cfg.enable_prefix_cache,
                             dtype=dtype, device=device, scratch_page=graphs is not None)
        self.scheduler = Scheduler(self.cfg.scheduler, cache,  # owns the cache manager
                                   draft_tokens=self.cfg.num_draft_tokens if draft is not None else 0)
        self.scheduler.on_admit = self._on_admit
        self.scheduler.on_preempt = self._on_preempt
        self.runner = ModelRunner(model, cache.pool)
        self.max_model_len = self.cfg.max_model_len or mcfg.max_position_embeddings
        if graphs is not None:
            self.runner.graphs = DecodeGraphs(self.runner, self.cfg.scheduler.max_num_seqs, self.max_model_len,
                                              scratch_page=cache.scratch_page, capture=graphs == "capture",
                                              prefill_lengths=prefill_graph_lengths(model, graphs,
                                                                                    self.cfg.hash_block_tokens),
                                              keep_hidden=draft is not None, features=self._draft_features,
                                              verify_lengths=tuple(range(2, self.cfg.num_draft_tokens + 2))
                                              if draft is not None else (),
                                              compile_step=self.cfg.compile_decode)
        elif self.cfg.compile_decode:
            notice("compile_decode has no effect: decode steps do not run on static buffers here (cuda_graphs is off, "
                   "or the conditions for them do not hold)")
        self.eos_id = mcfg.eos_token_id
        self.metrics = EngineMetrics()
        self.seqs: dict[str, Sequence] = {}
        self.lock = threading.RLock()
        self.last_prefetch: PrefetchReport | None = None  # what the latest `prefetch` fetched and skipped

    @property
    def cache(self) -> CacheManager:
        """The serving cache (page pool and prefix index), owned by the scheduler."""
        return self.scheduler.cache

    # --- requests ----------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context length {self.max_model_len}")
        need = self.cache.pages_needed(len(prompt_ids) + params.max_tokens)
        if need > self.cache.num_pages:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) needs up to {need} "
                             f"cache pages but the pool has {self.cache.num_pages}; lower max_tokens or give the "
                             f"server more cache memory")
        vocab = self.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        seq = Sequence(list(prompt_ids), params, **({"request_id": request_id} if request_id else {}))
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs.append(None)  # the first prompt token has no logprob: nothing predicts it
        seq.generator = torch.Generator(device=self.runner.device)
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") % 2**63
        seq.generator.manual_seed(seed)
        with self.lock:
            if seq.request_id in self.seqs:
                raise ValueError(f"request id {seq.request_id!r} is already in use")
            self.seqs[seq.request_id] = seq
            self.scheduler.add(seq)
        return seq

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its cache (e.g. the client went away)."""
        with self.lock:
            seq = self.seqs.pop(request_id, None)
            if seq is None or seq.status == Status.FINISHED:
                return
            self.scheduler.abort(seq)
            seq.status, seq.finish_reason = Status.FINISHED, "abort"
            if self.draft is not None:
                self.draft.forget(seq)

    def has_work(self) -> bool:
        return bool(self.scheduler.running) or self.scheduler.num_waiting > 0

    # --- the scheduler's notices (metrics) --------------------------------------------------------------------
    def _on_admit(self, seq: Sequence, hit_tokens: int) -> None:
        if seq.admitted_at is None:
            seq.admitted_at = time.monotonic()
            seq.cached_tokens = hit_tokens
            self.metrics.queue_time.append(seq.admitted_at - seq.arrival)
            self.metrics.prompt_tokens_cached += hit_tokens

    def _on_preempt(self, seq: Sequence) -> None:
        self.metrics.preemptions += 1
        if self.draft is not None:
            self.draft.forget(seq)  # it is recomputed, and observed again, from its prefix hit

    # --- one step ----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        with self.lock:
            work = self.scheduler.plan()
            if not work:
                if self.scheduler.running or self.scheduler.num_waiting:
                    return self._fail_unschedulable()
                return []
            t0 = self.clock()
            decode = [w for w in work if _is_decode(w)]
            decode_only = len(decode) == len(work)
            spec = [w for w in work if w.draft]
            if spec and self.spec_switch is not None and not self.spec_switch.decide(len(decode)):
                for w in spec:  # this batch size measures faster without speculation: a plain decode step
                    w.draft = 0
                spec = []
            work = [w for w in work if not w.draft]
            mixed = None  # (proposals, Verified) of verifications run in the same forward as prefill chunks
            if spec and self._mixes_verify(work):
                props = self._propose(spec)
                logits, v = self._run_batched(work, verify=(spec, props))
                mixed = (props, v)
            else:
                logits = self._run_batched(work) if work else {}
            due = []
            for w in work:
                self.metrics.prompt_tokens_computed += max(0, min(w.end, len(w.seq.prompt_ids)) - w.start)
                if w.end == w.seq.num_tokens:
                    due.append(w.seq)
            outputs = [self._finish_scored(s) for s in due if s.params.max_tokens == 0]
            due = [s for s in due if s.params.max_tokens > 0]
            if due:  # every request's next token in one batched sampling call: one read-back per step
                rows = _rows_of(logits, due)
                toks = sample_batch(rows, [s.params for s in due], [s.generator for s in due])
                for i, (s, t) in enumerate(zip(due, toks)):
                    first = s.first_token_at is None
                    out = self._sample(s, t, rows[i])
                    if first and s.params.prompt_logprobs is not None:
                        out.prompt_logprobs = s.prompt_logprobs
                    outputs.append(out)
            if mixed is not None:
                outputs += self._accept(spec, *mixed)
            elif spec:
                outputs += self._speculate(spec)
            self.cache.mark_landed()
            if self.spec_switch is not None and decode_only and decode:
                self.spec_switch.record(len(decode), bool(spec), sum(len(o.new_token_ids) for o in outputs),
                                        self.clock() - t0)
            return outputs

    def _finish_scored(self, seq: Sequence) -> RequestOutput:
        """A request with max_tokens=0 (prompt logprobs only) ends once its prompt is computed: nothing sampled."""
        self._finish(seq, "length")
        return RequestOutput(seq.request_id, [], "", True, "length", prompt_logprobs=seq.prompt_logprobs)

    def _segments(self, w: Work) -> list[tuple[int, int]]:
        """A prefill chunk is split at the last hash-aligned position inside it, so the KDA state there can be
        persisted as a checkpoint without recomputation."""
        hb = self.cfg.hash_block_tokens
        aligned = (w.end // hb) * hb
        bounds = [w.start, aligned, w.end] if w.start < aligned < w.end else [w.start, w.end]
        return list(zip(bounds, bounds[1:]))

    def _mixes_verify(self, work: list[Work]) -> bool:
        """Whether this step's verifications join its first round of prefill chunks in one packed forward (one pass
        over the weights instead of two): when there is such a round, and it runs eagerly anyway (no CUDA graphs,
        or chunks of different lengths, which are packed); a chunk that would be a graph replay keeps its graph and
        the verifications theirs."""
        if not self.cfg.mix_verify:
            return False
        lengths = [b - a for w in work if not _is_decode(w) for a, b in self._segments(w)[:1] if b - a > 1]
        return bool(lengths) and (self.runner.graphs is None or len(set(lengths)) > 1)

    def _run_batched(self, work: list[Work], verify=None):
        """Run every request's segments in rounds (a request's second segment runs only after its first). In a
        round, the single-token decode steps run as one batched forward and all prefill segments as another:
        of one length they are the rows of a batch, of different lengths they are packed into one row.
        Returns {request id: (the forward's logits [B, V], the request's row)}. `verify` (speculating works,
        their proposals): the verifications run in the first round's prefill forward (`ModelRunner.run_mixed`;
        `_mixes_verify` says when there is one); then returns (that dict, the verifications' `Verified`)."""
        segs = {id(w): self._segments(w) for w in work}
        logits: dict[str, tuple[torch.Tensor, int]] = {}
        verified = None
        for r in range(max(len(v) for v in segs.values())):
            groups: dict[bool, list[tuple[Work, int, int]]] = {}
            for w in work:
                if r < len(segs[id(w)]):
                    a, b = segs[id(w)][r]
                    groups.setdefault(b - a == 1, []).append((w, a, b))
            for one, group in groups.items():
                scores = [self._prompt_score(w.seq, a, b) for w, a, b in group]
                args = ([w.seq.token_range(a, b) for w, a, b in group], [a for _, a, _ in group],
                        [self.cache.slots(w.seq) for w, _, _ in group])
                if verify is not None and r == 0 and not one:
                    vw, props = verify
                    for w, p in zip(vw, props):
                        args[0].append(w.seq.token_range(w.start, w.end) + p.tokens)
                        args[1].append(w.start)
                        args[2].append(self.cache.slots(w.seq))
                    res, verified = self.runner.run_mixed(*args, len(vw), scores + [None] * len(vw),
                                                          keep_hidden=True, features=self._draft_features)
                elif self.draft is not None:  # the draft reads the target's hidden states
                    res = self.runner.run(*args, scores if any(scores) else None, keep_hidden=True,
                                          features=self._draft_features)
                elif any(scores):
                    res = RunOutput(*self.runner.forward(*args, scores=scores))
                else:
                    res = RunOutput(self.runner.forward(*args))
                if res.scored is not None:
                    for (w, _, _), sc, scored in zip(group, scores, res.scored):
                        if sc is not None:
                            w.seq.prompt_logprobs.extend(_score_entries(sc.targets, scored))
                for i, (w, a, b) in enumerate(group):
                    self._after_forward(w.seq, b)
                    logits[w.seq.request_id] = (res.logits, i)
                    if res.hidden is not None:
                        self.draft.observe(w.seq, a, res.hidden[i])
        if verify is not None:
            if verified is None:
                raise RuntimeError("the verifications had no prefill forward to join (see _mixes_verify)")
            return logits, verified
        return logits

    @staticmethod
    def _prompt_score(seq: Sequence, a: int, b: int) -> PromptScore | None:
        """What to score of the forward over seq.tokens[a:b]: the logits at position j predict prompt token
        j + 1, so the positions from the first prompt token not yet scored, up to the prompt's second-to-last
        (after a preemption, positions already scored are not scored again)."""
        if not seq.scores_prompt:
            return None
        known = len(seq.prompt_logprobs)
        if a > known - 1:  # admission never gives such a request a hit, so no position can have been skipped
            raise RuntimeError(f"request {seq.request_id}: forward starts at {a} but only {known} prompt tokens "
                               f"are scored")
        lo, hi = max(a, known - 1), min(b, len(seq.prompt_ids) - 1)
        if lo >= hi:
            return None
        return PromptScore(lo - a, seq.prompt_ids[lo + 1:hi + 1], seq.params.prompt_logprobs)

    def _after_forward(self, seq: Sequence, end: int) -> None:
        seq.num_computed = end
        self.cache.computed(seq, end)

    def _sample(self, seq: Sequence, tok: int, logits: torch.Tensor) -> RequestOutput:
        """Take the sampled token `tok` (drawn from `logits`): logprobs, timing metrics, stop rules, text; a request
        that this finishes releases its pages."""
        out = self._take(seq, tok, logits)
        if out.finished:
            self._release(seq)
        return out

    def _take(self, seq: Sequence, tok: int, logits: torch.Tensor) -> RequestOutput:
        """`_sample` without releasing the pages of a request it finishes (the caller still commits its state)."""
        p = seq.params
        now = time.monotonic()
        lp = {}
        if p.logprobs is not None:
            logp = torch.log_softmax(logits.float(), -1)
            top = torch.topk(logp, max(p.logprobs, 1))
            lp = {"token": tok, "logprob": float(logp[tok]),
                  "top": [(int(i), float(v)) for v, i in zip(top.values, top.indices)][: p.logprobs]}
        if seq.first_token_at is None:
            seq.first_token_at = now
            self.metrics.ttft.append(now - seq.arrival)
        elif seq.output_ids:
            self.metrics.tpot.append(now - getattr(seq, "_last_token_at", now))
        seq._last_token_at = now  # type: ignore[attr-defined]
        self.metrics.generation_tokens += 1
        reason = None
        if (self.eos_id is not None and tok == self.eos_id) or tok in p.stop_token_ids:
            reason = "stop"
            new_ids = []
        else:
            seq.output_ids.append(tok)
            if lp:
                seq.logprobs.append(lp)
            new_ids = [tok]
        prev_text = seq.text
        delta = ""
        if self.tokenizer is not None:
            full = self.tokenizer.decode(seq.output_ids)
            stop_at = min((full.find(s) for s in p.stop if s and s in full), default=-1)
            if stop_at >= 0:
                full, reason = full[:stop_at], "stop"
            if reason is None:
                full = full[: len(full) - _held_back(full, p.stop)]
            seq.text = full if len(full) >= len(prev_text) or reason else prev_text
        if reason is None and len(seq.output_ids) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._end(seq, reason)  # releases any held-back tail of the text
        delta = seq.text[len(prev_text):] if self.tokenizer is not None else ""
        return RequestOutput(seq.request_id, new_ids, delta, reason is not None, reason, [lp] if lp else [])

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._end(seq, reason)
        self._release(seq)

    def _end(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason, seq.finished_at = Status.FINISHED, reason, time.monotonic()
        if self.tokenizer is not None and reason != "stop":
            seq.text = self.tokenizer.decode(seq.output_ids)
        self.metrics.requests_finished += 1

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.seqs.pop(seq.request_id, None)
        if self.draft is not None:
            self.draft.forget(seq)

    # --- speculative decoding ----------------------------------------------------------------------------------
    def _propose(self, work: list[Work]) -> list:
        """The draft's proposals for the speculating works, checked against the number each asked for."""
        props = self.draft.propose([w.seq for w in work], [w.draft for w in work])
        for w, p in zip(work, props):
            if len(p.tokens) != w.draft:
                raise RuntimeError(f"the draft proposed {len(p.tokens)} tokens for {w.seq.request_id}, "
                                   f"{w.draft} were asked for")
        return props

    def _speculate(self, work: list[Work]) -> list[RequestOutput]:
        """Draft, verify, accept and commit the speculative decode steps of this step. Requests with the same
        number of drafts are verified as the rows of one batched forward (all of them, but near max_tokens)."""
        props = self._propose(work)
        groups: dict[int, list[int]] = {}
        for i, w in enumerate(work):
            groups.setdefault(w.draft, []).append(i)
        outputs = []
        for idx in groups.values():
            outputs += self._verify([work[i] for i in idx], [props[i] for i in idx])
        return outputs

    def _verify(self, work: list[Work], props) -> list[RequestOutput]:
        seqs = [w.seq for w in work]
        v = self.runner.verify([s.token_range(w.start, w.end) + p.tokens for s, w, p in zip(seqs, work, props)],
                               [w.start for w in work], [self.cache.slots(s) for s in seqs],
                               features=self._draft_features)
        return self._accept(work, props, v)

    def _accept(self, work: list[Work], props, v) -> list[RequestOutput]:
        """Accept each verified request's drafts (row i of the verification `v`), emit the tokens, commit the
        accepted positions' KDA states by replay and truncate the MLA cache to them."""
        seqs = [w.seq for w in work]
        outs, emitted = [], []
        greedy = greedy_targets(v.logits, [i for i, s in enumerate(seqs) if s.params.temperature == 0])
        for i, (s, w, p) in enumerate(zip(seqs, work, props)):
            n = len(p.tokens) + 1  # a mixed forward's rows are padded to its longest verification
            tgt = greedy.get(i)
            toks = accept(v.logits[i, :n], p.tokens, p.q, s.params, s.generator,
                          target=None if tgt is None else tgt[:n])
            got = []
            for j, t in enumerate(toks):  # stop rules token by token: nothing after a stop is kept
                got.append(self._take(s, t, v.logits[i, j]))
                if got[-1].finished:
                    break
            emitted.append(len(got))  # tokens emitted = verified positions committed (each one's input)
            outs.append(_merge(got))
            m = self.metrics
            m.spec_verifications += 1
            m.draft_tokens_proposed += w.draft
            m.draft_tokens_accepted += len(toks) - 1
        self._commit(seqs, work, v, emitted)
        for i, s in enumerate(seqs):
            if s.status == Status.FINISHED:
                self._release(s)
            else:
                self.draft.observe(s, work[i].start, v.hidden[i, :emitted[i]])
                self.cache.truncate(s, s.num_computed)
        return outs

    def _commit(self, seqs: list[Sequence], work: list[Work], v, emitted: list[int]) -> None:
        """Replay each request's committed positions into its KDA state and register them with the cache. A
        hash-block boundary inside them splits the replay there, so the checkpoint taken at it holds the state at
        exactly that position (checkpoints only of committed states)."""
        hb = self.cfg.hash_block_tokens
        first = []
        for w, n in zip(work, emitted):
            cut = (w.start + n) // hb * hb - w.start
            first.append(cut if 0 < cut < n else n)
        self.runner.replay(v, list(range(len(seqs))), [0] * len(seqs), first)
        for s, w, n in zip(seqs, work, first):
            self._after_forward(s, w.start + n)
        rest = [i for i, (n, f) in enumerate(zip(emitted, first)) if f < n]
        self.runner.replay(v, rest, [first[i] for i in rest], [emitted[i] - first[i] for i in rest])
        for i in rest:
            self._after_forward(seqs[i], work[i].start + emitted[i])

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled: the oldest waiting request cannot fit even in an empty pool."""
        if self.scheduler.running:
            return []
        for q in self.scheduler.waiting.values():
            if q:
                seq = q.popleft()
                seq.status, seq.finish_reason = Status.FINISHED, "error: the request does not fit in the cache"
                self.seqs.pop(seq.request_id, None)
                return [RequestOutput(seq.request_id, [], "", True, seq.finish_reason)]
        return []

    # --- offline use --------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while any(s.status != Status.FINISHED for s in seqs):
            self.step()
        return seqs

    def cache_stats(self) -> dict:
        return self.cache.stats()

    # --- host write-back and prefetch (report §5.3.1; k3.serve.cache.host) ---------------------------------------
    def write_back(self, prefixes: list[list[int]]) -> HostPrefixStore:
        """Copy to host memory, for each token sequence, the longest prefix the cache can restore exactly as an
        admission looks it up (MLA blocks, then a KDA checkpoint at their end; a multiple of hash_block_tokens, up
        to every complete hash block of the sequence, 0 tokens when nothing is cached). The cache is only read.
        Runs between steps (it takes the engine's lock), so it never sees a step's unlanded entries; requests may
        be running or waiting (their indexed pages are never rewritten), but the usual caller has no work left
        (paused rollouts were aborted: their computed blocks and newest checkpoint stay in the index)."""
        with self.lock:
            store = self.cache.write_back(prefixes)
            self.metrics.written_back_tokens += store.tokens
            self.metrics.written_back_bytes += store.nbytes
        return store

    def prefetch(self, store: HostPrefixStore) -> int:
        """Copy a store written back by an engine of the same model config, page_tokens, hash_block_tokens and
        cache dtype (ValueError naming the difference otherwise; the weights may differ: the states are then the
        writer's) into this engine's pool, registered as evictable prefix-cache entries: the next request whose
        prompt starts with one of the prefixes (and is longer) hits all of it. Prefixes are taken in the store's
        order, each whole or not at all, while pages can be found (free, or by evicting idle cache entries, never
        a running request's); `last_prefetch` (a PrefetchReport) lists the fetched and skipped ones. Returns the
        tokens made available. Runs between steps (the engine's lock)."""
        with self.lock:
            report = self.cache.prefetch(store)
            self.last_prefetch = report
            self.metrics.prefetched_tokens += report.tokens
            self.metrics.prefetched_bytes += report.bytes
        return report.tokens


def _is_decode(w: Work) -> bool:
    """A decode step (one position past the prompt, its token sampled by the last step), not a prefill chunk."""
    return w.end - w.start == 1 and w.start >= len(w.seq.prompt_ids)


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """One request's outputs of one step (several tokens of a speculative step) as one output."""
    last = outs[-1]
    return RequestOutput(last.request_id, [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs),
                         last.finished, last.finish_reason, [lp for o in outs for lp in o.logprobs])


def _held_back(text: str, stops: list[str]) -> int:
    """Characters at the end of `text` to hold back: an incomplete UTF-8 character (decoded as U+FFFD), and a prefix
    of a stop string before it (the incomplete character may be the stop string's next one: "q" then the first
    byte of "җ" must not stream the "q" when the stop string is "qҗ")."""
    tail = 1 if text.endswith("\ufffd") else 0
    body = text[:len(text) - tail]
    n = tail
    for s in stops:
        for k in range(min(len(s) - 1, len(body)), 0, -1):
            if body.endswith(s[:k]):
                n = max(n, k + tail)
                break
    return n


def _score_entries(targets: list[int], scored) -> list[dict]:
    """The runner's (logprobs, top-k values, top-k ids) for `targets` as logprob entries, read back at once."""
    lp, top_v, top_i = (t.tolist() for t in scored)
    return [{"token": t, "logprob": v, "top": list(zip(ids, vals))}
            for t, v, vals, ids in zip(targets, lp, top_v, top_i)]


def _rows_of(logits: dict[str, tuple[torch.Tensor, int]], due: list) -> torch.Tensor:
    """The due requests' logits as one [N, V] tensor: a view of the forward's output when they are its rows
    in order (a batch of decode steps), else the rows stacked."""
    picked = [logits[s.request_id] for s in due]
    out, first = picked[0]
    if all(t is out and i == first + k for k, (t, i) in enumerate(picked)):
        return out[first:first + len(picked)]
    return torch.stack([t[i] for t, i in picked])
