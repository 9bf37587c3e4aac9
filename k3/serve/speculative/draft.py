"""Draft models for speculative decoding: the interface the engine calls, and the MTP draft.

A draft proposes k tokens for each running request it is asked about (k3.serve.speculative.accept decides which the
target keeps). The engine tells it what the target computed: `observe` hands it the target's output-site hidden
states of committed positions (prefill chunks, decode steps, the accepted prefix of a verification), `forget` drops
a request (finished, aborted or preempted: a preempted request is recomputed and observed again). A draft never
sees rejected positions, and nothing it does changes what the target outputs, only how many tokens are accepted.

`MTPDraft` runs the model's own multi-token-prediction layer (report §4.1.4) autoregressively for k steps: the
layer maps (the target's hidden state at t, the embedding of token t + 1) to a hidden state that the shared head
reads as token t + 2; its next step takes its own output in place of the target's hidden state. The layer's Gated
MLA block keeps its latent rows of committed positions per request (up to `window` of them, the most recent: the
attention has no positional encoding, so a bounded window is still a valid context); rows of the draft's own
guesses are dropped after each proposal. Positions served from the prefix cache were never computed here, so they
are absent from that context (lower acceptance, same output).

Greedy proposals chain on the device (each argmax feeds the next step's embedding; one read-back per proposal). With
`chain_graphs` (the engine's, where its decode steps are captured) they run on static buffers (`_Chains`: per bucket
of requests, powers of 2 up to 64, and of context length, powers of 2 from 64, the contexts copied in before each
run; the attention reads no length back) captured as one CUDA graph per bucket, or uncaptured ("eager", the tests on
CPU). In the steady state, when every request has at most k + 1 newly observed positions (the accepted drafts and the
bonus token) and its context stays within the window, the whole proposal is one graph: the first step over those
positions right-padded to k + 1 (each row's count on the device), then the k heads and k - 1 steps; the new context
rows are copied back to the requests afterwards. Otherwise (a prompt just prefilled, positions decoded plainly) the
first step runs eagerly and the rest on a graph. Sampled proposals, the RoPE ablation, larger batches and longer
contexts draft eagerly as before; a capture that fails says so once and drafts eagerly from then on.

`Eagle3Draft` is the same procedure with a fine-tuned draft layer (k3.model.eagle3.Eagle3Layer): its first step
reads, in place of the target's hidden state, the fusion W_E3 [h_a; h_b; h] of the outputs of two AttnRes blocks
and the hidden state (a whole-proposal chain's first-step buffers are that wide). Its greedy proposals run on the
same chains. A draft that reads block features names them in its `features` attribute (AttnRes block
numbers; MTPDraft's is empty); the engine then asks the runner for them and `observe` receives, per position, those
blocks' outputs and the hidden state concatenated ([n, (k + 1) D]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from k3.model.cache import MLACache
from k3.ops.mla_append import mla_append_any
from k3.ops.mla_decode import default_num_splits
from k3.ops.registry import notice
from k3.serve.sampling import SamplingParams, sample_rows
from k3.serve.sequence import Sequence
from k3.tensors import to_device_async


@dataclass
class Proposal:
    """k draft tokens for one request and the distributions they were drawn from ([k, V] fp32), or None when they
    were chosen deterministically (greedy drafts: q is one-hot). `on_device` (a proposal asked for with
    ``on_device=True``: greedy drafts on a captured chain): the tokens [k] on the device, not read back; `tokens` is
    None until the verification's read-back fills it in (`SpeculativeDecoder`), so drafting never waits for the
    device. `ahead`: drafted before the previous verification's acceptance was read back (MTPDraft.propose_ahead)."""
    tokens: list[int] | None
    q: Tensor | None = None
    on_device: Tensor | None = None
    ahead: bool = False

    def __len__(self) -> int:
        return len(self.tokens) if self.tokens is not None else self.on_device.shape[0]


class Draft(Protocol):
    # AttnRes blocks whose outputs `observe` receives before the hidden state (optional: a draft without the
    # attribute reads the hidden state alone)
    features: tuple[int, ...]

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """ks[i] tokens to follow seqs[i]'s tokens (its last one sampled but not yet run through the target)."""

    def observe(self, seq: Sequence, start: int, hidden: Tensor) -> None:
        """The target's hidden states [n, D] of seq's committed positions start .. start + n - 1 (with `features`:
        those blocks' outputs and the hidden states concatenated, [n, (k + 1) D])."""

    def forget(self, seq: Sequence) -> None:
        """Drop what is kept for seq."""

    # Optional, as MTPDraft offers them: `warm_up()`, run by LLMEngine.warm_up on a GPU (the draft's kernels tuned
    # before a request waits for them); `chains` (not None: captured greedy chains) with `propose(seqs, ks,
    # on_device=True)`, whose greedy proposals may leave their tokens on the device (Proposal.on_device) for the
    # verification to read back with its targets (SpeculativeDecoder.device_drafts). A draft without them drafts
    # on the host and is not warmed up.


@dataclass
class _Context:
    # the MTP block's latent rows of committed positions; the first step over a fresh context runs the absorbed form
    # like every later one (the prefill form's kernel would compile for each new count of observed positions)
    cache: MLACache = field(default_factory=lambda: MLACache(prefill_form=False))
    next_pos: int | None = None  # the first position not yet observed
    pending_start: int | None = None  # target hidden states observed but not yet run through the MTP layer
    pending: list[Tensor] = field(default_factory=list)


