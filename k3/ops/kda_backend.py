"""KDA's implementations: the PyTorch reference (k3.ops.kda) or fla-core's Triton kernels (`chunk_kda` for training
and prefill, `fused_recurrent_kda` for decode) with the gate, q/k L2 norm and beta sigmoid fused in the kernel; and
KDA's short convolution, the reference or fla-core's `causal_conv1d`.

The choice never changes the math, only where it runs: ops ``kda`` and ``short_conv`` of k3.ops.registry.
"""

from __future__ import annotations


import torch

from k3.ops import kda as ref
from k3.ops.registry import DEFAULT, Backends, Fast, Op, dispatch, importable, register
from k3.tensors import LastResult, to_device_async


# fla's varlen kernels walk each document in chunks of this many tokens (chunk_kda's and causal_conv1d's default)
FLA_CHUNK = 64


def host_offsets_enabled(backends: Backends | None = None) -> bool:
    """Whether fla's KDA and conv take their varlen chunk lists from host offsets when a caller has them (the
    trainer): chunk_kda's fixed-shape list (`use_graph`) and a list built on the host for the conv, so that a
    training forward never waits for the device. ``Backends.kda_host_offsets``: None (the default) and True turn it
    on, False leaves fla to build its lists on the device."""
    return (backends or DEFAULT).kda_host_offsets is not False


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
        cu_seqlens_cpu=None, backends: Backends | None = None):
    """One KDA layer's sequence mixing from its raw inputs, on the implementation the registry picks for q (op
    ``kda``).

    q, k, v: [B, T, H, K] after the short conv and SiLU (q, k not yet L2-normalized); z: [B, T, H, K] decay
    logits before dt_bias; beta_logits: [B, T, H]; A_log: [H]; dt_bias: [H*K]. Returns (o [B, T, H, V],
    final state [N, H, K, V] fp32). The token recurrence is used for single-token steps, the chunkwise form
    otherwise (both exact). `cu_seqlens_cpu`, the same offsets as `cu_seqlens` on the host, lets fla's chunk
    kernels run without reading anything back from the device (their fixed-shape chunk list, `use_graph`) when
    `host_offsets_enabled`."""
    return dispatch("kda", q, backends).fn(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound, initial_state,
                                           cu_seqlens, cu_seqlens_cpu, backends)


def kda_torch(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound: float, initial_state=None, cu_seqlens=None,
              cu_seqlens_cpu=None, backends: Backends | None = None):
    """The reference: the gate, L2 norms and beta sigmoid, then the token recurrence (T == 1) or the chunkwise
    form (k3.ops.kda). `cu_seqlens_cpu` and `backends` are accepted for the common signature and not needed."""
    g = ref.kda_gate(z, A_log, dt_bias, lower_bound)
    # normalized in fp32 and kept there (as fla's kernels do in-kernel): rounding the unit vectors to bf16 moved the
    # state by ~2e-3 of its largest entry
    qn, kn = ref.l2norm(q.float()), ref.l2norm(k.float())
    beta = torch.sigmoid(beta_logits.float())
    if q.shape[1] == 1:
        return ref.kda_recurrent(qn, kn, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens)
    # g >= lower_bound by construction (kda_gate), so the chunk need not read g's minimum back from the device
    return ref.kda_chunk(qn, kn, v, g, beta, initial_state=initial_state, cu_seqlens=cu_seqlens, g_min=lower_bound)


