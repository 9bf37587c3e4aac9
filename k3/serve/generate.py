"""Offline generation for one prompt through the model's decode cache."""

from __future__ import annotations

from typing import Iterator

import torch

from k3.serve.sampling import SamplingParams, sample


@torch.no_grad()
def generate_tokens(model, prompt_ids: list[int], params: SamplingParams, eos_id: int | None = None) -> Iterator[int]:
    """Yields new token ids one at a time (prefill once, then one decode step per token)."""
    params.validate()
    if not prompt_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    device = next(model.parameters()).device
    gen = torch.Generator(device=device)
    gen.manual_seed(params.seed if params.seed is not None else torch.seed())
    cache = model.new_cache()
    logits = model(torch.tensor([prompt_ids], device=device), cache=cache, logits_to_keep=1).logits[:, -1]
    for _ in range(params.max_tokens):
        tok = int(sample(logits, params, gen)[0])
        if (eos_id is not None and tok == eos_id) or tok in params.stop_token_ids:
            return
        yield tok
        logits = model(torch.tensor([[tok]], device=device), cache=cache, logits_to_keep=1).logits[:, -1]
