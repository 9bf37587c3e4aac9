"""Speculative decoding never changes what a greedy request outputs: with the MTP draft (random weights: it is
almost never right), an oracle that proposes the target's own greedy tokens (every draft accepted: the multi-token
path) and a noisy oracle (partial acceptance), the engine's tokens, text, finish reasons, logprobs and streamed
outputs equal the engine's without speculation, under prefix-cache hits, chunked prefill, preemption and stop
strings."""

import functools

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from helpers import randomize_
from k3.config import K3Config
from k3.data.tokenizer import byte_level_tokenizer
from k3.model.model import K3ForCausalLM
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.generate import generate_tokens
from k3.serve.metrics import render_metrics
from k3.serve.sampling import SamplingParams
from k3.serve.scheduler import SchedulerConfig
from k3.serve.sequence import Status
from k3.serve.speculative.draft import Proposal
from k3.serve.speculative.switch import SpecSwitch

HB, PAGE, VOCAB = 16, 48, 512
LONGEST = 24  # the longest generation any test asks for


@functools.lru_cache(maxsize=1)
def _model():
    cfg = K3Config.from_preset("tiny").replace(vocab_size=VOCAB, eos_token_id=0)  # one MTP layer
    m = randomize_(K3ForCausalLM(cfg), seed=3).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(40)  # wide logit gaps: greedy choices do not hinge on last-bit rounding
    return m


@functools.lru_cache(maxsize=1)
def _tok():
    return byte_level_tokenizer(VOCAB)


@functools.lru_cache(maxsize=None)
def greedy_continuation(prompt: tuple) -> list[int]:
    """The target's greedy tokens after `prompt` (no stop rules): what the oracle proposes."""
    return list(generate_tokens(_model(), list(prompt), SamplingParams(max_tokens=LONGEST, temperature=0)))


class OracleDraft:
    """Proposes the target's own greedy tokens, through the engine's draft interface; with `wrong_every` = n, every
    n-th position (by the request's output length) is replaced by a wrong token, so verifications accept a prefix."""

    def __init__(self, wrong_every: int = 0):
        self.wrong_every = wrong_every
        self.observed: dict[str, int] = {}

    def propose(self, seqs, ks):
        out = []
        for s, k in zip(seqs, ks):
            ref = greedy_continuation(tuple(s.prompt_ids))
            j = len(s.output_ids)
            toks = (ref[j:j + k] + [1] * k)[:k]
            if self.wrong_every:
                toks = [(t + 1) % VOCAB if (j + i) % self.wrong_every == self.wrong_every - 1 else t
                        for i, t in enumerate(toks)]
            out.append(Proposal(toks))
        return out

    def observe(self, seq, start, hidden):
        assert hidden.shape[0] >= 1
        self.observed[seq.request_id] = start + hidden.shape[0]

    def forget(self, seq):
        self.observed.pop(seq.request_id, None)


