"""Training rows of image-text records (report §2.4: the encoder trained from scratch with the language model).

`ImageRecordFile` indexes a .jsonl of k3.data.images records: one pass reads every line, checks it as a record (a
bad one is an ImageRecordError naming file:line and the field, before any training) and keeps only its byte offset,
so a record is read again, and its images decoded, when a row needs it.

`ImageRowStream` packs records into rows of `seq_len` tokens, as SFT packs conversations
(k3.posttrain.chat_data.pack_conversations): each record its own segment (no attention or loss across records), a
segment's first label masked, only what the assistant writes trained (the placeholders, the prompt and the template
are not), the rest of a row padding (a segment of its own, eos ids, no loss). A row carries its records' images in
placeholder order, so the encoder sees every image of a row with it. Records are taken in the order of a permutation
seeded by (seed, epoch), greedily: a record that does not fit what is left of a row starts the next row (it is not
consumed until it is placed), so the stream's state is (epoch, position) and `load_state_dict` resumes it exactly. A
record longer than a row is cut to `seq_len` tokens when all its placeholders and at least one trained token fit
(its trained text's tail is dropped), otherwise skipped; both are counted (`stats`).

`ImageTextLoader` is the trainer's loader of a run with images: each step's rows are `round`ed shares of
`rows_per_step`, the image rows `share` of them (by tokens: every row is `seq_len` tokens) and the rest rows of the
text stream (a k3.data.packing.PackedLoader). The share is kept exactly over the run and within one row at every
step: step k has floor((k + 1) s R) - floor(k s R) image rows (s the share, R the rows per step). Its state is the
text loader's, the image stream's and the step count, so a resumed run reads the same rows.

Memory: a row holds at most `seq_len` tokens, so at most `seq_len` image tokens, (28 x 28 x 3) fp32 pixels each
(9.2 KiB: 38 MiB for a row of 4096 image tokens), decoded one record at a time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import torch

from k3.config import VisionConfig
from k3.data.images import (DEFAULT_MAX_IMAGE_TOKENS, MAX_LINE_BYTES, ImageRecordError, ImageTextRecord,
                            ImageTextSample, encode_record, parse_record)
from k3.data.packing import IGNORE_INDEX


class ImageRecordFile:
    """The records of one image-text .jsonl, indexed by byte offset and checked once (`k3.data.images.parse_record`:
    fields, roles, image files present); `fingerprint` is a digest of the file's bytes."""

    def __init__(self, path: str, max_line_bytes: int = MAX_LINE_BYTES):
        self.path = path
        self.base_dir = os.path.dirname(os.path.abspath(path))
        offsets, lines = [], []
        h = hashlib.sha256()
        try:
            f = open(path, "rb")
        except OSError as e:
            raise ImageRecordError(f"cannot read {path}: {e.strerror or e}") from None
        with f:
            n = off = 0
            while True:
                raw = f.readline(max_line_bytes + 1)
                if not raw:
                    break
                n += 1
                h.update(raw)
                if len(raw) > max_line_bytes:
                    raise ImageRecordError(f"{path}:{n}: the line is longer than {max_line_bytes} bytes")
                if raw.strip():
                    self._parse(raw, n)  # checked now; kept as its offset only
                    offsets.append(off)
                    lines.append(n)
                off += len(raw)
        if not offsets:
            raise ImageRecordError(f"{path} holds no image-text records")
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.lines = np.asarray(lines, dtype=np.int64)
        self.fingerprint = "images:" + h.hexdigest()[:16]

    def __len__(self) -> int:
        return int(self.offsets.shape[0])

    def _parse(self, raw: bytes, line: int) -> ImageTextRecord:
        where = f"{self.path}:{line}"
        try:
            text = raw.decode("utf-8")
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
            return parse_record(obj, where, self.base_dir, text)
        except UnicodeDecodeError as e:
            raise ImageRecordError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except ImageRecordError:
            raise
        except ValueError as e:
            raise ImageRecordError(f"{where}: {e}") from None

    def record(self, i: int) -> ImageTextRecord:
        """Record `i` (0-based, in file order), read again from the file."""
        with open(self.path, "rb") as f:
            f.seek(int(self.offsets[i]))
            raw = f.readline()
        return self._parse(raw, int(self.lines[i]))


