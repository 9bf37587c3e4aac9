"""Tokenizers: byte-level BPE training, the K3Tokenizer wrapper, save/load, tiktoken conversion."""

import base64
import os
import random
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3.data.corpus import default_corpus
from k3.data.tokenizer import (
    CHAT_MARKUP,
    DEFAULT_SPLIT_PATTERN,
    EOS,
    K3Tokenizer,
    byte_level_tokenizer,
    bytes_to_unicode,
    cached_tokenizer,
    load_any_tokenizer,
    load_tokenizer,
    train_bpe,
)

ODD_TEXTS = [
    "",
    " ",
    "\n\n\t  \r\n",
    "def f(x):\n    return x + 1  # é",
    "naïve café — 漢字かな交じり 🙂👩‍👩‍👧 e\u0301 \u200b\ufeff",
    "\x00\x01\x1f\x7f\x80\x9f\xa0\xad\xff",
    bytes(range(256)).decode("latin-1"),
    "literal <|endoftext|> inside a document",
    "x" * 5000 + " " * 300 + "1234567890",
    "I'LL we've DON'T it's",
]


@pytest.fixture(scope="module")
def sample_texts():
    train, _ = default_corpus(max_bytes=400_000)
    return [d.text for d in train]


@pytest.fixture(scope="module")
def bpe(sample_texts):
    return train_bpe(sample_texts, 1024)


# ---------------------------------------------------------------------------------------- training


def test_bpe_basics(bpe):
    assert isinstance(bpe, K3Tokenizer)
    assert bpe.eos_id == 0 and bpe.token_to_id(EOS) == 0
    assert bpe.vocab_size == 1024 == len(bpe)
    assert bpe.id_to_token(1023) is not None
    # Reached by merges, not by padding.
    assert bpe.token_to_id("<|reserved_0|>") is None
    code = "import os\n\ndef main():\n    return os.path.join('a', 'b')\n"
    assert len(bpe.encode(code)) < len(code.encode()) / 2.5  # it compresses code
    assert 0 not in bpe.encode("text with <|endoftext|> in it")  # documents cannot forge a boundary


@pytest.mark.parametrize("text", ODD_TEXTS)
def test_bpe_round_trip_odd_texts(bpe, text):
    ids = bpe.encode(text)
    assert all(0 < i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=200))
