"""`k3 train`: wire corpus, tokenizer, model and trainer together, start fresh or resume."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from k3.config import K3Config
from k3.devices import pick_device
from k3.model.model import K3ForCausalLM
from k3.ops.registry import Backends
from k3.run_dir import (clean_interrupted, complete_checkpoints, holding_run_dir, latest_checkpoint,
                        resume_checkpoint, step_of, truncated_files)
from k3.train.trainer import Trainer, TrainConfig


@dataclass
class RunOptions:
    preset: str | None = None
    config: str | None = None
    data: list[str] = field(default_factory=list)
    vocab_size: int | None = None
    resume: bool = False
    device: str = "auto"
    max_corpus_mb: float | None = None
    backends: Backends | None = None  # which implementations run the ops (None: Backends(), `auto`)
    verify: bool = True  # on --resume, check the checkpoint's shards against their recorded SHA-256
    # A distributed run's DeviceMesh (k3.parallel.mesh; the process group is initialized): the model is sharded
    # over it and every rank trains on its slice of each batch (k3.train.distributed). None: one process.
    mesh: Any = None
    moon_ep: bool = False  # MoonEP's balanced expert parallelism (with an "ep" mesh dimension of 2 or more)
    workers: int | None = None  # tokenizing processes (None: one per CPU, k3.data.shards.default_workers)
    data_cache: str | None = None  # where token shards are kept (None: OUT/data); reused across runs
    # Image-text records trained with the text (k3.train.image_training; None: a text-only run), their held-out
    # file (None: heldout.jsonl beside them, if any), the share of each step's rows they fill, the tokens per image.
    images: str | None = None
    images_heldout: str | None = None
    image_share: float | None = None
    max_image_tokens: int | None = None


# Defaults that make plain `k3 train` learn something on the machine at hand. The whole batch goes through
# one forward unless --micro-batch-rows says otherwise; on running out of GPU memory the trainer halves the
# micro-batch and retries the step.
# eval_batches: a CPU evaluates 16 batches of 16 x 256 tokens (65,536 tokens of the held-out set) instead of the
# whole set (64 batches): the evaluation before the first step took 4.5 minutes on a busy 2-core machine
CPU_DEFAULTS = dict(preset="tiny", seq_len=256, batch_tokens=8192, micro_batch_rows=None, lr=3e-3, vocab_size=4096,
                    eval_every=50, eval_batches=16)
# eval_every: an evaluation reads the whole held-out set of the default corpus (2.2M tokens on a GPU machine): ~10 s
# on an H200 against 0.43 s per k3-mini step, so every 50 steps it took a third of the run's wall time; every 200,
# about a tenth
GPU_DEFAULTS = dict(preset="k3-mini", seq_len=4096, batch_tokens=32768, micro_batch_rows=None, lr=2e-3,
                    vocab_size=32768, eval_every=200)


def load_corpus(data: list[str], max_corpus_mb: float | None, log=print):
    """(train, heldout) documents in memory, split as training splits them (`k3 eval`; training streams
    them into token shards instead, `prepare_data`): --data by content hash, duplicates dropped
    (k3.data.sources.assign); the default corpus by name (k3.data.corpus.default_corpus)."""
    from k3.data.corpus import default_corpus, load_documents
    from k3.data.sources import HELDOUT, TRAIN, assign, content_hash

    if data:
        docs = [d for d in load_documents(data) if d.text]
        if not docs:
            raise ValueError(f"--data {' '.join(data)} holds no documents")
        dest = assign([content_hash(d.text.encode("utf-8", "surrogatepass")) for d in docs], [0] * len(docs))
        train = [d for d, w in zip(docs, dest) if w == TRAIN]
        heldout = [d for d, w in zip(docs, dest) if w == HELDOUT]
        src = ", ".join(data)
    else:
        max_bytes = int(max_corpus_mb * 2**20) if max_corpus_mb else None
        train, heldout = default_corpus(max_bytes=max_bytes)
        src = "the Python standard library's source files"
    mb = sum(len(d.text) for d in train) / 2**20
    log(f"corpus: {src}: {len(train)} training documents ({mb:.1f} MB), {len(heldout)} held out")
    return train, heldout


def corpus_units(data: list[str], max_corpus_mb: float | None, full_default: bool):
    """(units, description) of the training text: --data's files, directories and globs, or the default corpus
    (`full_default`: every Python source and documentation file of this installation, as on a GPU)."""
    from k3.data.corpus import default_units
    from k3.data.sources import data_units

    if data:
        return data_units(data), ", ".join(data)
    max_bytes = int(max_corpus_mb * 2**20) if max_corpus_mb else None
    units = default_units(full=full_default, max_bytes=max_bytes)
    what = ("every Python source and documentation file of this installation (standard library and "
            "site-packages)" if full_default else "the Python standard library's source files")
    return units, what


def _train_texts(units):
    """The training documents' texts in order (what the tokenizer is trained on; it reads only a prefix)."""
    from k3.data.sources import DEFAULT_HELDOUT_FRACTION, HELDOUT, SPLIT, content_hash, iter_documents

    cut = DEFAULT_HELDOUT_FRACTION * 2.0**64
    for d, role in iter_documents(units):
        if role == HELDOUT or not d.text:
            continue
        if role == SPLIT and content_hash(d.text.encode("utf-8", "surrogatepass")) < cut:
            continue
        yield d.text