class EveryThirdPlain(SpecSwitch):
    """Runs every third decode step plain, the others speculative: plain decode steps over requests that speculated
    (with pending positions to replay, proposals drafted ahead to drop), and verifications that follow
    verifications."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def decide(self, batch):
        self.n += 1
        return self.n % 3 != 0


def _engine(draft=None, spec="off", k=3, mb=4.0, chunk=40, step_tokens=96, tokenizer=True, fused=False):
    eng = LLMEngine(_model(), _tok() if tokenizer else None, EngineConfig(
        cache_memory_mb=mb, page_tokens=PAGE, hash_block_tokens=HB, speculative=spec, num_draft_tokens=k,
        fused_replay=fused,
        scheduler=SchedulerConfig(max_step_tokens=step_tokens, prefill_chunk=chunk, max_num_seqs=8)), draft=draft)
    eng.eos_id = None
    return eng


def _run(eng, waves):
    """Submit requests (waves of (prompt, params)), stepping twice between waves; returns [(seq, streamed token
    ids, streamed text)]."""
    seqs, streamed = [], {}
    for wave in waves:
        for prompt, p in wave:
            seqs.append(eng.add_request(list(prompt), p))
        for _ in range(2):
            for o in eng.step():
                ids, text = streamed.setdefault(o.request_id, ([], []))
                ids += o.new_token_ids
                text.append(o.new_text)
    for _ in range(3000):
        if not eng.has_work():
            break
        for o in eng.step():
            ids, text = streamed.setdefault(o.request_id, ([], []))
            ids += o.new_token_ids
            text.append(o.new_text)
    assert not eng.has_work()
    return [(s, streamed[s.request_id][0], "".join(streamed[s.request_id][1])) for s in seqs]


@functools.lru_cache(maxsize=None)
def reference(prompt: tuple, max_tokens: int, stop: tuple, logprobs: int | None):
    """The request alone on an engine without speculation: (tokens, text, finish reason, logprobs)."""
    p = SamplingParams(max_tokens=max_tokens, temperature=0, stop=list(stop), logprobs=logprobs)
    s = _engine(mb=8.0).generate([list(prompt)], p)[0]
    return s.output_ids, s.text, s.finish_reason, s.logprobs


def _check(results, params):
    for (s, ids, text), p in zip(results, params):
        assert s.status == Status.FINISHED
        want = reference(tuple(s.prompt_ids), p.max_tokens, tuple(p.stop), p.logprobs)
        got = (s.output_ids, s.text, s.finish_reason, s.logprobs)
        assert got[:3] == want[:3], (s.request_id, got[:3], want[:3])
        # Same tokens and alternatives; logprobs to 1e-3: the logits are ~1e2 here (lm_head x 40), and a verification
        # runs KDA over its window in the chunked form where plain decoding takes the token recurrence, so they
        # differ by fp32 rounding (~1e-6 relative).
        for a, b in zip(got[3], want[3]):
            assert a["token"] == b["token"] and [i for i, _ in a["top"]] == [i for i, _ in b["top"]]
            assert abs(a["logprob"] - b["logprob"]) < 1e-3
        assert ids == s.output_ids and text == s.text  # what was streamed is the output


def _prompts(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    base = torch.randint(1, VOCAB, (120,), generator=g).tolist()
    return [base[: 20 + 13 * i] + torch.randint(1, VOCAB, (i % 3,), generator=g).tolist() for i in range(n)]


def random_waves(data, stop_string, waves: int = 3, per_wave: int = 4, longest: int = 110, extra: int = 5,
                 logprobs: bool = False):
    """Waves of greedy requests drawn by hypothesis `data`: up to `per_wave` each, prompts of 5..`longest` tokens, half
    of them prefixes of one shared base plus up to `extra` tokens (prefix-cache hits), the others of their own (small
    pools preempt), max_tokens 1..16, half with a stop string from stop_string(prompt, max_tokens), logprobs None or 1
    where `logprobs`. Returns (waves of (prompt, params), every request's params in order)."""
    base = _prompts(data.draw(st.integers(0, 3)), 1)[0] * 2
    out, params = [], []
    for _ in range(data.draw(st.integers(1, waves))):
        wave = []
        for _ in range(data.draw(st.integers(1, per_wave))):
            n = data.draw(st.integers(5, longest))
            if data.draw(st.booleans()):
                prompt = base[:n] + data.draw(st.lists(st.integers(1, VOCAB - 1), max_size=extra))
            else:
                prompt = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=n, max_size=n))
            max_tokens = data.draw(st.integers(1, 16))
            stop = stop_string(prompt, max_tokens) if data.draw(st.booleans()) else []
            p = SamplingParams(max_tokens=max_tokens, temperature=0, stop=stop,
                               logprobs=data.draw(st.sampled_from([None, 1])) if logprobs else None)
            wave.append((prompt, p))
            params.append(p)
        out.append(wave)
    return out, params


def _mixed(batch) -> bool:
    """A mixed forward (ModelRunner.execute's packed forward of plain requests and verifications): some of the
    batch's requests are verifications, not all."""
    return 0 < batch.n_verify < len(batch.tokens)


