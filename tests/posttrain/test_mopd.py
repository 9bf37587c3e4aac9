"""Multi-Teacher On-Policy Distillation (report §4.1.3): eq. 15's reward and its policy-gradient loss against
hand-computed gradients, partial rollouts that resume exactly, the rollout engine's cache retired after every
weight update, teacher selection by tag, bad inputs named, QAT rollouts computing as the training forward does,
and `k3 distill` end to end."""

import json
import os

import pytest
import torch

from helpers import randomize_, stop_after
from k3.checkpoint import save_pretrained
from k3.config import K3Config
from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer
from k3.model.model import K3ForCausalLM
from k3.posttrain.mopd import (PromptError, TeacherTable, opd_pg_loss, opd_reward, parse_teacher_spec, read_prompts,
                               token_logprobs)
from k3.posttrain.rollout import Rollout, RolloutEngine
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams

VOCAB = 512


def _cfg(**kw):
    return K3Config.from_preset("tiny").replace(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0,
                                                num_nextn_predict_layers=0, **kw)


def _model(seed):
    torch.manual_seed(seed)
    return randomize_(K3ForCausalLM(_cfg()), seed=seed)


def _tok():
    return K3Tokenizer(byte_level_tokenizer(VOCAB))


def _save(d, model, tok=None):
    save_pretrained(model, d, extra_files={"tokenizer.json": (tok or _tok()).to_str().encode()})
    return str(d)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A student and two teachers (different random weights), all with the byte-level tokenizer."""
    root = tmp_path_factory.mktemp("mopd")
    out = {name: _save(root / name, _model(seed)) for name, seed in (("student", 0), ("code", 1), ("docs", 2))}
    out["early_stopper"] = _save(root / "early_stopper", _early_stopper())
    return out


def _early_stopper(seed=0, c=4.0):
    """A model that ends a response with eos about a quarter of the time per token, so responses differ in length
    (in flight, some samples finish while others continue)."""
    m = _model(seed)
    hs = []
    hook = m.lm_head.register_forward_hook(lambda mod, inp, out: hs.append(inp[0]))
    with torch.no_grad():
        m(torch.randint(1, VOCAB, (4, 30), generator=torch.Generator().manual_seed(seed)))
        hook.remove()
        mu = hs[0].reshape(-1, hs[0].shape[-1]).mean(0)
        m.lm_head.weight[0] = c * mu / mu.norm() ** 2
    return m


def _engine_cfg():
    # hash blocks of 16 tokens: prompts of a few dozen tokens are prefix-cached
    return EngineConfig(cache_memory_mb=16, page_tokens=64, hash_block_tokens=16, cuda_graphs=False)


# --- eq. 15 and the loss ------------------------------------------------------------------------------------------

def test_reward_is_the_clipped_log_ratio_without_gradient():
    t = torch.tensor([-1.0, -2.0, -0.5, -9.0])
    s = torch.tensor([-1.5, -0.5, -7.0, -1.0], requires_grad=True)
    r = opd_reward(t, s, r_max=3.0)
    assert torch.equal(r, torch.tensor([0.5, -1.5, 3.0, -3.0]))  # 6.5 and -8 clipped to +-3
    assert not r.requires_grad  # sg(.): nothing flows back through the reward
    tt = t.clone().requires_grad_()
    assert not opd_reward(tt, s, 3.0).requires_grad
    with pytest.raises(ValueError, match="r_max"):
        opd_reward(t, s, 0.0)


@pytest.mark.parametrize("stale", [False, True])
def test_policy_gradient_matches_the_hand_computed_gradient(stale):
    torch.manual_seed(0)
    B, T, V = 2, 5, 7
    logits = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, T))
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    teacher = torch.randn(B, T, dtype=torch.float64) - 2
    r_max = 0.8
    logp = token_logprobs(logits, ids)
    behaviour = (logp.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64)) if stale else None
    terms = opd_pg_loss(logp, teacher, mask, r_max, behaviour_logp=behaviour)
    terms.loss.backward()
    # by hand: L = -(1/N) sum_t rho_t r_t, dL/dlogits[b, t-1] = -(1/N) rho_t r_t (onehot(y_t) - softmax(logits[b, t-1]))
    lp = logp.detach()
    r = (teacher - lp).clamp(-r_max, r_max)
    rho = torch.exp(lp - behaviour) if stale else torch.ones_like(lp)
    n = mask.sum()
    want = torch.zeros_like(logits)
    p = torch.softmax(logits.detach(), -1)
    for b in range(B):
        for t in range(1, T):
            if mask[b, t]:
                onehot = torch.nn.functional.one_hot(ids[b, t], V).double()
                want[b, t - 1] = -(rho[b, t] * r[b, t] / n) * (onehot - p[b, t - 1])
    torch.testing.assert_close(logits.grad, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(terms.loss.detach(), -(rho * r * mask).sum() / n)
    assert int(terms.clipped) == int((((teacher - lp).abs() > r_max) & mask).sum())
    torch.testing.assert_close(terms.log_ratio_sum, ((lp - teacher) * mask).sum(-1))


def test_micro_batches_sum_to_the_step_loss():
    torch.manual_seed(1)
    logits = torch.randn(4, 6, 9, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 9, (4, 6))
    mask = torch.rand(4, 6) > 0.3
    teacher = torch.randn(4, 6, dtype=torch.float64) - 2
    whole = opd_pg_loss(token_logprobs(logits, ids), teacher, mask, 2.0).loss
    n = mask[:, 1:].sum() + mask[:, 0].sum()
    parts = sum(opd_pg_loss(token_logprobs(logits[s:s + 2], ids[s:s + 2]), teacher[s:s + 2], mask[s:s + 2], 2.0,
                            normalizer=n.double()).loss for s in (0, 2))
    torch.testing.assert_close(parts, whole)


# --- rollouts -----------------------------------------------------------------------------------------------------

def _perturb_(model, seed=5, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.abs().mean() + 1e-3))


def test_a_dropped_engine_is_freed_at_once():
    # a new policy version or retire frees the old engine and its page pool now (their parts refer to one another:
    # left to the cycle collector, the pool would stay allocated beside the new engine or the training step)
    import gc
    import weakref

    ro = RolloutEngine(_model(0), config=_engine_cfg(), max_new_tokens=4, temperature=0.0)
    ro.advance([Rollout(uid=0, prompt_index=0, prompt_ids=[5, 6, 7])])
    gc.disable()
    try:
        old = weakref.ref(ro.engine)
        ro.policy_changed()
        ro.engine
        assert old() is None
        old = weakref.ref(ro.engine)
        ro.retire()
        assert old() is None and ro._engine is None
    finally:
        gc.enable()


def test_partial_rollouts_resume_exactly_where_they_stopped():
    model = _model(0)
    prompt = [int(x) for x in torch.randint(1, VOCAB, (23,), generator=torch.Generator().manual_seed(3))]
    whole = RolloutEngine(model, config=_engine_cfg(), max_new_tokens=12, temperature=0.0)
    one = Rollout(uid=0, prompt_index=0, prompt_ids=prompt)
    whole.advance([one])
    assert one.finished and len(one.tokens) == 12
    pieces = RolloutEngine(model, config=_engine_cfg(), max_new_tokens=12, budget=5, temperature=0.0)
    cut = Rollout(uid=0, prompt_index=0, prompt_ids=prompt)
    lens = []
    while not cut.finished:
        pieces.advance([cut])
        lens.append(len(cut.tokens))
    assert lens == [5, 10, 12]
    assert cut.tokens == one.tokens  # greedy: the pieces concatenate to one uninterrupted generation
    torch.testing.assert_close(torch.tensor(cut.behaviour_logprobs), torch.tensor(one.behaviour_logprobs),
                               rtol=0, atol=1e-4)
    # a weight update between pieces: the kept prefix stays as it was, the continuation is the new policy's
    cont = RolloutEngine(model, config=_engine_cfg(), max_new_tokens=12, budget=5, temperature=0.0)
    r = Rollout(uid=0, prompt_index=0, prompt_ids=prompt)
    cont.advance([r])
    kept, kept_lp = list(r.tokens), list(r.behaviour_logprobs)
    _perturb_(model, scale=0.5)
    cont.policy_changed()
    cont.advance([r])
    assert r.tokens[:5] == kept and r.behaviour_logprobs[:5] == kept_lp and r.versions == [0] * 5 + [1] * 5
    fresh = LLMEngine(model, config=_engine_cfg()).generate(
        [prompt + kept], SamplingParams(max_tokens=5, temperature=0.0, logprobs=0))[0]
    assert r.tokens[5:] == fresh.output_ids
    torch.testing.assert_close(torch.tensor(r.behaviour_logprobs[5:]),
                               torch.tensor([lp["logprob"] for lp in fresh.logprobs]), rtol=0, atol=1e-4)
    # the recorded log-probs are the model's: the training forward over the same tokens gives them too
    with torch.no_grad():
        lp = token_logprobs(model(torch.tensor([prompt + r.tokens])).logits, torch.tensor([prompt + r.tokens]))
    torch.testing.assert_close(lp[0, -5:], torch.tensor(r.behaviour_logprobs[5:]), rtol=0, atol=1e-4)


def test_prefix_cache_is_retired_after_a_weight_update():
    model = _model(0)
    prompt = [int(x) for x in torch.randint(1, VOCAB, (40,), generator=torch.Generator().manual_seed(4))]
    ro = RolloutEngine(model, config=_engine_cfg(), max_new_tokens=6, temperature=0.0)
    ro.advance([Rollout(uid=0, prompt_index=0, prompt_ids=prompt)])  # fills the prefix cache with the prompt
    stale = ro.engine  # what a run that forgot the update would keep using
    _perturb_(model, scale=0.5)
    ro.policy_changed()
    after = Rollout(uid=1, prompt_index=0, prompt_ids=prompt)
    ro.advance([after])
    assert ro.engines_built == 2 and ro.engine is not stale
    fresh = LLMEngine(model, config=_engine_cfg()).generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))[0]
    assert after.tokens == fresh.output_ids
    torch.testing.assert_close(torch.tensor(after.behaviour_logprobs),
                               torch.tensor([lp["logprob"] for lp in fresh.logprobs]), rtol=0, atol=1e-5)
    # the test can tell: the stale engine takes a prefix hit on the old policy's states and scores differently
    hit = stale.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=0))[0]
    assert hit.cached_tokens >= 32
    diff = (torch.tensor([lp["logprob"] for lp in hit.logprobs]) - torch.tensor(after.behaviour_logprobs)).abs()
    assert float(diff.max()) > 1e-3


# --- teachers and prompts -----------------------------------------------------------------------------------------

def test_teacher_selection_by_tag():
    t = TeacherTable(["code=/ck/code", "code/high=/ck/code_high", "math/low=/ck/math_low"])
    assert t.tag_for("code", "high") == ("code", "high")
    assert t.tag_for("code", "low") == ("code", None) and t.tag_for("code", None) == ("code", None)
    assert t.tag_for("math", "low") == ("math", "low")
    assert t.tag_for("math", "high") is None and t.tag_for("math", None) is None and t.tag_for("docs", None) is None
    assert parse_teacher_spec("a.b/x-1=/p=q") == ("a.b", "x-1", "/p=q")


@pytest.mark.parametrize("spec, msg", [("code", "expected TAG=CHECKPOINT"), ("=ck", "tag '' is invalid"),
                                       ("co de=ck", "tag 'co de' is invalid"), ("a/b/c=ck", "tag 'a/b/c'"),
                                       ("code=", "checkpoint path is empty")])
def test_bad_teacher_specs(spec, msg):
    with pytest.raises(ValueError, match=msg):
        TeacherTable([spec])
    with pytest.raises(ValueError, match="given twice"):
        TeacherTable(["code=a", "code=b"])


@pytest.mark.parametrize("line, msg", [
    ('{"prompt": "x"}', "field 'domain'"),
    ('{"prompt": "x", "domain": "code", "effort": 3}', "field 'effort'"),
    ('{"prompt": "x", "messages": [], "domain": "code"}', "exactly one of 'messages'"),
    ('{"messages": [{"role": "bot", "content": "x"}], "domain": "code"}', "field 'messages[0]'"),
    ('{"messages": [{"role": "assistant", "content": "x"}], "domain": "code"}', "only an assistant message"),
    ('{"prompt": "x", "domain": "poetry"}', "no teacher for domain 'poetry'"),
    ('{"prompt": "x", "domain": "math", "effort": "high"}', "no teacher for domain 'math' effort 'high'"),
    ('{"prompt": ', "not valid JSON"),
])
def test_bad_prompt_records_name_the_record(tmp_path, line, msg):
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ref"}],
                       "domain": "code"})
    path = tmp_path / "p.jsonl"
    path.write_text(f"{good}\n{line}\n")
    table = TeacherTable(["code=a", "math/low=b"])
    with pytest.raises(PromptError) as e:
        read_prompts([str(path)], table)
    assert f"{path}:2:" in str(e.value) and msg in str(e.value)
    path.write_text(good + "\n")
    (p,) = read_prompts([str(path)], table)
    assert p.messages == [{"role": "user", "content": "hi"}]  # the reference reply is dropped


def _prompts(path, n=6):
    recs = []
    for i in range(n):
        recs.append({"messages": [{"role": "user", "content": f"write f{i}"}], "domain": "code",
                     "effort": "high" if i % 2 else "low"})
        recs.append({"prompt": f"The module {i} documents", "domain": "docs"})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def test_cli_bad_inputs_are_named(tmp_path, ckpts, capsys):
    from k3.cli import main

    prompts = _prompts(tmp_path / "p.jsonl")
    base = ["distill", "--student", ckpts["student"], "--prompts", prompts, "--max-steps", "1", "--device", "cpu",
            "--no-progress", "--max-new-tokens", "4"]
    missing = str(tmp_path / "nowhere")
    assert main(base + ["--teacher", f"code={missing}", "--teacher", f"docs={ckpts['docs']}",
                        "--out", str(tmp_path / "r1")]) == 2
    assert f"--teacher code: {missing}: no checkpoint there" in capsys.readouterr().err
    other = _save(tmp_path / "v384", randomize_(K3ForCausalLM(_cfg().replace(vocab_size=384)), seed=3),
                  K3Tokenizer(byte_level_tokenizer(384)))
    assert main(base + ["--teacher", f"code={ckpts['code']}", "--teacher", f"docs={other}",
                        "--out", str(tmp_path / "r2")]) == 2
    assert f"--teacher docs={other}: vocabulary of 384 tokens, the student's has {VOCAB}" in capsys.readouterr().err
    assert main(base + ["--teacher", "code", "--out", str(tmp_path / "r3")]) == 2
    assert "--teacher 'code': expected TAG=CHECKPOINT" in capsys.readouterr().err
    assert main(base + ["--teacher", f"code={ckpts['code']}", "--out", str(tmp_path / "r4")]) == 2
    assert f"{prompts}:2: no teacher for domain 'docs'" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(prompts).read() + '{"prompt": "x", "domain": ""}\n')
    assert main(base + ["--prompts", str(bad), "--teacher", f"code={ckpts['code']}", "--teacher",
                        f"docs={ckpts['docs']}", "--out", str(tmp_path / "r5")]) == 2
    assert f"{bad}:13: field 'domain' = ''" in capsys.readouterr().err


# --- QAT rollouts -------------------------------------------------------------------------------------------------

def test_qat_student_rolls_out_with_its_training_numerics(tmp_path, ckpts):
    from k3.model.mx_experts import expert_formats
    from k3.posttrain.distill import DistillOptions, build_distill_run, score_rows, student_qat
    from k3.train.qat import save_mxfp4
    from k3.train.trainer import TrainConfig

    q = save_mxfp4(_model(0), str(tmp_path / "q"), extra_files={"tokenizer.json": _tok().to_str().encode()})
    assert student_qat(q) == "mxfp4" and student_qat(ckpts["student"]) is None
    opts = DistillOptions(student=q, teachers=[f"code={ckpts['code']}", f"docs={ckpts['docs']}"],
                          prompts=[_prompts(tmp_path / "p.jsonl")], rollouts_per_step=4, max_new_tokens=6,
                          device="cpu", engine=_engine_cfg())
    tr = build_distill_run(opts, TrainConfig(out=str(tmp_path / "run"), max_steps=1, qat="mxfp4"), log=lambda *a: None)
    assert expert_formats(tr.model) == ("mxfp4", "mxfp8") and tr.rollout.model is tr.model
    batch = tr._next_batch()
    rows = [batch["input_ids"][i][batch["segment_ids"][i] == 0].tolist() for i in range(batch["input_ids"].shape[0])]
    lp = score_rows(tr.model, rows, tr.device)
    m = batch["labels"] != -100
    # the engine's recorded log-probs are the training forward's, with the same fake-quantized experts (fp32; the
    # engine's paged, chunked forwards round differently from one full forward: ~1e-6 seen, 2e-5 allowed)
    torch.testing.assert_close(batch["behaviour"][m], lp[:, :m.shape[1]][m], rtol=0, atol=2e-5)
    # and the check can tell: without the quantization they differ by more (this near-uniform random model's
    # experts move its log-probs little: ~3e-4)
    import copy

    from k3.model.mx_experts import quantize_experts

    plain = score_rows(quantize_experts(copy.deepcopy(tr.model), None, None), rows, tr.device)
    assert float((plain[:, :m.shape[1]][m] - batch["behaviour"][m]).abs().max()) > 1e-4


# --- k3 distill end to end ----------------------------------------------------------------------------------------

def test_cli_distill_two_teachers_writes_metrics_and_a_loadable_checkpoint(tmp_path, ckpts, capsys):
    from k3.checkpoint import from_pretrained
    from k3.cli import main

    out = str(tmp_path / "run")
    args = ["distill", "--student", ckpts["student"], "--teacher", f"code={ckpts['code']}", "--teacher",
            f"docs={ckpts['docs']}", "--prompts", _prompts(tmp_path / "p.jsonl"), "--out", out, "--max-steps", "2",
            "--rollouts-per-step", "4", "--max-new-tokens", "8", "--rollout-budget", "5", "--device", "cpu",
            "--no-progress", "--rollout-cache-mb", "32"]
    assert main(args) == 0
    log = capsys.readouterr().out
    assert "step 2: reward" in log
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in recs if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["samples"] >= 1 and 1 <= r["response_len"] <= 8 and 0 <= r["clip_rate"] <= 1
        assert set(r["domains"]) <= {"code", "docs"} and r["domains"]
        n = sum(d["samples"] for d in r["domains"].values())
        assert n == r["samples"]
        tot = sum(d["reward"] * d["response_len"] * d["samples"] for d in r["domains"].values())
        assert abs(tot / (r["response_len"] * r["samples"]) - r["reward"]) < 1e-6
        assert r["reward"] <= 5.0 and r["loss"] == pytest.approx(-r["reward"], abs=1e-3)
    # 8-token responses with a 5-token budget: step 1 trains on none of length 8 (none finished yet unless by eos)
    assert steps[0]["response_len"] <= 5 or steps[0]["rollout_rounds"] == 2
    ck = os.path.join(out, "checkpoints", "step-0000002")
    model = from_pretrained(ck)
    student = from_pretrained(ckpts["student"])
    moved = [n for (n, a), (_, b) in zip(model.state_dict().items(), student.state_dict().items())
             if a.dtype.is_floating_point and not torch.equal(a, b)]
    assert moved  # the student was trained
    assert os.path.isfile(os.path.join(ck, "tokenizer.json")) and os.path.isfile(os.path.join(ck, "chat_template.json"))


def test_resume_continues_the_samples_in_flight_bit_exactly(tmp_path, ckpts):
    from k3.posttrain.distill import DistillOptions, build_distill_run
    from k3.train.trainer import TrainConfig

    prompts = _prompts(tmp_path / "p.jsonl")

    def trainer(out):
        opts = DistillOptions(student=ckpts["early_stopper"],
                              teachers=[f"code={ckpts['code']}", f"docs={ckpts['docs']}"],
                              prompts=[prompts], rollouts_per_step=3, max_new_tokens=7, rollout_budget=3,
                              device="cpu", engine=_engine_cfg(),
                              resume=os.path.isdir(os.path.join(out, "checkpoints")))
        return build_distill_run(opts, TrainConfig(out=str(out), max_steps=3, save_every_minutes=1e9),
                                 log=lambda *a: None)

    straight = trainer(tmp_path / "a")
    straight.fit(progress_bar=False)
    first = trainer(tmp_path / "b")
    stop_after(first, 2)
    assert first.fit(progress_bar=False)["step"] == 2
    carried = [r.to_dict() for r in first.loader.in_flight]
    assert carried and all(len(r["tokens"]) > 0 for r in carried)  # partial rollouts were in flight at the save
    resumed = trainer(tmp_path / "b")
    assert resumed.step == 2 and [r.to_dict() for r in resumed.loader.in_flight] == carried
    resumed.fit(progress_bar=False)
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    recs = [[json.loads(line) for line in open(tmp_path / r / "metrics.jsonl")] for r in "ab"]
    key = [[(r["step"], r["loss"], r["reward"], r["stale_tokens"]) for r in rs if "reward" in r] for rs in recs]
    assert key[0] == key[1] and sum(k[3] for k in key[0]) > 0  # some trained tokens came from an older policy


# --- held-out evaluation ------------------------------------------------------------------------------------------

def _distill_trainer(out, ckpts, prompts, heldout, teachers=None, **kw):
    from k3.posttrain.distill import DistillOptions, build_distill_run
    from k3.train.trainer import TrainConfig

    opts = DistillOptions(student=ckpts["early_stopper"],
                          teachers=teachers or [f"code={ckpts['code']}", f"docs={ckpts['docs']}"],
                          prompts=[prompts], heldout=heldout, eval_samples=2, rollouts_per_step=3, max_new_tokens=6,
                          rollout_budget=3, device="cpu", engine=_engine_cfg(), **kw)
    return build_distill_run(opts, TrainConfig(out=str(out), max_steps=2, eval_every=1, save_every_minutes=1e9),
                             log=lambda *a: None)


def test_heldout_evaluation_is_the_sampled_reverse_kl_and_leaves_training_alone(tmp_path, ckpts):
    prompts = _prompts(tmp_path / "p.jsonl")
    held = _prompts(tmp_path / "h.jsonl", n=3)
    runs = {}
    for name, h in (("with", [held]), ("without", [])):
        tr = _distill_trainer(tmp_path / name, ckpts, prompts, h)
        tr.fit(progress_bar=False)
        runs[name] = (tr, [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")])
    (tw, rw), (to, ro) = runs["with"], runs["without"]
    # the same training: weights and every step's loss and reward
    for (n, a), (_, b) in zip(tw.model.state_dict().items(), to.model.state_dict().items()):
        assert torch.equal(a, b), n
    key = lambda rs: [(r["step"], r["loss"], r["reward"]) for r in rs if "reward" in r]  # noqa: E731
    assert key(rw) == key(ro)
    evals = [r for r in rw if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2] and not any("val_loss" in r for r in ro)
    for r in evals:
        doms = r["val_domains"]
        assert set(doms) == {"code", "docs"} and all(d["tokens"] > 0 for d in doms.values())
        mean = sum(d["reverse_kl"] * d["tokens"] for d in doms.values()) / sum(d["tokens"] for d in doms.values())
        assert r["val_loss"] == pytest.approx(mean, rel=1e-12)
    # deterministic: the same weights give the same figure
    assert tw.evaluate() == tw.evaluate() == evals[-1]["val_loss"]


def test_heldout_reverse_kl_to_the_student_itself_is_zero(tmp_path, ckpts):
    prompts = _prompts(tmp_path / "p.jsonl")
    held = _prompts(tmp_path / "h.jsonl", n=2)
    same = [f"code={ckpts['early_stopper']}", f"docs={ckpts['early_stopper']}"]
    tr = _distill_trainer(tmp_path / "self", ckpts, prompts, [held], teachers=same)
    assert tr.evaluate() == 0.0  # teacher = student: every sampled token's log-ratio is exactly 0
    other = _distill_trainer(tmp_path / "other", ckpts, prompts, [held])
    assert other.evaluate() > 0.1  # random teachers: far from the student


def test_cli_distill_heldout_logs_val_domains(tmp_path, ckpts, capsys):
    from k3.cli import main

    out = str(tmp_path / "run")
    args = ["distill", "--student", ckpts["student"], "--teacher", f"code={ckpts['code']}", "--teacher",
            f"docs={ckpts['docs']}", "--prompts", _prompts(tmp_path / "p.jsonl"), "--heldout",
            _prompts(tmp_path / "h.jsonl", n=2), "--eval-samples", "1", "--eval-every", "2", "--out", out,
            "--max-steps", "2", "--rollouts-per-step", "2", "--max-new-tokens", "4", "--device", "cpu",
            "--no-progress", "--rollout-cache-mb", "32"]
    assert main(args) == 0
    log = capsys.readouterr().out
    assert "held-out prompts: 4, 1 samples each every 2 steps" in log and "held out" in log
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in recs if "val_domains" in r] == [0, 2]
