"""Time the MoonEP planner (report §5.2.1, appendix E) for one MoE layer at release shapes.

    python benchmarks/moon_ep_planner.py [--ranks 64 128] [--experts 896] [--top-k 16] [--tokens 16384]
                                         [--runs 7] [--threads 1] [--skews balanced lognormal zipf hot_rank theorem2]

For every EP size and load skew, the group's per-expert loads (R*S*K pairs) are drawn once, then
``plan_moon_ep`` is timed over ``--runs`` calls (wall clock, median and min), and ``pair_slots`` over the
same runs for one rank's [S, K] routing tensor (the dispatcher's per-pair destinations). Skews: ``balanced``
(uniform expert popularity: only sampling noise, what a balanced router gives), ``lognormal`` (popularity
exp(0.5 z)), ``zipf`` (popularity 1/rank, shuffled over experts), ``hot_rank`` (half of all pairs on one rank's
experts), ``theorem2`` (appendix E's tight case: rank 0's experts get nothing, the others share evenly).
Popularities are capped at 1/K per expert (a token picks an expert at most once) and the loads are a
multinomial draw. One JSON line per case: timings, the most redundant experts on any rank, the E/R bound, and
a simple lower bound (each rank alone: the fewest non-local experts covering its deficit).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3.parallel.expert_parallel import _plan_to
from k3.parallel.moon_ep import pair_slots, plan_moon_ep, rank_offsets


def popularity(skew: str, E: int, R: int, K: int, g: torch.Generator) -> torch.Tensor:
    """[E] expert probabilities over pairs, each at most 1/K."""
    n = E // R
    if skew == "balanced":
        p = torch.ones(E, dtype=torch.float64)
    elif skew == "lognormal":
        p = torch.exp(0.5 * torch.randn(E, generator=g, dtype=torch.float64))
    elif skew == "zipf":
        p = 1.0 / (torch.randperm(E, generator=g).double() + 1.0)
    elif skew == "hot_rank":
        p = torch.full((E,), 0.5 / (E - n), dtype=torch.float64)
        p[:n] = 0.5 / n
    elif skew == "theorem2":
        p = torch.ones(E, dtype=torch.float64)
        p[:n] = 0.0
    else:
        raise ValueError(f"unknown skew {skew!r}")
    p = p / p.sum()
    for _ in range(E):  # water-fill the cap
        over = p > 1.0 / K
        if not over.any():
            break
        p[over] = 1.0 / K
        free = ~over & (p < 1.0 / K)
        p[free] *= (1.0 - p[~free].sum()) / p[free].sum()
    return p


def draw_loads(p: torch.Tensor, total: int, skew: str, g: torch.Generator) -> torch.Tensor:
    if skew == "theorem2":  # even split, remainders to the first experts
        live = (p > 0).nonzero().flatten()
        loads = torch.zeros(p.numel(), dtype=torch.int64)
        loads[live] = total // live.numel()
        loads[live[:total - int(loads.sum())]] += 1
        return loads
    idx = torch.multinomial(p.float(), total, replacement=True, generator=g)
    return torch.bincount(idx, minlength=p.numel())


def lower_bound(loads: torch.Tensor, R: int, T: int) -> int:
    """Max over ranks of the fewest non-local experts whose loads cover the rank's deficit."""
    E = loads.numel()
    n = E // R
    best = 0
    for r in range(R):
        deficit = T - int(loads[r * n:(r + 1) * n].sum())
        if deficit > 0:
            other = torch.cat([loads[:r * n], loads[(r + 1) * n:]]).sort(descending=True).values.cumsum(0)
            best = max(best, int((other < deficit).sum()) + 1)
    return best


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--experts", type=int, default=896)
    ap.add_argument("--top-k", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384, help="S, tokens per rank (one micro-batch)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the planner is host code)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skews", nargs="+", default=["balanced", "lognormal", "zipf", "hot_rank", "theorem2"])
    ap.add_argument("--device", default="cpu", help="where the routing lives: on cuda the timed plan includes the "
                    "read of the [E] loads to the host and the plan's asynchronous copy back, and pair_slots runs "
                    "on the device (synchronized)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    E, K, S = args.experts, args.top_k, args.tokens
    T = S * K
    for R in args.ranks:
        for skew in args.skews:
            g = torch.Generator().manual_seed(args.seed)
            loads = draw_loads(popularity(skew, E, R, K, g), R * T, skew, g)
            # The group's pairs in a random order, as [R, S, K] routing tensors (for the pair_slots timing).
            pairs = torch.repeat_interleave(torch.arange(E), loads)
            ids = pairs[torch.randperm(R * T, generator=g)].reshape(R, S, K)
            counts = torch.bincount((ids + torch.arange(R).view(R, 1, 1) * E).reshape(-1),
                                    minlength=R * E).reshape(R, E)
            r = R // 2
            base = rank_offsets(counts)[r]
            dev = torch.device(args.device)
            cuda = dev.type == "cuda"
            loads_dev, ids_r, base_dev = loads.to(dev), ids[r].to(dev), base.to(dev)
            plan_times, slot_times = [], []
            for _ in range(args.runs + (1 if cuda else 0)):  # on cuda one untimed warm-up
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                plan = plan_moon_ep(loads_dev.cpu(), R, T)  # the layer's one device-to-host read, then the host
                if cuda:
                    plan = _plan_to(plan, dev)
                plan_t = time.perf_counter() - t0
                t0 = time.perf_counter()
                pair_slots(plan, ids_r, base_dev, check=not cuda)
                if cuda:
                    torch.cuda.synchronize()
                slot_t = time.perf_counter() - t0
                plan_times.append(plan_t)
                slot_times.append(slot_t)
            if cuda:
                plan_times, slot_times = plan_times[1:], slot_times[1:]
            n = E // R
            print(json.dumps({
                "bench": "moon_ep_planner", "device": args.device, "threads": args.threads,
                "E": E, "K": K, "R": R, "S": S, "skew": skew,
                "plan_ms_median": round(1e3 * statistics.median(plan_times), 2),
                "plan_ms_min": round(1e3 * min(plan_times), 2),
                "pair_slots_ms_median": round(1e3 * statistics.median(slot_times), 2),
                "max_redundant": plan.max_redundant, "bound_E_over_R": n,
                "lower_bound": lower_bound(loads, R, T),
                "total_redundant": int(plan.num_redundant.sum()),
                "max_rank_load_over_T": round(max(int(loads[q * n:(q + 1) * n].sum()) for q in range(R)) / T, 3),
                "runs": args.runs,
            }), flush=True)


if __name__ == "__main__":
    main()
