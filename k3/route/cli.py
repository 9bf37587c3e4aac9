"""`k3 route`: one OpenAI-compatible front for several `k3 serve` instances (registered by k3.cli).

    k3 serve --ckpt CK --port 8001 &  k3 serve --ckpt CK --port 8002 &  k3 serve --ckpt CK --port 8003 &
    k3 route --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 --backend http://127.0.0.1:8003
"""

from __future__ import annotations

import argparse
import os
import sys
from urllib.parse import urlsplit

__all__ = ["add_parser", "backend_url"]


def backend_url(text: str) -> str:
    """argparse type: an instance's base URL, http(s)://HOST:PORT (a trailing '/' or '/v1' is dropped)."""
    u = urlsplit(text.strip())
    path = u.path.rstrip("/").removesuffix("/v1")
    try:
        port = u.port
    except ValueError:
        port = None
    if u.scheme not in ("http", "https") or not u.hostname or port is None or u.query or u.fragment:
        raise argparse.ArgumentTypeError(f"expected a backend URL like http://127.0.0.1:8001 (scheme, host and "
                                         f"port), got {text!r}")
    return f"{u.scheme}://{u.netloc}{path}"


def _count0(s: str) -> int:
    """argparse type: an integer >= 0."""
    try:
        v = int(s)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {s!r}")
    return v


def add_parser(sub) -> None:
    from k3.cli_args import _non_negative_float, _port, _positive_float, _positive_int
    from k3.route.budget import DEFAULT_CLASSES
    from k3.route.defaults import (DEFAULT_BYTES_PER_TOKEN, DEFAULT_PREFIX_CHARS, DEFAULT_SESSION_HEADER,
                                   DEFAULT_TOKENS_PER_BACKEND)
    from k3.route.fleet import POLICIES
    from k3.route.ring import DEFAULT_VNODES
    from k3.serve.options import _positive_mb

    s = sub.add_parser("route", help="one OpenAI-compatible front for several `k3 serve` instances: session affinity, "
                                     "failover and per-class budgets (binds 127.0.0.1 by default)")
    s.add_argument("--backend", dest="backends", action="append", type=backend_url, required=True, metavar="URL",
                   help="a `k3 serve` instance, e.g. http://127.0.0.1:8001 (repeat for each)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=_port, default=8080, help="default 8080")
    s.add_argument("--policy", choices=POLICIES, default="affinity",
                   help="affinity: a session goes to its primary on a consistent-hash ring, to its secondary while "
                        "the primary is down; round-robin: the healthy backends in turn (default affinity)")
    s.add_argument("--session-header", default=DEFAULT_SESSION_HEADER,
                   help=f"the header that names a session (default {DEFAULT_SESSION_HEADER}); without it the "
                        f"body's 'user' field, else the prompt's first --session-prefix characters, is the key")
    s.add_argument("--session-prefix", type=_positive_int, default=DEFAULT_PREFIX_CHARS, metavar="CHARS",
                   help=f"characters of the prompt (a chat: its messages as 'role\\ntext\\n') hashed into the session "
                        f"key; at most one prefix-cache hash block of the backends (default {DEFAULT_PREFIX_CHARS})")
    s.add_argument("--vnodes", type=_positive_int, default=DEFAULT_VNODES,
                   help=f"points per backend on the hash ring (default {DEFAULT_VNODES})")
    s.add_argument("--classes", nargs="+", default=list(DEFAULT_CLASSES), metavar="NAME:MAX_TOKENS:SHARE",
                   help="request classes by prompt length, from the shortest, the last with MAX_TOKENS 'inf'; each "
                        "may hold SHARE of --fleet-tokens in flight (shares sum to at most 1) (default "
                        f"{' '.join(DEFAULT_CLASSES)})")
    s.add_argument("--fleet-tokens", type=_positive_int, default=None,
                   help=f"the fleet's capacity of in-flight prompt tokens that the classes share (default "
                        f"{DEFAULT_TOKENS_PER_BACKEND} per backend)")
    s.add_argument("--bytes-per-token", type=_positive_float, default=DEFAULT_BYTES_PER_TOKEN,
                   help=f"the prompt-token estimate: UTF-8 bytes of text per token (default {DEFAULT_BYTES_PER_TOKEN:g}, "
                        f"a BPE's usual ratio; 1 for the byte tokenizer)")
    s.add_argument("--queue-wait", type=_non_negative_float, default=30.0, metavar="SECONDS",
                   help="longest wait for room in a class's budget before a 429 with Retry-After (default 30)")
    s.add_argument("--max-queued", type=_count0, default=256,
                   help="requests that may wait per class; more get 429 at once (default 256)")
    s.add_argument("--health-interval", type=_positive_float, default=1.0, metavar="SECONDS",
                   help="seconds between health checks of each backend (default 1)")
    s.add_argument("--read-timeout", type=_positive_float, default=600.0, metavar="SECONDS",
                   help="longest silence of a backend inside an answer before the request fails (default 600)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $K3_API_KEY, else none); the "
                        "header is passed on to the backends")
    s.add_argument("--max-request-mb", type=_positive_mb, default=None,
                   help="largest request body in MiB; larger ones get HTTP 413 (default 8)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    s.set_defaults(fn=cmd_route)


def cmd_route(args) -> int:
    import logging

    import uvicorn

    from k3.route.app import RouterConfig, create_app
    from k3.route.budget import parse_classes
    from k3.route.requests import KeyOptions
    from k3.serve.guard import DEFAULT_MAX_REQUEST_BYTES
    from k3.serve.http import uvicorn_options

    try:
        parse_classes(args.classes)
    except ValueError as e:
        print(f"k3 route: --classes: {e}", file=sys.stderr)
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get("K3_API_KEY")
    max_bytes = DEFAULT_MAX_REQUEST_BYTES if args.max_request_mb is None else int(args.max_request_mb * 2**20)
    cfg = RouterConfig(backends=args.backends, policy=args.policy, vnodes=args.vnodes,
                       keys=KeyOptions(args.session_header, args.session_prefix, args.bytes_per_token),
                       classes=args.classes, fleet_tokens=args.fleet_tokens, queue_wait_s=args.queue_wait,
                       max_queued=args.max_queued, health_interval_s=args.health_interval,
                       read_timeout_s=args.read_timeout, api_key=api_key, max_request_bytes=max_bytes)
    try:
        app = create_app(cfg)
    except ValueError as e:
        print(f"k3 route: {e}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logging.getLogger("k3.route").warning("routing on %s without an API key: anyone who can reach it can use "
                                              "the backends", args.host)
    r = app.state.router
    classes = ", ".join(f"{c.name} (up to {c.cls.max_tokens:g} tokens: {c.budget} in flight)"
                        for c in r.admission.classes)
    print(f"k3 route: {len(args.backends)} backends ({args.policy}); classes {classes}; "
          f"http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10,
                **uvicorn_options())
    return 0
