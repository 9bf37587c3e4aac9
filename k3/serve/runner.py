"""Model runner: the one way into the model for a serving step, `ModelRunner.execute(ForwardBatch) -> ForwardResult`.

A `ForwardBatch` holds requests that each add their new tokens from their own position against the paged pool. The
last `n_verify` of them are speculative verifications (their last sampled token and their drafts, k3.serve.
speculative). `execute` runs, by what the batch holds:

* plain requests only: rows of one batch when they add the same number of tokens, else packed into one row (KDA runs
  them as separate sequences with their own states, MLA attends each request's own context); a batch of
  single-token steps (or of hash-block prefill chunks) runs as one step over the static buffers of the runner's
  graphs (`ModelRunner.graphs`, a k3.serve.cuda_graphs.DecodeGraphs the runner owns) when they can hold it;
* verifications only: one batched forward (a graph replay when the graphs verify that many positions) with KDA
  views that keep the projected inputs and leave the committed states as they are;
* both: one packed forward (speculative decoding mixed with prefill, report §5.4.2), the same effect on each.

A prefill chunk over an image's placeholders carries the image's rows (`ForwardBatch.images`: the encoder's output for
those positions, sliced by the engine): the forward then takes input embeddings, the token embeddings with those rows
put in place, and runs eagerly (the static-buffer steps take token ids).

The model runs through k3.serve.pool_forward (the same functions the static-buffer steps run), over per-layer views
built in one place (k3.serve.cache.views.layer_views). After a verification, `replay` commits each request's
accepted prefix: it reads the committed states from the pages, has each KDA layer replay the kept inputs
(KimiDeltaAttention.replay, k3.ops.kda_replay) and writes the new states back once.

Fused replay (`fused_replay`, EngineConfig.fused_replay; report §5.4.2): instead, the accepted positions stay
pending (`hold`: their kept inputs, per request id, in `pending`), and a request's pages hold its KDA state at
num_computed minus its pending count. Its next verification alone (every row of the forward a verification of the
same length), eager or on the static buffers (k3.serve.cuda_graphs: the fused verification step, with the pending
inputs copied into its buffers, one copy per request: `Pending.flat`), replays them
in the same pass as the new window (k3.serve.pool_forward.verify_replay_on_pool, op kda_verify_step: the committed
state read once, the state after the pending positions written once, in place). Every
other forward that reads a request's KDA state as committed replays its pending positions first (`flush`, the same
replay as `replay`): a plain forward (prefill, decode, the static-buffer steps), a mixed forward's verifications, a
verification on static buffers whose graphs were built without fused replay. While anything is pending every
forward must name its requests (ForwardBatch.ids), so none can read a state that is behind. The engine drops a
request's pending positions when it leaves the running set (`drop`: finished, aborted or preempted; its running pages
are freed, never read again as committed: checkpoints are copies of committed states, taken only at hash-aligned
positions the speculative decoder replays up to first).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from k3.model.batch import BatchInfo
from k3.model.cache import K3Cache, KDAInputs
from k3.model.kda import replay_layers
from k3.serve.cache.pool import CachePool
from k3.serve.cache.views import (KDAMixedView, KDAVerifyView, LayerLayout, PagedMLAView, SeqSlots, flat_inputs,
                                  inputs_of, layer_views, replay_inputs_of)
from k3.serve.cuda_graphs import DecodeGraphs
from k3.serve.pool_forward import run_on_pool, verify_on_pool, verify_replay_on_pool
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
class ForwardBatch:
    """One forward: request i adds tokens[i] from position starts[i], its cache at slots[i]. The last `n_verify`
    requests are verifications (their last sampled token and their drafts; all of them: one batched verification,
    every one adding the same number of tokens; some: they join the others' packed forward, any number each).
    `scores` (one entry per request, None for most; never a verification's): also score those requests' new tokens
    (`PromptScore`). `keep_hidden`: also return each plain request's hidden states; `features` (AttnRes block
    numbers, what an EAGLE-3 draft reads): those blocks' outputs beside them (and beside a verification's).
    `images` (one entry per request, None for most; never a verification's): image rows of the request's new tokens,
    a list of (offset among its new tokens, rows [n, D]) that replace the embeddings of new tokens offset .. offset
    + n - 1. `ids` (one per request): the requests' ids, which the runner's pending accepted positions are kept
    under (fused replay: required while any are pending). `drafts` (a forward of verifications only): their tokens
    after the first [B, T - 1] on the device (drafts not read back: `tokens` holds placeholders there), or all T of
    them [B, T] (a verification launched ahead: its first token, the previous verification's bonus, is on the device
    too)."""
    tokens: list[list[int]]
    starts: list[int]
    slots: list[SeqSlots]
    scores: list[PromptScore | None] | None = None
    n_verify: int = 0
    keep_hidden: bool = False
    features: tuple[int, ...] = ()
    images: list[list[tuple[int, Tensor]] | None] | None = None
    ids: list[str] | None = None
    drafts: Tensor | None = None

    def joined(self, verify: "ForwardBatch") -> "ForwardBatch":
        """This forward of plain requests with the verifications of `verify` (a forward of verifications only) after
        them: one mixed forward."""
        if self.n_verify or verify.n_verify != len(verify.tokens):
            raise ValueError("join a forward of plain requests and one of verifications only")
        if verify.drafts is not None:
            raise ValueError("a mixed forward takes its verifications' drafts as host tokens (ForwardBatch.drafts is "
                             "for a forward of verifications only)")
        if (self.ids is None) != (verify.ids is None):
            raise ValueError("join forwards that both name their requests (ForwardBatch.ids), or neither")
        scores = None if self.scores is None else self.scores + [None] * len(verify.tokens)
        images = None if self.images is None else self.images + [None] * len(verify.tokens)
        ids = None if self.ids is None else self.ids + verify.ids
        return ForwardBatch(self.tokens + verify.tokens, self.starts + verify.starts, self.slots + verify.slots,
                            scores, len(verify.tokens), self.keep_hidden, self.features, images, ids)


@dataclass
class Pending:
    """A request's accepted positions not yet in its KDA states (fused replay): `n` of them, `pages` the request's
    KDA running-state pages (one per KDA layer) they belong to; `flat`: every layer's kept projected inputs side by
    side [n, layers * width] (k3.serve.cache.views.flat_inputs; a slice of a static-buffer verification's, which
    nothing writes again, else made once), what the next static-buffer verification copies in one piece; `heads`:
    (KDA heads, head dim) of its layout."""
    pages: list[int]
    n: int
    flat: Tensor
    heads: tuple[int, int]

    @functools.cached_property
    def inputs(self) -> list[KDAInputs]:
        """Per KDA layer, its kept inputs ([n, ...] each: views of `flat`), made when an eager forward or a replay
        first reads them: a static-buffer verification reads `flat` alone, and the views of every layer cost the
        host ~0.4 ms per request at k3-mini (12 views per layer)."""
        return [inputs_of(self.flat, g, *self.heads) for g in range(len(self.pages))]


@dataclass
class Verified:
    """A verification forward: logits [B, T, V] fp32 and output-site hidden states [B, T, D] (or with the draft's
    features [B, T, (k + 1) D]) at every verified position, each KDA layer's view holding the projected inputs, and
    the requests' running-state pages [n_kda, B] (unchanged by the forward); `flat`: a static-buffer verification's
    kept inputs of every KDA layer side by side [B, T, layers * width] (the views' inputs are views of it), else
    None."""
    logits: Tensor
    hidden: Tensor
    kda_views: list[KDAVerifyView]
    kda_pages: Tensor
    flat: Tensor | None = None


@dataclass
class ForwardResult:
    """What `execute` returns. `logits`: the logits of each plain request's last new token [B, V] fp32 (a mixed
    forward: its plain requests' rows first, then one row per verification, which callers skip; None for a
    verification alone). `scored`: per request, None or (token logprobs [n], top-k logprobs [n, k], top-k ids
    [n, k]), fp32 log-softmax on the device (None when nothing was scored). `hidden`: with keep_hidden, each plain
    request's hidden states of its new tokens (a list of [n_i, D] views, before the final norm: what a draft
    reads). `verified`: the verifications' `Verified` (padded to the longest in a mixed forward: rows past a
    request's own length repeat its last position and are never accepted)."""
    logits: Tensor | None
    scored: list | None = None
    hidden: list[Tensor] | None = None
    verified: Verified | None = None



