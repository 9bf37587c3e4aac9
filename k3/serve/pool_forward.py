"""The model over the page pool: the two forwards that the eager runner (k3.serve.runner.ModelRunner) and the
static-buffer steps (k3.serve.cuda_graphs.DecodeGraphs) both run, so that a graph replay is the same code as the
eager forward it replaces.

* `run_on_pool`: run the model with the per-layer views (k3.serve.cache.views.layer_views; the MLA views write the
  new latent rows into the pages; a single-token step advances each KDA layer's states in their pages, a longer one
  reads copies and the new states are written back after).
* `verify_on_pool`: a speculative verification (report §5.4.2): every position's logits, the KDA layers' views
  keep the projected inputs and the states in the pages are not advanced (the accepted prefix is replayed later).
* `verify_replay_on_pool`: the same verification with the replay of each request's pending accepted positions (a
  previous verification's, not yet in the states) fused in front (EngineConfig.fused_replay, report §5.4.2): each
  KDA layer runs KimiDeltaAttention.verify_replay (k3.ops.kda_verify_step) on its rows of the pages: the committed
  state read once, advanced in place to the state after the pending positions, the window's inputs kept.

Each KDA layer recognises the fused view by its `pending_replay` (the k3.model.cache protocol) and runs its
`verify_replay` on it.
"""

from __future__ import annotations


import torch
from torch import Tensor

from k3.model.batch import BatchInfo
from k3.model.cache import K3Cache, KDAInputs
from k3.serve.cache.pool import CachePool
from k3.serve.cache.views import KDAReplayVerifyView, KDAVerifyView, LayerLayout, layer_views
from k3.tensors import to_device_async


def run_on_pool(model, layout: LayerLayout, pool: CachePool, ids: Tensor, kda_pages: Tensor, mla_views: list,
                lengths: list[int] | None = None, features: tuple[int, ...] = (),
                embeds: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The model over the pool: ids [B, T] (packed, `lengths` given: [1, total] holding the requests' tokens one
    after another), each KDA layer's states read from pages kda_pages[g] ([n_kda, B] device tensor) and written
    back after, `mla_views` for the MLA layers. Returns (the logits of each row's (packed: each request's) last
    token [B, V] fp32, the hidden states [B, T, D] before the final norm, what a draft reads: with `features` (AttnRes
    block numbers) those blocks' outputs and the hidden states concatenated [B, T, (k + 1) D], else the hidden
    states). `embeds` [B, T, D]: the input embeddings in place of the ids' (a prefill chunk with image rows)."""
    per_layer, kda_views = layer_views(layout, pool, kda_pages, mla_views)
    cache = K3Cache(per_layer, packed=lengths is not None)
    if lengths is not None:
        # the packed requests' record, built on the host: their documents and each one's last token
        info = BatchInfo.from_lengths(lengths, device=ids.device, logits_at_ends=True)
        out = model(ids, cache=cache, batch=info, check_ids=False, features=features, inputs_embeds=embeds)
        logits = out.logits[0].float()
    else:
        out = model(ids, cache=cache, logits_to_keep=1, check_ids=False, features=features, inputs_embeds=embeds)
        logits = out.logits[:, -1].float()
    hidden = out.hidden_states
    kept = torch.cat([*out.features, hidden], -1) if features else hidden
    for g, view in enumerate(kda_views):
        if view.updated:  # else the layer advanced the states in their pages
            pool.write_kda(kda_pages[g], view.state, view.conv_stacked())
    return logits, hidden, kept


def verify_on_pool(model, layout: LayerLayout, pool: CachePool, ids: Tensor, kda_pages: Tensor, mla_views: list,
                   features: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, list[KDAVerifyView]]:
    """A verification of ids [B, T] (each request's last token and T - 1 drafts) over the pool -> (logits [B, T, V]
    fp32, the hidden states [B, T, D] (with `features`: those blocks' outputs beside them, as `run_on_pool`), each
    KDA layer's view holding the projected inputs). The KDA states in the pages stay as they were; the MLA views
    write every position's latent rows."""
    per_layer, views = layer_views(layout, pool, kda_pages, mla_views, KDAVerifyView)
    out = model(ids, cache=K3Cache(per_layer), logits_to_keep=ids.shape[1], check_ids=False, features=features)
    hidden = torch.cat([*out.features, out.hidden_states], -1) if features else out.hidden_states
    return out.logits.float(), hidden, views


def verify_replay_on_pool(model, layout: LayerLayout, pool: CachePool, ids: Tensor, kda_pages: Tensor,
                          mla_views: list, pending: list[KDAInputs], lengths: list[int] | Tensor,
                          features: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, list[KDAReplayVerifyView]]:
    """`verify_on_pool` with each request's pending accepted positions replayed in front of its window, in the same
    pass: pending[g] the g-th KDA layer's pending inputs [B, P, ...] (a verification's kept inputs; row b's first
    lengths[b] positions are real, 0 for none), the states in pages kda_pages[g] the committed ones before them.
    Returns what `verify_on_pool` returns (the logits and hidden states of the window, from the state after the
    pending positions; each KDA layer's view holding the window's inputs). Each KDA layer writes every row's state and
    conv tail after its pending positions into its pages, in place (a row with nothing pending writes back its
    committed ones unchanged, bit for bit; a padding row only the scratch page its pages point at); the window
    advances nothing. `lengths`: host ints, or an int tensor [B] on the device (a static-buffer step's, refilled
    before each replay; nothing is read back)."""
    B = ids.shape[0]
    if len(pending) != len(layout.kda) or len(lengths) != B:
        raise ValueError(f"pending inputs for {len(pending)} KDA layers and {len(lengths)} rows: need "
                         f"{len(layout.kda)} layers and {B} rows")
    if not isinstance(lengths, Tensor):  # the counts on the device once for every layer (not one copy per layer)
        lengths = to_device_async(torch.tensor(lengths, dtype=torch.int32), ids.device)
    views = [KDAReplayVerifyView(pool, kda_pages[g], pending[g], lengths) for g in range(len(layout.kda))]
    per_layer, views = layer_views(layout, pool, kda_pages, mla_views, kda_given=views)
    out = model(ids, cache=K3Cache(per_layer), logits_to_keep=ids.shape[1], check_ids=False, features=features)
    for g, view in enumerate(views):
        if view.inputs is None:
            raise RuntimeError(f"KDA layer {layout.kda[g]} did not run verify_replay on its view")
    hidden = torch.cat([*out.features, out.hidden_states], -1) if features else out.hidden_states
    return out.logits.float(), hidden, views