@pytest.mark.parametrize("fused", [False, True])  # EngineConfig.fused_replay
def test_oracle_draft_accepts_every_draft_and_matches_plain_decoding(fused):
    prompts = _prompts(0, 4)
    params = [SamplingParams(max_tokens=LONGEST, temperature=0, logprobs=2)] * len(prompts)
    eng = _engine(OracleDraft(), k=4, fused=fused)
    _check(_run(eng, [list(zip(prompts, params))]), params)
    m = eng.metrics
    # every verification but those cut short near max_tokens takes all 4 drafts: the multi-token path
    assert m.draft_tokens_accepted == m.draft_tokens_proposed > 0
    assert m.mean_accepted_length > 4.0
    text = render_metrics(eng)
    assert f"k3_spec_draft_tokens_accepted_total {m.draft_tokens_accepted}" in text
    assert "k3_spec_mean_accepted_length" in text


def test_mtp_draft_matches_plain_decoding():
    prompts = _prompts(1, 3)
    params = [SamplingParams(max_tokens=12, temperature=0)] * len(prompts)
    eng = _engine(spec="mtp", k=3)
    _check(_run(eng, [list(zip(prompts, params))]), params)
    assert eng.metrics.spec_verifications > 0 and eng.metrics.draft_tokens_proposed > 0


@pytest.mark.parametrize("fused", [False, True])  # EngineConfig.fused_replay
def test_partial_acceptance_commits_exactly_the_accepted_prefix(fused):
    prompts = _prompts(2, 3)
    params = [SamplingParams(max_tokens=LONGEST, temperature=0)] * len(prompts)
    eng = _engine(OracleDraft(wrong_every=3), k=5, fused=fused)
    _check(_run(eng, [list(zip(prompts, params))]), params)
    m = eng.metrics
    assert 0 < m.draft_tokens_accepted < m.draft_tokens_proposed
    # the pages the verifications took beyond the accepted length went back: nothing is held once all finished
    st = eng.cache_stats()
    assert st["running"] == 0 and st["free_pages"] + st["evictable_pages"] == st["num_pages"]
    eng.cache.prefix.check_invariants()


def _stop_string(prompt, max_tokens):
    """A short piece of the request's reference text (a stop string it will meet), or none."""
    text = reference(tuple(prompt), max_tokens, (), None)[1]
    return [text[len(text) // 2: len(text) // 2 + 2]] if len(text) >= 4 else []


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck),
          phases=(Phase.explicit, Phase.reuse, Phase.generate))  # no shrinking: each example runs engines
@given(data=st.data())
def test_random_request_mixes_match_plain_decoding(data):
    kind = data.draw(st.sampled_from(["oracle", "noisy", "mtp"]))
    draft = {"oracle": OracleDraft(), "noisy": OracleDraft(wrong_every=data.draw(st.integers(2, 4))), "mtp": None}
    eng = _engine(draft[kind], spec="mtp" if kind == "mtp" else "off", k=data.draw(st.sampled_from([1, 2, 3, 5])),
                  mb=data.draw(st.sampled_from([0.5, 0.8, 4.0])), chunk=data.draw(st.sampled_from([16, 24, 40])),
                  step_tokens=data.draw(st.sampled_from([32, 96])))
    waves, params = random_waves(data, _stop_string, logprobs=True)
    _check(_run(eng, waves), params)
    eng.cache.prefix.check_invariants()


@pytest.mark.parametrize("fused", [False, True])  # EngineConfig.fused_replay
def test_preemption_under_speculation_matches_plain_decoding(fused):
    # five prompts of their own in a 14-page pool: requests that grow past a page while decoding preempt others
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (30 + i,), generator=g).tolist() for i in range(5)]
    params = [SamplingParams(max_tokens=LONGEST, temperature=0)] * len(prompts)
    eng = _engine(OracleDraft(wrong_every=4), k=3, mb=0.5, step_tokens=64, fused=fused)
    results = _run(eng, [list(zip(prompts, params))])
    assert eng.metrics.preemptions > 0 and eng.metrics.draft_tokens_accepted > 0
    _check(results, params)