class ReplayedPositions:
    """Picks each replayed row's positions offsets[i] .. offsets[i] + L - 1 (L = max(lengths); clamped to the T
    verified positions, those past a row's length never read) out of a verification's kept KDAInputs [B, T, ...] as
    [R, L, ...], and the rows' KDA pages. One row (batch 1) takes views of its slice: no kernel. Several take one
    gather per tensor with the indices built on the device (the host lists through pinned memory: a copy from
    pageable memory would wait for the device here and in every layer's replay; kda_replay copies its lengths the
    same way)."""

    def __init__(self, rows: list[int], offsets: list[int], lengths: list[int], T: int, device):
        L = max(lengths)
        self.view = len(rows) == 1 and offsets[0] + L <= T  # within the verified positions: no clamp to mimic
        if self.view:
            self.rows, self.idx = slice(rows[0], rows[0] + 1), (rows[0], slice(offsets[0], offsets[0] + L))
        else:
            r = to_device_async(torch.tensor(rows), device)
            starts = to_device_async(torch.tensor(offsets), device)
            pos = (starts[:, None] + torch.arange(L, device=device)[None]).clamp(max=T - 1)
            self.rows, self.idx = r, (r[:, None], pos)

    def take(self, x: Tensor) -> Tensor:
        """The picked rows' positions of one verification tensor x [B, T, ...] -> [R, L, ...]."""
        return x[self.idx].unsqueeze(0) if self.view else x[self.idx]

    def kept(self, v: Verified) -> Tensor:
        """The picked positions of every KDA layer's kept inputs of verification v, side by side ([R, L, layers *
        width], `flat_inputs`' layout): a view of a static-buffer verification's `flat`, else one copy of the
        per-layer inputs of an eager (or mixed) one."""
        return self.take(v.flat) if v.flat is not None else flat_inputs([self(w.inputs) for w in v.kda_views])

    def __call__(self, inp: KDAInputs) -> KDAInputs:
        take = (lambda x: x[self.idx].unsqueeze(0)) if self.view else (lambda x: x[self.idx])
        return KDAInputs(tuple(take(x) for x in inp.pre_conv), take(inp.q), take(inp.k), take(inp.v), take(inp.z),
                         take(inp.beta_logits))


