"""`k3 init` writes a tokenizer with exactly the model's vocabulary, every id of which decodes to text."""

import pytest

from k3.cli import main
from k3.config import K3Config
from k3.data.tokenizer import load_any_tokenizer


@pytest.mark.parametrize("kind", ["bpe", "bytes"])
def test_init_tokenizer_covers_the_vocabulary(tmp_path, kind):
    out = tmp_path / "ckpt"
    assert main(["init", "--preset", "tiny", "--out", str(out), "--tokenizer", kind]) == 0
    cfg, tok = K3Config.load(str(out)), load_any_tokenizer(str(out))
    assert tok.vocab_size == cfg.vocab_size == 4096
    assert cfg.eos_token_id == tok.eos_id == 0
    texts = [tok.decode([i]) for i in range(tok.vocab_size)]
    assert all(texts), [i for i, t in enumerate(texts) if not t][:10]
    # Beyond the 257 byte-level ids the texts are distinct: a BPE's merges, or the reserved tokens.
    assert len(set(texts[257:])) == tok.vocab_size - 257
    s = "def f(x):\n    return x + 1  # ünïcödé ✓\n"
    assert tok.decode(tok.encode(s)) == s
    # The chat markup is reserved (one special id each) and the saved chat template is format_version 2.
    from k3.serve.chat import DEFAULT_CHAT_TEMPLATE, load_chat_template, markup_ids

    assert load_chat_template(out) == DEFAULT_CHAT_TEMPLATE
    ids = markup_ids(tok)
    assert ids is not None and [tok.decode([i]) for i in ids.values()] == list(ids)
    if kind == "bytes":
        assert list(ids.values()) == [257, 258, 259, 260]
    if kind == "bpe":  # a trained BPE compresses code well below one token per byte
        code = "def area(width, height):\n    return width * height\n"
        assert len(tok.encode(code)) < 0.5 * len(code.encode())