class ImageRowStream:
    """Shuffled rows of `seq_len` tokens packed from the records of an ImageRecordFile (the module docstring)."""

    def __init__(self, records: ImageRecordFile, tokenizer, placeholder_id: int, vision: VisionConfig, seq_len: int,
                 seed: int = 0, max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS, pad_id: int | None = None,
                 shuffle: bool = True):
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        self.records, self.tok, self.placeholder_id = records, tokenizer, int(placeholder_id)
        self.vision, self.seq_len, self.seed = vision, int(seq_len), int(seed)
        self.max_image_tokens = max_image_tokens
        self.pad_id = tokenizer.eos_id if pad_id is None else int(pad_id)
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # records of the current epoch's order already placed (or skipped)
        self._perm_epoch, self._perm = -1, None
        self._pending: tuple[int, int, ImageTextSample] | None = None  # the encoded record at (epoch, position)
        self.stats = {"records": 0, "truncated": 0, "skipped_too_long": 0}

    @property
    def data(self) -> str:
        return self.records.fingerprint

    def _order(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            n = len(self.records)
            self._perm = (np.random.default_rng([self.seed, epoch, 0x1A6E]).permutation(n) if self.shuffle
                          else np.arange(n))
            self._perm_epoch = epoch
        return self._perm

    def _peek(self) -> ImageTextSample:
        if self._pending is None or self._pending[:2] != (self.epoch, self.position):
            i = int(self._order(self.epoch)[self.position])
            s = encode_record(self.records.record(i), self.tok, self.placeholder_id, self.vision,
                              self.max_image_tokens)
            self._pending = (self.epoch, self.position, s)
        return self._pending[2]

    def _advance(self) -> None:
        self.position += 1
        self._pending = None
        if self.position >= len(self.records):
            self.epoch += 1
            self.position = 0

    def _fit(self, s: ImageTextSample) -> ImageTextSample | None:
        """The sample cut to one row (all placeholders and a trained token kept), or None when it cannot be."""
        T = self.seq_len
        if s.input_ids.shape[0] <= T:
            return s
        if (s.input_ids[T:] == self.placeholder_id).any() or not s.trained[1:T].any():
            return None
        return ImageTextSample(s.where, s.input_ids[:T], s.trained[:T], s.pixel_values, s.image_tokens)

    def next_rows(self, n: int, one_pass: bool = False) -> list[list[ImageTextSample]]:
        """The next `n` rows, each a list of the samples packed into it. `one_pass`: stop at the end of the first
        epoch (fewer rows, the last one possibly short)."""
        rows = []
        for _ in range(n):
            if one_pass and self.epoch > 0:
                break
            row, used, tried = [], 0, 0
            while not (one_pass and self.epoch > 0):
                s = self._peek()
                cut = self._fit(s)
                if cut is None:
                    self.stats["skipped_too_long"] += 1
                    self._advance()
                    tried += 1
                    if tried > len(self.records):
                        raise ValueError(f"no record of {self.records.path} fits a row of {self.seq_len} tokens with "
                                         "its images and a trained token: raise --seq-len or lower "
                                         "--max-image-tokens")
                    continue
                if used + cut.input_ids.shape[0] > self.seq_len:
                    break  # starts the next row (not consumed)
                if cut is not s:
                    self.stats["truncated"] += 1
                row.append(cut)
                used += cut.input_ids.shape[0]
                self.stats["records"] += 1
                self._advance()
                if used == self.seq_len:
                    break
            rows.append(row)
        return rows

    def state_dict(self) -> dict:
        return {"epoch": int(self.epoch), "position": int(self.position), "seed": int(self.seed), "data": self.data}

    def load_state_dict(self, d: dict) -> None:
        epoch, position, seed = int(d["epoch"]), int(d["position"]), int(d["seed"])
        if d.get("data") not in (None, self.data):
            raise ValueError(f"the image stream's state was saved over {d['data']}, this run reads {self.data} "
                             f"({self.records.path}): the image-text file changed since")
        if epoch < 0 or not 0 <= position < len(self.records):
            raise ValueError(f"image stream state {d} does not fit the {len(self.records)} records of "
                             f"{self.records.path}")
        self.epoch, self.position, self.seed = epoch, position, seed
        self._perm_epoch, self._pending = -1, None


def pack_rows(rows: list[list[ImageTextSample]], seq_len: int, pad_id: int) -> dict:
    """Rows of samples -> {"input_ids", "labels", "segment_ids"} [n, seq_len] int64 and "pixel_values" (per row, the
    list of its images' [3, H, W] tensors in placeholder order); see the module docstring for the layout."""
    n = len(rows)
    ids = np.full((n, seq_len), pad_id, dtype=np.int64)
    lab = np.full((n, seq_len), IGNORE_INDEX, dtype=np.int64)
    seg = np.zeros((n, seq_len), dtype=np.int64)
    pixels = []
    for r, row in enumerate(rows):
        off = 0
        seg[r, :] = len(row)  # padding: a segment of its own
        images = []
        for k, s in enumerate(row):
            m = s.input_ids.shape[0]
            ids[r, off:off + m] = s.input_ids
            lab[r, off:off + m] = np.where(s.trained, s.input_ids, IGNORE_INDEX)
            lab[r, off] = IGNORE_INDEX  # a segment's first token is never a target
            seg[r, off:off + m] = k
            images.extend(s.pixel_values)
            off += m
        pixels.append(images)
    return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(lab),
            "segment_ids": torch.from_numpy(seg), "pixel_values": pixels}


