"""K3ForCausalLM: embedding -> 93 hybrid layers over a Block-AttnRes stream -> output site -> norm -> head."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import record_function

from k3.config import K3Config, VisionConfig
from k3.model.attn_res import residual_stream, site_query
from k3.model.batch import BatchInfo, packed_cu_seqlens  # noqa: F401  (packed_cu_seqlens: re-exported)
from k3.model.block import DecoderLayer
from k3.model.cache import K3Cache
from k3.model.common import RMSNorm, set_backends, use_weight_casts
from k3.model.mtp import MTPLayer
from k3.model.stats import ForwardStats, check_stats
from k3.ops.linear_ce import linear_cross_entropy
from k3.ops.registry import Backends
from k3.ops.weight_cast import WeightCasts

# Parameters kept in fp32 whatever the model dtype (they are fp32 in the release, checkpoint-layout §2.9).
FP32_PARAM_SUFFIXES = ("A_log", "dt_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
                       "o_norm.weight", "e_score_correction_bias")


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [B, T, V]
    loss: torch.Tensor | None = None  # next-token cross-entropy when labels are given
    hidden_states: torch.Tensor | None = None  # output-site mix before the final norm [B, T, D]
    mtp_loss: torch.Tensor | None = None  # token t+2 cross-entropy of the MTP layer(s), when labels are given
    stats: ForwardStats | None = None  # the statistics asked for with `stats=` (k3.model.stats), else None
    features: list[torch.Tensor] | None = None  # the AttnRes block outputs asked for with `features=` [B, T, D] each


class K3Model(nn.Module):
    backends: Backends | None = None  # which implementations run the ops (K3ForCausalLM.set_backends)

    def __init__(self, cfg: K3Config):
        super().__init__()
        self.config = cfg
        D = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        if cfg.residual == "attn_res":  # the plain-residual ablation has no output site
            self.output_attn_res_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(D, 1, bias=False)
        self.two_phase_attn_res = False  # inference form of Block AttnRes (same result)
        self.activation_checkpointing = False

    @property
    def activation_checkpointing(self) -> bool:
        """Activation checkpointing of every layer (default off): in training forwards (training mode, gradients
        enabled, no cache, one-pass AttnRes) each layer keeps only its AttnRes sources and recomputes each
        sublayer ("AttnRes mix -> norm -> KDA / MLA" and "AttnRes mix -> norm -> MLP / LatentMoE") in backward.
        Costs about one extra forward of compute; needed for long contexts. Same loss and gradients. Setting it
        sets every backbone layer's `DecoderLayer.activation_checkpointing` (the MTP layers are included by
        `K3ForCausalLM.set_activation_checkpointing`)."""
        return self._activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, enabled: bool) -> None:
        self._activation_checkpointing = bool(enabled)
        for layer in self.layers:
            layer.activation_checkpointing = bool(enabled)

    def _block_sites(self, start: int) -> list:
        """(key, query) of every AttnRes site served by the completed blocks of the block at `start`."""
        S, L = self.config.attn_res_block_size, len(self.layers)
        sites = []
        for i in range(start, min(start + S, L)):
            w_attn, w_mlp = self.layers[i].site_queries()
            if i != start:
                sites.append((("attn", i), w_attn))
            sites.append((("mlp", i), w_mlp))
        if start + S >= L:
            sites.append((("out", None), site_query(self.output_attn_res_norm, self.output_attn_res_proj)))
        return sites

    def _site_queries(self) -> list[torch.Tensor] | None:
        """Every AttnRes site's query in one pass, [2L + 1, D] fp32 (layer i's mixer site at row 2i, its FFN site at
        2i + 1, the output site last): the norms' weights and the projections' stacked, cast and multiplied, five
        operations where site by site it takes three per site (78 kernels per k3-mini decode step). The same
        elementwise products as `site_query`, bit for bit. None for the plain-residual ablation or weights of mixed
        dtypes (then each site computes its own)."""
        if self.config.residual != "attn_res":
            return None
        norms = [n for layer in self.layers for n in (layer.self_attention_res_norm, layer.mlp_res_norm)]
        projs = [p for layer in self.layers for p in (layer.self_attention_res_proj, layer.mlp_res_proj)]
        norms.append(self.output_attn_res_norm)
        projs.append(self.output_attn_res_proj)
        if len({n.weight.dtype for n in norms}) != 1 or len({p.weight.dtype for p in projs}) != 1:
            return None
        g = torch.stack([n.weight for n in norms]).float()
        w = torch.stack([p.weight[0] for p in projs]).float()
        return list((g * w).unbind(0))

    def forward(self, input_ids=None, inputs_embeds=None, cache: K3Cache | None = None,
                segment_ids: torch.Tensor | None = None, batch: BatchInfo | None = None, stats=(),
                features: tuple[int, ...] = ()):
        """Returns the output-site hidden state [B, T, D] (before the final norm), or (that, ForwardStats) when
        `stats` names statistics to return (k3.model.stats; forwards without a cache only).

        `features`: AttnRes block numbers b (1 .. `num_attn_res_blocks`): the return is then (hidden, ForwardStats or
        None, [the output of block b, [B, T, D], for each b asked]), block b being the sum of the outputs of its
        `attn_res_block_size` layers (the stream's completed block b, or its final partial sum for the last block),
        what an EAGLE-3 draft fuses (k3.model.eagle3). The stream holds them anyway: asking costs nothing.

        `batch`: the batch's record (k3.model.batch), or `segment_ids` [B, T] to have it built here. With a cache,
        segment ids [1, T] pack several requests' new tokens into one row (the cache must be `packed`: per-request
        KDA states and one MLA view per layer that attends each request's own context)."""
        batch = _batch_record(segment_ids, batch)
        want = check_stats(stats)
        if want and cache is not None:
            raise ValueError(f"stats={sorted(want)} are training statistics: ask for them in forwards without a cache")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        dev = h.device.type
        if h.dtype == torch.float32 and torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev):
            # Under autocast every layer output, and so every later block sum of the AttnRes stream, is in the
            # autocast dtype; the embedding joins them in it too, as in a bf16 model. Otherwise each site would
            # copy every block to fp32 to mix them, and feed fp32 activations to the bf16 GEMMs, with a cast of
            # each of their gradients back in backward (~15% of a k3-mini training step on an H200).
            h = h.to(torch.get_autocast_dtype(dev))
        if batch is not None:
            batch.check(h.shape[0], h.shape[1])
            segment_ids = batch.segment_ids
        if segment_ids is not None and cache is not None and (segment_ids.shape[0] != 1 or not cache.packed):
            raise ValueError("segment_ids with a cache need a packed cache (one row of several requests' "
                             "tokens, as the serving runner builds) and a batch of one row")
        found = ForwardStats(asked=want) if want else None
        S = self.config.attn_res_block_size
        # forwards without gradients (serving, evaluation, rollouts) may run each AttnRes site and the norm after it
        # as one kernel (k3.ops.attn_res_norm), where the registry picks one
        stream = residual_stream(self.config.residual, h, S, self.config.rms_norm_eps,
                                 two_phase=self.two_phase_attn_res, backends=self.backends,
                                 fuse=not torch.is_grad_enabled())
        # forwards without gradients (serving, evaluation, rollouts) take every site's query at once; a training
        # forward computes each at its site, inside the site's checkpointed region where that is on
        qs = self._site_queries() if not torch.is_grad_enabled() else None
        for i, layer in enumerate(self.layers):
            upcoming = self._block_sites(i) if (stream.two_phase and i % S == 0) else None
            got = layer(stream, cache[i] if cache is not None else None, batch=batch, upcoming=upcoming, stats=want,
                        queries=None if qs is None else (qs[2 * i], qs[2 * i + 1]))
            if found is not None:
                found.add(layer.layer_idx, got)
        if cache is not None:
            cache.seq_len += h.shape[1]
        plain = self.config.residual == "plain"
        hidden = stream.output(None if plain else qs[-1] if qs is not None
                               else site_query(self.output_attn_res_norm, self.output_attn_res_proj))
        if features:
            check_feature_blocks(self.config, features)
            # stream.blocks[0] is the embedding, blocks[b] the b-th completed block; the last block is still open
            feats = [stream.blocks[b] if b < len(stream.blocks) else stream.partial for b in features]
            return hidden, found, feats
        return hidden if found is None else (hidden, found)


