"""A communication model of one K3 layer at release shapes: bytes per rank per training step.

    python benchmarks/comm_model.py [--ep 64 128] [--tokens 16384] [--skews balanced measured zipf hot_rank]
                                    [--cp 2 4 8 16] [--context 131072 262144 524288 1048576] [--json OUT.json]

Expert parallelism (report §5.2.1). Every EP rank routes S tokens to K of E experts; the LatentMoE dispatches the
latent (``routed_expert_hidden_size`` L values per pair, bf16) to the pair's computing rank and combines the
results back; the backward sends the same rows again the other way. Plain EP computes a pair at its expert's home
rank; MoonEP (k3.parallel.moon_ep) at the rank its plan gives, after fetching the redundant experts' weights (w1,
w3, w2: 3 F L bf16 values each) and reducing their fp32 gradients back in the backward. The per-source,
per-destination pair counts come from the real planner and the layer's own routing arithmetic
(k3.parallel.expert_parallel) on loads drawn at each skew; the slowest rank sets the time of an all-to-all, so the
table reports the busiest rank's bytes received (and sent), and the computed pairs' max / mean.

Skews: ``balanced`` (uniform popularity), ``measured`` (log-normal popularity whose busiest expert carries
``--measured-max-over-mean`` times the mean: the k3-mini H200 run's per-layer expert load max / mean, 1.12-1.22
over the last 50 steps, BENCHMARKS.md), ``zipf`` (1/rank) and ``hot_rank`` (half the pairs on one rank's experts).

Context parallelism (report §5.1.2), per layer and rank, forward (the backward's reduce-scatter moves the same):
* KDA under KCP: one all-gather of every rank's per-head segment transition M [dk, dk] and zero-start state
  S~ [dk, dv] in fp32, plus the short conv's halo (kernel - 1 rows of q, k, v): independent of the context length.
* The same layer width as softmax attention under ring attention: each rank receives every other rank's K and V
  (heads x (dk + dv) bf16 values per token).
* Gated MLA under CP as k3 runs it: an all-gather of the latent KV (kv_lora_rank + qk_rope_head_dim = 576 bf16
  values per token).
* Gated MLA under ring attention on the expanded keys and values (heads x (qk_nope + qk_rope + v) per token).
Totals over the model (69 KDA + 24 MLA layers) and the time at ``--link-gb-s`` (per direction) are printed too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

from k3.config import K3Config
from k3.parallel.expert_parallel import _pair_matrix
from k3.parallel.moon_ep import plan_moon_ep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moon_ep_planner import popularity  # noqa: E402

BF16, FP32 = 2, 4


def lognormal_for(max_over_mean: float, E: int, K: int, g: torch.Generator) -> torch.Tensor:
    """Popularity exp(sigma z) with sigma chosen so that the busiest expert has `max_over_mean` times the mean."""
    z = torch.randn(E, generator=g, dtype=torch.float64)
    lo, hi = 0.0, 3.0
    for _ in range(60):
        mid = (lo + hi) / 2
        p = torch.exp(mid * z)
        if float(p.max() / p.mean()) < max_over_mean:
            lo = mid
        else:
            hi = mid
    p = torch.exp(lo * z)
    return (p / p.sum()).clamp_max(1.0 / K) / (p / p.sum()).clamp_max(1.0 / K).sum()


def route_counts(p: torch.Tensor, R: int, pairs_per_rank: int, g: torch.Generator) -> torch.Tensor:
    """[R, E] pairs each rank routes to each expert: a multinomial draw of every rank's pairs."""
    idx = torch.multinomial(p.float().expand(R, -1).contiguous(), pairs_per_rank, replacement=True, generator=g)
    return torch.zeros(R, p.numel(), dtype=torch.int64).scatter_add_(1, idx, torch.ones_like(idx))


def ep_case(cfg: K3Config, R: int, S: int, skew: str, max_over_mean: float, seed: int) -> dict:
    E, K, L, F = cfg.num_experts, cfg.num_experts_per_token, cfg.routed_expert_hidden_size, cfg.moe_intermediate_size
    g = torch.Generator().manual_seed(seed)
    p = lognormal_for(max_over_mean, E, K, g) if skew == "measured" else popularity(skew, E, R, K, g)
    counts = route_counts(p, R, S * K, g)
    n = E // R
    out = {"E": E, "K": K, "R": R, "S": S, "skew": skew,
           "expert_max_over_mean": round(float(counts.sum(0).max() / counts.sum(0).double().mean()), 3)}
    for name, plan in (("ep", None), ("moon_ep", plan_moon_ep(counts.sum(0), R, S * K))):
        pairs = _pair_matrix(counts, n, plan)  # [source, expert, computing rank]
        flow = pairs.sum(1)  # [source, destination]
        off = flow - torch.diag(torch.diagonal(flow))  # pairs that leave their rank
        row = L * BF16
        # forward dispatch + combine, backward the same again: each pair's row crosses twice each way
        recv = 2 * (off.sum(0) + off.sum(1)) * row
        sent = recv.clone()  # dispatch out = combine in, per rank, and vice versa
        computed = flow.sum(0).double()
        weights = grads = torch.zeros(R, dtype=torch.float64)
        if plan is not None:
            copies = (plan.redundant >= 0).sum(1).double()
            weights = copies * 3 * F * L * BF16  # the copies' bf16 weights in (forward)
            grads = copies * 3 * F * L * FP32  # their fp32 gradients back out (backward)
        out[name] = {
            "max_rank_recv_GB": round(float((recv.double() + weights).max()) / 1e9, 3),
            "mean_rank_recv_GB": round(float((recv.double() + weights).mean()) / 1e9, 3),
            "max_rank_sent_GB": round(float((sent.double() + grads).max()) / 1e9, 3),
            "expert_weights_max_GB": round(float(weights.max()) / 1e9, 3),
            "computed_max_over_mean": round(float(computed.max() / computed.mean()), 3),
            "max_redundant": 0 if plan is None else plan.max_redundant,
        }
    return out