def prepare_data(opts: RunOptions, out: str, gpu: bool, resume_from: str | None, log=print,
                 progress: bool = False):
    """(tokenizer, token set) of the run: the tokenizer cached in `out` (or the checkpoint's, on resume), the
    documents tokenized into memory-mapped shards under --data-cache (default OUT/data), reused while the
    sources and the tokenizer are unchanged (k3.data.shards). `gpu`: the GPU defaults (the whole installation as
    the default corpus, the larger vocabulary)."""
    from k3.data.shards import build_token_set, source_fingerprint
    from k3.data.sources import DEFAULT_HELDOUT_FRACTION
    from k3.data.tokenizer import cached_tokenizer, load_any_tokenizer, num_merges

    t0 = time.perf_counter()
    units, what = corpus_units(opts.data, opts.max_corpus_mb, full_default=gpu)
    if not units:
        raise ValueError(f"--data {' '.join(opts.data)} holds no documents" if opts.data
                         else "the default corpus is empty")
    mb = sum(u.nbytes for u in units) / 2**20
    log(f"corpus: {what}: {len(units):,} files or pieces, {mb:,.1f} MB ({time.perf_counter() - t0:.1f}s)")
    if resume_from is not None:
        tok = load_any_tokenizer(resume_from)
    else:
        t0 = time.perf_counter()
        vocab = opts.vocab_size or (GPU_DEFAULTS if gpu else CPU_DEFAULTS)["vocab_size"]
        trained = []
        tok = cached_tokenizer(out, lambda: trained.append(1) or _train_texts(units), vocab - bool(opts.images),
                               data_fingerprint=source_fingerprint(units, DEFAULT_HELDOUT_FRACTION), log=log)
        if opts.images:  # the image placeholder is the vocabulary's last id
            from k3.train.image_training import add_image_placeholder

            tok = add_image_placeholder(tok)
        how = (f"trained in {time.perf_counter() - t0:.1f}s" if trained else
               f"reused {os.path.join(out, 'tokenizer.json')}, trained on this data")
        log(f"tokenizer: byte-level BPE, {tok.vocab_size} tokens, {num_merges(tok):,} merges ({how})")
    t0 = time.perf_counter()
    cache = opts.data_cache or os.path.join(out, "data")
    ts = build_token_set(tok, units, cache, workers=opts.workers, progress=progress)
    ix = ts.index
    how = ("reused" if ts.reused else
           f"tokenized by {ix['workers']} worker{'s' if ix['workers'] > 1 else ''} in {time.perf_counter() - t0:.1f}s")
    n = ix["duplicates"]
    dropped = f"; {n:,} duplicate document{'' if n == 1 else 's'} dropped" if n else ""
    log(f"tokens: {ix['train']['tokens']:,} train ({ix['train']['documents']:,} documents), "
        f"{ix['heldout']['tokens']:,} held out ({ix['heldout']['documents']:,}) in {ts.directory} ({how}){dropped}")
    if opts.data and not ix["train"]["documents"]:
        raise ValueError(f"--data {' '.join(opts.data)} holds no training documents")
    return tok, ts


