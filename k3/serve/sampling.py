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
    # logits with the tokens it forbids at -inf, `advance(token)` takes each sampled token. Used by `sample_step`
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
    return probs_rows(logits, [p] * logits.shape[0])


def probs_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`probs` of each row of logits [N, V] under its own params (none greedy), all rows in one pass: the temperature
    divides each row, each row's top-k cut is the k-th value of one top-k of the largest k, each row's top-p cut one
    stable sort of all rows (the smallest prefix whose mass reaches top_p, the first token always kept)."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling params for {logits.shape[0]} rows of logits")
    if any(p.temperature == 0 for p in params):
        raise ValueError("probs is not defined for greedy params (temperature 0)")
    N, V = logits.shape
    dev = logits.device
    temps = [float(p.temperature) for p in params]
    # one temperature (the usual step): divided by it as a number (not at all by 1, which changes nothing), else by a
    # column of them (the same fp32 division)
    if len(set(temps)) > 1:
        x = logits.float() / torch.tensor(temps, device=dev)[:, None]
    else:
        x = logits.float() if temps[0] == 1.0 else logits.float() / temps[0]
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(ks):
        top = torch.topk(x, max(ks), dim=-1).values  # [N, max k], descending
        k = torch.tensor(ks, device=dev)
        kth = top.gather(-1, (k - 1).clamp(min=0)[:, None])
        kth = torch.where(k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))  # no cut for top_k 0
        x = x.masked_fill(x < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        # a top_p of 1 keeps every token (no comparison with a cumulative sum that rounds to 1 before the end)
        tp = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=dev)
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        sp = torch.softmax(sorted_x, -1)
        drop = sp.cumsum(-1) - sp >= tp[:, None]
        x = torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x.masked_fill(drop, float("-inf")))
    return torch.softmax(x, -1)


CDF_BLOCK = 1024  # the cumulative sums of a row are taken in blocks of this many entries (see `cdf`)


def cdf(pr: torch.Tensor) -> torch.Tensor:
    """The fp64 cumulative sums of the rows of pr [N, V], taken blockwise: each block of CDF_BLOCK entries summed on
    its own, then the blocks' totals, exclusive, added to their entries. A scan along one long row runs as one
    sequential pass of one thread block on a GPU (the whole vocabulary per request); blocked, a step's rows are
    N * V / CDF_BLOCK short scans side by side. Non-decreasing along each row as a plain cumulative sum is (a block's
    offset is the previous offset plus that block's last entry), equal to it up to fp64 rounding."""
    N, V = pr.shape
    x = pr.double()
    if V <= CDF_BLOCK:
        return x.cumsum(-1)
    nb = -(-V // CDF_BLOCK)
    if nb * CDF_BLOCK != V:
        x = torch.nn.functional.pad(x, (0, nb * CDF_BLOCK - V))
    inner = x.view(N, nb, CDF_BLOCK).cumsum(-1)
    ends = inner[:, :, -1].cumsum(-1)  # [N, nb]: the cumulative sum at each block's last entry
    offset = torch.nn.functional.pad(ends[:, :-1], (1, 0))  # exclusive: 0 before the first block
    return (inner + offset[:, :, None]).view(N, nb * CDF_BLOCK)[:, :V]


def inverse_transform(pr: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of pr [N, V] by inverse transform sampling from one uniform u [N] in [0, 1) per row: the
    first token whose cumulative probability (fp64, `cdf`) exceeds u times the row's total. The point stays below the
    total, so it lands on a token of positive probability (never on one a cut left at 0)."""
    c = cdf(pr)
    total = c[:, -1:]
    x = torch.minimum(u.double()[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(c.contiguous(), x, right=True)[:, 0]


def uniforms(counts: list[int], generators: list[torch.Generator | None], device: torch.device | str
             ) -> torch.Tensor:
    """Uniform numbers in [0, 1) for a batch of requests, counts[i] of them for request i, in request order [sum]:
    a seeded request's from its own generator (one draw each, so its numbers do not depend on the others), and the
    unseeded requests' together from one draw of the device's default generator (a step of unseeded requests draws
    once, not once per request)."""
    if len(counts) != len(generators):
        raise ValueError(f"{len(counts)} counts for {len(generators)} generators")
    free = sum(c for c, g in zip(counts, generators) if g is None)
    shared = torch.rand(free, device=device) if free else None
    if free == sum(counts):
        return shared if shared is not None else torch.empty(0, device=device)
    pieces, at = [], 0
    for c, g in zip(counts, generators):
        if not c:
            continue
        if g is None:
            pieces.append(shared[at:at + c])
            at += c
        else:
            pieces.append(torch.rand(c, device=device, generator=g))
    return torch.cat(pieces)


def sample(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> token ids [N]. Greedy when temperature == 0; else drawn from `probs`, one uniform number
    from `generator` per row (`inverse_transform`)."""
    if p.temperature == 0:
        return logits.float().argmax(-1)
    pr = probs(logits, p)
    return inverse_transform(pr, torch.rand(pr.shape[0], device=pr.device, generator=generator))


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
    """The tokens [N] (on the device, not read back) of the rows of logits [N, V] under their params: one argmax for
    the greedy rows, and the sampled rows' distributions computed together (`probs_rows`) and drawn from by
    `inverse_transform` with one uniform number from each row's own generator (the unseeded rows' from one draw:
    `uniforms`). Also those distributions [S, V] (None without sampled rows) and the sampled rows' indices."""
    rows = [i for i, p in enumerate(params) if p.temperature != 0]
    every = bool(rows) and len(rows) == len(params)  # every row sampled: no argmax, no index sent to the device
    out = None if every else logits.float().argmax(-1)  # the greedy rows' tokens (one kernel for all rows)
    if not rows:
        return out, None, rows
    idx = None if every else torch.tensor(rows, device=logits.device)
    pr = probs_rows(logits if every else logits[idx], [params[i] for i in rows])
    u = uniforms([1] * len(rows), [generators[i] for i in rows], logits.device)
    drawn = inverse_transform(pr, u)
    if every:
        return drawn, pr, rows
    out[idx] = drawn
    return out, pr, rows


def sample_step(logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of logits [N, V], row i with params[i] and generators[i], left on the device [N] (the
    caller reads it back with whatever else the step reads: one read-back per step). Greedy rows share one argmax
    (taken over all rows); the sampled rows' distributions are computed together (`probs_rows`) and drawn from
    together (`inverse_transform`), each with one uniform number from its own generator, so a request's tokens do not
    depend on which other requests share its step: equal to calling `sample` row by row, in a fixed number of kernels
    plus one draw per seeded row. A row whose params have a constraint samples from its masked logits (a copy: the
    caller's logits stay as they are, for logprobs); the caller hands the tokens, once read back, to `advance`."""
    constrained = [i for i, p in enumerate(params) if p.constraint is not None]
    if constrained:
        logits = logits.clone()
        for i in constrained:
            logits[i] = params[i].constraint.mask(logits[i])
    return sample_rows(logits, params, generators)[0]


def advance(params: list[SamplingParams], toks: list[int]) -> None:
    """Each constrained row's constraint takes its sampled token (after `sample_step`, once read back)."""
    for p, t in zip(params, toks):
        if p.constraint is not None:
            p.constraint.advance(t)


def sample_batch(logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
    """`sample_step` read back to the host, the constraints advanced: the tokens as a list."""
    toks = sample_step(logits, params, generators).tolist()
    advance(params, toks)
    return toks
