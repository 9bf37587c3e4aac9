"""`k3 train --images`: the encoder trained with the language model (k3.train.image_training, k3.data.image_batches),
and the transcription score (k3.train.transcribe)."""

import json
import os

import numpy as np
import pytest
import torch

from helpers import stop_after
from k3.config import K3Config, VisionConfig
from k3.data.image_batches import ImageRecordFile, ImageRowStream, ImageTextLoader, image_rows_at
from k3.data.images import ImageRecordError
from k3.data.packing import PackedLoader
from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer
from k3.model.model import K3ForCausalLM
from k3.train.image_training import ImageTextTrainer, add_image_placeholder, image_placeholder_id
from k3.train.trainer import TrainConfig
from k3.train.transcribe import char_error_rate, edit_distance


def _png(h: int, w: int, seed: int) -> bytes:
    import io

    from PIL import Image

    a = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def _pairs(tmp_path, n: int = 24, name: str = "train.jsonl") -> str:
    """`n` pairs of small random images (28 x 28..84 px: 1 to 3 image tokens of the tiny encoder) and short texts."""
    rng = np.random.default_rng(len(name))
    lines = []
    for i in range(n):
        img = f"img-{name}-{i}.png"
        (tmp_path / img).write_bytes(_png(28, 28 * int(rng.integers(1, 4)), seed=i))
        lines.append(json.dumps({"text": f"x = {i} + {int(rng.integers(0, 99))}", "images": [{"path": img}],
                                 "prompt": "Read."}))
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def tok():
    return add_image_placeholder(K3Tokenizer(byte_level_tokenizer(511)))  # 512 ids, the placeholder the last


def _model(tok, seed=0):
    cfg = K3Config.from_preset("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=0, pad_token_id=0,
                                               vision_config=VisionConfig.tiny().to_dict(),
                                               media_placeholder_token_id=image_placeholder_id(tok))
    torch.manual_seed(seed)
    return K3ForCausalLM(cfg).init_weights(seed=seed)


