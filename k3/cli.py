"""The `k3` command."""

from __future__ import annotations

import argparse
import os
import sys


def _config_from_arg(spec: str):
    from k3.config import PRESETS, K3Config

    if spec in PRESETS:
        return spec, K3Config.from_preset(spec)
    if os.path.exists(spec):
        return spec, K3Config.load(spec)
    raise SystemExit(f"k3: '{spec}' is neither a preset ({', '.join(PRESETS)}) nor a config file or checkpoint directory")


def cmd_info(args) -> int:
    from k3.info import format_info, model_info

    name, cfg = _config_from_arg(args.model)
    print(format_info(name, cfg, model_info(cfg, context=args.context), args.context))
    return 0


def cmd_init(args) -> int:
    import torch

    from k3.config import K3Config
    from k3.data.tokenizer import byte_level_tokenizer
    from k3.info import model_info
    from k3.model.model import K3ForCausalLM

    cfg = K3Config.from_preset(args.preset)
    info = model_info(cfg)
    nbytes = info.total * (4 if cfg.dtype == "float32" else 2)
    if nbytes > args.max_gib * 2**30:
        raise SystemExit(f"k3 init: preset '{args.preset}' has {info.total:,} parameters ({nbytes / 2**30:,.0f} GiB); "
                         f"raise --max-gib (now {args.max_gib}) to write it anyway")
    torch.manual_seed(args.seed)
    model = K3ForCausalLM(cfg).init_weights(seed=args.seed).set_dtype(cfg.torch_dtype)
    tok = byte_level_tokenizer().to_str().encode("utf-8")
    model.save_pretrained(args.out, extra_files={"tokenizer.json": tok})
    print(f"wrote a randomly initialized '{args.preset}' checkpoint ({info.total:,} parameters) to {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3", description="The Kimi K3 system: model, training and serving.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="parameter counts, cache sizes and FLOPs of a preset or checkpoint")
    s.add_argument("model", help="preset name (k3, k3-mini, tiny), config.json or checkpoint directory")
    s.add_argument("--context", type=_positive_int, default=4096, help="context length for the FLOP count")
    s.set_defaults(fn=cmd_info)

    s = sub.add_parser("init", help="write a randomly initialized checkpoint")
    s.add_argument("--preset", required=True, choices=["k3", "k3-mini", "tiny"])
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--max-gib", type=float, default=64.0, help="refuse to write checkpoints larger than this")
    s.set_defaults(fn=cmd_init)
    return p


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def main(argv: list[str] | None = None) -> int:
    from k3.checkpoint import CheckpointError
    from k3.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ConfigError, CheckpointError) as e:
        print(f"k3 {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"k3 {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
