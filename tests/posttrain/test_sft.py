"""SFT on chat data (report §4.1.1): records checked at the edge, the server's template rendering, loss on the
assistant's tokens only, packing with document masks, `k3 sft` resuming bit-exactly (with and without QAT), and the
docstring-to-code generator (`k3 data sft-from-source`)."""

import json
import os

import numpy as np
import pytest
import torch

from helpers import randomize_, stop_after
from k3.checkpoint import save_pretrained
from k3.config import K3Config
from k3.data.packing import IGNORE_INDEX
from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer
from k3.model.batch import BatchInfo
from k3.model.model import K3ForCausalLM
from k3.posttrain.chat_data import (ChatDataError, ChatLoader, conversation_pieces, pack_conversations,
                                    read_chat_jsonl, tokenize_conversations)
from k3.serve.chat import (DEFAULT_CHAT_TEMPLATE, ChatTemplate, encode_segments, render_chat, render_chat_ids,
                           save_chat_template, split_markup)

VOCAB = 512
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "add one to x"},
        {"role": "assistant", "content": "def f(x):\n    return x + 1\n"},
        {"role": "user", "content": "and two?"}, {"role": "assistant", "content": "def g(x):\n    return x + 2\n"}]


def _tok():
    return K3Tokenizer(byte_level_tokenizer(VOCAB))


def _conversations(n=60):
    out = []
    for i in range(n):
        out.append([{"role": "system", "content": "You write Python."},
                    {"role": "user", "content": f"a function returning x times {i}"},
                    {"role": "assistant", "content": f"def f{i}(x):\n    return x * {i}\n"}])
    return out


