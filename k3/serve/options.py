"""The flags of `k3 serve`, apart from the server so that building the CLI needs no HTTP stack (FastAPI is only
imported when a server starts)."""

from __future__ import annotations

import argparse
import math


def _count(text: str) -> int:
    """argparse type: a positive integer (sizes and counts of the engine)."""
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def _positive_mb(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v * 2**20 >= 1):
        raise argparse.ArgumentTypeError(f"must be a positive number of MiB, got {text!r}")
    return v


def _draft_count(text: str) -> int:
    from k3.serve.engine import MAX_DRAFT_TOKENS

    try:
        v = int(text)
    except ValueError:
        v = 0
    if not 1 <= v <= MAX_DRAFT_TOKENS:
        raise argparse.ArgumentTypeError(f"must be an integer in [1, {MAX_DRAFT_TOKENS}], got {text!r}")
    return v


def add_speculative_arguments(parser) -> None:
    """--speculative, --draft, --num-draft-tokens, --speculative-auto, --fused-replay and --verify-ahead (`k3 serve`
    and `k3 generate`): EngineConfig.speculative, .draft, .num_draft_tokens, .speculative_auto, .fused_replay and
    .verify_ahead."""
    parser.add_argument("--speculative", choices=["off", "mtp", "eagle3"], default="off",
                        help="speculative decoding: 'mtp' drafts with the model's MTP layer, 'eagle3' with an "
                             "EAGLE-3 draft trained by `k3 train-draft` (--draft), and verifies the drafts in one "
                             "forward; outputs are unchanged (greedy: the same tokens; sampling: the same "
                             "distribution) (default off)")
    parser.add_argument("--draft", default=None,
                        help="with --speculative eagle3: the draft's directory (default: CK/draft beside the "
                             "checkpoint)")
    parser.add_argument("--num-draft-tokens", type=_draft_count, default=3,
                        help="draft tokens per speculative step (default 3)")
    parser.add_argument("--speculative-auto", action=argparse.BooleanOptionalAction, default=True,
                        help="with --speculative: measure speculative against plain decode steps per decode batch "
                             "size and keep to the faster (default on; --no-speculative-auto: speculate on every "
                             "step)")
    parser.add_argument("--fused-replay", action=argparse.BooleanOptionalAction, default=None,
                        help="with --speculative: replay the accepted drafts into the KDA states in the same pass as "
                             "the request's next verification (op kda_verify_step) instead of right after "
                             "acceptance; the outputs are the same (default: on with --speculative; "
                             "--no-fused-replay: the replay right after acceptance)")
    parser.add_argument("--verify-ahead", action="store_true",
                        help="with --speculative on a draft's captured chains (CUDA graphs): launch the verification "
                             "of each proposal drafted ahead before the acceptance before it is read back, kept where "
                             "every draft was accepted (EngineConfig.verify_ahead); the outputs are the same "
                             "(default off: not yet measured on a GPU)")


def add_serve_arguments(parser) -> None:
    """The flags of `k3 serve`."""
    from k3.cli_args import _device_arg, _port

    parser.add_argument("--ckpt", required=True, help="checkpoint directory (or a training run directory: its latest "
                                                      "checkpoint)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=_port, default=8000)
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $K3_API_KEY, else none)")
    parser.add_argument("--model-name", default=None,
                        help="the model id clients send (default: the training run's directory name for a run or "
                             "one of its checkpoints, the same across its checkpoints; else the checkpoint "
                             "directory's name; GET /v1/models lists it)")
    parser.add_argument("--cache-memory-mb", type=_positive_mb, default=None,
                        help="KV/state page pool size (default 512)")
    parser.add_argument("--page-tokens", type=_count, default=None, help="tokens per cache page (default 2048)")
    parser.add_argument("--hash-block-tokens", type=_count, default=None,
                        help="prefix-cache block size; divides --page-tokens (default 512)")
    parser.add_argument("--max-num-seqs", type=_count, default=None, help="most requests running at once (default 64)")
    parser.add_argument("--max-step-tokens", type=_count, default=None, help="tokens per engine step (default 2048)")
    parser.add_argument("--prefill-chunk", type=_count, default=None,
                        help="largest prefill chunk of one request per step (default 512)")
    parser.add_argument("--max-request-mb", type=_positive_mb, default=None,
                        help="largest request body in MiB; larger ones get HTTP 413 (default 8)")
    add_image_arguments(parser)
    parser.add_argument("--device", type=_device_arg, default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_speculative_arguments(parser)


def add_image_arguments(parser) -> None:
    """The limits of a chat request's images (k3.serve.images.ImageLimits; their defaults are its defaults)."""
    parser.add_argument("--max-images-per-request", type=_count, default=8,
                        help="most image_url parts one chat request may hold; more get HTTP 400 (default 8)")
    parser.add_argument("--max-image-mb", type=_positive_mb, default=6.0,
                        help="largest image file in MiB (decoded from its base64 data URL); larger ones get HTTP 413 "
                             "(default 6: its base64 fills the default 8 MiB request body)")
    parser.add_argument("--max-image-tokens", type=_count, default=1024,
                        help="an image is resized (aspect ratio kept) to at most this many tokens ((H/28) x "
                             "(W/28) for the release) (default 1024, e.g. 896 x 896 px)")
    parser.add_argument("--max-image-pixels", type=_count, default=64 << 20,
                        help="an image whose header claims more pixels is refused before decoding (a "
                             "decompression bomb) with HTTP 400 (default 67108864, 8192 x 8192)")


def image_limits(args):
    """k3.serve.images.ImageLimits from the flags of add_image_arguments (their defaults where absent)."""
    from k3.serve.images import ImageLimits

    d = ImageLimits()
    mb = getattr(args, "max_image_mb", None)
    return ImageLimits(max_images=getattr(args, "max_images_per_request", d.max_images),
                       max_image_bytes=d.max_image_bytes if mb is None else int(mb * 2**20),
                       max_image_tokens=getattr(args, "max_image_tokens", d.max_image_tokens),
                       max_image_pixels=getattr(args, "max_image_pixels", d.max_image_pixels)).validate()


def draft_dir(ckpt: str, speculative: str, draft: str | None) -> str | None:
    """EngineConfig.draft for these flags: --draft, else CK/draft with --speculative eagle3; a --draft with another
    --speculative is refused."""
    import os

    if draft is not None and speculative != "eagle3":
        raise ValueError(f"--draft {draft} is for --speculative eagle3 (got --speculative {speculative})")
    if speculative != "eagle3":
        return None
    return draft if draft is not None else os.path.join(ckpt, "draft")
