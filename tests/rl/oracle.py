"""The RL tests' oracle that scripts which tokens its
requests sample.

The model is a real tiny random checkpoint run by the real engine; only the choice of each sampled token is
scripted (`scripted`): the engine's postprocess step draws the oracle's token in place of a sampled one
(`Postprocessor.draw`), so the recorded log-prob is the real model's log-prob of that token under the states the
engine computed. The oracle
reads the whole token history of the request (prompt + output) and writes the scripted assistant message of the
current turn (the j-th generation prefix of the history: SCRIPT[j]), token by token, then [end_of_msg].
"""

import torch

from k3.env.client import assistant_message, tool_call
from k3.env.task import Budget, Task, TaskFamily, Verdict, register_family
from k3.serve.chat import chat_stop, render_chat_ids
from k3.serve.postprocess import Postprocessor

SCRIPT = [
    assistant_message(None, [tool_call("python", {"code": "open('out.txt', 'w').write('hello')\nprint('written')"})]),
    assistant_message(None, [tool_call("submit", {"answer": "written"})]),
]


def _verify(sandbox, answer):
    ok = sandbox.read_file("out.txt") == b"hello" and answer == "written"
    return Verdict(float(ok), ok, "ok" if ok else "wrong")


def _task(i: int) -> Task:
    return Task(id=f"t/{i}", family="scripted", prompt=f"Write hello to out.txt, then submit. ({i})", verify=_verify,
                tools=("python", "submit"), budget=Budget(turns=4, tokens=4096, wall_seconds=60.0))


def body_ids(tok, msg) -> list[int]:
    """The tokens a model writes for `msg` after the generation prefix, through [end_of_msg]."""
    user = [{"role": "user", "content": "x"}]
    prefix = render_chat_ids(user, tok, None, True)
    ids = render_chat_ids(user + [msg], tok, None, False)
    assert ids[:len(prefix)] == prefix
    rest = ids[len(prefix):]
    return rest[:rest.index(chat_stop(tok)[1][0]) + 1]


def script_tokens(monkeypatch, tok, script):
    """Make every engine request write `script` (assistant messages), turn j of its history writing script[j];
    returns the scripted bodies' token ids."""
    prefix = render_chat_ids([{"role": "user", "content": "x"}], tok, None, True)
    prefix = prefix[len(render_chat_ids([{"role": "user", "content": "x"}], tok, None, False)):]
    bodies = [body_ids(tok, m) for m in script]

    def oracle(ids):
        starts = [i + len(prefix) for i in range(len(ids) - len(prefix) + 1) if ids[i:i + len(prefix)] == prefix]
        turn, k = len(starts) - 1, len(ids) - starts[-1]
        return bodies[turn][k]

    def draw(self, due, rows):
        return torch.tensor([oracle(list(s.prompt_ids) + list(s.output_ids)) for s in due], device=rows.device)

    monkeypatch.setattr(Postprocessor, "draw", draw)
    return bodies


@register_family("rltest")
class ScriptedFamily(TaskFamily):
    """`_task` instances as a task family (for `k3 rl --tasks rltest:N` in tests); the test split is offset."""
    description = "write hello to out.txt, then submit (the RL tests' scripted task)"

    def instances(self, split, n, seed=0):
        off = 0 if split == "train" else 10_000
        for i in range(n):
            t = _task(off + seed * 1000 + i)
            t.split = split
            yield t
