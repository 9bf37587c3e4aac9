"""k3.data.images: image-text records (the pair and the messages forms), their errors naming file:line and the
field, the guarded image decoding, the resize rule and the rendering with placeholder tokens."""

import base64
import io
import json
import math
import random
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from k3.config import VisionConfig
from k3.data.images import (PLACEHOLDER_TEXT, ImageRecordError, decode_image, encode_record, iter_samples,
                            load_pixels, read_records, record_units, render_text, target_size)
from k3.data.tokenizer import K3Tokenizer

PLACEHOLDER = 300  # a reserved id of the byte-level tokenizer padded to 512: never produced from text


@pytest.fixture(scope="module")
def tok():
    from k3.data.tokenizer import byte_level_tokenizer

    return K3Tokenizer(byte_level_tokenizer(vocab_size=512))


def _png(w=100, h=60, mode="RGB", seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    ch = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    a = rng.integers(0, 256, size=(h, w, ch), dtype=np.uint8)
    img = Image.fromarray(a[..., 0] if ch == 1 else a, mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _write(tmp_path, records, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def _reference_pixels(data: bytes, h: int, w: int) -> torch.Tensor:
    """Independent reference: PIL decode, bicubic resize when the size differs, then [-1, 1] channels first."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    if img.size != (w, h):
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    return torch.tensor(np.array(img), dtype=torch.float32).permute(2, 0, 1) / 127.5 - 1.0


# ---------------------------------------------------------------------------------------------- good records

def test_pair_from_path_and_base64_give_the_same_sample(tmp_path, tok):
    data = _png(100, 60)
    (tmp_path / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    path = _write(tmp_path, [
        {"text": "hello", "images": [{"path": "a.png"}], "prompt": "Read it.", "source": "x"},
        {"text": "hello", "images": [{"base64": b64}], "prompt": "Read it."},
        {"text": "hello", "images": [{"url": "data:image/png;base64," + b64}], "prompt": "Read it."},
        "",  # a blank line is not a record
        {"text": "hello", "images": [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}}],
         "prompt": "Read it."},
    ])
    recs = list(read_records(path))
    assert [r.where for r in recs] == [f"{path}:1", f"{path}:2", f"{path}:3", f"{path}:5"]
    assert recs[0].meta == {"source": "x"}
    samples = [encode_record(r, tok, PLACEHOLDER) for r in recs]
    # 100x60 -> nearest multiples of 28: 112x56 -> (56/28) * (112/28) = 8 tokens
    ref = _reference_pixels(data, 56, 112)
    for s in samples:
        assert s.image_tokens == [8]
        assert s.pixel_values[0].shape == (3, 56, 112) and s.pixel_values[0].dtype == torch.float32
        torch.testing.assert_close(s.pixel_values[0], ref, atol=1e-6, rtol=0)  # fp32 of the same uint8 values
        assert int((s.input_ids == PLACEHOLDER).sum()) == 8
        np.testing.assert_array_equal(s.input_ids, samples[0].input_ids)
    s = samples[0]
    assert s.input_ids[-1] == tok.eos_id and not s.trained[-1]
    assert not s.trained[s.input_ids == PLACEHOLDER].any()
    trained = tok.decode(s.input_ids[s.trained].tolist())
    assert trained == "hello[close]response[sep][end_of_msg]"  # what the assistant writes, as in SFT
    text = render_text(recs[0], s.image_tokens)
    assert text == ("[open]user[sep]" + PLACEHOLDER_TEXT * 8 + "Read it.[end_of_msg][close]user[sep]"
                    "[open]assistant[sep][open]response[sep]hello[close]response[sep][end_of_msg][close]assistant[sep]")


def test_messages_form_puts_the_images_where_they_occur(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(_png(56, 28))
    (tmp_path / "b.png").write_bytes(_png(28, 84, seed=1))
    path = _write(tmp_path, [{"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Left:"}, {"type": "image", "path": "a.png"},
                                     {"type": "text", "text": "Right:"}, {"type": "image", "path": "b.png"},
                                     {"type": "text", "text": "Same?"}]},
        {"role": "assistant", "content": "No."}]}])
    rec = next(read_records(path))
    s = encode_record(rec, tok, PLACEHOLDER)
    assert s.image_tokens == [2, 3]
    text = render_text(rec, s.image_tokens, placeholder="<I>")
    assert "[open]user[sep]Left:<I><I>Right:<I><I><I>Same?[end_of_msg]" in text
    ids = s.input_ids.tolist()
    first = ids.index(PLACEHOLDER)
    assert ids[first:first + 2] == [PLACEHOLDER] * 2 and ids[first + 2] != PLACEHOLDER
    assert tok.decode(ids[first - 5:first]) == "Left:"
    assert int((s.input_ids == PLACEHOLDER).sum()) == 5


def test_placeholders_match_the_encoder_and_its_config(tmp_path, tok):
    """Placeholder count = VisionConfig.num_image_tokens, and the tiny encoder's output fills them exactly."""
    from k3.model.vision import VisionEncoder, merge_image_embeddings

    (tmp_path / "a.png").write_bytes(_png(150, 90))
    path = _write(tmp_path, [{"text": "x", "images": [{"path": "a.png"}, {"path": "a.png"}]}])
    rec = next(read_records(path))
    for cfg in (VisionConfig(), VisionConfig.tiny(), VisionConfig.tiny(patch_size=16)):
        s = encode_record(rec, tok, PLACEHOLDER, cfg)
        mh, mw = cfg.pixel_multiple
        for p, n in zip(s.pixel_values, s.image_tokens):
            assert p.shape[1] % mh == 0 and p.shape[2] % mw == 0
            assert n == cfg.num_image_tokens(p.shape[1], p.shape[2])
        assert int((s.input_ids == PLACEHOLDER).sum()) == sum(s.image_tokens)
    enc = VisionEncoder(VisionConfig.tiny(patch_size=16)).init_weights(0)
    with torch.no_grad():
        feats = enc(s.pixel_values)
    assert [f.shape[0] for f in feats] == s.image_tokens
    ids = torch.from_numpy(s.input_ids.astype(np.int64))[None]
    emb = torch.zeros(1, ids.shape[1], 128)
    merged = merge_image_embeddings(emb, ids, feats, PLACEHOLDER)
    torch.testing.assert_close(merged[0, ids[0] == PLACEHOLDER], torch.cat(feats))


def test_iter_samples_streams_records_before_a_bad_line(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(_png())
    path = _write(tmp_path, [{"text": "a", "images": [{"path": "a.png"}]}, {"text": "b", "images": [{"path": "a.png"}]},
                             "{not json"])
    it = iter_samples([path], tok, PLACEHOLDER)
    assert next(it).where == f"{path}:1"
    assert next(it).where == f"{path}:2"
    with pytest.raises(ImageRecordError, match=rf"^{path}:3: not valid JSON"):
        next(it)


def test_images_are_made_rgb_and_upright():
    rgba = np.zeros((28, 56, 4), np.uint8)
    rgba[:, :28] = (255, 0, 0, 255)  # opaque red left, transparent right
    buf = io.BytesIO()
    Image.fromarray(rgba, "RGBA").save(buf, format="PNG")
    p = load_pixels(buf.getvalue())
    assert p.shape == (3, 28, 56)
    torch.testing.assert_close(p[:, 0, 0], torch.tensor([1.0, -1.0, -1.0]))
    torch.testing.assert_close(p[:, 0, 40], torch.tensor([1.0, 1.0, 1.0]))  # transparency over white
    gray = load_pixels(_png(56, 28, mode="L"))
    assert gray.shape == (3, 28, 56) and torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    # EXIF orientation 6 (rotate 90 degrees clockwise to view): a 280 x 140 JPEG stands upright as 140 x 280
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("RGB", (280, 140), (0, 128, 255)).save(buf, format="JPEG", exif=exif)
    assert load_pixels(buf.getvalue()).shape == (3, 280, 140)


def test_large_jpeg_decoded_at_reduced_scale_matches_the_full_decode():
    """The JPEG draft path (decoding at 1/2^k scale) against decode-all-then-resize, on a smooth image; tolerance 0.05
    mean absolute (of the [-1, 1] range): the two resample differently, they must agree on content."""
    y, x = np.mgrid[0:1000, 0:2000]
    a = np.stack([x * 255 // 2000, y * 255 // 1000, (x + y) * 255 // 3000], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(a, "RGB").save(buf, format="JPEG", quality=95)
    data = buf.getvalue()
    p = load_pixels(data, max_tokens=64)
    h, w = target_size(1000, 2000, max_tokens=64)
    assert p.shape == (3, h, w) and (h, w) == (140, 308)
    ref = _reference_pixels(data, h, w)
    assert float((p - ref).abs().mean()) < 0.05


# ---------------------------------------------------------------------------------------------- bad records

BAD_RECORDS = [
    ("{not json", "not valid JSON"),
    ('["a", "list"]', "must be a JSON object"),
    ({"images": [{"path": "a.png"}]}, "field 'text' is missing"),
    ({"text": "x"}, "field 'images' is missing"),
    ({"text": "", "images": [{"path": "a.png"}]}, "field 'text' must be a non-empty string"),
    ({"text": "x", "images": []}, "field 'images' must be a non-empty list"),
    ({"text": "x", "images": [{"file": "a.png"}]}, r"field 'images\[0\]' is an unknown image source"),
    ({"text": "x", "images": [{"path": "a.png", "base64": "AAAA"}]}, r"field 'images\[0\]' is an unknown image source"),
    ({"text": "x", "images": ["a.png"]}, r"field 'images\[0\]' must be an object"),
    ({"text": "x", "images": [{"path": "missing.png"}]}, r"field 'images\[0\].path' = 'missing.png': no such file"),
    ({"text": "x", "images": [{"url": "https://example.com/a.png"}]},
     r"field 'images\[0\].url' = .*\(remote URLs are not fetched"),
    ({"text": "x", "prompt": 3, "images": [{"path": "a.png"}]}, "field 'prompt' must be a string"),
    ({"text": "x", "messages": [], "images": []}, "both 'text' and 'messages'"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, "has no image"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}]},
                   {"role": "assistant", "content": [{"type": "image", "path": "a.png"}]}]},
     r"field 'messages\[1\].content\[0\]' is an image in a 'assistant' message"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "path": "a.png"}]}]}, "no assistant message"),
    ({"messages": [{"role": "robot", "content": [{"type": "image", "path": "a.png"}]}]}, r"messages\[0\].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"uri": "x"}}]}]},
     r"field 'messages\[0\].content\[0\].image_url' must be"),
]


