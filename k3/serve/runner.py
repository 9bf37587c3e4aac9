"""Model runner: runs prefill chunks and batched decode steps of many requests against the paged pool.

The model reads its caches through the protocol of k3.model.cache; the runner builds views of the pool pages
(k3.serve.cache.views) for the requests in a batch, runs the model (the MLA views write the new latent rows into
the pages), and writes the new KDA states back. Batches of single-token decode steps can instead run as one
CUDA-graph replay over static buffers (`ModelRunner.graphs`, a k3.serve.cuda_graphs.DecodeGraphs the engine
sets up).

Speculative decoding (k3.serve.speculative) adds three calls: `verify` runs every request's last token and its drafts in
one batched forward (a graph replay when the runner's graphs verify that many positions), with KDA views that keep
the projected inputs and leave the committed states as they are; `run_mixed` runs verifications in the same packed
forward as prefill chunks, with the same effect on each; `replay` then rebuilds the states after each request's
accepted prefix from the kept inputs (k3.ops.kda_replay) and writes them into the running-state pages once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.model.batch import BatchInfo
from k3.model.cache import K3Cache
from k3.ops.kda_replay import kda_replay_any
from k3.serve.cache.pool import CachePool
from k3.serve.cache.views import KDAPageView, KDAVerifyView, PagedMLAView, SeqSlots
from k3.tensors import to_device_async


SCORE_ROWS = 128  # prompt positions scored per lm_head call: bounds the fp32 logits held to [SCORE_ROWS, vocab]


@dataclass
class PromptScore:
    """Score one request's new tokens first .. first + len(targets) - 1 of a forward: the logits at new token
    first + i against the id targets[i] (the token that follows it), with the top `k` alternatives."""
    first: int
    targets: list[int]
    k: int


@dataclass
class RunOutput:
    """What one `run` returns: the logits of each request's last new token [B, V] fp32, the scored entries (as
    `forward` documents them; None when nothing was scored) and, when asked for, each request's output-site hidden
    states of its new tokens (a list of [n_i, D] views, before the final norm: what a draft model reads)."""
    logits: torch.Tensor
    scored: list | None = None
    hidden: list[torch.Tensor] | None = None


@dataclass
class Verified:
    """A verification forward: logits [B, T, V] fp32 and output-site hidden states [B, T, D] (or with the draft's
    features [B, T, (k + 1) D]) at every verified
    position, each KDA layer's view holding the projected inputs, and the requests' running-state pages
    [n_kda, B] (unchanged by the forward)."""
    logits: torch.Tensor
    hidden: torch.Tensor
    kda_views: list[KDAVerifyView]
    kda_pages: torch.Tensor


class ModelRunner:
    def __init__(self, model, pool: CachePool):
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        layers = model.model.layers
        self.kda_layers = [i for i, l in enumerate(layers) if l.is_kda]
        self.mla_layers = [i for i, l in enumerate(layers) if not l.is_kda]
        # batched single-token steps (and hash-block prefill chunks) as graph replays: a DecodeGraphs of this
        # runner, set by the engine (k3.serve.cuda_graphs)
        self.graphs = None

    def forward(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots],
                scores: list[PromptScore | None] | None = None):
        """`run`'s logits, or (logits, scored) when `scores` asks for something."""
        out = self.run(tokens, starts, slots, scores)
        return out.logits if out.scored is None else (out.logits, out.scored)

    def _kda_pages(self, slots: list[SeqSlots]) -> torch.Tensor:
        """The requests' KDA running-state pages, [n_kda, B] on the device."""
        n = len(self.kda_layers)
        return torch.tensor([[s.kda_pages[g] for s in slots] for g in range(n)], device=self.device,
                            dtype=torch.long).reshape(n, len(slots))

    def _views(self, kda_view, kda_pages: torch.Tensor, slots: list[SeqSlots], starts: list[int],
               lengths: list[int] | None = None) -> tuple[list, list]:
        """(every layer's cache view, the KDA layers' views): `kda_view` over each KDA layer's states read from
        `kda_pages`, a PagedMLAView (packed when `lengths` is given) for each MLA layer."""
        per_layer: list = [None] * len(self.model.model.layers)
        kda_views = []
        for g, li in enumerate(self.kda_layers):
            kda_views.append(kda_view(*self.pool.read_kda(kda_pages[g])))
            per_layer[li] = kda_views[-1]
        for g, li in enumerate(self.mla_layers):
            per_layer[li] = PagedMLAView(self.pool, [s.mla_tables[g] for s in slots], starts, self.device, lengths)
        return per_layer, kda_views

    @torch.no_grad()
    def run(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots],
            scores: list[PromptScore | None] | None = None, keep_hidden: bool = False,
            features: tuple[int, ...] = ()) -> RunOutput:
        """Run len(tokens) requests, each adding its new tokens from its own position. Requests adding the
        same number of tokens run as the rows of one batch; otherwise their tokens are packed into one row
        (KDA runs them as separate sequences with their own states, MLA attends each request's own context).
        Returns the logits of each request's last new token [B, V] (fp32). With `graphs` set, a batch of
        single-token steps runs as one step over its static buffers (a graph replay) when they can hold it.
        `scores` (one entry per request, None for most): also score those requests' new tokens from the same
        forward (`PromptScore`); the return is then (logits, [per request: None or (token logprobs [n],
        top-k logprobs [n, k], top-k ids [n, k])]), fp32 log-softmax, on the device. `keep_hidden`: also return
        each request's hidden states (`RunOutput.hidden`; such a forward runs eagerly); with `features` (AttnRes
        block numbers, what an EAGLE-3 draft reads) those blocks' outputs and the hidden states concatenated."""
        B = len(tokens)
        if not B or any(not t for t in tokens):
            raise ValueError("every request of a forward must add at least one token")
        if scores is not None and not any(scores):
            scores = None
        if scores is not None:
            for t, sc in zip(tokens, scores):
                if sc is not None and not (0 <= sc.first and sc.first + len(sc.targets) <= len(t) and sc.targets):
                    raise ValueError(f"PromptScore(first={sc.first}, {len(sc.targets)} targets) lies outside the "
                                     f"request's {len(t)} new tokens")
        lengths = [len(t) for t in tokens]
        packed = any(n != lengths[0] for n in lengths)
        # A graph step returns only the last tokens' logits (and, when its graphs keep them, the hidden states a
        # draft reads): a forward that scores tokens, or asks for hidden states the graphs do not keep, runs eagerly.
        g = self.graphs
        if g is not None and not packed and scores is None and keep_hidden == g.keep_hidden \
                and (not keep_hidden or tuple(features) == g.features):
            out = g.run(tokens, starts, slots)
            if out is not None:
                return RunOutput(out[0], None, list(out[1].unbind(0))) if keep_hidden else RunOutput(out)
        dev = self.device
        kda_pages = self._kda_pages(slots)
        mla_views = [PagedMLAView(self.pool, [s.mla_tables[g] for s in slots], starts, dev, lengths if packed else None)
                     for g in range(len(self.mla_layers))]
        if packed:
            ids = torch.tensor([[t for seq in tokens for t in seq]], device=dev)
            out = self.run_cached(ids, kda_pages, mla_views, lengths=lengths, scores=scores, keep_hidden=keep_hidden,
                                  features=features)
        else:
            out = self.run_cached(torch.tensor(tokens, device=dev), kda_pages, mla_views, scores=scores,
                                  keep_hidden=keep_hidden, features=features)
        if not keep_hidden:
            return RunOutput(out[0], out[1]) if scores is not None else RunOutput(out)
        logits, scored, hidden = out
        rows = list(hidden[0].split(lengths)) if packed else list(hidden.unbind(0))
        return RunOutput(logits, scored, rows)

    def run_cached(self, ids: torch.Tensor, kda_pages: torch.Tensor, mla_views: list,
                   lengths: list[int] | None = None, scores: list[PromptScore | None] | None = None,
                   keep_hidden: bool = False, features: tuple[int, ...] = ()):
        """The model over the pool: read each KDA layer's states from pages kda_pages[g] ([n_kda, B] device
        tensor), run `ids` with per-layer caches (those KDA states, `mla_views`), write the new states back.
        ids [B, T] -> the logits of each row's last token [B, V] fp32; packed (`lengths` given: ids [1, total]
        holds the requests' tokens one after another) -> the logits of each request's last token.
        `scores`: as in `forward` (then returns (logits, scored)). `keep_hidden`: returns (logits, scored or None,
        the forward's hidden states [B, T, D], or with `features` those blocks' outputs and the hidden states
        concatenated [B, T, (k + 1) D])."""
        per_layer: list = [None] * len(self.model.model.layers)
        kda_views = []
        for g, li in enumerate(self.kda_layers):
            state, conv = self.pool.read_kda(kda_pages[g])
            view = KDAPageView(state, conv)
            kda_views.append(view)
            per_layer[li] = view
        for g, li in enumerate(self.mla_layers):
            per_layer[li] = mla_views[g]
        cache = K3Cache(per_layer, packed=lengths is not None)
        if lengths is not None:
            # the packed requests' record, built on the host: their documents and each one's last token
            info = BatchInfo.from_lengths(lengths, device=ids.device, logits_at_ends=True)
            out = self.model(ids, cache=cache, batch=info, check_ids=False, features=features)
            logits, hidden = out.logits[0].float(), out.hidden_states
        else:
            out = self.model(ids, cache=cache, logits_to_keep=1, check_ids=False, features=features)
            logits, hidden = out.logits[:, -1].float(), out.hidden_states
        kept = torch.cat([*out.features, hidden], -1) if features else hidden  # what the draft reads
        for g, view in enumerate(kda_views):
            self.pool.write_kda(kda_pages[g], view.state, view.conv_stacked())
        if scores is None:
            return (logits, None, kept) if keep_hidden else logits
        scored: list = []
        offset = 0
        for i, sc in enumerate(scores):
            if sc is not None:
                n = len(sc.targets)
                rows = hidden[0, offset + sc.first: offset + sc.first + n] if lengths is not None \
                    else hidden[i, sc.first: sc.first + n]
                scored.append(self._score(rows, sc.targets, sc.k))
            else:
                scored.append(None)
            if lengths is not None:
                offset += lengths[i]
        return (logits, scored, kept) if keep_hidden else (logits, scored)

    # --- speculative decoding ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def verify(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots],
               features: tuple[int, ...] = ()) -> Verified:
        """Run each request's T tokens (its last sampled token and T - 1 drafts, the same T for all) from its own
        position as the rows of one batch: a graph replay when `graphs` verifies T positions (and the batch fits),
        else eagerly. The MLA views write every position's latent rows into the
        pages (rows past the accepted length are overwritten later and released by CacheManager.truncate); the
        KDA states in the pages are not advanced: call `replay` with the accepted lengths. `features`: as in
        `run`, Verified.hidden then holds those blocks' outputs and the hidden states concatenated."""
        T = len(tokens[0])
        if any(len(t) != T for t in tokens):
            raise ValueError("every request of a verification adds the same number of tokens")
        dev = self.device
        kda_pages = self._kda_pages(slots)
        g = self.graphs
        if g is not None and g.verify_lengths and tuple(features) == g.features:
            out = g.run_verify(tokens, starts, slots)
            if out is not None:  # a graph replay: the same forward over static buffers
                logits, hidden, inputs = out
                views = []
                for i in inputs:
                    view = KDAVerifyView(None, None)
                    view.inputs = i
                    views.append(view)
                return Verified(logits, hidden, views, kda_pages)
        per_layer, views = self._views(KDAVerifyView, kda_pages, slots, starts)
        out = self.model(torch.tensor(tokens, device=dev), cache=K3Cache(per_layer), logits_to_keep=T,
                         check_ids=False, features=features)
        hidden = torch.cat([*out.features, out.hidden_states], -1) if features else out.hidden_states
        return Verified(out.logits.float(), hidden, views, kda_pages)

    @torch.no_grad()
    def run_mixed(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots], n_verify: int,
                  scores: list[PromptScore | None] | None = None, keep_hidden: bool = False,
                  features: tuple[int, ...] = ()) -> tuple[RunOutput, Verified]:
        """Prefill chunks and verifications in one packed forward (speculative decoding mixed with prefill, report
        §5.4.2): the last `n_verify` requests are verifications (their last sampled token and their drafts, any
        number of them per request), the others run as `run` runs them. Returns (`run`'s output for the others,
        their logits rows first and then one row per verification, which callers skip; the `Verified` of the
        verifications, padded to the longest: rows past a request's own length repeat its last position and are
        never accepted). As in `verify`, the verifications' KDA states stay as they were in their pages (only
        the other requests' new states are written back) and their projected inputs are kept for `replay`."""
        B = len(tokens)
        nv = n_verify
        nb = B - nv  # the prefill requests come first
        if not 0 < nv < B:
            raise ValueError(f"a mixed forward needs prefill requests and verifications ({B} requests, {nv} "
                             "verifications)")
        if any(not t for t in tokens):
            raise ValueError("every request of a forward must add at least one token")
        if scores is not None and any(sc is not None for sc in scores[nb:]):
            raise ValueError("a verification scores no prompt tokens")
        scores = scores if scores is not None and any(scores) else None
        dev = self.device
        lengths = [len(t) for t in tokens]
        kda_pages = self._kda_pages(slots)
        per_layer, kda_views = self._views(_KDAMixedView, kda_pages, slots, starts, lengths)
        ids = torch.tensor([[t for seq in tokens for t in seq]], device=dev)
        info = BatchInfo.from_lengths(lengths, device=dev, logits_at_ends=True)
        out = self.model(ids, cache=K3Cache(per_layer, packed=True), batch=info, check_ids=False, features=features)
        hidden = out.hidden_states  # [1, total, D]
        kept = torch.cat([*out.features, hidden], -1) if features else hidden
        # the verifications' positions in the packed row, [nv, T] (a shorter one repeats its last position)
        offs = [sum(lengths[:i]) for i in range(B)]
        T = max(lengths[nb:])
        pos = torch.tensor([[offs[i] + min(t, lengths[i] - 1) for t in range(T)] for i in range(nb, B)],
                           device=dev)
        views = []  # only the prefill requests' new states are written back
        for g, view in enumerate(kda_views):
            self.pool.write_kda(kda_pages[g, :nb], view.state[:nb], view.conv_stacked()[:nb])
            inp = view.inputs
            kept_inputs = KDAVerifyView(None, None)
            kept_inputs.inputs = type(inp)(tuple(x[0, pos] for x in inp.pre_conv), inp.q[0, pos], inp.k[0, pos],
                                           inp.v[0, pos], inp.z[0, pos], inp.beta_logits[0, pos])
            views.append(kept_inputs)
        verified = Verified(self.model.head(hidden[0, pos]).float(), kept[0, pos], views, kda_pages[:, nb:])
        logits = out.logits[0].float()
        scored = None
        if scores is not None:
            scored = []
            for i, sc in enumerate(scores):
                scored.append(None if sc is None else self._score(hidden[0, offs[i] + sc.first:
                                                                         offs[i] + sc.first + len(sc.targets)],
                                                                  sc.targets, sc.k))
        rows = list(kept[0].split(lengths)[:nb]) if keep_hidden else None
        return RunOutput(logits, scored, rows), verified

    @torch.no_grad()
    def replay(self, v: Verified, rows: list[int], offsets: list[int], lengths: list[int]) -> None:
        """Advance the running states of verified requests `rows` by their positions offsets[i] .. offsets[i] +
        lengths[i] - 1 of the verification (KDA rollback by replay, report §5.4.2): from the state now in each
        request's pages (the committed one, or the one a previous `replay` of the same verification left), through
        the cached projected inputs, written back once."""
        if not rows:
            return
        dev = self.device
        # the host lists go through pinned memory: a copy from pageable memory would wait for the device here and in
        # every layer's replay (kda_replay copies its lengths the same way)
        r = to_device_async(torch.tensor(rows), dev)
        L = max(lengths)
        T = v.logits.shape[1]
        starts = to_device_async(torch.tensor(offsets), dev)
        pos = (starts[:, None] + torch.arange(L, device=dev)[None]).clamp(max=T - 1)
        idx = (r[:, None], pos)  # [R, L] positions of each replayed row
        for g, li in enumerate(self.kda_layers):
            inp, attn = v.kda_views[g].inputs, self.model.model.layers[li].self_attn
            pages = v.kda_pages[g, r]
            state, conv = self.pool.read_kda(pages)
            new_state, new_conv = kda_replay_any(inp.q[idx], inp.k[idx], inp.v[idx], inp.z[idx],
                                                 inp.beta_logits[idx], torch.stack(inp.pre_conv, 2)[idx], attn.A_log,
                                                 attn.dt_bias, attn.lower_bound, state, conv, lengths,
                                                 backends=self.model.backends)
            self.pool.write_kda(pages, new_state, new_conv)

    def _score(self, rows: torch.Tensor, targets: list[int], k: int):
        """Pre-norm hidden states rows [n, D] -> (logprob of targets[i] [n], top-k logprobs [n, k], their ids
        [n, k]): log-softmax in fp32, SCORE_ROWS rows at a time so at most that many rows of logits exist."""
        m = self.model
        tgt = torch.tensor(targets, device=rows.device, dtype=torch.long)
        k = min(k, m.config.vocab_size)
        lp, top_v, top_i = [], [], []
        for a in range(0, rows.shape[0], SCORE_ROWS):
            logp = torch.log_softmax(m.head(rows[a:a + SCORE_ROWS]).float(), -1)
            lp.append(logp.gather(1, tgt[a:a + SCORE_ROWS, None])[:, 0])
            top = torch.topk(logp, k, dim=-1)
            top_v.append(top.values)
            top_i.append(top.indices)
        return torch.cat(lp), torch.cat(top_v), torch.cat(top_i)


class _KDAMixedView(KDAPageView):
    """A KDA layer's view for `ModelRunner.run_mixed`: the new states of every request of the packed forward (the
    runner writes back only the prefill requests') and the projected inputs of every position (the verifications'
    are kept for replay)."""

    def __init__(self, state: torch.Tensor, conv: torch.Tensor):
        super().__init__(state, conv)
        self.inputs = None

    def update(self, state, conv, inputs=None) -> None:
        if inputs is None:
            raise ValueError("a mixed forward's KDA layer must hand its projected inputs to the cache")
        super().update(state, conv)
        self.inputs = inputs
