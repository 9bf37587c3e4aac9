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


def bf16_loss_and_grads(model, ids, segment_ids=None, mtp_weight: float = 0.3):
    """One training forward + backward under bf16 autocast on the model's device: (loss, {name: fp64 flat grad})."""
    model.zero_grad(set_to_none=True)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        out = model(ids, labels=ids, segment_ids=segment_ids)
    (out.loss + (mtp_weight * out.mtp_loss if out.mtp_loss is not None else 0)).backward()
    grads = {n: p.grad.detach().double().flatten() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def grad_disagreement(g: dict, g_ref: dict, min_numel: int = 64):
    """How far two gradient sets are apart: (L2 error of all of them together relative to the reference,
    [(cosine, name)] of each tensor of >= min_numel entries, worst first). Few-entry tensors (A_log, ...) are
    left to the global bound: their cosine is fragile."""
    assert g.keys() == g_ref.keys()
    flat = torch.cat([g[n].double().flatten() for n in g_ref])
    flat_ref = torch.cat([t.double().flatten() for t in g_ref.values()])
    cosine = torch.nn.functional.cosine_similarity
    cos = sorted((float(cosine(g[n].double().flatten(), g_ref[n].double().flatten(), dim=0)), n)
                 for n in g_ref if g_ref[n].numel() >= min_numel)
    return float((flat - flat_ref).norm() / flat_ref.norm()), cos
