"""`k3 train --images PAIRS.jsonl [--image-share 0.2]`: the vision encoder trained from scratch together with the
language model (report §2.4: MoonViT-V2 is trained natively with the LM, not bolted on afterwards).

What a run with images adds to a text run (k3.train.run builds it through `image_trainer`):
* the model: a vision encoder (`vision_config`): the preset's (tiny: VisionConfig.tiny(); k3-mini:
  `K3_MINI_VISION`, a ViT-Base-sized MoonViT-V2; k3: the release's), or the --config file's own (a --config without
  one is refused), and `media_placeholder_token_id`;
* the tokenizer: the release's placeholder "<|kimi_image_placeholder|>" as a special token, the last id (a fresh run
  trains its BPE one id smaller, so --vocab-size still counts every id); text never encodes to it;
* the batches: k3.data.image_batches.ImageTextLoader: --image-share of each step's rows (so of its tokens) are packed
  image-text records, only the assistant's text trained, the rest rows of the text stream;
* the loss (`ImageTextLoss`): next-token cross-entropy over every trained token of the step, text and image rows
  alike (each micro-batch weighed by its trained tokens), plus the MTP term; the step also reports the loss of each
  kind of row;
* the optimizer: the encoder's parameters join the model's groups (k3.train.per_head_muon.muon_param_groups): its
  linear weights ([out, in]) are Muon's, the patch convolution, the position table and the norms AdamW's;
* evaluation: beside the text held-out loss, the loss of the held-out records (--images-heldout, default
  heldout.jsonl beside --images) as `image_val_loss`;
* metrics: per step the text-stream tokens, image tokens (placeholders), images, the image rows' trained tokens,
  each per second, and the loss on each kind of row;
* checkpoints: the vision tower under the release's names (k3.checkpoint), and `image_training.json` (the image
  files, the share, the token budget per image). --resume restores the image stream's position exactly (its
  permutation's epoch and position are in the trainer state); without --images it continues with the run's files.

One process only: a run under torchrun, or with --context-schedule, is refused with --images.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass

import torch

from k3.config import K3Config, VisionConfig
from k3.data.images import DEFAULT_MAX_IMAGE_TOKENS, PLACEHOLDER_TEXT
from k3.model.batch import BatchInfo
from k3.tensors import to_device_async
from k3.train.losses import LossOutput, MicroBatch
from k3.train.trainer import StepMetrics, Trainer

IMAGE_SETTINGS = "image_training.json"  # in every checkpoint of a run with images
DEFAULT_IMAGE_SHARE = 0.2
IMAGE_EVAL_ROWS = 64  # held-out image rows read by one evaluation (at most)

# k3-mini's encoder: MoonViT-V2's architecture (14 px patches, 2x2 merge, RMSNorm, learned 64x64 table, patchmergerv2
# projector) at ViT-Base size: 12 layers of width 768, 12 heads of 64, MLP 3072, 101M parameters with the
# projector, a third of k3-mini's ~0.3B active (the release pairs a 0.4B encoder with a 1T model; a small LM needs a
# relatively larger encoder to see text at all).
K3_MINI_VISION = dict(vt_hidden_size=768, qkv_hidden_size=768, vt_intermediate_size=3072, vt_num_attention_heads=12,
                      vt_num_hidden_layers=12, mm_hidden_size=768, text_hidden_size=1024)


# ------------------------------------------------------------------------------------------ model and tokenizer

def add_image_placeholder(tok):
    """The tokenizer with PLACEHOLDER_TEXT as a special token (the next id; unchanged when it has one already):
    text containing it still encodes as plain bytes (k3.data.tokenizer), so only the data reader puts the id in."""
    from k3.data.tokenizer import K3Tokenizer

    if tok.special_token_id(PLACEHOLDER_TEXT) is not None:
        return tok
    tok.tokenizer.add_special_tokens([PLACEHOLDER_TEXT])
    out = K3Tokenizer(tok.tokenizer, tok.eos_token)
    if out.special_token_id(PLACEHOLDER_TEXT) is None:
        raise ValueError(f"could not add {PLACEHOLDER_TEXT} to the tokenizer as a special token")
    return out


def image_placeholder_id(tok, where: str = "the tokenizer") -> int:
    i = tok.special_token_id(PLACEHOLDER_TEXT)
    if i is None:
        raise ValueError(f"{where} has no image placeholder token {PLACEHOLDER_TEXT}: it was not made for images")
    return i


def vision_config_for(cfg: K3Config, preset: str | None, config_path: str | None) -> dict:
    """The vision_config of a fresh run with images: the config's own, else the preset's (tiny:
    VisionConfig.tiny(), k3-mini: K3_MINI_VISION)."""
    if cfg.vision_config is not None:
        return dict(cfg.vision_config)
    if config_path:
        raise ValueError(f"--images: {config_path} has no vision_config; give a config.json with one (the official "
                         "'vision_config' object, its text_hidden_size equal to the model's hidden_size) or a preset")
    if preset == "tiny":
        vc = VisionConfig.tiny()
    elif preset == "k3-mini":
        vc = VisionConfig(**K3_MINI_VISION)
    else:
        raise ValueError(f"--images: no vision encoder is defined for preset {preset!r}; give --config with a "
                         "vision_config")
    if vc.text_hidden_size != cfg.hidden_size:
        raise ValueError(f"--images: the {preset} encoder projects to width {vc.text_hidden_size}, the model's "
                         f"hidden_size is {cfg.hidden_size}")
    return vc.to_dict()


def image_model_config(cfg: K3Config, tok, opts, resumed: bool) -> K3Config:
    """The model config of a run with images: a fresh run's gets its vision_config and the tokenizer's placeholder
    id; a resumed run's must already have both (its checkpoint's)."""
    pid = image_placeholder_id(tok)
    if resumed:
        if cfg.vision_config is None or cfg.media_placeholder_token_id != pid:
            raise ValueError("--resume with images: the checkpoint's config has no vision encoder or another "
                             f"placeholder id ({cfg.media_placeholder_token_id}, the tokenizer's is {pid})")
        return cfg
    preset = opts.preset or ("tiny" if not opts.config else None)
    return cfg.replace(vision_config=vision_config_for(cfg, preset, opts.config), media_placeholder_token_id=pid)


def check_image_options(opts, tcfg, resume_from: str | None, mesh, log=print) -> None:
    """Before a run's data work: a resumed run continues with its checkpoint's image settings (the flags given
    override the share and the held-out file); images with torchrun or a context schedule are refused."""
    if resume_from is not None:
        path = os.path.join(resume_from, IMAGE_SETTINGS)
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    saved = json.load(f)
                if not isinstance(saved, dict) or "images" not in saved:
                    raise ValueError("not an object with 'images'")
            except (OSError, ValueError) as e:
                raise ValueError(f"{path} is unreadable ({e}); the checkpoint is damaged") from None
            if opts.images is None:
                opts.images = saved["images"]
                if opts.images_heldout is None:
                    opts.images_heldout = saved.get("images_heldout")
            if opts.image_share is None:
                opts.image_share = saved.get("image_share", DEFAULT_IMAGE_SHARE)
            if opts.max_image_tokens is None:
                opts.max_image_tokens = saved.get("max_image_tokens", DEFAULT_MAX_IMAGE_TOKENS)
        elif opts.images:
            raise ValueError(f"--images: the run in {tcfg.out} was trained without images (its checkpoint has no "
                             f"{IMAGE_SETTINGS}); start a new run in another --out to train with images")
    if not opts.images:
        extra = [f for f, v in (("--images-heldout", opts.images_heldout), ("--image-share", opts.image_share),
                                ("--max-image-tokens", opts.max_image_tokens)) if v is not None]
        if extra:
            raise ValueError(f"{', '.join(extra)} only apply with --images")
        return
    if mesh is not None:
        raise ValueError("--images trains on one process: a run under torchrun with --images is not supported yet")
    if getattr(tcfg, "context_schedule", None) is not None:
        raise ValueError("--images and --context-schedule cannot be combined yet")
    if opts.image_share is None:
        opts.image_share = DEFAULT_IMAGE_SHARE
    if opts.max_image_tokens is None:
        opts.max_image_tokens = DEFAULT_MAX_IMAGE_TOKENS


def default_heldout(images: str) -> str | None:
    """heldout.jsonl beside a train.jsonl (k3 data render-pairs writes both), when it exists."""
    p = os.path.join(os.path.dirname(os.path.abspath(images)), "heldout.jsonl")
    return p if os.path.exists(p) and os.path.abspath(p) != os.path.abspath(images) else None


# ---------------------------------------------------------------------------------------------------- the loss

@dataclass(frozen=True)
class ImageTextLoss:
    """Next-token cross-entropy over every trained token of the micro-batch (text rows: every token past a segment
    start; image rows: the assistant's text only), the images encoded and merged at their placeholders, weighed by
    the micro-batch's trained tokens over the step's (so micro-batches sum to the step's token mean whatever rows
    they hold), plus `mtp_weight` x the MTP loss. Its `extra`: the image rows' summed loss and trained tokens
    (computed again from the hidden states without gradient, for reporting)."""
    mtp_weight: float = 0.3

    def __call__(self, model, mb: MicroBatch) -> LossOutput:
        t = mb.tensors
        pixels = t["pixel_values"]
        out = model(t["input_ids"], labels=t["labels"], batch=mb.info, return_logits=False, check_ids=False,
                    stats=mb.stats, pixel_values=pixels if pixels else None)
        n = (t["labels"][:, 1:] != -100).sum().to(torch.float32)
        w = n / mb.step_tokens
        loss = out.loss * w
        if out.mtp_loss is not None:
            loss = loss + self.mtp_weight * out.mtp_loss * w
        extra = {}
        if t["n_image_rows"]:
            with torch.no_grad():
                rows = t["image_rows"]
                lab = t["labels"][rows]
                k = (lab[:, 1:] != -100).sum()
                extra = {"image_loss_sum": (model.head_loss(out.hidden_states[rows].detach(), lab) * k).double(),
                         "image_targets": k.double()}
        mtp = (out.mtp_loss.detach().double() * w) if out.mtp_loss is not None else None
        return LossOutput(loss, (out.loss.detach() * w).double(), out.stats, mtp=mtp, extra=extra)


@dataclass
class ImageStepMetrics(StepMetrics):
    """A step of a run with images: StepMetrics, the step's counts per kind of row and their rates."""
    text_loss: float | None = None  # mean loss of the text rows' tokens
    image_loss: float | None = None  # mean loss of the image rows' trained (assistant) tokens
    text_tokens: int = 0  # tokens of the text stream
    image_rows: int = 0
    image_tokens: int = 0  # image placeholders (encoder outputs) in the image rows
    images: int = 0
    image_targets: int = 0  # trained tokens of the image rows
    text_tokens_per_s: float = 0.0
    image_tokens_per_s: float = 0.0
    images_per_s: float = 0.0

    def progress_postfix(self) -> dict:
        """What the progress bar adds (k3.train.reporting.ProgressBar)."""
        return {"text tok/s": f"{self.text_tokens_per_s:,.0f}", "img tok/s": f"{self.image_tokens_per_s:,.0f}",
                "img/s": f"{self.images_per_s:,.1f}"}


# ------------------------------------------------------------------------------------------------- the trainer

class ImageTextTrainer(Trainer):
    """The Trainer over an ImageTextLoader: each micro-batch's images go to the device with its rows, in row order;
    the step's metrics are ImageStepMetrics; evaluation adds the held-out image loss."""

    def __init__(self, model, tcfg, loader, image_eval: list[dict] | None = None, **kw):
        kw.setdefault("loss", ImageTextLoss(tcfg.mtp_weight))
        super().__init__(model, tcfg, loader, **kw)
        self.image_eval = image_eval
        self._counts: dict | None = None

    def _next_batch(self) -> dict:
        batch = super()._next_batch()
        img = batch["image_row"]
        ph = self.model.config.media_placeholder_token_id
        self._counts = {
            "text_tokens": int((~img).sum()) * batch["input_ids"].shape[1],
            "image_rows": int(img.sum()),
            "image_tokens": int((batch["input_ids"][img] == ph).sum()),
            "images": sum(len(p) for p in batch["pixel_values"]),
            "image_targets": int((batch["labels"][img][:, 1:] != -100).sum()),
            "text_targets": int((batch["labels"][~img][:, 1:] != -100).sum()),
        }
        return batch

    def _micro_batch(self, host: dict) -> tuple[BatchInfo, dict, float]:
        dev = self.device
        info = BatchInfo.from_segment_ids(host["segment_ids"]).to(dev)
        tensors = {k: to_device_async(host[k], dev) for k in ("input_ids", "labels")}
        tensors["pixel_values"] = [to_device_async(p, dev) for row in host["pixel_values"] for p in row]
        idx = torch.nonzero(host["image_row"]).flatten()
        tensors["image_rows"] = to_device_async(idx, dev)
        tensors["n_image_rows"] = int(idx.numel())
        return info, tensors, 1.0

    def train_step(self) -> ImageStepMetrics:
        t0 = time.perf_counter()
        m = super().train_step()
        dt = max(time.perf_counter() - t0, 1e-9)
        m.text_tokens_per_s = m.text_tokens / dt
        m.image_tokens_per_s = m.image_tokens / dt
        m.images_per_s = m.images / dt
        return m

    def _finish_step(self, metrics: StepMetrics, extras: list[dict]) -> ImageStepMetrics:
        c = self._counts
        m = ImageStepMetrics(**asdict(metrics), **{k: v for k, v in c.items() if k != "text_targets"})
        parts = [(e["image_loss_sum"], e["image_targets"]) for e in extras if e]
        if parts:
            vals = torch.stack([torch.stack(p) for p in parts]).sum(0).cpu()
            img_sum, img_n = float(vals[0]), float(vals[1])
            m.image_loss = img_sum / img_n if img_n else None
            total = c["text_targets"] + c["image_targets"]
            if c["text_targets"]:
                m.text_loss = (metrics.loss * total - img_sum) / c["text_targets"]
        elif c["text_targets"]:
            m.text_loss = metrics.loss
        return m

    def evaluate(self) -> float | None:
        val = super().evaluate()
        if self.image_eval:
            v = evaluate_image_batches(self.model, self.image_eval, self.device, self.cfg.autocast_bf16)
            self._eval_extra = {"image_val_loss": v}
            if self.step == 0 or self.done():
                self.log(f"image held-out loss at step {self.step}: {v:.4f}")
        return val


@torch.no_grad()
def evaluate_image_batches(model, batches: list[dict], device, autocast_bf16: bool = False) -> float:
    """Mean next-token loss over the trained tokens (the assistant's text) of packed image rows, images encoded."""
    model.eval()
    total, count = 0.0, 0
    dev = torch.device(device)
    for b in batches:
        info = BatchInfo.from_segment_ids(b["segment_ids"]).to(dev)
        pixels = [p.to(dev) for row in b["pixel_values"] for p in row]
        labels = b["labels"].to(dev)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            out = model(b["input_ids"].to(dev), labels=labels, batch=info, return_logits=False,
                        pixel_values=pixels or None)
        n = int((b["labels"][:, 1:] != -100).sum())
        if n:
            total += float(out.loss) * n
            count += n
    if count == 0:
        raise ValueError("the held-out image rows have no trained token")
    return total / count


def image_trainer(opts, tcfg, model, text_loader, tok, eval_stream, tok_json: bytes, log=print) -> ImageTextTrainer:
    """The trainer of a run with images (k3.train.run.build_run): the image stream of --images beside the text
    loader, the held-out image rows, the image settings written into every checkpoint."""
    from k3.data.image_batches import ImageRecordFile, ImageRowStream, ImageTextLoader, heldout_image_batches

    t0 = time.perf_counter()
    vc = VisionConfig.from_dict(model.config.vision_config)
    pid = model.config.media_placeholder_token_id
    images = os.path.abspath(opts.images)
    train = ImageRecordFile(images)
    stream = ImageRowStream(train, tok, pid, vc, tcfg.seq_len, seed=tcfg.seed, max_image_tokens=opts.max_image_tokens)
    loader = ImageTextLoader(text_loader, stream, tcfg.rows_per_step, opts.image_share)
    heldout = opts.images_heldout or default_heldout(images)
    image_eval = None
    if heldout:
        heldout = os.path.abspath(heldout)
        image_eval = heldout_image_batches(ImageRecordFile(heldout), tok, pid, vc, tcfg.seq_len,
                                           rows=max(1, min(tcfg.rows_per_step, 16)), max_rows=IMAGE_EVAL_ROWS,
                                           max_image_tokens=opts.max_image_tokens)
    settings = {"images": images, "images_heldout": heldout, "image_share": opts.image_share,
                "max_image_tokens": opts.max_image_tokens, "placeholder": PLACEHOLDER_TEXT, "placeholder_id": pid}
    n_vis = sum(p.numel() for p in model.vision.parameters())
    per_step = opts.image_share * tcfg.rows_per_step
    held_rows = sum(b["input_ids"].shape[0] for b in image_eval) if image_eval else 0
    held = f"{held_rows} held-out rows from {heldout}" if image_eval else "no held-out file"
    log(f"images: {len(train):,} records in {images}, {held} ({time.perf_counter() - t0:.1f}s); "
        f"{opts.image_share:.0%} of each step's rows ({per_step:g} of {tcfg.rows_per_step}) are image rows; "
        f"vision encoder {n_vis / 1e6:.2f}M parameters ({vc.vt_num_hidden_layers} layers, width "
        f"{vc.vt_hidden_size}), placeholder id {pid}")
    return ImageTextTrainer(model, tcfg, loader, image_eval=image_eval, eval_stream=eval_stream, eos_id=tok.eos_id,
                            tokenizer_json=tok_json, log=log,
                            extra_files={IMAGE_SETTINGS: (json.dumps(settings, indent=1) + "\n").encode("utf-8")})


__all__ = ["DEFAULT_IMAGE_SHARE", "IMAGE_SETTINGS", "ImageStepMetrics", "ImageTextLoss", "ImageTextTrainer",
           "K3_MINI_VISION", "add_image_placeholder", "check_image_options", "image_model_config",
           "image_placeholder_id", "image_trainer", "vision_config_for"]
