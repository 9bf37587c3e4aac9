"""benchmarks/spec_decode.py's prompts and divergence report: prompts are consecutive windows of held-out text (a long
document gives several), bad --prompts files are refused naming file:line, and a divergence names the first
differing position and the plain run's top-2 logit margin there."""

import json

import pytest
import torch
from helpers import load_benchmark

from k3.config import K3Config
from k3.model.model import K3ForCausalLM

bench = load_benchmark("spec_decode")


class _Bytes:
    def encode(self, text):
        return list(text.encode())


def test_prompts_are_consecutive_windows_of_the_given_documents(tmp_path):
    (tmp_path / "a.txt").write_text("abcdefghij")  # two windows of 4 (the last 2 bytes are left)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "klmnopqr"}) + "\n\n" + json.dumps({"text": "st"}) + "\n")
    files = [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    got = bench.heldout_prompts(_Bytes(), 4, 4, files)
    assert [bytes(p).decode() for p in got] == ["abcd", "efgh", "klmn", "opqr"]
    with pytest.raises(SystemExit, match="give only 4 windows of 4 tokens, 5 are needed"):
        bench.heldout_prompts(_Bytes(), 5, 4, files)


@pytest.mark.parametrize("name,content,why", [
    ("bad.jsonl", '{"text": "ok"}\n{not json\n', "bad.jsonl:2: not JSON"),
    ("bad.jsonl", '{"text": 3}\n', 'bad.jsonl:1: expected an object with a string "text" field'),
    ("bad.csv", "a,b\n", "bad.csv: --prompts takes"),
])
def test_bad_prompt_files_are_refused_by_name(tmp_path, name, content, why):
    (tmp_path / name).write_text(content)
    with pytest.raises(SystemExit, match=why.replace(".", r"\.")):
        bench.heldout_prompts(_Bytes(), 10, 1, [str(tmp_path / name)])


def test_divergence_is_the_first_differing_position_and_the_plain_top2_margin():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.from_preset("tiny")).init_weights(seed=0).eval()
    prompts = [[5, 6, 7], [8, 9]]
    plain = [[1, 2, 3, 4], [10, 11]]
    other = [[1, 2, 30, 4], [10, 11]]  # request 0 differs at position 2, request 1 not at all
    got = bench.divergence(model, prompts, plain, other)
    assert [(d["request"], d["position"]) for d in got] == [(0, 2)]
    with torch.no_grad():
        top2 = model(torch.tensor([[5, 6, 7, 1, 2]])).logits[0, -1].topk(2).values
    assert got[0]["top2_margin"] == pytest.approx(float(top2[0] - top2[1]), abs=1e-4) and got[0]["top2_margin"] >= 0
    # one output a prefix of the other: they differ where the shorter ends
    assert bench.divergence(model, [[5]], [[1, 2]], [[1]])[0]["position"] == 1
