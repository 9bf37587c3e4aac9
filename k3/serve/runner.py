"""Model runner: runs prefill chunks and batched decode steps of many requests against the paged pool.

The model reads its caches through the protocol of k3.model.cache; the runner builds views of the pool pages
(k3.serve.cache.views) for the requests in a batch, runs the model (the MLA views write the new latent rows into
the pages), and writes the new KDA states back. Batches of single-token decode steps can instead run as one
CUDA-graph replay over static buffers (`ModelRunner.graphs`, a k3.serve.cuda_graphs.DecodeGraphs the engine
sets up).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3.model.batch import BatchInfo
from k3.model.cache import K3Cache
from k3.serve.cache.pool import CachePool
from k3.serve.cache.views import KDAPageView, PagedMLAView, SeqSlots


SCORE_ROWS = 128  # prompt positions scored per lm_head call: bounds the fp32 logits held to [SCORE_ROWS, vocab]


@dataclass
class PromptScore:
    """Score one request's new tokens first .. first + len(targets) - 1 of a forward: the logits at new token
    first + i against the id targets[i] (the token that follows it), with the top `k` alternatives."""
    first: int
    targets: list[int]
    k: int


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

    @torch.no_grad()
    def forward(self, tokens: list[list[int]], starts: list[int], slots: list[SeqSlots],
                scores: list[PromptScore | None] | None = None):
        """Run len(tokens) requests, each adding its new tokens from its own position. Requests adding the
        same number of tokens run as the rows of one batch; otherwise their tokens are packed into one row
        (KDA runs them as separate sequences with their own states, MLA attends each request's own context).
        Returns the logits of each request's last new token [B, V] (fp32). With `graphs` set, a batch of
        single-token steps runs as one step over its static buffers (a graph replay) when they can hold it.
        `scores` (one entry per request, None for most): also score those requests' new tokens from the same
        forward (`PromptScore`); the return is then (logits, [per request: None or (token logprobs [n],
        top-k logprobs [n, k], top-k ids [n, k])]), fp32 log-softmax, on the device."""
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
        # A graph step returns only the last tokens' logits: a forward that scores tokens runs eagerly.
        if self.graphs is not None and not packed and scores is None:
            logits = self.graphs.run(tokens, starts, slots)
            if logits is not None:
                return logits
        dev = self.device
        kda_pages = torch.tensor([[s.kda_pages[g] for s in slots] for g in range(len(self.kda_layers))],
                                 device=dev, dtype=torch.long).reshape(len(self.kda_layers), B)
        mla_views = [PagedMLAView(self.pool, [s.mla_tables[g] for s in slots], starts, dev, lengths if packed else None)
                     for g in range(len(self.mla_layers))]
        if packed:
            ids = torch.tensor([[t for seq in tokens for t in seq]], device=dev)
            return self.run_cached(ids, kda_pages, mla_views, lengths=lengths, scores=scores)
        return self.run_cached(torch.tensor(tokens, device=dev), kda_pages, mla_views, scores=scores)

    def run_cached(self, ids: torch.Tensor, kda_pages: torch.Tensor, mla_views: list,
                   lengths: list[int] | None = None, scores: list[PromptScore | None] | None = None):
        """The model over the pool: read each KDA layer's states from pages kda_pages[g] ([n_kda, B] device
        tensor), run `ids` with per-layer caches (those KDA states, `mla_views`), write the new states back.
        ids [B, T] -> the logits of each row's last token [B, V] fp32; packed (`lengths` given: ids [1, total]
        holds the requests' tokens one after another) -> the logits of each request's last token.
        `scores`: as in `forward` (then returns (logits, scored))."""
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
            out = self.model(ids, cache=cache, batch=info, check_ids=False)
            logits, hidden = out.logits[0].float(), out.hidden_states
        else:
            out = self.model(ids, cache=cache, logits_to_keep=1, check_ids=False)
            logits, hidden = out.logits[:, -1].float(), out.hidden_states
        for g, view in enumerate(kda_views):
            self.pool.write_kda(kda_pages[g], view.state, view.conv_stacked())
        if scores is None:
            return logits
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
        return logits, scored

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
