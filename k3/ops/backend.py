"""Which implementation runs each op that has a GPU fast path.

Every op has a PyTorch reference (the definition, runs anywhere) and one fast backend:

    op         fast backend   what it is
    kda        fla            fla-core's chunk_kda / fused_recurrent_kda (gate, L2 norm, beta fused)
    short_conv fla            fla-core's causal_conv1d (KDA's q/k/v depthwise conv + SiLU, varlen, states)
    attn_res   fla            fla-core's fused_attnres (one pass over all sources, forward and backward)
    mla        flex           torch's flex_attention, compiled, with a block mask for causal + document masking
                              (no T x T matrix; the per-head max logit for QK-Clip comes out of the kernel)
    moe        grouped        tokens sorted by expert, torch._grouped_mm for the expert GEMMs
    moe_combine triton        the weighted sum of each token's k expert outputs as one Triton kernel per pass
                              (k3.ops.moe_combine): no token-order copy, no fp32 [N, k, L] intermediates; the
                              same kernel is the backward of the dispatch gather (no scatter into zeros)
    situ       triton         SiTU-GLU forward and backward as one Triton kernel each (k3.ops.situ_triton)
    mla_decode triton         single-token MLA decode straight from the serving page pool, split-K
                              (k3.ops.mla_decode); no gathered or fp32 copy of the cache
    muon       triton         Per-Head Muon's momentum and update passes as one Triton kernel each
                              (k3.ops.muon_update), around the batched Newton-Schulz GEMMs
    gate_norm  fla            fla-core's rms_norm_gated: KDA's per-head output RMSNorm times sigmoid(gate)
                              as one kernel each way (k3.ops.gate_norm)
    linear_ce  triton         the output head's cross-entropy gradient (log-sum-exp, softmax - onehot) in one
                              kernel, in place on the chunk's logits (k3.ops.linear_ce)
    rms_norm   triton         RMSNorm of bf16 activations with an fp32 weight (the release's roundings) as one
                              Triton kernel each way, the weight's gradient from per-program partial sums
                              (k3.ops.rms_norm)
    kda_host_offsets fla      fla's KDA and conv take their packed-document chunk lists from offsets the trainer
                              computed on the host, so a training forward never waits for the device
                              (k3.ops.kda_backend); its reference is fla building those lists on the device

The choice never changes the math, only where it runs. `auto` (the default) picks the fast backend on CUDA
when it is installed and validated (VALIDATED below: its GPU tests in tests/ops/ passed on an H200 with this
code) and the reference otherwise. The environment variables K3_KDA_BACKEND, K3_ATTN_RES_BACKEND,
K3_MLA_BACKEND, K3_MOE_BACKEND, K3_MOE_COMBINE_BACKEND, K3_SITU_BACKEND, K3_MLA_DECODE_BACKEND,
K3_SHORT_CONV_BACKEND, K3_MUON_BACKEND, K3_GATE_NORM_BACKEND, K3_LINEAR_CE_BACKEND, K3_KDA_HOST_OFFSETS_BACKEND and
K3_RMS_NORM_BACKEND
(values: auto, torch, or the fast backend's name; `torch` is the reference) override it per op.
Asking for a fast backend that cannot run is an error; `auto` falling back on a GPU prints a one-time notice
saying why.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import torch

FAST = {"kda": "fla", "attn_res": "fla", "mla": "flex", "moe": "grouped", "situ": "triton", "mla_decode": "triton",
        "short_conv": "fla", "moe_combine": "triton", "muon": "triton", "gate_norm": "fla",
        "linear_ce": "triton", "kda_host_offsets": "fla", "rms_norm": "triton"}
# True once the backend's op-level GPU tests (forward and backward against the reference, tests/ops/) passed on an
# H200 with this code: attn_res, mla, moe, situ (2026-11-29), mla_decode (2026-11-29), kda and short_conv
# (2026-11-30: fla's chunk and decode KDA at k3-mini's shapes, packed and not, and the causal conv, packed and not).
# moe_combine (op tests), gate_norm (op tests and the in-situ model test) and linear_ce (op tests at k3-mini's head
# shapes) 2026-11-30; kda_host_offsets (tests/ops/test_kda_backend.py, the in-situ case and the sync-free check in
# tests/model/test_fast_backends_gpu.py) 2026-11-30. The Muon update kernels measured no faster than PyTorch's
# update: `auto` keeps the reference. rms_norm (tests/ops/test_rms_norm.py at k3-mini's hidden and latent shapes)
# 2026-11-30.
VALIDATED = {"kda": True, "attn_res": True, "mla": True, "moe": True, "situ": True, "mla_decode": True,
             "short_conv": True, "moe_combine": True, "muon": False, "gate_norm": True,
             "linear_ce": True, "kda_host_offsets": True, "rms_norm": True}
# Fast backends that also run on CPU (used when asked for explicitly; `auto` keeps the reference on CPU): the
# grouped GEMM has a CPU implementation; the paged decode, the Muon update and the cross-entropy kernels run in
# Triton's interpreter (TRITON_INTERPRET=1; the decode otherwise on its gather-based reference).
CPU_OK = {"moe", "mla_decode", "muon", "linear_ce"}

_notices: set[str] = set()


def importable(module: str) -> tuple[bool, str]:
    """(True, "") when `module` imports, else (False, why) — the availability check of a kernel library.

    Before fla is first imported, Triton is asked to keep autotuning results on disk (TRITON_CACHE_AUTOTUNING=1,
    unless the variable is already set): fla's KDA kernels otherwise re-autotune in every new process, minutes
    per shape. The setting is read when fla's kernels are defined, so it has to precede the import."""
    if module.startswith("fla") and "fla" not in sys.modules:
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    try:
        __import__(module)
    except Exception as e:  # ImportError, or a Triton/driver problem at import
        hint = "; install it with `pip install k3[gpu]`" if module.startswith("fla") else ""
        return False, f"{module} is not importable ({type(e).__name__}: {e}){hint}"
    return True, ""


