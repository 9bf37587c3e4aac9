"""k3.train.long_eval: the passkey generator (deterministic per seed, exact lengths, the needle at its depth), the
scorer (an induction oracle that copies scores 1, a random-init model scores chance, the cached path equals reading
every candidate whole), the per-position loss and its buckets, and `k3 eval --long` end to end."""

import json
import math
import os

import numpy as np
import pytest
import torch

from helpers import one_torch_thread
from k3.config import K3Config
from k3.data.tokenizer import K3Tokenizer
from k3.model.model import K3ForCausalLM
from k3.train import long_eval as le

TOK = K3Tokenizer.byte_level()
FILLER_TEXT = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py"), encoding="utf-8").read()
FILLER = np.asarray(TOK.encode(FILLER_TEXT), dtype=np.int64)


@pytest.fixture(scope="module")
def tiny():
    model = K3ForCausalLM(K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0))
    model.init_weights(seed=0)
    return model.eval()


def _cell(length, depth, n, choices=4, seed=0):
    return [le.make_passkey_item(TOK, FILLER, length, depth, choices, le.item_seed(seed, length, depth, i))
            for i in range(n)]


# ------------------------------------------------------------------------------------------- generator


@pytest.mark.parametrize("length", [le.min_length(TOK), 300, 1000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_item_has_exact_length_and_the_needle_at_its_depth(length, depth):
    it = le.make_passkey_item(TOK, FILLER, length, depth, 5, seed=7)
    assert it.input_ids.shape == (length,) and it.input_ids.dtype == np.int64
    header, question = TOK.encode(le.HEADER), TOK.encode(le.QUESTION)
    key = it.keys[it.answer]
    needle = TOK.encode("".join(le.NEEDLE).format(key=key))
    n_filler = length - len(header) - len(needle) - len(question)
    assert it.needle_start == len(header) + round(depth * n_filler)
    ids = it.input_ids.tolist()
    assert ids[:len(header)] == header and ids[length - len(question):] == question
    assert ids[it.needle_start:it.needle_start + len(needle)] == needle
    assert TOK.decode(ids[it.key_start:it.key_start + len(key)]) == key
    # the filler is one contiguous window of the stream, cut by the needle
    filler = ids[len(header):it.needle_start] + ids[it.needle_start + len(needle):length - len(question)]
    assert len(filler) == n_filler
    doubled = FILLER.tolist() * 2
    assert any(doubled[o:o + n_filler] == filler for o in range(len(FILLER)))
    # K distinct five-digit keys, the true one among them, tokenized as the needle holds it
    assert len(set(it.keys)) == 5 and all(len(k) == 5 and k.isdigit() and k[0] != "0" for k in it.keys)
    assert [list(c) for c in it.choices] == [TOK.encode(k) for k in it.keys]


def test_items_are_deterministic_per_seed():
    a = _cell(400, 0.5, 6)
    b = _cell(400, 0.5, 6)
    for x, y in zip(a, b):
        assert np.array_equal(x.input_ids, y.input_ids) and x.choices == y.choices and x.answer == y.answer
    c = _cell(400, 0.5, 6, seed=1)
    assert not any(np.array_equal(x.input_ids, z.input_ids) for x, z in zip(a, c))
    assert len({x.keys[x.answer] for x in a}) == 6  # items of a cell differ
    assert sorted({x.answer for x in _cell(400, 0.5, 40)}) == [0, 1, 2, 3]  # the true key's place varies


def test_filler_shorter_than_the_window_wraps():
    short = FILLER[:50]
    it = le.make_passkey_item(TOK, short, 600, 0.0, 3, seed=0)
    assert it.length == 600


def test_too_short_a_length_is_refused_with_the_minimum():
    m = le.min_length(TOK)
    with pytest.raises(ValueError, match=rf"length 100 cannot hold the passkey task.*at least {m}"):
        le.make_passkey_item(TOK, FILLER, 100, 0.5, 4, seed=0)
    with pytest.raises(ValueError, match="depth 1.5 is outside"):
        le.make_passkey_item(TOK, FILLER, 400, 1.5, 4, seed=0)
    with pytest.raises(ValueError, match="at least 2 keys"):
        le.make_passkey_item(TOK, FILLER, 400, 0.5, 1, seed=0)


# ------------------------------------------------------------------------------------------------ scorer


class InductionOracle(torch.nn.Module):
    """A perfect copier: at each position it predicts the token that followed the earlier occurrence of the longest
    suffix of the context read so far (the most recent on ties), with logit 20 against 0; uniform where the
    current token never occurred before. Called as the scorer's logits function: (ids [B, T], m) -> [B, m, V]."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab

    def forward(self, ids: torch.Tensor, m: int) -> torch.Tensor:
        B, T = ids.shape
        out = torch.zeros(B, m, self.vocab)
        for b in range(B):
            x = ids[b].numpy()
            match = np.zeros(T, dtype=np.int64)  # match[j]: common suffix length of x[:j+1] and x[:t+1]
            for t in range(T):
                prev = np.concatenate([[0], match[:-1]])
                match = np.where(x == x[t], prev + 1, 0)
                match[t:] = 0
                if t >= T - m and match.max() > 0:
                    j = T - 1 - int(np.argmax(match[::-1]))  # the longest, latest on ties
                    out[b, t - (T - m), x[j + 1]] = 20.0
        return out


def test_a_copying_model_scores_one():
    oracle = InductionOracle(len(TOK))
    for depth in (0.0, 0.5, 1.0):
        items = _cell(260, depth, 6, choices=5)
        scores, exact = le.score_items(oracle, items, "cpu", rows=3)
        assert scores == [1.0] * 6 and exact == [True] * 6


def test_ties_at_the_top_earn_their_share():
    logp = torch.tensor([[-1.0, -1.0, -3.0], [-2.0, -1.0, -1.0], [-5.0, -5.0, -5.0]], dtype=torch.float64)
    hit = torch.tensor([[True, False, False]] * 3)
    scores, exact = le.item_scores(logp, hit, torch.tensor([0, 0, 2]))
    assert scores == [0.5, 0.0, pytest.approx(1 / 3)] and exact == [True, True, False]


def test_cached_scoring_equals_reading_every_candidate_whole(tiny):
    """The fast path (one prefill, a fork of the cache per candidate) against the reference (each prompt + candidate
    forwarded whole): fp32 sums of ~5 log-probabilities, within 1e-4 absolute."""
    items = _cell(200, 0.5, 3, choices=3) + _cell(200, 0.0, 2, choices=3)
    prompts, cands, lens = le._padded(items, TOK.eos_id)
    with one_torch_thread():
        lp, hit = le.candidate_logprobs(tiny, prompts, cands, lens)
        lp_ref, hit_ref = le.candidate_logprobs_full(lambda ids, m: tiny(ids, logits_to_keep=m).logits,
                                                     prompts, cands, lens)
    assert torch.allclose(lp, lp_ref, atol=1e-4, rtol=0) and torch.equal(hit, hit_ref)
    assert (lp < 0).all()


def test_a_random_model_scores_chance(tiny):
    """120 items of K = 4 at 200 tokens, spread over three depths: a random-init tiny model's accuracy is within
    3 binomial standard deviations (0.119) of chance 0.25, and it never reproduces a key greedily."""
    items = [it for d in (0.0, 0.5, 1.0) for it in _cell(200, d, 40, choices=4)]
    with one_torch_thread():
        scores, exact = le.score_items(tiny, items, "cpu", rows=40, pad_id=TOK.eos_id)
    sd = math.sqrt(0.25 * 0.75 / len(items))
    assert abs(np.mean(scores) - 0.25) < 3 * sd, np.mean(scores)
    assert not any(exact)


class OutOfMemoryAbove:
    """The oracle, running out of device memory on forwards of more than `max_rows` rows or `max_tokens` tokens."""

    def __init__(self, max_rows: int, max_tokens: int):
        self.oracle, self.max_rows, self.max_tokens, self.rows_seen = InductionOracle(len(TOK)), max_rows, max_tokens, []

    def __call__(self, ids, m):
        self.rows_seen.append(ids.shape[0])
        if ids.shape[0] > self.max_rows or ids.shape[1] > self.max_tokens:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.oracle(ids, m)


def test_running_out_of_memory_halves_the_rows_then_stops_the_grid():
    model = OutOfMemoryAbove(max_rows=2, max_tokens=400)
    scores, exact = le.score_items(model, _cell(200, 0.5, 9), "cpu", rows=8)
    assert scores == [1.0] * 9 and exact == [True] * 9
    assert model.rows_seen[:3] == [8, 4, 2] and set(model.rows_seen[3:]) <= {1, 2}  # halved until it fits, kept
    with pytest.raises(le.LengthDoesNotFit, match="one row of 500 tokens does not fit"):
        le.score_items(model, _cell(500, 0.5, 2), "cpu", rows=4)
    lines = []
    grid = le.passkey_grid(model, TOK, FILLER, [300, 200, 500, 1000], [0.0, 1.0], 2, 3, 0, "cpu", batch_tokens=600,
                           log=lines.append)
    assert grid["lengths"] == [200, 300] and grid["largest_fit"] == 300 and grid["did_not_fit"] == 500
    assert [(c["length"], c["depth"]) for c in grid["cells"]] == [(200, 0.0), (200, 1.0), (300, 0.0), (300, 1.0)]
    assert all(c["accuracy"] == 1.0 for c in grid["cells"])
    assert lines[-1] == "passkey: stopped at length 500: one row of 500 tokens does not fit in device memory"


# ------------------------------------------------------------------------------------- per-position loss


def test_position_losses_average_to_the_model_loss(tiny):
    """The per-position losses (head in chunks of 7 positions) averaged over positions equal the model's own
    mean next-token loss on the same windows (fp32, 1e-5 relative), and do not depend on the chunking."""
    windows = torch.from_numpy(le.cut_windows([FILLER], 96, 3))
    with one_torch_thread():
        per = le.position_losses(tiny, windows, rows=2, chunk=7)
        whole = le.position_losses(tiny, windows, rows=3, chunk=4096)
        with torch.no_grad():
            ref = float(tiny(windows, labels=windows).loss)
    assert per.shape == (95,)
    assert np.allclose(per, whole, rtol=1e-5, atol=1e-6)
    assert abs(per.mean() - ref) < 1e-5 * ref


def test_buckets_cover_every_position_once():
    per = np.linspace(3.0, 1.0, 299)  # L = 300
    curve = le.bucket_curve(per, windows=2, train_length=100)
    b = curve["buckets"]
    assert b[0]["start"] == 1 and b[-1]["end"] == 300
    assert all(x["end"] == y["start"] for x, y in zip(b[:-1], b[1:]))
    assert sum(x["tokens"] for x in b) == 2 * 299
    assert any(x["start"] == 100 for x in b)  # the training length is an edge
    assert [x["start"] for x in b[:6]] == [1, 2, 4, 5, 8, 11]  # half-octaves
    ctx = np.arange(1, 300)
    assert curve["loss_within_train_length"] == pytest.approx(per[ctx < 100].mean())
    assert curve["loss_beyond_train_length"] == pytest.approx(per[ctx >= 100].mean())
    for x in b:
        assert x["loss"] == pytest.approx(per[x["start"] - 1:x["end"] - 1].mean())


def test_windows_are_cut_inside_documents_round_robin():
    a, b = np.arange(0, 25), np.arange(100, 112)
    w = le.cut_windows([a, b], 10, 5)
    assert w.tolist() == [list(range(0, 10)), list(range(100, 110)), list(range(10, 20))]
    assert le.cut_windows([a, b], 10, 2).shape == (2, 10)
    with pytest.raises(ValueError, match="no document holds 30 tokens .the longest has 25"):
        le.cut_windows([a, b], 30, 2)


def test_default_lengths_double_from_4096():
    assert le.default_lengths(40000) == [4096, 8192, 16384, 32768]
    assert le.default_lengths(4096) == [4096]
    assert le.default_lengths(1000) == [1000]


# -------------------------------------------------------------------------------------------------- CLI


def test_cli_end_to_end(tmp_path, capsys):
    from k3.cli import main

    ck, data, out = tmp_path / "ck", tmp_path / "data", tmp_path / "out"
    assert main(["init", "--preset", "tiny", "--tokenizer", "bytes", "--out", str(ck)]) == 0
    data.mkdir()
    (data / "a.txt").write_text(FILLER_TEXT)
    (data / "b.txt").write_text(FILLER_TEXT[::-1])  # two documents: one is held out
    capsys.readouterr()
    with one_torch_thread():
        rc = main(["eval", "--ckpt", str(ck), "--long", "--data", str(data), "--lengths", "200,240", "--depths",
                   "0,1", "--items", "2", "--choices", "3", "--windows", "1", "--train-length", "100",
                   "--out", str(out), "--device", "cpu"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "passkey length       240 depth 1.00" in printed and "depth \\ length" in printed
    rec = json.loads((out / "long_eval.json").read_text())
    grid, curve = rec["passkey"], rec["extrapolation"]
    assert grid["lengths"] == [200, 240] and grid["depths"] == [0.0, 1.0] and grid["chance"] == pytest.approx(1 / 3)
    assert len(grid["cells"]) == 4 and all(0 <= c["accuracy"] <= 1 and c["items"] == 2 for c in grid["cells"])
    assert grid["largest_fit"] == 240 and grid["did_not_fit"] is None
    assert curve["length"] == 240 and curve["windows"] == 1 and curve["train_length"] == 100
    assert sum(b["tokens"] for b in curve["buckets"]) == 239 and "loss_beyond_train_length" in curve
    for png in ("passkey_heatmap.png", "extrapolation.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not [p for p in os.listdir(out) if p.startswith(".tmp")]


def test_cli_refuses_bad_flags(tmp_path, capsys):
    from k3.cli import main

    ck = tmp_path / "ck"
    assert main(["init", "--preset", "tiny", "--tokenizer", "bytes", "--out", str(ck)]) == 0
    capsys.readouterr()
    assert main(["eval", "--ckpt", str(ck), "--items", "3"]) == 2
    assert "--items only apply with --long" in capsys.readouterr().err
    assert main(["eval", "--ckpt", str(ck), "--long", "--lengths", "100,4096", "--device", "cpu"]) == 2
    assert f"--lengths 100: too short to hold the passkey task, which takes {le.min_length(TOK)}" in \
        capsys.readouterr().err
    assert main(["eval", "--ckpt", str(ck), "--long", "--depths", "0,2", "--device", "cpu"]) == 2
    assert "--depths '0,2': expected a comma-separated list of fractions in [0, 1]" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cached_scoring_on_gpu_equals_reading_every_candidate_whole():
    """On CUDA with the fast backends (fla's KDA chunk kernel with an initial state for the candidates, SDPA for the
    prefill, the absorbed MLA over the cache): the tiny model in fp32 at 1024 tokens, cached against whole, within
    2e-3 relative per candidate (the kernels' TF32 products, ~1e-3 each, over ~5 summed log-probabilities)."""
    from k3.ops.registry import Backends

    with torch.device("cuda"):
        model = K3ForCausalLM(K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0),
                              backends=Backends(default="auto"))
    model.init_weights(seed=0)
    model.eval()
    items = [it for d in (0.0, 0.5, 1.0) for it in _cell(1024, d, 2, choices=4)]
    prompts, cands, lens = (t.cuda() for t in le._padded(items, TOK.eos_id))
    lp, hit = le.candidate_logprobs(model, prompts, cands, lens)
    lp_ref, hit_ref = le.candidate_logprobs_full(lambda ids, m: model(ids, logits_to_keep=m).logits,
                                                 prompts, cands, lens)
    assert ((lp - lp_ref).abs() / lp_ref.abs()).max() < 2e-3
