"""The RL losses (k3.rl.loss) against hand-computed gradients on tiny cases, the per-token treatment of tokens
sampled by older policy versions, and the loss through the Trainer's seam."""

import math

import pytest
import torch

from k3.rl.loss import RLLoss, RLLossConfig, rl_token_loss


def _grad(kind, logp, mu, adv, mask, **kw):
    x = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    terms = rl_token_loss(x, torch.tensor(mu, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                          torch.tensor(mask), RLLossConfig(kind=kind, **kw))
    terms.loss.backward()
    return terms, x.grad


def test_kimi_gradient_equals_hand_computed():
    # one row, 4 tokens: an on-policy token, two drifted ones inside [alpha, beta], one outside, one untrained
    logp = [[-1.0, -0.5, -2.0, -0.1, -3.0]]
    mu = [[-1.0, -0.8, -1.5, -1.5, -0.2]]
    adv = [[0.5, 0.5, -1.0, 2.0, 7.0]]
    mask = [[True, True, True, True, False]]
    tau, alpha, beta = 0.1, 0.5, 2.0
    terms, g = _grad("kimi", logp, mu, adv, mask, tau=tau, alpha=alpha, beta=beta)
    n = 4
    want, loss = [], 0.0
    for lp, m, a, on in zip(logp[0], mu[0], adv[0], mask[0]):
        if not on:
            want.append(0.0)
            continue
        lr = lp - m
        rho = math.exp(lr)
        inside = alpha <= rho <= beta
        # J_t = clip-mask(rho) * A - tau * lr^2; dJ/dlogpi = inside * rho * A - 2 tau lr; L = -J / N
        want.append(-((rho * a if inside else 0.0) - 2 * tau * lr) / n)
        loss += -(rho * a - tau * lr * lr) / n
    assert torch.allclose(g[0], torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert float(terms.loss.detach()) == pytest.approx(loss, abs=1e-12)
    assert int(terms.masked) == 1  # the token at rho = e^1.4 > beta
    assert float(terms.tokens) == 4


def test_ppo_gradient_equals_hand_computed():
    logp = [[-1.0, -0.5, -2.0, -0.1, -1.2]]
    mu = [[-1.0, -0.8, -1.5, -1.5, -1.0]]
    adv = [[0.5, 0.5, -1.0, 2.0, -1.0]]
    mask = [[True] * 5]
    eps = 0.2
    terms, g = _grad("ppo", logp, mu, adv, mask, eps=eps)
    want = []
    for lp, m, a in zip(logp[0], mu[0], adv[0]):
        rho = math.exp(lp - m)
        unclipped, clipped = rho * a, min(max(rho, 1 - eps), 1 + eps) * a
        # min(rho A, clip(rho) A): the gradient flows through rho A when it is the smaller (or the clip is inactive)
        flows = unclipped <= clipped or (1 - eps) <= rho <= (1 + eps)
        want.append(-(rho * a if flows else 0.0) / 5)
    assert torch.allclose(g[0], torch.tensor(want, dtype=torch.float64), atol=1e-12)
    # rho = e^0.3 > 1.2 with A > 0 (token 1) and rho = e^-0.5 < 0.8 with A < 0 (token 2) are cut; token 3 (rho =
    # e^1.4, A > 0) too; token 4 (rho = e^-0.2 inside the range) flows
    assert int(terms.masked) == 3


def test_on_policy_tokens_are_plain_policy_gradient():
    """At pi = mu (fresh samples) both losses' gradient is -A / N per token: REINFORCE with the group baseline;
    kimi's penalty is zero there."""
    logp = [[-0.7, -1.3, -0.2]]
    adv = [[1.0, -0.5, 0.25]]
    for kind in ("kimi", "ppo"):
        _, g = _grad(kind, logp, logp, adv, [[True] * 3])
        assert torch.allclose(g[0], -torch.tensor(adv[0], dtype=torch.float64) / 3, atol=1e-12)


def test_stale_tokens_are_weighted_by_their_own_behaviour_logprob():
    """A row whose tokens came from two policy versions: each token's ratio is against the log-prob recorded for
    it, so the same current log-prob gives different weights; with zero advantage only the penalty acts, pulling
    each token back toward its own sampling policy by -2 tau log rho / N."""
    logp = [[-1.0, -1.0, -1.0]]
    mu = [[-1.0, -1.3, -0.6]]  # token 0 from the current version, 1 and 2 from an older one
    tau = 0.2
    _, g = _grad("kimi", logp, mu, [[0.0, 0.0, 0.0]], [[True] * 3], tau=tau)
    want = [2 * tau * (lp - m) / 3 for lp, m in zip(logp[0], mu[0])]
    assert torch.allclose(g[0], torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert g[0, 0] == 0  # the on-policy token is at the penalty's minimum
    _, g = _grad("kimi", logp, mu, [[1.0, 1.0, 1.0]], [[True] * 3], tau=0.0)
    want = [-math.exp(lp - m) / 3 for lp, m in zip(logp[0], mu[0])]
    assert torch.allclose(g[0], torch.tensor(want, dtype=torch.float64), atol=1e-12)


def test_normalizer_is_the_step_token_count():
    """Micro-batches pass the step's token count: two halves' losses sum to the whole batch's."""
    torch.manual_seed(0)
    logp, mu, adv = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64), \
        torch.randn(4, 6, dtype=torch.float64)
    mask = torch.rand(4, 6) > 0.3
    cfg = RLLossConfig(kind="kimi", tau=0.1, alpha=0.0, beta=1e9)
    whole = rl_token_loss(logp, mu, adv, mask, cfg).loss
    n = mask.sum()
    parts = sum(rl_token_loss(logp[i:i + 2], mu[i:i + 2], adv[i:i + 2], mask[i:i + 2], cfg, normalizer=n).loss
                for i in (0, 2))
    assert float(parts) == pytest.approx(float(whole), abs=1e-12)


def test_bad_loss_config_names_the_flag():
    with pytest.raises(ValueError, match="--loss"):
        RLLoss(RLLossConfig(kind="reinforce"))
    with pytest.raises(ValueError, match="--clip-range"):
        RLLoss(RLLossConfig(alpha=1.5, beta=2.0))
    with pytest.raises(ValueError, match="--tau"):
        RLLoss(RLLossConfig(tau=-1.0))


def test_rl_loss_through_the_seam_matches_its_definition():
    """RLLoss on a tiny model: the loss and the gradient of one weight equal those of the written-out objective
    (model log-probs of the labelled tokens, fp32, 1e-6 / 1e-5)."""
    from helpers import randomize_
    from k3.config import K3Config
    from k3.model.batch import BatchInfo
    from k3.model.model import K3ForCausalLM
    from k3.train.losses import MicroBatch

    torch.manual_seed(0)
    model = randomize_(K3ForCausalLM(K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0,
                                                                          pad_token_id=0)), seed=0)
    B, T, V = 2, 12, model.config.vocab_size
    ids = torch.randint(1, V, (B, T))
    labels = torch.full((B, T), -100)
    labels[0, 5:10], labels[1, 3:12] = ids[0, 5:10], ids[1, 3:12]
    mask = labels != -100
    mu = torch.randn(B, T) * 0.1 - 8.0
    adv = torch.where(mask, torch.tensor([[0.7], [-0.4]]).expand(B, T), torch.zeros(B, T))
    stale = torch.zeros(B, T, dtype=torch.long)
    stale[0, 5:7] = 2
    seg = torch.zeros(B, T, dtype=torch.long)
    info = BatchInfo.from_segment_ids(seg)
    cfg = RLLossConfig(kind="kimi", tau=0.3, alpha=0.0, beta=1e30)
    n = mask[:, 1:].sum().float()
    mb = MicroBatch({"input_ids": ids, "labels": labels, "behaviour": mu, "advantage": adv, "staleness": stale},
                    info, (), 1.0, n)
    out = RLLoss(cfg)(model, mb)
    out.loss.backward()
    w = model.lm_head.weight
    g_seam = w.grad.clone()
    model.zero_grad()
    logits = model(ids, batch=info, check_ids=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    m = mask[:, 1:]
    lr = lp - mu[:, 1:]
    j = (torch.exp(lr) * adv[:, 1:] - 0.3 * lr * lr) * m
    ref = -j.sum() / n
    ref.backward()
    assert float(out.loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-6, abs=1e-6)
    assert torch.allclose(g_seam, w.grad, rtol=1e-5, atol=1e-7)
    assert int(out.extra["by_staleness"][2]) == 2 and int(out.extra["by_staleness"].sum()) == int(m.sum())
