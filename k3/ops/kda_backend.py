"""KDA backends: the PyTorch reference (k3.ops.kda) or fla-core's Triton kernels (`chunk_kda` for training and
prefill, `fused_recurrent_kda` for decode) with the gate, q/k L2 norm and beta sigmoid fused in the kernel.

The choice never changes the math, only where it runs: `auto` (the default) uses fla on CUDA when fla-core
is installed (and validated, see FLA_VALIDATED) and the reference otherwise; the environment variable K3_KDA_BACKEND=torch|fla|auto overrides
it. Falling back on a GPU prints a one-time notice saying why.
"""

from __future__ import annotations

import os
import sys

import torch

from k3.ops import kda as ref

_notices: set[str] = set()
# `auto` picks fla only once tests/ops/test_kda_backend.py's GPU tests have passed on a GPU with this code;
# until then fla runs only when asked for explicitly (K3_KDA_BACKEND=fla).
FLA_VALIDATED = False


def _fla_available() -> tuple[bool, str]:
    try:
        import fla.ops.kda  # noqa: F401
    except Exception as e:  # ImportError, or a Triton/driver problem at import
        return False, f"fla-core is not importable ({type(e).__name__}: {e}); install it with `pip install k3[gpu]`"
    return True, ""


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    req = (requested or os.environ.get("K3_KDA_BACKEND", "auto")).lower()
    if req not in ("auto", "torch", "fla"):
        raise ValueError(f"K3_KDA_BACKEND={req!r} is invalid: use auto, torch or fla")
    if req == "torch":
        return "torch"
    ok, why = _fla_available()
    if device.type != "cuda":
        if req == "fla":
            raise ValueError(f"the fla KDA backend needs CUDA tensors, got device {device}")
        return "torch"
    if ok and req == "auto" and not FLA_VALIDATED:
        ok, why = False, "the fla backend is not yet validated against the reference on GPU (K3_KDA_BACKEND=fla forces it)"
    if not ok:
        if req == "fla":
            raise ValueError(why)
        if why not in _notices:
            _notices.add(why)
            print(f"k3: KDA runs on the PyTorch reference path: {why}", file=sys.stderr)
        return "torch"
    return "fla"


def kda(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound: float, initial_state=None, cu_seqlens=None,
        backend: str | None = None):
    """One KDA layer's sequence mixing from its raw inputs.

    q, k, v: [B, T, H, K] after the short conv and SiLU (q, k not yet L2-normalized); z: [B, T, H, K] decay
    logits before dt_bias; beta_logits: [B, T, H]; A_log: [H]; dt_bias: [H*K]. Returns (o [B, T, H, V],
    final state [N, H, K, V] fp32). The token recurrence is used for single-token steps, the chunkwise form
    otherwise (both exact)."""
    T = q.shape[1]
    if resolve_backend(q.device, backend) == "fla":
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        common = dict(A_log=A_log.float(), dt_bias=dt_bias.float(), initial_state=initial_state,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, cu_seqlens=cu_seqlens)
        if T == 1 and not torch.is_grad_enabled():
            return fused_recurrent_kda(q, k, v, z, beta_logits, **common)
        return chunk_kda(q, k, v, z, beta_logits, safe_gate=True, **common)
    g = ref.kda_gate(z, A_log, dt_bias, lower_bound)
    qn, kn = ref.l2norm(q), ref.l2norm(k)
    beta = torch.sigmoid(beta_logits.float())
    fn = ref.kda_recurrent if T == 1 else ref.kda_chunk
    return fn(qn, kn, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