def cp_case(cfg: K3Config, P: int, T: int) -> dict:
    H, dk, dv = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim
    Ha = cfg.num_attention_heads
    qk, vd, lat = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim
    others = (P - 1) / P * T  # tokens of the other ranks
    kcp = (P - 1) * H * (dk * dk + dk * dv) * FP32 + (cfg.kda_short_conv_kernel_size - 1) * 3 * H * dk * BF16
    return {
        "P": P, "context": T,
        "kda_kcp_MB": kcp / 1e6,
        "kda_as_ring_attention_MB": others * H * (dk + dv) * BF16 / 1e6,
        "mla_latent_allgather_MB": others * lat * BF16 / 1e6,
        "mla_ring_attention_MB": others * Ha * (qk + vd) * BF16 / 1e6,
    }


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--ep", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tokens", type=int, default=16384, help="S, tokens per EP rank")
    ap.add_argument("--skews", nargs="+", default=["balanced", "measured", "zipf", "hot_rank"])
    ap.add_argument("--measured-max-over-mean", type=float, default=1.2)
    ap.add_argument("--cp", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[131072, 262144, 524288, 1048576])
    ap.add_argument("--link-gb-s", type=float, default=450.0, help="per-direction link bandwidth for the times")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg = K3Config.from_preset("k3")
    n_kda, n_mla = len(cfg.kda_layers), len(cfg.full_attn_layers)
    res = {"ep": [], "cp": []}
    print(f"## EP dispatch, one MoE layer, forward + backward (E={cfg.num_experts}, K={cfg.num_experts_per_token}, "
          f"L={cfg.routed_expert_hidden_size}, S={a.tokens} per rank)\n")
    print("| EP | skew | busiest expert / mean | EP: busiest rank recv / sent GB | EP: computed max/mean | "
          "MoonEP: busiest rank recv / sent GB (weights in) | MoonEP: computed max/mean | MoonEP copies (max) |")
    print("|---|---|---|---|---|---|---|---|")
    for R in a.ep:
        for skew in a.skews:
            r = ep_case(cfg, R, a.tokens, skew, a.measured_max_over_mean, a.seed)
            res["ep"].append(r)
            e, m = r["ep"], r["moon_ep"]
            print(f"| {R} | {skew} | {r['expert_max_over_mean']:.2f} | {e['max_rank_recv_GB']:.2f} / "
                  f"{e['max_rank_sent_GB']:.2f} | {e['computed_max_over_mean']:.2f} | {m['max_rank_recv_GB']:.2f} / "
                  f"{m['max_rank_sent_GB']:.2f} ({m['expert_weights_max_GB']:.2f}) | "
                  f"{m['computed_max_over_mean']:.2f} | {m['max_redundant']} |", flush=True)
    print(f"\n## Context parallel, per rank, forward (MB per layer; model total at {a.link_gb_s:g} GB/s)\n")
    print("| CP | context | KDA: KCP | KDA width as ring attention | MLA: latent all-gather | MLA: ring attention "
          "| model: k3 (KCP + latent) | model: ring attention |")
    print("|---|---|---|---|---|---|---|---|")
    for P in a.cp:
        for T in a.context:
            c = cp_case(cfg, P, T)
            ours = n_kda * c["kda_kcp_MB"] + n_mla * c["mla_latent_allgather_MB"]
            ring = n_kda * c["kda_as_ring_attention_MB"] + n_mla * c["mla_ring_attention_MB"]
            c.update(model_k3_GB=ours / 1e3, model_ring_GB=ring / 1e3)
            res["cp"].append(c)
            t = lambda mb: f"{mb / 1e3:.1f} GB, {mb / 1e3 / a.link_gb_s * 1e3:.0f} ms"  # noqa: E731
            print(f"| {P} | {T // 1024}K | {c['kda_kcp_MB']:.1f} | {c['kda_as_ring_attention_MB']:.0f} | "
                  f"{c['mla_latent_allgather_MB']:.0f} | {c['mla_ring_attention_MB']:.0f} | {t(ours)} | {t(ring)} |",
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