def test_bpe_round_trip_any_unicode(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
def test_bpe_round_trip_any_bytes_as_text(bpe, data):
    for text in (data.decode("latin-1"), data.decode("utf-8", errors="replace")):
        assert bpe.decode(bpe.encode(text)) == text


def test_encode_batch_matches_encode(bpe):
    assert bpe.encode_batch(ODD_TEXTS) == [bpe.encode(t) for t in ODD_TEXTS]
    assert bpe.encode_batch([]) == []


def test_bpe_training_deterministic(sample_texts, bpe):
    again = train_bpe(sample_texts, 1024)
    assert again.tokenizer.get_vocab() == bpe.tokenizer.get_vocab()
    assert again.to_str() == bpe.to_str()


def test_bpe_training_limits_text(sample_texts):
    small = train_bpe(sample_texts, 600, max_train_bytes=20_000)
    same = train_bpe(sample_texts[:40], 600, max_train_bytes=20_000)  # more text after the cut changes nothing
    assert small.to_str() == same.to_str()


def test_bpe_pads_to_vocab_size_on_tiny_text():
    tok = train_bpe(["abab abab"], 400)
    assert tok.vocab_size == 400 and tok.eos_id == 0
    assert tok.token_to_id("<|reserved_0|>") is not None
    assert tok.decode(tok.encode("abab <|reserved_0|>")) == "abab <|reserved_0|>"
    with pytest.raises(ValueError, match="at least 261"):  # eos, 256 bytes and the 4 chat markup tokens
        train_bpe(["x"], 100)


# ------------------------------------------------------------------------------------- save / load


def test_save_load_round_trip(bpe, tmp_path):
    path = bpe.save(tmp_path / "ckpt")
    assert path == str(tmp_path / "ckpt" / "tokenizer.json") and os.path.isfile(path)
    assert [f for f in os.listdir(tmp_path / "ckpt")] == ["tokenizer.json"]  # no temp file left behind
    for source in (tmp_path / "ckpt", path):
        loaded = load_any_tokenizer(source)
        assert loaded.vocab_size == bpe.vocab_size and loaded.eos_id == bpe.eos_id
        assert loaded.tokenizer.get_vocab() == bpe.tokenizer.get_vocab()
        for t in ODD_TEXTS:
            assert loaded.encode(t) == bpe.encode(t)
            assert loaded.decode(loaded.encode(t)) == t
    bpe.save(tmp_path / "other.json")
    assert load_any_tokenizer(tmp_path / "other.json").to_str() == bpe.to_str()
    # The plain `tokenizers` loader used elsewhere reads the same file.
    assert load_tokenizer(tmp_path / "ckpt").encode("def f(): pass").ids == bpe.encode("def f(): pass")
    with pytest.raises(FileNotFoundError):
        load_any_tokenizer(tmp_path / "missing")


def test_byte_level_tokenizer_still_works():
    raw = byte_level_tokenizer()
    text = "def f(x):\n    return x + 1  # é"
    assert raw.decode(raw.encode(text).ids) == text
    tok = K3Tokenizer.byte_level()
    assert tok.eos_id == 0 and tok.vocab_size == 261  # eos, the 256 bytes, the 4 chat markup tokens
    assert tok.encode(text) == raw.encode(text).ids
    for t in ODD_TEXTS:
        assert tok.decode(tok.encode(t)) == t


def test_cached_tokenizer(sample_texts, tmp_path):
    calls = []

    def texts():
        calls.append(1)
        return sample_texts[:20]

    a = cached_tokenizer(tmp_path, texts, 512)
    assert calls == [1] and (tmp_path / "tokenizer.json").is_file()
    b = cached_tokenizer(tmp_path, texts, 512)
    assert calls == [1] and b.to_str() == a.to_str()
    c = cached_tokenizer(tmp_path, texts, 600)  # other size: trained again and replaced
    assert calls == [1, 1] and c.vocab_size == 600
    assert load_any_tokenizer(tmp_path).vocab_size == 600


# ----------------------------------------------------------------------------- tiktoken conversion


def _train_ranks(texts, pattern_findall, num_merges, seed=0):
    """A tiny rank-based BPE trainer: single bytes first (in a shuffled order), then repeatedly the most
    frequent adjacent pair inside pre-tokenized pieces gets the next rank."""
    order = list(range(256))
    random.Random(seed).shuffle(order)
    ranks = {bytes([b]): r for r, b in enumerate(order)}
    words = Counter(tuple(bytes([c]) for c in p.encode()) for t in texts for p in pattern_findall(t))
    for _ in range(num_merges):
        pairs = Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += n
        words = merged
    return ranks


def _reference_encode(text, ranks, pattern_findall):
    """Rank-based BPE, directly: a piece that is a token is that token; otherwise repeatedly merge the
    adjacent pair whose concatenation has the lowest rank."""
    ids = []
    for piece in pattern_findall(text):
        data = piece.encode()
        if data in ranks:
            ids.append(ranks[data])
            continue
        parts = [data[i:i + 1] for i in range(len(data))]
        while True:
            best = min(((ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                        if parts[i] + parts[i + 1] in ranks), default=None)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] for p in parts)
    return ids


def _write_ranks(path, ranks):
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    path.write_text("\n".join(lines) + "\n")
    return path


TIKTOKEN_TRAIN = [
    "the quick brown fox jumps over the lazy dog; the dog sleeps. " * 3,
    "def forward(self, x):\n    return self.proj(x) + x  # residual\n" * 3,
    "café naïve résumé — 漢字 漢字 かな 🙂🙂 12345 67890 2024-01-01\n" * 3,
    "I'm sure they'll say it's fine; we've done THE WORK\r\n" * 2,
]
TIKTOKEN_TEST = TIKTOKEN_TRAIN + [
    "xyz the lazy fox résumé 漢字かな 🙂 999999 'll",
    "unseen words: zebra quokka 🦘 ÆØÅ \t\t\n\n    indented()",
    "",
    "the",
]


