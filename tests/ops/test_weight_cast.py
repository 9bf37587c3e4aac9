"""Weights cast once per training step with gradients summed straight into fp32 .grad (k3.ops.weight_cast)."""

import pytest
import torch
import torch.nn.functional as F

from helpers import randomize_
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.ops.weight_cast import WeightCasts, cached_stack, stacked_weight, weight


def _tiny(seed=0):
    cfg = K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(seed)
    return randomize_(K3ForCausalLM(cfg), seed=seed, scale=0.3)


def _grads_of_micro_batches(model, batches, cached: bool | WeightCasts, checkpointing: bool = False):
    """Sum of the gradients of several micro-batches under bf16 autocast, as the trainer accumulates them (with
    one step's WeightCasts when `cached`: a new one, or the one given)."""
    model.zero_grad(set_to_none=True)
    model.set_activation_checkpointing(checkpointing)
    losses = []
    casts = cached if isinstance(cached, WeightCasts) else (WeightCasts() if cached else None)
    with model.use_weight_casts(casts):
        for ids, seg in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(ids, labels=ids, segment_ids=seg)
                loss = out.loss + 0.3 * out.mtp_loss
            (loss * 0.5).backward()
            losses.append(float(out.loss.detach()))
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batches(n=2, B=2, T=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 512, (B, T), generator=g)
        seg = torch.zeros(B, T, dtype=torch.long)
        seg[:, T // 3:] = 1
        out.append((ids, seg))
    return out


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "activation-checkpointing"])
def test_gradients_are_bitwise_those_of_autocast(checkpointing):
    # The cast copy is what autocast makes; the fp32 add of a bf16 gradient is autograd's cast + accumulate.
    # So losses and every parameter's gradient, summed over two micro-batches, must be exactly equal.
    model = _tiny()
    batches = _batches()
    ref_losses, ref = _grads_of_micro_batches(model, batches, cached=False, checkpointing=checkpointing)
    losses, got = _grads_of_micro_batches(model, batches, cached=True, checkpointing=checkpointing)
    assert losses == ref_losses
    assert got.keys() == ref.keys()
    for name in ref:
        assert got[name].dtype == torch.float32 and got[name].is_contiguous()
        assert torch.equal(got[name], ref[name]), name


def test_each_weight_is_cast_once_per_step_and_again_after_it_changes():
    model = _tiny()
    batches = _batches(n=3)
    casts = WeightCasts()
    _grads_of_micro_batches(model, batches, cached=casts)
    per_step = casts.casts
    n_linear = sum(1 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert 0 < per_step < n_linear + 3 * len(model.model.layers)  # once per weight (or stack), not per micro-batch
    w = model.model.layers[0].mlp.down_proj.weight if hasattr(model.model.layers[0], "mlp") else None
    casts = WeightCasts()
    p = model.lm_head.weight if w is None else w
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = weight(p, casts)
        assert a.dtype == torch.bfloat16 and weight(p, casts).data_ptr() == a.data_ptr()  # cached
        with torch.no_grad():
            p.mul_(2)  # an in-place update bumps the version: cast again
        b = weight(p, casts)
    assert b.data_ptr() != a.data_ptr() and torch.equal(b, (p.detach()).to(torch.bfloat16))


def test_outside_the_context_or_autocast_nothing_changes():
    p = torch.nn.Parameter(torch.randn(8, 4))
    assert weight(p) is p  # no casts
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weight(p) is p and weight(p, None) is p  # no casts, under autocast
    casts = WeightCasts()
    assert weight(p, casts) is p  # no autocast
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weight(p.detach().to(torch.bfloat16), casts).dtype == torch.bfloat16  # not fp32: left alone
    computed = p * 2  # a weight computed in the forward (not a leaf) is new each time: never cached
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert weight(computed, casts) is computed and cached_stack([p, computed], casts=casts) is None
    assert casts.casts == 0
    ps = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5, 4))]
    s = stacked_weight(ps, pad=8)
    assert s.shape == (16, 4) and s.dtype == torch.float32 and torch.equal(s[:3], ps[0]) and not s[8:].any()


