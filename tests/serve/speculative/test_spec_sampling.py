"""Speculative sampling keeps the target's distribution: chi-square tests of the tokens it emits against the exact
distributions, with fixed seeds (deterministic), at significance 1e-3 (a correct implementation fails with
probability 1e-3 for a given seed; a wrong acceptance rule, e.g. accepting every draft or resampling from p instead
of (p - q)+, gives p-values below 1e-12 at these sample sizes)."""

import pytest
import torch

from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams, probs
from k3.serve.scheduler import SchedulerConfig
from k3.serve.speculative.accept import accept, accept_batch

ALPHA = 1e-3


def chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of `counts` against `expected_probs`; cells expecting fewer than 5 samples are
    pooled into one (the usual validity rule)."""
    n = counts.sum()
    exp = expected_probs.double() * n
    small = exp < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    exp = torch.cat([exp[~small], exp[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi_square_helper_rejects_a_wrong_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2])
    draws = torch.multinomial(p, 5000, replacement=True, generator=g)
    counts = torch.bincount(draws, minlength=3)
    assert chi_square_p(counts, p) > ALPHA
    assert chi_square_p(counts, torch.tensor([0.45, 0.35, 0.2])) < 1e-6


def _rule_samples(draft_q, n: int, params: SamplingParams, seed: int, wrong: bool = False):
    """Emit two tokens from a synthetic target (p0 for the first, p1[x1] for the second given the first) with one
    draft token drawn from q (None: a deterministic draft, always token 0); returns the (x1, x2) counts [V, V] and
    their exact probabilities. `wrong`: a broken rule instead of `accept`."""
    V = 6
    g = torch.Generator().manual_seed(seed)
    logits0 = torch.randn(V, generator=g) * 1.5
    logits1 = torch.randn(V, V, generator=g) * 1.5
    counts = torch.zeros(V, V, dtype=torch.long)
    for _ in range(n):
        if draft_q is None:
            d, q = 0, None
        else:
            d = int(torch.multinomial(draft_q, 1, generator=g))
            q = draft_q[None]
        rows = torch.stack([logits0, logits1[d]])  # the target's logits after the prefix and after the draft
        if wrong:  # a plausible bug: after a rejection, draw from p instead of the residual (p - q)+
            p0 = probs(logits0[None], params)[0]
            ok = float(torch.rand(1, generator=g)) * float(q[0, d]) < float(p0[d])
            out = [d] if ok else [int(torch.multinomial(p0, 1, generator=g))]
        else:
            out = accept(rows, [d], q, params, g)
        x1 = out[0]
        x2 = out[1] if len(out) > 1 else int(torch.multinomial(probs(logits1[x1][None], params)[0], 1, generator=g))
        counts[x1, x2] += 1
    p0 = probs(logits0[None], params)[0]
    p1 = probs(logits1, params)
    return counts.flatten(), (p0[:, None] * p1).flatten()


def test_acceptance_rule_keeps_the_target_distribution():
    q = torch.tensor([0.4, 0.05, 0.05, 0.2, 0.2, 0.1])
    for params, draft in [(SamplingParams(temperature=1.0), q), (SamplingParams(temperature=0.7, top_k=4), q),
                          (SamplingParams(temperature=1.0, top_p=0.8), None)]:
        counts, expect = _rule_samples(draft, 6000, params, seed=1)
        assert chi_square_p(counts, expect) > ALPHA, params
    # the test has power: drawing from p instead of the residual after a rejection skews the distribution
    counts, expect = _rule_samples(q, 6000, SamplingParams(temperature=1.0), seed=1, wrong=True)
    assert chi_square_p(counts, expect) < 1e-12


@pytest.mark.slow
def test_engine_speculative_sampling_equals_the_target_distribution():
    """The engine with the MTP draft (drafts sampled from the draft's distribution) against the exact joint
    distribution of the first three generated tokens of a tiny model with an 8-token vocabulary (512 cells, rare
    ones pooled). The first is sampled after the prefill; one draft is verified for the second (accepted, or
    corrected from the residual), and the third is the verification's bonus token when the draft was accepted,
    else a plain step's."""
    V, P, N = 8, 5, 3000
    cfg = K3Config.from_preset("tiny").replace(vocab_size=V, eos_token_id=None, bos_token_id=None,
                                               pad_token_id=None)
    model = K3ForCausalLM(cfg).init_weights(seed=4).eval()
    prompt = [1, 5, 2, 7, 3][:P]
    with torch.no_grad():  # the exact joint over (t1, t2, t3) from full forwards
        ids = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])  # [V * V, P + 2]
        logp = torch.log_softmax(model(ids).logits.double(), -1)
        p1 = logp[0, P - 1].exp()  # [V]
        p2 = logp[::V, P].exp()  # [V (t1), V]
        p3 = logp[:, P + 1].exp().view(V, V, V)  # [t1, t2, V]
        joint = p1[:, None, None] * p2[:, :, None] * p3
    eng = LLMEngine(model, None, EngineConfig(cache_memory_mb=64, page_tokens=16, hash_block_tokens=16,
                                              enable_prefix_cache=False, speculative="mtp", num_draft_tokens=2,
                                              scheduler=SchedulerConfig(max_num_seqs=64, max_step_tokens=512)))
    eng.eos_id = None
    counts = torch.zeros(V ** 3, dtype=torch.long)
    for start in range(0, N, 250):
        seqs = eng.generate([prompt] * 250, [SamplingParams(max_tokens=3, temperature=1.0, seed=start + i)
                                             for i in range(250)])
        for s in seqs:
            a, b, c = s.output_ids
            counts[(a * V + b) * V + c] += 1
    m = eng.metrics
    assert m.spec_verifications >= N and 0 < m.draft_tokens_accepted < m.draft_tokens_proposed
    assert chi_square_p(counts, joint.flatten()) > ALPHA


