"""Images in the server (k3.serve.images, the engine's prefill, the prefix cache's image salt).

A tiny vision-language model: the `tiny` preset (byte tokenizer, from `k3 init`) with VisionConfig.tiny() and the
placeholder id 300, a reserved id of the byte tokenizer that no text encodes to; random weights (seed 0). As in
test_server.py, the head gets a bias of -30 on every id but the printable ASCII bytes, so replies are readable text
and a reply's content is exactly the decoded generated ids.

The reference is the model's plain forward: `model(ids, pixel_values=[pixels])` over the whole sequence at every
greedy step (no cache, no chunking, the encoder inside the forward), with pixels computed here from the PNG's bytes
((x / 255 - 0.5) / 0.5, at a size that needs no resize). The engine path (paged cache, chunked prefill in 16-token
chunks, so an image spans chunks, packed forwards, prefix-cache hits over part or all of an image) must give the same
greedy tokens, and their logprobs within 1e-4 (fp32 on CPU; only the summation order differs).

A real uvicorn server on 127.0.0.1 is driven with the `openai` client and httpx (trust_env=False); the limit and
no-vision apps, whose requests never reach an engine, run in-process with FastAPI's TestClient.
"""

import argparse
import asyncio
import base64
import io
import struct
import zlib
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from openai import OpenAI

from helpers import tiny_chat_checkpoint, uvicorn_in_thread

from k3.config import VisionConfig
from k3.serve.sampling import SamplingParams
from k3.serve.sequence import PromptImage, Status

PIL = pytest.importorskip("PIL.Image")
pytest.importorskip("uvicorn")

MODEL = "k3-vl-tiny"
PID = 300  # media_placeholder_token_id: a reserved id of the byte tokenizer
HOST = "127.0.0.1"
TOL = 1e-4  # engine vs plain forward, logprobs of the chosen tokens (fp32)
VCFG = VisionConfig.tiny()
N_TOKENS = 8  # generated per request


def _png(seed: int, h: int = 140, w: int = 112) -> bytes:
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    PIL.fromarray(a).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(png: bytes) -> torch.Tensor:
    """The encoder's input, computed here: RGB [3, H, W] in [-1, 1] (sizes are multiples of 28: no resize)."""
    a = np.asarray(PIL.open(io.BytesIO(png)).convert("RGB"), dtype=np.float32)
    return torch.from_numpy((a / 255.0 - 0.5) / 0.5).permute(2, 0, 1).contiguous()


def _url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _msg(*parts) -> list[dict]:
    content = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": p[0]}}
               for p in parts]
    return [{"role": "user", "content": content}]


def _vl_model(text_model, tok):
    from k3.model.model import K3ForCausalLM

    cfg = text_model.config.replace(vision_config=VCFG.to_dict(), media_placeholder_token_id=PID)
    model = K3ForCausalLM(cfg).init_weights(seed=0).eval()
    ids = sorted({tok.encode(chr(c))[0] for c in range(32, 127)})
    assert PID not in ids and all(PID not in tok.encode(chr(c)) for c in range(32, 127))
    bias = torch.full((cfg.vocab_size,), -30.0)
    bias[ids] = 0.0
    model.lm_head.bias = torch.nn.Parameter(bias, requires_grad=False)
    return model


def _engine(model, tok, **kw):
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.scheduler import SchedulerConfig

    cfg = EngineConfig(cache_memory_mb=16, page_tokens=32, hash_block_tokens=16, max_model_len=256,
                       scheduler=SchedulerConfig(max_num_seqs=8, max_step_tokens=64, prefill_chunk=16), **kw)
    return LLMEngine(model, tok, cfg)


@torch.no_grad()
def _reference(model, ids: list[int], pixels: list[torch.Tensor], n: int = N_TOKENS):
    """Greedy tokens of the plain forward (the whole sequence, images encoded inside) and their logprobs."""
    ids, out, lps = list(ids), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids]), pixel_values=pixels or None).logits[0, -1].float()
        t = int(logits.argmax())
        out.append(t)
        lps.append(float(torch.log_softmax(logits, -1)[t]))
        ids.append(t)
    return out, lps


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    from k3.serve.app import create_app
    from k3.serve.chat import load_chat_template
    from k3.serve.images import ImageLimits

    ckpt = tmp_path_factory.mktemp("vl") / "tiny"
    text_model, tok = tiny_chat_checkpoint(ckpt)
    model = _vl_model(text_model, tok)
    engine = _engine(model, tok)
    template = load_chat_template(ckpt)
    # A 1-megapixel header limit, so a small PNG can be a decompression bomb.
    limits = ImageLimits(max_images=3, max_image_bytes=100_000, max_image_pixels=1 << 20)
    app = create_app(engine, tok, MODEL, chat_template=template, image_limits=limits)
    with uvicorn_in_thread(app, HOST) as port:
        hc = httpx.Client(trust_env=False, timeout=60)
        client = OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="none", max_retries=0, timeout=60, http_client=hc)
        yield SimpleNamespace(model=model, text_model=text_model, tok=tok, engine=engine, app=app, client=client,
                              http=hc, base=f"http://{HOST}:{port}", template=template, ckpt=ckpt)
        hc.close()


