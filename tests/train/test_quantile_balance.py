"""Quantile Balancing and the sign baseline (k3.train.quantile_balance; report §2.3.3, appendices C and D)."""

import io
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from k3.ops.moe import Routing, expert_load, route
from k3.train.quantile_balance import (METHODS, ExpertBalancer, histogram_quantile, ideal_load_ratios, load_stats_of,
                                      quantile_bias_exact)

QB_METHODS = ("histogram", "exact")
ALL_METHODS = ("histogram", "exact", "sign")


def _max_over_mean(indices: torch.Tensor, num_experts: int) -> float:
    load = expert_load(indices, num_experts).double()
    return float(load.max() / load.mean())


def _selected(R: Routing) -> torch.Tensor:
    """The selected experts of every token as a set (sorted), ignoring their order within the top-k."""
    return R.indices.sort(dim=1).values


def _rows(R: Routing, start: int, stop: int) -> Routing:
    return Routing(*(t[start:stop] for t in R))


def _random_routing(m: int, E: int, k: int, seed: int, bias_scale: float = 0.3, skew_scale: float = 0.5):
    """Random logits with a per-expert skew, routed with a random (non-zero) bias."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(m, E, generator=g) * 1.5 + torch.randn(E, generator=g) * skew_scale
    bias = torch.randn(E, generator=g) * bias_scale
    return route(logits, bias, k), bias, logits


def _required_bias_sorted(R: Routing) -> torch.Tensor:
    """r_ij = alpha_i - s_ij (fp32, as routed), sorted over tokens per expert, in float64."""
    r = R.cutoff.float()[:, None] - R.scores.float()
    return r.double().sort(dim=0).values


# ---------------------------------------------------------------------------------------------
# 1. Acceptance: a persistent per-expert skew, 896 experts, top-16, 65,536 tokens per step.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_acceptance_qb_balances_skewed_router_within_three_updates():
    E, k, m, steps = 896, 16, 65_536, 4
    g = torch.Generator().manual_seed(2024)
    skew = torch.randn(E, generator=g) * 0.25  # fixed across steps: the imbalance persists
    balancers = {name: ExpertBalancer(E, k, name) for name in ALL_METHODS}
    bias = {name: torch.zeros(E) for name in ALL_METHODS}
    loads = {name: [] for name in ALL_METHODS}
    for step in range(steps):
        # A fresh batch each step, routed with the bias computed from the *earlier* batches only.
        logits = torch.randn(m, E, generator=g).add_(skew)
        shared = route(logits, bias["sign"], k) if step == 0 else None  # step 0: every bias is zero
        for name in ALL_METHODS:
            R = shared if shared is not None else route(logits, bias[name], k)
            loads[name].append(_max_over_mean(R.indices, E))
            if step < steps - 1:
                bal = balancers[name]
                bal.observe(R, bias[name])
                assert bal.load_stats()["max_over_mean"] == pytest.approx(loads[name][-1], rel=1e-12)
                new = bal.update(bias[name])
                assert new.dtype == torch.float32 and new.shape == (E,)
                if name in QB_METHODS:
                    assert abs(float(new.double().mean())) < 1e-6
                bias[name] = new
            del R
        del logits, shared
    print("\nmax/mean load per step (step t routed after t updates):")
    for name in ALL_METHODS:
        print(f"  {name:9s} " + "  ".join(f"{x:.3f}" for x in loads[name]))
    assert loads["sign"][0] > 3.0  # the skew is strong: zero bias leaves one expert > 3x the mean
    for name in QB_METHODS:
        assert loads[name][3] <= 1.15, (name, loads[name])
    assert loads["sign"][3] > 1.15, loads["sign"]


# ---------------------------------------------------------------------------------------------
# 2. Histogram estimator: hand-made counts, and within one bin of the exact quantile.
# ---------------------------------------------------------------------------------------------


def test_histogram_quantile_hand_made_counts():
    counts = torch.tensor([[0, 2, 2, 0], [4, 0, 0, 0], [0, 0, 0, 4], [1, 1, 1, 1]])
    # q = 3: row 0 -> bin 2 (cum 2 before, 2 inside): 2 + (3-2)/2 = 2.5; row 1 -> 0.75; row 2 -> 3.75; row 3 -> 3.0
    expect3 = torch.tensor([2.5, 0.75, 3.75, 3.0])
    for c in (counts, counts.float(), counts.double()):
        assert torch.allclose(histogram_quantile(c, 0.0, 4.0, 3.0), expect3, atol=1e-6)
    # q = 2 reaches the target at a bin edge: row 0 -> bin 1 fully taken = 2.0
    assert torch.allclose(histogram_quantile(counts, 0.0, 4.0, 2.0), torch.tensor([2.0, 0.5, 3.5, 2.0]), atol=1e-6)
    # range and q as 0-dim tensors, range not starting at zero: value = lo + (bin + frac) * w with w = 0.5
    out = histogram_quantile(counts, torch.tensor(-1.0), torch.tensor(1.0), torch.tensor(3.0))
    assert torch.allclose(out, -1.0 + expect3 * 0.5, atol=1e-6)
    assert out.dtype == torch.float32


@pytest.mark.parametrize(
    "E,B,m,k",
    [(8, 50, 1000, 2), (16, 200, 333, 3), (64, 1000, 4096, 4), (5, 7, 100, 1), (96, 1000, 2000, 8), (32, 64, 777, 5)],
)
def test_histogram_within_one_bin_of_exact_quantile(E, B, m, k):
    R, bias, _ = _random_routing(m, E, k, seed=E * 1000 + B + m)
    bal = ExpertBalancer(E, k, "histogram", bins=B)
    bal.observe(R, bias)
    sd = bal.state_dict()
    counts, (lo, hi) = sd["counts"][:, :B], sd["hist_range"].tolist()
    assert lo == pytest.approx(float(bias.min()) - 1) and hi == pytest.approx(float(bias.max()) + 1)
    assert torch.equal(counts.sum(1), torch.full((E,), m))  # every token counted once per expert
    assert torch.equal(sd["counts"][:, B], expert_load(R.indices, E))  # packed routed load

    q = m * k / E
    w = (hi - lo) / B
    est = histogram_quantile(counts, lo, hi, q).double()
    r = _required_bias_sorted(R)
    exact = r[min(m * k // E, m - 1)]  # the report's (q+1)-th smallest required bias (floor for fractional q)
    lower = r[math.ceil(q) - 1]  # the ceil(q)-th smallest: its bin is the one the estimator reads
    tol = w * (1 + 1e-4) + 1e-6
    assert float((est - exact).abs().max()) <= tol
    # The estimate lies in the bin of the ceil(q)-th smallest value (the report's "same bin" property).
    assert float((est - lower).abs().max()) <= tol
    # The exact estimator agrees with the pure function; after mean-centring both, within two bins.
    assert torch.allclose(quantile_bias_exact(R.scores, R.cutoff, k).double(), exact - exact.mean(), atol=1e-6)
    new = bal.update(bias)
    assert float((new.double() - quantile_bias_exact(R.scores, R.cutoff, k).double()).abs().max()) <= 2 * tol


# ---------------------------------------------------------------------------------------------
# 3. The report's Fig. 5: m = 8 tokens, n = 4 experts, k = 1: loads (4, 3, 1, 0) -> (2, 2, 2, 2).
# ---------------------------------------------------------------------------------------------

# Router scores: t1-t4 prefer E1, t5-t7 prefer E2, t8 prefers E3; nobody prefers E4.
FIG5_SCORES = [
    [0.99, 0.22, 0.12, 0.92],
    [0.73, 0.46, 0.14, 0.59],
    [0.52, 0.33, 0.25, 0.17],
    [0.58, 0.23, 0.12, 0.01],
    [0.63, 0.84, 0.10, 0.14],
    [0.72, 0.89, 0.65, 0.14],
    [0.58, 0.85, 0.32, 0.07],
    [0.22, 0.45, 0.77, 0.41],
]


@pytest.mark.parametrize("method", QB_METHODS)
def test_fig5_one_update_balances_the_batch(method):
    logits = torch.logit(torch.tensor(FIG5_SCORES, dtype=torch.float64)).float()
    zero = torch.zeros(4)
    R = route(logits, zero, 1)
    assert expert_load(R.indices, 4).tolist() == [4, 3, 1, 0]
    bal = ExpertBalancer(4, 1, method)
    bal.observe(R, zero)
    assert bal.load_stats() == {"max_over_mean": 2.0, "min_over_mean": 0.0}
    b = bal.update(zero)
    # The overloaded experts are pushed down, the idle ones pulled up.
    assert b[0] < b[2] and b[1] < b[2] and b[0] < b[3] and b[1] < b[3]
    assert expert_load(route(logits, b, 1).indices, 4).tolist() == [2, 2, 2, 2]
    if method == "exact":
        assert torch.equal(b, quantile_bias_exact(R.scores, R.cutoff, 1))


# ---------------------------------------------------------------------------------------------
# 4. Mean-centring and shift invariance.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", QB_METHODS)
def test_new_bias_is_mean_centred_and_shift_invariant(method):
    E, k = 48, 6
    R, bias, logits = _random_routing(600, E, k, seed=7, bias_scale=0.5)
    bal = ExpertBalancer(E, k, method, bins=500)
    bal.observe(R, bias)
    new = bal.update(bias)
    assert abs(float(new.double().mean())) < 1e-6

    # A common offset on the bias selects the same experts ...
    c = 0.5
    R_shift = route(logits, bias + c, k)
    assert torch.equal(_selected(R_shift), _selected(R))
    assert torch.allclose(R_shift.cutoff, R.cutoff + c, atol=1e-6)
    # ... and QB, which sees the old bias only through the cutoffs, returns the same centred bias.
    bal.observe(R_shift, bias + c)
    assert torch.allclose(bal.update(bias + c), new, atol=1e-5)
    # Adding a constant to the new bias leaves the next routing unchanged too.
    # (compared as sets: a QB bias can create near-ties, whose order inside the top-k may flip on rounding)
    assert torch.equal(_selected(route(logits, new, k)), _selected(route(logits, new + 0.25, k)))


# ---------------------------------------------------------------------------------------------
# 5. Accumulation over micro-batches equals one big batch; window bookkeeping.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
def test_micro_batches_equal_one_big_batch(method):
    E, k, m = 40, 5, 1100
    R, bias, _ = _random_routing(m, E, k, seed=11)
    whole = ExpertBalancer(E, k, method, bins=300)
    whole.observe(R, bias)
    parts = ExpertBalancer(E, k, method, bins=300)
    for a, b in ((0, 1), (1, 400), (400, 401), (401, m)):
        parts.observe(_rows(R, a, b), bias)
    sw, sp = whole.state_dict(), parts.state_dict()
    assert torch.equal(sw["counts"], sp["counts"])  # histogram counts and loads identical
    assert torch.equal(sw["hist_range"], sp["hist_range"])
    assert sw["num_tokens"] == sp["num_tokens"] == m
    assert whole.load_stats() == parts.load_stats()
    bw, bp = whole.update(bias), parts.update(bias)
    assert torch.equal(bw, bp)
    if method == "exact":
        assert torch.equal(bp, quantile_bias_exact(R.scores, R.cutoff, k))
    if method == "sign":
        load = expert_load(R.indices, E).double()
        expect = bias + 1e-3 * torch.sign(load.mean() - load).float()
        assert torch.allclose(bp, expect, atol=1e-7)
        assert not torch.equal(bp, bias)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_empty_window_returns_bias_and_update_resets(method):
    E, k = 12, 2
    bias = torch.linspace(-0.1, 0.1, E)
    bal = ExpertBalancer(E, k, method, bins=100)
    out = bal.update(bias)
    assert torch.equal(out, bias) and out is not bias
    assert math.isnan(bal.load_stats()["max_over_mean"])
    R, _, _ = _random_routing(200, E, k, seed=3)
    bal.observe(R, bias)
    assert not math.isnan(bal.load_stats()["max_over_mean"])
    first = bal.update(bias)
    assert torch.equal(bal.last_load, expert_load(R.indices, E))
    assert math.isnan(bal.load_stats()["max_over_mean"])  # reset
    assert torch.equal(bal.update(first), first)  # nothing observed since


def test_histogram_range_is_fixed_at_the_first_observe_of_the_window():
    E, k = 10, 2
    R, bias, _ = _random_routing(300, E, k, seed=5)
    bal = ExpertBalancer(E, k, "histogram", bins=64)
    bal.observe(_rows(R, 0, 150), bias)
    bal.observe(_rows(R, 150, 300), bias * 3)  # a different bias later in the window does not move the bins
    lo, hi = bal.state_dict()["hist_range"].tolist()
    assert lo == pytest.approx(float(bias.min()) - 1) and hi == pytest.approx(float(bias.max()) + 1)
    ref = ExpertBalancer(E, k, "histogram", bins=64)
    ref.observe(R, bias)
    assert torch.equal(bal.update(bias), ref.update(bias))
    # the next window takes the range afresh
    bal.observe(R, bias * 3)
    lo2, _ = bal.state_dict()["hist_range"].tolist()
    assert lo2 == pytest.approx(float(bias.min()) * 3 - 1)


# ---------------------------------------------------------------------------------------------
# 6. state_dict / load_state_dict mid-window.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ALL_METHODS)
def test_state_dict_resume_mid_window_is_bit_exact(method):
    E, k, m = 24, 3, 900
    R, bias, _ = _random_routing(m, E, k, seed=13)
    a = ExpertBalancer(E, k, method, bins=128)
    a.observe(_rows(R, 0, 500), bias)
    sd = a.state_dict()
    for key, v in sd.items():
        assert isinstance(v, (torch.Tensor, int, float, str)), key
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=True)  # no pickle-only objects

    b = ExpertBalancer(E, k, method, bins=128)
    b.load_state_dict(restored)
    a.observe(_rows(R, 500, m), bias)
    b.observe(_rows(R, 500, m), bias)
    assert a.load_stats() == b.load_stats()
    assert torch.equal(a.update(bias), b.update(bias))

    # the state dict is a copy: observing after state_dict() does not change it
    c = ExpertBalancer(E, k, method, bins=128)
    c.observe(R, bias)
    sd_c = c.state_dict()
    snapshot = {key: v.clone() if isinstance(v, torch.Tensor) else v for key, v in sd_c.items()}
    c.observe(R, bias)
    for key, v in sd_c.items():
        assert torch.equal(v, snapshot[key]) if isinstance(v, torch.Tensor) else v == snapshot[key]


def test_load_state_dict_rejects_other_configurations():
    sd = ExpertBalancer(16, 2, "histogram", bins=100).state_dict()
    with pytest.raises(ValueError, match="bins"):
        ExpertBalancer(16, 2, "histogram", bins=200).load_state_dict(sd)
    with pytest.raises(ValueError, match="method"):
        ExpertBalancer(16, 2, "exact", bins=100).load_state_dict(sd)
    with pytest.raises(ValueError, match="top_k"):
        ExpertBalancer(16, 3, "histogram", bins=100).load_state_dict(sd)
    with pytest.raises(ValueError, match="missing"):
        ExpertBalancer(16, 2, "histogram", bins=100).load_state_dict({"num_experts": 16})


# ---------------------------------------------------------------------------------------------
# 7. Distributed: 2 gloo processes, each observing part of the batch; one all-reduce per update.
# ---------------------------------------------------------------------------------------------

DIST_E, DIST_K, DIST_M, DIST_BINS, DIST_SEED = 32, 4, 1000, 256, 17
# rank 0 observes rows [0, 500) as two micro-batches, rank 1 rows [500, 1000) as one
DIST_PARTS = {0: [(0, 200), (200, 500)], 1: [(500, 1000)]}


def _dist_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    calls = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls.append(args[0].shape)
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counting_all_reduce
    try:
        R, bias, _ = _random_routing(DIST_M, DIST_E, DIST_K, seed=DIST_SEED)  # same batch on both ranks
        out = {}
        for method in ("histogram", "sign"):
            bal = ExpertBalancer(DIST_E, DIST_K, method, bins=DIST_BINS)
            for a, b in DIST_PARTS[rank]:
                bal.observe(_rows(R, a, b), bias)
            before = len(calls)
            out[method] = bal.update(bias)
            out[f"{method}_calls"] = len(calls) - before
            out[f"{method}_counter"] = bal.num_allreduce
            out[f"{method}_last_load"] = bal.last_load
            # a second window in which only rank 0 observes: rank 1 still joins the all-reduce
            if rank == 0:
                bal.observe(R, bias)
            out[f"{method}_rank0_only"] = bal.update(bias)
            out[f"{method}_counter2"] = bal.num_allreduce
        # an empty window on every rank returns the bias unchanged (after the same single all-reduce)
        bal = ExpertBalancer(DIST_E, DIST_K, "histogram", bins=DIST_BINS)
        out["empty"] = bal.update(bias)
        bal = ExpertBalancer(DIST_E, DIST_K, "exact")
        bal.observe(R, bias)
        try:
            bal.update(bias)
            out["exact_error"] = ""
        except RuntimeError as e:
            out["exact_error"] = str(e)
        out["calls"] = len(calls)
        out["shapes"] = [list(s) for s in calls]
        # diagnostics: the window routed again with the new bias, every rank's tokens (one more all-reduce)
        bal = ExpertBalancer(DIST_E, DIST_K, "histogram", bins=DIST_BINS, diagnostics=True)
        for a, b in DIST_PARTS[rank]:
            bal.observe(_rows(R, a, b), bias)
        out["diag_bias"] = bal.update(bias)
        out["diag_ideal"], out["diag_counter"] = bal.last_ideal_load, bal.num_allreduce
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.all_reduce = real_all_reduce
        dist.destroy_process_group()


def test_distributed_histogram_equals_single_process(tmp_path, monkeypatch):
    # Spawned workers import this module by name: make its top package importable from sys.path.
    depth = len(__name__.split("."))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[depth - 1]))
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)

    R, bias, _ = _random_routing(DIST_M, DIST_E, DIST_K, seed=DIST_SEED)
    for rank in (0, 1):
        out = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for method in ("histogram", "sign"):
            single = ExpertBalancer(DIST_E, DIST_K, method, bins=DIST_BINS)
            single.observe(R, bias)
            expect = single.update(bias)
            assert torch.equal(out[method], expect), (rank, method)
            assert torch.equal(out[f"{method}_rank0_only"], expect), (rank, method)
            assert out[f"{method}_calls"] == 1 and out[f"{method}_counter"] == 1
            assert out[f"{method}_counter2"] == 2
            assert torch.equal(out[f"{method}_last_load"], expert_load(R.indices, DIST_E))
        assert torch.equal(out["empty"], bias)
        assert "histogram" in out["exact_error"] and "exact" in out["exact_error"]
        # 2 methods x 2 windows + the empty window = 5 all-reduces, each one [E, C] tensor
        assert out["calls"] == 5
        assert out["shapes"][0] == [DIST_E, DIST_BINS + 1] and out["shapes"][2] == [DIST_E, 1]
        single = ExpertBalancer(DIST_E, DIST_K, "histogram", bins=DIST_BINS, diagnostics=True)
        single.observe(R, bias)
        assert torch.equal(out["diag_bias"], single.update(bias)) and out["diag_counter"] == 2
        assert torch.equal(out["diag_ideal"], single.last_ideal_load)


# ---------------------------------------------------------------------------------------------
# 8. Bad arguments.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_diagnostics_route_the_window_again_with_the_new_bias(method):
    R, bias, logits = _random_routing(600, 16, 3, seed=11)
    bal = ExpertBalancer(16, 3, method, diagnostics=True)
    plain = ExpertBalancer(16, 3, method)
    for a, b in ((0, 250), (250, 600)):  # two micro-batches of the window
        bal.observe(_rows(R, a, b), bias)
        plain.observe(_rows(R, a, b), bias)
    new = bal.update(bias)
    assert torch.equal(new, plain.update(bias))  # diagnostics change nothing of the balancing
    assert plain.last_ideal_load is None
    assert torch.equal(bal.last_ideal_load, expert_load(route(logits, new, 3).indices, 16))
    assert torch.equal(bal.last_load, expert_load(R.indices, 16))
    ratio = ideal_load_ratios([bal, plain])
    assert ratio[0] == pytest.approx(float(bal.last_ideal_load.max()) / (600 * 3 / 16)) and math.isnan(ratio[1])
    if method == "none":
        assert torch.equal(new, bias) and torch.equal(bal.last_ideal_load, bal.last_load)
    if method in QB_METHODS:  # the quantile bias balances the batch it came from far better than the bias it was routed with
        assert ratio[0] < 0.5 * float(bal.last_load.max()) / (600 * 3 / 16)


def test_bad_arguments_raise_value_error_naming_them():
    for kwargs, name in [
        (dict(num_experts=0, top_k=1), "num_experts"),
        (dict(num_experts=8.0, top_k=1), "num_experts"),
        (dict(num_experts=8, top_k=0), "top_k"),
        (dict(num_experts=8, top_k=8), "top_k"),
        (dict(num_experts=8, top_k=True), "top_k"),
        (dict(num_experts=8, top_k=2, method="median"), "method"),
        (dict(num_experts=8, top_k=2, bins=0), "bins"),
        (dict(num_experts=8, top_k=2, bins=10.5), "bins"),
        (dict(num_experts=8, top_k=2, sign_step=0.0), "sign_step"),
        (dict(num_experts=8, top_k=2, sign_step=float("nan")), "sign_step"),
    ]:
        with pytest.raises(ValueError, match=name):
            ExpertBalancer(**kwargs)

    R, bias, _ = _random_routing(50, 8, 2, seed=1)
    bal = ExpertBalancer(8, 2)
    with pytest.raises(ValueError, match="scores"):
        bal.observe(Routing(R.weights, R.indices, R.scores[:, :7], R.cutoff), bias)
    with pytest.raises(ValueError, match="cutoff"):
        bal.observe(Routing(R.weights, R.indices, R.scores, R.cutoff[:-1]), bias)
    with pytest.raises(ValueError, match="indices"):
        bal.observe(Routing(R.weights, R.indices[:, :1], R.scores, R.cutoff), bias)
    with pytest.raises(ValueError, match="bias"):
        bal.observe(R, bias[:-1])
    with pytest.raises(ValueError, match="bias"):
        bal.update(torch.zeros(7))

    with pytest.raises(ValueError, match="top_k"):
        quantile_bias_exact(R.scores, R.cutoff, 8)
    with pytest.raises(ValueError, match="scores"):
        quantile_bias_exact(R.scores[0], R.cutoff, 2)
    with pytest.raises(ValueError, match="cutoff"):
        quantile_bias_exact(R.scores, R.cutoff[:3], 2)

    counts = torch.ones(3, 5, dtype=torch.int64)
    with pytest.raises(ValueError, match="counts"):
        histogram_quantile(counts[0], 0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="hi"):
        histogram_quantile(counts, 1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="q"):
        histogram_quantile(counts, 0.0, 1.0, -1.0)
    with pytest.raises(ValueError, match="lo"):
        histogram_quantile(counts, float("nan"), 1.0, 1.0)


def test_load_stats_of_many_balancers_equals_each_ones_own():
    # The trainer reads every MoE layer's load statistics at once (one device read); empty windows give NaN.
    E, k = 12, 2
    bals = [ExpertBalancer(E, k, QB_METHODS[0]) for _ in range(3)]
    for seed, bal in ((1, bals[0]), (2, bals[2])):
        R, _, _ = _random_routing(300, E, k, seed=seed)
        bal.observe(R, torch.zeros(E))
    many = load_stats_of(bals)
    assert many[0] == bals[0].load_stats() and many[2] == bals[2].load_stats()
    assert many[0] != many[2] and many[0]["max_over_mean"] > 1.0
    assert all(math.isnan(v) for v in many[1].values())
    assert load_stats_of([]) == []
