"""Model arithmetic from the modules themselves: parameter counts (built on the meta device), cache sizes
and forward FLOPs per token. Nothing here is typed in; it all follows from the config's shapes."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from k3.config import K3Config

COMPONENTS = ["embeddings", "KDA", "MLA", "dense MLP", "routed experts", "shared experts", "latent projections",
              "router", "AttnRes", "norms", "MTP", "output head", "vision encoder"]


def component_of(name: str, kda_layers: set[int]) -> str:
    """The component a parameter belongs to, by its module path; `kda_layers` are 0-based layer indices."""
    if name.startswith("mtp."):
        return "MTP"
    if name.startswith("vision."):
        return "vision encoder"
    if name == "model.embed_tokens.weight":
        return "embeddings"
    if name == "lm_head.weight":
        return "output head"
    if "_res_norm" in name or "_res_proj" in name:
        return "AttnRes"
    if ".self_attn." in name:
        return "KDA" if int(name.split(".")[2]) in kda_layers else "MLA"
    if ".block_sparse_moe.experts." in name:
        return "routed experts"
    if ".block_sparse_moe.shared_experts." in name:
        return "shared experts"
    if ".block_sparse_moe.gate." in name:
        return "router"
    if "routed_expert_" in name:
        return "latent projections"
    if ".mlp." in name:
        return "dense MLP"
    if name.endswith("norm.weight"):
        return "norms"
    raise KeyError(name)


@dataclass
class ModelInfo:
    total: int
    active: int  # per token, excluding the input embedding
    breakdown: "OrderedDict[str, tuple[int, int]]"  # component -> (total, active)
    kda_state_bytes: int  # fp32 recurrent state per sequence
    kda_conv_bytes: int  # fp32 short-conv tails per sequence
    mla_cache_bytes_per_token: int  # bf16 latent + extra key dims
    flops_per_token: float  # forward, at `context` tokens
    vision_params: int = 0  # MoonViT-V2 + projector, not in `total`
    # Training only: per-token active parameters of the MTP layer(s) (their block with the routed fraction of its
    # experts, vectors excluded) plus the shared output head, which each MTP depth applies once more.
    mtp_active: int = 0


def build_meta_model(cfg: K3Config):
    from k3.model.model import K3ForCausalLM

    with torch.device("meta"):
        return K3ForCausalLM(cfg)


def model_info(cfg: K3Config, context: int = 4096, cache_dtype_bytes: int = 2) -> ModelInfo:
    model = build_meta_model(cfg)
    kda_layers = {i for i, layer in enumerate(model.model.layers) if layer.is_kda}
    frac = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    rows = OrderedDict((c, [0, 0.0]) for c in COMPONENTS)
    # The router's score-correction bias is a buffer (set by balancing, not gradients) but is stored weight.
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers()
                                                 if n.endswith("e_score_correction_bias")]
    for name, p in tensors:
        c = component_of(name, kda_layers)
        n = p.numel()
        rows[c][0] += n
        if c in ("embeddings", "MTP", "vision encoder"):
            continue  # active: text path per token, excluding the input embedding; MTP is not on that path
        rows[c][1] += n * frac if c == "routed experts" else n
    breakdown = OrderedDict((c, (int(t), int(round(a)))) for c, (t, a) in rows.items() if t)
    vision = breakdown.get("vision encoder", (0, 0))[0]
    total = sum(t for t, _ in breakdown.values()) - vision  # the report's totals are the text model
    active = sum(a for _, a in breakdown.values())

    n_kda = len(kda_layers)
    n_mla = len(model.model.layers) - n_kda
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    kda_state = n_kda * H * K * K * 4
    kda_conv = n_kda * 3 * H * K * (cfg.kda_short_conv_kernel_size - 1) * 4
    mla_tok = n_mla * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * cache_dtype_bytes

    # FLOPs: 2 per multiply-add of every active matrix (embedding lookup is free), plus the sequence mixing.
    matmul = 2 * (active - rows["norms"][1] - _vector_params(model))
    # MLA at `context`: on average a token attends to context/2 keys; QK over 192 dims and PV over 128 per head.
    Hm = cfg.num_attention_heads
    mla = n_mla * 2 * Hm * (context / 2) * (cfg.qk_head_dim + cfg.v_head_dim)
    # KDA per token (recurrent view): decay+rank-1 update and readout, ~ 4 flops per state element + 2 for o.
    kda = n_kda * H * K * K * 6
    mtp_active = 0
    for name, p in model.named_parameters():
        if name.startswith("mtp.") and p.dim() > 1:
            mtp_active += p.numel() * (frac if ".block_sparse_moe.experts." in name else 1)
    mtp_active = int(round(mtp_active)) + len(model.mtp) * model.lm_head.weight.numel()
    return ModelInfo(total, active, breakdown, kda_state, kda_conv, mla_tok, float(matmul + mla + kda), vision,
                     mtp_active)


def sequence_cache_bytes(info: ModelInfo, context: int) -> int:
    """The decode cache of one sequence after `context` tokens: every KDA layer's fp32 recurrent state and conv tails
    (fixed, whatever the length) plus every MLA layer's latent rows (growing with it), at the cache dtype
    `model_info` was given."""
    if context < 0:
        raise ValueError(f"context must be a non-negative number of tokens, got {context}")
    return info.kda_state_bytes + info.kda_conv_bytes + info.mla_cache_bytes_per_token * context


def _vector_params(model) -> int:
    """1-D parameters in the active set (biases, A_log, dt_bias, norms counted separately) do no matmul."""
    n = 0
    for name, p in model.named_parameters():
        if p.dim() == 1 and not name.startswith(("mtp.", "vision.")) and not name.endswith("norm.weight"):
            n += p.numel()
    return n


def _fmt(n: float) -> str:
    for unit, div in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.4g}{unit}"
    return f"{n:.0f}"


def _bytes(n: float) -> str:
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.4g} {unit}"
    return f"{n:.0f} B"


def format_info(name: str, cfg: K3Config, info: ModelInfo, context: int) -> str:
    lines = [f"{name}: {cfg.num_hidden_layers} layers ({len(cfg.kda_layers)} KDA, {len(cfg.full_attn_layers)} MLA), "
             f"hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.num_experts} experts top-{cfg.num_experts_per_token}",
             "", f"{'component':<20}{'total':>16}{'active':>16}"]
    if cfg.ablations():  # the ablation arms this config sets (K3Config.ablations): not the K3 architecture
        lines[1:1] = ["ablation arm, not K3: " + "; ".join(cfg.ablations())]
    for c, (t, a) in info.breakdown.items():
        lines.append(f"{c:<20}{t:>16,}{a:>16,}")
    lines.append(f"{'text model':<20}{info.total:>16,}{info.active:>16,}")
    lines += [
        "",
        f"total parameters:        {_fmt(info.total)} (text model)"
        + (f" + {_fmt(info.vision_params)} vision encoder" if info.vision_params else ""),
        f"active per token:        {_fmt(info.active)} (excluding the input embedding)",
        f"KDA state per sequence:  {info.kda_state_bytes:,} B = {info.kda_state_bytes / 1e6:.1f} MB fp32"
        f" (+ {info.kda_conv_bytes / 1e6:.1f} MB conv tails)",
        f"MLA cache per token:     {info.mla_cache_bytes_per_token:,} B bf16"
        f" -> {_bytes(info.mla_cache_bytes_per_token * 2**20)} at 2^20 tokens",
        f"forward FLOPs per token: {_fmt(info.flops_per_token)} at {context:,} tokens of context",
    ]
    return "\n".join(lines)