def test_verifications_run_in_the_prefill_forward_equal_the_two_forwards_apart(monkeypatch):
    # With prefill chunks in a step (and no CUDA graphs), the step's verifications join the chunks' packed forward
    # (a mixed ForwardBatch through ModelRunner.execute): one pass over the weights. Each such forward is replayed
    # here from the same pool as the two forwards it replaces (`execute` of the chunks alone, and of the
    # verifications alone per number of drafts): the chunks' logits, hidden states and new KDA states, and the
    # verifications' logits, kept inputs and untouched KDA states agree to fp32 rounding (packed vs batched KDA
    # chunking; logits are ~1e2 here, lm_head x 40).
    from k3.serve.runner import ForwardBatch, ModelRunner

    seen = []
    orig = ModelRunner.execute

    def checked(self, batch):
        if not _mixed(batch):
            return orig(self, batch)
        tokens, starts, slots, n_verify = batch.tokens, batch.starts, batch.slots, batch.n_verify
        features = batch.features
        before = self.pool.pages.clone()
        res = orig(self, batch)
        v = res.verified
        after = self.pool.pages.clone()
        nb = len(tokens) - n_verify
        pages = v.kda_pages
        self.pool.pages.copy_(before)
        ref = self.execute(ForwardBatch(tokens[:nb], starts[:nb], slots[:nb], keep_hidden=True, features=features))
        torch.testing.assert_close(res.logits[:nb], ref.logits, rtol=1e-5, atol=2e-3)
        for a, b in zip(res.hidden, ref.hidden):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        for g in range(pages.shape[0]):
            # the verifications' states are the committed ones: the mixed forward wrote none of them
            torch.testing.assert_close(_kda_of(self, after, pages[g]), _kda_of(self, before, pages[g]),
                                       rtol=0, atol=0)
        by_len: dict[int, list[int]] = {}
        for j in range(n_verify):
            by_len.setdefault(len(tokens[nb + j]), []).append(j)
        for T, rows in by_len.items():
            ref_v = self.execute(ForwardBatch([tokens[nb + j] for j in rows], [starts[nb + j] for j in rows],
                                              [slots[nb + j] for j in rows], n_verify=len(rows),
                                              features=features)).verified
            torch.testing.assert_close(v.logits[rows, :T], ref_v.logits, rtol=1e-5, atol=2e-3)
            for g in range(len(v.kda_views)):
                got, want = v.kda_views[g].inputs, ref_v.kda_views[g].inputs
                for x, y in zip([*got.pre_conv, got.q, got.k, got.v, got.z, got.beta_logits],
                                [*want.pre_conv, want.q, want.k, want.v, want.z, want.beta_logits]):
                    torch.testing.assert_close(x[rows, :T], y, rtol=1e-4, atol=1e-4)
        kda_prefill = [[s.kda_pages[g] for s in slots[:nb]] for g in range(pages.shape[0])]
        for g, pg in enumerate(kda_prefill):
            pg = torch.tensor(pg)
            torch.testing.assert_close(_kda_of(self, after, pg), _kda_of(self, self.pool.pages, pg),
                                       rtol=1e-4, atol=1e-5)
        self.pool.pages.copy_(after)  # go on from the mixed forward's pool
        seen.append((nb, n_verify, sorted(by_len)))
        return res

    def _kda_of(runner, pages_tensor, ids):
        keep = runner.pool.pages
        runner.pool.pages = pages_tensor
        try:
            state, conv = runner.pool.read_kda(ids)
            return torch.cat([state.flatten(1), conv.flatten(1)], 1).clone()
        finally:
            runner.pool.pages = keep

    monkeypatch.setattr(ModelRunner, "execute", checked)
    prompts = _prompts(1, 5)
    params = [SamplingParams(max_tokens=LONGEST, temperature=0, logprobs=1)] * len(prompts)
    eng = _engine(OracleDraft(wrong_every=3), k=3, step_tokens=64)
    results = _run(eng, [list(zip(prompts[:2], params[:2])), list(zip(prompts[2:], params[2:]))])
    assert seen and all(nb > 0 and nv > 0 for nb, nv, _ in seen), seen
    _check(results, params)


