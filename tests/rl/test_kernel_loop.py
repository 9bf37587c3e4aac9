"""The kernel agent loop as an RL family, end to end on CPU (the Triton interpreter where a kernel needs Triton).

A real tiny random checkpoint runs in the real engine; in (a) and (b) the oracle (tests/rl/oracle.py) scripts
its sampled tokens to play assistant tool calls: the kernel family's scripted solution (write kernel.py, score it
with `score_kernel`, submit), or a kernel that returns wrong values. The episode's hidden verifier scores the final
kernel.py with the kernel reward, and the sample's reward must be exactly that reward's verdict. In (c) `k3 rl` runs
one iteration of the kernel family with the random model itself (no oracle).
"""

import json
import os
import shutil

import pytest

from rl.oracle import script_tokens
from k3.env.client import assistant_message, tool_call
from k3.env.episode import Episode
from k3.env.harness import HarnessConfig, ToolChoice
from k3.env.presets import TERMINAL_PROMPT
from k3.env.tasks import scripted_solution
from k3.env.tasks.kernel import make_task
from k3.rl.rollout import AgentRollouts, RolloutConfig, Sample, Throttle
from k3.serve.chat import DEFAULT_CHAT_TEMPLATE
from k3.serve.engine import EngineConfig

# the kernel tools of the scripted solution, under a terminal-style system prompt
HARNESS = HarnessConfig("kernel-rl-test", (ToolChoice("write_file"), ToolChoice("score_kernel"), ToolChoice("submit")),
                        TERMINAL_PROMPT)
KERNEL = "gemm_bf16"  # the shortest honest example (fewest scripted tokens) and a quick score on CPU

WRONG = '''"""A wrong GEMM: the product of the transposes."""

import torch


def kernel(a, b):
    return torch.matmul(b.t(), a.t()).t() + 1
'''


def _script(actions) -> list[dict]:
    return [assistant_message(None, [tool_call(a["tool"], a["args"])]) for a in actions]


def _run(policy, task, n):
    """`n` samples of `task` through AgentRollouts (the Triton interpreter for the kernel reward on CPU)."""
    model, tok = policy
    cfg = RolloutConfig(harness=HARNESS, sandbox_kind="none", max_turn_tokens=1024)
    ecfg = EngineConfig(cache_memory_mb=32.0, page_tokens=64, hash_block_tokens=16, cuda_graphs=False)
    ro = AgentRollouts(model, tok, DEFAULT_CHAT_TEMPLATE, cfg, ecfg, Throttle(start=8))
    samples = [Sample(uid=i, group=0, task=task, episode=Episode(task, HARNESS, None, sandbox_kind="none",
                                                                     kernel_device="cpu"))
               for i in range(n)]
    try:
        ro.run(samples, seed=1)
    finally:
        ro.close()
    return samples


@pytest.fixture()
def scores(monkeypatch):
    """Every kernel-reward score of this test, in order: (kernel task, source, Result)."""
    from k3.kernel_reward import scoring

    seen, orig = [], scoring.score

    def spy(task, source, *a, **kw):
        res = orig(task, source, *a, **kw)
        seen.append((task, source, res))
        return res

    monkeypatch.setattr(scoring, "score", spy)
    return seen


