"""The policy-optimization losses of `k3 rl`, as per-token terms over sampled tokens, and their `Loss` for the
Trainer's seam (k3.train.losses).

Notation, per trained token t of a trajectory y sampled for prompt x (one of K samples of x):
    log rho_t = log pi_theta(y_t | x, y_<t) - log mu(y_t | x, y_<t)
where mu is the behaviour policy: the policy version that actually sampled token t, whose log-prob the rollout
engine recorded at sampling time. Under partial rollouts one trajectory holds tokens of several versions, so mu is
per token, never per trajectory. A = r(x, y) - mean_k r(x, y_k) is the group-mean baseline advantage (the same
for every token of y). N is the step's trained-token count (all micro-batches together).

`kimi` (Kimi K2.5's policy optimization, which K3 follows, report §4.1.2), to be maximized:
    J = 1/N sum_t [ clip(rho_t, alpha, beta) * A  -  tau * (log rho_t)^2 ]
The clip is a token mask, not a value clamp: a token whose ratio left [alpha, beta] contributes no policy-gradient
term (its rho is detached there), so tokens the policy has moved far from (stale tokens of old versions, or a
mismatch between the rollout and training numerics) cannot push further. The squared log-ratio keeps every token
in a neighbourhood of the policy that sampled it, whatever its age: d/d log pi of the penalty is -2 tau log rho_t,
a pull back towards mu proportional to the drift. This is the per-token form of Kimi K1.5/K2's online policy
mirror descent, whose objective regresses r - mean r - tau log(pi/mu) per trajectory.

`ppo` (the clipped importance-ratio baseline of PPO/GRPO, no KL term):
    J = 1/N sum_t min(rho_t * A, clip(rho_t, 1 - eps, 1 + eps) * A)

Both are written as a loss L = -J. Their gradient with respect to log pi_theta(y_t) (the quantity the tests
check against hand-computed values) is:
    kimi: dL/dlogpi_t = -(m_t * rho_t * A - 2 tau log rho_t) / N,  m_t = [alpha <= rho_t <= beta]
    ppo:  dL/dlogpi_t = -(u_t * rho_t * A) / N,  u_t = 0 where the clipped term is the smaller one and active
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.train.losses import LossOutput, MicroBatch, target_logprobs, trained_mask

IGNORE = -100
LOSSES = ("kimi", "ppo")


@dataclass(frozen=True)
class RLLossConfig:
    kind: str = "kimi"
    tau: float = 0.05  # kimi: the squared log-ratio's coefficient
    alpha: float = 0.5  # kimi: tokens with rho outside [alpha, beta] get no policy-gradient term
    beta: float = 2.0
    eps: float = 0.2  # ppo: the ratio's clip range [1 - eps, 1 + eps]

    def validate(self) -> None:
        if self.kind not in LOSSES:
            raise ValueError(f"--loss {self.kind!r} is invalid: one of {list(LOSSES)}")
        if not self.tau >= 0:
            raise ValueError(f"--tau {self.tau!r} is invalid: must be >= 0")
        if not 0 <= self.alpha < 1 < self.beta:
            raise ValueError(f"--clip-range {self.alpha!r} {self.beta!r} is invalid: need 0 <= alpha < 1 < beta")
        if not 0 < self.eps < 1:
            raise ValueError(f"--ppo-eps {self.eps!r} is invalid: must be in (0, 1)")


@dataclass
class RLTerms:
    loss: torch.Tensor  # scalar, differentiable
    tokens: torch.Tensor  # scalar: trained tokens of this micro-batch
    masked: torch.Tensor  # scalar: tokens whose policy-gradient term was cut (kimi: rho outside [alpha, beta];
    #                       ppo: the clipped side was taken and is flat)
    log_ratio_sq: torch.Tensor  # scalar: sum of (log rho)^2 over trained tokens
    log_ratio_abs: torch.Tensor  # scalar: sum of |log rho|
    max_ratio: torch.Tensor  # scalar: largest rho


def rl_token_loss(logp: torch.Tensor, behaviour: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
                  cfg: RLLossConfig, normalizer: float | torch.Tensor | None = None) -> RLTerms:
    """The loss of `cfg.kind` over [B, T] tensors: `logp` log pi_theta of the sampled tokens (with gradient),
    `behaviour` log mu (the recorded sampling log-probs), `advantage` A per token, `mask` True at trained tokens.
    `normalizer`: N (None: the mask's count; a micro-batch passes its step's count)."""
    mask = mask.bool()
    m = mask.to(logp.dtype)
    log_rho = torch.where(mask, logp - behaviour.detach().to(logp.dtype), torch.zeros_like(logp))
    rho = torch.exp(log_rho)
    adv = advantage.detach().to(logp.dtype)
    n = m.sum() if normalizer is None else normalizer
    if not torch.is_tensor(n):
        n = torch.tensor(float(n), dtype=logp.dtype, device=logp.device)
    n = n.to(logp.dtype).clamp_min(1)
    if cfg.kind == "kimi":
        inside = (rho.detach() >= cfg.alpha) & (rho.detach() <= cfg.beta)
        pg = torch.where(inside, rho, rho.detach()) * adv
        objective = (pg - cfg.tau * log_rho.square()) * m
        masked = (~inside & mask).sum()
    elif cfg.kind == "ppo":
        clipped = rho.clamp(1 - cfg.eps, 1 + cfg.eps)
        a, b = rho * adv, clipped * adv
        objective = torch.minimum(a, b) * m
        # the clipped term is taken and flat: no gradient for this token
        masked = (((b < a) & ((rho < 1 - cfg.eps) | (rho > 1 + cfg.eps))) & mask).sum()
    else:
        raise ValueError(f"unknown RL loss {cfg.kind!r}: one of {list(LOSSES)}")
    lr = log_rho.detach() * m
    return RLTerms(loss=-objective.sum() / n, tokens=m.sum().detach(), masked=masked.detach(),
                   log_ratio_sq=lr.square().sum(), log_ratio_abs=lr.abs().sum(),
                   max_ratio=(rho.detach() * m).amax() if mask.any() else torch.ones((), device=logp.device))


class RLLoss:
    """`rl_token_loss` over a micro-batch of `RLTrainer` rows (k3.rl.trainer): the policy's log-probs of the sampled
    tokens from one forward, against the batch's `behaviour` log-probs and `advantage` at the trained tokens
    (labels != -100), all elementwise in the micro-batch's alignment (k3.train.losses: a context-parallel segment's
    are shifted with its labels). Divided by the step's trained-token count, so micro-batches sum to the step's token mean.
    Statistics (`extra`): trained and masked tokens, sums of (log rho)^2 and |log rho|, the largest ratio, and the
    trained tokens per staleness (policy versions behind, the batch's `staleness` tensor)."""

    def __init__(self, cfg: RLLossConfig):
        cfg.validate()
        self.cfg = cfg

    def __call__(self, model, mb: MicroBatch) -> LossOutput:
        t = mb.tensors
        out = model(t["input_ids"], batch=mb.info, check_ids=False, stats=mb.stats)
        mask = trained_mask(mb)
        terms = rl_token_loss(target_logprobs(out.logits, mb), t["behaviour"], t["advantage"], mask, self.cfg,
                              normalizer=mb.step_tokens)
        stale = t["staleness"].long().clamp(0, 63)
        by_staleness = torch.bincount(stale[mask], minlength=64)
        extra = {"tokens": terms.tokens, "masked": terms.masked, "log_ratio_sq": terms.log_ratio_sq,
                 "log_ratio_abs": terms.log_ratio_abs, "max_ratio": terms.max_ratio, "by_staleness": by_staleness}
        return LossOutput(terms.loss, terms.loss.detach().double(), out.stats, extra=extra)