def _check_conversion(tmp_path, findall, pattern=None):
    ranks = _train_ranks(TIKTOKEN_TRAIN, findall, 150)
    ranks[b"xyz"] = len(ranks)  # a token no merge can build: only a whole piece equal to it gets it
    path = _write_ranks(tmp_path / "tiktoken.model", ranks)
    kwargs = {} if pattern is None else {"pattern": pattern}
    tok = load_any_tokenizer(path, **kwargs)
    assert tok.vocab_size == len(ranks) + 1 and tok.eos_id == len(ranks)
    assert load_any_tokenizer(tmp_path, **kwargs).to_str() == tok.to_str()  # directory holding tiktoken.model
    for text in TIKTOKEN_TEST:
        assert tok.encode(text) == _reference_encode(text, ranks, findall), text
        assert tok.decode(tok.encode(text)) == text
    # The converted tokenizer survives a tokenizer.json round trip.
    tok.save(tmp_path / "conv")
    again = load_any_tokenizer(tmp_path / "conv")
    assert all(again.encode(t) == tok.encode(t) for t in TIKTOKEN_TEST)
    return tok, ranks


def test_tiktoken_conversion_default_pattern(tmp_path):
    regex = pytest.importorskip("regex")  # Python's `re` lacks \p{L}; the `regex` module has it
    pat = regex.compile(DEFAULT_SPLIT_PATTERN)
    tok, ranks = _check_conversion(tmp_path, pat.findall)
    assert tok.encode("xyz") == [ranks[b"xyz"]]


def test_tiktoken_conversion_custom_pattern(tmp_path):
    pattern = r" ?[A-Za-z]+| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"
    _check_conversion(tmp_path, re.compile(pattern).findall, pattern=pattern)


def test_tiktoken_special_tokens_and_errors(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    ranks[b"ab"] = 256
    path = _write_ranks(tmp_path / "m.tiktoken", ranks)
    tok = load_any_tokenizer(path, special_tokens={"<|im_end|>": 257, EOS: 260})
    assert tok.eos_id == 260 and tok.token_to_id("<|im_end|>") == 257 and tok.vocab_size == 261
    assert tok.encode("abab") == [256, 256]
    assert 260 not in tok.encode("<|endoftext|>")
    (tmp_path / "bad.model").write_text("YWI= 1\nnot-base64!! 2\n")
    with pytest.raises(ValueError, match=r"bad\.model:2"):
        load_any_tokenizer(tmp_path / "bad.model")
    (tmp_path / "few.model").write_text("YQ== 0\nYg== 1\n")
    with pytest.raises(ValueError, match="every byte"):
        load_any_tokenizer(tmp_path / "few.model")


def test_bytes_to_unicode_matches_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    table = bytes_to_unicode()
    assert sorted(table.values()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    pt = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    for b in range(128):
        assert pt.pre_tokenize_str(chr(b))[0][0] == table[b]
    assert pt.pre_tokenize_str("é")[0][0] == table[0xC3] + table[0xA9]


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_chat_markup_tokens(kind, sample_texts):
    """The chat markup is four reserved special tokens (after the learned vocabulary, before the padding): one id
    each, decoded whole, never produced by encoding text (k3.serve.chat encodes markup and text apart)."""
    tok = K3Tokenizer(byte_level_tokenizer(300)) if kind == "bytes" else train_bpe(sample_texts[:20], 600)
    ids = [tok.special_token_id(m) for m in CHAT_MARKUP]
    assert len(set(ids)) == 4 and None not in ids and tok.vocab_size == (300 if kind == "bytes" else 600)
    if kind == "bytes":
        assert ids == [257, 258, 259, 260] and tok.token_to_id("<|reserved_0|>") == 261
    text = "a[open]b[sep]c[close]d[end_of_msg]" + "".join(CHAT_MARKUP)
    enc = tok.encode(text)
    assert not set(ids) & set(enc) and tok.decode(enc) == text
    for m, i in zip(CHAT_MARKUP, ids):
        assert tok.decode([i]) == m and tok.decode([5, i, 5]) == tok.decode([5]) + m + tok.decode([5])
    assert tok.special_token_id("[open") is None and tok.special_token_id(EOS) == 0