class MTPDraft:
    features: tuple[int, ...] = ()

    def __init__(self, model, window: int = 4096, chain_graphs: bool | str = False):
        if not len(model.mtp):
            raise ValueError("speculative='mtp' needs a model with an MTP layer (num_nextn_predict_layers >= 1), "
                             "this one has none")
        if window < 1:
            raise ValueError(f"window={window} must be positive")
        self.model, self.layer, self.window = model, model.mtp[0], window
        self._ctx: dict[str, _Context] = {}
        self.chains = _chains(self, chain_graphs)

    def observe(self, seq: Sequence, start: int, hidden: Tensor) -> None:
        ctx = self._ctx.get(seq.request_id)
        if ctx is None or ctx.next_pos != start:  # a gap (a prefix-cache hit): a fresh context from here
            ctx = self._ctx[seq.request_id] = _Context(next_pos=start)
        if ctx.pending_start is None:
            ctx.pending_start = start
        ctx.pending.append(hidden)
        ctx.next_pos = start + hidden.shape[0]

    def forget(self, seq: Sequence) -> None:
        self._ctx.pop(seq.request_id, None)

    @torch.no_grad()
    def warm_up(self, longest: int | None = None) -> list[int]:
        """Run the first drafting step once at every power-of-two count of observed positions up to the bucket of
        `longest` (default: the window, the most a first step runs), on a scratch context that is dropped; returns
        the counts run. The first step over what plain steps committed (a prompt just prefilled, a switch back to
        speculation) runs eagerly over a count that varies, and on a GPU some of its kernels are autotuned per log2
        bucket of tokens: without this the first proposal at each new bucket waits for the tuning (~1 s each)."""
        longest = min(longest or self.window, self.window)
        p = next(self.layer.parameters())
        g = torch.Generator(device=p.device).manual_seed(0)  # not the global generator a sampler may rely on
        emb, vocab = self.model.model.embed_tokens, self.model.config.vocab_size
        counts = [1 << j for j in range((longest - 1).bit_length() + 1)]
        for n in counts:
            hidden = torch.randn(1, n, self._first_width(), generator=g, device=p.device, dtype=p.dtype)
            ids = torch.randint(vocab, (1, n), generator=g, device=p.device)
            self._step(hidden, emb(ids), True, MLACache(prefill_form=False))
        return counts

    def first_tokens(self) -> int:
        """The most positions one batched first drafting step runs at once (rows times the longest row's count): the
        largest count `warm_up` runs (on a GPU some of the layer's kernels are tuned per log2 bucket of tokens, so a
        first step past it would wait for a tuning: at batch 64 after 128-token prompts, 451 ms inside a timed
        generation on an H100); a batch with more runs its first step in groups of rows within it."""
        return 1 << (self.window - 1).bit_length()

    def _first_step(self, prep: list, n: list[int]) -> list[Tensor]:
        """One first drafting step of the requests of `prep` (`_first_inputs` each; n[r] observed positions),
        right-padded to the longest against their own contexts: their new rows appended to those contexts (kept to
        the last `window`); returns each row's output at its last observed position ([1, D] each)."""
        emb = self.model.model.embed_tokens
        N, first = max(n), prep[0][1]
        hid = first.new_zeros(len(prep), N, first.shape[-1])
        ids = torch.zeros(len(prep), N, dtype=torch.long)
        for r, p in enumerate(prep):  # right-padded: a row's padding positions come after its own
            ids[r, :n[r]] = p[2]
        torch._foreach_copy_([hid[r, :n[r]] for r in range(len(prep))], [p[1] for p in prep])
        ids = to_device_async(ids, first.device)
        cache = _RaggedCache([p[0].cache for p in prep], N)
        h = self._step(hid, emb(ids), True, cache)
        # the committed positions' rows join each request's own context (copied in, one multi-tensor copy); row r's
        # new positions start at its context's length in the ragged rows
        contexts = [p[0].cache for p in prep]
        MLACache.append_each(contexts, [(cache.c[r:r + 1, cc.length:cc.length + n[r]],
                                         cache.k_rope[r:r + 1, cc.length:cc.length + n[r]])
                                        for r, cc in enumerate(contexts)])
        for cc in contexts:
            cc.keep_last(self.window)
        at = to_device_async(torch.tensor(n) - 1, h.device)
        return list(h[torch.arange(len(prep), device=h.device), at].split(1))

    def _first_width(self) -> int:
        """The width of an observed position's input to the first step (the target's hidden state)."""
        return self.model.config.hidden_size

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], ks: list[int], on_device: bool = False) -> list[Proposal]:
        """Every drafting step of all requests as one batched forward: the first runs each request's newly observed
        positions (a different number each, right-padded), the later ones one new position per request, each
        against its own context (rows of different lengths, `_RaggedCache`). Equal to `propose_sequential`, which
        a single request takes (its context grows in place, nothing is copied). `on_device`: a whole proposal on
        one captured chain leaves its tokens on the device (`Proposal.on_device`; the others are read back)."""
        ahead = self.chains.pop_ahead() if self.chains is not None else None  # good for this proposal only
        if self.chains is not None and seqs and all(s.params.temperature == 0 for s in seqs):
            got = ahead.take(self, seqs, ks, on_device) if ahead is not None else {}
            if got:  # drafted ahead where it holds, the other requests' proposals drafted now
                rest = [i for i in range(len(seqs)) if i not in got]
                if rest:
                    got.update(zip(rest, self.propose([seqs[i] for i in rest], [ks[i] for i in rest], on_device)))
                return [got[i] for i in range(len(seqs))]
            out = self.chains.propose(seqs, ks, on_device)  # the whole proposal on one captured graph, where it fits
            if out is not None:
                return out
        if len(seqs) == 1:
            return [self._propose_one(seqs[0], ks[0])]
        prep = [self._first_inputs(s) for s in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        qs: list[list[Tensor | None]] = [[] for _ in seqs]
        rows = [i for i, p in enumerate(prep) if p is not None]
        if rows:
            emb = self.model.model.embed_tokens
            n = [prep[i][1].shape[0] for i in rows]
            K = max(ks[i] for i in rows)
            last = []  # each row's output at its last observed position [1, D]
            for group in _first_groups(n, self.first_tokens()):
                last += self._first_step([prep[rows[r]] for r in group], [n[r] for r in group])
            contexts = [prep[i][0].cache for i in rows]
            # the guesses run against the contexts as now kept (the last `window` rows each)
            cache = _RaggedCache(contexts, K - 1) if K > 1 else None
            h = torch.cat(last)[:, None]
            if all(seqs[i].params.temperature == 0 for i in rows):  # greedy: chained on the device, one read-back
                chosen = self._chain(h, K, contexts, cache).tolist()
                for r, i in enumerate(rows):
                    tokens[i], qs[i] = chosen[r][:ks[i]], [None]
            else:
                for j in range(K):
                    logits = self.model.head(h)[:, -1]
                    # a request with fewer drafts draws nothing more: its generator is untouched
                    act = [r for r, i in enumerate(rows) if j < ks[i]]
                    toks, q = _choose(logits if len(act) == len(rows) else logits[act],
                                      [seqs[rows[r]].params for r in act], [seqs[rows[r]].generator for r in act])
                    for r, tok, qr in zip(act, toks, q):
                        tokens[rows[r]].append(tok)
                        qs[rows[r]].append(qr)
                    if j + 1 < K:
                        nxt = torch.tensor([[tokens[i][-1]] for i in rows], device=h.device)
                        h = self._step(h, emb(nxt), False, cache)
        out = []
        for i, (s, k) in enumerate(zip(seqs, ks)):
            if prep[i] is None:
                out.append(Proposal([s.token_range(s.num_computed, s.num_computed + 1)[0]] * k))
            else:
                out.append(Proposal(tokens[i], None if qs[i][0] is None else torch.stack(qs[i])))
        return out

    @torch.no_grad()
    def propose_ahead(self, seqs: list[Sequence], starts: list[int], k: int, hidden: Tensor, targets: Tensor) -> bool:
        """The next greedy proposal of k drafts for `seqs`, drafted now on a captured chain as if each request's
        verification from position starts[i] accepted all its k drafts: its first step over those k + 1 positions
        (hidden [R, k + 1, width], the verification's hidden states; targets [R, k + 1], its greedy tokens on the
        device), nothing read back. The next `propose` takes it for the requests that then observed exactly those
        positions (every draft accepted) where nothing ran on the chains in between, and drafts the others as
        always; any later proposal drops it.
        Returns whether it ran (False: no chains, or the batch does not fit one)."""
        return self.chains is not None and self.chains.ahead(seqs, starts, k, hidden, targets)

    @torch.no_grad()
    def propose_sequential(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """The reference of `propose`: one request at a time, its steps one after another."""
        return [self._propose_one(s, k) for s, k in zip(seqs, ks)]

    def _first_inputs(self, seq: Sequence) -> tuple[_Context, Tensor, Tensor] | None:
        """What the first drafting step of seq runs: (its context, the observed hidden states not yet run through
        the layer [n, width] (the last `window`), the next tokens [n] on the host), taken from the pending ones;
        None when nothing is observed up to the last committed position (cannot happen in the engine's order: any
        tokens are then valid drafts, only unlikely to be accepted)."""
        ctx = self._ctx.get(seq.request_id)
        C = seq.num_computed
        if ctx is None or not ctx.pending or ctx.next_pos != C:
            return None
        # one observation (the steady state: a verification's accepted positions) is taken as it is, no copy
        hidden = (ctx.pending[0] if len(ctx.pending) == 1 else torch.cat(ctx.pending))[-self.window:]
        first = C - hidden.shape[0]  # MTP position t reads the target's hidden at t and token t + 1
        ctx.pending, ctx.pending_start = [], None
        return ctx, hidden, torch.tensor(seq.token_range(first + 1, C + 1), dtype=torch.long)

    def _pending(self, seq: Sequence) -> tuple[_Context, int] | None:
        """(seq's context, how many observed positions its first drafting step would run), without taking them;
        None where `_first_inputs` gives None."""
        ctx = self._ctx.get(seq.request_id)
        if ctx is None or not ctx.pending or ctx.next_pos != seq.num_computed:
            return None
        return ctx, min(self.window, sum(h.shape[0] for h in ctx.pending))

    def _first(self, seq: Sequence) -> tuple[Tensor, MLACache] | None:
        """The first drafting step of seq alone: its observed positions run through the layer, their rows appended
        to its context; returns (the output at the last position [1, 1, D], the context), or None (`_first_inputs`)."""
        p = self._first_inputs(seq)
        if p is None:
            return None
        ctx, hidden, nxt = p
        nxt = to_device_async(nxt, hidden.device)
        h = self._step(hidden[None], self.model.model.embed_tokens(nxt[None]), True, ctx.cache)
        ctx.cache.keep_last(self.window)
        return h[:, -1:], ctx.cache

    def _propose_one(self, seq: Sequence, k: int) -> Proposal:
        f = self._first(seq)
        if f is None:
            return Proposal([seq.token_range(seq.num_computed, seq.num_computed + 1)[0]] * k)
        h, cache = f
        committed = cache.length
        if seq.params.temperature == 0:  # greedy: chained on the device, one read-back
            tokens = self._chain(h, k, [cache], cache)[0].tolist()
            cache.truncate(committed)
            return Proposal(tokens)
        emb = self.model.model.embed_tokens
        tokens, qs = [], []
        for i in range(k):
            (tok,), (q,) = _choose(self.model.head(h)[0, -1:], [seq.params], [seq.generator])
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                h = self._step(h, emb(torch.tensor([[tok]], device=h.device)), False, cache)
        cache.truncate(committed)  # the guesses' rows are not context
        return Proposal(tokens, None if qs[0] is None else torch.stack(qs))

    def _chain(self, h: Tensor, k: int, contexts: list[MLACache], cache) -> Tensor:
        """`_greedy_chain` from h [R, 1, D] after the contexts: on the captured chain of R's bucket where there is
        one (`chains`), else eagerly against `cache`."""
        if self.chains is not None and k > 1:
            out = self.chains.run(h, k, contexts)
            if out is not None:
                return out
        return self._greedy_chain(h, k, cache)

    def _greedy_chain(self, h: Tensor, k: int, cache, queries: Tensor | None = None) -> Tensor:
        """k greedy drafting steps of every row from the last outputs h [R, 1, D]: each step's argmax token feeds the
        next step's embedding on the device, with no read-back between steps (the host reads the [R, k] tokens
        once). The same tokens as choosing each on the host. `queries`: the layer's site queries (`site_queries`),
        computed here once for all the steps when None."""
        emb = self.model.model.embed_tokens
        if queries is None and k > 1:
            queries = self.site_queries()
        out = []
        for j in range(k):
            tok = self.model.head(h)[:, -1].argmax(-1)  # [R]
            out.append(tok)
            if j + 1 < k:
                h = self._step(h, emb(tok[:, None]), False, cache, queries)
        return torch.stack(out, 1)

    def attention(self):
        """The draft layer's attention (Gated MLA): its latent rows are the contexts."""
        return self.layer.block.self_attn

    def site_queries(self) -> Tensor | None:
        """The draft layer's AttnRes site queries in one pass (k3.model.mtp.MTPLayer.site_queries): what the steps of
        one chain share, computed once for all of them."""
        return self.layer.site_queries()

    def _step(self, hidden: Tensor, embeds: Tensor, first: bool, cache: MLACache,
              queries: Tensor | None = None) -> Tensor:
        """One drafting step: the layer's output [1, T, D] from its input (the target's at the first step, else the
        previous output) and the next tokens' embeddings. `queries`: `site_queries()`, computed already (else the
        layer computes them)."""
        return self.layer(hidden, embeds, cache=cache, queries=queries)[0]


class Eagle3Draft(MTPDraft):
    """MTPDraft with an EAGLE-3 draft layer (k3.model.eagle3.Eagle3Layer, e.g. k3.draft_checkpoint.load_draft):
    observed positions carry the target's block features, which the first step fuses."""

    def __init__(self, model, layer, window: int = 4096, chain_graphs: bool | str = False):
        if window < 1:
            raise ValueError(f"window={window} must be positive")
        if layer.config.hidden_size != model.config.hidden_size:
            raise ValueError(f"the draft's hidden size {layer.config.hidden_size} is not the target's "
                             f"{model.config.hidden_size}")
        self.model, self.layer, self.window = model, layer.eval(), window
        self.features = tuple(layer.blocks)
        self._ctx: dict[str, _Context] = {}
        self.chains = _chains(self, chain_graphs)

    def attention(self):
        return self.layer.mtp.block.self_attn

    def _first_width(self) -> int:
        return self.layer.feature_width  # the fused blocks' outputs and the hidden state

    def site_queries(self) -> Tensor | None:
        return self.layer.mtp.site_queries()

    def _step(self, hidden: Tensor, embeds: Tensor, first: bool, cache: MLACache,
              queries: Tensor | None = None) -> Tensor:
        return self.layer(hidden, embeds, fused=first, cache=cache, queries=queries)


class _RaggedCache:
    """The draft's steps for a batch of requests, each after its own committed context (k3.model.cache.MLACache of
    different lengths): the contexts copied into rows padded to the longest plus room for `extra` positions;
    attention reads each row up to its own length. A step may add several positions per row (the first step's
    newly observed ones, right-padded: a row's padding lies after its own positions, which never see it). The
    requests' own contexts are not touched here (the proposal copies committed rows back; guesses are never
    context)."""

    check = True  # the attention checks the lengths (a read-back); the static form's are valid by construction

    def __init__(self, caches: list[MLACache], extra: int):
        self.caches, self.extra = caches, extra
        self.c: Tensor | None = None
        self.k_rope: Tensor | None = None
        self.lengths: Tensor | None = None
        self._rows: Tensor | None = None

    def _allocate(self, c: Tensor, k_rope: Tensor) -> None:
        lens = [cc.length for cc in self.caches]
        B, L = len(self.caches), max(lens) + self.extra
        self.c = c.new_zeros(B, L, c.shape[-1])
        self.k_rope = k_rope.new_zeros(B, L, k_rope.shape[-1])
        for i, cc in enumerate(self.caches):
            if lens[i]:
                self.c[i, :lens[i]] = cc.c[0]
                self.k_rope[i, :lens[i]] = cc.k_rope[0]
        self.lengths = torch.tensor(lens, device=c.device)
        self._rows = torch.arange(B, device=c.device)

    def token_positions(self, c: Tensor) -> Tensor:
        """Each row's new positions after its context (the RoPE ablation; the contexts' dropped rows counted)."""
        lengths = [cc.length for cc in self.caches] if self.lengths is None else self.lengths
        start = torch.tensor([cc.start for cc in self.caches], device=c.device)
        return (start + torch.as_tensor(lengths, device=c.device))[:, None] + torch.arange(c.shape[1], device=c.device)

    def attend(self, attn, q: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
        if self.c is None:
            self._allocate(c, k_rope)
        T = q.shape[1]
        pos = self.lengths[:, None] + torch.arange(T, device=c.device)  # [B, T]
        rows = self._rows[:, None].expand(-1, T)
        self.c[rows, pos] = c
        self.k_rope[rows, pos] = k_rope
        start = self.lengths
        self.lengths = self.lengths + T
        return attn.absorbed(q, self.c, self.k_rope, q_start=start, kv_len=self.lengths, check=self.check)


class _StaticRaggedCache(_RaggedCache):
    """`_RaggedCache` over buffers of a fixed shape (one tensor kv [Rb, Lb, R + dr] whose views are c [Rb, Lb, R] and
    k_rope [Rb, Lb, dr], lengths [Rb]): the static inputs of a captured chain. `copy_in` copies the contexts in and the
    chain sets their lengths `filled` (before a replay; rows past them get length 0 and compute on zeros); `start`
    begins a chain (inside the graph: each attend advances a copy of the lengths), and the attention runs without
    reading the lengths back (they are valid by construction). NoPE layers only: the RoPE ablation's positions come
    from the host.

    Where the layer's decode attention runs on the paged kernel (`LatentAttention.paged_kernel_used`: on a GPU with
    the fast backends, as the engine's captured decode steps), the buffers are its page pool: row b is one page of
    Lb tokens, and query t of row b (at position lengths[b] + t) reads its first lengths[b] + t + 1 tokens, so a
    drafting step's attention is the decode steps' few launches (the rows written and the lengths made by op
    mla_append, the paged kernel, the value absorption) instead of the absorbed form's ~25 (masks, fp32 copies of
    the buffers and of w_kc/w_vc, einsums, softmax) and the indexed writes' ~5. `steps`: the query counts T a step
    may have (the tables of its query rows, [Rb * T, 1], made here, before any capture)."""

    check = False  # the buffers' lengths are valid by construction: nothing read back

    def __init__(self, rows: int, length: int, like_c: Tensor, like_kr: Tensor,
                 shared: "_StaticRaggedCache | None" = None, steps: tuple[int, ...] = (1,),
                 filled: Tensor | None = None):
        super().__init__([], 0)
        dev = like_c.device
        if shared is not None:  # another chain's buffers of the same shape (replays never overlap)
            self.kv, self.c, self.k_rope, self._rows = shared.kv, shared.c, shared.k_rope, shared._rows
        else:
            R = like_c.shape[-1]
            self.kv = like_c.new_zeros(rows, length, R + like_kr.shape[-1])
            self.c, self.k_rope = self.kv[..., :R], self.kv[..., R:]
            self._rows = torch.arange(rows, device=dev)
        # the contexts' lengths [rows] (device): `filled`, a view of the chain's input buffer, or a tensor of its own
        self.filled = filled if filled is not None else torch.zeros(rows, dtype=torch.long, device=dev)
        self._tables = {t: self._rows.repeat_interleave(t)[:, None] for t in set(steps)}
        self._splits: dict[tuple[int, int], int] = {}  # (query rows, heads) -> the paged kernel's fixed split count

    def attend(self, attn, q: Tensor, c: Tensor, k_rope: Tensor) -> Tensor:
        return self.attend_gated(attn, q, c, k_rope, None)

    def attend_gated(self, attn, q: Tensor, c: Tensor, k_rope: Tensor, gate: Tensor | None) -> Tensor:
        """`attend` with the output gate (k3.model.cache.MLALayerCache; None: ungated): inside the paged decode's
        last kernel where the chain attends through it."""
        T = q.shape[1]
        if T not in self._tables or not attn.paged_kernel_used():
            o = super().attend(attn, q, c, k_rope)
            return o if gate is None else attn.gated(gate, o)
        # the new rows written at each row's length, and query t of row b's length (its own position + 1: causal),
        # as the decode steps write theirs (op mla_append: one kernel where the registry picks it)
        seen = mla_append_any(self.kv, self._tables[1], self.lengths, c, k_rope, attn.backends)
        self.lengths = self.lengths + T
        key = (seen.numel(), q.shape[2])
        if key not in self._splits:  # fixed per shape (from the buffer's length), as a captured step needs
            self._splits[key] = default_num_splits(key[0], key[1], self.kv.shape[1], self.kv.device)
        return attn.paged(q, self.kv, self._tables[T], seen, self._splits[key], gate=gate)

    def copy_in(self, caches: list[MLACache]) -> list[int]:
        """The contexts' rows copied into the buffers (row i from caches[i]); returns their lengths, for `filled`
        (which the caller sets: the chain, with its other inputs in one transfer)."""
        lens = [cc.length for cc in caches]
        held = [i for i, n in enumerate(lens) if n]
        if held:  # one multi-tensor copy (a launch or two on CUDA), not two per request
            torch._foreach_copy_([self.c[i, :lens[i]] for i in held] + [self.k_rope[i, :lens[i]] for i in held],
                                 [caches[i].c[0] for i in held] + [caches[i].k_rope[0] for i in held])
        return lens

    def start(self) -> None:
        self.lengths = self.filled.clone()

    def commit(self, counts: Tensor) -> None:
        """After a first step of right-padded positions: each row's context is its filled rows and its first
        `counts` new ones (the padding rows after them are overwritten by the next steps, and never seen)."""
        self.lengths = self.filled + counts

    def token_positions(self, c: Tensor) -> Tensor:
        raise RuntimeError("a captured draft chain runs NoPE MLA layers only (the RoPE ablation drafts eagerly)")


class _Chain:
    """The k greedy drafting steps of up to `rows` requests with contexts of up to `length` - (k - 1) rows, on static
    buffers: h [rows, 1, D] in, tokens [rows, k] out. `eager`: run the same code on the buffers uncaptured (any
    device: the tests); else captured as one CUDA graph after two warm-up runs on a side stream."""

    def __init__(self, draft: "MTPDraft", rows: int, length: int, k: int, like_h: Tensor, like_c: Tensor,
                 like_kr: Tensor, eager: bool, pool=None, first: int = 0, shared: _StaticRaggedCache | None = None,
                 owner: "_Chains | None" = None):
        self.draft, self.rows, self.length, self.k, self.first = draft, rows, length, k, first
        self.owner = owner  # its _Chains, told of every run (which overwrites the buffers it shares)
        # first > 0: the chain begins with the first drafting step over up to `first` observed positions per row
        # (hidden states h [rows, first, D] and next tokens ids [rows, first], right-padded, counts [rows])
        self.h = like_h.new_zeros(rows, max(first, 1), like_h.shape[-1])
        # the next tokens [rows, first], the counts [rows] and the contexts' lengths [rows]: columns of one buffer,
        # set by one host-to-device copy per run
        self.inputs = torch.zeros(rows, first + 2, dtype=torch.long, device=like_h.device)
        self.ids, self.counts = self.inputs[:, :first], self.inputs[:, first]
        self.cache = _StaticRaggedCache(rows, length, like_c, like_kr, shared, steps=(1, first) if first else (1,),
                                        filled=self.inputs[:, first + 1])
        self.graph = None
        self.tokens: Tensor | None = None
        if not eager:
            side = torch.cuda.Stream(device=like_h.device)
            side.wait_stream(torch.cuda.current_stream(like_h.device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._body()
            torch.cuda.current_stream(like_h.device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=pool):
                self.tokens = self._body()

    def _body(self) -> Tensor:
        self.cache.start()
        h = self.h
        queries = self.draft.site_queries()  # once for every drafting step of the chain
        if self.first:
            h = self.draft._step(h, self.draft.model.model.embed_tokens(self.ids), True, self.cache, queries)
            self.cache.commit(self.counts)
            h = h[self.cache._rows, (self.counts - 1).clamp(min=0)][:, None]
        return self.draft._greedy_chain(h, self.k, self.cache, queries)

    def run_first(self, hidden: list[Tensor], ids: list[Tensor], contexts: list[MLACache]) -> Tensor:
        """The first step over each row's observed positions (hidden[i] [n_i, D], ids[i] [n_i]), then the chain:
        tokens [R, k]; the new rows of row i stay in the buffers at its context's length (`new_rows`)."""
        R = len(hidden)
        torch._foreach_copy_([self.h[i, :x.shape[0]] for i, x in enumerate(hidden)], hidden)
        host = torch.zeros(self.rows, self.first + 2, dtype=torch.long)  # the ids, the counts, the lengths
        for i, t in enumerate(ids):
            host[i, :t.shape[0]] = t
            host[i, -2] = t.shape[0]
        self._load(host, contexts)
        return self._replay(R)

    def run_ahead(self, hidden: Tensor, ids: Tensor, contexts: list[MLACache]) -> Tensor:
        """`run_first` with every row's observed positions on the device, all of one count: hidden [R, n, D], ids
        [R, n] (n <= first); nothing read back."""
        R, n = ids.shape
        self.h[:R, :n].copy_(hidden)
        host = torch.zeros(self.rows, self.first + 2, dtype=torch.long)  # the counts and the lengths
        host[:R, -2] = n
        self._load(host, contexts)
        self.ids[:R, :n].copy_(ids)
        return self._replay(R)

    def _replay(self, R: int) -> Tensor:
        """The chain over its loaded inputs (run eagerly without a graph): the first R rows' tokens [R, k]."""
        if self.owner is not None:
            self.owner.runs += 1
        if self.graph is None:
            return self._body()[:R]
        self.graph.replay()
        return self.tokens[:R].clone()

    def _load(self, host: Tensor, contexts: list[MLACache]) -> None:
        """The contexts copied into the buffers, their lengths put in the last column of `host` (the chain's inputs
        [rows, first + 2] on the host), and `host` copied to the device: one transfer, one copy."""
        host[:len(contexts), -1] = torch.tensor(self.cache.copy_in(contexts), dtype=torch.long)
        self.inputs.copy_(to_device_async(host, self.inputs.device))

    def new_rows(self, i: int, start: int, n: int) -> tuple[Tensor, Tensor]:
        """Row i's n new latent rows from `start` (its context's length before the step), as [1, n, .] views of the
        chain's buffers (MLACache.append copies them)."""
        return self.cache.c[i:i + 1, start:start + n], self.cache.k_rope[i:i + 1, start:start + n]

    def run(self, h: Tensor, contexts: list[MLACache]) -> Tensor:
        R = h.shape[0]
        self.h[:R].copy_(h)
        self._load(torch.zeros(self.rows, 2, dtype=torch.long), contexts)
        return self._replay(R)


class _Chains:
    """The draft's captured greedy chains, one per (rows bucket, context bucket, k), made on first use: rows in
    powers of 2 up to MAX_ROWS, context lengths in powers of 2 from 64 up to the draft's window + k (a context of L
    rows runs in the bucket of L + k - 1, or of L + 2k for a whole proposal). Larger batches, longer contexts and
    layers with RoPE draft eagerly.
    Memory: the chains of one (rows, length) share their context buffers (rows x length latent rows, at most
    MAX_BUFFER_ROWS); the graphs share one memory pool. Neither counts against the engine's cache budget."""

    MAX_ROWS = 64
    MAX_BUFFER_ROWS = 1 << 17  # rows x length of one chain's buffers (c in fp32 inside the attention: 256 MB at R=512)

    def __init__(self, draft: "MTPDraft", eager: bool):
        self.draft, self.eager = draft, eager
        self.made: dict[tuple[int, int, int], _Chain] = {}
        self.pool = None if eager else torch.cuda.graph_pool_handle()
        attn = draft.attention()
        self.nope = getattr(attn, "rope_theta", None) is None
        self.runs = 0  # chains run or captured: each overwrites the buffers a proposal drafted ahead left its rows in
        self._ahead: _Ahead | None = None
        # the proposal drafted ahead from which the latest proposal took every request's (None otherwise: a part
        # drafted then resets it): a verification launched ahead on its tokens is that proposal's only when it is
        self.taken: _Ahead | None = None
        self.counts = {"ahead": 0, "taken": 0}  # requests' proposals drafted ahead, and taken

    def shape(self, lengths: list[int], counts: list[int], k: int) -> tuple[int, int] | None:
        """The (rows, length) bucket of a whole proposal of k drafts (first step and chain) for contexts of
        `lengths` rows with counts[i] observed positions pending, or None where it drafts as before: more positions
        than k + 1, a context past the window, more rows than MAX_ROWS or buffers past MAX_BUFFER_ROWS."""
        if k < 1 or not self.nope or len(lengths) > self.MAX_ROWS or any(
                n > k + 1 or L + n > self.draft.window for L, n in zip(lengths, counts)):
            return None
        rows, length = self._bucket(len(lengths)), self._bucket(max(lengths) + 2 * k, 64)
        return None if rows * length > self.MAX_BUFFER_ROWS else (rows, length)

    def ahead(self, seqs: list[Sequence], starts: list[int], k: int, hidden: Tensor, targets: Tensor) -> bool:
        """MTPDraft.propose_ahead on the chain of the proposal's bucket: its tokens and the buffer rows of its first
        step kept (`_Ahead`) for the next `pop_ahead`."""
        self._ahead = None
        ctxs = [self.draft._ctx.get(s.request_id) for s in seqs]
        if any(c is None or c.cache.c is None for c in ctxs):
            return False
        contexts = [c.cache for c in ctxs]
        fit = self.shape([cc.length for cc in contexts], [k + 1] * len(seqs), k)
        chain = None if fit is None else self.get(*fit, k, hidden, contexts[0], first=k + 1)
        if chain is None:
            return False
        tokens = chain.run_ahead(hidden, targets, contexts)
        self._ahead = _Ahead(chain, tokens, self.runs, k, {
            s.request_id: (i, c, start, c.cache.length, c.cache.start, hidden[i].data_ptr())
            for i, (s, c, start) in enumerate(zip(seqs, ctxs, starts))})
        self.counts["ahead"] += len(seqs)
        return True

    @property
    def pending(self) -> "_Ahead | None":
        """The proposal drafted ahead last (`ahead`), not yet popped: its tokens [R, k] on the device."""
        return self._ahead

    def pop_ahead(self) -> "_Ahead | None":
        """The proposal drafted ahead, if nothing ran on the chains since (then forgotten here either way)."""
        a, self._ahead, self.taken = self._ahead, None, None
        return a if a is not None and a.runs == self.runs else None

    @staticmethod
    def _bucket(n: int, least: int = 1) -> int:
        return max(least, 1 << (n - 1).bit_length())

    def run(self, h: Tensor, k: int, contexts: list[MLACache]) -> Tensor | None:
        """tokens [R, k] of the captured chain, or None where this batch drafts eagerly."""
        R = h.shape[0]
        longest = max(cc.length for cc in contexts)
        if not self.nope or R > self.MAX_ROWS or not longest or any(cc.c is None for cc in contexts):
            return None
        rows, length = self._bucket(R), self._bucket(longest + k - 1, 64)
        if rows * length > self.MAX_BUFFER_ROWS or length > self._bucket(self.draft.window + k - 1, 64):
            return None
        chain = self.get(rows, length, k, h, contexts[0])
        return None if chain is None else chain.run(h, contexts)

    def get(self, rows: int, length: int, k: int, like_h: Tensor, like: MLACache, first: int = 0) -> _Chain | None:
        """The chain of that bucket, made (captured) on first use; None once a capture has failed."""
        key = (rows, length, k, first)
        if key not in self.made:
            if not self.nope:
                return None
            # chains of one (rows, length) share their context buffers (the largest part of their memory)
            shared = next((c.cache for (r, n, _, _), c in self.made.items() if (r, n) == (rows, length)), None)
            self.runs += 1  # a capture runs the chain on the shared buffers
            try:
                self.made[key] = _Chain(self.draft, rows, length, k, like_h, like.c, like.k_rope, self.eager,
                                        self.pool, first=first, shared=shared, owner=self)
            except Exception as e:  # e.g. an op that reads back from the device under capture: draft eagerly
                if self.eager:
                    raise
                notice(f"the draft's greedy steps run eagerly: capturing them failed ({type(e).__name__}: {e})")
                self.nope = False
                return None
        return self.made[key]

    def propose(self, seqs: list[Sequence], ks: list[int], on_device: bool = False) -> list[Proposal] | None:
        return _propose_on_chain(self, seqs, ks, on_device)


def _propose_on_chain(chains: "_Chains", seqs: list[Sequence], ks: list[int],
                      on_device: bool = False) -> list[Proposal] | None:
    """A whole greedy proposal (first step and chain) on one captured graph: every request has at most k + 1
    observed positions pending (the steady state: the accepted drafts and the bonus token) and a context that stays
    within the window; else None (drafted as before). `on_device`: the tokens stay on the device (rows of one
    [R, k] tensor), nothing is read back."""
    draft = chains.draft
    k = max(ks)
    peeks = [draft._pending(s) for s in seqs]
    if any(p is None or p[0].cache.c is None for p in peeks):
        return None
    fit = chains.shape([p[0].cache.length for p in peeks], [p[1] for p in peeks], k)
    if fit is None:
        return None
    rows, length = fit
    prep = [draft._first_inputs(s) for s in seqs]  # takes the pending positions
    contexts = [p[0].cache for p in prep]
    chain = chains.get(rows, length, k, prep[0][1], contexts[0], first=k + 1)
    if chain is None:  # the capture failed: the pending positions are taken, so draft eagerly from them here
        return None if not prep else _eager_from(draft, seqs, ks, prep)
    starts = [cc.length for cc in contexts]
    out = chain.run_first([p[1] for p in prep], [p[2] for p in prep], contexts)
    # the committed positions' rows back into each context: one multi-tensor copy for all of them
    MLACache.append_each(contexts, [chain.new_rows(i, starts[i], p[1].shape[0]) for i, p in enumerate(prep)])
    for cc in contexts:
        cc.keep_last(draft.window)
    if on_device:
        return [Proposal(None, on_device=out[i, :k_i]) for i, k_i in enumerate(ks)]
    tokens = out.tolist()
    return [Proposal(tokens[i][:k_i]) for i, k_i in enumerate(ks)]


class _Ahead:
    """A proposal drafted ahead (`_Chains.ahead`): the chain it ran on, its tokens [R, k] on the device, the chains'
    run count after it, and per request (row, its _Context, the verification's start, the context's length and
    start then, the data pointer of its row of hidden states)."""

    def __init__(self, chain: _Chain, tokens: Tensor, runs: int, k: int, rows: dict[str, tuple]):
        self.chain, self.tokens, self.runs, self.k, self.rows = chain, tokens, runs, k, rows

    def take(self, draft: "MTPDraft", seqs: list[Sequence], ks: list[int], on_device: bool) -> dict[int, Proposal]:
        """The proposals of the requests of `seqs` whose verification accepted every draft: {index in seqs: its
        Proposal of ks[i] <= k drafts (a greedy chain's first k_i tokens are those of a shorter chain)}. A request
        qualifies where it then observed exactly the k + 1 positions it was drafted from (its observation is that row
        of the verification's hidden states, its tokens the targets) and its context is as it was; their rows join
        their contexts and their pending positions are taken, as their proposal would; the others are not touched."""
        n = self.k + 1
        got = []
        for i, (s, k) in enumerate(zip(seqs, ks)):
            e = self.rows.get(s.request_id)
            if e is None or k > self.k:
                continue
            _, ctx, start, length, cstart, ptr = e
            if draft._ctx.get(s.request_id) is ctx and ctx.pending_start == start and len(ctx.pending) == 1 \
                    and ctx.pending[0].shape[0] == n and ctx.pending[0].data_ptr() == ptr \
                    and s.num_computed == start + n and ctx.next_pos == start + n \
                    and (ctx.cache.length, ctx.cache.start) == (length, cstart):
                got.append(i)
        if not got:
            return {}
        entries = [self.rows[seqs[i].request_id] for i in got]
        contexts = [e[1].cache for e in entries]
        MLACache.append_each(contexts, [self.chain.new_rows(e[0], e[3], n) for e in entries])
        for e in entries:
            e[1].pending, e[1].pending_start = [], None
            e[1].cache.keep_last(draft.window)
        draft.chains.counts["taken"] += len(got)
        draft.chains.taken = self
        if on_device:
            return {i: Proposal(None, on_device=self.tokens[e[0], :ks[i]], ahead=True) for i, e in zip(got, entries)}
        tokens = self.tokens.tolist()
        return {i: Proposal(tokens[e[0]][:ks[i]], ahead=True) for i, e in zip(got, entries)}


def _first_groups(n: list[int], most: int) -> list[list[int]]:
    """Consecutive groups of the rows with n[r] positions each, such that a group's rows times its longest row stay
    within `most` (a row longer than that alone in its group): the rows of each batched first drafting step."""
    groups, cur, longest = [], [], 0
    for r, m in enumerate(n):
        if cur and (len(cur) + 1) * max(longest, m) > most:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(r)
        longest = max(longest, m)
    return groups + [cur] if cur else groups


def _eager_from(draft: "MTPDraft", seqs: list[Sequence], ks: list[int], prep) -> list[Proposal]:
    """The proposal drafted eagerly from first inputs already taken (`_first_inputs`): their observed positions
    given back to their contexts as pending, then the usual path."""
    for s, (ctx, hidden, _) in zip(seqs, prep):
        ctx.pending, ctx.pending_start = [hidden], s.num_computed - hidden.shape[0]
    chains, draft.chains = draft.chains, None
    try:
        return draft.propose(seqs, ks)
    finally:
        draft.chains = chains


def _chains(draft: "MTPDraft", mode: bool | str) -> _Chains | None:
    """The draft's chains for `mode`: True (captured on CUDA; None elsewhere), "eager" (the static buffers
    uncaptured, any device), False (None: eager drafting as before)."""
    if mode not in (True, False, "eager"):
        raise ValueError(f"chain_graphs={mode!r}: True, False or 'eager'")
    if mode is False:
        return None
    if mode is True and next(draft.layer.parameters()).device.type != "cuda":
        return None
    return _Chains(draft, eager=mode == "eager")


def _choose(logits: Tensor, params: list[SamplingParams], generators: list
            ) -> tuple[list[int], list[Tensor | None]]:
    """A draft token from each row of logits [R, V]: the argmax for a greedy request, else a draw from the same
    temperature, top-k and top-p the target uses (k3.serve.sampling.sample_rows), with its distribution (None for a
    greedy row). All rows drawn together and read back once."""
    out, pr, rows = sample_rows(logits, params, generators)
    qs: list[Tensor | None] = [None] * len(params)
    for j, i in enumerate(rows):
        qs[i] = pr[j]
    return out.tolist(), qs