def num_attn_res_blocks(cfg: K3Config) -> int:
    """How many AttnRes blocks of layers the backbone has: ceil(num_hidden_layers / attn_res_block_size)."""
    return -(-cfg.num_hidden_layers // cfg.attn_res_block_size)


def check_feature_blocks(cfg: K3Config, blocks) -> None:
    """A ValueError naming the bad block number and the allowed range unless every entry of `blocks` is a block."""
    n = num_attn_res_blocks(cfg)
    for b in blocks:
        if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= n:
            raise ValueError(f"AttnRes block {b!r} is out of range: this model has {n} blocks of "
                             f"{cfg.attn_res_block_size} layers ({cfg.num_hidden_layers} layers), numbered 1 .. {n}")


def _batch_record(segment_ids: torch.Tensor | None, batch: BatchInfo | None) -> BatchInfo | None:
    """The forward's record: `batch`, or one built from `segment_ids` (the convenience form), or None."""
    if segment_ids is None:
        return batch
    if batch is not None:
        raise ValueError("give segment_ids or a batch record (BatchInfo), not both")
    return BatchInfo.from_segment_ids(segment_ids)


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Raise a ValueError naming the range when a token id lies outside [0, vocab_size) (reads the ids back from
    their device)."""
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise ValueError(f"input_ids must lie in [0, vocab_size={vocab_size}), got "
                         f"[{int(input_ids.min())}, {int(input_ids.max())}]")


class K3ForCausalLM(nn.Module):
    backends: Backends | None = None  # which implementations run the ops: see set_backends

    def __init__(self, cfg: K3Config, backends: Backends | None = None):
        super().__init__()
        self.config = cfg
        self.model = K3Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPLayer(cfg, d) for d in range(cfg.num_nextn_predict_layers))
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.vision = None
        if cfg.vision_config is not None:
            from k3.model.vision import VisionEncoder

            self.vision = VisionEncoder(VisionConfig.from_dict(cfg.vision_config))
        self.set_backends(backends)

    # --- construction ---------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> "K3ForCausalLM":
        """Initialization that trains well: N(0, 0.02) matrices (output projections scaled by
        1/sqrt(2L)), unit norms, zero AttnRes pseudo-queries (uniform mixing at the start, report §2.2),
        A = 0 and Kimi Linear's dt_bias (report §2.1.1), zero router bias."""
        gen = torch.Generator(device="cpu")
        gen.manual_seed(0 if seed is None else seed)
        std = self.config.initializer_range
        out_std = std / math.sqrt(2 * self.config.num_hidden_layers)

        def normal_(p, s):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)

        for name, p in self.named_parameters():
            if name.startswith("vision."):
                continue  # the vision encoder initializes itself below
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("_res_proj.weight"):
                p.zero_()
            elif name.endswith("A_log"):
                p.zero_()
            elif name.endswith("dt_bias"):
                p.copy_(_kimi_linear_dt_bias(p.numel(), gen))
            elif name.endswith("conv1d.weight"):
                bound = 1.0 / math.sqrt(p.shape[-1])  # nn.Conv1d's default for a depthwise kernel
                p.copy_(torch.rand(p.shape, generator=gen) * 2 * bound - bound)
            elif any(name.endswith(s) for s in ("o_proj.weight", "down_proj.weight", "experts.w2",
                                                "routed_expert_up_proj.weight")):
                normal_(p, out_std)
            else:
                normal_(p, std)
        if self.vision is not None:
            self.vision.init_weights(seed=seed)
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()
        return self

    def set_dtype(self, dtype: torch.dtype) -> "K3ForCausalLM":
        """Cast to `dtype`, keeping the release's fp32 parameters (KDA decay, convs, norms, router bias) fp32."""
        for name, t in list(self.named_parameters()) + list(self.named_buffers()):
            target = torch.float32 if name.endswith(FP32_PARAM_SUFFIXES) else dtype
            if t.is_floating_point() and t.dtype != target:
                t.data = t.data.to(target)
        return self

    def set_backends(self, backends: Backends | None) -> "K3ForCausalLM":
        """Which implementation runs each op with a fast path (k3.ops.registry.Backends; None: ``Backends()``, every
        op's validated fast path on CUDA and the reference elsewhere). Stored on every submodule, where each layer
        reads it as ``self.backends`` and passes it to the ops it calls; the choice follows the tensors' device at
        each call, so it holds when the model moves."""
        return set_backends(self, backends)

    def set_activation_checkpointing(self, enabled: bool = True) -> "K3ForCausalLM":
        """Turn activation checkpointing on (or off) in every decoder layer, backbone and MTP: training forwards
        then recompute each sublayer in backward instead of keeping its activations (see
        `K3Model.activation_checkpointing`). Inference forwards (eval mode, no_grad, a cache) are unaffected."""
        self.model.activation_checkpointing = enabled
        for m in self.mtp.modules():
            if isinstance(m, DecoderLayer):
                m.activation_checkpointing = bool(enabled)
        return self

    def use_weight_casts(self, casts: WeightCasts | None):
        """A context within which this model's weights (and no other model's) go through `casts`
        (k3.ops.weight_cast): under autocast each is cast once for all the forwards within, and its gradient
        summed straight into the fp32 ``.grad``, bitwise what autograd gives. The trainer makes one `WeightCasts`
        per optimizer step and runs that step's micro-batches, forward and backward, within. None: no change
        (under FSDP2, whose MixedPrecisionPolicy casts the parameters itself, the trainer passes None)."""
        return use_weight_casts(self, casts)

    def new_cache(self) -> K3Cache:
        return K3Cache([layer.new_cache() for layer in self.model.layers])

    # --- forward ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: K3Cache | None = None, labels: torch.Tensor | None = None,
                segment_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                logits_to_keep: int = 0, pixel_values=None, return_logits: bool = True,
                check_ids: bool = True, batch: BatchInfo | None = None, stats=(),
                features: tuple[int, ...] = ()) -> CausalLMOutput:
        """input_ids [B, T]. labels [B, T] are aligned with input_ids (shifted inside; -100 is ignored).
        segment_ids [B, T] marks packed documents: KDA state and conv reset at each document start and
        MLA does not attend across documents. `batch` instead: the batch's record (k3.model.batch) built where the
        batch was made; the trainer builds it on the host, and with it and check_ids=False the forward never waits
        for the device, so the host can queue it while the device still runs earlier work. Its `logit_positions`
        compute logits at those positions only. logits_to_keep > 0 computes logits for the last N positions only.
        pixel_values ([N, 3, H, W] or a list of [3, H, W]) are encoded by MoonViT-V2 and replace, in order, the
        embeddings at the `media_placeholder_token_id` positions of input_ids (report §2.4).
        return_logits=False (training, with labels) skips the [B, T, V] logits: the loss is computed by
        `head_loss` in chunks of rows, and `logits` is None. check_ids=False skips the token-id range check,
        which reads the ids back from the device (the serving engine validates prompts when they arrive).
        stats: names among k3.model.stats.STATS ("routing", "max_logit"): the output's `stats` then holds them for
        every MoE / MLA layer that ran, backbone and MTP (forwards without a cache); nothing is computed otherwise.
        features: AttnRes block numbers whose outputs the output's `features` then holds (`K3Model.forward`)."""
        if input_ids is not None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
            if check_ids:
                check_token_ids(input_ids, self.config.vocab_size)
        if pixel_values is not None:
            if self.vision is None:
                raise ValueError("pixel_values given, but this model has no vision encoder (no vision_config)")
            from k3.model.vision import merge_image_embeddings

            emb = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            inputs_embeds = merge_image_embeddings(emb, input_ids, self.vision(pixel_values),
                                                   self.config.media_placeholder_token_id)
        if not return_logits and labels is None:
            raise ValueError("return_logits=False needs labels (it computes only the loss)")
        batch = _batch_record(segment_ids, batch)
        positions = batch.logit_positions if batch is not None else None
        if positions is not None and (logits_to_keep > 0 or labels is not None):
            raise ValueError("the batch record's logit_positions select the logits to compute: give no "
                             "logits_to_keep and no labels with them")
        want = check_stats(stats)
        hidden = self.model(input_ids, inputs_embeds=inputs_embeds, cache=cache, batch=batch, stats=want,
                            features=features)
        found = feats = None
        if features:
            hidden, found, feats = hidden
        elif want:
            hidden, found = hidden
        logits = None
        if return_logits:
            h = hidden[:, -logits_to_keep:] if logits_to_keep > 0 else hidden
            if positions is not None:
                h = hidden[:, positions]
            logits = self.head(h)
        out = CausalLMOutput(logits=logits, hidden_states=hidden, stats=found, features=feats)
        if labels is not None and batch is not None and batch.context is not None:
            out.loss = self._context_loss(hidden, logits, labels, batch.context)
            if len(self.mtp) and input_ids is not None:
                out.mtp_loss = self._context_mtp_loss(hidden, input_ids, labels, batch, found=found)
        elif labels is not None:
            out.loss = _shifted_ce(logits, labels, 1) if return_logits else self.head_loss(hidden, labels)
            if len(self.mtp) and input_ids is not None:
                out.mtp_loss = self.mtp_loss(hidden, input_ids, labels, batch, found=found)
        return out

    def _context_loss(self, hidden, logits, labels, context) -> torch.Tensor:
        """This segment's share of the row's mean next-token cross-entropy under context parallelism: `labels` are
        aligned with the positions (the target of position t at t, shifted before the row was split), the sum over
        this segment's tokens divided by the row's count of labelled tokens, so the segments' losses sum to the
        single-process loss (and their gradients to its gradient)."""
        target = labels.reshape(-1)
        if logits is not None:
            total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target, ignore_index=-100,
                                    reduction="sum")
        else:
            D = hidden.shape[-1]
            with record_function("k3.head_loss"):
                total = linear_cross_entropy(self.model.norm(hidden.reshape(-1, D)), self.lm_head.weight, target,
                                             backends=self.backends)
        return total / context.token_count((target != -100).sum())

    def _context_mtp_loss(self, hidden, input_ids, labels, batch: BatchInfo,
                          found: ForwardStats | None = None) -> torch.Tensor:
        """`mtp_loss` for one segment under context parallelism: this segment's share of every depth's mean, so the
        segments' losses sum to the single-process MTP loss. `labels` are aligned with the positions (the target
        of t at t), `batch` is the segment's record.

        The depth-d block's position t takes the depth-(d - 1) hidden state at t and the embedding of token t + d,
        its document id that of t + d, its target that of t + d. For a segment's last d positions those tokens
        are the next segments' first ones: one gather of every segment's first D tokens (ids, document ids,
        labels; D the number of depths) brings them (ContextParallel.rows_after). The row's last d positions have
        no token t + d, so the last segment's block is d positions shorter (ContextParallel.shifted); the target
        of the row's last position is -100, so the positions that count are the single process's."""
        context = batch.context
        want = found.asked if found is not None else frozenset()
        T = input_ids.shape[1]
        own = torch.stack([input_ids.long(), batch.segment_ids.long(), labels.long()], dim=-1)  # [1, T_i, 3]
        rows = torch.cat([own, context.rows_after(own, len(self.mtp))], dim=1)
        ids, seg, target = rows.unbind(-1)
        ahead = rows.shape[1] - T  # tokens after this segment: D, fewer at the row's end
        losses = []
        h = hidden
        for d, layer in enumerate(self.mtp, start=1):
            if sum(context.lengths) <= d + 1:  # the single process's bound, on the whole row
                break
            n = T - max(0, d - ahead)  # this segment's positions t with a token t + d
            record = BatchInfo(segment_ids=seg[:, d:d + n], context=context.shifted(d))
            h, got = layer(h[:, :n], self.model.embed_tokens(ids[:, d:d + n]), batch=record, stats=want)
            if found is not None:
                found.add(layer.block.layer_idx, got)
            losses.append(self._context_loss(h, None, target[:, d:d + n], context))
        return torch.stack(losses).mean() if losses else hidden.new_zeros(())

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head: output-site hidden states [..., D] (before the final norm) -> logits [..., V]."""
        return self.lm_head(self.model.norm(hidden))

    def mtp_loss(self, hidden, input_ids, labels, batch: BatchInfo | None = None,
                 found: ForwardStats | None = None) -> torch.Tensor:
        """Depth-d MTP layer predicts token t+1+d from the depth-(d-1) hidden state at t and the
        embedding of token t+d (DeepSeek-V3-style chaining); losses averaged over depths. `batch`: the record of
        the backbone's batch. `found`: the forward's statistics, joined by the MTP layers' own (those it asked for)."""
        want = found.asked if found is not None else frozenset()
        losses = []
        h = hidden
        for d, layer in enumerate(self.mtp, start=1):
            T = input_ids.shape[1]
            if T <= d + 1:
                break
            emb = self.model.embed_tokens(input_ids[:, d:])
            shifted = None if batch is None else batch.shifted(d)
            h, got = layer(h[:, : T - d] if d == 1 else h[:, :-1], emb, batch=shifted, stats=want)
            if found is not None:
                found.add(layer.block.layer_idx, got)
            losses.append(self.head_loss(h, labels[:, d:]))
        return torch.stack(losses).mean() if losses else hidden.new_zeros(())

    def head_loss(self, hidden: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 8192) -> torch.Tensor:
        """Mean next-token cross-entropy of `lm_head(norm(hidden))` against `labels` shifted by one (-100 ignored),
        without the full [B, T, V] logits: k3.ops.linear_ce takes the head `chunk_tokens` rows at a time and, when
        gradients are on, finishes each chunk's gradient while its logits are at hand, so the head costs
        O(chunk_tokens x V) memory at any context length and no recomputation. Equals
        `_shifted_ce(lm_head(norm(hidden)), labels, 1)`."""
        D = hidden.shape[-1]
        h = self.model.norm(hidden[:, :-1].reshape(-1, D))
        target = labels[:, 1:].reshape(-1)
        with record_function("k3.head_loss"):  # includes the head's gradient when one is needed
            total = linear_cross_entropy(h, self.lm_head.weight, target, chunk_tokens=chunk_tokens,
                                         backends=self.backends)
        return total / (target != -100).sum()


def _shifted_ce(logits: torch.Tensor, labels: torch.Tensor, shift: int) -> torch.Tensor:
    V = logits.shape[-1]
    return F.cross_entropy(logits[:, :-shift].float().reshape(-1, V), labels[:, shift:].reshape(-1),
                           ignore_index=-100)


def _kimi_linear_dt_bias(n: int, gen: torch.Generator, dt_min=1e-3, dt_max=0.1, floor=1e-4) -> torch.Tensor:
    """dt sampled log-uniformly in [dt_min, dt_max], stored as its softplus inverse (Mamba / Kimi Linear)."""
    dt = torch.exp(torch.rand(n, generator=gen) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    dt = dt.clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))