def build_run(opts: RunOptions, tcfg: TrainConfig, log=print, progress: bool = False) -> Trainer:
    from k3.data.packing import PackedLoader

    tcfg.validate()  # before any slow work (corpus, tokenizer)
    device = pick_device(opts.device)
    tcfg.device = str(device)
    if device.type == "cuda":
        tcfg.autocast_bf16 = True
    out = tcfg.out
    os.makedirs(out, exist_ok=True)
    mesh = opts.mesh
    rank = 0 if mesh is None else torch.distributed.get_rank()
    if rank == 0:
        with holding_run_dir(out):  # before looking for the latest: a swap cut short is undone here
            clean_interrupted(os.path.join(out, "checkpoints"), log=log)
    if mesh is not None:
        torch.distributed.barrier()  # every rank looks for the latest checkpoint after rank 0's clean-up
    resume_from, skipped = resume_checkpoint(out) if opts.resume else (None, [])
    if opts.resume and resume_from is None:
        raise ValueError(f"--resume: no checkpoint found in {out}/checkpoints"
                         + "".join(f"; {p} is {why}" for p, why in skipped))
    if skipped and resume_from is not None:
        log(f"--resume: skipping {'; '.join(f'{p} ({why})' for p, why in skipped)}; continuing from {resume_from} "
            f"(step {step_of(os.path.basename(resume_from))}): the steps after it are trained again")
    if not opts.resume and latest_checkpoint(out) is not None:
        raise ValueError(f"{out} already holds a run; pass --resume to continue it or choose another --out")
    if opts.images or resume_from is not None:
        from k3.train.image_training import check_image_options

        check_image_options(opts, tcfg, resume_from, mesh, log)  # a resumed run's image settings are its own

    if resume_from is not None:
        from k3.checkpoint import load_config

        cfg = load_config(resume_from)  # the trainer state itself is read by Trainer.load
    elif opts.config:
        cfg = K3Config.load(opts.config)
    else:
        cfg = K3Config.from_preset(opts.preset or (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)["preset"])

    # Under torchrun rank 0 trains the tokenizer and tokenizes first (writing the caches in the run directory);
    # the other ranks then read the same caches.
    if rank > 0:
        torch.distributed.barrier()
    tok, tokens = prepare_data(opts, out, device.type == "cuda", resume_from, log, progress=progress and rank == 0)
    long_tokens = None
    if tcfg.context_schedule is not None:
        if mesh is not None:
            from k3.parallel.mesh import data_rank
            from k3.train.context_schedule import check_context_schedule

            check_context_schedule(tcfg.context_schedule, tcfg.batch_tokens, cp=mesh["cp"].size(),
                                   data_ranks=data_rank(mesh)[1])
        if not opts.data and len(tcfg.context_schedule) > 1 and tcfg.long_doc_share > 0:
            long_tokens = long_doc_tokens(tok, opts.data_cache or os.path.join(out, "data"),
                                          tcfg.context_schedule, log)
    if resume_from is None:
        cfg = cfg.replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id,
                          bos_token_id=None)
    if opts.images:
        from k3.train.image_training import image_model_config

        cfg = image_model_config(cfg, tok, opts, resumed=resume_from is not None)
    if cfg.vocab_size < tok.vocab_size:
        raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is {cfg.vocab_size}")
    if mesh is not None and rank == 0:
        torch.distributed.barrier()
    if len(tokens.train) < tcfg.batch_tokens:
        raise ValueError(f"the training data has {len(tokens.train):,} tokens, fewer than one batch "
                         f"(--batch-tokens {tcfg.batch_tokens}); add data or lower --batch-tokens")
    eval_stream = tokens.heldout.as_array()

    torch.manual_seed(tcfg.seed)
    model = K3ForCausalLM(cfg, backends=opts.backends).init_weights(seed=tcfg.seed).to(device)
    if tcfg.qat is not None:  # before parallelizing: FSDP2 gathers MXExperts' weights, EP slices them
        from k3.train.qat import apply_qat

        apply_qat(model, tcfg.qat)
    if tcfg.context_schedule is None:
        loader = PackedLoader(tokens.train, tcfg.seq_len, tcfg.rows_per_step, tok.eos_id, seed=tcfg.seed,
                              data=tokens.fingerprint)
    else:
        loader = staged_loader(tcfg, tokens.train, tokens.fingerprint, tok.eos_id, long_tokens)
    tok_json = _tokenizer_json_bytes(tok)
    n = sum(p.numel() for p in model.parameters())
    if opts.images:
        from k3.train.image_training import image_trainer

        trainer = image_trainer(opts, tcfg, model, loader, tok, eval_stream, tok_json, log)
    elif mesh is None:
        trainer = Trainer(model, tcfg, loader, eval_stream=eval_stream, eos_id=tok.eos_id, tokenizer_json=tok_json,
                          log=log)
    else:
        from k3.parallel.parallelize import ParallelizeOptions, default_param_dtype, parallelize
        from k3.train.distributed import DistributedTrainer

        # On CUDA FSDP2's policy gathers the bf16 units' parameters in bf16; the Kimi Delta Attention units stay fp32
        # (their decay and conv parameters must), so autocast stays on for their projections' matmuls, as on one
        # device. The single-device trainer's once-per-step weight casts are not used (DistributedTrainer).
        parallelize(model, mesh, ParallelizeOptions(param_dtype=default_param_dtype(device), moon_ep=opts.moon_ep))
        trainer = DistributedTrainer(model, tcfg, loader, mesh, eval_stream=eval_stream, eos_id=tok.eos_id,
                                     tokenizer_json=tok_json, log=log)
    if resume_from is not None:
        _load_resumed(trainer, resume_from, opts.verify)
        log(f"resumed from {resume_from} at step {trainer.step}")
    log(f"model: {n / 1e6:.2f}M parameters ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts top-{cfg.num_experts_per_token}) on {device}"
        f"{', activation checkpointing' if tcfg.activation_checkpointing else ''}"
        f"{f', QAT {tcfg.qat} (routed experts: MXFP4 weights, MXFP8 inputs)' if tcfg.qat else ''}"
        f"{'' if mesh is None else f', sharded over {mesh.size()} ranks (mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))})'}")
    return trainer