def _write_jsonl(path, convs):
    with open(path, "w") as f:
        for c in convs:
            f.write(json.dumps({"messages": c}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny checkpoint with a byte-level tokenizer and a non-default chat template (so that the template is
    seen to come from the checkpoint)."""
    d = tmp_path_factory.mktemp("base")
    cfg = K3Config.from_preset("tiny").replace(vocab_size=VOCAB, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = randomize_(K3ForCausalLM(cfg), seed=0)
    save_pretrained(model, d, extra_files={"tokenizer.json": _tok().to_str().encode()})
    save_chat_template(d, ChatTemplate(open="<", close="</", sep=">"))
    return str(d)


# --- records ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("line, field", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}', "messages[1].role"),
    ('{"conversation": []}', "'messages' is missing"),
    ('{"messages": []}', "'messages' must be a non-empty list"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}', "messages[1].content"),
    ('{"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]}', "messages[0].content"),
    ('{"messages": [{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "x"}]}',
     "messages[0].content[0].type"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "messages[0].role"),
    ('{"messages": [{"role": "user", "content": "hi", "tool_calls": []}, {"role": "assistant", "content": "x"}]}',
     "messages[0].tool_calls"),
    ('[1, 2]', "JSON object"),
    ('{"messages": [', "not valid JSON"),
])
def test_bad_records_name_the_line_and_the_field(tmp_path, line, field):
    good = json.dumps({"messages": CONV})
    path = tmp_path / "chat.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(ChatDataError) as e:
        read_chat_jsonl(str(path))
    assert f"{path}:3:" in str(e.value) and field in str(e.value)
    recs, bad = read_chat_jsonl(str(path), skip_bad=True)  # skipped and counted, never silently
    assert [r.line for r in recs] == [1, 4] and len(bad) == 1 and bad[0].startswith(f"{path}:3:")


# --- rendering and labels -----------------------------------------------------------------------------------------

def _reply(content, t):
    """What the model writes after the instruct-mode generation prefix (format_version 2): the response channel's
    text, its close and the end of the message."""
    return f"{content}{t.close}response{t.sep}{t.end_of_message}"


@pytest.mark.parametrize("template", [DEFAULT_CHAT_TEMPLATE, ChatTemplate(open="<", close="</", sep=">")])
def test_rendering_is_the_servers(template):
    tok = _tok()  # has the default markup as special tokens; the second template's markers are plain text
    pieces = conversation_pieces(CONV, template)
    assert "".join(t for t, _ in pieces) == render_chat(CONV, template, add_generation_prompt=False)
    assert [t for t, trained in pieces if trained] == [_reply(m["content"], template)
                                                      for m in CONV if m["role"] == "assistant"]
    (ids, trained), = tokenize_conversations(tok, [CONV], template)
    assert ids[-1] == tok.eos_id and not trained[-1]
    assert tok.decode(ids[:-1].tolist()) == render_chat(CONV, template, add_generation_prompt=False)
    assert (template is DEFAULT_CHAT_TEMPLATE) == (tok.special_token_id("[open]") in ids.tolist())
    # Every reply starts where the server's prompt for it ends: the prompt tokens are the server's encoding.
    starts = [i for i in range(1, len(ids)) if trained[i] and not trained[i - 1]]
    assistant_at = [i for i, m in enumerate(CONV) if m["role"] == "assistant"]
    assert len(starts) == len(assistant_at)
    for s, i in zip(starts, assistant_at):
        assert ids[:s].tolist() == render_chat_ids(CONV[:i], tok, template)


def test_first_reply_prompt_is_the_servers_with_a_bpe_tokenizer():
    from k3.data.tokenizer import train_bpe

    tok = train_bpe([render_chat(CONV, add_generation_prompt=False) * 20, "def f(x): return x + 1\n" * 50], 400,
                    max_train_bytes=None)
    (ids, trained), = tokenize_conversations(tok, [CONV], DEFAULT_CHAT_TEMPLATE)
    s = int(np.argmax(trained))
    assert ids[:s].tolist() == render_chat_ids(CONV[:2], tok)
    assert tok.decode(ids[:-1].tolist()) == render_chat(CONV, add_generation_prompt=False)


def test_tool_calls_reasoning_and_options_in_sft_records(tmp_path):
    """Thinking-mode records with tools: the channels are trained, option messages and the pure-JSON fallback
    block (inputs only) are not."""
    conv = [{"role": "user", "content": "list files"},
            {"role": "assistant", "reasoning_content": "use ls", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "ls", "arguments": '{"path": "/tmp"}'}},
                {"id": "b", "type": "function", "function": {"name": "ls", "arguments": '["odd"]'}}]},
            {"role": "tool", "tool_call_id": "a", "content": "x.txt"},
            {"role": "option", "type": "tool-declare", "tools": [{"type": "function", "function": {"name": "cat"}}]},
            {"role": "assistant", "content": "x.txt"}]
    tools = [{"type": "function", "function": {"name": "ls"}}]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": conv, "tools": tools, "reasoning_effort": "low", "thinking": True}) + "\n")
    (rec,), bad = read_chat_jsonl(str(path))
    assert rec.options == {"tools": tools, "reasoning_effort": "low", "thinking": True} and not bad
    trained = "".join(t for t, tr in conversation_pieces(rec.messages, DEFAULT_CHAT_TEMPLATE, **rec.options) if tr)
    assert trained == ('use ls[close]think[sep][open]tools[sep][open]call tool="ls" index="0"[sep]'
                       '[open]arg name="path"[sep]/tmp[close]arg[sep][close]call[sep]'
                       '[open]call tool="ls" index="1"[sep]'
                       '[close]call[sep][close]tools[sep][end_of_msg]'
                       '[close]think[sep][open]response[sep]x.txt[close]response[sep][end_of_msg]')
    tok = _tok()
    (ids, mask), = tokenize_conversations(tok, [rec.messages], DEFAULT_CHAT_TEMPLATE, [rec.options])
    assert tok.decode(ids[mask].tolist()) == trained
    bad_call = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "ls", "arguments": "{oops"}}]}]}
    path.write_text(json.dumps(bad_call) + "\n")
    with pytest.raises(ChatDataError, match=r":1: messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid"):
        read_chat_jsonl(str(path))


def _sft_loss(model, batch, labels):
    info = BatchInfo.from_segment_ids(batch["segment_ids"])
    with torch.no_grad():
        return model(batch["input_ids"], labels=labels, batch=info, return_logits=False).loss


def test_only_assistant_tokens_carry_loss():
    tok = _tok()
    examples = tokenize_conversations(tok, [CONV, CONV[:3]], DEFAULT_CHAT_TEMPLATE)
    packed = pack_conversations(examples, 512, tok.eos_id)
    assert packed.num_rows == 1 and packed.stats["truncated"] == 0
    batch = packed.batch(np.arange(1))
    ids, labels, seg = batch["input_ids"][0], batch["labels"][0], batch["segment_ids"][0]
    n0, n1 = len(examples[0][0]), len(examples[1][0])
    assert seg[:n0].eq(0).all() and seg[n0:n0 + n1].eq(1).all() and seg[n0 + n1:].eq(2).all()  # pad: its own
    trained = np.concatenate([examples[0][1], examples[1][1], np.zeros(512 - n0 - n1, bool)])
    assert torch.equal(labels, torch.where(torch.from_numpy(trained), ids, IGNORE_INDEX))
    assert tok.decode(ids[torch.from_numpy(trained)].tolist()) == "".join(
        _reply(m["content"], DEFAULT_CHAT_TEMPLATE) for c in (CONV, CONV[:3]) for m in c if m["role"] == "assistant")

    cfg = K3Config.from_preset("tiny").replace(vocab_size=VOCAB, eos_token_id=0, num_nextn_predict_layers=0)
    torch.manual_seed(0)
    model = randomize_(K3ForCausalLM(cfg), seed=0).eval()
    # The loss as a function of the targets: every position a target (pre-training), masked to the replies.
    targets = ids.clone()
    mask = torch.from_numpy(trained)
    loss = _sft_loss(model, batch, torch.where(mask, targets, IGNORE_INDEX)[None])
    assert torch.equal(loss, _sft_loss(model, batch, labels[None]))
    text = tok.decode(ids[:n0].tolist())
    for needle, is_reply in (("Be brief", False), ("add one", False), ("[open]user", False), ("return x + 1", True)):
        pos = len(encode_segments(tok, split_markup(text[:text.index(needle)]))) + 1  # markers: one id each
        assert bool(mask[pos]) == is_reply, needle
        changed = targets.clone()
        changed[pos] = (changed[pos] + 7) % VOCAB
        other = _sft_loss(model, batch, torch.where(mask, changed, IGNORE_INDEX)[None])
        assert torch.equal(other, loss) != is_reply, needle


def test_packing_counts_truncation_and_drops():
    tok = _tok()
    long_prompt = [{"role": "user", "content": "x" * 300}, {"role": "assistant", "content": "ok"}]
    long_reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "y" * 300}]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]  # 61 tokens
    packed = pack_conversations(tokenize_conversations(tok, [long_prompt, long_reply, short],
                                                       DEFAULT_CHAT_TEMPLATE), 128, tok.eos_id)
    st = packed.stats
    assert st["conversations"] == 3 and st["truncated"] == 2 and st["dropped_no_reply"] == 1 and st["rows"] == 2
    assert (packed.labels[:, 0] == IGNORE_INDEX).all()
    loader = ChatLoader(packed, 3, seed=1)
    b = loader.next_batch()
    assert b["input_ids"].shape == (3, 128) and loader.state_dict() == {"epoch": 1, "position": 1, "seed": 1}


# --- k3 sft ---------------------------------------------------------------------------------------------------------

def _sft_trainer(out, base, data, heldout, qat):
    from k3.posttrain.sft import SFTOptions, build_sft_run
    from k3.train.trainer import TrainConfig

    tc = TrainConfig(out=str(out), max_steps=4, seq_len=128, batch_tokens=384, lr=2e-3, eval_every=2, eval_batches=1,
                     save_every_minutes=1e9, qat=qat)
    return build_sft_run(SFTOptions(ckpt=base, data=[data], heldout=[heldout], resume=os.path.isdir(
        os.path.join(out, "checkpoints")), device="cpu"), tc, log=lambda *a: None)


@pytest.mark.parametrize("qat", [None, "mxfp4"])
def test_sft_resume_is_bit_exact(tmp_path, base, qat):
    data = _write_jsonl(tmp_path / "train.jsonl", _conversations(60))
    held = _write_jsonl(tmp_path / "held.jsonl", _conversations(8)[::-1])
    straight = _sft_trainer(tmp_path / "a", base, data, held, qat)
    straight.fit(progress_bar=False)
    first = _sft_trainer(tmp_path / "b", base, data, held, qat)
    stop_after(first, 2)
    assert first.fit(progress_bar=False)["step"] == 2
    resumed = _sft_trainer(tmp_path / "b", base, data, held, qat)
    assert resumed.step == 2
    resumed.fit(progress_bar=False)
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    recs = [[json.loads(line) for line in open(tmp_path / r / "metrics.jsonl")] for r in "ab"]
    losses = [[(r["step"], r.get("loss"), r.get("val_loss")) for r in rs] for rs in recs]
    assert losses[0] == losses[1] and losses[0][0][2] is not None
    ck = os.path.join(tmp_path / "b", "checkpoints", "step-0000004")
    assert open(os.path.join(ck, "chat_template.json")).read() == open(os.path.join(base, "chat_template.json")).read()


def test_cli_sft_with_qat_exports_a_servable_mxfp4_checkpoint(tmp_path, base, capsys):
    from k3.checkpoint import from_pretrained
    from k3.cli import main
    from k3.model.mx_experts import expert_formats
    from k3.train.qat import apply_qat

    data = _write_jsonl(tmp_path / "train.jsonl", _conversations(30))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(data).read() + '{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = str(tmp_path / "run")
    args = ["sft", "--ckpt", base, "--data", str(bad), "--out", out, "--max-steps", "2", "--seq-len", "128",
            "--batch-tokens", "256", "--device", "cpu", "--no-progress", "--qat", "mxfp4"]
    assert main(args) == 2
    assert f"{bad}:31: field 'messages' has no assistant message" in capsys.readouterr().err
    assert main(args + ["--skip-bad-records"]) == 0
    log = capsys.readouterr().out
    assert "1 bad records skipped" in log and f"skipped {bad}:31:" in log
    served = from_pretrained(os.path.join(out, "mxfp4"))
    assert expert_formats(served) == (None, "mxfp8")
    trained = from_pretrained(os.path.join(out, "checkpoints", "step-0000002"))
    assert expert_formats(trained) == (None, None) and trained.config.quantization_config is None
    ids = torch.randint(1, VOCAB, (1, 40))
    with torch.no_grad():
        assert torch.equal(served(ids).logits, apply_qat(trained, "mxfp4")(ids).logits)
    for name in ("tokenizer.json", "chat_template.json"):
        assert os.path.isfile(os.path.join(out, "mxfp4", name))


# --- k3 data sft-from-source ---------------------------------------------------------------------------------------

def _source_tree(root):
    for i in range(12):
        d = root / f"pkg{i % 3}"
        d.mkdir(exist_ok=True)
        (d / f"mod{i}.py").write_text(
            f'"""Module {i}."""\n\nimport os\n\n\n@staticmethod\ndef plus_{i}(x, y=1):\n    """Add {i} and y to x."""\n'
            f'    # a comment\n    return x + y + {i}\n\n\nclass C{i}:\n    def method(self):\n'
            f'        """Return the module number."""\n        return {i}\n\n    def bare(self):\n        return 0\n\n\n'
            f'def only_doc():\n    """Nothing else."""\n')
    (root / "broken.py").write_text("def f(:\n")


def test_sft_from_source_is_deterministic_and_held_out_by_file(tmp_path, capsys):
    from k3.cli import main
    from k3.data.corpus import is_heldout

    src = tmp_path / "src"
    src.mkdir()
    _source_tree(src)
    runs = []
    for r in ("a", "b"):
        tr, he = tmp_path / f"{r}_train.jsonl", tmp_path / f"{r}_held.jsonl"
        assert main(["data", "sft-from-source", str(src), "--out", str(tr), "--heldout", str(he),
                     "--heldout-fraction", "0.3"]) == 0
        runs.append((tr.read_bytes(), he.read_bytes()))
    assert runs[0] == runs[1]
    assert "13 files" in capsys.readouterr().out
    train = [json.loads(line) for line in runs[0][0].decode().splitlines()]
    held = [json.loads(line) for line in runs[0][1].decode().splitlines()]
    assert train and held and len(train) + len(held) == 24  # plus_i and C_i.method of 12 files
    files = lambda recs: {r["source"].rsplit(":", 1)[0] for r in recs}  # noqa: E731
    assert not files(train) & files(held)
    assert all(is_heldout(f, 0.3) for f in files(held)) and not any(is_heldout(f, 0.3) for f in files(train))
    rec = next(r for r in train if "plus_" in r["source"] or "def plus_" in r["messages"][2]["content"])
    user, reply = rec["messages"][1]["content"], rec["messages"][2]["content"]
    assert reply.startswith("@staticmethod\ndef plus_") and "# a comment" in reply
    assert user.endswith('    """Add ' + reply.split("plus_")[1].split("(")[0] + ' and y to x."""\n')
    compile(reply, "f", "exec")
    method = next(r for r in train + held if "def method" in r["messages"][2]["content"])
    assert method["messages"][2]["content"].startswith("def method(self):\n")  # dedented
    read_chat_jsonl(str(tmp_path / "a_train.jsonl"))  # valid `k3 sft` data


def test_definitions_finds_what_ast_walk_finds_in_its_order():
    """k3.data.sft_from_source.definitions walks statements only; it must find every function and class ast.walk
    finds, in ast.walk's order, wherever they are nested (try/except*, match, with, loops, classes, functions)."""
    import ast

    from k3.data.sft_from_source import definitions

    src = '''
def a():
    def b(): pass
    x = lambda: (yield)
    class C:
        async def d(self): pass
try:
    def e(): pass
except ValueError:
    def f(): pass
else:
    class G: pass
finally:
    def h(): pass
try:
    pass
except* OSError:
    def i(): pass
match a:
    case 1:
        def j(): pass
    case _:
        class K:
            def l(self): pass
with open("x") as fh:
    for _ in fh:
        while True:
            if _:
                def m(): pass
            else:
                async def n(): pass
'''
    tree = ast.parse(src)
    for kinds in ((ast.FunctionDef, ast.AsyncFunctionDef), (ast.FunctionDef, ast.ClassDef)):
        want = [n.name for n in ast.walk(tree) if isinstance(n, kinds)]
        assert [n.name for n in definitions(tree, kinds)] == want and len(want) >= 8