def image_rows_at(step: int, share: float, rows_per_step: int) -> int:
    """Image rows of step `step` (0-based): floor((step + 1) s R) - floor(step s R), so the first k steps hold
    floor(k s R) image rows (the share exactly, up to one row) and each step one of the two integers around s R."""
    total = share * rows_per_step
    return math.floor((step + 1) * total + 1e-9) - math.floor(step * total + 1e-9)


class ImageTextLoader:
    """Each step's rows: `image_rows_at` rows of the image stream, the rest of `rows_per_step` from the text loader,
    text rows first; the batch also holds "pixel_values" (per row, its images) and "image_row" ([rows] bool)."""

    data_flag = "--data"

    def __init__(self, text, images: ImageRowStream, rows_per_step: int, share: float):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"the image share must be in [0, 1], got {share}")
        if text.seq_len != images.seq_len:
            raise ValueError(f"text rows of {text.seq_len} tokens and image rows of {images.seq_len}: they must match")
        self.text, self.images, self.rows_per_step, self.share = text, images, int(rows_per_step), float(share)
        self.seq_len = text.seq_len
        self.steps = 0

    @property
    def num_rows(self) -> int:
        """Rows per text epoch, counting the image rows read beside them (so that --epochs counts text epochs)."""
        if self.share >= 1.0:
            return max(1, len(self.images.records))
        return max(1, round(self.text.num_rows / (1.0 - self.share)))

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_rows * self.seq_len

    def next_batch(self) -> dict:
        n_img = image_rows_at(self.steps, self.share, self.rows_per_step)
        n_text = self.rows_per_step - n_img
        parts = []
        if n_text:
            self.text.batch_size = n_text
            parts.append(self.text.next_batch())
        if n_img:
            parts.append(pack_rows(self.images.next_rows(n_img), self.seq_len, self.images.pad_id))
        batch = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "labels", "segment_ids")}
        batch["pixel_values"] = [[] for _ in range(n_text)] + (parts[-1]["pixel_values"] if n_img else [])
        batch["image_row"] = torch.arange(self.rows_per_step) >= n_text
        self.steps += 1
        return batch

    def state_dict(self) -> dict:
        return {"text": self.text.state_dict(), "images": self.images.state_dict(), "steps": int(self.steps)}

    def load_state_dict(self, d: dict) -> None:
        self.text.load_state_dict(d["text"])
        self.images.load_state_dict(d["images"])
        self.steps = int(d["steps"])


def heldout_image_batches(records: ImageRecordFile, tokenizer, placeholder_id: int, vision: VisionConfig,
                          seq_len: int, rows: int, max_rows: int,
                          max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS) -> list[dict]:
    """The held-out image rows (records in file order, packed as for training), at most `max_rows` rows in batches
    of `rows`: the same rows at every evaluation."""
    stream = ImageRowStream(records, tokenizer, placeholder_id, vision, seq_len, max_image_tokens=max_image_tokens,
                            shuffle=False)
    out, taken = [], 0
    while taken < max_rows and stream.epoch == 0:
        got = [r for r in stream.next_rows(min(rows, max_rows - taken), one_pass=True) if r]
        if got:
            out.append(pack_rows(got, seq_len, stream.pad_id))
            taken += len(got)
    if not out:
        raise ValueError(f"no held-out record of {records.path} fits a row of {seq_len} tokens with its images and a "
                         "trained token: raise --seq-len or lower --max-image-tokens")
    return out


__all__ = ["ImageRecordFile", "ImageRowStream", "ImageTextLoader", "heldout_image_batches", "image_rows_at",
           "pack_rows"]
