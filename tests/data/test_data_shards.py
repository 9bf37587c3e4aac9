"""Token shards: documents round-trip exactly, parallel tokenization equals serial, the set is reused while nothing
changed, the loader reads shards by offset (bounded memory, measured), and its order and resume are exact across
shard boundaries."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from k3.data.packing import PackedLoader
from k3.data.shards import TokenShards, _ShardWriter, build_token_set, open_token_set
from k3.data.sources import content_hash, data_units
from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer

EOS = 0


@pytest.fixture(scope="module")
def tok():
    return K3Tokenizer.byte_level()


def _corpus(root, n_jsonl=400, dup=True):
    """A directory of text files and a .jsonl file; some documents repeat, some are empty."""
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(12):
        t = f"# file {i}\n" + "".join(f"def f{j}(x):\n    return x * {j} + {i}  # é\n" for j in range(i * 7 + 1))
        (root / f"m{i:02d}.py").write_text(t, encoding="utf-8")
        texts.append(t)
    lines = []
    for i in range(n_jsonl):
        t = f"record {i}: " + "漢字 and text " * (i % 17) if i % 50 else ""
        if dup and i % 40 == 3:
            t = texts[i % 12]  # a copy of a text file
        lines.append(json.dumps({"text": t}))
    (root / "z.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(root)


def _texts(tok, shards: TokenShards) -> list[str]:
    off = shards.document_offsets()
    out = []
    for i in range(shards.num_documents):
        ids = shards.read(int(off[i]), int(off[i + 1]))
        assert ids[-1] == tok.eos_id and (ids[:-1] != tok.eos_id).all()
        out.append(tok.decode(ids[:-1].tolist()))
    return out


def test_shards_round_trip_documents_exactly(tmp_path, tok):
    data = _corpus(tmp_path / "data")
    units = data_units([data], unit_bytes=2000)
    ts = build_token_set(tok, units, str(tmp_path / "cache"), workers=1, shard_tokens=3000, task_bytes=4000)
    ix = ts.index
    assert len(ix["train"]["shards"]) > 3 and len(ix["heldout"]["shards"]) == 1
    assert all(s["tokens"] <= 3000 for s in ix["train"]["shards"][:-1] if s["documents"] > 1)
    from k3.data.corpus import load_documents

    docs = [d.text for d in load_documents([data]) if d.text]
    unique = list(dict.fromkeys(docs))  # first copies, in order
    train, held = _texts(tok, ts.train), _texts(tok, ts.heldout)
    assert ix["duplicates"] == len(docs) - len(unique) > 0 and ix["empty"] == 8
    assert sorted(train + held) == sorted(unique) and len(held) >= 1
    assert train == [t for t in unique if t not in set(held)]  # source order kept
    assert ts.train.dtype == np.uint16 and len(ts.train) == sum(len(tok.encode(t)) + 1 for t in train)
    # The same sources and tokenizer: reused, nothing tokenized.
    again = build_token_set(tok, units, str(tmp_path / "cache"), workers=1, shard_tokens=3000, task_bytes=4000)
    assert again.reused and again.directory == ts.directory
    # A changed file or another tokenizer: a new set beside the old one.
    os.utime(os.path.join(data, "m00.py"), ns=(1, 1))
    changed = build_token_set(tok, data_units([data], unit_bytes=2000), str(tmp_path / "cache"), workers=1)
    other = build_token_set(K3Tokenizer(byte_level_tokenizer(vocab_size=300)), units, str(tmp_path / "cache"),
                            workers=1)
    assert not changed.reused and not other.reused
    assert len({ts.directory, changed.directory, other.directory}) == 3
    assert _texts(tok, changed.train) == train and _texts(tok, other.train) == train


def test_parallel_tokenization_equals_serial(tmp_path, tok):
    data = _corpus(tmp_path / "data")
    units = data_units([data], unit_bytes=1500)
    serial = build_token_set(tok, units, str(tmp_path / "a"), workers=1, shard_tokens=5000, task_bytes=3000)
    parallel = build_token_set(tok, units, str(tmp_path / "b"), workers=2, shard_tokens=5000, task_bytes=3000)
    assert parallel.index["workers"] == 2 and serial.index["workers"] == 1
    for k in ("train", "heldout", "duplicates", "empty", "tokenizer", "sources"):
        assert parallel.index[k] == serial.index[k], k
    names = sorted(os.listdir(serial.directory))
    assert names == sorted(os.listdir(parallel.directory))
    for n in names:
        if n != "index.json":
            with open(os.path.join(serial.directory, n), "rb") as f:
                with open(os.path.join(parallel.directory, n), "rb") as g:
                    assert f.read() == g.read(), n


def test_damaged_or_partial_set_is_rebuilt(tmp_path, tok):
    data = _corpus(tmp_path / "data", n_jsonl=50)
    units = data_units([data])
    ts = build_token_set(tok, units, str(tmp_path / "c"), workers=1)
    shard = os.path.join(ts.directory, ts.index["train"]["shards"][0]["file"])
    with open(shard, "r+b") as f:
        f.truncate(10)
    assert open_token_set(ts.directory) is None
    os.makedirs(ts.directory + ".partial/parts")  # a killed build's leftovers
    again = build_token_set(tok, units, str(tmp_path / "c"), workers=1)
    assert not again.reused and os.path.getsize(shard) == ts.index["train"]["shards"][0]["tokens"] * 2
    assert sorted(os.listdir(tmp_path / "c")) == [os.path.basename(ts.directory)]


def test_a_bad_record_in_a_worker_is_named_and_leaves_nothing(tmp_path, tok):
    lines = [json.dumps({"text": f"doc {i} " * 20}) for i in range(3000)]
    lines[2345] = json.dumps({"text": 3})
    (tmp_path / "e.jsonl").write_text("\n".join(lines) + "\n")
    units = data_units([str(tmp_path / "e.jsonl")], unit_bytes=20_000)
    with pytest.raises(ValueError, match=r"e\.jsonl:2346: expected a JSON object with a string 'text' field"):
        build_token_set(tok, units, str(tmp_path / "c"), workers=2, task_bytes=20_000)
    assert os.listdir(tmp_path / "c") == []


def _written(tmp_path, tokens, doc_lengths, limit, name="train"):
    w = _ShardWriter(str(tmp_path), name, "uint16", limit)
    w.add(tokens, doc_lengths)
    return TokenShards(str(tmp_path), w.finish(), "uint16")


def _stream(n, seed=0):
    rng = np.random.default_rng(seed)
    s = rng.integers(1, 1000, size=n).astype(np.uint16)
    s[rng.random(n) < 0.02] = EOS
    return s


def test_loader_over_shards_equals_the_array_and_resumes_across_a_shard_boundary(tmp_path):
    s = _stream(20_000)
    lengths = np.full(200, 100, dtype=np.int64)  # 200 "documents" of 100 tokens
    shards = _written(tmp_path, s, lengths, limit=2_300)  # 23 documents per shard: boundaries every 2,300 tokens
    assert len(shards.files) == 9 and shards.read(0, len(shards)).tolist() == s.tolist()
    assert shards.read(2_290, 2_310).tolist() == s[2_290:2_310].tolist()  # one read over two shards
    T, B = 64, 5
    ref = PackedLoader(s, T, B, EOS, seed=7)
    got = PackedLoader(shards, T, B, EOS, seed=7, data="set-1")
    expected = [ref.next_batch() for _ in range(70)]  # 312 rows per epoch: past the first epoch
    for want in expected[:20]:
        b = got.next_batch()
        assert all(torch.equal(b[k], want[k]) for k in want)
    state = json.loads(json.dumps(got.state_dict()))
    assert state == {"epoch": 0, "position": 100, "seed": 7, "data": "set-1"}
    # The rows served after the resume point include ones spanning a shard boundary.
    order = np.random.default_rng([7, 0]).permutation(got.num_rows)[100:]
    bounds = set(shards.starts[1:-1])
    assert any(any(r * T < b < (r + 1) * T for b in bounds) for r in order)
    resumed = PackedLoader(shards, T, B, EOS, seed=0, data="set-1")
    resumed.load_state_dict(state)
    for want in expected[20:]:
        b = resumed.next_batch()
        assert all(torch.equal(b[k], want[k]) for k in want)
    with pytest.raises(ValueError, match="token set set-1.*set-2"):
        PackedLoader(shards, T, B, EOS, data="set-2").load_state_dict(state)


def test_loader_reads_only_its_rows_by_offset(tmp_path):
    s = _stream(50_000)
    shards = _written(tmp_path, s, np.full(50, 1000, dtype=np.int64), limit=10_000)
    reads = []
    real = shards.read

    def counting(lo, hi):
        reads.append(hi - lo)
        return real(lo, hi)

    shards.read = counting
    loader = PackedLoader(shards, 128, 6, EOS)
    for _ in range(10):
        loader.next_batch()
    assert reads == [128] * 60  # each batch reads its rows, nothing else
    assert shards._maps == [None] * 5  # and never maps a shard (see the test below)
    assert isinstance(shards.shard(2), np.memmap) and shards.shard(2)[:5].tolist() == s[20_000:20_005].tolist()


def test_loader_peak_memory_stays_bounded_over_a_large_shard(tmp_path):
    # A 256 MB shard (128M uint16 tokens): 300 batches of 8 x 1024 tokens grow the peak RSS by a few MB at most.
    n = 128 << 20
    with open(tmp_path / "train-00000.bin", "wb") as f:
        chunk = np.arange(1 << 24, dtype=np.uint16) | 1
        for _ in range(n // chunk.shape[0]):
            f.write(chunk.tobytes())
    np.save(tmp_path / "train.docs.npy", np.array([0, n], dtype=np.int64))
    split = {"shards": [{"file": "train-00000.bin", "tokens": n, "documents": 1}], "documents": 1,
             "docs": "train.docs.npy"}
    code = textwrap.dedent(f"""
        import resource
        from k3.data.packing import PackedLoader
        from k3.data.shards import TokenShards
        loader = PackedLoader(TokenShards({str(tmp_path)!r}, {split!r}, "uint16"), 1024, 8, eos_id=0)
        loader.next_batch()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        total = sum(int(loader.next_batch()["input_ids"].sum()) for _ in range(300))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(total > 0, (after - before) // 1024)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    ok, grown_mb = out.stdout.split()
    assert ok == "True" and int(grown_mb) < 32, f"300 batches grew the peak RSS by {grown_mb} MB"


def test_content_hash_is_the_split_key(tmp_path, tok):
    # The held-out documents of a set are those whose text hashes below 2% (or the smallest, when none does).
    data = _corpus(tmp_path / "data", dup=False)
    ts = build_token_set(tok, data_units([data]), str(tmp_path / "c"), workers=1)
    held = _texts(tok, ts.heldout)
    cut = 0.02 * 2.0**64
    assert held and all(content_hash(t.encode()) < cut for t in held)
    assert not any(content_hash(t.encode()) < cut for t in _texts(tok, ts.train))
