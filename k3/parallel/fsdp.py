"""FSDP2 (`fully_shard`) over a finished K3 model: one unit per mixer (KDA / Gated MLA) and per FFN (MLP /
LatentMoE) of every decoder layer and MTP layer, one for the embedding, and the root (norms, AttnRes
pseudo-queries, the head).

The units are the sublayers, not the decoder layers: a decoder layer advances the AttnRes stream in place and
returns no tensor, so FSDP2 could not hook its backward; a sublayer maps tensors to tensors.

Mixed precision goes through FSDP2's policy: parameters all-gathered in bf16 for compute, gradients reduced in
fp32 into fp32 master weights, and the optimizer state (created on the sharded parameters) sharded with them.
The release's fp32 parameters (the KDA decay and conv taps, k3.model.model.FP32_PARAM_SUFFIXES) must stay fp32 in
compute too, so every Kimi Delta Attention module is its own unit with an fp32 policy.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from k3.model.kda import KimiDeltaAttention

# A sublayer's output is often a view (a reshape); FSDP2 warns that an in-place op on it would skip its backward
# hook. The AttnRes stream only ever adds sublayer outputs out of place (AttnResStream.add), so the warning is noise.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` (a K3ForCausalLM) over the 1-D `mesh` in place and return it. `param_dtype` None: compute in
    the parameters' own dtype (fp32 runs equal the single-device run); bf16: FSDP2 casts each unit's parameters
    for compute and reduces gradients in fp32."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    fp32 = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32 if param_dtype else None)
    layers = list(model.model.layers) + [m.block for m in model.mtp]
    for layer in layers:
        policy = fp32 if isinstance(layer.self_attn, KimiDeltaAttention) else mp
        fully_shard(layer.self_attn, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
        fully_shard(layer.ffn, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if not model.config.tie_word_embeddings:  # a tied embedding shares its weight with the head: root unit
        fully_shard(model.model.embed_tokens, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    if model.vision is not None:
        fully_shard(model.vision, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)  # the root is needed right after
    return model
