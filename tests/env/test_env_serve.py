"""`k3 env run` against `k3 serve`: the agent environments' policy client, the chat endpoint's tool calling and the
engine, end to end over HTTP.

A random tiny checkpoint (byte tokenizer) is served by a real uvicorn server in a thread; `k3 env run --endpoint`
plays 50 episodes of the arith and code families with small-budget copies of the react and terminal harnesses
(tools declared, tool_choice "auto"). Two models: one whose head is biased to printable ASCII (it answers in plain
text), and one that may also write the chat markup's special tokens at random (malformed channels and calls, which
the server must report and the harness must survive). Either way every episode must end without a harness error.
"""

import json
import os
import shutil

import httpx
import pytest
import torch

from helpers import tiny_chat_checkpoint, uvicorn_in_thread
from k3.cli import main
from k3.env.presets import PRESETS
from k3.env.toolbox import BUILTIN_TOOLS
from k3.env.trajectory import read_jsonl
from k3.serve.chat import DEFAULT_CHAT_TEMPLATE, markup_ids

MODEL = "k3-tiny-env"
HOST = "127.0.0.1"
# isolated when bubblewrap and its sandbox module are there, as tests/env/test_episode.py decides
SANDBOX = "bwrap" if shutil.which("bwrap") and os.path.exists(
    os.path.join(os.path.dirname(__file__), "../../k3/env/bwrap.py")) else "none"


def _bias_head(model, tok, markup: bool) -> None:
    """Allow only the printable ASCII bytes (and, with `markup`, the four markers) at the head."""
    ids = sorted({tok.encode(chr(c))[0] for c in range(32, 127)})
    if markup:
        ids += sorted(markup_ids(tok, DEFAULT_CHAT_TEMPLATE).values())
    bias = torch.full((model.config.vocab_size,), -30.0)
    bias[ids] = 0.0
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)


def _small_harness(tmp_path, preset: str) -> str:
    d = PRESETS[preset].to_dict()
    d.update(name=f"{preset}-small", max_tokens_per_turn=24, temperature=1.0)
    path = tmp_path / f"{preset}-small.json"
    path.write_text(json.dumps(d))
    return str(path)


@pytest.mark.slow  # ~25 s on 2 cores (a served model, 50 episodes in the sandbox); faster siblings: the scripted
# episodes against each task family (tests/env/test_scripted_episodes.py) and the harness's own tests
@pytest.mark.parametrize("markup", [False, True], ids=["text", "markup"])
def test_env_run_against_k3_serve(tmp_path, markup):
    from k3.serve.app import create_app
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig

    model, tok = tiny_chat_checkpoint(tmp_path / "tiny")
    _bias_head(model, tok, markup)
    cfg = EngineConfig(cache_memory_mb=64, page_tokens=64, hash_block_tokens=64, max_model_len=8192,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_step_tokens=8192, prefill_chunk=8192))
    app = create_app(LLMEngine(model, tok, cfg), tok, MODEL)
    out = tmp_path / "run"
    harnesses = [_small_harness(tmp_path, "react"), _small_harness(tmp_path, "terminal")]
    with uvicorn_in_thread(app, HOST) as port:
        assert main(["env", "run", "--endpoint", f"http://{HOST}:{port}/v1", "--model", MODEL,
                     "--tasks", "arith:13", "code:12", "--harness", harnesses[0], "--harness", harnesses[1],
                     "--out", str(out), "--sandbox", SANDBOX, "--concurrency", "4", "--no-progress"]) == 0
        if markup:  # the same kind of request as the episodes': the random markup is reported, not hidden
            body = {"model": MODEL, "messages": [{"role": "user", "content": "Compute 2+2."}], "max_tokens": 24,
                    "tools": [BUILTIN_TOOLS["shell"].spec()], "tool_choice": "auto"}
            with httpx.Client(trust_env=False, timeout=60) as c:
                msgs = [c.post(f"http://{HOST}:{port}/v1/chat/completions", json={**body, "seed": k}).json()
                        ["choices"][0]["message"] for k in range(8)]
            assert sum(bool(m.get("tool_call_errors")) for m in msgs) >= 4, msgs
    summary = json.loads((out / "summary.json").read_text())
    trajectories = [t.to_dict() for t in read_jsonl(str(out / "trajectories.jsonl"))]  # each one validated
    assert summary["total"]["episodes"] == len(trajectories) == 50
    assert summary["total"]["harness_errors"] == 0, [t["error"] for t in trajectories if t["error"]]
    rows = {(r["family"], r["harness"]): r["episodes"] for r in summary["rows"]}
    assert rows == {("arith", "react-small"): 13, ("arith", "terminal-small"): 13, ("code", "react-small"): 12,
                    ("code", "terminal-small"): 12}
    for t in trajectories:
        assert t["end_reason"] in ("answered", "submitted", "max_turns", "max_tokens"), t["end_reason"]
        assistant = [m for m in t["messages"] if m["role"] == "assistant"]
        assert assistant and all(m["content"] is None or isinstance(m["content"], str) for m in assistant)


def test_env_run_with_a_checkpoint_served_in_process(tmp_path, capsys):
    """`k3 env run --ckpt`: the checkpoint is loaded here and served on a loopback port for the episodes."""
    ckpt = tmp_path / "tiny"
    assert main(["init", "--preset", "tiny", "--tokenizer", "bytes", "--out", str(ckpt)]) == 0
    out = tmp_path / "run"
    assert main(["env", "run", "--ckpt", str(ckpt), "--tasks", "arith:3", "--harness",
                 _small_harness(tmp_path, "react"), "--out", str(out), "--sandbox", SANDBOX, "--device", "cpu",
                 "--cache-memory-mb", "64", "--no-progress"]) == 0
    trajs = read_jsonl(str(out / "trajectories.jsonl"))
    assert len(trajs) == 3 and all(t.end_reason != "error" for t in trajs), [t.error for t in trajs]
    assert all(t.counts["completion_tokens"] > 0 for t in trajs)
    assert "| arith | react-small | 3 |" in capsys.readouterr().out
