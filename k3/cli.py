"""The `k3` command."""

from __future__ import annotations

import argparse
import os
import sys

from k3.cli_args import (BACKEND_HELP, TRAIN_FLAGS, VERIFY_HELP, _add_trainer_flags, _backends,  # noqa: F401
                         _device_arg, _positive_float, _positive_int, _resolve_ckpt, _saved_train_config, _train_config,
                         exit_code, run_training_command)


def _config_from_arg(spec: str):
    from k3.config import PRESETS, K3Config

    if spec in PRESETS:
        return spec, K3Config.from_preset(spec)
    if os.path.isdir(spec):
        return spec, K3Config.load(_resolve_ckpt(spec, "model"))  # a checkpoint, or a run's latest
    if os.path.exists(spec):
        return spec, K3Config.load(spec)
    raise SystemExit(f"k3: '{spec}' is neither a preset ({', '.join(PRESETS)}) nor a config file, checkpoint directory "
                     "or run directory")


def _context_schedule(text: str) -> list:
    from k3.train.context_schedule import parse_context_schedule

    try:
        return parse_context_schedule(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _share(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 <= v <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return v


_CUDA_GRAPHS = {"auto": True, "on": True, "1": True, "off": False, "0": False, "eager": "eager"}


def _cmd_serve(args) -> int:
    from k3.devices import pick_device
    from k3.serve.cli import cmd_serve

    args.backends = _backends(args.backend, pick_device(args.device))
    # EngineConfig.cuda_graphs: --no-cuda-graphs, else K3_CUDA_GRAPHS (auto, off, or eager: no capture, for debugging)
    raw = os.environ.get("K3_CUDA_GRAPHS", "auto").strip().lower()
    if raw not in _CUDA_GRAPHS:
        raise ValueError(f"K3_CUDA_GRAPHS={raw!r} is invalid: use auto, off or eager")
    args.cuda_graphs = _CUDA_GRAPHS[raw] if args.cuda_graphs else False
    if args.cuda_graphs is True and pick_device(args.device).type != "cuda":
        args.cuda_graphs = False  # nothing to capture on a CPU: no notice that graphs are not used
    if args.api_key is None:
        args.api_key = os.environ.get("K3_API_KEY")
    return cmd_serve(args)


def cmd_info(args) -> int:
    from k3.info import format_info, model_info

    name, cfg = _config_from_arg(args.model)
    print(format_info(name, cfg, model_info(cfg, context=args.context), args.context))
    return 0


def cmd_init(args) -> int:
    import torch

    from k3.checkpoint import save_pretrained
    from k3.config import K3Config
    from k3.info import model_info
    from k3.model.model import K3ForCausalLM

    cfg = K3Config.from_preset(args.preset)
    info = model_info(cfg)
    nbytes = info.total * (4 if cfg.dtype == "float32" else 2)
    if nbytes > args.max_gib * 2**30:
        raise SystemExit(f"k3 init: preset '{args.preset}' has {info.total:,} parameters ({nbytes / 2**30:,.0f} GiB); "
                         f"raise --max-gib (now {args.max_gib}) to write it anyway")
    tok = _init_tokenizer(args.tokenizer, cfg.vocab_size)
    cfg = cfg.replace(eos_token_id=tok.eos_id, pad_token_id=tok.eos_id, bos_token_id=None)
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(cfg).init_weights(seed=args.seed).set_dtype(cfg.torch_dtype)
    save_pretrained(model, args.out, extra_files={"tokenizer.json": tok.to_str().encode("utf-8")})
    from k3.serve.chat import save_chat_template

    save_chat_template(args.out)
    print(f"wrote a randomly initialized '{args.preset}' checkpoint ({info.total:,} parameters) and a "
          f"{tok.vocab_size:,}-token tokenizer ({args.tokenizer}) to {args.out}")
    return 0


def cmd_chat_template(args) -> int:
    """`k3 chat-template migrate CK`: rewrite a checkpoint's chat_template.json as the current format_version."""
    from k3.serve.chat import CHAT_TEMPLATE_FILE, migrate_chat_template

    ckpt = args.ckpt  # any directory holding a chat_template.json; else a checkpoint, or a run's latest
    if not os.path.isfile(os.path.join(ckpt, CHAT_TEMPLATE_FILE)):
        ckpt = _resolve_ckpt(ckpt, "ckpt")
    path, notes = migrate_chat_template(ckpt)
    print(f"{path}:")
    for n in notes:
        print(f"  {n}")
    return 0


INIT_BPE_TRAIN_BYTES = 2 << 20  # a few seconds of BPE training on two cores


def _init_tokenizer(kind: str, vocab_size: int):
    """The tokenizer `k3 init` writes: exactly `vocab_size` ids, every one with a text, so that everything the
    model can emit decodes. 'bpe': a byte-level BPE trained on the standard library's sources (as `k3 train`
    does); 'bytes': the 257 byte-level ids, the rest reserved special tokens. Both hold the chat markup
    (k3.data.tokenizer.CHAT_MARKUP) as special tokens, which the chat template saved beside it uses."""
    from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer, train_bpe

    if kind == "bpe":
        from k3.data.corpus import default_corpus

        try:
            train, _ = default_corpus(max_bytes=INIT_BPE_TRAIN_BYTES)
            why = "it holds no readable sources"
        except (OSError, ValueError) as e:
            train, why = [], str(e)
        if train:
            return train_bpe((d.text for d in train), vocab_size, max_train_bytes=None)
        print(f"k3 init: cannot train a BPE on the standard library ({why}); writing the byte tokenizer")
    return K3Tokenizer(byte_level_tokenizer(vocab_size))


def cmd_train(args) -> int:
    from k3.devices import pick_device
    from k3.train.run import CPU_DEFAULTS, GPU_DEFAULTS, RunOptions, context_flags, run_training

    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun sets WORLD_SIZE, RANK, LOCAL_RANK
    # One process, under torchrun or not, trains on the single-device path: FSDP2's one-rank path was seen to hand
    # a unit uninitialized parameter memory now and then (a fresh CPU run under gloo: non-finite router weights in
    # about a third of the runs), and one rank has nothing to shard.
    launched = world > 1
    from k3.parallel.mesh import ParallelDims

    dims = ParallelDims.from_flags(world, args.dp_shard, args.ep, args.cp)  # refuses sizes that do not fit
    if args.moon_ep and dims.ep < 2:
        raise SystemExit(f"k3 train: --moon-ep balances expert parallelism; it needs --ep of 2 or more (got --ep {dims.ep})")
    device = pick_device(args.device)
    if launched and device.type == "cuda":
        device = torch_device_for_rank(int(os.environ.get("LOCAL_RANK", "0")))
    backends = _backends(args.backend, device)
    tcfg = _train_config(args, GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)
    context_flags(tcfg, args)
    opts = RunOptions(preset=args.preset, config=args.config, data=args.data or [], vocab_size=args.vocab_size,
                      resume=args.resume, device=str(device), max_corpus_mb=args.max_corpus_mb, backends=backends,
                      verify=args.verify, moon_ep=args.moon_ep, workers=args.workers, data_cache=args.data_cache,
                      images=args.images, images_heldout=args.images_heldout, image_share=args.image_share,
                      max_image_tokens=args.max_image_tokens)
    if launched:
        return run_training_command("train", lambda: _train_distributed(opts, tcfg, dims, device,
                                                                      not args.no_progress))
    return run_training_command("train", lambda: run_training(opts, tcfg, progress_bar=not args.no_progress))


def torch_device_for_rank(local_rank: int):
    """This process's GPU under torchrun (one per process, by LOCAL_RANK), made the current device."""
    import torch

    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def _train_distributed(opts, tcfg, dims, device, progress_bar: bool) -> dict:
    """`k3 train` as one rank of a torchrun launch: the process group (gloo on CPU, NCCL on CUDA) from torchrun's
    environment, the ("dp", "ep", "cp") mesh passed to the run; an error names the rank; the group is destroyed
    on the way out."""
    import gc

    import torch.distributed as dist

    from k3.parallel.mesh import backend_for
    from k3.train.run import run_training
    from k3.train.trainer import TrainingError

    dist.init_process_group(backend_for(device), init_method="env://",
                            device_id=device if device.type == "cuda" else None)
    rank = dist.get_rank()
    try:
        opts.mesh = dims.build_mesh(device.type)
        return run_training(opts, tcfg, progress_bar=progress_bar)
    except (TrainingError, ValueError) as e:
        raise type(e)(f"rank {rank}: {e}") from e
    except Exception as e:
        raise RuntimeError(f"rank {rank}: {type(e).__name__}: {e}") from e
    finally:
        # the run's objects (its model's sharded state, pending collectives' work objects) go while the group still
        # exists, not at interpreter exit, where the collective library's threads may still reference them
        gc.collect()
        dist.destroy_process_group()


def _load_for_inference(ckpt: str, device: str, verify: bool = True, generate: bool = False):
    """`generate`: as the serving engine runs it (k3.serve.build.load_for_generation), else in the stored dtype.
    The tokenizer is read first: a damaged one is refused before the (possibly slow) load of the weights."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.serve.build import load_for_generation

    dev = pick_device(device)
    try:
        tok = load_any_tokenizer(ckpt)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{ckpt} has no usable tokenizer: {e}") from None
    if generate:
        model = load_for_generation(ckpt, dev, backends=_backends("auto", dev), verify=verify)
    else:
        model = from_pretrained(ckpt, device=dev, backends=_backends("auto", dev), verify=verify,
                                packed_experts="auto")  # MXFP4 experts packed where their kernels run
    return model, tok, dev


def cmd_eval(args) -> int:
    import math

    from k3.data.packing import tokenize_documents
    from k3.train.run import load_corpus
    from k3.train import long_eval
    from k3.train.evaluate import eval_extent, evaluate_loss

    given = [f"--{k.replace('_', '-')}" for k in long_eval.LONG_FLAGS if getattr(args, k) is not None
             and not (k == "out" and args.transcribe)]  # --transcribe writes into --out too
    if given and not args.long:
        raise ValueError(f"{', '.join(given)} only apply with --long")
    ckpt = _resolve_ckpt(args.ckpt)
    model, tok, dev = _load_for_inference(ckpt, args.device, verify=args.verify)
    if args.long:
        return long_eval.main(args, ckpt, model, tok, dev)
    if args.transcribe:
        from k3.train import transcribe

        return transcribe.main(args, ckpt, model, tok, dev)
    _, heldout = load_corpus(args.data or [], None, log=lambda *a: None)
    docs = heldout
    stream = tokenize_documents(tok, docs)
    loss = evaluate_loss(model, stream, args.seq_len, tok.eos_id, args.max_batches, rows=args.batch_size, device=dev)
    batches, scored = eval_extent(len(stream), args.seq_len, args.batch_size, args.max_batches)
    what = (f"the held-out split of --data {' '.join(args.data)}" if args.data
            else "the standard library's held-out files")
    part = f"{scored:,} tokens" if scored == len(stream) else f"{scored:,} of {len(stream):,} tokens ({batches} batches)"
    print(f"held-out loss {loss:.4f} nats/token, perplexity {math.exp(loss):.2f} "
          f"({part} of {what}: {len(docs)} documents)")
    return 0


def cmd_generate(args) -> int:
    """Offline generation through the serving engine (same scheduler, cache and sampler as `k3 serve`)."""
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.options import draft_dir
    from k3.serve.sampling import SamplingParams

    ckpt = _resolve_ckpt(args.ckpt)
    model, tok, dev = _load_for_inference(ckpt, args.device, verify=args.verify, generate=True)
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed)
    try:
        params.validate()
    except ValueError as e:
        raise SystemExit(f"k3 generate: {e}")
    try:
        engine = LLMEngine(model, tok, EngineConfig(cache_memory_mb=args.cache_memory_mb,
                                                    cuda_graphs=dev.type == "cuda",  # none on a CPU
                                                    speculative=args.speculative,
                                                    num_draft_tokens=args.num_draft_tokens,
                                                    speculative_auto=args.speculative_auto,
                                                    fused_replay=args.fused_replay,
                                                    verify_ahead=args.verify_ahead,
                                                    draft=draft_dir(ckpt, args.speculative, args.draft)))
    except ValueError as e:  # e.g. --speculative mtp for a model without an MTP layer, a draft of another target
        raise SystemExit(f"k3 generate: {e}")
    seq = engine.add_request(tok.encode(args.prompt), params)
    sys.stdout.write(args.prompt)
    while engine.has_work():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    del seq
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="The Kimi K3 system: model, training and serving.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="parameter counts, cache sizes and FLOPs of a preset or checkpoint")
    s.add_argument("model", help="preset name (k3, k3-mini, tiny), config.json, checkpoint directory or run directory "
                   "(its latest checkpoint)")
    s.add_argument("--context", type=_positive_int, default=4096, help="context length for the FLOP count")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("init", help="write a randomly initialized checkpoint")
    s.add_argument("--preset", required=True, choices=["k3", "k3-mini", "tiny"])
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-gib", type=float, default=64.0, help="refuse to write checkpoints larger than this")
    s.add_argument("--tokenizer", choices=["bpe", "bytes"], default="bpe",
                   help="bpe: a byte-level BPE of the model's vocabulary size trained on the Python standard "
                        "library (a few seconds); bytes: the 256 bytes, the other ids reserved tokens. Both "
                        "reserve the chat markup ([open], [sep], [close], [end_of_msg]) as special tokens")
    s.set_defaults(fn=cmd_init)

    s = sub.add_parser("chat-template", help="a checkpoint's chat template (chat_template.json)")
    s.add_argument("action", choices=["migrate"], help="migrate: rewrite a format_version 1 file as version 2, "
                   "keeping what maps and naming what it drops")
    s.add_argument("ckpt", help="checkpoint directory (or a run directory: its latest checkpoint)")
    s.set_defaults(fn=cmd_chat_template)

    s = sub.add_parser("train", help="train a model (default: tiny on the Python standard library, on CPU)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--preset", choices=["k3", "k3-mini", "tiny"], help="model preset (default: tiny on CPU, k3-mini on GPU)")
    g.add_argument("--config", help="a config.json (official layout) instead of a preset")
    s.add_argument("--data", action="append", help="training text (repeatable): .txt/.md/.py/.rst files (one document "
                   "each), .jsonl (a 'text' field per line), .parquet (a 'text' column; needs pyarrow), directories "
                   "(recursive) and quoted glob patterns ('data/**/*.jsonl'); streamed, duplicates dropped, 2%% held "
                   "out by a hash of each document's text (default: this Python's own source files)")
    s.add_argument("--out", default="runs/k3", help="run directory (checkpoints, metrics.jsonl, loss.png)")
    s.add_argument("--workers", type=_positive_int, help="processes that tokenize the data (default: one per CPU)")
    s.add_argument("--data-cache", help="directory for the token shards, reused while the data and the tokenizer "
                   "are unchanged (default: OUT/data)")
    s.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    _add_trainer_flags(s)
    s.add_argument("--vocab-size", type=_positive_int, help="BPE vocabulary size to train (default 4096 CPU, 32768 GPU)")
    s.add_argument("--max-corpus-mb", type=_positive_float, help="cap the default corpus's training text")
    s.add_argument("--dp-shard", type=_positive_int, help="data-parallel (FSDP2) ranks under torchrun "
                   "(default: the world size / (--ep x --cp))")
    s.add_argument("--ep", type=_positive_int, default=1, help="expert-parallel ranks under torchrun (default 1)")
    s.add_argument("--cp", type=_positive_int, default=1, help="context-parallel ranks under torchrun: each packed row "
                   "split along the sequence (KDA context parallelism; default 1)")
    s.add_argument("--moon-ep", action="store_true", help="with --ep > 1: MoonEP's balanced expert parallelism, every "
                   "rank computing the same number of token-expert pairs with redundant experts planned per layer "
                   "(report §5.2.1)")
    s.add_argument("--context-schedule", type=_context_schedule, metavar="LEN:SHARE,...", help="progressive context "
                   "extension (report §3.4), e.g. 8192:0.7,65536:0.2,262144:0.1: rows of each length for its share of "
                   "the run's steps (of its time with --max-minutes alone), --batch-tokens a step at every length; "
                   "the later stages of a default-corpus run also read standard-library packages as long documents; "
                   "--seq-len is the first length (k3/train/context_schedule.py; --resume keeps the run's)")
    s.add_argument("--activation-checkpointing-from", type=_positive_int, metavar="LEN", help="with "
                   "--context-schedule: activation checkpointing in the stages of this length or more (default: in "
                   "those whose forward holds more tokens than the first stage's)")
    s.add_argument("--long-doc-share", type=_share, help="with --context-schedule on the default corpus: the share "
                   "of each later stage's rows read from long documents (default 0.5)")
    g = s.add_argument_group("images (the vision encoder trained with the model; k3/train/image_training.py)")
    g.add_argument("--images", metavar="PAIRS.jsonl", help="image-text records (k3.data.images; `k3 data render-pairs` "
                   "writes them) trained together with the text: the model gets a vision encoder (tiny: "
                   "VisionConfig.tiny(), k3-mini: a ViT-Base-sized MoonViT-V2, --config: its vision_config) and the "
                   "tokenizer the image placeholder; --resume continues with the run's own")
    g.add_argument("--images-heldout", metavar="FILE", help="held-out records for the image loss (default: "
                   "heldout.jsonl beside --images, if any)")
    g.add_argument("--image-share", type=_share, help="share of each step's rows (so of its tokens) that "
                   "are packed image-text records, the rest text (default 0.2)")
    g.add_argument("--max-image-tokens", type=_positive_int, help="largest image, in encoder tokens (placeholders) "
                   "after resizing (default 1024)")
    s.set_defaults(fn=cmd_train)

    from k3.posttrain.cli import add_parsers as add_posttrain

    add_posttrain(sub)  # k3 sft, k3 quantize, k3 data

    from k3.rl.cli import add_parser as add_rl

    add_rl(sub)  # k3 rl

    from k3.posttrain.draft_cli import add_parser as add_train_draft

    add_train_draft(sub)  # k3 train-draft

    s = sub.add_parser("eval", help="held-out loss and perplexity of a checkpoint")
    s.add_argument("--ckpt", required=True, help="checkpoint directory (or a run directory: its latest checkpoint)")
    s.add_argument("--data", action="append", help="evaluation text (default: the held-out standard-library files)")
    s.add_argument("--seq-len", type=_positive_int, default=256)
    s.add_argument("--batch-size", type=_positive_int, default=8)
    s.add_argument("--max-batches", type=_positive_int, default=None)
    s.add_argument("--device", type=_device_arg, default="auto", help="auto, cpu, cuda or cuda:N")
    s.add_argument("--no-verify", dest="verify", action="store_false", help=VERIFY_HELP)
    g = s.add_argument_group("long context (--long; k3/train/long_eval.py)")
    g.add_argument("--long", action="store_true", help="passkey retrieval over a depth x length grid and the "
                   "per-position loss past the training length, instead of the held-out loss")
    g.add_argument("--lengths", help="prompt lengths in tokens, comma-separated (default: 4096, 8192, ... up to "
                   "--max-length, stopping at the first that does not fit in device memory)")
    g.add_argument("--max-length", type=_positive_int, help="longest length (default: 4096 on a CPU, 1048576 on a GPU)")
    g.add_argument("--depths", help="needle depths, fractions of the filler (default: 0,0.25,0.5,0.75,1)")
    g.add_argument("--items", type=_positive_int, help="passkey items per cell (default: 20)")
    g.add_argument("--choices", type=_positive_int, help="candidate keys per item, chance 1/K (default: 10)")
    g.add_argument("--seed", type=int, help="seed of the items (default: 0)")
    g.add_argument("--extrapolation-length", type=_positive_int, help="window length of the per-position loss "
                   "(default: the longest passkey length that fit, at most the longest document)")
    g.add_argument("--windows", type=_positive_int, help="windows of the per-position loss (default: 4)")
    g.add_argument("--train-length", type=_positive_int, help="the training length marked on the curve (default: "
                   "the checkpoint's trainer_state.json seq_len, if any)")
    g.add_argument("--batch-tokens", type=_positive_int, help="tokens per forward; rows = batch-tokens / length, at "
                   "least 1 (default: 32768)")
    g.add_argument("--out", help="directory for long_eval.json, passkey_heatmap.png and extrapolation.png "
                   "(default: long_eval)")
    g = s.add_argument_group("transcription (--transcribe; k3/train/transcribe.py)")
    g.add_argument("--transcribe", metavar="HELDOUT.jsonl", help="greedy answers to image-text records (the prompt as "
                   "each record gives it) and their character error rate against the records' text, instead of the "
                   "held-out loss (--out DIR also writes DIR/transcribe.json)")
    g.add_argument("--max-records", type=_positive_int, help="records scored (default 200)")
    g.add_argument("--max-new-tokens", type=_positive_int, help="longest answer in tokens (default 256; also at most "
                   "twice the reference's tokens, at least 16)")
    s.set_defaults(fn=cmd_eval)

    from k3.serve.options import add_serve_arguments, add_speculative_arguments

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (binds 127.0.0.1 by default)")
    add_serve_arguments(s)
    s.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto", help=BACKEND_HELP)
    s.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly instead of as CUDA-graph replays (same as K3_CUDA_GRAPHS=off)")
    s.add_argument("--compile-decode", action="store_true",
                   help="torch.compile the decode step before its CUDA-graph capture (fewer, fused kernels; a compile "
                        "per batch bucket at start-up; experimental)")
    s.add_argument("--no-verify", dest="verify", action="store_false", help=VERIFY_HELP)
    s.set_defaults(fn=_cmd_serve)

    from k3.route.cli import add_parser as add_route

    add_route(sub)  # k3 route

    s = sub.add_parser("generate", help="continue a prompt")
    s.add_argument("--ckpt", required=True, help="checkpoint directory (or a run directory: its latest checkpoint)")
    s.add_argument("prompt")
    s.add_argument("--max-new-tokens", type=_positive_int, default=128)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-p", type=float, default=0.95)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--cache-memory-mb", type=_positive_float, default=256.0, help="page pool for the decode cache")
    s.add_argument("--device", type=_device_arg, default="auto", help="auto, cpu, cuda or cuda:N")
    s.add_argument("--no-verify", dest="verify", action="store_false", help=VERIFY_HELP)
    add_speculative_arguments(s)
    s.set_defaults(fn=cmd_generate)

    from k3.kernel_reward.cli import add_parser as add_kernel_reward

    add_kernel_reward(sub)

    from k3.env.cli import add_parser as add_env

    add_env(sub)  # k3 env list, k3 env run
    return p


def _keep_logs() -> None:
    """Progress lines reach a redirected log as they are printed (a block-buffered stdout loses its last lines when
    the process dies hard), and a fatal signal in native code (CUDA, compiled kernels) prints the Python traceback
    of every thread on stderr instead of ending the process without a word."""
    import faulthandler

    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and not stream.line_buffering:
            try:
                stream.reconfigure(line_buffering=True)
            except (ValueError, OSError):  # a stream that cannot be reconfigured (closed, or not a text file)
                pass
    if not faulthandler.is_enabled():
        try:
            faulthandler.enable()
        except (ValueError, OSError, AttributeError):  # e.g. a stderr without a file descriptor (tests capture it)
            pass


def main(argv: list[str] | None = None) -> int:
    from k3.checkpoint import CheckpointError
    from k3.config import ConfigError

    from k3.cli_args import use_compile_cache

    use_compile_cache()  # before anything imports torch's compiler or Triton
    args = build_parser().parse_args(argv)
    _keep_logs()
    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, ValueError) as e:
        print(f"k3 {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"k3 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
