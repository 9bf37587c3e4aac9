"""The post-training commands: `k3 sft`, `k3 distill`, `k3 quantize`, `k3 data sft-from-source` and
`k3 data docs-from-source` (registered by k3.cli)."""

from __future__ import annotations

import os

from k3 import cli_args as cli


def cmd_sft(args) -> int:
    from k3.devices import pick_device
    from k3.posttrain.sft import CPU_DEFAULTS, GPU_DEFAULTS, SFTOptions, run_sft

    device = pick_device(args.device)
    tcfg = cli._train_config(args, GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS)
    if args.ckpt is None and not args.resume:
        raise SystemExit("k3 sft: --ckpt is required (the checkpoint to fine-tune), unless --resume")
    opts = SFTOptions(ckpt=None if args.ckpt is None else cli._resolve_ckpt(args.ckpt), data=args.data or [],
                      heldout=args.heldout or [], resume=args.resume, device=str(device),
                      backends=cli._backends(args.backend, device), verify=args.verify,
                      skip_bad_records=args.skip_bad_records)
    return cli.run_training_command("sft", lambda: run_sft(opts, tcfg, progress_bar=not args.no_progress))


def cmd_distill(args) -> int:
    from k3.devices import pick_device
    from k3.posttrain.distill import CPU_DEFAULTS, GPU_DEFAULTS, DistillOptions, run_distill, student_qat

    if args.seq_len is not None or args.batch_tokens is not None:
        raise SystemExit("k3 distill: --seq-len and --batch-tokens do not apply: a row is one sample (prompt + "
                         "response: --max-prompt-tokens + --max-new-tokens) and a step holds --rollouts-per-step")
    if args.student is None and not args.resume:
        raise SystemExit("k3 distill: --student is required (the checkpoint to distill into), unless --resume")
    device = pick_device(args.device)
    defaults = dict(GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS, seq_len=8, batch_tokens=8,
                    micro_batch_rows=None)
    student = None if args.student is None else cli._resolve_ckpt(args.student, "--student")
    if args.qat is None and not args.resume and student is not None and os.path.isdir(student):
        args.qat = student_qat(student)  # a QAT-trained student keeps its quantization, in training and rollouts
    tcfg = cli._train_config(args, defaults)
    teachers = [_resolved_teacher(spec) for spec in args.teacher]
    opts = DistillOptions(student=student, teachers=teachers, prompts=args.prompts, resume=args.resume,
                          rollouts_per_step=args.rollouts_per_step, max_prompt_tokens=args.max_prompt_tokens,
                          max_new_tokens=args.max_new_tokens, rollout_budget=args.rollout_budget, r_max=args.r_max,
                          cache_memory_mb=args.rollout_cache_mb, device=str(device),
                          backends=cli._backends(args.backend, device), verify=args.verify,
                          heldout=args.heldout or [], eval_samples=args.eval_samples)
    return cli.run_training_command("distill", lambda: run_distill(opts, tcfg, progress_bar=not args.no_progress))


def _resolved_teacher(spec: str) -> str:
    """A `--teacher TAG=CK` with CK resolved as every checkpoint flag's path is (a run directory: its latest
    checkpoint)."""
    from k3.posttrain.mopd import parse_teacher_spec

    domain, effort, ck = parse_teacher_spec(spec)
    tag = domain if effort is None else f"{domain}/{effort}"
    return f"{tag}={cli._resolve_ckpt(ck, f'--teacher {tag}')}"


