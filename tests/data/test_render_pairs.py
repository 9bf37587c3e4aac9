"""k3.data.render_pairs: rendered image-text pairs are deterministic per seed, held out by document (disjoint and
stable), charts carry their data, text pairs are windows of their source, and the output reads back through
k3.data.images with no resampling."""

import csv
import hashlib
import io
import json
import os
import random
import sysconfig

import numpy as np
import pytest
from PIL import Image

from k3.data import render_pairs as rp
from k3.data.sources import content_hash

STDLIB = sysconfig.get_paths()["stdlib"]
CODE_FILES = ["json/decoder.py", "json/encoder.py", "textwrap.py", "shlex.py", "colorsys.py", "bisect.py"]

DOC_TEXT = """Rendered pairs
==============

The quick brown fox jumps over the lazy dog.
Pack my box with five dozen liquor jugs.

    an indented line, and a\ttab
Sphinx of black quartz, judge my vow.
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(code, docs) lists: a few standard-library sources, and documentation files written here."""
    d = tmp_path_factory.mktemp("docs")
    docs = []
    for i in range(4):
        p = d / f"guide{i}.rst"
        p.write_text(DOC_TEXT.replace("fox", f"fox {i}"))
        docs.append((f"docs/guide{i}.rst", str(p)))
    code = [(name, os.path.join(STDLIB, name)) for name in CODE_FILES]
    return code, docs


def _colours(img) -> int:
    return len(np.unique(np.asarray(img).reshape(-1, 3), axis=0))


def _pairs(files, seed, n, kinds=rp.KINDS, fonts=None, max_tokens=rp.DEFAULT_MAX_IMAGE_TOKENS, max_lines=8):
    code, docs = files
    fl = rp.monospace_fonts() if fonts is None else fonts
    return [rp.make_pair(seed, i, kinds, code, docs, fl or [None], (28, 28), max_tokens, max_lines) for i in range(n)]


def _snapshot(pairs):
    return [(p.kind, p.text, p.source, p.document, rp.png_bytes(p.image)) for p in pairs]


def test_pairs_are_deterministic_per_seed(files):
    a = _snapshot(_pairs(files, seed=7, n=8))
    b = _snapshot(_pairs(files, seed=7, n=8))
    assert a == b  # byte-identical images and texts
    c = _snapshot(_pairs(files, seed=8, n=8))
    assert [x[1] for x in a] != [x[1] for x in c]
    assert sum(x[4] != y[4] for x, y in zip(a, c)) >= 6  # nearly every image differs
    assert _snapshot(_pairs(files, seed=7, n=3)) == a[:3]  # pair i depends on (seed, i) only
    assert {x[0] for x in a} <= set(rp.KINDS)


def test_pillow_default_font_is_the_fallback(files):
    a = _pairs(files, seed=3, n=3, kinds=("code",), fonts=[])
    assert all(p.style["font"] == "pillow-default" for p in a)
    assert _snapshot(a) == _snapshot(_pairs(files, seed=3, n=3, kinds=("code",), fonts=[]))