def context_flags(tcfg: TrainConfig, args, log=print) -> None:
    """Put `k3 train`'s context-extension flags (--context-schedule, --activation-checkpointing-from,
    --long-doc-share) into `tcfg`: on --resume the run's own settings unless a flag is given; a resumed run keeps
    its schedule (another one is refused). A fresh run's --seq-len is the schedule's first length."""
    from k3.cli_args import _saved_train_config

    names = ("context_schedule", "activation_checkpointing_from", "long_doc_share")
    given = {k: getattr(args, k, None) for k in names}
    ck = resume_checkpoint(tcfg.out)[0] if args.resume else None
    saved = _saved_train_config(ck) if ck is not None else {}
    for k in names:
        v = given[k] if given[k] is not None else saved.get(k)
        if v is not None:
            setattr(tcfg, k, v)
    if ck is not None:
        had = saved.get("context_schedule")
        if given["context_schedule"] is not None and had != given["context_schedule"]:
            raise ValueError(f"--resume: the run in {tcfg.out} was trained with "
                             f"{'--context-schedule ' + _schedule_text(had) if had else 'no --context-schedule'}; "
                             "it continues with its own (give the same --context-schedule, or none)")
    elif tcfg.context_schedule is not None:
        first = tcfg.context_schedule[0][0]
        if getattr(args, "seq_len", None) not in (None, first):
            raise ValueError(f"--seq-len {args.seq_len} with --context-schedule {_schedule_text(tcfg.context_schedule)}:"
                             f" the run's length is the schedule's first ({first}); leave --seq-len out")
        tcfg.seq_len = first


def _schedule_text(stages) -> str:
    return ",".join(f"{n}:{share:g}" for n, share in stages)


def long_doc_tokens(tok, cache_dir: str, stages, log=print, root: str | None = None):
    """(token stream, fingerprint) of the standard library's training package documents (k3.data.long_docs) of
    at least 3 characters per token of the schedule's second length (about one row of it: code runs 3-4 characters
    a token), tokenized once into `cache_dir`/long_docs.npy (reused while the documents and the tokenizer are
    the same)."""
    import hashlib

    from k3.data.long_docs import long_documents
    from k3.data.packing import tokenize_documents

    t0 = time.perf_counter()
    min_chars = 3 * stages[1][0]
    docs = long_documents(heldout=False, min_chars=min_chars, root=root)
    longest = stages[-1][0]
    if not docs:
        raise ValueError(f"--context-schedule: no standard-library package has {min_chars:,} characters or more to "
                         "read as long documents; use --long-doc-share 0 or shorter stages")
    os.makedirs(cache_dir, exist_ok=True)
    stream = tokenize_documents(tok, docs, os.path.join(cache_dir, "long_docs.npy"))
    if len(stream) < longest:
        raise ValueError(f"--context-schedule: the long documents hold {len(stream):,} tokens, fewer than one row of "
                         f"{longest:,}; use --long-doc-share 0 or shorter stages")
    mb = sum(len(d.text) for d in docs) / 2**20
    log(f"long documents: {len(docs)} standard-library packages of {min_chars:,}+ characters, modules in import "
        f"order ({mb:.1f} MB, {len(stream):,} tokens, {time.perf_counter() - t0:.1f}s)")
    return stream, "long-docs:" + hashlib.sha256(stream.tobytes()).hexdigest()[:16]


