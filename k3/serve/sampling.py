"""Next-token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # return this many top alternatives per token
    # Score the prompt too: per prompt token (after the first) its logprob and this many top alternatives,
    # computed in the forwards that prefill it. Such a request never takes prefix-cache hits.
    prompt_logprobs: int | None = None
    # A grammar over the output (e.g. k3.serve.chat_constrain.ToolCallConstraint): `mask(logits [V])` returns the
    # logits with the tokens it forbids at -inf, `advance(token)` takes each sampled token. Used by `sample_batch`
    # (the engine's plain decode steps), so a constrained request must not be speculated.
    constraint: object | None = None

    def validate(self) -> None:
        plp = self.prompt_logprobs
        if plp is not None and (not isinstance(plp, int) or plp < 0):
            raise ValueError(f"prompt_logprobs must be None or a non-negative integer, got {self.prompt_logprobs!r}")
        # 0 new tokens only makes sense when the prompt itself is scored.
        least = 0 if self.prompt_logprobs is not None else 1
        if not isinstance(self.max_tokens, int) or self.max_tokens < least:
            raise ValueError(f"max_tokens must be a positive integer (0 only with prompt_logprobs), got "
                             f"{self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must lie in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p!r}")


def probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from: logits [N, V] -> probabilities [N, V] fp32 after temperature, top-k and
    top-p (speculative sampling compares the target's and the draft's). Not for greedy params (temperature 0)."""
    logits = logits.float() / p.temperature
    if p.top_k > 0 and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sp = torch.softmax(sorted_logits, -1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = sp.cumsum(-1) - sp >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, -1)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> token ids [N]. Greedy when temperature == 0."""
    if p.temperature == 0:
        return logits.float().argmax(-1)
    return torch.multinomial(probs(logits, p), 1, generator=generator).squeeze(-1)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of logits [N, V], row i with params[i] and generators[i], read back to the host once.
    Greedy rows share one argmax (taken over all rows); each sampled row draws from its own generator, so a
    request's tokens do not depend on which other requests share its step. Equal to calling `sample` row by row.
    A row whose params have a constraint samples from its masked logits (a copy: the caller's logits stay as they
    are, for logprobs), and the constraint then takes the token."""
    constrained = [i for i, p in enumerate(params) if p.constraint is not None]
    if constrained:
        logits = logits.clone()
        for i in constrained:
            logits[i] = params[i].constraint.mask(logits[i])
    out = logits.float().argmax(-1)  # the greedy rows' tokens (one kernel for all rows)
    for i, p in enumerate(params):
        if p.temperature != 0:
            out[i] = sample(logits[i:i + 1], p, generators[i])[0]
    toks = out.tolist()
    for i in constrained:
        params[i].constraint.advance(toks[i])
    return toks
