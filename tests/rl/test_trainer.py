"""`k3 rl` (k3.rl.trainer): rewards, baselines and the budget penalty; whole iterations on a tiny checkpoint whose
sampled tokens are scripted (tests/rl/oracle.py), with their metrics, trajectories, budgets and checkpoints."""

import json
import os

import pytest

from helpers import tiny_chat_checkpoint
from rl.oracle import SCRIPT, script_tokens
from k3.rl.loss import RLLossConfig
from k3.rl.trainer import RLOptions, budget_reward, build_rl_run, group_advantages, run_rl
from k3.train.config import TrainConfig


def test_budget_reward():
    assert budget_reward(1.0, 120, 100.0, 1.5) == 1.0  # within 1.5 x b0
    assert budget_reward(1.0, 151, 100.0, 1.5) == -1.0  # over: -1 whatever the task's reward
    assert budget_reward(0.0, 151, 100.0, 1.5) == -1.0
    assert budget_reward(0.5, 10**6, None, 1.5) == 0.5  # no budget for this problem
    assert budget_reward(0.5, 10**6, 100.0, None) == 0.5  # no budget control


def test_group_advantages():
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [0.5, -0.5, -0.5, 0.5]
    assert group_advantages([1.0, 1.0]) == [0.0, 0.0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("rlck") / "ck"
    _, tok = tiny_chat_checkpoint(path)
    return str(path), tok


def _opts(ck, **kw):
    base = dict(ckpt=ck, tasks=["rltest:4"], heldout=["rltest:2"], harness="terminal", groups=2, samples=2,
                max_turn_tokens=256, max_context=4096, sandbox="none", cache_memory_mb=32.0, device="cpu",
                verify=False)
    return RLOptions(**{**base, **kw})


def test_rl_iterations_with_scripted_samples(ckpt, tmp_path, monkeypatch):
    ck, tok = ckpt
    script_tokens(monkeypatch, tok, SCRIPT)
    out = str(tmp_path / "run")
    tcfg = TrainConfig(out=out, max_steps=2, eval_every=2, lr=1e-4)
    summary = run_rl(_opts(ck), tcfg, progress_bar=False, log=lambda *a: None)
    assert summary["step"] == 2 and os.path.isdir(summary["checkpoint"])
    recs = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r for r in recs if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # every scripted sample succeeds: reward 1, equal rewards in every group (no policy-gradient signal)
        assert r["reward"] == 1.0 and r["success"] == 1.0 and r["samples"] == 4 and r["groups"] == 2
        assert r["zero_adv_groups"] == 2 and r["turns"] == 2.0 and r["families"]["scripted"]["success"] == 1.0
        assert r["sampled_tokens"] > 0 and r["rollout_s"] > 0 and r["paused"] == 0
    assert steps[0]["staleness"] == 0.0
    vals = [r for r in recs if "val_success" in r]
    assert [r["step"] for r in vals] == [0, 2] and all(r["val_success"] == 1.0 and r["val_loss"] == 0.0
                                                        for r in vals)
    trajs = [json.loads(x) for x in open(os.path.join(out, "trajectories.jsonl"))]
    assert len(trajs) == 8 and all(t["reward"] == 1.0 and t["advantage"] == 0.0 for t in trajs)
    assert os.path.isfile(os.path.join(out, "reward.png"))


@pytest.mark.slow
def test_budget_penalty_measures_b0_then_overrides_the_reward(ckpt, tmp_path, monkeypatch):
    """b0(x) is measured from the starting model before step 1 (every scripted sample costs the same, so b0 is that
    cost); with tau_b = 0.5 every trajectory is over its budget and gets reward -1; with tau_b = 2, none is."""
    ck, tok = ckpt
    bodies = script_tokens(monkeypatch, tok, SCRIPT)
    cost = sum(map(len, bodies))
    for tau, reward, over in ((0.5, -1.0, 4), (2.0, 1.0, 0)):
        out = str(tmp_path / f"run{tau}")
        trainer = build_rl_run(_opts(ck, heldout=[], budget_tau=(tau, tau)), TrainConfig(out=out, max_steps=1),
                               log=lambda *a: None)
        trainer.fit(progress_bar=False)
        trainer.close()
        budgets = json.load(open(os.path.join(out, "budgets.json")))
        assert len(budgets) == 4 and set(budgets.values()) == {float(cost)}
        rec = trainer.history[-1]
        assert rec["reward"] == reward and rec["over_budget"] == over and rec["budget_tau"] == tau
        assert rec["task_reward"] == 1.0


def test_bad_options_are_named(ckpt, tmp_path):
    ck, _ = ckpt
    for kw, msg in ((dict(samples=1), "--samples"), (dict(lam=0.0), "--lam"), (dict(tasks=[]), "--tasks"),
                    (dict(tasks=["nosuch:2"]), "unknown task family"), (dict(tasks=["rltest:x"]), "N must be"),
                    (dict(loss=RLLossConfig(kind="x")), "--loss")):
        with pytest.raises(ValueError, match=msg):
            build_rl_run(_opts(ck, **kw), TrainConfig(out=str(tmp_path / "bad"), max_steps=1), log=lambda *a: None)
    from k3.cli import main

    with pytest.raises(SystemExit, match="--seq-len"):
        main(["rl", "--ckpt", ck, "--tasks", "rltest:2", "--seq-len", "64", "--out", str(tmp_path / "x")])


def test_rl_keeps_the_expert_bias_unless_asked(ckpt, tmp_path, monkeypatch):
    """`k3 rl` defaults to --balance none (the checkpoint's expert bias is kept: re-fitting it from each small RL
    batch moves the policy off the one that sampled); an explicit --balance is honoured."""
    import k3.rl.trainer as rl_trainer
    from k3.cli import main

    ck, _ = ckpt
    seen = []
    monkeypatch.setattr(rl_trainer, "run_rl", lambda opts, tcfg, progress_bar=True, log=print: seen.append(tcfg) or {})
    for extra, want in (([], "none"), (["--balance", "histogram"], "histogram")):
        main(["rl", "--ckpt", ck, "--tasks", "rltest:2", "--out", str(tmp_path / "x"), "--device", "cpu", *extra])
        assert seen[-1].balance == want
