"""`k3 serve`: load a checkpoint and serve its OpenAI-compatible app with uvicorn. The flags are in
k3.serve.options, apart from the HTTP stack."""

from __future__ import annotations

import logging
import os
import time

from k3.serve.app import create_app
from k3.serve.build import build_engine
from k3.serve.guard import DEFAULT_MAX_REQUEST_BYTES
from k3.serve.http import uvicorn_options

logger = logging.getLogger("k3.serve")


def serve(ckpt_dir: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          cache_memory_mb: float | None = None, page_tokens: int | None = None, hash_block_tokens: int | None = None,
          max_num_seqs: int | None = None, max_step_tokens: int | None = None, prefill_chunk: int | None = None,
          device: str = "auto", model_name: str | None = None, log_level: str = "info", backends=None,
          cuda_graphs: bool | str = True, max_request_mb: float | None = None, verify: bool = True,
          speculative: str = "off", num_draft_tokens: int = 3, draft: str | None = None,
          speculative_auto: bool = True, compile_decode: bool = False, image_limits=None,
          fused_replay: bool | None = None, verify_ahead: bool = False) -> None:
    """Load `ckpt_dir` and serve it until interrupted. Binds 127.0.0.1 unless told otherwise. Engine options left
    as None take EngineConfig / SchedulerConfig defaults; `max_request_mb` (MiB) defaults to
    DEFAULT_MAX_REQUEST_BYTES; `image_limits` (k3.serve.images.ImageLimits) to its defaults."""
    import uvicorn

    max_request_bytes = DEFAULT_MAX_REQUEST_BYTES if max_request_mb is None else int(max_request_mb * 2**20)
    if not max_request_bytes >= 1:  # checked before the (possibly slow) load
        raise ValueError(f"--max-request-mb must be positive, got {max_request_mb!r}")
    engine, tokenizer, template = build_engine(ckpt_dir, cache_memory_mb, page_tokens, hash_block_tokens,
                                               max_num_seqs, max_step_tokens, prefill_chunk, device,
                                               backends=backends, cuda_graphs=cuda_graphs, verify=verify,
                                               speculative=speculative, num_draft_tokens=num_draft_tokens,
                                               draft=draft, speculative_auto=speculative_auto,
                                               compile_decode=compile_decode, fused_replay=fused_replay,
                                               verify_ahead=verify_ahead)
    t0 = time.perf_counter()
    warm = engine.warm_up()  # graphs captured and the draft's kernels tuned now, so no request waits for them
    if warm["graphs"] or warm["draft_counts"]:
        draft = f", the draft's first step at {len(warm['draft_counts'])} counts" if warm["draft_counts"] else ""
        print(f"k3 serve: {warm['graphs']} CUDA graphs captured{draft} in {time.perf_counter() - t0:.1f} s",
              flush=True)
    name = model_name or default_model_name(ckpt_dir)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", host)
    app = create_app(engine, tokenizer, name, api_key=api_key, chat_template=template,
                     max_request_bytes=max_request_bytes, image_limits=image_limits)
    stats = engine.cache_stats()
    print(f"k3 serve: model '{name}' from {ckpt_dir}; context {engine.max_model_len} tokens; cache "
          f"{stats['num_pages']} pages x {stats['page_bytes']} bytes; http://{host}:{port}/v1", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10, **uvicorn_options())


def default_model_name(ckpt_dir: str) -> str:
    """The model id `k3 serve` answers to without --model-name: for a checkpoint of a training run
    (RUN/checkpoints/step-N, which `--ckpt RUN` resolves to) the run directory's name, the same for every checkpoint
    of the run, so that a client keeps working when the server restarts on a newer one; else the checkpoint
    directory's name."""
    from k3.run_dir import step_of

    path = os.path.normpath(os.path.abspath(ckpt_dir))
    parent = os.path.dirname(path)
    if step_of(os.path.basename(path)) is not None and os.path.basename(parent) == "checkpoints":
        return os.path.basename(os.path.dirname(parent)) or "k3"
    return os.path.basename(path) or "k3"


def cmd_serve(args) -> int:
    import sys

    from k3.checkpoint import CheckpointError
    from k3.cli_args import _resolve_ckpt
    from k3.serve.options import image_limits

    if not 0 <= args.port <= 65535:
        print(f"k3 serve: --port {args.port} is not a port number", file=sys.stderr)
        return 2
    try:
        ckpt = _resolve_ckpt(args.ckpt)  # a checkpoint, or a training run's latest
        serve(ckpt, host=args.host, port=args.port, api_key=args.api_key, cache_memory_mb=args.cache_memory_mb,
              page_tokens=args.page_tokens, hash_block_tokens=args.hash_block_tokens, max_num_seqs=args.max_num_seqs,
              max_step_tokens=args.max_step_tokens, prefill_chunk=args.prefill_chunk, device=args.device,
              model_name=args.model_name, log_level=getattr(args, "log_level", "info"),
              backends=getattr(args, "backends", None), cuda_graphs=getattr(args, "cuda_graphs", True),
              max_request_mb=getattr(args, "max_request_mb", None), verify=getattr(args, "verify", True),
              speculative=getattr(args, "speculative", "off"), num_draft_tokens=getattr(args, "num_draft_tokens", 3),
              draft=getattr(args, "draft", None), speculative_auto=getattr(args, "speculative_auto", True),
              compile_decode=getattr(args, "compile_decode", False), image_limits=image_limits(args),
              fused_replay=getattr(args, "fused_replay", None), verify_ahead=getattr(args, "verify_ahead", False))
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"k3 serve: {e}", file=sys.stderr)
        return 2
    return 0
