"""Shared test helpers."""

import torch


def randomize_(model, seed: int = 0, scale: float = 1.0):
    """Random init plus non-zero AttnRes pseudo-queries and router biases, so every mechanism is exercised."""
    from k3.model.model import K3ForCausalLM

    model.init_weights(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_res_proj.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * scale)
            elif name.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    assert isinstance(model, K3ForCausalLM)
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
