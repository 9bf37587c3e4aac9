"""`k3 train-draft` (registered by k3.cli): fine-tune a checkpoint's MTP layer into an EAGLE-3 draft
(k3.posttrain.eagle3)."""

from __future__ import annotations

import argparse
import sys

from k3 import cli_args as cli


def _blocks(text: str) -> tuple[int, ...]:
    try:
        v = tuple(int(x) for x in text.split(","))
    except ValueError:
        v = ()
    if len(v) != 2:
        raise argparse.ArgumentTypeError(f"expected two AttnRes block numbers 'A,B' (e.g. 1,4), got {text!r}")
    return v


def cmd_train_draft(args) -> int:
    from k3.devices import pick_device
    from k3.posttrain.eagle3 import DraftOptions, train_draft

    device = pick_device(args.device)
    opts = DraftOptions(ckpt=cli._resolve_ckpt(args.ckpt), out=args.out, steps=args.steps, loss=args.loss,
                        qat=None if args.qat == "none" else args.qat, data=args.data or [],
                        max_corpus_mb=args.max_corpus_mb, blocks=args.blocks, seq_len=args.seq_len, rows=args.rows,
                        lr=args.lr, seed=args.seed, log_every=args.log_every, device=str(device),
                        backends=cli._backends(args.backend, device), verify=args.verify, resume=args.resume)
    try:
        return cli.run_training_command("train-draft", lambda: train_draft(opts, progress=not args.no_progress))
    except FileNotFoundError as e:
        print(f"k3 train-draft: {e}", file=sys.stderr)
        return 2


def add_parser(sub) -> None:
    s = sub.add_parser("train-draft", help="fine-tune the checkpoint's MTP layer into an EAGLE-3 draft (target "
                       "frozen; LK loss, 7-step training-time test) for `k3 serve --speculative eagle3`")
    s.add_argument("--ckpt", required=True, help="the target checkpoint (or a run directory: its latest checkpoint)")
    s.add_argument("--out", help="the draft's directory (default: CK/draft, where `k3 serve --speculative eagle3` "
                                 "looks)")
    s.add_argument("--steps", type=cli._positive_int, default=200, help="optimizer steps (default 200)")
    s.add_argument("--loss", choices=["lk", "kl"], default="lk",
                   help="lk: -log sum_x min(p, q), the acceptance rate's log (report eq. 16); kl: KL(p || q) "
                        "(default lk)")
    s.add_argument("--qat", choices=["mxfp4", "none"], default="none",
                   help="mxfp4: the routed experts of target and draft compute in MXFP4 weights / MXFP8 inputs, the "
                        "post-training QAT configuration (default none)")
    s.add_argument("--data", action="append", help="training text (repeatable; files, directories, globs as for "
                   "`k3 train`; default: the default corpus)")
    s.add_argument("--max-corpus-mb", type=cli._positive_float, help="cap the default corpus's text")
    s.add_argument("--blocks", type=_blocks, help="the two AttnRes blocks fused with the final hidden state, 'A,B' "
                   "(default 1,4; on models with fewer than 4 blocks 1 and the second-to-last)")
    s.add_argument("--seq-len", type=cli._positive_int, default=256, help="tokens per row (default 256)")
    s.add_argument("--rows", type=cli._positive_int, default=8, help="rows per step (default 8)")
    s.add_argument("--lr", type=cli._positive_float, default=1e-3, help="peak learning rate (default 1e-3)")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--log-every", type=cli._positive_int, default=10, help="steps per progress line / metrics row")
    s.add_argument("--device", default="auto", help="auto, cpu or cuda")
    s.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto", help=cli.BACKEND_HELP)
    s.add_argument("--resume", action="store_true",
                   help="continue the unfinished run in the draft's directory (stopped by Ctrl-C or SIGTERM, or killed) "
                        "from its newest checkpoint, with the same settings (--steps may grow)")
    s.add_argument("--no-progress", action="store_true", help="no progress lines")
    s.add_argument("--no-verify", dest="verify", action="store_false", help=cli.VERIFY_HELP)
    s.set_defaults(fn=cmd_train_draft)
