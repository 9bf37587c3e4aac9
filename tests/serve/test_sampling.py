"""Sampling (k3.serve.sampling): the batched distributions against one row at a time, and the drawn tokens against
the distribution they are drawn from."""

import pytest
import torch

from k3.serve.sampling import CDF_BLOCK, SamplingParams, cdf, probs, probs_rows, sample, sample_batch, uniforms


def _params():
    return [SamplingParams(temperature=0.8), SamplingParams(temperature=1.3, top_k=3),
            SamplingParams(temperature=1.0, top_p=0.6), SamplingParams(temperature=0.5, top_k=7, top_p=0.8),
            SamplingParams(temperature=1.0, top_k=40), SamplingParams(temperature=2.0, top_p=1.0)]


def test_every_row_under_its_own_params_equals_that_row_alone():
    # top_k 40 >= V (no cut), top_p 1 (no cut), cuts of both kinds together: each row of the batched pass is what
    # the row alone under its params gives
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3
    batched = probs_rows(logits, _params())
    for i, p in enumerate(_params()):
        assert torch.equal(batched[i], probs(logits[i:i + 1], p)[0])
    assert (batched[1] > 0).sum() == 3 and (batched[3] > 0).sum() <= 7 and (batched[4] > 0).all()


def test_drawn_tokens_follow_the_distribution_and_never_leave_the_cuts():
    # 40 requests x 300 steps of sample_batch (each request its own generator): the frequencies of each row's
    # tokens within 0.02 of its probabilities (over 4 sigma for 12,000 draws), tokens of probability 0 never drawn
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(1)) * 2
    params = _params()[:4]
    want = probs_rows(logits, params)
    rows = logits.repeat(10, 1)
    gens = [torch.Generator().manual_seed(100 + i) for i in range(40)]
    counts = torch.zeros(4, 12)
    for _ in range(300):
        toks = torch.tensor(sample_batch(rows, params * 10, gens)).view(10, 4)
        for r in range(4):
            counts[r] += torch.bincount(toks[:, r], minlength=12)
    freq = counts / counts.sum(-1, keepdim=True)
    assert (freq - want).abs().max() < 0.02
    assert not freq[want == 0].any()


def test_a_greedy_row_takes_the_argmax_and_a_seeded_row_repeats():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, top_p=0.9)
    draws = [sample_batch(logits, [SamplingParams(temperature=0), p, p],
                          [None, torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]) for _ in range(2)]
    assert draws[0] == draws[1] and draws[0][0] == int(logits[0].argmax())
    assert int(sample(logits[:1], SamplingParams(temperature=0))[0]) == int(logits[0].argmax())


def test_logprob_entries_of_a_step_equal_each_token_scored_alone():
    # every row's entry (its token's log-softmax and its k most likely alternatives, k = 0 giving none) from the
    # batched pass equals the row scored alone
    from k3.serve.postprocess import logprob_entries

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * 4
    toks, ks = [3, 60, 0, 17, 17], [0, 1, 5, 2, 0]
    got = logprob_entries(logits, toks, ks)
    for row, t, k, e in zip(logits, toks, ks, got):
        logp = torch.log_softmax(row.float(), -1)
        top = torch.topk(logp, max(k, 1))
        assert e == {"token": t, "logprob": float(logp[t]),
                     "top": [(int(i), float(v)) for v, i in zip(top.values, top.indices)][:k]}
    assert logprob_entries(logits[:0], [], []) == []


def test_a_steps_tokens_and_logprob_entries_come_back_in_one_read_back(monkeypatch):
    # read_step: the device tokens and the entries of the rows that ask for logprobs (all, some, none) equal the
    # tokens read alone and logprob_entries of those rows, from one tolist of one tensor
    from k3.serve.postprocess import logprob_entries, read_step

    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(4)) * 4
    toks = torch.tensor([3, 60, 0, 17, 17])
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    for want, ks in (([0, 1, 2, 3, 4], [0, 1, 5, 2, 0]), ([1, 3], [2, 0]), ([], [])):
        reads.clear()
        got, entries = read_step(logits, toks, want, ks)
        assert len(reads) == 1
        monkeypatch.setattr(torch.Tensor, "tolist", real)
        assert got == [3, 60, 0, 17, 17]
        assert entries == (logprob_entries(logits[want], [got[i] for i in want], ks) if want else [])
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    with pytest.raises(ValueError, match="counts for"):
        read_step(logits, toks, [0, 1], [1])


def test_a_step_of_no_rows_samples_nothing():
    assert sample_batch(torch.zeros(0, 8), [], []) == []
    assert sample_batch(torch.zeros(2, 8), [SamplingParams(temperature=0)] * 2, [None, None]) == [0, 0]


def test_unseeded_requests_draw_their_uniforms_together_and_seeded_ones_from_their_own_generator():
    # a seeded request's numbers are its generator's next ones whatever shares the step; the unseeded requests' come
    # from one draw of the default generator, in request order (what one torch.rand of their total gives)
    def gen(seed):
        return torch.Generator().manual_seed(seed)

    counts, seeds = [2, 3, 0, 1, 4], [None, 7, None, 9, None]
    torch.manual_seed(123)
    got = uniforms(counts, [gen(s) if s is not None else None for s in seeds], "cpu")
    torch.manual_seed(123)
    shared = torch.rand(2 + 0 + 4)
    want = torch.cat([shared[:2], torch.rand(3, generator=gen(7)), torch.rand(1, generator=gen(9)), shared[2:]])
    assert got.shape == (10,) and torch.equal(got, want)
    torch.manual_seed(5)
    every_free = uniforms([1, 1, 1], [None] * 3, "cpu")
    torch.manual_seed(5)
    assert torch.equal(every_free, torch.rand(3))
    assert uniforms([0, 0], [None, gen(1)], "cpu").shape == (0,)
    with pytest.raises(ValueError, match="counts for"):
        uniforms([1], [None, None], "cpu")


@pytest.mark.parametrize("V", [5, CDF_BLOCK, CDF_BLOCK + 1, 4 * CDF_BLOCK, 5 * CDF_BLOCK - 3])
def test_the_blockwise_cumulative_sums_equal_the_plain_ones_and_never_decrease(V):
    # rows with zeros (a cut's tokens), widths at, around and across whole blocks: fp64 rounding apart (1e-12) the
    # plain cumulative sum, non-decreasing, and the last entry the row's total
    g = torch.Generator().manual_seed(V)
    pr = torch.softmax(torch.randn(4, V, generator=g) * 4, -1)
    pr[:, ::3] = 0
    got, want = cdf(pr), pr.double().cumsum(-1)
    assert got.shape == (4, V) and got.dtype == torch.float64
    assert (got - want).abs().max() <= 1e-12
    assert bool((got[:, 1:] >= got[:, :-1]).all())
    # not vacuous: a block's offset left out is far
    if V > CDF_BLOCK:
        assert (got[:, CDF_BLOCK:] - pr.double()[:, CDF_BLOCK:].cumsum(-1)).abs().max() > 1e-3