def force_all(mode: str, overwrite: bool = True) -> None:
    """Set every op's environment variable: mode 'fast' (each op's fast backend) or 'torch' (the reference);
    with overwrite=False, variables already set to a backend (anything but unset or 'auto') are kept, so one op
    can be pinned while a blanket choice sets the rest."""
    if mode not in ("fast", "torch"):
        raise ValueError(f"mode must be 'fast' or 'torch', got {mode!r}")
    for op, fast in FAST.items():
        if overwrite or os.environ.get(env_var(op), "auto").strip().lower() == "auto":
            os.environ[env_var(op)] = fast if mode == "fast" else "torch"


def env_var(op: str) -> str:
    return f"K3_{op.upper()}_BACKEND"


def notice(message: str) -> None:
    """Print `message` to stderr once per process."""
    if message not in _notices:
        _notices.add(message)
        print(f"k3: {message}", file=sys.stderr)


def resolve(op: str, device: torch.device, available: Callable[[], tuple[bool, str]],
            requested: str | None = None) -> str:
    """'torch' or FAST[op] for tensors on `device`. `available()` says whether the fast backend can run
    here (and why not); `requested` overrides the environment variable."""
    fast = FAST[op]
    var = env_var(op)
    req = (requested or os.environ.get(var, "auto")).lower()
    if req not in ("auto", "torch", fast):
        raise ValueError(f"{var}={req!r} is invalid: use auto, torch or {fast}")
    if req == "torch":
        return "torch"
    if device.type != "cuda" and op not in CPU_OK:
        if req == fast:
            raise ValueError(f"the {fast} {op} backend needs CUDA tensors, got device {device}")
        return "torch"
    if device.type != "cuda" and req == "auto":
        return "torch"
    ok, why = available()
    if ok and req == "auto" and not VALIDATED[op]:
        ok, why = False, (f"the {fast} backend is not yet validated against the reference on GPU "
                          f"({var}={fast} forces it)")
    if not ok:
        if req == fast:
            raise ValueError(f"{var}={fast}: {why}")
        notice(f"{op} runs on its reference path: {why}")
        return "torch"
    return fast