@pytest.mark.parametrize("record,message", BAD_RECORDS, ids=[m[:40] for _, m in BAD_RECORDS])
def test_bad_record_names_file_line_and_field(tmp_path, record, message):
    (tmp_path / "a.png").write_bytes(_png())
    path = _write(tmp_path, [{"text": "fine", "images": [{"path": "a.png"}]}, record])
    it = read_records(path)
    next(it)
    with pytest.raises(ImageRecordError, match=rf"^{path}:2: .*{message}"):
        next(it)


def test_line_over_the_limit_and_non_utf8_are_named(tmp_path):
    path = _write(tmp_path, [{"text": "x" * 200, "images": [{"path": "a.png"}]}])
    with pytest.raises(ImageRecordError, match=rf"^{path}:1: the line is longer than 100 bytes"):
        list(read_records(path, max_line_bytes=100))
    p2 = tmp_path / "latin1.jsonl"
    p2.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ImageRecordError, match=rf"^{p2}:1: not UTF-8"):
        list(read_records(str(p2)))


def _huge_png(w: int, h: int) -> bytes:
    """A valid 1x1 PNG whose IHDR claims w x h (the header of a decompression bomb; no pixel data to match)."""
    data = bytearray(_png(1, 1))
    ihdr = bytearray(data[12:29])
    ihdr[4:12] = struct.pack(">II", w, h)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return bytes(data)