def test_greedy_acceptance_with_targets_read_back_for_the_batch():
    """`greedy_targets` reads every greedy row's argmax back at once; `accept` given them emits what it emits when it
    reads them itself, for every acceptance length, and refuses a target of the wrong length."""
    import pytest

    from k3.serve.speculative.accept import accept, greedy_targets

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 50, generator=g)
    argmax = logits.argmax(-1).tolist()
    params = SamplingParams(max_tokens=8, temperature=0)
    targets = greedy_targets(logits, [0, 2])
    assert targets == {0: argmax[0], 2: argmax[2]} and greedy_targets(logits, []) == {}
    assert greedy_targets(logits, [0, 1, 2]) == dict(enumerate(argmax))  # every row: the whole tensor's argmax
    assert greedy_targets(logits.bfloat16(), [1]) == {1: logits.bfloat16()[1].argmax(-1).tolist()}
    for row in (0, 2):
        for n in range(4):  # the first n drafts right, then a wrong one (or all 3 right)
            drafts = argmax[row][:n] + [(argmax[row][n] + 1) % 50] * (3 - n) if n < 3 else argmax[row][:3]
            want = accept(logits[row], drafts, None, params)
            assert accept(logits[row], drafts, None, params, target=targets[row]) == want
            assert len(want) == n + 1
    with pytest.raises(ValueError, match="target tokens"):
        accept(logits[0], [1, 2, 3], None, params, target=[1, 2])
    # drafts left on the device read back in the same transfer, after their row's targets (rows without: zeros)
    drafts = {0: torch.tensor([7, 8, 9]), 2: torch.tensor([1, 2, 3])}
    both = greedy_targets(logits, [0, 1, 2], drafts)
    assert both == {0: argmax[0] + [7, 8, 9], 1: argmax[1] + [0, 0, 0], 2: argmax[2] + [1, 2, 3]}
    assert greedy_targets(logits, [2, 0], drafts) == {2: argmax[2] + [1, 2, 3], 0: argmax[0] + [7, 8, 9]}
    with pytest.raises(ValueError, match="greedy rows only"):
        greedy_targets(logits, [0], drafts)
    with pytest.raises(ValueError, match="all of one length"):
        greedy_targets(logits, [0, 2], {0: torch.tensor([7, 8]), 2: torch.tensor([1, 2, 3])})
    with pytest.raises(ValueError, match="not greedy"):
        greedy_targets(logits, [], drafts)


def test_a_verification_decided_together_equals_each_request_alone():
    # greedy and sampled requests (a draft distribution, a one-hot draft, top-k, top-p, no drafts) decided in one
    # batch give what each gives alone from the same generator state: a request's tokens do not depend on the others
    g = torch.Generator().manual_seed(5)
    V = 20
    ks = [3, 2, 0, 3, 1, 2]
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0), SamplingParams(temperature=0.7),
              SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.2, top_p=0.8),
              SamplingParams(temperature=1.0)]
    for trial in range(20):
        logits = [torch.randn(k + 1, V, generator=g) * 2 for k in ks]
        qs = [torch.softmax(torch.randn(k, V, generator=g), -1) if i in (0, 3) else None for i, k in enumerate(ks)]
        drafts = [(torch.multinomial(q, 1, generator=g)[:, 0].tolist() if q is not None else
                   torch.randint(0, V, (k,), generator=g).tolist()) for q, k in zip(qs, ks)]
        if trial % 2:  # the greedy request's drafts all agree with its target
            drafts[1] = logits[1].argmax(-1)[:-1].tolist()
        gens = lambda: [torch.Generator().manual_seed(100 * trial + i) for i in range(len(ks))]  # noqa: E731
        together = accept_batch(logits, drafts, qs, params, gens())
        alone = [accept(x, d, q, p, gen) for x, d, q, p, gen in zip(logits, drafts, qs, params, gens())]
        assert together == alone
        assert all(1 <= len(t) <= k + 1 and t[:-1] == d[:len(t) - 1] for t, k, d in zip(together, ks, drafts))
