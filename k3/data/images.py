"""Image-text data (report §2.4): records of text and images -> token ids with image placeholders, and the pixels
MoonViT-V2 takes.

A data file is JSON Lines, one record per line. The primary form is a pair, an image (or several) and its text:

    {"text": "def f(x):\\n    return x\\n", "images": [{"path": "images/000001.png"}], "prompt": "Transcribe ..."}

`images` is a non-empty list of sources, each one of {"path": FILE} (relative to the .jsonl's directory, or
absolute), {"base64": B64} (the file's bytes) or {"url": "data:image/png;base64,..."}; an OpenAI content part
{"type": "image_url", "image_url": {"url": DATA_URL}} is accepted in the list too. `prompt` is optional. The pair is
the conversation: a user message holding the images (then the prompt), and an assistant message holding the text,
which is what the model learns to write. The second form is a whole conversation, OpenAI style, with the images
where they occur:

    {"messages": [{"role": "user", "content": [{"type": "text", "text": "What does this print?"},
                                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}},
                                               {"type": "image", "path": "shot.png"}]},
                  {"role": "assistant", "content": "42"}]}

Image parts are {"type": "image_url", "image_url": {"url": DATA_URL}} or {"type": "image", <one source key>}, in
system, user and tool messages (the model writes no images); remote URLs are refused (nothing here fetches). Other
top-level keys (source, kind, style) are kept as `meta` and do not render. A bad record or image is an
ImageRecordError naming the file, the line and the field.

Rendering. The conversation goes through the chat template (XTML, k3.serve.chat) exactly as SFT data does
(k3.posttrain.chat_data): the server's renderer, no generation prompt, what the assistant writes trained, eos appended
untrained. Each image becomes `media_placeholder_token_id` repeated VisionConfig.num_image_tokens(H, W) times at its
place in the message ((H/28) * (W/28) for the release: 14x14 patches, then the 2x2 pixel shuffle), never trained;
the model puts the encoder's outputs there (k3.model.vision.merge_image_embeddings). In text (`render_text`) the
placeholder is written as the release's `image_placeholder`, "<|kimi_image_placeholder|>".

Pixels. An image is decoded with Pillow, only from PNG, JPEG, WebP, GIF (first frame) or BMP; a file whose header
claims more than `max_decode_pixels` (64 Mpx) is refused before any pixel is decoded (a decompression bomb), as are
truncated files, files over `MAX_IMAGE_FILE_BYTES`, and anything that is not an image. It is turned upright (EXIF
orientation), made RGB (transparency over white), and resized, aspect ratio kept, so both sides are multiples of the
encoder's unit (patch_size x merge kernel = 28 px, from VisionConfig) with at most `max_image_tokens` tokens
(`target_size`). The tensor is [3, H, W] float32, (x / 255 - 0.5) / 0.5 in [-1, 1]: the layout
`VisionEncoder.forward` takes, the mean/std 0.5 of Kimi-VL's MoonViT processor (the release's own preprocessing file
is not in checkpoint-layout.md; this is the inferred convention).

Memory: `read_records` reads one line at a time (at most `max_line_bytes`), and a record holds its images as sources,
decoded only by `encode_record`, one at a time, so a pass over a file holds one record's pixels.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Iterator, NamedTuple

import numpy as np
import torch

from k3.config import VisionConfig
from k3.serve.chat import ChatTemplate, markup_ids, render_chat_segments, segment_units
from k3.serve.chat_render import Segment, _short

DEFAULT_MAX_IMAGE_TOKENS = 1024  # e.g. 896 x 896 px; the report's largest input (3584 x 3584) is 16,384 tokens
MAX_DECODE_PIXELS = 64 << 20  # header size above this is refused before decoding (8192 x 8192 px)
MAX_IMAGE_FILE_BYTES = 32 << 20
MAX_LINE_BYTES = 64 << 20
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # Pillow's decoders we allow (no EPS, PDF, TIFF plugins)
PIXEL_MEAN = 0.5
PIXEL_STD = 0.5
PLACEHOLDER_TEXT = "<|kimi_image_placeholder|>"  # config.json's `image_placeholder` (checkpoint-layout.md §3)
SOURCE_KEYS = ("path", "base64", "url")
IMAGE_ROLES = ("system", "user", "tool")


class ImageRecordError(ValueError):
    """A bad image-text record or image; the message names the file, the line and the field."""


class ImageSlot(NamedTuple):
    """The place of image `index` (in record order) in a rendering."""

    index: int


# ---------------------------------------------------------------------------------------------------- pixels

def target_size(height: int, width: int, cfg: VisionConfig | None = None,
                max_tokens: int = DEFAULT_MAX_IMAGE_TOKENS) -> tuple[int, int]:
    """(H, W) an image of height x width pixels is resized to: multiples of the encoder's unit (VisionConfig
    .pixel_multiple, 28 x 28 px for the release), each side the nearest multiple (at least one unit); when that is
    more than `max_tokens` tokens, the image is scaled down to `max_tokens` units of area, aspect ratio kept, each
    side rounded down (an image thinner than one unit keeps one unit on its short side and at most `max_tokens` on
    the long one). Never more than `max_tokens` tokens; no upscaling beyond the rounding."""
    cfg = cfg or VisionConfig()
    if not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    mh, mw = cfg.pixel_multiple
    near_h, near_w = max(1, round(height / mh)), max(1, round(width / mw))
    if near_h * near_w <= max_tokens:
        return near_h * mh, near_w * mw
    s = math.sqrt(max_tokens * mh * mw / (height * width))
    hu = max(1, min(near_h, math.floor(height * s / mh)))
    wu = max(1, min(near_w, math.floor(width * s / mw)))
    if hu * wu > max_tokens:  # one side was raised to one unit: the other gets the whole budget
        hu, wu = (min(hu, max_tokens), 1) if wu == 1 else (1, min(wu, max_tokens))
    return hu * mh, wu * mw


def _bad(where: str, what: str) -> ImageRecordError:
    return ImageRecordError(f"{where}: {what}")


def decode_image(data: bytes, where: str = "image", max_pixels: int = MAX_DECODE_PIXELS,
                 size_hint=None):
    """The RGB PIL image in `data` (upright by its EXIF orientation; transparency composited over white).
    ImageRecordError naming `where` when it is not an image of IMAGE_FORMATS, claims more than `max_pixels`
    pixels (checked on the header, before decoding), or is truncated or damaged. `size_hint(h, w) -> (H, W)`: the
    size the caller will resize to, so a JPEG is decoded at the smallest scale that still covers it."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise _bad(where, "the image is empty (0 bytes)")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise _bad(where, f"refused as a decompression bomb: {e}") from None
        except UnidentifiedImageError:
            raise _bad(where, f"not an image in a supported format ({', '.join(IMAGE_FORMATS)}); its first bytes "
                              f"are {data[:16]!r}") from None
        except (OSError, SyntaxError, ValueError) as e:
            raise _bad(where, f"not a readable image: {e}") from None
        w, h = img.size
        if w <= 0 or h <= 0 or w * h > max_pixels:
            raise _bad(where, f"{img.format} image of {w}x{h} pixels is refused: more than {max_pixels} pixels "
                              "(a decompression bomb or an oversized image)")
        try:
            if size_hint is not None and img.format == "JPEG":
                transposed = img.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # rotated by 90 degrees
                th, tw = size_hint(w, h) if transposed else size_hint(h, w)
                img.draft("RGB", (th, tw) if transposed else (tw, th))
            img.load()
            img = ImageOps.exif_transpose(img)
            return _to_rgb(img)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise _bad(where, f"refused as a decompression bomb: {e}") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise _bad(where, f"{img.format} image is truncated or damaged: {e}") from None


