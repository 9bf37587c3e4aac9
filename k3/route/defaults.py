"""The router's command-line defaults, importable without the HTTP stack (the `k3` parser is built from them on
machines without FastAPI)."""

DEFAULT_TOKENS_PER_BACKEND = 65536  # --fleet-tokens default: this many in-flight prompt tokens per backend
DEFAULT_SESSION_HEADER = "X-Session-Id"
DEFAULT_PREFIX_CHARS = 1024
DEFAULT_BYTES_PER_TOKEN = 4.0  # a byte-level BPE's usual ratio on English and code
