"""`k3 sft`: supervised fine-tuning of a checkpoint on chat data (report §4.1.1), optionally with MXFP4 QAT (§4.1.4).

The same Trainer as `k3 train` (Per-Head Muon, QK-Clip, Quantile Balancing, metrics.jsonl, loss.png, atomic
checkpoints, bit-exact resume); only the data differ: packed conversations whose labels are the assistant's
tokens (k3.posttrain.chat_data), rendered with the checkpoint's chat template, and a held-out loss over the
replies of held-out conversations. The run's checkpoints hold the fp32 master weights (with the tokenizer and the
chat template, so `k3 serve` of one of them talks the same template); a QAT run also writes its MXFP4 deployment
checkpoint to `OUT/mxfp4` at the end (k3.train.qat).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.devices import pick_device
from k3.run_dir import clean_interrupted, holding_run_dir, latest_checkpoint
from k3.train.trainer import Trainer, TrainConfig

# Fine-tuning defaults: rows long enough for a conversation, a lower peak rate than pre-training.
CPU_DEFAULTS = dict(seq_len=512, batch_tokens=8192, micro_batch_rows=None, lr=1e-3)
GPU_DEFAULTS = dict(seq_len=4096, batch_tokens=65536, micro_batch_rows=None, lr=3e-4)


@dataclass
class SFTOptions:
    ckpt: str | None = None  # the base checkpoint (a fresh run; a resumed one continues from its own)
    data: list[str] = field(default_factory=list)  # chat .jsonl files
    heldout: list[str] = field(default_factory=list)  # held-out chat .jsonl files (the held-out loss)
    resume: bool = False
    device: str = "auto"
    backends: Any = None
    verify: bool = True
    skip_bad_records: bool = False  # skip (and count) bad records instead of stopping at the first


def load_chat_data(paths: list[str], tok, template, seq_len: int, skip_bad: bool, what: str, log=print):
    """Read, render, tokenize and pack chat .jsonl files (k3.posttrain.chat_data), logging what went in."""
    from k3.posttrain.chat_data import pack_conversations, read_chat_jsonl, tokenize_conversations

    convs, options, bad = [], [], []
    for p in paths:
        recs, b = read_chat_jsonl(p, skip_bad=skip_bad)
        convs.extend(r.messages for r in recs)
        options.extend(r.options for r in recs)
        bad.extend(b)
    packed = pack_conversations(tokenize_conversations(tok, convs, template, options), seq_len, tok.eos_id)
    st = packed.stats
    st["bad_records"] = len(bad)
    log(f"{what}: {st['conversations']} conversations -> {st['rows']} rows of {seq_len} tokens "
        f"({st['trained_tokens']:,} reply tokens of {st['tokens']:,}); {st['truncated']} cut to the row length, "
        f"{st['dropped_no_reply']} dropped (no reply token left), {len(bad)} bad records skipped")
    for msg in bad[:5]:
        log(f"  skipped {msg}")
    if len(bad) > 5:
        log(f"  ... and {len(bad) - 5} more")
    return packed


def prepare_run_dir(tcfg: TrainConfig, device: str, resume: bool, log=print):
    """What every post-training run does first: pick the device (bf16 autocast on CUDA), create the run directory and
    clean an interrupted save, and check --resume against what is there. Returns (device, the checkpoint to resume
    from or None)."""
    dev = pick_device(device)
    tcfg.device = str(dev)
    if dev.type == "cuda":
        tcfg.autocast_bf16 = True
    out = tcfg.out
    os.makedirs(out, exist_ok=True)
    with holding_run_dir(out):
        clean_interrupted(os.path.join(out, "checkpoints"), log=log)
    resume_from = latest_checkpoint(out) if resume else None
    if resume and resume_from is None:
        raise ValueError(f"--resume: no checkpoint found in {out}/checkpoints")
    if not resume and latest_checkpoint(out) is not None:
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    return dev, resume_from


def load_fp32_base(src: str, device, backends, verify: bool, what: str = "", qat: str | None = None):
    """(model, tokenizer, chat template) of the checkpoint a post-training run starts from: fp32 master weights with
    plain experts and no quantization_config, so that the run's checkpoints keep them exactly (a release's MXFP4
    weights decode exactly; QAT re-wraps the experts, the export writes MXFP4 again). `what` prefixes messages
    (e.g. "--student "). `qat` ("mxfp4"): wrap the experts for quantization-aware training (training forwards and
    the rollouts of an on-policy run alike: its engine runs this very module)."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.model.mx_experts import quantize_experts
    from k3.serve.chat import load_chat_template

    if not os.path.isdir(src) or not os.path.isfile(os.path.join(src, "config.json")):
        raise ValueError(f"{what}{src}: no checkpoint there (a directory with config.json and safetensors)")
    model = from_pretrained(src, dtype=torch.float32, device=device, backends=backends, verify=verify)
    quantize_experts(model, None, None)
    model.config = model.config.replace(quantization_config=None)
    try:
        tok = load_any_tokenizer(src)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{what}{src} has no usable tokenizer.json ({e})") from None
    if qat is not None:
        from k3.train.qat import apply_qat

        apply_qat(model, qat)
    return model, tok, load_chat_template(src)


