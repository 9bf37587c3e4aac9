"""MXFP4 quantization-aware training, MXFP4 export and the post-training quantization baseline (report §4.1.4).

`apply_qat(model, "mxfp4")` wraps the routed experts of a finished model from outside (k3.model.mx_experts): in
every forward their weights are fake-quantized to MXFP4 and their GEMM inputs to MXFP8 with the exact encoders of
k3.ops.mx, and the gradients pass straight through to the high-precision master weights; attention, the latent
projections, the shared experts and the router are untouched. The trainer's checkpoints keep the master weights
(bit-exact resume); `save_mxfp4` writes the deployment checkpoint: the routed experts as `weight_packed` /
`weight_scale` (checkpoint-layout.md §2.7), the rest as trained, and a `quantization_config` whose expert
`input_activations` say MXFP8, so that `k3.from_pretrained` (and `k3 serve`) computes the experts exactly as the
QAT training forward did.

`quantize_checkpoint` is post-training quantization: the same export of a model trained without QAT.
"""

from __future__ import annotations

import os

import torch

from k3.checkpoint import from_pretrained, load_config, save_pretrained
from k3.config import mxfp4_quantization_config
from k3.model.mx_experts import quantize_experts

QAT_FORMATS = ("mxfp4",)
CARRIED_FILES = ("tokenizer.json", "chat_template.json")  # what a checkpoint holds besides weights and config


def check_qat_format(fmt: str | None) -> None:
    if fmt is not None and fmt not in QAT_FORMATS:
        raise ValueError(f"qat={fmt!r} is invalid: use one of {', '.join(QAT_FORMATS)} (or none)")


def apply_qat(model: torch.nn.Module, fmt: str = "mxfp4") -> torch.nn.Module:
    """Train `model`'s routed experts in `fmt` from now on: MXFP4 weights, MXFP8 expert inputs, straight-through
    gradients (k3.model.mx_experts). Apply before the optimizer is built and before any parallelization."""
    check_qat_format(fmt)
    return quantize_experts(model, weights="mxfp4", activations="mxfp8")


def save_mxfp4(model: torch.nn.Module, path: str, activations: str | None = "mxfp8", dtype: torch.dtype | None = None,
               extra_files: dict[str, bytes] | None = None) -> str:
    """Write `model` as an MXFP4 checkpoint: routed experts `weight_packed` / `weight_scale` encoded from the
    weights as they are (never from a cast copy), every other tensor as stored (in `dtype` when given), and the
    `quantization_config` with the expert `input_activations` in `activations` ("mxfp8" or None)."""
    cfg = model.config
    model.config = cfg.replace(quantization_config=mxfp4_quantization_config(activations))
    try:
        save_pretrained(model, path, dtype=dtype, extra_files=extra_files)
    finally:
        model.config = cfg
    return path


def carried_files(ckpt_dir: str) -> dict[str, bytes]:
    """The tokenizer and chat template of a checkpoint, to be written beside an export of it."""
    out = {}
    for name in CARRIED_FILES:
        p = os.path.join(ckpt_dir, name)
        if os.path.isfile(p):
            with open(p, "rb") as f:
                out[name] = f.read()
    return out


def quantize_checkpoint(src: str, dst: str, fmt: str = "mxfp4", activations: str | None = "mxfp8",
                        dtype: torch.dtype | None = None, verify: bool = True) -> str:
    """Post-training quantization: the checkpoint at `src` written to `dst` in `fmt` (see `save_mxfp4`), its
    tokenizer and chat template beside it. Non-expert tensors keep the source's dtype unless `dtype` is given."""
    if fmt != "mxfp4":
        raise ValueError(f"format={fmt!r} is invalid: use mxfp4")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise ValueError(f"--out {dst} is the source checkpoint; write the quantized one elsewhere")
    stored = load_config(src).torch_dtype
    model = from_pretrained(src, dtype=torch.float32, verify=verify)
    quantize_experts(model, None, None)  # the export encodes the weights; nothing runs here
    return save_mxfp4(model, dst, activations, dtype=dtype or stored, extra_files=carried_files(src))


def export_checkpoint(ckpt_dir: str, out: str, log=print) -> str:
    """`export_run` from a run's saved checkpoint (its fp32 weights; a distributed run's gathered one): the
    deployment checkpoint `OUT/mxfp4`, the tokenizer and chat template beside it; returns the path."""
    path = quantize_checkpoint(ckpt_dir, os.path.join(out, "mxfp4"))
    log(f"MXFP4 export (routed experts weight_packed/weight_scale, MXFP8 expert inputs): {path}")
    return path


def export_run(trainer, log=print) -> str:
    """The deployment checkpoint of a QAT run, written to `OUT/mxfp4` (its tokenizer and chat template beside
    it), from the trainer's model as it stands; returns the path."""
    path = os.path.join(trainer.cfg.out, "mxfp4")
    extra = dict(trainer.extra_files)
    if trainer.tokenizer_json is not None:
        extra["tokenizer.json"] = trainer.tokenizer_json
    save_mxfp4(trainer.model, path, extra_files=extra)
    log(f"MXFP4 export (routed experts weight_packed/weight_scale, MXFP8 expert inputs): {path}")
    return path
