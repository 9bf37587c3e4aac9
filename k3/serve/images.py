"""Images in chat requests (report §2.4): OpenAI `image_url` content parts -> the prompt's token ids with a
placeholder run per image, and the images (k3.serve.sequence.PromptImage) the engine encodes at prefill.

A part is {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} (a bare string for `image_url`
is taken too; OpenAI's "detail" is ignored: the image is used at its own resolution, up to the token budget) in a
system, user or tool message. Only base64 data URLs are taken: the server never fetches a remote URL (it would
make the server a client of any address a request names), and an http(s) URL is refused with a 400 that says to
send a data URL. Decoding is k3.data.images' (the same code that reads image-text training data): only PNG, JPEG,
WebP, GIF (first frame) or BMP, a header that claims more than `max_image_pixels` refused before any pixel is
decoded (a decompression bomb), truncated or damaged files refused, then resized (aspect ratio kept) to multiples of
the encoder's 28-pixel unit with at most `max_image_tokens` tokens, and normalized.

Rendering follows training (k3.data.images.record_units / encode_units): each image part becomes a sentinel text
part, the conversation goes through the chat template, the sentinels are cut out again as image slots, and
`encode_units` encodes the text runs on their own and puts the model's `media_placeholder_token_id` repeated
VisionConfig.num_image_tokens(H, W) times at each image's place. So the prompt a request gets is the one an
image-text record of the same conversation trains on (without the record's closing eos).

Limits (`ImageLimits`, flags of `k3 serve`): at most `max_images` images per request (400), each at most
`max_image_bytes` bytes once decoded from base64 (413, checked on the base64 length before decoding it); both
errors name the limit and its flag. A bad image gets a 400 naming the message and part (`messages[1].content[0]`)
and what is wrong; nothing of it reaches the engine.

Each image's content hash (`image_digest`: SHA-256 of its normalized pixels and their shape) keys the prefix cache
(k3.serve.cache.prefix.MediaSpan): the same image and text sent again hit the cache; another image never shares
its blocks.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from k3.config import VisionConfig
from k3.data.images import (DEFAULT_MAX_IMAGE_TOKENS, IMAGE_ROLES, MAX_DECODE_PIXELS, ImageRecordError, ImageSlot,
                            ImageSource, encode_units, load_pixels)
from k3.serve.chat_render import Segment
from k3.serve.protocol import APIError
from k3.serve.sequence import PromptImage

DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_IMAGE_MB = 6.0  # its base64 (4/3 as long) fills the default 8 MiB request body


@dataclass(frozen=True)
class ImageLimits:
    """What one request's images may be: `max_images` per request, `max_image_bytes` each (decoded from base64),
    at most `max_image_pixels` pixels as the file's header claims (more: refused before decoding), resized to at
    most `max_image_tokens` tokens."""

    max_images: int = DEFAULT_MAX_IMAGES
    max_image_bytes: int = int(DEFAULT_MAX_IMAGE_MB * 2**20)
    max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS
    max_image_pixels: int = MAX_DECODE_PIXELS

    def validate(self) -> "ImageLimits":
        for name in ("max_images", "max_image_bytes", "max_image_tokens", "max_image_pixels"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"image limit {name} = {v!r} must be a positive integer")
        return self


@dataclass(frozen=True)
class ImagePart:
    """An image part of a request: where it is (`messages[i].content[j]`) and its base64 payload."""

    where: str
    data: str


def has_image_parts(messages) -> bool:
    """Whether any message's content list holds an {"type": "image_url"} part (a quick scan; nothing is checked)."""
    if not isinstance(messages, list):
        return False
    return any(isinstance(m, dict) and isinstance(m.get("content"), list)
               and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
               for m in messages)


