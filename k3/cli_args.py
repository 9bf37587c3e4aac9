"""The command line's shared pieces: argument types, the trainer's flags and their TrainConfig, the ops'
backends and checkpoint paths, used by `k3` (k3.cli) and the commands it registers (k3.posttrain.cli)."""

from __future__ import annotations

import argparse
import copy
import math
import os


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """--help that gives every option's default, as argparse.ArgumentDefaultsHelpFormatter does but also for an
    option without a help text, and not for one whose help already speaks of its default; None and False (the
    option left out) are not shown. The benchmark scripts' parsers use it."""

    @staticmethod
    def _shows_default(action) -> bool:
        return bool(action.option_strings) and all(action.default is not v for v in (None, False, argparse.SUPPRESS))

    def _format_action(self, action):
        if not action.help and self._shows_default(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        if self._shows_default(action) and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


class RawDefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultsHelpFormatter):
    """DefaultsHelpFormatter with the description printed as written (a script's docstring with its examples)."""


BACKEND_HELP = ("which implementation runs the ops that have a GPU fast path: auto (each op's fast backend on CUDA "
                "once validated, else the PyTorch reference), fast (every fast backend, validated or not; needs "
                "CUDA) or torch (the reference everywhere). An op pinned by its K3_<OP>_BACKEND variable keeps it")


VERIFY_HELP = ("load the checkpoint without checking its shards against the SHA-256 digests its index records "
               "(checkpoints without digests, such as the release, are never checked)")


def _backends(choice: str, device):
    """The ops' implementations for this run (k3.ops.registry.Backends): --backend for every op, each op pinned by
    its K3_<OP>_BACKEND variable keeping its own, and the ops' options from their variables
    (k3.ops.registry.backends_from_env lists them)."""
    from k3.ops.registry import backends_from_env

    if choice == "fast" and device.type != "cuda":
        raise SystemExit(f"k3: --backend fast needs a CUDA device (this run is on {device.type}); use auto or torch")
    return backends_from_env(os.environ, default=choice)


TRAIN_FLAGS = ["max_steps", "max_minutes", "epochs", "seq_len", "batch_tokens", "lr", "seed", "micro_batch_rows",
               "balance", "mtp_weight", "qk_clip_tau", "eval_every", "eval_batches", "grad_clip", "save_every_minutes",
               "activation_checkpointing", "qat", "balance_diagnostics", "optimizer", "keep_checkpoints"]


def compile_cache_dir() -> str:
    """Where compiled kernels are kept between runs: $XDG_CACHE_HOME/k3 (default ~/.cache/k3)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "k3")


def use_compile_cache() -> None:
    """Keep compiled kernels across runs, under compile_cache_dir(): torch.compile's (TORCHINDUCTOR_CACHE_DIR,
    whose default is a folder of /tmp that a fresh machine or a reboot empties) and Triton's (TRITON_CACHE_DIR). A
    variable already set is left alone. Called before any command imports torch's compiler, so that a second start
    on the same machine reuses the first one's kernels instead of compiling them again (on an H200, the first start
    of `k3 train` spent 259 s compiling, a second one seconds)."""
    root = compile_cache_dir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(root, "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(root, "triton"))


def _saved_train_config(ck: str) -> dict:
    """The training settings a checkpoint was saved with (its trainer_state.json), for --resume."""
    import json

    from k3.checkpoint import CheckpointError
    from k3.train.state import unflatten

    path = os.path.join(ck, "trainer_state.json")
    try:
        with open(path, "rb") as f:
            saved = unflatten(None, json.loads(f.read().decode("utf-8")))["train_config"]
        if not isinstance(saved, dict):
            raise TypeError(f"train_config is a {type(saved).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); the checkpoint is damaged") from None
    return saved


def _train_config(args, defaults: dict):
    """The TrainConfig of `k3 train` / `k3 sft`: a resumed run's own settings (else `defaults`), then the flags."""
    from k3.run_dir import resume_checkpoint
    from k3.train.trainer import TrainConfig

    fields = {"out": args.out}
    if args.resume:
        ck = resume_checkpoint(args.out)[0]  # the one the run will continue from (k3.train.run.build_run)
        if ck is not None:  # continue with the run's own settings unless a flag overrides them
            saved = _saved_train_config(ck)
            fields.update({k: v for k, v in saved.items() if k in TRAIN_FLAGS})
    else:
        fields.update(seq_len=defaults["seq_len"], batch_tokens=defaults["batch_tokens"], lr=defaults["lr"],
                      micro_batch_rows=defaults["micro_batch_rows"])
        for k in ("eval_every", "eval_batches"):
            if k in defaults:
                fields[k] = defaults[k]
    fields.update({k: getattr(args, k) for k in TRAIN_FLAGS if getattr(args, k) is not None})
    if fields.get("qat") == "none":
        fields["qat"] = None
    if fields.get("max_steps") is None and fields.get("max_minutes") is None and fields.get("epochs") is None:
        fields["max_minutes"] = 10.0
    return TrainConfig(**fields)


def _resolve_ckpt(path: str, what: str = "--ckpt") -> str:
    """The checkpoint a command's flag names (k3.run_dir.resolve_checkpoint: a checkpoint directory, or a run
    directory's latest checkpoint, said on stderr); a bad path raises CheckpointPathError (a ValueError: `k3` prints
    it and exits with status 2)."""
    import sys

    from k3.run_dir import resolve_checkpoint

    return resolve_checkpoint(path, what, log=lambda msg: print(f"k3: {msg}", file=sys.stderr, flush=True))