def cmd_quantize(args) -> int:
    import torch

    from k3.train.qat import quantize_checkpoint

    dtype = {None: None, "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    src = cli._resolve_ckpt(args.ckpt)
    quantize_checkpoint(src, args.out, fmt=args.format, activations=None if args.activations == "none" else
                        args.activations, dtype=dtype, verify=args.verify)
    print(f"wrote {args.out}: {src} with its routed experts in MXFP4 (weight_packed / weight_scale)"
          f"{', expert inputs MXFP8' if args.activations != 'none' else ''}")
    return 0


def cmd_data_sft_from_source(args) -> int:
    from k3.data.sft_from_source import sft_from_source

    if args.heldout_fraction > 0 and args.heldout is None:
        raise SystemExit("k3 data sft-from-source: give --heldout FILE.jsonl for the held-out files' conversations "
                         "(or --heldout-fraction 0)")
    train, held, st = sft_from_source(args.paths, heldout_fraction=args.heldout_fraction, max_chars=args.max_chars,
                                      max_records=args.max_records, max_heldout=args.max_heldout)
    _write_data(args, train, held)
    print(f"{st.files} files ({st.heldout_files} held out, {st.unparsable_files} unreadable or unparsable): "
          f"{st.functions} functions with a docstring; left out {st.too_long} longer than {args.max_chars} chars, "
          f"{st.not_standalone} that do not compile alone, {st.leaked} held-out duplicates of training code; "
          f"wrote {st.train} conversations to {args.out}"
          + (f" and {st.heldout} to {args.heldout}" if args.heldout is not None else ""))
    return 0


def cmd_data_docs_from_source(args) -> int:
    from k3.data.docs_from_source import docs_from_source

    if args.heldout_fraction > 0 and args.heldout is None:
        raise SystemExit("k3 data docs-from-source: give --heldout FILE.jsonl for the held-out files' conversations "
                         "(or --heldout-fraction 0)")
    train, held, st = docs_from_source(args.paths, heldout_fraction=args.heldout_fraction, head_chars=args.head_chars,
                                       reply_chars=args.reply_chars, max_records=args.max_records,
                                       max_heldout=args.max_heldout)
    _write_data(args, train, held)
    print(f"{st.files} files ({st.heldout_files} held out, {st.unparsable_files} unreadable or unparsable): "
          f"{st.docstrings} docstrings of at least {args.head_chars + args.reply_chars // 2} chars; wrote "
          f"{st.train} conversations to {args.out}"
          + (f" and {st.heldout} to {args.heldout}" if args.heldout is not None else ""))
    return 0


def _write_data(args, train: list[dict], held: list[dict]) -> None:
    """Write a `k3 data` command's records (each tagged with --domain when given: `k3 distill` reads such a file as
    prompts, `k3 sft` as chat data)."""
    from k3.data.sft_from_source import write_jsonl

    for r in train + held if args.domain else ():
        r["domain"] = args.domain
    write_jsonl(train, args.out)
    if args.heldout is not None:
        write_jsonl(held, args.heldout)


def _add_data_flags(d) -> None:
    """The flags `k3 data sft-from-source` and `k3 data docs-from-source` share."""
    d.add_argument("paths", nargs="*", help=".py files or directories (default: the Python standard library)")
    d.add_argument("--out", required=True, help="training conversations (.jsonl)")
    d.add_argument("--heldout", help="held-out conversations (.jsonl): those of the held-out files")
    d.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="fraction of files held out, by a stable hash of their relative path (default 0.05)")
    d.add_argument("--max-records", type=cli._positive_int, help="keep at most this many training conversations")
    d.add_argument("--max-heldout", type=cli._positive_int, help="keep at most this many held-out conversations")
    d.add_argument("--domain", metavar="TAG", help="add \"domain\": TAG to every record, so that the file is also a "
                   "`k3 distill --prompts` file for the teacher of that domain")


