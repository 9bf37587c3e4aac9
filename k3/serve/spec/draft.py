"""Draft models for speculative decoding: the interface the engine calls, and the MTP draft.

A draft proposes k tokens for each running request it is asked about (k3.serve.spec.accept decides which the
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

`Eagle3Draft` is the same procedure with a fine-tuned draft layer (k3.model.eagle3.Eagle3Layer): its first step
reads, in place of the target's hidden state, the fusion W_E3 [h_a; h_b; h] of the outputs of two AttnRes blocks
and the hidden state. A draft that reads block features names them in its `features` attribute (AttnRes block
numbers; MTPDraft's is empty); the engine then asks the runner for them and `observe` receives, per position, those
blocks' outputs and the hidden state concatenated ([n, (k + 1) D]).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from k3.model.cache import MLACache
from k3.serve.sampling import SamplingParams, probs
from k3.serve.sequence import Sequence


@dataclass
class Proposal:
    """k draft tokens for one request and the distributions they were drawn from ([k, V] fp32), or None when they
    were chosen deterministically (greedy drafts: q is one-hot)."""
    tokens: list[int]
    q: Tensor | None = None


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


@dataclass
class _Context:
    cache: MLACache = field(default_factory=MLACache)  # the MTP block's latent rows of committed positions
    next_pos: int | None = None  # the first position not yet observed
    pending_start: int | None = None  # target hidden states observed but not yet run through the MTP layer
    pending: list[Tensor] = field(default_factory=list)


class MTPDraft:
    features: tuple[int, ...] = ()

    def __init__(self, model, window: int = 4096):
        if not len(model.mtp):
            raise ValueError("speculative='mtp' needs a model with an MTP layer (num_nextn_predict_layers >= 1), "
                             "this one has none")
        if window < 1:
            raise ValueError(f"window={window} must be positive")
        self.model, self.layer, self.window = model, model.mtp[0], window
        self._ctx: dict[str, _Context] = {}

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
    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [self._propose_one(s, k) for s, k in zip(seqs, ks)]

    def _propose_one(self, seq: Sequence, k: int) -> Proposal:
        ctx = self._ctx.get(seq.request_id)
        C = seq.num_computed
        if ctx is None or not ctx.pending or ctx.next_pos != C:
            # nothing observed up to the last committed position (cannot happen in the engine's order): any tokens
            # are valid drafts, they are only unlikely to be accepted
            return Proposal([seq.token_range(C, C + 1)[0]] * k)
        hidden = torch.cat(ctx.pending)[-self.window:]
        first = C - hidden.shape[0]  # MTP position t reads the target's hidden at t and token t + 1
        ctx.pending, ctx.pending_start = [], None
        emb = self.model.model.embed_tokens
        dev = hidden.device
        nxt = torch.tensor([seq.token_range(first + 1, C + 1)], device=dev)
        h = self._step(hidden[None], emb(nxt), True, ctx.cache)
        ctx.cache.keep_last(self.window)
        committed = ctx.cache.length
        h = h[:, -1:]
        tokens, qs = [], []
        for i in range(k):
            tok, q = _choose(self.model.head(h)[0, -1], seq.params, seq.generator)
            tokens.append(tok)
            qs.append(q)
            if i + 1 < k:
                h = self._step(h, emb(torch.tensor([[tok]], device=dev)), False, ctx.cache)
        ctx.cache.truncate(committed)  # the guesses' rows are not context
        return Proposal(tokens, None if qs[0] is None else torch.stack(qs))

    def _step(self, hidden: Tensor, embeds: Tensor, first: bool, cache: MLACache) -> Tensor:
        """One drafting step: the layer's output [1, T, D] from its input (the target's at the first step, else the
        previous output) and the next tokens' embeddings."""
        return self.layer(hidden, embeds, cache=cache)[0]


class Eagle3Draft(MTPDraft):
    """MTPDraft with an EAGLE-3 draft layer (k3.model.eagle3.Eagle3Layer, e.g. k3.draft_checkpoint.load_draft):
    observed positions carry the target's block features, which the first step fuses."""

    def __init__(self, model, layer, window: int = 4096):
        if window < 1:
            raise ValueError(f"window={window} must be positive")
        if layer.config.hidden_size != model.config.hidden_size:
            raise ValueError(f"the draft's hidden size {layer.config.hidden_size} is not the target's "
                             f"{model.config.hidden_size}")
        self.model, self.layer, self.window = model, layer.eval(), window
        self.features = tuple(layer.blocks)
        self._ctx: dict[str, _Context] = {}

    def _step(self, hidden: Tensor, embeds: Tensor, first: bool, cache: MLACache) -> Tensor:
        return self.layer(hidden, embeds, fused=first, cache=cache)


def _choose(logits: Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, Tensor | None]:
    """A draft token from logits [V]: the argmax for a greedy request, else a draw from the same temperature, top-k
    and top-p the target uses, with its distribution."""
    if params.temperature == 0:
        return int(logits.argmax()), None
    q = probs(logits[None], params)[0]
    return int(torch.multinomial(q, 1, generator=generator)), q