def build_sft_run(opts: SFTOptions, tcfg: TrainConfig, log=print) -> Trainer:
    from k3.posttrain.chat_data import ChatLoader
    from k3.serve.chat import chat_template_json
    from k3.train.run import _tokenizer_json_bytes

    tcfg.validate()
    if not opts.data:
        raise ValueError("--data: give at least one chat .jsonl file")
    device, resume_from = prepare_run_dir(tcfg, opts.device, opts.resume, log)
    src = resume_from or opts.ckpt
    if src is None:
        raise ValueError("--ckpt: give the checkpoint to fine-tune")
    model, tok, template = load_fp32_base(src, device, opts.backends, opts.verify, what="--ckpt ", qat=tcfg.qat)

    train = load_chat_data(opts.data, tok, template, tcfg.seq_len, opts.skip_bad_records, "training data", log)
    if train.num_rows == 0:
        raise ValueError(f"--data {' '.join(opts.data)} holds no conversation with a reply token")
    heldout = None
    if opts.heldout:
        held = load_chat_data(opts.heldout, tok, template, tcfg.seq_len, opts.skip_bad_records, "held-out data", log)
        if held.num_rows:
            heldout = held.eval_batches(max(1, min(tcfg.rows_per_step, 16)))[: tcfg.eval_batches]
    torch.manual_seed(tcfg.seed)
    loader = ChatLoader(train, tcfg.rows_per_step, seed=tcfg.seed)
    trainer = Trainer(model, tcfg, loader, eval_stream=heldout, eos_id=tok.eos_id,
                      tokenizer_json=_tokenizer_json_bytes(tok), log=log,
                      extra_files={"chat_template.json": chat_template_json(template).encode("utf-8")})
    if resume_from is not None:
        trainer.load(resume_from, verify=opts.verify)
        log(f"resumed from {resume_from} at step {trainer.step}")
    cfg = model.config
    n = sum(p.numel() for p in model.parameters())
    log(f"model: {src}: {n / 1e6:.2f}M parameters ({cfg.num_hidden_layers} layers, {cfg.num_experts} experts "
        f"top-{cfg.num_experts_per_token}) on {device}"
        f"{f', QAT {tcfg.qat} (routed experts: MXFP4 weights, MXFP8 inputs)' if tcfg.qat else ''}")
    return trainer


def run_sft(opts: SFTOptions, tcfg: TrainConfig, progress_bar: bool = True, log=print) -> dict:
    tcfg.validate()
    with holding_run_dir(tcfg.out):  # one process per run directory, from before the data work on
        trainer = build_sft_run(opts, tcfg, log)
        summary = trainer.fit(progress_bar=progress_bar)
        if tcfg.qat is not None:
            from k3.train.qat import export_run

            summary["export"] = export_run(trainer, log)
    first, last = summary.get("first_val_loss"), summary.get("last_val_loss")
    msg = f"stopped at step {summary['step']}" if summary.get("interrupted") else f"finished at step {summary['step']}"
    if first is not None and last is not None:
        msg += f": held-out reply loss {first:.3f} -> {last:.3f}"
    log(f"{msg}; checkpoint {summary['checkpoint']}")
    return summary