def _stream(n=20_000, seed=0):
    rng = np.random.default_rng(seed)
    s = np.tile(np.arange(1, 97, dtype=np.int32), n // 96 + 1)[:n]
    s[rng.random(n) < 0.01] = 0
    return s


def _trainer(tmp_path, tok, out, max_steps, share=0.25, seed=0):
    model = _model(tok, seed)
    tc = TrainConfig(out=str(out), max_steps=max_steps, seq_len=64, batch_tokens=512, lr=3e-3, eval_every=1000,
                     eval_batches=1, save_every_minutes=1e9, seed=seed)
    vc = VisionConfig.from_dict(model.config.vision_config)
    stream = ImageRowStream(ImageRecordFile(_pairs(tmp_path)), tok, model.config.media_placeholder_token_id, vc,
                            tc.seq_len, seed=seed)
    loader = ImageTextLoader(PackedLoader(_stream(), tc.seq_len, tc.rows_per_step, 0, seed=seed), stream,
                             tc.rows_per_step, share)
    return ImageTextTrainer(model, tc, loader, eval_stream=None, eos_id=0, log=lambda *a: None)


def test_placeholder_is_special_and_text_never_encodes_to_it(tok):
    pid = image_placeholder_id(tok)
    assert pid == tok.vocab_size - 1 == 511
    assert pid not in tok.encode("<|kimi_image_placeholder|> and text")
    assert add_image_placeholder(tok).vocab_size == tok.vocab_size  # idempotent (a resumed run's tokenizer)


def test_steps_train_the_encoder_and_image_rows_train_only_the_text(tmp_path, tok, one_thread):
    tr = _trainer(tmp_path, tok, tmp_path / "run", 3)
    seen = []
    real = tr.loader.next_batch
    tr.loader.next_batch = lambda: seen.append(real()) or seen[-1]  # the batch the step trains on
    before = {n: p.detach().clone() for n, p in tr.model.vision.named_parameters()}
    m = tr.train_step()
    batch = seen[0]
    img = batch["image_row"]
    assert img.sum() == 2  # 25% of 8 rows
    pid = tr.model.config.media_placeholder_token_id
    ids, labels = batch["input_ids"][img], batch["labels"][img]
    # image rows: placeholders, prompt and template never trained; trained labels are the records' text
    assert (ids == pid).sum() == sum(t.shape[1] * t.shape[2] // 28 ** 2 for r in batch["pixel_values"] for t in r)
    assert not (labels == pid).any()
    trained = labels[labels != -100]
    text = tok.decode(trained.tolist())
    assert "x = " in text and "Read." not in text and "user" not in text
    n_images = sum(len(r) for r in batch["pixel_values"])
    assert n_images == len(batch["pixel_values"][-1]) + len(batch["pixel_values"][-2]) > 0
    assert all(len(r) == 0 for r in batch["pixel_values"][:6])  # text rows carry no image
    assert m.images == n_images and m.image_tokens == int((ids == pid).sum()) and m.image_rows == 2
    assert m.text_tokens == 6 * 64 and m.image_targets == int((labels[:, 1:] != -100).sum())
    assert m.images_per_s > 0 and m.image_tokens_per_s > 0 and m.text_tokens_per_s > 0
    # the step's loss is the token mean over both kinds of rows
    total = m.image_targets + int((batch["labels"][~img][:, 1:] != -100).sum())
    assert m.loss == pytest.approx((m.text_loss * (total - m.image_targets) + m.image_loss * m.image_targets) / total,
                                   rel=1e-5)
    changed = [n for n, p in tr.model.vision.named_parameters() if not torch.equal(p, before[n])]
    assert len(changed) == len(before)  # every encoder tensor, conv and position table included, got a gradient


def test_image_row_loss_counts_only_text_targets(tmp_path, tok, one_thread):
    # The image rows' loss equals a cross-entropy over exactly the trained (assistant) tokens, computed by hand.
    tr = _trainer(tmp_path, tok, tmp_path / "run", 1, share=1.0)
    batch = tr.loader.next_batch()
    model = tr.model.eval()
    pixels = [p for row in batch["pixel_values"] for p in row]
    with torch.no_grad():
        out = model(batch["input_ids"], labels=batch["labels"], segment_ids=batch["segment_ids"],
                    pixel_values=pixels)
        logits = model(batch["input_ids"], segment_ids=batch["segment_ids"], pixel_values=pixels).logits
    lab = batch["labels"][:, 1:]
    mask = lab != -100
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, lab.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    want = -(lp[mask]).mean()
    torch.testing.assert_close(out.loss, want, rtol=1e-5, atol=1e-5)
    # and the mask is the assistant's text: no placeholder, no padding
    assert not (batch["input_ids"][:, 1:][mask] == model.config.media_placeholder_token_id).any()


def test_image_share_per_step_within_one_row_and_exact_over_the_run():
    R = 16
    for share in (0.0, 0.1, 0.2, 0.37, 0.5, 1.0):
        rows = [image_rows_at(k, share, R) for k in range(100)]
        assert all(abs(r - share * R) < 1 for r in rows)  # each step: one of the two integers around s R
        for k in range(1, 101):
            assert sum(rows[:k]) == int(np.floor(k * share * R + 1e-9))  # the first k steps: the share exactly


def test_image_share_of_each_steps_tokens(tmp_path, tok):
    model = _model(tok)
    vc = VisionConfig.from_dict(model.config.vision_config)
    stream = ImageRowStream(ImageRecordFile(_pairs(tmp_path)), tok, image_placeholder_id(tok), vc, 64)
    loader = ImageTextLoader(PackedLoader(_stream(), 64, 10, 0), stream, 10, 0.2)
    for _ in range(5):
        b = loader.next_batch()
        assert b["input_ids"].shape == (10, 64) and len(b["pixel_values"]) == 10
        share = float(b["image_row"].float().mean())  # every row is 64 tokens: the share of the step's tokens
        assert share == pytest.approx(0.2)


def test_resume_equals_an_uninterrupted_run(tmp_path, tok, one_thread):
    straight = _trainer(tmp_path, tok, tmp_path / "a", 4)
    straight.fit(progress_bar=False)
    first = _trainer(tmp_path, tok, tmp_path / "b", 4)
    stop_after(first, 2)
    assert first.fit(progress_bar=False)["step"] == 2
    resumed = _trainer(tmp_path, tok, tmp_path / "b", 4)
    resumed.load(os.path.join(tmp_path / "b", "checkpoints", "step-0000002"))
    assert resumed.loader.state_dict() == first.loader.state_dict()  # the image stream's position restored
    resumed.fit(progress_bar=False)
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    la = [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl")]
    lb = [json.loads(l) for l in open(tmp_path / "b" / "metrics.jsonl")]
    assert [r["loss"] for r in la if "loss" in r] == [r["loss"] for r in lb if "loss" in r]
    assert [r["images"] for r in la if "loss" in r] == [r["images"] for r in lb if "loss" in r]
    # the vision tower is saved under the release's names
    names = json.load(open(tmp_path / "a" / "checkpoints" / "step-0000004" / "model.safetensors.index.json"))
    assert "vision_tower.patch_embed.pos_emb.weight" in names["weight_map"]
    assert "mm_projector.proj.0.weight" in names["weight_map"]


def test_cer_on_known_strings():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance("", "abc") == 3 and edit_distance("abc", "") == 3 and edit_distance("same", "same") == 0
    assert edit_distance("flaw", "lawn") == 2
    assert char_error_rate(["abc", ""], ["abd", "xy"]) == pytest.approx((1 + 2) / 5)
    assert char_error_rate(["hello world"], ["hello world"]) == 0.0
    assert char_error_rate(["a long wrong answer"], ["ab"]) > 1  # a long wrong answer can exceed 1
    with pytest.raises(ValueError, match="hypotheses"):
        char_error_rate(["a"], [])


def test_bad_images_file_names_file_and_line(tmp_path):
    (tmp_path / "a.png").write_bytes(_png(28, 28, 0))
    good = json.dumps({"text": "ok", "images": [{"path": "a.png"}]})
    p = tmp_path / "bad.jsonl"
    p.write_text(good + "\n\n" + json.dumps({"text": "no image", "images": [{"path": "missing.png"}]}) + "\n")
    with pytest.raises(ImageRecordError, match=rf"{p}:3: field 'images\[0\].path'"):
        ImageRecordFile(str(p))
    p.write_text(good + "\n{not json\n")
    with pytest.raises(ImageRecordError, match=rf"{p}:2: not valid JSON"):
        ImageRecordFile(str(p))
    with pytest.raises(ImageRecordError, match="cannot read"):
        ImageRecordFile(str(tmp_path / "nope.jsonl"))


def test_cli_refuses_a_bad_images_file_naming_file_and_line(tmp_path, capsys):
    from k3.cli import main

    data = tmp_path / "data"
    data.mkdir()
    (data / "m.py").write_text("".join(f"def f{j}(x):\n    return x * {j}\n\n" for j in range(300)))
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps({"text": "t", "images": "not a list"}) + "\n")
    rc = main(["train", "--data", str(data), "--images", str(bad), "--out", str(tmp_path / "run"), "--seq-len", "64",
               "--batch-tokens", "512", "--vocab-size", "300", "--max-steps", "1", "--no-progress", "--device", "cpu"])
    assert rc == 2
    assert f"{bad}:1: field 'images' must be a non-empty list" in capsys.readouterr().err


def test_config_without_vision_is_refused(tmp_path):
    from k3.train.image_training import vision_config_for

    cfg = K3Config.from_preset("tiny")
    with pytest.raises(ValueError, match="my.json has no vision_config"):
        vision_config_for(cfg, None, "my.json")
    assert VisionConfig.from_dict(vision_config_for(cfg, "tiny", None)) == VisionConfig.tiny()
    mini = VisionConfig.from_dict(vision_config_for(K3Config.from_preset("k3-mini"), "k3-mini", None))
    assert mini.text_hidden_size == K3Config.from_preset("k3-mini").hidden_size