def _bad_images():
    png = _png(100, 60)
    tiff = io.BytesIO()
    Image.new("RGB", (10, 10)).save(tiff, format="TIFF")
    return [
        ("truncated.png", png[: len(png) // 2], "truncated or damaged"),
        ("huge.png", _huge_png(100_000, 100_000), "decompression bomb"),
        ("wide.png", _huge_png(10_000, 7_000), r"10000x7000 pixels is refused: more than \d+ pixels"),
        ("notes.png", b"this is a text file, not a picture\n", "not an image in a supported format"),
        ("image.tiff", tiff.getvalue(), "not an image in a supported format"),
        ("empty.png", b"", "the image is empty"),
    ]


@pytest.mark.parametrize("name,data,message", _bad_images(), ids=[b[0] for b in _bad_images()])
def test_bad_image_names_file_line_and_field(tmp_path, tok, name, data, message):
    (tmp_path / name).write_bytes(data)
    (tmp_path / "ok.png").write_bytes(_png())
    path = _write(tmp_path, [{"text": "fine", "images": [{"path": "ok.png"}]},
                             {"text": "x", "images": [{"path": "ok.png"}, {"path": name}]}])
    recs = list(read_records(path))  # parsing reads no image
    encode_record(recs[0], tok, PLACEHOLDER)
    with pytest.raises(ImageRecordError, match=rf"^{path}:2: field 'images\[1\].path' \(.*{name}\): .*{message}"):
        encode_record(recs[1], tok, PLACEHOLDER)


def test_decompression_bomb_refused_before_decoding_and_bad_base64(tmp_path, tok):
    # a real 200x200 image over a 10,000-pixel limit: refused from its header
    with pytest.raises(ImageRecordError, match=r"^x: PNG image of 200x200 pixels is refused"):
        decode_image(_png(200, 200), "x", max_pixels=10_000)
    path = _write(tmp_path, [{"text": "x", "images": [{"base64": "not base64!"}]}])
    rec = next(read_records(path))
    with pytest.raises(ImageRecordError, match=rf"^{path}:1: field 'images\[0\].base64': not valid base64"):
        encode_record(rec, tok, PLACEHOLDER)


def test_placeholder_id_that_text_produces_is_refused(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(_png())
    path = _write(tmp_path, [{"text": "A", "images": [{"path": "a.png"}]}])
    rec = next(read_records(path))
    byte_a = tok.encode("A")[0]
    with pytest.raises(ValueError, match=rf"{path}:1: the text encodes to the image placeholder id {byte_a}"):
        encode_record(rec, tok, byte_a)


# ---------------------------------------------------------------------------------------------- resize rule

def test_target_size_examples():
    assert target_size(60, 100) == (56, 112)  # nearest multiples
    assert target_size(3584, 3584, max_tokens=16384) == (3584, 3584)  # the report's largest input, as is
    assert target_size(10, 10) == (28, 28)  # at least one unit
    # 1000 x 2000 in 1024 tokens: scale sqrt(1024 * 784 / 2e6) = 0.6336 -> 22.6 x 45.3 units, rounded down
    assert target_size(1000, 2000, max_tokens=1024) == (616, 1260)
    assert target_size(10, 100_000, max_tokens=64) == (28, 64 * 28)  # thinner than a unit: one unit high
    assert target_size(60, 100, VisionConfig.tiny(patch_size=16)) == (64, 96)  # the unit comes from the config
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        target_size(10, 10, max_tokens=0)


def test_target_size_multiples_budget_and_aspect_on_random_sizes():
    rng = random.Random(0)
    for _ in range(2000):
        H, W = rng.randint(1, 9000), rng.randint(1, 9000)
        budget = rng.choice([1, 4, 64, 256, 1024, 4096])
        h, w = target_size(H, W, max_tokens=budget)
        assert h % 28 == 0 and w % 28 == 0 and h >= 28 and w >= 28
        hu, wu = h // 28, w // 28
        assert hu * wu <= budget
        near = (max(1, round(H / 28)), max(1, round(W / 28)))
        if near[0] * near[1] <= budget:
            assert (hu, wu) == near  # within budget: only rounded
        else:
            assert hu <= near[0] and wu <= near[1]  # never scaled up
            if hu > 1 and wu > 1:  # aspect kept to the rounding of one unit per side
                err = abs(math.log((h / w) / (H / W)))
                assert err <= math.log(1 + 1 / min(hu, wu)) + 1e-9, (H, W, budget, h, w)
                assert (hu + 1) * (wu + 1) > budget  # the largest size of that shape: not shrunk needlessly


def test_record_units_place_one_slot_per_image(tmp_path):
    (tmp_path / "a.png").write_bytes(_png())
    path = _write(tmp_path, [{"text": "t", "prompt": "p", "images": [{"path": "a.png"}] * 3}])
    rec = next(read_records(path))
    slots = [u.index for u in record_units(rec) if type(u).__name__ == "ImageSlot"]
    assert slots == [0, 1, 2]
    assert render_text(rec, [1, 2, 3], placeholder="#").count("#") == 6