def staged_loader(tcfg: TrainConfig, train, fingerprint: str | None, eos_id: int, long_tokens=None):
    """The StagedLoader of `tcfg.context_schedule` (k3.train.context_schedule): stage k's rows of its length from
    `train` (a token store), --batch-tokens / length a step; from the second stage on, with `long_tokens` ((stream,
    fingerprint) of long documents), `tcfg.long_doc_share` of them from those."""
    from k3.data.packing import PackedLoader
    from k3.train.context_schedule import MixedLoader, StagedLoader

    stages = tcfg.context_schedule

    def make(k: int):
        length = stages[k][0]
        rows = tcfg.batch_tokens // length
        base = PackedLoader(train, length, rows, eos_id, seed=tcfg.seed, data=fingerprint)
        if k == 0 or long_tokens is None:
            return base
        long = PackedLoader(long_tokens[0], length, rows, eos_id, seed=tcfg.seed, data=long_tokens[1])
        return MixedLoader(base, long, tcfg.long_doc_share, rows)

    return StagedLoader(stages, make, make(0))


def _load_resumed(trainer, ck: str, verify: bool) -> None:
    """trainer.load(ck), a damaged checkpoint's error saying what can be done: a truncated file cannot be loaded at
    all (the digest check's "--no-verify loads it anyway" does not hold), and an older complete checkpoint of the
    run, if any, is named."""
    from k3.checkpoint import CheckpointError

    try:
        trainer.load(ck, verify=verify)
    except CheckpointError as e:
        ckdir = os.path.dirname(ck)
        older = [p for s, p in complete_checkpoints(ckdir) if s < (step_of(os.path.basename(ck)) or 0)]
        cut = truncated_files(ck)
        msg = (f"{ck} is damaged: truncated {', '.join(cut)}: a truncated file cannot be read, so it cannot be "
               "loaded" if cut else str(e))
        if older:
            msg += (f"; the older checkpoint {older[-1]} is complete: move {ck} out of {ckdir} and run --resume "
                    "again to continue from it")
        raise CheckpointError(msg) from None


def _quiet(*args, **kwargs) -> None:
    """The log of a distributed run's ranks other than 0."""


def _tokenizer_json_bytes(tok) -> bytes:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tok.save(d)
        with open(os.path.join(d, "tokenizer.json"), "rb") as f:
            return f.read()


def run_training(opts: RunOptions, tcfg: TrainConfig, progress_bar: bool = True, log=print) -> dict:
    tcfg.validate()
    # One process per run directory for the whole run (two would interleave metrics.jsonl and checkpoints),
    # taken before the corpus and tokenizer work so that a second run fails at once.
    first_rank = opts.mesh is None or torch.distributed.get_rank() == 0
    log = log if first_rank else _quiet
    t0 = time.perf_counter()
    with holding_run_dir(tcfg.out) if first_rank else contextlib.nullcontext():
        trainer = build_run(opts, tcfg, log, progress=progress_bar)
        trainer.setup_s = time.perf_counter() - t0  # for the time-to-first-step line (Trainer._log_first_step)
        summary = trainer.fit(progress_bar=progress_bar)
        if tcfg.qat is not None and first_rank:
            from k3.train.qat import export_checkpoint, export_run

            # under torchrun the live model is sharded: rank 0 encodes the gathered final checkpoint instead (the
            # same values: its fp32 weights are the model's)
            summary["export"] = (export_run(trainer, log) if opts.mesh is None
                                 else export_checkpoint(summary["checkpoint"], trainer.cfg.out, log))
    first, last = summary.get("first_val_loss"), summary.get("last_val_loss")
    msg = f"stopped at step {summary['step']}" if summary.get("interrupted") else f"finished at step {summary['step']}"
    msg += f" ({summary['epochs']:.2f} epochs of the training data)"
    if first is not None and last is not None:
        before = summary.get("first_val_step")
        msg += (f": held-out loss {first:.3f} (step {before}, before this resume) -> {last:.3f}"
                if summary.get("start_step") and before is not None else f": held-out loss {first:.3f} -> {last:.3f}")
    log(f"{msg}; checkpoint {summary['checkpoint']}" if summary["checkpoint"] else f"{msg} (no checkpoint written)")
    return summary