def _sentinel(messages) -> str:
    """A text no string of the request contains: it stands for an image until the rendering is cut at it."""
    try:
        text = json.dumps(messages, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(messages)
    k = 0
    while f"\x00image{k}\x00" in text or f"\\u0000image{k}" in text:
        k += 1
    return f"\x00image{k}\x00"


def _payload(part: dict, where: str) -> str:
    """The base64 payload of an image_url part; APIError (400) naming the part when it is not a base64 data URL."""
    spec = part.get("image_url")
    if isinstance(spec, str):
        spec = {"url": spec}
    if not isinstance(spec, dict) or not isinstance(spec.get("url"), str) or not spec["url"]:
        raise APIError(400, f"{where}.image_url must be an object like {{\"url\": \"data:image/png;base64,...\"}}",
                       param="messages")
    url = spec["url"]
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme in ("http", "https", "ftp", "file"):
        raise APIError(400, f"{where}.image_url.url is a {scheme} URL: the server does not fetch remote images; send "
                            "a data URL (\"data:image/png;base64,...\")", param="messages")
    if scheme != "data":
        raise APIError(400, f"{where}.image_url.url is not a data URL: send the image as \"data:image/png;base64,...\" "
                            "(remote URLs are not fetched)", param="messages")
    head, sep, data = url.partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise APIError(400, f"{where}.image_url.url is not a base64 data URL (\"data:image/png;base64,...\")",
                       param="messages")
    if not data:
        raise APIError(400, f"{where}.image_url.url has no data after the comma", param="messages")
    return data


def find_image_parts(messages, limits: ImageLimits) -> tuple[list, list[ImagePart], str]:
    """(the messages with each image part replaced by a sentinel text part, the image parts in order, the
    sentinel). APIError: an image in a message of another role or a bad URL (400, naming the part), more than
    limits.max_images images (400), an image over limits.max_image_bytes (413). Nothing is decoded here."""
    sentinel = _sentinel(messages)
    parts: list[ImagePart] = []
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), list):
            out.append(m)  # the renderer checks the rest
            continue
        content = []
        for j, part in enumerate(m["content"]):
            if not (isinstance(part, dict) and part.get("type") == "image_url"):
                content.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            if m.get("role") not in IMAGE_ROLES:
                raise APIError(400, f"{where} is an image in a {m.get('role')!r} message: images go in "
                                    f"{', '.join(IMAGE_ROLES)} messages (the model writes none)", param="messages")
            data = _payload(part, where)
            size = len(data) * 3 // 4
            if size > limits.max_image_bytes:
                raise APIError(413, f"{where}: the image is about {size} bytes, more than this server's limit of "
                                    f"{limits.max_image_bytes} bytes per image (k3 serve --max-image-mb)",
                               param="messages", code="image_too_large")
            parts.append(ImagePart(where, data))
            content.append({"type": "text", "text": sentinel})
        out.append({**m, "content": content})
    if len(parts) > limits.max_images:
        raise APIError(400, f"the request has {len(parts)} images; this server takes at most {limits.max_images} per "
                            "request (k3 serve --max-images-per-request)", param="messages", code="too_many_images")
    return out, parts, sentinel


def decode_images(parts: list[ImagePart], cfg: VisionConfig, limits: ImageLimits) -> list[torch.Tensor]:
    """Each part's pixels as the encoder takes them ([3, H, W] float32; k3.data.images.load_pixels), one at a time.
    APIError (400) naming the part for data that is not base64 or not a readable image of the allowed formats,
    a truncated or damaged file, or a header claiming more than limits.max_image_pixels pixels."""
    out = []
    for p in parts:
        try:
            data = ImageSource(p.where, data=p.data).read_bytes(limits.max_image_bytes)
            out.append(load_pixels(data, p.where, cfg, limits.max_image_tokens, limits.max_image_pixels))
        except ImageRecordError as e:
            raise APIError(400, str(e), param="messages", code="invalid_image") from None
    return out


def image_digest(pixels: torch.Tensor) -> bytes:
    """The content hash of an image as the encoder sees it: SHA-256 of its shape and its normalized float32
    pixels (so the resize settings are part of it). The prefix cache keys the image's blocks on it."""
    px = pixels.detach().to("cpu", torch.float32).contiguous()
    h = hashlib.sha256(b"k3 image v1")
    h.update(struct.pack("<3q", *px.shape))
    h.update(px.numpy().tobytes())
    return h.digest()


def split_images(segments: list[Segment], sentinel: str) -> list:
    """The rendering's segments with an ImageSlot (numbered in order) where each sentinel was (k3.data.images
    .record_units' cut)."""
    units: list = []
    k = 0
    for s in segments:
        if s.special or sentinel not in s.text:
            units.append(s)
            continue
        for j, piece in enumerate(s.text.split(sentinel)):
            if j:
                units.append(ImageSlot(k))
                k += 1
            if piece:
                units.append(s._replace(text=piece))
    return units


def encode_with_images(segments: list[Segment], sentinel: str, pixels: list[torch.Tensor], tokenizer,
                       placeholder_id: int, cfg: VisionConfig, template=None) -> tuple[list[int], list[PromptImage]]:
    """The prompt ids of a rendering whose image parts are `sentinel`s, and its PromptImages: encoded as
    k3.data.images.encode_units encodes a training record (its closing eos left off: the prompt goes on with the
    generation prompt the segments end with). APIError (400) when a text encodes to the placeholder id."""
    units = split_images(segments, sentinel)
    n_slots = sum(isinstance(u, ImageSlot) for u in units)
    if n_slots != len(pixels):
        raise APIError(400, f"the request has {len(pixels)} images but the chat template renders {n_slots} of them "
                            "(an image part in a field the template does not render)", param="messages")
    counts = [cfg.num_image_tokens(p.shape[1], p.shape[2]) for p in pixels]
    try:
        ids, _ = encode_units(units, tokenizer, placeholder_id, counts, "messages", template)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = [int(t) for t in ids[:-1]]  # encode_units closes a record with eos; a prompt is not closed
    where = [t for t, x in enumerate(ids) if x == placeholder_id]
    images, at = [], 0
    for px, n in zip(pixels, counts):
        start = where[at]
        if where[at + n - 1] != start + n - 1:  # never: the text cannot hold the placeholder id
            raise RuntimeError("an image's placeholder run is not contiguous")
        images.append(PromptImage(px, start, n, image_digest(px)))
        at += n
    return ids, images


__all__ = ["DEFAULT_MAX_IMAGES", "DEFAULT_MAX_IMAGE_MB", "ImageLimits", "ImagePart", "decode_images",
           "encode_with_images", "find_image_parts", "has_image_parts", "image_digest", "split_images"]