def _to_rgb(img):
    from PIL import Image

    if img.mode == "P" and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "LA", "PA"):
        img = img.convert("RGBA")
        bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, img).convert("RGB")
    return img if img.mode == "RGB" else img.convert("RGB")


def resize_for_encoder(img, cfg: VisionConfig | None = None, max_tokens: int = DEFAULT_MAX_IMAGE_TOKENS):
    """The RGB image resized to `target_size` (bicubic; unchanged when it already has that size)."""
    from PIL import Image

    h, w = target_size(img.height, img.width, cfg, max_tokens)
    if (img.height, img.width) == (h, w):
        return img
    return img.resize((w, h), Image.Resampling.BICUBIC)


def to_pixel_values(img) -> torch.Tensor:
    """An RGB image -> [3, H, W] float32, (x / 255 - PIXEL_MEAN) / PIXEL_STD."""
    a = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float()
    return (a / 255.0 - PIXEL_MEAN) / PIXEL_STD


def load_pixels(data: bytes, where: str = "image", cfg: VisionConfig | None = None,
                max_tokens: int = DEFAULT_MAX_IMAGE_TOKENS, max_pixels: int = MAX_DECODE_PIXELS) -> torch.Tensor:
    """Image bytes -> the encoder's [3, H, W] input (decode_image, resize_for_encoder, to_pixel_values)."""
    img = decode_image(data, where, max_pixels, size_hint=lambda h, w: target_size(h, w, cfg, max_tokens))
    return to_pixel_values(resize_for_encoder(img, cfg, max_tokens))