def test_mix_verify_off_runs_verifications_apart_with_the_same_output(monkeypatch):
    from k3.serve.runner import ModelRunner

    orig = ModelRunner.execute

    def never(self, batch):
        if _mixed(batch):
            raise AssertionError("mix_verify=False must not run a mixed forward")
        return orig(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", never)
    prompts = _prompts(1, 3)
    params = [SamplingParams(max_tokens=12, temperature=0)] * len(prompts)
    eng = _engine(OracleDraft(wrong_every=3), k=3, step_tokens=64)
    eng.cfg.mix_verify = False
    _check(_run(eng, [list(zip(prompts[:1], params[:1])), list(zip(prompts[1:], params[1:]))]), params)
    assert eng.metrics.spec_verifications > 0
    with pytest.raises(ValueError, match="mix_verify"):
        EngineConfig(mix_verify="yes").validate()


def test_a_prompt_scored_in_a_mixed_forward_has_the_plain_engines_prompt_logprobs(monkeypatch):
    # a request asking for prompt logprobs prefills while another speculates: its chunks share the packed forward
    # with the verification, and its prompt logprobs are those of an engine without speculation (1e-3, as above)
    from k3.serve.runner import ModelRunner

    mixed = []
    orig = ModelRunner.execute
    monkeypatch.setattr(ModelRunner, "execute",
                        lambda self, batch: (mixed.append(1) if _mixed(batch) else None) or orig(self, batch))
    prompts = _prompts(2, 3)
    decoding = SamplingParams(max_tokens=16, temperature=0)
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=2)

    def go(eng):
        a = eng.add_request(prompts[0], decoding)
        for _ in range(3):
            eng.step()
        b = eng.add_request(prompts[2], scored)
        while eng.has_work():
            eng.step()
        return a, b

    a, b = go(_engine(OracleDraft(wrong_every=3), k=3, step_tokens=64))
    assert mixed
    ra, rb = go(_engine())
    assert (a.output_ids, b.output_ids) == (ra.output_ids, rb.output_ids)
    assert len(b.prompt_logprobs) == len(rb.prompt_logprobs)
    for x, y in zip(b.prompt_logprobs, rb.prompt_logprobs):
        assert (x is None) == (y is None)
        if x is not None:
            assert x["token"] == y["token"] and [i for i, _ in x["top"]] == [i for i, _ in y["top"]]
            assert abs(x["logprob"] - y["logprob"]) < 1e-3


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mix", [True, False])
def test_every_model_forward_of_a_step_runs_through_the_runners_one_door(mix, fused):
    # One path into the model: prefill chunks, decode steps, verifications (alone, or mixed with prefill) all run
    # inside ModelRunner.execute; the replay of accepted drafts is a KDA layer's, not a model forward (with fused
    # replay, part of the next verification's).
    eng = _engine(OracleDraft(wrong_every=3), k=3, step_tokens=64, fused=fused)
    eng.cfg.mix_verify = mix
    inside, kinds, outside = [False], set(), []
    execute, forward = eng.runner.execute, eng.model.forward

    def door(batch):
        inside[0] = True
        kinds.add("plain" if not batch.n_verify else "verify" if batch.n_verify == len(batch.tokens) else "mixed")
        try:
            return execute(batch)
        finally:
            inside[0] = False

    def model_forward(*args, **kwargs):
        if not inside[0]:
            outside.append(1)
        return forward(*args, **kwargs)

    prompts = _prompts(1, 3)
    params = [SamplingParams(max_tokens=12, temperature=0)] * len(prompts)
    for p in prompts:  # the oracle's and the check's references first: their forwards are not this engine's
        greedy_continuation(tuple(p))
        reference(tuple(p), 12, (), None)
    eng.runner.execute, eng.model.forward = door, model_forward
    try:
        results = _run(eng, [list(zip(prompts[:1], params[:1])), list(zip(prompts[1:], params[1:]))])
    finally:
        del eng.model.forward  # the shared model's own forward again
    _check(results, params)
    assert not outside
    assert kinds == ({"plain", "verify", "mixed"} if mix else {"plain", "verify"}), kinds