def add_parsers(sub) -> None:
    s = sub.add_parser("sft", help="supervised fine-tuning of a checkpoint on chat data (loss on the assistant's "
                       "tokens), optionally with MXFP4 QAT")
    s.add_argument("--ckpt", help="the checkpoint to fine-tune (or a run directory: its latest checkpoint)")
    s.add_argument("--data", action="append", required=True,
                   help="chat .jsonl: one {\"messages\": [{\"role\": ..., \"content\": ...}, ...]} per line (repeatable)")
    s.add_argument("--heldout", action="append", help="held-out chat .jsonl for the held-out reply loss (repeatable)")
    s.add_argument("--out", default="runs/sft", help="run directory (checkpoints, metrics.jsonl, loss.png)")
    s.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint")
    s.add_argument("--skip-bad-records", action="store_true",
                   help="skip bad records (counted and listed in the log) instead of stopping at the first")
    cli._add_trainer_flags(s)
    s.set_defaults(fn=cmd_sft)

    s = sub.add_parser("distill", help="multi-teacher on-policy distillation (MOPD): the student samples, the "
                       "teacher of each prompt's domain/effort tag scores every token, eq. 15's clipped log-ratio is "
                       "the reward")
    s.add_argument("--student", help="the checkpoint to distill into (or a run directory: its latest checkpoint)")
    s.add_argument("--teacher", action="append", required=True, metavar="TAG=CK",
                   help="a teacher: TAG = DOMAIN (every effort of the domain) or DOMAIN/EFFORT (that pair only; wins "
                        "over the domain's), CK its checkpoint (or a run directory: its latest checkpoint; repeatable)")
    s.add_argument("--prompts", action="append", required=True, metavar="FILE.jsonl",
                   help="prompts, one per line: {\"messages\": [...]} or {\"prompt\": \"...\"}, with \"domain\" "
                        "and optional \"effort\" (repeatable)")
    s.add_argument("--out", default="runs/distill", help="run directory (checkpoints, metrics.jsonl)")
    s.add_argument("--resume", action="store_true", help="continue the run in --out from its latest checkpoint, "
                   "samples in flight included (give the same --teacher and --prompts)")
    s.add_argument("--rollouts-per-step", type=cli._positive_int, default=8, help="samples trained per step "
                   "(in flight at once)")
    s.add_argument("--max-new-tokens", type=cli._positive_int, default=128, help="longest response")
    s.add_argument("--max-prompt-tokens", type=cli._positive_int, default=256,
                   help="longer prompts are left out (counted in the log)")
    s.add_argument("--rollout-budget", type=cli._positive_int, help="tokens a sample may generate per step; a longer "
                   "one is kept and continues in the next step under the then-current policy (partial rollouts; "
                   "default --max-new-tokens: none)")
    s.add_argument("--r-max", type=cli._positive_float, default=5.0,
                   help="R_max of eq. 15: the per-token reward is clipped to [-R_max, R_max] (default 5)")
    s.add_argument("--heldout", action="append", metavar="FILE.jsonl",
                   help="held-out prompts (the --prompts format; repeatable): every --eval-every steps the student "
                        "samples --eval-samples responses to each, and the sampled reverse KL to each prompt's teacher "
                        "is logged (val_loss, and per domain val_domains)")
    s.add_argument("--eval-samples", type=cli._positive_int, default=2, help="samples per held-out prompt")
    s.add_argument("--rollout-cache-mb", type=cli._positive_float, default=256.0,
                   help="the rollout engine's cache pool (MLA KV, KDA states, prefix checkpoints)")
    cli._add_trainer_flags(s)
    s.set_defaults(fn=cmd_distill)

    s = sub.add_parser("quantize", help="post-training quantization: write a checkpoint with its routed experts in "
                       "MXFP4 (the official layout)")
    s.add_argument("--ckpt", required=True, help="checkpoint directory (or a run directory: its latest checkpoint)")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--format", choices=["mxfp4"], default="mxfp4")
    s.add_argument("--activations", choices=["mxfp8", "none"], default="mxfp8",
                   help="the expert inputs at inference: mxfp8 (as K3 is deployed and QAT trains) or none (the "
                        "release's config: high-precision inputs)")
    s.add_argument("--dtype", choices=["bfloat16", "float32"], help="dtype of the other tensors (default: the source's)")
    s.add_argument("--no-verify", dest="verify", action="store_false", help=cli.VERIFY_HELP)
    s.set_defaults(fn=cmd_quantize)

    s = sub.add_parser("data", help="make training data")
    dsub = s.add_subparsers(dest="data_command", required=True)
    d = dsub.add_parser("sft-from-source", help="docstring-to-code conversations from Python sources (the user gives "
                        "a function's signature and docstring, the assistant writes the function)")
    _add_data_flags(d)
    d.add_argument("--max-chars", type=cli._positive_int, default=1500, help="longest function kept, in characters")
    d.set_defaults(fn=cmd_data_sft_from_source)
    d = dsub.add_parser("docs-from-source", help="documentation conversations from Python sources' docstrings (the "
                        "user gives a docstring's opening, the assistant continues it)")
    _add_data_flags(d)
    d.add_argument("--head-chars", type=cli._positive_int, default=160,
                   help="the opening the user gives, in characters (cut at a line break; default 160)")
    d.add_argument("--reply-chars", type=cli._positive_int, default=320,
                   help="the continuation the assistant writes, in characters (default 320)")
    d.set_defaults(fn=cmd_data_docs_from_source)
    from k3.data.render_pairs import add_parser as add_render_pairs

    add_render_pairs(dsub)  # k3 data render-pairs: image-text pairs (k3.data.images)
