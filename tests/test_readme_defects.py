"""The README runs as written: each defect found by walking it, reproduced (these tests failed before the fix)."""

import os
import re
import stat

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _section(heading: str) -> str:
    """The README's text under `heading` (a "## " line), up to the next heading of that level."""
    text = open(README, encoding="utf-8").read()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section, flags=re.M | re.S)


def _init_tiny(out, tokenizer="bpe") -> str:
    from k3.cli import main

    assert main(["init", "--preset", "tiny", "--tokenizer", tokenizer, "--out", str(out)]) == 0
    return str(out)


# --- 1. the quick start's BatchInfo and statistics snippet -------------------------------------------------------

def test_quick_start_batchinfo_snippet_runs_on_cpu(tmp_path):
    """The second Python snippet of "Quick start" named an undefined `seg_on_host` and moved the batch to "cuda"."""
    first, second = _blocks(_section("## Quick start"), "python")[:2]
    assert "BatchInfo" in second and "/tmp/t" in first
    ck = _init_tiny(tmp_path / "t")
    ns: dict = {}
    exec(compile(first.replace("/tmp/t", ck), "README.md: quick start 1", "exec"), ns)
    exec(compile(second, "README.md: quick start 2", "exec"), ns)
    out, ids, batch, model = ns["out"], ns["ids"], ns["batch"], ns["model"]
    T = ids.shape[1]
    assert batch.cu_seqlens_cpu.tolist() == [0, 3, T]  # the snippet's two packed documents
    cfg = model.config
    loads = out.stats.expert_loads()[1]
    assert loads.shape == (cfg.num_experts,) and int(loads.sum()) == T * cfg.num_experts_per_token
    assert out.stats.max_logit[3].shape == (cfg.num_attention_heads,)
    assert torch.isfinite(out.loss)


# --- 6. atomic writes keep the mode a plain open gives ------------------------------------------------------------

@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_atomic_writes_get_the_mode_of_a_plain_open(tmp_path, umask, mode):
    """Files written through k3.files (tempfile.mkstemp) were 0600 under umask 022: chat_template.json of `k3 init`,
    the draft's config.json and model.safetensors; every other file 0644."""
    from k3.checkpoint import from_pretrained
    from k3.draft_checkpoint import save_draft
    from k3.env.memory import MemoryStore
    from k3.files import _umask, atomic_write_text
    from k3.model.eagle3 import Eagle3Layer

    old = os.umask(umask)
    try:
        assert _umask() == umask
        ck = _init_tiny(tmp_path / "ck", tokenizer="bytes")
        draft = os.path.join(ck, "draft")
        save_draft(Eagle3Layer.from_target(from_pretrained(ck)), draft, ck)
        MemoryStore(str(tmp_path / "memory"), "arith").write("k", "v")
        open(tmp_path / "plain", "w").close()
    finally:
        os.umask(old)
    files = [os.path.join(ck, f) for f in os.listdir(ck) if os.path.isfile(os.path.join(ck, f))]
    files += [os.path.join(draft, f) for f in os.listdir(draft)] + [str(tmp_path / "memory" / "arith.json")]
    assert os.path.join(ck, "chat_template.json") in files and os.path.join(draft, "config.json") in files
    assert os.path.join(draft, "model.safetensors") in files
    assert {f: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files} == {f: oct(mode) for f in files}
    assert stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == mode
    # a file replaced keeps its own mode, as `open(path, "w")` leaves it
    path = os.path.join(ck, "chat_template.json")
    os.chmod(path, 0o640)
    atomic_write_text(path, "{}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
