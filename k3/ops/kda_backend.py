"""KDA backends: the PyTorch reference (k3.ops.kda) or fla-core's Triton kernels (`chunk_kda` for training and
prefill, `fused_recurrent_kda` for decode) with the gate, q/k L2 norm and beta sigmoid fused in the kernel.

The choice never changes the math, only where it runs; k3.ops.backend decides (K3_KDA_BACKEND=auto|torch|fla).
"""

from __future__ import annotations


import torch

from k3.ops import kda as ref
from k3.ops.backend import importable
from k3.ops.backend import resolve as _resolve
from k3.utils import LastResult, to_device_async


def resolve_backend(device: torch.device, requested: str | None = None) -> str:
    """'torch' or 'fla' (see k3.ops.backend; environment variable K3_KDA_BACKEND)."""
    return _resolve("kda", device, lambda: importable("fla.ops.kda"), requested)


# fla's varlen kernels walk each document in chunks of this many tokens (chunk_kda's and causal_conv1d's default)
FLA_CHUNK = 64


def host_offsets_enabled(device: torch.device) -> bool:
    """Whether fla's KDA and conv take their varlen chunk lists from host offsets when a caller has them (the
    trainer): chunk_kda's fixed-shape list (`use_graph`) and a list built on the host for the conv, so that a
    training forward never waits for the device. Backend op ``kda_host_offsets`` (K3_KDA_HOST_OFFSETS_BACKEND,
    fla = on, torch = fla's own lists built on the device); `auto` takes it once its GPU tests have passed."""
    return _resolve("kda_host_offsets", device, lambda: importable("fla.ops.kda")) == "fla"


_chunk_lists = LastResult()  # every KDA layer of a forward asks for the same list


def host_chunk_indices(cu_seqlens_cpu: torch.Tensor, device: torch.device, dtype: torch.dtype,
                       chunk: int = FLA_CHUNK) -> torch.Tensor:
    """fla's varlen chunk list, (document, chunk of `chunk` tokens) pairs [NT, 2], built on the host from the
    document offsets `cu_seqlens_cpu` and copied to `device` (through pinned memory, without waiting for the
    device). fla builds it on the device otherwise, reading its length back, which stalls the host until the
    device has finished everything queued before. The result of the previous call is reused for the same offsets
    tensor (every KDA layer of a forward asks for it)."""
    def build():
        cu = cu_seqlens_cpu.to(torch.int64)
        counts = (cu[1:] - cu[:-1] + chunk - 1) // chunk
        seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        starts = torch.cumsum(counts, 0) - counts
        intra = torch.arange(seq.numel()) - starts[seq]
        return to_device_async(torch.stack([seq, intra], 1).to(dtype), device)

    return _chunk_lists.get((cu_seqlens_cpu, torch.device(device), dtype, chunk), build)


def kda(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound: float, initial_state=None, cu_seqlens=None,
        backend: str | None = None, cu_seqlens_cpu=None):
    """One KDA layer's sequence mixing from its raw inputs.

    q, k, v: [B, T, H, K] after the short conv and SiLU (q, k not yet L2-normalized); z: [B, T, H, K] decay
    logits before dt_bias; beta_logits: [B, T, H]; A_log: [H]; dt_bias: [H*K]. Returns (o [B, T, H, V],
    final state [N, H, K, V] fp32). The token recurrence is used for single-token steps, the chunkwise form
    otherwise (both exact). `cu_seqlens_cpu`, the same offsets as `cu_seqlens` on the host, lets fla's chunk
    kernels run without reading anything back from the device (their fixed-shape chunk list, `use_graph`) when
    `host_offsets_enabled`."""
    T = q.shape[1]
    if resolve_backend(q.device, backend) == "fla":
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        common = dict(A_log=A_log.float(), dt_bias=dt_bias.float(), initial_state=initial_state,
                      output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                      use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, cu_seqlens=cu_seqlens)
        if T == 1 and not torch.is_grad_enabled():
            return fused_recurrent_kda(q, k, v, z, beta_logits, **common)
        host = {}
        if cu_seqlens is not None and cu_seqlens_cpu is not None and host_offsets_enabled(q.device):
            host = dict(cu_seqlens_cpu=cu_seqlens_cpu, use_graph=True)
        return chunk_kda(q, k, v, z, beta_logits, safe_gate=True, **common, **host)
    g = ref.kda_gate(z, A_log, dt_bias, lower_bound)
    qn, kn = ref.l2norm(q), ref.l2norm(k)
    beta = torch.sigmoid(beta_logits.float())
    if T == 1:
        return ref.kda_recurrent(qn, kn, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    # g >= lower_bound by construction (kda_gate), so the chunk need not read g's minimum back from the device
    return ref.kda_chunk(qn, kn, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, g_min=lower_bound)


def short_conv(x, weight, conv_state=None, cu_seqlens=None, backend: str | None = None, cu_seqlens_cpu=None,
               output_state: bool = True):
    """``k3.ops.kda.short_conv`` (depthwise causal conv + SiLU; state = the last W-1 inputs [N, C, W-1],
    oldest first) on the backend k3.ops.backend picks (K3_SHORT_CONV_BACKEND=auto|torch|fla): fla-core's
    Triton ``causal_conv1d`` on GPU. fla keeps W columns of state with the oldest slot unused, so ours is
    padded in front on the way in and its last W-1 columns are taken on the way out. Returns (y in x.dtype,
    new state fp32, or None with output_state=False). `cu_seqlens_cpu` (the offsets on the host) spares fla
    building its chunk list on the device (see `host_chunk_indices`) when `host_offsets_enabled`."""
    if _resolve("short_conv", x.device, lambda: importable("fla.modules.causal_conv1d"), backend) == "fla":
        from fla.modules.causal_conv1d import causal_conv1d

        w = weight[:, 0] if weight.dim() == 3 else weight
        init = None if conv_state is None else torch.nn.functional.pad(conv_state.to(x.dtype), (1, 0))
        chunks = None
        if cu_seqlens is not None and cu_seqlens_cpu is not None and host_offsets_enabled(x.device):
            chunks = host_chunk_indices(cu_seqlens_cpu, cu_seqlens.device, cu_seqlens.dtype)
        y, final = causal_conv1d(x, w, initial_state=init, output_final_state=output_state, activation="silu",
                                 cu_seqlens=cu_seqlens, chunk_indices=chunks)
        return y, (final[..., 1:].float() if output_state else None)
    y, state = ref.short_conv(x, weight, conv_state, cu_seqlens=cu_seqlens)
    return y, (state if output_state else None)

