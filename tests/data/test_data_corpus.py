"""Corpus: the default (standard library) corpus, the stable split, and reading user files."""

import json
import os
import random
import sys

import pytest

from k3.data.corpus import (
    MAX_STDLIB_FILE_BYTES,
    Document,
    default_corpus,
    load_documents,
    split_documents,
    stdlib_files,
    stdlib_root,
)


@pytest.fixture(scope="module")
def full_corpus():
    return default_corpus()


def _nbytes(docs):
    return sum(len(d.text.encode("utf-8")) for d in docs)


# ------------------------------------------------------------------------------------ default corpus


def test_stdlib_files_found_sorted_and_filtered():
    files = stdlib_files()
    assert len(files) > 100
    root = stdlib_root()
    rel = [os.path.relpath(p, root).replace(os.sep, "/") for p in files]
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    assert not any("site-packages/" in r or "__pycache__/" in r for r in rel)
    assert all(os.path.getsize(p) <= MAX_STDLIB_FILE_BYTES for p in files)
    assert "os.py" in rel and "json/__init__.py" in rel
    assert stdlib_files() == files


def test_default_corpus_nonempty_disjoint_deterministic(full_corpus):
    train, heldout = full_corpus
    assert len(train) > 100 and len(heldout) >= 1
    assert _nbytes(train) > 1_000_000
    assert all(isinstance(d, Document) and d.text for d in train + heldout)
    train_names = {d.name for d in train}
    held_names = {d.name for d in heldout}
    assert len(train_names) == len(train) and len(held_names) == len(heldout)
    assert not train_names & held_names
    assert 0.005 < len(heldout) / (len(train) + len(heldout)) < 0.05  # ~2%
    train2, heldout2 = default_corpus()
    assert [d.name for d in train2] == [d.name for d in train]
    assert [(d.name, d.text) for d in heldout2] == [(d.name, d.text) for d in heldout]
    # The split is the same stable-hash split as for user data.
    names = sorted(train_names | held_names)
    _, held = split_documents([Document(n, "") for n in names])
    assert {d.name for d in held} == held_names


def test_default_corpus_max_bytes(full_corpus):
    train, heldout = full_corpus
    small, held_small = default_corpus(max_bytes=200_000)
    assert 0 < _nbytes(small) <= 200_000
    assert _nbytes(small) > 190_000  # the last file is cut to fill the budget
    assert [d.name for d in held_small] == [d.name for d in heldout]
    # A capped corpus is a prefix of the full one (same deterministic order).
    assert [d.name for d in small] == [d.name for d in train[: len(small)]]
    assert all(a.text == b.text for a, b in zip(small[:-1], train))
    assert train[len(small) - 1].text.startswith(small[-1].text)
    again, _ = default_corpus(max_bytes=200_000)
    assert [(d.name, d.text) for d in again] == [(d.name, d.text) for d in small]
    assert default_corpus(max_bytes=0)[0] == []


# --------------------------------------------------------------------------------------------- split


def test_split_documents_stable_and_order_independent():
    docs = [Document(f"doc{i}.txt", str(i)) for i in range(5000)]
    train, held = split_documents(docs)
    assert 0.01 < len(held) / len(docs) < 0.03
    assert len(train) + len(held) == len(docs)
    assert not {d.name for d in train} & {d.name for d in held}
    shuffled = docs[:]
    random.Random(0).shuffle(shuffled)
    _, held2 = split_documents(shuffled)
    assert {d.name for d in held2} == {d.name for d in held}
    # Order within each part is kept.
    assert [d.name for d in train] == [d.name for d in docs if d.name not in {h.name for h in held}]
    # A larger fraction holds out a superset.
    _, held10 = split_documents(docs, 0.10)
    assert {d.name for d in held} <= {d.name for d in held10}