def _prompt(vl, messages):
    """The prompt ids and images the server makes of `messages` (instruct mode)."""
    from k3.serve.chat_api import chat_options

    return asyncio.run(vl.app.state.server.chat_prompt(messages, chat_options(vl.template)))


def _chat(vl, messages, **kw):
    return vl.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=N_TOKENS, temperature=0,
                                             logprobs=True, **kw)


def _check_against_reference(vl, messages, pngs, reply):
    ids, images = _prompt(vl, messages)
    pixels = [_pixels(p) for p in pngs]
    assert len(images) == len(pixels)
    for im, px in zip(images, pixels):
        assert torch.equal(im.pixel_values, px)
        assert ids[im.start:im.end] == [PID] * VCFG.num_image_tokens(*px.shape[1:])
    assert ids.count(PID) == sum(im.length for im in images)
    want, want_lp = _reference(vl.model, ids, pixels)
    got = reply.choices[0]
    assert got.message.content == vl.tok.decode(want)
    assert [vl.tok.encode(t.token) for t in got.logprobs.content] == [[t] for t in want]
    assert np.allclose([t.logprob for t in got.logprobs.content], want_lp, atol=TOL)
    assert reply.usage.prompt_tokens == len(ids)
    return got.message.content


# ---- the server ---------------------------------------------------------------------------------------------------

def test_chat_with_an_image_through_the_openai_client_equals_the_plain_forward(vl):
    png = _png(1)
    messages = _msg("What is in this picture?", (_url(png),), "Answer in a few words.")
    reply = _chat(vl, messages)
    assert reply.choices[0].finish_reason == "length"
    _check_against_reference(vl, messages, [png], reply)


def test_served_prompt_is_the_training_rendering(vl, tmp_path):
    """The server's prompt is the prefix, up to the assistant's text, of what k3.data.images makes of the same
    conversation as a training record (the same template, placeholder runs and pixels)."""
    from k3.data.images import encode_record, read_records

    png = _png(2, 56, 84)
    user = _msg((_url(png),), "Transcribe it.")
    ids, images = _prompt(vl, user)
    rec_file = tmp_path / "r.jsonl"
    import json

    rec_file.write_text(json.dumps({"messages": user + [{"role": "assistant", "content": "xyz"}]}) + "\n")
    rec = next(read_records(str(rec_file)))
    sample = encode_record(rec, vl.tok, PID, VCFG)
    assert sample.input_ids[:len(ids)].tolist() == ids
    assert vl.tok.decode(sample.input_ids[len(ids):len(ids) + 3].tolist()) == "xyz"
    assert torch.equal(sample.pixel_values[0], images[0].pixel_values)


def test_repeated_image_hits_the_prefix_cache_and_equals_the_cold_output(vl):
    png = _png(3)
    messages = _msg((_url(png),), "Describe the picture above in one or two short sentences, please.")
    encoded = vl.engine.metrics.images_encoded
    cold = _chat(vl, messages)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert vl.engine.metrics.images_encoded == encoded + 1
    text = _check_against_reference(vl, messages, [png], cold)
    ids, images = _prompt(vl, messages)
    warm = _chat(vl, messages)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= images[0].end  # the whole image came from the cache ...
    assert vl.engine.metrics.images_encoded == encoded + 1  # ... so the encoder did not run again
    assert warm.choices[0].message.content == text
    assert np.allclose([t.logprob for t in warm.choices[0].logprobs.content],
                       [t.logprob for t in cold.choices[0].logprobs.content], atol=TOL)