def _add_trainer_flags(s) -> None:
    """The Trainer's flags, shared by `k3 train` and `k3 sft`."""
    s.add_argument("--max-steps", type=_positive_int)
    s.add_argument("--max-minutes", type=_positive_float,
                   help="training-time budget (default 10 when neither --max-steps nor --epochs is given)")
    s.add_argument("--epochs", type=_positive_float, help="passes over the training data (may be fractional); with "
                   "--max-steps / --max-minutes the first budget reached ends the run")
    s.add_argument("--seq-len", type=_positive_int)
    s.add_argument("--batch-tokens", type=_positive_int, help="tokens per optimizer step")
    s.add_argument("--micro-batch-rows", type=_positive_int, help="rows per forward/backward (gradient accumulation)")
    s.add_argument("--lr", type=_positive_float, help="peak learning rate (Muon and AdamW)")
    s.add_argument("--seed", type=int)
    s.add_argument("--balance", choices=["histogram", "exact", "sign", "none"], help="expert load balancing (default histogram)")
    s.add_argument("--balance-diagnostics", action="store_true", default=None,
                   help="also log, per MoE layer and step, the load imbalance of the batch routed again with the bias "
                        "computed from it (expert_load_ideal_max_over_mean in metrics.jsonl): tells batch-to-batch "
                        "variation from balancing error; keeps the step's routing scores (default off)")
    s.add_argument("--optimizer", choices=["per-head-muon", "muon", "adamw"],
                   help="per-head-muon (K3's: Q/K/V orthogonalized per head, experts per expert, AdamW for the rest), "
                        "muon (whole-matrix Q/K/V) or adamw (everything), for comparisons (default per-head-muon)")
    s.add_argument("--mtp-weight", type=_non_negative_float,
                   help="weight of the multi-token-prediction loss, >= 0 (default 0.3; 0 trains no MTP loss)")
    s.add_argument("--qk-clip-tau", type=_non_negative_float,
                   help="QK-Clip threshold on MLA logits, >= 0 (default 100; 0 disables)")
    s.add_argument("--grad-clip", type=_positive_float)
    s.add_argument("--eval-every", type=_positive_int, help="steps between held-out evaluations (default 50 on a CPU, 200 on a GPU)")
    s.add_argument("--eval-batches", type=_positive_int,
                   help="batches (of up to 16 rows x --seq-len tokens) each held-out evaluation reads, the one "
                        "before the first step included (default 16 on a CPU: 65,536 tokens; 64 on a GPU)")
    s.add_argument("--save-every-minutes", type=_positive_float)
    s.add_argument("--keep-checkpoints", type=_positive_int,
                   help="how many of the newest checkpoints the run keeps; each holds the weights and the optimizer "
                        "state, ~2-3x the model in fp32 (default 2)")
    s.add_argument("--activation-checkpointing", action=argparse.BooleanOptionalAction, default=None,
                   help="recompute each sublayer in backward instead of storing its activations: trades ~1 extra "
                        "forward of compute for much less activation memory; needed for long contexts "
                        "(default off; --resume keeps the run's setting)")
    s.add_argument("--qat", choices=["mxfp4", "none"], help="quantization-aware training of the routed experts: "
                   "mxfp4 = MXFP4 weights and MXFP8 expert inputs in the forward, straight-through gradients "
                   "(report §4.1.4); the run's checkpoints keep the fp32 weights and OUT/mxfp4 gets the MXFP4 export "
                   "(default none; --resume keeps the run's setting)")
    s.add_argument("--device", type=_device_arg, default="auto", help="auto, cpu, cuda or cuda:N")
    s.add_argument("--backend", choices=["auto", "fast", "torch"], default="auto", help=BACKEND_HELP)
    s.add_argument("--no-progress", action="store_true", help="no progress bar")
    s.add_argument("--no-verify", dest="verify", action="store_false", help=VERIFY_HELP)


def _positive(kind):
    """argparse type: a positive int or a positive finite float, with a message naming what was expected."""
    word = "integer" if kind is int else "number"

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a positive {word}, got {s!r}") from None
        if not (v > 0 and math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"expected a positive {word}, got {s!r}")
        return v

    return parse


def _non_negative_float(s: str) -> float:
    """argparse type: a finite number >= 0 (a weight or threshold where 0 turns the thing off)."""
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0 (0 turns it off), got {s!r}")
    return v


def _device_arg(s: str) -> str:
    """argparse type of every --device flag: auto, cpu, cuda or cuda:N (k3.devices.check_device)."""
    from k3.devices import check_device

    try:
        return check_device(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--device ")) from None


def _port(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        v = -1
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number (0 to 65535), got {s!r}")
    return v


_positive_int, _positive_float = _positive(int), _positive(float)


def run_training_command(name: str, run) -> int:
    """Run a training command's `run()` (which returns the run's summary): its exit status by `exit_code`, or 3 with
    "k3 NAME: why" on stderr when training cannot continue (TrainingError; the last good checkpoint is intact)."""
    import sys

    from k3.train.trainer import TrainingError

    try:
        summary = run()
    except TrainingError as e:
        print(f"k3 {name}: {e}", file=sys.stderr)
        return 3
    return exit_code(summary)


def exit_code(summary: dict) -> int:
    """The exit status of a finished training command: 143 (128 + SIGTERM, what a process killed by the signal
    reports: supervisors expect it) when a SIGTERM stopped it, 130 when it was interrupted, else 0."""
    if summary.get("signal") == "SIGTERM":
        return 143
    return 130 if summary.get("interrupted") else 0