def test_stacked_weight_sends_each_parameter_its_rows_of_the_gradient():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(3, 16)), torch.nn.Parameter(torch.randn(5, 16))]
    frozen = torch.nn.Parameter(torch.randn(2, 16), requires_grad=False)
    x = torch.randn(6, 16)
    dy = torch.randn(6, 10 + 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = F.linear(x, torch.cat(ps + [frozen, torch.zeros(6, 16)]))
    (y.float() * dy).sum().backward()
    ref = [p.grad.clone() for p in ps]
    for p in ps:
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = F.linear(x, stacked_weight(ps + [frozen], pad=6, casts=WeightCasts()))
        (y2.float() * dy).sum().backward()
    assert torch.equal(y2, y)
    for p, r in zip(ps, ref):
        assert torch.equal(p.grad, r)
    assert frozen.grad is None


def test_trainer_steps_are_the_same_with_the_cache(tmp_path, monkeypatch):
    # The trainer uses the cache under autocast; switching it off must not change a step's numbers.
    import numpy as np

    from k3.data.packing import PackedLoader
    from k3.train.trainer import TrainConfig, Trainer

    made = []  # the WeightCasts the trainer made, one per step

    def run(on: bool):
        real = Trainer._weight_casts
        monkeypatch.setattr(Trainer, "_weight_casts", lambda self: made.append(real(self)) or made[-1] if on else None)
        model = _tiny()
        tc = TrainConfig(out=str(tmp_path / str(on)), max_steps=2, seq_len=32, batch_tokens=256,
                         micro_batch_rows=4, eval_every=100, eval_batches=1, save_every_minutes=1e9,
                         autocast_bf16=True)
        stream = np.random.default_rng(0).integers(0, 512, size=8000).astype(np.int32)
        loader = PackedLoader(stream, tc.seq_len, tc.rows_per_step, eos_id=0, seed=0)
        tr = Trainer(model, tc, loader, eos_id=0, log=lambda *a: None)
        return [tr.train_step() for _ in range(2)]

    on = run(True)
    assert len(made) == 2 and all(c.casts > 0 for c in made)  # the trainer really went through the cache
    off = run(False)
    for a, b in zip(on, off):
        assert (a.loss, a.mtp_loss, a.grad_norm) == (b.loss, b.mtp_loss, b.grad_norm)


def test_cached_stack_along_a_later_dim_routes_each_slice_back():
    # The experts' w1 [E, F, L] and w3 stacked per expert ([E, 2F, L]): gradients exactly autocast's.
    torch.manual_seed(1)
    w1, w3 = (torch.nn.Parameter(torch.randn(3, 4, 6)) for _ in range(2))
    x = torch.randn(3, 5, 6)
    dy = torch.randn(3, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.bmm(x, torch.cat([w1, w3], dim=1).transpose(1, 2))
    (y.float() * dy).sum().backward()
    ref = [w1.grad.clone(), w3.grad.clone()]
    w1.grad = w3.grad = None
    assert cached_stack([w1, w3], dim=1) is None  # without casts: the caller keeps its own path
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w13 = cached_stack([w1, w3], dim=1, casts=WeightCasts())
        assert w13.shape == (3, 8, 6) and w13.dtype == torch.bfloat16
        y2 = torch.bmm(x, w13.transpose(1, 2))
        (y2.float() * dy).sum().backward()
    assert torch.equal(y2, y)
    assert torch.equal(w1.grad, ref[0]) and torch.equal(w3.grad, ref[1])


def test_two_models_in_one_process_do_not_share_weight_casts():
    # Casting scoped to model a (its own modules only) leaves model b on plain autocast, while both run at once:
    # b's gradients are autograd's own (no cast copy made for it), a's the cached ones, both bitwise the reference.
    a, b = _tiny(seed=0), _tiny(seed=1)
    batches = _batches(n=2, seed=3)
    ref_a = _grads_of_micro_batches(a, batches, cached=False)
    ref_b = _grads_of_micro_batches(b, batches, cached=False)
    casts = WeightCasts()
    for m in (a, b):
        m.zero_grad(set_to_none=True)
    with a.use_weight_casts(casts):
        assert all(m.weight_casts is None for m in b.modules() if hasattr(m, "weight_casts"))
        for ids, seg in batches:  # the two models' micro-batches interleaved
            for m in (a, b):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = m(ids, labels=ids, segment_ids=seg)
                    loss = out.loss + 0.3 * out.mtp_loss
                (loss * 0.5).backward()
        n_a = casts.casts
    assert all(m.weight_casts is None for m in a.modules() if hasattr(m, "weight_casts"))  # scope ended
    a_params = {p.data_ptr() for p in a.parameters()}  # every cast copy is of a's weights, none of b's
    assert n_a > 0 and all(params[0].data_ptr() in a_params for params, _, _ in casts._cache.values())
    for model, (_, ref) in ((a, ref_a), (b, ref_b)):
        got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name], ref[name]), name