def test_different_images_with_the_same_text_do_not_share_cache_blocks(vl, monkeypatch):
    from k3.serve.sequence import Sequence

    prefix = "Here is a picture of something you may know well enough: "  # text blocks before the image are shared
    pa, pb = _png(4), _png(5)
    ma = _msg(prefix, (_url(pa),), "Name it.")
    mb = _msg(prefix, (_url(pb),), "Name it.")
    (ids_a, [ia]), (ids_b, [ib]) = _prompt(vl, ma), _prompt(vl, mb)
    assert ids_a == ids_b and ia.start == ib.start and ia.digest != ib.digest
    ra = _chat(vl, ma)
    text_a = _check_against_reference(vl, ma, [pa], ra)
    rb = _chat(vl, mb)
    text_b = _check_against_reference(vl, mb, [pb], rb)  # B's own cold output
    assert text_a != text_b
    hb = vl.engine.cache.hash_block_tokens
    # at most the text blocks before the image (those with a KDA checkpoint kept at their end)
    assert rb.usage.prompt_tokens_details.cached_tokens <= ia.start // hb * hb
    # Without the image salt the second image would reuse the first one's blocks: a different (wrong) output.
    monkeypatch.setattr(Sequence, "media", property(lambda self: ()))
    mc = _msg(prefix, (_url(_png(6)),), "Name it.")
    _chat(vl, ma)  # A's blocks, unsalted now
    wrong = _chat(vl, mc)
    assert wrong.usage.prompt_tokens_details.cached_tokens > ia.end
    right, _ = _reference(vl.model, ids_a, [_pixels(_png(6))])
    assert wrong.choices[0].message.content != vl.tok.decode(right)