class ModelRunner:
    def __init__(self, model, pool: CachePool):
        self.model, self.pool = model, pool
        self.device = next(model.parameters()).device
        self.layout = LayerLayout.of(model)
        # batched single-token steps (and hash-block prefill chunks, verifications) as graph replays: `use_graphs`
        self.graphs: DecodeGraphs | None = None
        # fused replay (the module docstring): accepted positions kept per request id until the next verification
        self.fused_replay = False
        self.pending: dict[str, Pending] = {}

    def use_graphs(self, **options) -> DecodeGraphs:
        """Run the steps that fit on static buffers (k3.serve.cuda_graphs.DecodeGraphs of this runner, with
        `options`) from now on."""
        self.graphs = DecodeGraphs(self, **options)
        return self.graphs

    # --- the one door ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, batch: ForwardBatch) -> ForwardResult:
        """Run one forward (see the module docstring for which)."""
        B, nv = len(batch.tokens), batch.n_verify
        if not 0 <= nv <= B:
            raise ValueError(f"n_verify={nv} for a forward of {B} requests")
        if batch.drafts is not None and (nv != B or tuple(batch.drafts.shape) not in (
                (B, len(batch.tokens[0]) - 1), (B, len(batch.tokens[0])))):
            raise ValueError(f"ForwardBatch.drafts of shape {tuple(batch.drafts.shape)}: a forward of verifications "
                             f"only takes [B, T - 1] or [B, T] (here B={B}, n_verify={nv})")
        images = batch.images if batch.images is not None and any(batch.images) else None
        if images is not None:
            if len(images) != B or any(images[B - nv:]):
                raise ValueError("ForwardBatch.images needs one entry per request, and none for a verification")
            for t, rows in zip(batch.tokens, images):
                for off, x in rows or ():
                    if not (0 <= off and off + x.shape[0] <= len(t)):
                        raise ValueError(f"image rows at {off} .. {off + x.shape[0] - 1} lie outside the request's "
                                         f"{len(t)} new tokens")
        if self.pending:
            if batch.ids is None or len(batch.ids) != B:
                raise ValueError("the runner holds accepted positions not yet in the KDA states (fused replay): a "
                                 "forward must name its requests (ForwardBatch.ids, one per request) so that theirs "
                                 "are replayed first")
            for rid, sl in zip(batch.ids, batch.slots):
                p = self.pending.get(rid)
                if p is not None and list(sl.kda_pages) != p.pages:
                    raise RuntimeError(f"request {rid}: pending positions held for KDA pages {p.pages}, but the "
                                       f"forward runs it on {list(sl.kda_pages)} (dropped too late?)")
            # a plain forward (and a mixed one's verifications) reads the states as committed: replay theirs first
            self.flush(batch.ids if nv < B else [])
        if nv == 0:
            return self._run(batch.tokens, batch.starts, batch.slots, batch.scores, batch.keep_hidden,
                             batch.features, images)
        if nv == B:
            return ForwardResult(None, verified=self._verify(batch.tokens, batch.starts, batch.slots,
                                                             batch.features, batch.ids, batch.drafts))
        res, verified = self._run_mixed(batch.tokens, batch.starts, batch.slots, nv, batch.scores, batch.keep_hidden,
                                        batch.features, images)
        res.verified = verified
        return res

    @torch.no_grad()
    def replay(self, v: Verified, rows: list[int], offsets: list[int], lengths: list[int]) -> None:
        """Advance the running states of verified requests `rows` by their positions offsets[i] .. offsets[i] +
        lengths[i] - 1 of the verification (KDA rollback by replay, report §5.4.2): from the state now in each
        request's pages (the committed one, or the one a previous `replay` of the same verification left), through
        the kept projected inputs, every KDA layer in one replay (`_replay_layers`), written back once."""
        if not rows or not self.layout.kda:  # nothing accepted, or no KDA state to advance (all-MLA)
            return
        pick = ReplayedPositions(rows, offsets, lengths, v.logits.shape[1], self.device)
        self._replay_layers(v.kda_pages[:, pick.rows], pick.kept(v), lengths)

    def _replay_layers(self, pages: Tensor, flat: Tensor, lengths: list[int]) -> None:
        """Every KDA layer's replay at once (k3.model.kda.replay_layers: one kernel launch on a GPU): the states in
        pages [n_kda, R] read in one gather, the first lengths[i] positions of row i of `flat` [R, L, layers * width]
        (every layer's kept inputs side by side) replayed, the states written back in one scatter. The same states
        as each layer's `KimiDeltaAttention.replay` of its own inputs."""
        cfg = self.model.config
        ids = pages.flatten()  # layer-major, as replay_layers takes the states
        state, conv = self.pool.read_kda(ids)
        layers = [self.model.model.layers[li].self_attn for li in self.layout.kda]
        self.pool.write_kda(ids, *replay_layers(layers, *replay_inputs_of(flat, len(layers), cfg.kda_num_heads,
                                                                          cfg.kda_head_dim), state, conv, lengths))

    # --- fused replay: pending accepted positions ----------------------------------------------------------------
    def hold(self, request_id: str, pages: list[int], v: Verified, row: int, offset: int, n: int) -> None:
        """Keep positions offset .. offset + n - 1 of verified row `row` (accepted, not replayed) pending for
        request `request_id`, whose KDA running-state pages are `pages`: its next verification replays them in
        front of its window, any other forward over it first (`flush`)."""
        if not self.fused_replay:
            raise RuntimeError("hold() is fused replay's (ModelRunner.fused_replay is off): commit with replay()")
        if request_id in self.pending:
            raise RuntimeError(f"request {request_id} already has {self.pending[request_id].n} pending positions: "
                               "its verification should have replayed them")
        T = v.logits.shape[1]
        if not (n >= 1 and 0 <= offset and offset + n <= T):
            raise ValueError(f"pending positions {offset} .. {offset + n - 1} lie outside the verification's {T}")
        # a static-buffer verification's: a slice of it; an eager or mixed one's per-layer inputs, side by side once
        flat = ReplayedPositions([row], [offset], [n], T, self.device).kept(v)[0]
        cfg = self.model.config
        if len(pages) != len(self.layout.kda):
            raise ValueError(f"{len(pages)} KDA pages for {len(self.layout.kda)} KDA layers")
        self.pending[request_id] = Pending(list(pages), n, flat, (cfg.kda_num_heads, cfg.kda_head_dim))

    def pending_tokens(self, request_id: str) -> int:
        """How many accepted positions of the request are pending (0: its KDA states are at num_computed)."""
        p = self.pending.get(request_id)
        return 0 if p is None else p.n

    def drop(self, request_id: str) -> None:
        """Forget a request's pending positions (it leaves: finished, aborted or preempted; its pages are freed)."""
        self.pending.pop(request_id, None)

    @torch.no_grad()
    def flush(self, request_ids: list[str]) -> None:
        """Replay the pending positions of those of `request_ids` that have any into their KDA states (one replay
        for all of them), and clear them."""
        got = [(rid, self.pending[rid]) for rid in dict.fromkeys(request_ids) if rid in self.pending]
        if not got:
            return
        entries = [p for _, p in got]
        pages = to_device_async(torch.tensor([[p.pages[g] for p in entries] for g in range(len(self.layout.kda))],
                                             dtype=torch.long), self.device)
        lengths = [p.n for p in entries]
        P = max(lengths)
        if len(entries) == 1:  # every layer's pending inputs, as they are kept: a view
            flat = entries[0].flat[None]
        else:  # side by side, each request's padded to the longest (the padding never read: lengths)
            flat = entries[0].flat.new_zeros(len(entries), P, entries[0].flat.shape[-1])
            torch._foreach_copy_([flat[i, :p.n] for i, p in enumerate(entries)], [p.flat for p in entries])
        self._replay_layers(pages, flat, lengths)
        for rid, _ in got:
            del self.pending[rid]

    def _stacked(self, entries: list[Pending | None], g: int, P: int) -> KDAInputs:
        """KDA layer g's pending inputs of `entries` as rows [len(entries), P, ...], zero-padded (None: no row of
        its own, all padding)."""
        cfg = self.model.config
        H, K = cfg.kda_num_heads, cfg.kda_head_dim
        dtype = next(self.model.parameters()).dtype
        shapes = KDAInputs(((H * K,),) * 3, (H, K), (H, K), (H, K), (H, K), (H,))

        def rows(pick, shape) -> Tensor:
            if len(entries) == 1 and entries[0] is not None:  # one request (batch 1): a view, nothing copied
                x = pick(entries[0].inputs[g])
                if x is not None and x.shape[0] == P:
                    return x.unsqueeze(0)
            out = []
            for e in entries:
                x = None if e is None else pick(e.inputs[g])
                if x is None:
                    x = torch.zeros(P, *shape, device=self.device, dtype=dtype)
                elif x.shape[0] < P:
                    x = torch.cat([x, x.new_zeros(P - x.shape[0], *x.shape[1:])])
                out.append(x)
            return torch.stack(out)

        return KDAInputs(tuple(rows(lambda i, c=c: i.pre_conv[c], shapes.pre_conv[c]) for c in range(3)),
                         rows(lambda i: i.q, shapes.q), rows(lambda i: i.k, shapes.k), rows(lambda i: i.v, shapes.v),
                         rows(lambda i: i.z, shapes.z), rows(lambda i: i.beta_logits, shapes.beta_logits))

    # --- the forwards -----------------------------------------------------------------------------------------------
    def _kda_pages(self, slots: list[SeqSlots]) -> Tensor:
        """The requests' KDA running-state pages, [n_kda, B] on the device, through pinned memory: a copy from
        pageable memory would wait for the device (on a GPU, a verification's host work for the draft's kernels)."""
        n = len(self.layout.kda)
        host = torch.tensor([[s.kda_pages[g] for s in slots] for g in range(n)], dtype=torch.long)
        return to_device_async(host.reshape(n, len(slots)), self.device)

    def _mla_views(self, slots: list[SeqSlots], starts: list[int], lengths: list[int] | None = None) -> list:
        """A PagedMLAView (packed when `lengths` is given) for each MLA layer."""
        return [PagedMLAView(self.pool, [s.mla_tables[g] for s in slots], starts, self.device, lengths)
                for g in range(len(self.layout.mla))]

    def _embeds(self, ids: Tensor, images: list | None, lengths: list[int], packed: bool) -> Tensor | None:
        """The input embeddings of `ids` with the requests' image rows in place ([B, T, D], or [1, total, D] packed),
        or None without images (the model embeds the ids itself)."""
        if images is None:
            return None
        emb = self.model.model.embed_tokens(ids)
        for i, rows in enumerate(images):
            r, base = (0, sum(lengths[:i])) if packed else (i, 0)
            for off, x in rows or ():
                emb[r, base + off: base + off + x.shape[0]] = x.to(device=emb.device, dtype=emb.dtype)
        return emb

    def _run(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots],
             scores: list[PromptScore | None] | None, keep_hidden: bool, features: tuple[int, ...],
             images: list | None = None) -> ForwardResult:
        """Plain requests: rows of one batch, or packed; on the graphs' static buffers when they can hold it."""
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
        if g is not None and not packed and scores is None and images is None and keep_hidden == g.keep_hidden \
                and (not keep_hidden or tuple(features) == g.features):
            out = g.run(tokens, starts, slots)
            if out is not None:
                return ForwardResult(out[0], None, list(out[1].unbind(0))) if keep_hidden else ForwardResult(out)
        dev = self.device
        ids = torch.tensor([[t for seq in tokens for t in seq]] if packed else tokens, device=dev)
        logits, hidden, kept = run_on_pool(self.model, self.layout, self.pool, ids, self._kda_pages(slots),
                                           self._mla_views(slots, starts, lengths if packed else None),
                                           lengths if packed else None, features,
                                           self._embeds(ids, images, lengths, packed))
        scored = None
        if scores is not None:
            offs = [sum(lengths[:i]) for i in range(B)] if packed else [0] * B
            scored = [None if sc is None else
                      self._score(hidden[0, offs[i] + sc.first: offs[i] + sc.first + len(sc.targets)] if packed
                                  else hidden[i, sc.first: sc.first + len(sc.targets)], sc.targets, sc.k)
                      for i, sc in enumerate(scores)]
        rows = None
        if keep_hidden:
            rows = list(kept[0].split(lengths)) if packed else list(kept.unbind(0))
        return ForwardResult(logits, scored, rows)

    def _verify(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots],
                features: tuple[int, ...], ids: list[str] | None = None, drafts: Tensor | None = None) -> Verified:
        """Run each request's T tokens (its last sampled token and T - 1 drafts, the same T for all) from its own
        position as the rows of one batch: a graph replay when `graphs` verifies T positions (and the batch fits),
        else eagerly. The MLA views write every position's latent rows into the pages (rows past the accepted
        length are overwritten later and released by CacheManager.truncate); the KDA states in the pages are not
        advanced: call `replay` with the accepted lengths (or `hold` them, with fused replay). With fused replay
        the verification replays the requests' pending positions (by `ids`) in the same pass, eagerly or on the
        static buffers of graphs built with fused replay (other graphs replay them first: `flush`)."""
        T = len(tokens[0])
        if any(len(t) != T for t in tokens):
            raise ValueError("every request of a verification adds the same number of tokens")
        kda_pages = self._kda_pages(slots)
        entries = [None if ids is None else self.pending.get(rid) for rid in (ids or [None] * len(tokens))]
        lengths = [0 if e is None else e.n for e in entries]
        g = self.graphs
        if g is not None and g.verify_lengths and tuple(features) == g.features:
            fused = self.fused_replay and g.fused_replay
            if self.pending and not fused:  # these graphs verify from committed states: the unfused replay first
                self.flush(ids)
            rows = [None if e is None else e.flat for e in entries] if fused and any(lengths) else None
            out = g.run_verify(tokens, starts, slots, rows, lengths if fused else None, drafts)
            if out is not None:  # a graph replay: the same forward over static buffers
                if fused:
                    self._replayed(ids, entries)
                logits, hidden, views, flat = out
                return Verified(logits, hidden, views, kda_pages, flat)
        if self.fused_replay:
            entries = [None if ids is None else self.pending.get(rid) for rid in (ids or [None] * len(tokens))]
            lengths = [0 if e is None else e.n for e in entries]
            P = max(lengths)
            pending = [self._stacked(entries, gi, P) for gi in range(len(self.layout.kda))]
            logits, hidden, views = verify_replay_on_pool(self.model, self.layout, self.pool,
                                                          self._ids(tokens, drafts), kda_pages,
                                                          self._mla_views(slots, starts), pending, lengths, features)
            self._replayed(ids, entries)
            return Verified(logits, hidden, views, kda_pages)
        logits, hidden, views = verify_on_pool(self.model, self.layout, self.pool,
                                               self._ids(tokens, drafts), kda_pages,
                                               self._mla_views(slots, starts), features)
        return Verified(logits, hidden, views, kda_pages)

    def _ids(self, tokens: list[list[int]], drafts: Tensor | None) -> Tensor:
        """A verification's token ids [B, T] on the device: `tokens`, with the last drafts.shape[1] of each row from
        `drafts` ([B, T - 1]: the drafts after the first; [B, T]: all) where they are on the device."""
        ids = torch.tensor(tokens, device=self.device)
        if drafts is not None:
            ids[:, ids.shape[1] - drafts.shape[1]:] = drafts
        return ids

    def _replayed(self, ids: list[str] | None, entries: list[Pending | None]) -> None:
        """Forget the pending positions a fused verification replayed and wrote: the states are at its window's
        start now."""
        for rid, e in zip(ids or (), entries):
            if e is not None:
                del self.pending[rid]

    def _run_mixed(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots], n_verify: int,
                   scores: list[PromptScore | None] | None = None, keep_hidden: bool = False,
                   features: tuple[int, ...] = (), images: list | None = None) -> tuple[ForwardResult, Verified]:
        """`execute`'s mixed forward: prefill chunks and verifications in one packed forward; the last `n_verify`
        requests are verifications (any number of drafts each). Returns (the result for the others, their logits
        rows first and then one row per verification; the `Verified` of the verifications, padded to the longest).
        As in a verification alone, the verifications' KDA states stay as they were in their pages (only the other
        requests' new states are written back) and their projected inputs are kept for `replay`."""
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
        per_layer, kda_views = layer_views(self.layout, self.pool, kda_pages, self._mla_views(slots, starts, lengths),
                                           KDAMixedView)
        ids = torch.tensor([[t for seq in tokens for t in seq]], device=dev)
        info = BatchInfo.from_lengths(lengths, device=dev, logits_at_ends=True)
        out = self.model(ids, cache=K3Cache(per_layer, packed=True), batch=info, check_ids=False, features=features,
                         inputs_embeds=self._embeds(ids, images, lengths, packed=True))
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
        return ForwardResult(logits, scored, rows), verified

    def _score(self, rows: Tensor, targets: list[int], k: int):
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
