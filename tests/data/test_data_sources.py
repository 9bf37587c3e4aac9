"""Sources: --data's files, directories and globs; .jsonl cut into byte ranges and .parquet into row groups read as
the whole file reads; bad records named by line; the content-hash split (stable under other files) and dedup."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from k3.data.corpus import default_corpus, default_units, load_documents
from k3.data.sources import (
    HELDOUT,
    SPLIT,
    TRAIN,
    assign,
    content_hash,
    data_units,
    file_units,
    installation_files,
    iter_documents,
    read_unit,
    resolve_paths,
)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def _jsonl(path, texts, blank_every=0):
    lines = []
    for i, t in enumerate(texts):
        lines.append(json.dumps({"text": t, "i": i}))
        if blank_every and i % blank_every == 0:
            lines.append("")
    return _write(path, "\n".join(lines) + "\n")


def test_globs_directories_and_files_in_order(tmp_path):
    _write(tmp_path / "a" / "x.txt", "x")
    _write(tmp_path / "a" / "deep" / "y.jsonl", json.dumps({"text": "y"}) + "\n")
    _write(tmp_path / "a" / "skip.csv", "no")
    _write(tmp_path / "b" / "z.md", "z")
    _write(tmp_path / "b" / "w.py", "w")
    got = resolve_paths([str(tmp_path / "b" / "*.md"), str(tmp_path / "a"), str(tmp_path / "**" / "*.py"),
                         str(tmp_path / "a" / "x.txt")])  # x.txt again: kept once, at its first place
    rel = [os.path.relpath(p, tmp_path) for p in got]
    assert rel == ["b/z.md", "a/deep/y.jsonl", "a/x.txt", "b/w.py"]
    with pytest.raises(ValueError, match=r"nothing\*\.jsonl.*matches no files.*accepted"):
        resolve_paths([str(tmp_path / "nothing*.jsonl")])
    with pytest.raises(ValueError, match="missing.txt.*no such file"):
        resolve_paths([str(tmp_path / "missing.txt")])
    docs = load_documents([str(tmp_path / "**" / "*.*")])
    assert sorted(d.text for d in docs) == ["w", "x", "y", "z"]  # the .csv is not matched by an accepted glob


def test_jsonl_byte_ranges_read_as_the_whole_file(tmp_path):
    texts = [f"document {i} " + "é" * (i % 13) for i in range(300)]
    path = _jsonl(tmp_path / "d.jsonl", texts, blank_every=7)
    whole = [d.text for d in read_unit(file_units(path)[0])]
    assert whole == texts
    for unit_bytes in (1, 50, 333, 4096):
        units = file_units(path, unit_bytes=unit_bytes)
        assert len(units) == -(-os.path.getsize(path) // unit_bytes)
        assert [d.text for d, _ in iter_documents(units)] == texts, unit_bytes


def test_bad_jsonl_lines_are_named_in_any_range(tmp_path):
    lines = [json.dumps({"text": f"ok {i}"}) for i in range(200)]
    lines[150] = "{not json"
    path = _write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")
    for unit_bytes in (1 << 20, 256):  # the whole file, or a range starting far from line 1
        with pytest.raises(ValueError, match=r"bad\.jsonl:151: invalid JSON"):
            list(iter_documents(file_units(path, unit_bytes=unit_bytes)))
    lines[150] = json.dumps({"body": "no text"})
    path = _write(tmp_path / "bad.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:151: expected a JSON object with a string 'text' field"):
        list(iter_documents(file_units(path, unit_bytes=256)))


def test_parquet_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "t.parquet")
    texts = [f"row {i}" if i % 5 else None for i in range(100)]
    pq.write_table(pa.table({"text": texts, "n": list(range(100))}), path, row_group_size=16)
    units = file_units(path)
    assert len(units) == 7 and all(u.kind == "parquet" for u in units)
    docs = [d for d, _ in iter_documents(units)]
    assert [d.text for d in docs] == [t for t in texts if t is not None]
    assert docs[0].name == f"{path}:1" and docs[-1].name == f"{path}:99"  # rows counted across row groups
    bad = str(tmp_path / "bad.parquet")
    pq.write_table(pa.table({"body": ["x"]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet.*'text' column"):
        data_units([bad])


def _held(names_texts):
    docs = list(names_texts)
    dest = assign([content_hash(t.encode()) for t in docs], [SPLIT] * len(docs))
    return {t for t, d in zip(docs, dest) if d == HELDOUT}, dest


def test_heldout_split_is_stable_under_adding_other_files():
    a = [f"file a document {i}" for i in range(3000)]
    b = [f"file b document {i}" for i in range(2000)]
    held_a, _ = _held(a)
    held_ab, _ = _held(b[:1000] + a + b[1000:])  # other documents before and after
    assert 30 < len(held_a) < 90  # ~2%
    assert held_ab & set(a) == held_a
    shuffled = list(reversed(a))
    assert _held(shuffled)[0] == held_a  # nor does the order matter


def test_duplicates_are_dropped_and_never_cross_the_split():
    texts = ["a", "b", "a", "c", "b", "a"]
    dest = assign([content_hash(t.encode()) for t in texts], [SPLIT] * len(texts))
    assert (dest == 0).sum() == 3 and list(dest[[2, 4, 5]]) == [0, 0, 0]
    # Fixed roles (the default corpus) dedup too: the first copy wins, so a train copy of a held-out file goes.
    dest = assign([content_hash(b"x"), content_hash(b"x"), content_hash(b"y")], [HELDOUT, TRAIN, TRAIN])
    assert list(dest) == [HELDOUT, 0, TRAIN]
    # Tiny inputs still get both sides; one document trains.
    two = assign([content_hash(b"p"), content_hash(b"q")], [SPLIT, SPLIT])
    assert sorted(two) == [TRAIN, HELDOUT]
    assert list(assign([content_hash(b"p")], [SPLIT])) == [TRAIN]
    assert assign(np.zeros(0, np.uint64), np.zeros(0, np.uint8)).shape == (0,)


def test_default_units_are_the_default_corpus():
    for cap in (None, 300_000):
        train, held = default_corpus(max_bytes=cap)
        units = default_units(max_bytes=cap)
        got = [(d.name, d.text, r) for d, r in iter_documents(units)]
        assert [(n, t) for n, t, r in got if r == HELDOUT] == [(d.name, d.text) for d in held]
        assert [(n, t) for n, t, r in got if r == TRAIN and t] == [(d.name, d.text) for d in train]


def test_installation_files_cover_stdlib_and_site_packages():
    files = installation_files()
    names = [n for n, _ in files]
    assert len(set(names)) == len(names) and len({os.path.realpath(p) for _, p in files}) == len(files)
    assert "os.py" in names and "json/__init__.py" in names  # standard library names as in the CPU corpus
    site = [n for n in names if n.startswith(("site-packages/", "dist-packages/"))]
    assert any(n.endswith("numpy/__init__.py") for n in site)
    assert any(n.endswith((".md", ".rst", ".txt")) for n in site)
    assert not any(".dist-info/" in n or "__pycache__/" in n for n in names)


def test_streaming_a_large_jsonl_keeps_memory_bounded(tmp_path):
    # ~160 MB of jsonl read document by document: the reader's peak memory grows by far less than the file.
    path = tmp_path / "big.jsonl"
    line = (json.dumps({"text": "x" * 4000}) + "\n").encode()
    with open(path, "wb") as f:
        for _ in range(40):
            f.write(line * 1000)
    code = textwrap.dedent(f"""
        import resource
        from k3.data.sources import data_units, iter_documents
        units = data_units([{str(path)!r}])
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        n = sum(len(d.text) for d, _ in iter_documents(units))
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(n, (after - before) // 1024)
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    n, grown_mb = map(int, out.stdout.split())
    assert n == 40_000 * 4000
    assert grown_mb < 32, f"reading grew the peak RSS by {grown_mb} MB"