def kda_fla(q, k, v, z, beta_logits, A_log, dt_bias, lower_bound: float, initial_state=None, cu_seqlens=None,
            cu_seqlens_cpu=None, backends: Backends | None = None):
    """fla-core's kernels: ``fused_recurrent_kda`` for a single-token step without gradients, ``chunk_kda``
    otherwise (with the chunk list from `cu_seqlens_cpu` when `host_offsets_enabled`)."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    common = dict(A_log=A_log.float(), dt_bias=dt_bias.float(), initial_state=initial_state,
                  output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound, cu_seqlens=cu_seqlens)
    if q.shape[1] == 1 and not torch.is_grad_enabled():
        return fused_recurrent_kda(q, k, v, z, beta_logits, **common)
    host = {}
    if cu_seqlens is not None and cu_seqlens_cpu is not None and host_offsets_enabled(backends):
        host = dict(cu_seqlens_cpu=cu_seqlens_cpu, use_graph=True)
    return chunk_kda(q, k, v, z, beta_logits, safe_gate=True, **common, **host)


def short_conv(x, weight, conv_state=None, cu_seqlens=None, cu_seqlens_cpu=None, output_state: bool = True,
               backends: Backends | None = None):
    """``k3.ops.kda.short_conv`` (depthwise causal conv + SiLU; state = the last W-1 inputs [N, C, W-1], oldest
    first) on the implementation the registry picks for x (op ``short_conv``: fla-core's Triton ``causal_conv1d``
    on GPU). Returns (y in x.dtype, new state fp32, or None with output_state=False). `cu_seqlens_cpu` (the offsets
    on the host) spares fla building its chunk list on the device (see `host_chunk_indices`) when
    `host_offsets_enabled`."""
    return dispatch("short_conv", x, backends).fn(x, weight, conv_state, cu_seqlens, cu_seqlens_cpu, output_state,
                                                  backends)


def short_conv_torch(x, weight, conv_state=None, cu_seqlens=None, cu_seqlens_cpu=None, output_state: bool = True,
                     backends: Backends | None = None):
    """The reference, k3.ops.kda.short_conv (`cu_seqlens_cpu` and `backends` are not needed)."""
    y, state = ref.short_conv(x, weight, conv_state, cu_seqlens=cu_seqlens)
    return y, (state if output_state else None)


def short_conv_fla(x, weight, conv_state=None, cu_seqlens=None, cu_seqlens_cpu=None, output_state: bool = True,
                   backends: Backends | None = None):
    """fla-core's ``causal_conv1d``. fla keeps W columns of state with the oldest slot unused, so ours is padded in
    front on the way in and its last W-1 columns are taken on the way out."""
    from fla.modules.causal_conv1d import causal_conv1d

    w = weight[:, 0] if weight.dim() == 3 else weight
    init = None if conv_state is None else torch.nn.functional.pad(conv_state.to(x.dtype), (1, 0))
    chunks = None
    if cu_seqlens is not None and cu_seqlens_cpu is not None and host_offsets_enabled(backends):
        chunks = host_chunk_indices(cu_seqlens_cpu, cu_seqlens.device, cu_seqlens.dtype)
    y, final = causal_conv1d(x, w, initial_state=init, output_final_state=output_state, activation="silu",
                             cu_seqlens=cu_seqlens, chunk_indices=chunks)
    return y, (final[..., 1:].float() if output_state else None)


def kda_chunk_fla(q, k, v, g, beta, scale=None, initial_state=None, cu_seqlens=None, g_min=None):
    """k3.ops.kda.kda_chunk's contract (q, k L2-normalized, g the log-decay, beta after its sigmoid; returns (o,
    final state [N, H, K, V] fp32)) on fla-core's ``chunk_kda``: what KDA context parallelism runs its fragment pass
    and segments with (k3.parallel.context_parallel, op ``kda_chunk``). `g_min`: a lower bound of g, which lets fla
    take its bounded-gate path."""
    from fla.ops.kda import chunk_kda

    bounded = dict(safe_gate=True, lower_bound=g_min) if g_min is not None else {}
    o, final = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                         cu_seqlens=cu_seqlens, **bounded)
    return o, final.float()


register(Op(
    "kda_chunk", reference=ref.kda_chunk,
    # not validated until its GPU test (tests/parallel/test_context_parallel.py, marked gpu) has passed: `auto` keeps
    # the reference, `--backend fast` or per_op={"kda_chunk": "fla"} asks for it
    fast=(Fast("fla", kda_chunk_fla, lambda t: importable("fla.ops.kda"), validated=False),),
    tolerance="as op kda: fp32 inputs 5e-3 of the largest entry (the kernel's dot products run in reduced "
              "precision), gradients 1e-2"))
register(Op(
    "kda", reference=kda_torch,
    fast=(Fast("fla", kda_fla, lambda t: importable("fla.ops.kda"), validated=True),),
    tolerance="bf16 inputs against the fp32 reference: 5e-2 of the largest entry (bf16 rounding of q, k, v, o inside "
              "the kernel); fp32 inputs 5e-3 (the kernel's dot products run in reduced precision); decode 2e-2",
    options=("kda_host_offsets",)))
register(Op(
    "short_conv", reference=short_conv_torch,
    fast=(Fast("fla", short_conv_fla, lambda t: importable("fla.modules.causal_conv1d"), validated=True),),
    tolerance="bf16 input: 2e-2 of the largest entry (one bf16 rounding of the output and gradients); the carried "
              "states exact up to bf16 storage of the inputs",
    options=("kda_host_offsets",)))
