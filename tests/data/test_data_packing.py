"""Packing: the token stream and its cache, segment ids and label masking, the resumable loader, eval batches."""

import json

import numpy as np
import pytest
import torch

from k3.data.corpus import Document
from k3.data.packing import PackedLoader, eval_batches, segment_ids_for, tokenize_documents
from k3.data.tokenizer import K3Tokenizer

EOS = 0


@pytest.fixture(scope="module")
def tok():
    return K3Tokenizer.byte_level()


def _stream(n, seed=0, eos_every=7):
    """Tokens 1..99 with an eos at pseudo-random places (about one in `eos_every`)."""
    rng = np.random.default_rng(seed)
    s = rng.integers(1, 100, size=n).astype(np.int32)
    s[rng.random(n) < 1 / eos_every] = EOS
    return s


# -------------------------------------------------------------------------------------- tokenizing


def test_tokenize_documents(tok):
    docs = [Document("a", "hello"), Document("b", ""), Document("c", "wörld\n")]
    s = tokenize_documents(tok, docs)
    assert s.dtype == np.int32 and s.ndim == 1
    expect = []
    for d in docs:
        expect += tok.encode(d.text) + [tok.eos_id]
    assert s.tolist() == expect
    assert tokenize_documents(tok, []).shape == (0,)


def test_tokenize_documents_cache(tok, tmp_path, monkeypatch):
    docs = [Document(f"d{i}", f"document number {i} é") for i in range(10)]
    cache = tmp_path / "cache" / "train.npy"
    s = tokenize_documents(tok, docs, cache)
    assert cache.is_file()
    meta = json.loads((tmp_path / "cache" / "train.npy.json").read_text())
    assert meta["tokens"] == s.shape[0] and meta["documents"] == 10
    assert np.load(cache, allow_pickle=False).tolist() == s.tolist()

    def boom(texts):
        raise AssertionError("should have used the cache")

    monkeypatch.setattr(tok, "encode_batch", boom)
    again = tokenize_documents(tok, docs, cache)
    assert again.dtype == np.int32 and again.tolist() == s.tolist()
    monkeypatch.undo()

    changed = docs[:9] + [Document("d9", "something else")]
    s2 = tokenize_documents(tok, changed, cache)  # fingerprint differs: recomputed and re-cached
    assert s2.tolist() == tokenize_documents(tok, changed).tolist() != s.tolist()
    assert json.loads((tmp_path / "cache" / "train.npy.json").read_text())["fingerprint"] != meta["fingerprint"]
    renamed = docs[:9] + [Document("other", docs[9].text)]
    assert tokenize_documents(tok, renamed, cache).tolist() == s.tolist()
    assert json.loads((tmp_path / "cache" / "train.npy.json").read_text())["fingerprint"] != meta["fingerprint"]
    # A damaged sidecar is a cache miss, not an error.
    (tmp_path / "cache" / "train.npy.json").write_text("{oops")
    assert tokenize_documents(tok, docs, cache).tolist() == s.tolist()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["train.npy", "train.npy.json"]


# --------------------------------------------------------------------------------- segments, labels


def test_segment_ids_hand_made():
    w = np.array([5, 6, EOS, 7, EOS, EOS, 8, 9])
    assert segment_ids_for(w, EOS).tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    assert segment_ids_for(np.array([EOS]), EOS).tolist() == [0]
    assert segment_ids_for(np.array([1, 2, 3]), EOS).tolist() == [0, 0, 0]
    assert segment_ids_for(np.array([], dtype=np.int32), EOS).tolist() == []


def test_labels_mask_document_boundaries():
    w = np.array([5, 6, EOS, 7, EOS, EOS, 8, 9], dtype=np.int32)
    batch = PackedLoader(w, seq_len=8, batch_size=1, eos_id=EOS).next_batch()
    assert set(batch) == {"input_ids", "labels", "segment_ids"}
    for v in batch.values():
        assert v.dtype == torch.int64 and v.shape == (1, 8)
    assert batch["input_ids"][0].tolist() == w.tolist()
    assert batch["segment_ids"][0].tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    # Each segment's first token (after position 0) is not a target: the token before it is an eos of
    # another document. The eos tokens themselves are targets (the model learns to end documents).
    assert batch["labels"][0].tolist() == [5, 6, EOS, -100, EOS, -100, -100, 9]


# ------------------------------------------------------------------------------------------- loader


def _rows_of(batch):
    return [tuple(r) for r in batch["input_ids"].tolist()]