def test_split_documents_small_inputs():
    assert split_documents([]) == ([], [])
    one = [Document("a", "x")]
    assert split_documents(one) == (one, [])
    for n in range(2, 6):
        docs = [Document(f"f{i}", "x") for i in range(n)]
        train, held = split_documents(docs)
        assert len(held) >= 1 and len(train) >= 1 and len(train) + len(held) == n
        assert split_documents(docs) == (train, held)
    with pytest.raises(ValueError):
        split_documents(one, 1.5)


# -------------------------------------------------------------------------------------- user files


def _write(path, text, mode="w"):
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == "wb":
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_load_documents_each_kind(tmp_path):
    files = {
        "a.txt": "plain text é",
        "b.md": "# title\n",
        "c.py": "print('hi')\n",
        "d.rst": "Title\n=====\n",
    }
    for name, text in files.items():
        _write(tmp_path / name, text)
    jl = _write(tmp_path / "e.jsonl", "\n".join([json.dumps({"text": "one", "id": 1}), "",
                                                  json.dumps({"text": "two 漢字"})]) + "\n")
    for name, text in files.items():
        docs = load_documents([str(tmp_path / name)])
        assert docs == [Document(str(tmp_path / name), text)]
    docs = load_documents([jl])
    assert [d.text for d in docs] == ["one", "two 漢字"]
    assert [d.name for d in docs] == [f"{jl}:1", f"{jl}:3"]
    # Several paths keep their order.
    both = load_documents([str(tmp_path / "c.py"), str(tmp_path / "a.txt")])
    assert [d.text for d in both] == ["print('hi')\n", "plain text é"]


def test_load_documents_directory_recursive_sorted(tmp_path):
    _write(tmp_path / "z.txt", "z")
    _write(tmp_path / "sub" / "b.py", "b")
    _write(tmp_path / "sub" / "a.md", "a")
    _write(tmp_path / "sub" / "deeper" / "c.jsonl", json.dumps({"text": "c"}) + "\n")
    _write(tmp_path / "sub" / "ignored.csv", "x,y")
    _write(tmp_path / ".hidden" / "h.txt", "hidden")
    docs = load_documents([tmp_path])
    assert [d.text for d in docs] == ["a", "b", "c", "z"]
    assert load_documents(str(tmp_path)) == docs  # a single path is accepted too


def test_load_documents_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match="nope.txt.*no such file.*accepted"):
        load_documents([missing])
    bad = _write(tmp_path / "data.csv", "a,b")
    with pytest.raises(ValueError, match=r"data\.csv.*\.csv.*accepted.*\.jsonl"):
        load_documents([bad])
    jl = _write(tmp_path / "bad.jsonl", json.dumps({"text": "ok"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        load_documents([jl])
    jl2 = _write(tmp_path / "bad2.jsonl", json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad2\.jsonl:2.*'text'"):
        load_documents([jl2])
    jl3 = _write(tmp_path / "bad3.jsonl", json.dumps({"text": 3}) + "\n")
    with pytest.raises(ValueError, match=r"bad3\.jsonl:1"):
        load_documents([jl3])
    latin = _write(tmp_path / "latin.txt", "caf\xe9".encode("latin-1"), mode="wb")
    with pytest.raises(ValueError, match=r"latin\.txt.*UTF-8"):
        load_documents([latin])
    empty = tmp_path / "empty"
    empty.mkdir()
    _write(empty / "x.csv", "1")
    with pytest.raises(ValueError, match="empty.*no files"):
        load_documents([empty])


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    path = _write(tmp_path / "t.parquet", b"PAR1", mode="wb")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(ImportError, match="reading .parquet needs pyarrow: pip install pyarrow"):
        load_documents([path])


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["first", None, "third é"], "n": [1, 2, 3]}), path)
    docs = load_documents([path])
    assert [d.text for d in docs] == ["first", "third é"]
    assert [d.name for d in docs] == [f"{path}:0", f"{path}:2"]
    nocol = tmp_path / "n.parquet"
    pq.write_table(pa.table({"body": ["x"]}), nocol)
    with pytest.raises(ValueError, match="n.parquet.*'text' column"):
        load_documents([nocol])