@pytest.mark.parametrize("max_tokens", [64, 1024])
def test_text_pairs_are_windows_of_their_source_within_the_budget(files, max_tokens):
    pairs = _pairs(files, seed=1, n=12, kinds=("code", "doc"), max_tokens=max_tokens)
    styles = set()
    for p in pairs:
        w, h = p.image.size
        assert w % 28 == 0 and h % 28 == 0 and (w // 28) * (h // 28) <= max_tokens
        lines = p.text.split("\n")
        assert all(ln == ln.rstrip() and all(32 <= ord(c) < 127 for c in ln) for ln in lines)
        assert lines[0].strip() and lines[-1].strip()
        name, line = p.source.rsplit(":", 1)
        path = dict(files[0] + files[1])[name]
        with open(path, "rb") as f:
            data = f.read()
        assert p.document == content_hash(data)  # the document is the whole source file
        if p.source.endswith(".rst:" + line) or p.kind == "code":  # a window starting at that line
            src = [ln.expandtabs(4).rstrip() for ln in data.decode().splitlines()]
            assert src[int(line) - 1:int(line) - 1 + len(lines)] == lines
        else:  # a window of a docstring of the file
            docs = ["\n".join(rp.clean_lines(d.splitlines()) or []) for _, d in rp._docstrings(data.decode())]
            assert any(p.text in d for d in docs)
        assert _colours(p.image) > 2  # text was drawn (anti-aliased glyphs over a plain background)
        styles.add((p.style["font"], p.style["size"], p.style["theme"]))
    assert len(styles) >= 6  # several fonts, sizes and themes


def test_wrapped_lines_are_kept_whole_in_the_text():
    assert rp.wrap(["abcdefghij", "", "xy"], 4) == ["abcd", "efgh", "ij", "", "xy"]
    assert rp.clean_lines(["", "\tx = 1   ", "", "  y", "", ""]) == ["    x = 1", "", "  y"]
    assert rp.clean_lines(["caf\u00e9"]) is None and rp.clean_lines(["", "  "]) is None


def _figure_texts(fig) -> set[str]:
    from matplotlib.text import Text

    return {t.get_text() for t in fig.findobj(Text) if t.get_text()}


def test_chart_pairs_contain_their_data():
    seen_kinds = set()
    for seed in range(6):
        rng = random.Random(seed)
        data = rp.chart_data(rng)
        kind, xname, labels, series, values = data
        seen_kinds.add(kind)
        table = list(csv.reader(io.StringIO(rp.chart_csv(xname, labels, series, values))))
        assert table[0] == [xname] + series
        assert [r[0] for r in table[1:]] == labels
        assert [[int(r[j + 1]) for r in table[1:]] for j in range(len(series))] == values
        style = {"font_size": 8, "grid": True, "face": "white", "colors": rp.CHART_COLORS[:len(series)]}
        fig = rp.chart_figure(data, style, 448, 336)
        texts = _figure_texts(fig)
        # every label, series name and value is written on the chart
        assert set(labels) <= texts and xname in texts and set(series) <= texts
        for v in values:
            assert {str(x) for x in v} <= texts
    assert seen_kinds == {"bar", "line"}
    for p in _pairs(([], []), seed=5, n=2, kinds=("chart",)):
        assert p.kind == "chart" and p.document == content_hash(p.text.encode())
        assert p.image.size[0] % 28 == 0 and p.image.size[1] % 28 == 0
        assert _colours(p.image) > 2
    with pytest.raises(ValueError, match="too small for a chart"):
        rp.make_pair(0, 0, ("chart",), [], [], [None], (28, 28), max_tokens=8)


def _read(out):
    recs = {}
    for split in ("train", "heldout"):
        with open(os.path.join(out, f"{split}.jsonl")) as f:
            recs[split] = [json.loads(line) for line in f]
    return recs


def test_render_pairs_writes_a_split_that_is_disjoint_stable_and_readable(files, tmp_path):
    from k3.data.images import encode_record, read_records
    from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer

    out_a, out_b = str(tmp_path / "a"), str(tmp_path / "b")
    st = rp.render_pairs(out_a, 16, seed=0, heldout_share=0.5, files=files, progress=False)
    assert sum(st.pairs.values()) == 16 and st.train + st.heldout + st.leaked == 16
    rp.render_pairs(out_b, 16, seed=1, heldout_share=0.5, files=files, progress=False)
    split_of = {}
    for out in (out_a, out_b):
        recs = _read(out)
        assert recs["train"] and recs["heldout"]
        train_texts = {r["text"] for r in recs["train"]}
        assert not train_texts & {r["text"] for r in recs["heldout"]}
        for split, rs in recs.items():
            for r in rs:
                doc = int(r["document"], 16)
                assert split_of.setdefault(doc, split) == split  # disjoint, and the same across seeds
                assert rp.is_heldout_document(doc, 0.5) == (split == "heldout")
    meta = json.load(open(os.path.join(out_a, "meta.json")))
    assert meta["seed"] == 0 and meta["counts"]["train"] == st.train
    n_images = len(os.listdir(os.path.join(out_a, "images")))
    assert n_images == st.train + st.heldout  # the images of dropped held-out pairs are removed
    # the records read back as k3.data.images pairs, at the size they were drawn (no resampling)
    tok = K3Tokenizer(byte_level_tokenizer(vocab_size=512))
    for rec in read_records(os.path.join(out_a, "train.jsonl")):
        s = encode_record(rec, tok, 300)
        with Image.open(rec.images[0].path) as im:
            assert tuple(s.pixel_values[0].shape[1:]) == (im.height, im.width)
        assert tok.decode(s.input_ids[s.trained].tolist()).startswith(rec.messages[-1]["content"])
    # the same seed again: byte-identical output
    rp.render_pairs(out_b, 16, seed=0, heldout_share=0.5, files=files, progress=False)
    for name in ("train.jsonl", "heldout.jsonl"):
        assert open(os.path.join(out_a, name), "rb").read() == open(os.path.join(out_b, name), "rb").read()
    digest = lambda d: {f: hashlib.sha1(open(os.path.join(d, "images", f), "rb").read()).hexdigest()
                        for f in os.listdir(os.path.join(d, "images"))}
    assert digest(out_a) == digest(out_b)
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]  # no temporary directory left behind


def test_render_pairs_validates_its_arguments(tmp_path):
    for kw, msg in [({"n": 0}, "n must be a positive integer"), ({"heldout_share": 1.0}, "heldout_share"),
                    ({"kinds": ("code", "video")}, "kinds"), ({"max_lines": 0}, "max_lines")]:
        args = {"n": 2, **kw}
        with pytest.raises(ValueError, match=msg):
            rp.render_pairs(str(tmp_path / "x"), files=([], []), progress=False, **args)
    assert not os.path.exists(tmp_path / "x")


def test_cli_render_pairs(tmp_path, capsys):
    from k3.cli import build_parser, main

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "render-pairs", "--help"])
    help_text = capsys.readouterr().out
    for flag, default in [("--seed", "0"), ("--heldout-share", "0.05"), ("--max-image-tokens", "1024"),
                          ("--max-lines", "16"), ("--kinds", "code,doc,chart")]:
        assert flag in help_text and f"default: {default}" in " ".join(help_text.split())
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "render-pairs", "--out", "x", "--n", "2", "--heldout-share", "1.5"])
    assert "expected a share in [0, 1)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["data", "render-pairs", "--out", "x", "--n", "2", "--kinds", "code,video"])
    assert "subset of code,doc,chart" in capsys.readouterr().err
    out = str(tmp_path / "pairs")
    assert main(["data", "render-pairs", "--out", out, "--n", "3", "--kinds", "chart", "--seed", "4"]) == 0
    said = capsys.readouterr().out
    assert "rendered 3 pairs (0 code, 0 doc, 3 chart)" in said
    recs = _read(out)
    assert len(recs["train"]) + len(recs["heldout"]) == 3