def test_loader_epoch_visits_every_row_once():
    s = _stream(24 * 16 + 5)
    loader = PackedLoader(s, seq_len=16, batch_size=6, eos_id=EOS, seed=3)
    assert loader.num_rows == 24 and loader.tokens_per_epoch == 24 * 16 and loader.epoch == 0
    all_rows = {tuple(s[i * 16:(i + 1) * 16].tolist()) for i in range(24)}
    seen = []
    for _ in range(4):
        seen += _rows_of(loader.next_batch())
    assert loader.epoch == 1 and loader.state_dict() == {"epoch": 1, "position": 0, "seed": 3}
    assert len(seen) == 24 and set(seen) == all_rows
    second = []
    for _ in range(4):
        second += _rows_of(loader.next_batch())
    assert set(second) == all_rows and second != seen  # a new order each epoch
    # Same seed, same batches; another seed, another order.
    a = PackedLoader(s, 16, 6, EOS, seed=3)
    b = PackedLoader(s, 16, 6, EOS, seed=4)
    assert _rows_of(a.next_batch()) == seen[:6]
    assert _rows_of(b.next_batch()) != seen[:6]


def test_loader_wraps_around_epochs():
    s = _stream(10 * 8)
    loader = PackedLoader(s, seq_len=8, batch_size=4, eos_id=EOS, seed=1)
    rows = []
    for _ in range(5):  # 20 rows = exactly two epochs, with batches straddling the boundary
        b = loader.next_batch()
        assert b["input_ids"].shape == (4, 8)
        rows += _rows_of(b)
    assert loader.epoch == 2 and loader.state_dict()["position"] == 0
    assert sorted(rows[:10]) == sorted(rows[10:]) and len(set(rows[:10])) == 10
    # More rows per batch than the stream has: rows repeat across epochs.
    tiny = PackedLoader(_stream(3 * 8), seq_len=8, batch_size=7, eos_id=EOS)
    assert tiny.next_batch()["input_ids"].shape == (7, 8)
    assert tiny.epoch == 2 and tiny.state_dict()["position"] == 1
    with pytest.raises(ValueError, match="shorter than seq_len"):
        PackedLoader(_stream(7), seq_len=8, batch_size=1, eos_id=EOS)


@pytest.mark.parametrize("stop_after", [0, 1, 3, 4, 7])
def test_loader_resume_equals_uninterrupted(stop_after):
    s = _stream(13 * 32 + 3, seed=2)
    ref = PackedLoader(s, seq_len=32, batch_size=5, eos_id=EOS, seed=11)
    expected = [ref.next_batch() for _ in range(stop_after + 6)]

    first = PackedLoader(s, seq_len=32, batch_size=5, eos_id=EOS, seed=11)
    for _ in range(stop_after):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))
    assert all(type(v) is int for v in state.values())

    resumed = PackedLoader(s, seq_len=32, batch_size=5, eos_id=EOS, seed=0)  # the state carries the seed
    resumed.load_state_dict(state)
    assert resumed.epoch == state["epoch"]
    for want in expected[stop_after:]:
        got = resumed.next_batch()
        for k in want:
            assert torch.equal(got[k], want[k]), k
    with pytest.raises(ValueError, match="does not fit"):
        resumed.load_state_dict({"epoch": 0, "position": 13, "seed": 0})


def test_loader_accepts_memmapped_stream(tmp_path):
    s = _stream(6 * 16)
    np.save(tmp_path / "s.npy", s)
    mm = np.load(tmp_path / "s.npy", mmap_mode="r")
    a = PackedLoader(mm, 16, 3, EOS, seed=5).next_batch()
    b = PackedLoader(s, 16, 3, EOS, seed=5).next_batch()
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------- eval


def test_eval_batches_cover_stream_in_order():
    s = _stream(10 * 8 + 3)
    batches = list(eval_batches(s, seq_len=8, batch_size=4, eos_id=EOS))
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 3]  # 11 rows: 10 full + the padded tail
    flat_ids = torch.cat([b["input_ids"] for b in batches]).reshape(-1)
    flat_labels = torch.cat([b["labels"] for b in batches]).reshape(-1)
    assert flat_ids[: s.shape[0]].tolist() == s.tolist()
    assert (flat_labels[s.shape[0]:] == -100).all()  # padding is never a target
    for b in batches:
        for row_ids, row_seg, row_labels in zip(b["input_ids"], b["segment_ids"], b["labels"]):
            assert row_seg.tolist() == segment_ids_for(row_ids.numpy(), EOS).tolist()
            starts = torch.zeros_like(row_seg, dtype=torch.bool)
            starts[1:] = row_seg[1:] != row_seg[:-1]
            assert (row_labels[starts] == -100).all()
    # Deterministic, and max_batches stops early.
    again = list(eval_batches(s, 8, 4, EOS))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(batches, again))
    assert len(list(eval_batches(s, 8, 4, EOS, max_batches=2))) == 2
    exact = list(eval_batches(s[:80], 8, 5, EOS))
    assert len(exact) == 2 and torch.cat([b["input_ids"] for b in exact]).reshape(-1).tolist() == s[:80].tolist()
    assert list(eval_batches(s[:0], 8, 5, EOS)) == []
    short = list(eval_batches(s[:5], 8, 5, EOS))  # shorter than one row: still evaluated
    assert len(short) == 1 and short[0]["input_ids"].shape == (1, 8)