# --------------------------------------------------------------------------------------------------- records

@dataclass(frozen=True)
class ImageSource:
    """Where one image's bytes are: a file (`path`, absolute) or base64 text (`data`). `where` names it in errors
    ("data.jsonl:3: field 'images[0]'")."""

    where: str
    path: str | None = None
    data: str | None = None

    def read_bytes(self, max_bytes: int = MAX_IMAGE_FILE_BYTES) -> bytes:
        if self.path is not None:
            try:
                size = os.path.getsize(self.path)
                if size > max_bytes:
                    raise _bad(self.where, f"{self.path} is {size} bytes, more than the {max_bytes} an image may be")
                with open(self.path, "rb") as f:
                    return f.read()
            except OSError as e:
                raise _bad(self.where, f"cannot read {self.path}: {e.strerror or e}") from None
        if len(self.data) * 3 // 4 > max_bytes:
            raise _bad(self.where, f"the base64 image is over {max_bytes} bytes")
        try:
            return base64.b64decode(self.data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _bad(self.where, f"not valid base64: {e}") from None

    def describe(self) -> str:
        return self.path if self.path is not None else f"base64 ({len(self.data)} chars)"


@dataclass
class ImageTextRecord:
    """One record: its conversation (image parts replaced by `sentinel` text parts, in order) and its images.
    `where` is "file:line"."""

    where: str
    messages: list[dict]
    images: list[ImageSource]
    sentinel: str
    meta: dict = field(default_factory=dict)


@dataclass
class ImageTextSample:
    """A record encoded: token ids (int32; placeholders where the images go, eos last), which ids are trained (what
    the assistant writes), each image's [3, H, W] pixels and its number of placeholder tokens."""

    where: str
    input_ids: np.ndarray
    trained: np.ndarray
    pixel_values: list[torch.Tensor]
    image_tokens: list[int]


def _source(spec, field_name: str, where: str, base_dir: str) -> ImageSource:
    """An image source object ({"path"|"base64"|"url": ...}) -> ImageSource, or ValueError naming the field."""
    if not isinstance(spec, dict):
        raise ValueError(f"field '{field_name}' must be an object with one of {list(SOURCE_KEYS)}, got {_short(spec)}")
    keys = [k for k in SOURCE_KEYS if k in spec]
    if len(keys) != 1:
        raise ValueError(f"field '{field_name}' is an unknown image source {_short(spec)}: give exactly one of "
                         f"{list(SOURCE_KEYS)}")
    k, v = keys[0], spec[keys[0]]
    at = f"{where}: field '{field_name}.{k}'"
    if not isinstance(v, str) or not v:
        raise ValueError(f"field '{field_name}.{k}' must be a non-empty string, got {_short(v)}")
    if k == "path":
        path = v if os.path.isabs(v) else os.path.join(base_dir, v)
        if not os.path.isfile(path):
            raise ValueError(f"field '{field_name}.path' = {_short(v)}: no such file ({path})")
        return ImageSource(at, path=path)
    if k == "url":
        if not v.startswith("data:"):
            raise ValueError(f"field '{field_name}.url' = {_short(v)} is not a data: URL (remote URLs are not "
                             "fetched; give \"data:image/png;base64,...\", a 'path' or 'base64')")
        head, sep, payload = v.partition(",")
        if not sep or not head.endswith(";base64"):
            raise ValueError(f"field '{field_name}.url' = {_short(v)} is not a base64 data: URL "
                             "(\"data:image/png;base64,...\")")
        v = payload
    return ImageSource(at, data=v)


def _image_part(part, field_name: str, where: str, base_dir: str) -> ImageSource | None:
    """The image of a content part ({"type": "image_url", ...} or {"type": "image", ...}), or None for another
    part (text parts are the chat renderer's to check)."""
    if not isinstance(part, dict):
        return None
    kind = part.get("type")
    if kind == "image_url":
        spec = part.get("image_url")
        spec = {"url": spec} if isinstance(spec, str) else spec
        if not isinstance(spec, dict) or "url" not in spec:
            raise ValueError(f"field '{field_name}.image_url' must be {{\"url\": \"data:...\"}}, got {_short(spec)}")
        return _source({"url": spec["url"]}, f"{field_name}.image_url", where, base_dir)
    if kind == "image":
        return _source({k: v for k, v in part.items() if k != "type"}, field_name, where, base_dir)
    return None


def _sentinel(line: str) -> str:
    """A text no string of the record contains (it stands for an image until the rendering is cut at it)."""
    k = 0
    while f"\x00image{k}\x00" in line or f"\\u0000image{k}" in line:
        k += 1
    return f"\x00image{k}\x00"


def parse_record(obj, where: str, base_dir: str, line: str = "") -> ImageTextRecord:
    """A decoded JSON record -> ImageTextRecord (images not read), or ValueError naming the field. `line` is the
    record's JSON text (the sentinel is chosen not to occur in it)."""
    if not isinstance(obj, dict):
        raise ValueError(f"a record must be a JSON object with 'text' and 'images' (or 'messages'), got a JSON "
                         f"{type(obj).__name__}")
    sentinel = _sentinel(line or json.dumps(obj))
    images: list[ImageSource] = []
    if "text" in obj and "messages" in obj:
        raise ValueError("the record has both 'text' and 'messages': give one (a pair, or a conversation)")
    if "messages" in obj:
        msgs = obj["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"field 'messages' must be a non-empty list of messages, got {_short(msgs)}")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("content"), list):
                out.append(m)  # the renderer checks the rest
                continue
            parts = []
            for j, part in enumerate(m["content"]):
                src = _image_part(part, f"messages[{i}].content[{j}]", where, base_dir)
                if src is None:
                    parts.append(part)
                    continue
                if m.get("role") in ("assistant", "option"):  # another bad role: the renderer names it
                    raise ValueError(f"field 'messages[{i}].content[{j}]' is an image in a {m.get('role')!r} "
                                     f"message: images go in {list(IMAGE_ROLES)} messages (the model writes none)")
                images.append(src)
                parts.append({"type": "text", "text": sentinel})
            out.append({**m, "content": parts})
        meta = {k: v for k, v in obj.items() if k != "messages"}
    elif "text" in obj:
        text, prompt = obj["text"], obj.get("prompt", "")
        if not isinstance(text, str) or not text:
            raise ValueError(f"field 'text' must be a non-empty string, got {_short(text)}")
        if not isinstance(prompt, str):
            raise ValueError(f"field 'prompt' must be a string, got {_short(prompt)}")
        if "images" not in obj:
            raise ValueError("field 'images' is missing (a pair is {\"text\": ..., \"images\": [{\"path\": ...}]})")
        specs = obj["images"]
        if not isinstance(specs, list) or not specs:
            raise ValueError(f"field 'images' must be a non-empty list of image sources, got {_short(specs)}")
        for j, spec in enumerate(specs):
            src = _image_part(spec, f"images[{j}]", where, base_dir)
            images.append(src if src is not None else _source(spec, f"images[{j}]", where, base_dir))
        content = [{"type": "text", "text": sentinel} for _ in images]
        if prompt:
            content.append({"type": "text", "text": prompt})
        out = [{"role": "user", "content": content}, {"role": "assistant", "content": text}]
        meta = {k: v for k, v in obj.items() if k not in ("text", "images", "prompt")}
    else:
        raise ValueError("field 'text' is missing (a record is {\"text\": ..., \"images\": [...]} or "
                         "{\"messages\": [...]})")
    if not images:
        raise ValueError("the record has no image (image-text data needs at least one; text-only data goes to "
                         "--data)")
    rec = ImageTextRecord(where, out, images, sentinel, meta)
    units = record_units(rec)  # the renderer's own checks (roles, content), with the field's name
    if not any(isinstance(u, Segment) and u.train for u in units):
        raise ValueError("field 'messages' has no assistant message: nothing to train on")
    if sum(isinstance(u, ImageSlot) for u in units) != len(images):
        raise ValueError("an image part is in a field the template does not render")
    return rec


def read_records(path: str, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[ImageTextRecord]:
    """The records of a .jsonl file, one line at a time (blank lines are not records). The first bad record raises
    ImageRecordError "path:line: ..."; images are not read here (encode_record reads them)."""
    base_dir = os.path.dirname(os.path.abspath(path))
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ImageRecordError(f"cannot read {path}: {e.strerror or e}") from None
    with f:
        n = 0
        while True:
            raw = f.readline(max_line_bytes + 1)
            if not raw:
                return
            n += 1
            where = f"{path}:{n}"
            if len(raw) > max_line_bytes:
                raise _bad(where, f"the line is longer than {max_line_bytes} bytes")
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
                yield parse_record(obj, where, base_dir, text)
            except UnicodeDecodeError as e:
                raise _bad(where, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
            except ImageRecordError:
                raise
            except ValueError as e:
                raise _bad(where, str(e)) from None


# ------------------------------------------------------------------------------------------------- rendering

def record_units(rec: ImageTextRecord, template: ChatTemplate | None = None, messages: list | None = None,
                 add_generation_prompt: bool = False) -> list:
    """The record's rendering (the chat template; by default all its messages, no generation prompt) as Segments
    with an ImageSlot where each image goes; `messages` renders a part of them (a prompt) instead."""
    units: list = []
    k = 0
    for s in render_chat_segments(rec.messages if messages is None else messages, template,
                                  add_generation_prompt=add_generation_prompt):
        if s.special or rec.sentinel not in s.text:
            units.append(s)
            continue
        for j, piece in enumerate(s.text.split(rec.sentinel)):
            if j:
                units.append(ImageSlot(k))
                k += 1
            if piece:
                units.append(s._replace(text=piece))
    return units


def render_text(rec: ImageTextRecord, image_tokens: list[int], template: ChatTemplate | None = None,
                placeholder: str = PLACEHOLDER_TEXT) -> str:
    """The record as text, each image as `placeholder` repeated its number of tokens (for reading; training uses
    `encode_record`'s ids)."""
    _check_counts(rec, image_tokens)
    return "".join(placeholder * image_tokens[u.index] if isinstance(u, ImageSlot) else u.text
                   for u in record_units(rec, template))


def _check_counts(rec: ImageTextRecord, image_tokens: list[int]) -> None:
    if len(image_tokens) != len(rec.images):
        raise ValueError(f"{rec.where}: {len(rec.images)} images but {len(image_tokens)} token counts")


def encode_units(units: list, tokenizer, placeholder_id: int, image_tokens: list[int], where: str = "record",
                 template: ChatTemplate | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids int32, trained bool) of rendered units: markers as special ids (where the tokenizer has them),
    text runs encoded on their own (as k3.posttrain.chat_data does), each ImageSlot as `placeholder_id` x its
    tokens (untrained), eos appended (untrained)."""
    ids_of = markup_ids(tokenizer, template)
    toks: list[int] = []
    mask: list[bool] = []
    run: list[Segment] = []

    def flush():
        for u in segment_units(run, ids_of):
            piece = [u] if isinstance(u, int) else tokenizer.encode(u)
            if not isinstance(u, int) and placeholder_id in piece:
                raise ValueError(f"{where}: the text encodes to the image placeholder id {placeholder_id}: use an id "
                                 "the tokenizer never produces from text (a reserved special token)")
            toks.extend(piece)
            mask.extend([run[0].train] * len(piece))
        run.clear()

    for u in units:
        if isinstance(u, ImageSlot):
            flush()
            toks.extend([placeholder_id] * image_tokens[u.index])
            mask.extend([False] * image_tokens[u.index])
        else:
            if run and run[-1].train != u.train:
                flush()
            run.append(u)
    flush()
    toks.append(tokenizer.eos_id)
    mask.append(False)
    return np.asarray(toks, dtype=np.int32), np.asarray(mask, dtype=bool)


def load_record_images(rec: ImageTextRecord, cfg: VisionConfig | None = None,
                       max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS,
                       max_pixels: int = MAX_DECODE_PIXELS) -> list[torch.Tensor]:
    """The record's images as the encoder's [3, H, W] inputs, decoded one at a time; ImageRecordError naming the
    file, line and field of a bad one."""
    out = []
    for src in rec.images:
        where = f"{src.where} ({src.describe()})"
        out.append(load_pixels(src.read_bytes(), where, cfg, max_image_tokens, max_pixels))
    return out


def encode_record(rec: ImageTextRecord, tokenizer, placeholder_id: int, cfg: VisionConfig | None = None,
                  max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS, template: ChatTemplate | None = None,
                  max_pixels: int = MAX_DECODE_PIXELS) -> ImageTextSample:
    """A record -> ImageTextSample: its images loaded and resized, their placeholder counts from
    VisionConfig.num_image_tokens, the rendering encoded."""
    cfg = cfg or VisionConfig()
    pixels = load_record_images(rec, cfg, max_image_tokens, max_pixels)
    counts = [cfg.num_image_tokens(p.shape[1], p.shape[2]) for p in pixels]
    ids, trained = encode_units(record_units(rec, template), tokenizer, placeholder_id, counts, rec.where, template)
    return ImageTextSample(rec.where, ids, trained, pixels, counts)


def iter_samples(paths: Iterable[str], tokenizer, placeholder_id: int, cfg: VisionConfig | None = None,
                 max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS, template: ChatTemplate | None = None
                 ) -> Iterator[ImageTextSample]:
    """The samples of .jsonl files in order, one record (and its images) at a time."""
    for path in paths:
        for rec in read_records(path):
            yield encode_record(rec, tokenizer, placeholder_id, cfg, max_image_tokens, template)


__all__ = [
    "DEFAULT_MAX_IMAGE_TOKENS", "ImageRecordError", "ImageSlot", "ImageSource", "ImageTextRecord", "ImageTextSample",
    "PLACEHOLDER_TEXT", "decode_image", "encode_record", "encode_units", "iter_samples", "load_pixels",
    "load_record_images", "parse_record", "read_records", "record_units", "render_text", "resize_for_encoder",
    "target_size", "to_pixel_values",
]