@pytest.mark.slow  # ~30 s on 2 cores (kernel scoring in fresh processes); faster siblings: a wrong kernel's zero
# reward (below) and the task's verdict being the kernel reward (tests/env/test_tasks.py)
def test_scripted_kernel_episodes_get_the_kernel_reward(policy, monkeypatch, scores):
    from k3.kernel_reward import score
    from k3.kernel_reward.examples import source

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    task = make_task(KERNEL, 0, "cpu", "train")
    actions = scripted_solution(task)
    assert [a["tool"] for a in actions] == ["write_file", "score_kernel", "submit"]
    script_tokens(monkeypatch, policy[1], _script(actions))
    (s,) = _run(policy, task, 1)
    t = s.trajectory
    assert s.done and s.error is None and t["end_reason"] == "submitted", (s.error, t["end_reason"])
    assert s.turns == 3 and s.row.sampled == s.output_tokens > 0
    tools = [m for m in t["messages"] if m["role"] == "tool"]
    assert [m["name"] for m in tools] == ["write_file", "score_kernel", "submit"]
    assert "reward" in tools[1]["content"] and "passed" in tools[1]["content"], tools[1]["content"]
    # the score_kernel call, then the hidden verifier, each scored kernel.py as written: the verifier's Result is
    # the sample's reward and success, exactly
    code = source(f"{KERNEL}_torch")
    assert [(n, src) for n, src, _ in scores] == [(KERNEL, code), (KERNEL, code)]
    verdict = scores[-1][2]
    assert verdict.passed and verdict.reward > 0 and not verdict.hacks
    assert s.success is True and s.reward == float(verdict.reward) > 0
    assert t["verdict"]["reward"] == s.reward and t["verdict"]["data"]["hacks"] == []
    # scored directly, the same file gets the same verdict (the timed reward is a fresh measurement; the expert's
    # anchor time is the same, measured once per process)
    direct = score(KERNEL, code, device="cpu")
    assert direct.passed and direct.reward > 0 and not direct.hacks
    assert [(c.label, c.passed) for c in direct.checks] == [(c.label, c.passed) for c in verdict.checks]
    assert direct.expert_time_s == verdict.expert_time_s == t["verdict"]["data"]["expert_time_s"]


def test_a_wrong_kernel_gets_reward_zero(policy, monkeypatch, scores):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    task = make_task(KERNEL, 0, "cpu", "train")
    script_tokens(monkeypatch, policy[1], _script([
        {"tool": "write_file", "args": {"path": "kernel.py", "content": WRONG}},
        {"tool": "submit", "args": {"answer": "kernel.py"}}]))
    samples = _run(policy, task, 2)
    for s in samples:
        assert s.done and s.error is None and s.trajectory["end_reason"] == "submitted"
        assert s.reward == 0.0 and s.success is False
        v = s.trajectory["verdict"]
        assert "wrong result" in v["details"], v["details"]
    assert [src for _, src, _ in scores] == [WRONG, WRONG]
    assert all(not r.passed and r.reward == 0.0 for _, _, r in scores)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from helpers import tiny_chat_checkpoint

    path = tmp_path_factory.mktemp("rlkernel") / "ck"
    tiny_chat_checkpoint(path)
    return str(path)


@pytest.mark.slow
def test_k3_rl_on_the_kernel_family(ckpt, tmp_path, monkeypatch):
    """One iteration of `k3 rl --tasks kernel:1` with the random model: its episodes run and are scored."""
    from k3.cli import main

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "run"
    sandbox = "bwrap" if shutil.which("bwrap") else "none"
    rc = main(["rl", "--ckpt", ckpt, "--tasks", "kernel:1", "--sandbox", sandbox, "--max-steps", "1",
               "--groups", "1", "--samples", "2", "--max-turn-tokens", "32", "--out", str(out), "--device", "cpu",
               "--no-progress"])
    assert rc == 0
    recs = [json.loads(x) for x in open(out / "metrics.jsonl")]
    steps = [r for r in recs if "reward" in r]
    assert [r["step"] for r in steps] == [1] and "kernel" in steps[0]["families"], steps
    assert steps[0]["samples"] == 2 and steps[0]["sampled_tokens"] > 0
    trajs = [json.loads(x) for x in open(out / "trajectories.jsonl")]
    assert len(trajs) == 2 and all(t["family"] == "kernel" for t in trajs)
    assert all(isinstance(t["reward"], (int, float)) and 0.0 <= t["reward"] <= 1.0 for t in trajs), trajs
    assert os.path.isdir(out)
