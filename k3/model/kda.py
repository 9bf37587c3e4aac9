"""Kimi Delta Attention layer (report §2.1.1), parameter names as in the official checkpoint."""

from __future__ import annotations

import torch
from torch import nn

from k3.config import K3Config
from k3.model.batch import BatchInfo
from k3.model.cache import KDAInputs, KDALayerCache
from k3.model.common import Linear, RMSNorm, stacked_linear
from k3.ops.gate_norm import gate_norm
from k3.ops.kda_backend import kda as kda_mix
from k3.ops.kda_backend import short_conv
from k3.ops.kda_decode import KDAStore, kda_decode
from k3.ops.kda_replay import kda_replay_any, kda_replay_layers_any
from k3.ops.kda_verify_step import kda_verify_step_any
from k3.ops.registry import Backends, dispatch


class KimiDeltaAttention(nn.Module):
    backends: Backends | None = None  # which implementations run the ops (K3ForCausalLM.set_backends)

    def __init__(self, cfg: K3Config, layer_idx: int):
        super().__init__()
        D, H, K = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        P, W = H * K, cfg.kda_short_conv_kernel_size
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, H, K
        self.lower_bound = cfg.kda_gate_lower_bound
        self.q_proj = Linear(D, P, bias=False)
        self.k_proj = Linear(D, P, bias=False)
        self.v_proj = Linear(D, P, bias=False)
        # Depthwise causal convs; nn.Conv1d only holds the [P, 1, W] weight, the op does the math.
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        # Decay logits z = W_up W_down x + dt_bias, low rank = head_dim (f_a: D -> K, f_b: K -> P).
        self.f_a_proj = Linear(D, K, bias=False)
        self.f_b_proj = Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.zeros(H))  # one log-scale per head, initialized 0 (report §2.1.1)
        self.dt_bias = nn.Parameter(torch.zeros(P))
        self.b_proj = Linear(D, H, bias=False)
        self.g_proj = Linear(D, P, bias=False)  # full-rank output gate
        self.o_norm = RMSNorm(K, eps=cfg.rms_norm_eps)
        self.o_proj = Linear(P, D, bias=False)

    def projection_groups(self) -> tuple[tuple[nn.Linear, ...], ...]:
        """The projections of x that `stacked_linear` computes together, in its order (k3.model.common)."""
        return ((self.q_proj, self.k_proj, self.v_proj, self.f_a_proj, self.b_proj, self.g_proj),)

    def forward(self, x: torch.Tensor, cache: KDALayerCache | None = None, batch: BatchInfo | None = None):
        """x [B, T, D] -> [B, T, D]. `batch`: the batch's record; with segment ids, the documents (offsets
        `batch.cu_seqlens`) run as separate sequences of one row, state and conv reset at each start. `cache`: a
        decode cache (k3.model.cache protocol) the state and conv tails are read from and stored back into."""
        shape = x.shape
        cu_seqlens = cu_seqlens_cpu = None
        if batch is not None and batch.segment_ids is not None:
            if batch.cu_seqlens is None:
                raise ValueError("KDA layers need the documents' offsets: build the record with "
                                 "BatchInfo.from_segment_ids or BatchInfo.from_lengths")
            cu_seqlens, cu_seqlens_cpu = batch.cu_seqlens, batch.cu_seqlens_cpu
            x = x.reshape(1, -1, shape[-1])  # the batch's documents as the sequences of one row
        context = batch.context if batch is not None else None
        if context is not None and cache is not None:
            raise ValueError("context parallelism is a training forward: give no cache with it")
        local_cu = None if context is None else (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens)
        pending = cache.pending_replay() if hasattr(cache, "pending_replay") else None
        if pending is not None:  # a verification with the previous cycle's accepted positions replayed in front
            if cu_seqlens is not None:
                raise ValueError("a fused verify-replay forward runs rows of one length, not packed documents")
            out, inputs = self.verify_replay(x, *pending)
            cache.replayed(inputs)
            return out.view(shape)
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        P = H * K
        store = cache.decode_store() if T == 1 and cu_seqlens is None and hasattr(cache, "decode_store") else None
        if store is not None:  # a single-token step on states a cache holds in rows: one fused update in place
            xq, xk, xv, f_a, beta_logits, gate = stacked_linear(x, self.q_proj, self.k_proj, self.v_proj,
                                                                self.f_a_proj, self.b_proj, self.g_proj)
            conv_w = (self.q_conv1d.weight[:, 0], self.k_conv1d.weight[:, 0], self.v_conv1d.weight[:, 0])
            fused = None if torch.is_grad_enabled() else dispatch("kda_decode_decay_proj", xq, self.backends)
            if fused is not None and fused.name == "triton":
                # the decay's up-projection inside the decode kernel (one GEMM fewer per layer and step)
                o = fused.fn(xq[:, 0], xk[:, 0], xv[:, 0], f_a[:, 0], self.f_b_proj.weight, beta_logits[:, 0],
                             gate[:, 0], conv_w, self.A_log, self.dt_bias, self.lower_bound, self.o_norm.weight,
                             self.o_norm.eps, store, self.backends)
            else:
                o = kda_decode(xq[:, 0], xk[:, 0], xv[:, 0], self.f_b_proj(f_a)[:, 0], beta_logits[:, 0],
                               gate[:, 0], conv_w, self.A_log, self.dt_bias, self.lower_bound, self.o_norm.weight,
                               self.o_norm.eps, store, backends=self.backends)
            return self.o_proj(o.to(x.dtype)).view(shape)
        # every projection of x as one GEMM: q, k, v, the decay's low-rank down projection, beta logits, output gate
        if cache is None:
            # q, k and v side by side through one depthwise conv (the conv is per channel, so this is the same
            # math as three): one kernel each way instead of three
            qkv, f_a, beta_logits, gate = stacked_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.f_a_proj,
                                                         self.b_proj, self.g_proj)
            w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])
            # under context parallelism a continued first document's conv reads the previous segment's last inputs
            halo = None if context is None else context.conv_halo(qkv, w.shape[-1], local_cu)
            q, k, v = short_conv(qkv, w, halo, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                 output_state=False, backends=self.backends)[0].split(P, dim=-1)
            state = None
        else:
            state, conv = cache.read()
            xq, xk, xv, f_a, beta_logits, gate = stacked_linear(x, self.q_proj, self.k_proj, self.v_proj,
                                                                self.f_a_proj, self.b_proj, self.g_proj)
            q, cq = short_conv(xq, self.q_conv1d.weight, conv[0], cu_seqlens=cu_seqlens, backends=self.backends)
            k, ck = short_conv(xk, self.k_conv1d.weight, conv[1], cu_seqlens=cu_seqlens, backends=self.backends)
            v, cv = short_conv(xv, self.v_conv1d.weight, conv[2], cu_seqlens=cu_seqlens, backends=self.backends)
        z = self.f_b_proj(f_a).view(B, T, H, K)
        # L2 norm of q/k, the lower-bounded gate and the beta sigmoid happen inside (fused on the fla backend).
        if context is not None:  # KCP: this segment's incoming state from the earlier segments
            o = context.kda(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), z, beta_logits.contiguous(),
                            self.A_log, self.dt_bias, self.lower_bound, local_cu, backends=self.backends)
        else:
            o, new_state = kda_mix(q.view(B, T, H, K), k.view(B, T, H, K), v.view(B, T, H, K), z,
                                   beta_logits.contiguous(), self.A_log, self.dt_bias, self.lower_bound,
                                   initial_state=state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                                   backends=self.backends)
        if cache is not None:
            cache.update(new_state, [cq, ck, cv], KDAInputs((xq, xk, xv), q.view(B, T, H, K), k.view(B, T, H, K),
                                                            v.view(B, T, H, K), z, beta_logits))
        # per-head RMSNorm times sigmoid(output gate), in fp32 (one fused kernel each way on the fla backend)
        o = gate_norm(o, gate.view(B, T, H, K), self.o_norm.weight, self.o_norm.eps, backends=self.backends)
        return self.o_proj(o.reshape(B, T, H * K).to(x.dtype)).view(shape)

    def replay(self, inputs: KDAInputs, state: torch.Tensor, conv: torch.Tensor,
               lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """KDA rollback by replay (report §5.4.2): the state [N, H, K, V] fp32 and conv tails [N, 3, P, W-1] after the
        first lengths[n] positions of row n of `inputs` (projected inputs a verification forward kept, [N, L, ...]),
        from the committed `state` and `conv`. The recurrence of those positions again (k3.ops.kda_replay), under
        this layer's gate parameters; no outputs are computed (the verification produced them)."""
        pre_conv = torch.stack(inputs.pre_conv, 2)
        return kda_replay_any(inputs.q, inputs.k, inputs.v, inputs.z, inputs.beta_logits, pre_conv, self.A_log,
                              self.dt_bias, self.lower_bound, state, conv, lengths, backends=self.backends)

    def verify_replay(self, x: torch.Tensor, pending: KDAInputs, lengths: list[int] | torch.Tensor,
                      store: KDAStore) -> tuple[torch.Tensor, KDAInputs]:
        """A verification forward of the window x [N, T, D] with the replay of the previous cycle's accepted
        positions fused in front (report §5.4.2, k3.ops.kda_verify_step): the first lengths[n] positions of row n
        of `pending` (a verification's kept inputs, [N, P, ...]; 0 for none; host ints or an int tensor [N] on the
        device, never read back: a captured verification step's) advance row n of `store` (its committed state
        [H, K, V] fp32 and conv tails [3, H*K, W-1], updated in place to after those positions), then the window
        runs from there. Returns (the window's outputs [N, T, D], as `forward` from the state after the pending
        positions gives them; the window's projected inputs, the next cycle's pending ones)."""
        N, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        # q, k and v as one output (column slices of it, read in place), then the decay's input, beta, output gate
        qkv, f_a, beta_logits, gate = stacked_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.f_a_proj,
                                                     self.b_proj, self.g_proj)
        pre = qkv.view(N, T, 3, H * K).unbind(2)
        z = self.f_b_proj(f_a).view(N, T, H, K)
        w = (self.q_conv1d.weight[:, 0], self.k_conv1d.weight[:, 0], self.v_conv1d.weight[:, 0])
        p = pending
        r = kda_verify_step_any(p.k, p.v, p.z, p.beta_logits, p.pre_conv, lengths, pre, z, beta_logits, gate, w,
                                self.A_log, self.dt_bias, self.lower_bound, self.o_norm.weight, self.o_norm.eps, store,
                                backends=self.backends)
        return self.o_proj(r.y), KDAInputs(pre, r.q, r.k, r.v, z, beta_logits)


def replay_layers(layers: list[KimiDeltaAttention], k: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
                  beta_logits: torch.Tensor, pre_conv: torch.Tensor, state: torch.Tensor, conv: torch.Tensor,
                  lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`KimiDeltaAttention.replay` of G layers at once (one kernel launch where op kda_replay runs its kernel): layer
    g's kept inputs are k[g], v[g], z[g], beta_logits[g] ([N, L, ...] each) and pre_conv[g] [N, L, 3, P], its
    committed states state[g * N:(g + 1) * N] and conv tails likewise (layer-major); each under its own gate
    parameters. Returns the states and conv tails after each request's first lengths[n] positions, layer-major."""
    if len({layer.lower_bound for layer in layers}) != 1:
        raise ValueError("replay_layers: the layers' kda_gate_lower_bound differ")
    A_log = torch.stack([layer.A_log for layer in layers])
    dt_bias = torch.stack([layer.dt_bias.reshape(-1) for layer in layers])
    return kda_replay_layers_any(k, v, z, beta_logits, pre_conv, A_log, dt_bias, layers[0].lower_bound, state, conv,
                                 lengths, backends=layers[0].backends)
