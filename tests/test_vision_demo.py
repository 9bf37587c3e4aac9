"""benchmarks/vision_demo.py's render stage: the digit renders are deterministic per seed, their held-out strings are
never training strings, and each record is the pair `k3 train --images` reads (an image of the string's width)."""

import json

from PIL import Image
from helpers import load_benchmark

demo = load_benchmark("vision_demo")


def test_digit_strings_are_distinct_deterministic_and_in_range():
    a = list(demo.digit_strings(3, 6, 200, seed=1))
    assert a == list(demo.digit_strings(3, 6, 200, seed=1)) and a != list(demo.digit_strings(3, 6, 200, seed=2))
    strings = [s for s, _ in a]
    assert len(set(strings)) == 200 and all(s.isdigit() and 3 <= len(s) <= 6 for s in strings)


def _render(out, seed):
    demo.main(["--out", str(out), "--stages", "render", "--texts", "digits", "--min-chars", "2", "--max-chars", "5",
               "--pairs", "60", "--heldout", "10", "--heldout-share", "0.2", "--seed", str(seed)])
    recs = {split: [json.loads(l) for l in open(out / "pairs" / f"{split}.jsonl")] for split in ("train", "heldout")}
    return recs


def test_digit_renders_hold_out_other_strings_and_repeat_per_seed(tmp_path):
    recs = _render(tmp_path / "a", 0)
    train, held = recs["train"], recs["heldout"]
    assert len(train) == 60 and 1 <= len(held) <= 10
    assert not {r["text"] for r in train} & {r["text"] for r in held}
    for r in train[:5] + held[:5]:
        assert r["prompt"] == demo.PROMPT and r["text"].isdigit()
        w, h = Image.open(tmp_path / "a" / "pairs" / r["images"][0]["path"]).size
        assert h == 28 and w % 28 == 0 and w >= 28
    again = _render(tmp_path / "b", 0)
    assert again == recs
    a0 = open(tmp_path / "a" / "pairs" / train[0]["images"][0]["path"], "rb").read()
    assert a0 == open(tmp_path / "b" / "pairs" / train[0]["images"][0]["path"], "rb").read()
    results = json.load(open(tmp_path / "a" / "results.json"))
    assert results["render"]["texts"] == "digits" and results["render"]["train"] == 60