def _post(vl, messages, **kw):
    return vl.http.post(f"{vl.base}/v1/chat/completions",
                        json={"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0, **kw})


def _huge_png() -> bytes:
    """A valid 1x1 PNG whose header claims 100000 x 100000 pixels."""
    png = bytearray(_png(0, 28, 28))
    ihdr = png[12:29]  # b"IHDR" + 13 bytes of data
    new = b"IHDR" + struct.pack(">II", 100_000, 100_000) + bytes(ihdr[12:17])
    png[12:29] = new
    png[29:33] = struct.pack(">I", zlib.crc32(new))
    return bytes(png)


def _bomb_png() -> bytes:
    """1200 x 1200 black pixels (1.44 Mpx, over the test server's 1 Mpx) in a few KB."""
    buf = io.BytesIO()
    PIL.new("RGB", (1200, 1200)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def _tiff() -> bytes:
    buf = io.BytesIO()
    PIL.new("RGB", (28, 28)).save(buf, format="TIFF")
    return buf.getvalue()


HOSTILE = {
    "truncated": lambda: _url(_png(7)[:500]),
    "huge dimensions": lambda: _url(_huge_png()),
    "decompression bomb": lambda: _url(_bomb_png()),
    "wrong type (TIFF)": lambda: _url(_tiff(), "image/tiff"),
    "not an image": lambda: _url(b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj << >> endobj\n"),
    "not base64": lambda: "data:image/png;base64,@@not-base64@@",
    "empty": lambda: "data:image/png;base64,",
    "not a base64 data URL": lambda: "data:image/png," + "x" * 10,
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_images_are_refused_naming_the_part(vl, kind):
    r = _post(vl, _msg("Look:", (HOSTILE[kind](),)))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "messages[0].content[1]" in err["message"], err


def test_the_server_still_serves_after_hostile_images(vl):
    for kind in ("truncated", "decompression bomb"):
        assert _post(vl, _msg((HOSTILE[kind](),))).status_code == 400
    assert httpx.get(f"{vl.base}/health", trust_env=False, timeout=10).json() == {"status": "ok"}
    png = _png(8, 56, 56)
    messages = _msg((_url(png),), "Again?")
    _check_against_reference(vl, messages, [png], _chat(vl, messages))


def test_remote_urls_and_misplaced_images_are_refused(vl):
    r = _post(vl, _msg("Look:", ("https://example.com/cat.png",)))
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "messages[0].content[1]" in msg and "does not fetch remote images" in msg and "data URL" in msg
    r = _post(vl, [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": _url(_png(9))}}]}])
    assert r.status_code == 400 and "messages[1].content[0] is an image in a 'assistant' message" in r.text
    r = _post(vl, [{"role": "user", "content": [{"type": "image_url", "image_url": {"detail": "low"}}]}])
    assert r.status_code == 400 and "messages[0].content[0].image_url" in r.text


def test_image_limits_are_enforced(vl):
    small = _url(_png(10, 28, 28))
    r = _post(vl, _msg(*[(small,)] * 4))
    assert r.status_code == 400
    assert "4 images" in r.text and "at most 3" in r.text and "--max-images-per-request" in r.text
    r = _post(vl, _msg((_url(_png(11, 224, 224)),)))  # ~150 KB of noise, over the test server's 100,000 bytes
    assert r.status_code == 413
    assert "100000 bytes" in r.text and "--max-image-mb" in r.text and "messages[0].content[0]" in r.text
    # the context bounds the image tokens too: one flat colour, a small file of 16 x 17 = 272 tokens > 256
    buf = io.BytesIO()
    PIL.new("RGB", (28 * 17, 28 * 16), (200, 30, 30)).save(buf, format="PNG")
    r = _post(vl, _msg((_url(buf.getvalue()),)))
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


def test_model_without_a_vision_encoder_refuses_images(vl):
    from k3.serve.app import create_app

    app = create_app(_engine(vl.text_model, vl.tok), vl.tok, MODEL, chat_template=vl.template)
    with TestClient(app) as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                  "messages": _msg("hi", (_url(_png(13, 28, 28)),))})
    assert r.status_code == 400 and "this model has no vision encoder" in r.json()["error"]["message"]


def test_image_flags_reach_the_limits():
    from k3.serve.images import ImageLimits
    from k3.serve.options import add_serve_arguments, image_limits

    p = argparse.ArgumentParser()
    add_serve_arguments(p)
    assert image_limits(p.parse_args(["--ckpt", "d"])) == ImageLimits()
    a = p.parse_args(["--ckpt", "d", "--max-images-per-request", "2", "--max-image-mb", "0.5",
                      "--max-image-tokens", "64", "--max-image-pixels", "1000000"])
    assert image_limits(a) == ImageLimits(2, 2**19, 64, 1_000_000)
    with pytest.raises(SystemExit):
        p.parse_args(["--ckpt", "d", "--max-images-per-request", "0"])


# ---- the engine ---------------------------------------------------------------------------------------------------

def _image(ids: list[int], at: int, png: bytes) -> tuple[list[int], PromptImage]:
    from k3.serve.images import image_digest

    px = _pixels(png)
    n = VCFG.num_image_tokens(*px.shape[1:])
    return ids[:at] + [PID] * n + ids[at:], PromptImage(px, at, n, image_digest(px))


def _prompt_with_images(tok, seed: int, sizes, gap: str = "") -> tuple[list[int], list[PromptImage]]:
    ids = tok.encode(f"Picture set {seed}: ")
    images = []
    for k, (h, w) in enumerate(sizes):
        ids, im = _image(ids, len(ids), _png(100 * seed + k, h, w))
        images.append(im)
        ids += tok.encode(f" (image {k}){gap} ")
    return ids + tok.encode("What do they show?"), images


def _run(engine, prompts, n=N_TOKENS):
    p = SamplingParams(max_tokens=n, temperature=0, logprobs=0)
    seqs = [engine.add_request(ids, p, images=ims) for ids, ims in prompts]
    for _ in range(500):
        if all(s.status == Status.FINISHED for s in seqs):
            break
        engine.step()
    return seqs


@pytest.mark.parametrize("speculative", ["off", "mtp"])
def test_engine_chunked_packed_prefill_with_images_equals_the_plain_forward(vl, speculative):
    """Two requests at once (packed forwards of different lengths), two images each of different sizes, prefilled in
    16-token chunks (each image spans chunks); with MTP speculation too (a draft reads the image positions' hidden
    states). Then a prompt whose last hash boundary lies inside an image, sent twice: the second one's prefix hit
    ends inside the image (at the checkpoint the first kept there), whose remaining rows come from a fresh
    encoding."""
    engine = _engine(vl.model, vl.tok, speculative=speculative)
    mixed = []  # the image rows of each mixed forward (prefill chunks joined by verifications)
    run_mixed = engine.runner._run_mixed

    def spy(*args):
        mixed.append(args[7])
        return run_mixed(*args)

    engine.runner._run_mixed = spy
    prompts = [_prompt_with_images(vl.tok, 1, [(140, 112), (56, 84)], gap=", and after a few more words, "),
               _prompt_with_images(vl.tok, 2, [(84, 56)])]
    seqs = _run(engine, prompts)
    if speculative == "mtp":  # the second request decodes while the first one's images are prefilled
        assert engine.metrics.spec_verifications > 0 and any(m is not None for m in mixed)
    for (ids, ims), s in zip(prompts, seqs):
        want, want_lp = _reference(vl.model, ids, [im.pixel_values for im in ims])
        assert s.output_ids == want
        assert np.allclose([e["logprob"] for e in s.logprobs], want_lp, atol=TOL)
    ids, ims = prompts[0]
    im0 = ims[0]
    short = (ids[:im0.end] + vl.tok.encode("?"), [im0])  # its last hash boundary lies inside the image
    assert im0.start < (len(short[0]) - 1) // 16 * 16 < im0.end
    want, _ = _reference(vl.model, short[0], [im0.pixel_values])
    [cold] = _run(engine, [short])
    encoded = engine.metrics.images_encoded
    [again] = _run(engine, [short])
    assert cold.cached_tokens == 0 and im0.start < again.cached_tokens < im0.end
    assert engine.metrics.images_encoded == encoded + 1
    assert cold.output_ids == want and again.output_ids == want
    assert all(s.image_embeds is None for s in seqs + [cold, again])  # nothing kept after prefill


def test_engine_refuses_images_that_do_not_match_the_prompt(vl):
    engine = _engine(vl.model, vl.tok)
    ids, [im] = _prompt_with_images(vl.tok, 3, [(56, 56)])
    p = SamplingParams(max_tokens=2, temperature=0)
    bad = [
        (PromptImage(im.pixel_values, im.start, im.length + 1, im.digest), "makes 4 tokens, not 5"),
        (PromptImage(im.pixel_values, im.start - 1, im.length, im.digest), "are not all the image placeholder"),
        (PromptImage(im.pixel_values[:, :50], im.start, im.length, im.digest), "multiples of 28 x 28"),
        (PromptImage(im.pixel_values, len(ids) - 2, im.length, im.digest), "outside the"),
    ]
    for image, words in bad:
        with pytest.raises(ValueError, match=words):
            engine.add_request(ids, p, images=[image])
    text_engine = _engine(vl.text_model, vl.tok)
    with pytest.raises(ValueError, match="no vision encoder"):
        text_engine.add_request(ids, p, images=[im])


def test_prefix_hashes_mix_in_the_image_content():
    """Block hashes: equal before the image's first block, different from it on (through the chain) for another
    image, equal for the same image; a lookup with another image hits only the blocks before it."""
    from k3.serve.cache.prefix import MediaSpan, PrefixCache

    tokens = list(range(40)) + [PID] * 20 + list(range(40))  # image run [40, 60), hash blocks of 16
    a, b = MediaSpan(40, 60, b"a" * 32), MediaSpan(40, 60, b"b" * 32)
    pc = PrefixCache(64, 1, 1, page_tokens=32, hash_block_tokens=16)
    pc.admit("a", tokens, media=[a])
    pc.ensure_capacity("a", len(tokens))
    pc.register_tokens("a", tokens)
    for end in (32, 48, 64, 80, 96):
        pc.checkpoint_slots("a", end, turn_boundary=True)
    pc.finish("a")
    pc.mark_landed()
    hashes_a = list(pc.peek(tokens).hashes)  # text-only hashes: a prompt with images is not found by its ids
    assert len(hashes_a) == 2  # the blocks before the image
    assert pc.admit("b", tokens, media=[b]).hit_tokens == 32
    assert pc.admit("a2", tokens, media=[a]).hit_tokens == 96
    hb, ha = pc._reqs["b"].hashes, pc._reqs["a2"].hashes
    assert hb[:2] == ha[:2] and all(x != y for x, y in zip(hb[2:], ha[2:]))
    with pytest.raises(ValueError, match="outside"):
        pc.admit("c", tokens, media=[MediaSpan(90, 110, b"c" * 32)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_with_images_matches_the_plain_forward(vl):
    """bf16 on CUDA, decode steps on captured graphs, image chunks eager: each generated token's logprob equals the
    plain forward's (teacher-forced on the engine's tokens, images encoded inside) within 0.1, and each token is
    the plain forward's argmax up to that margin (bf16 may flip near-ties)."""
    import copy

    model = copy.deepcopy(vl.model).cuda().set_dtype(torch.bfloat16)
    engine = _engine(model, vl.tok)
    prompts = [_prompt_with_images(vl.tok, 1, [(140, 112), (56, 84)]), _prompt_with_images(vl.tok, 2, [(84, 56)])]
    seqs = _run(engine, prompts)
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    for (ids, ims), s in zip(prompts, seqs):
        full = torch.tensor([ids + s.output_ids], device="cuda")
        with torch.no_grad():
            logits = model(full, pixel_values=[im.pixel_values.cuda().to(torch.bfloat16) for im in ims]).logits
        lp = torch.log_softmax(logits[0, len(ids) - 1:-1].float(), -1)
        ref = lp.gather(1, torch.tensor(s.output_ids, device="cuda")[:, None])[:, 0].cpu()
        got = torch.tensor([e["logprob"] for e in s.logprobs])
        assert (ref - got).abs().max() < 0.1, (ref, got)
        assert (lp.max(-1).values.cpu() - ref).max() < 0.1
