"""`k3 train-draft`: fine-tune the pre-trained MTP layer into an EAGLE-3 draft (report §4.1.4, eq. 16).

The target is frozen (eval mode, no gradients); only the draft (k3.model.eagle3.Eagle3Layer: the MTP block and
W_E3) trains.

Training-time test (EAGLE-3). Draft row p of a row of T tokens reads the target features at p and the embedding
of token p + 1, and is scored against the target's distribution at p + 1 (the one over token p + 2). The draft is
unrolled for 7 steps over all rows at once: step 1 reads the fused target features, step j >= 2 reads at row p
the draft's own step-(j - 1) output at row p - 1, mirroring drafting at inference, where the j-th guess after the
committed position a = p - (j - 1) is made from the (j - 1)-th guess's output. The token inputs are the data's
tokens (the guesses at inference).

Attention context, exact. At inference, drafting step j from committed position a attends to the rows of the
committed positions <= a (built from target features: step-1 rows) and to its own earlier guesses' rows (the
step-i row made at position a + i - 1, i = 2 .. j). `TTTContext` is the training equivalent: an object of the
MLA cache protocol (k3.model.cache) that keeps every step's latent rows and answers step j's queries with the
mask "query (j, p) sees step-1 rows at positions <= p - (j - 1) and the step-i row at position p - (j - i) for
i = 2 .. j", and only rows of the query's own document. Draft outputs of the training path therefore equal
recurrent drafting's for the same position (tests/posttrain/test_draft.py checks it).

Which (j, p) count: the anchor a = p - (j - 1) lies in the row (a >= 0) and the target token p + 2 is in the
anchor's document (row p's document is that of position p, as at inference, where a request's first draft row is
its position 0 reading token 1), so everything the chain reads is of one document. The loss of a step is the mean
over its counted positions (every token of every document weighs the same: token weighting, not a mean per
document), and the loss is the mean over the 7 steps (each step weighs the same, although later steps count
slightly fewer positions).

Losses, both at temperature 1, p the target's distribution and q the draft's:
  lk:  L = -log sum_x min(p(x), q(x))   (the LK loss, eq. 16: minus the log of the acceptance rate of lossless
       speculative sampling; computed as -logsumexp(min(log p, log q)), stable where the rate is tiny)
  kl:  L = KL(p || q)                   (the usual surrogate, for comparison)
No ground-truth cross-entropy term. The logged acceptance estimate of step j is the mean of sum_x min(p, q).

Optimizer: Per-Head Muon for the draft's matrices, AdamW for its vectors (k3.train.per_head_muon), with the
training schedule (k3.train.schedule). `qat="mxfp4"`: the routed experts of the target and of the draft compute
in MXFP4 / MXFP8 (k3.train.qat.apply_qat), the post-training QAT configuration.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from k3.model.eagle3 import TTT_STEPS, Eagle3Layer

LOSSES = ("lk", "kl")


# --- losses ------------------------------------------------------------------------------------------------------
def lk_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """-log sum_x min(p(x), q(x)) per row [...], p = softmax(target_logits), q = softmax(draft_logits), fp32."""
    lp = torch.log_softmax(target_logits.float(), -1)
    lq = torch.log_softmax(draft_logits.float(), -1)
    return -torch.logsumexp(torch.minimum(lp, lq), -1)


def kl_loss(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row [...], fp32."""
    lp = torch.log_softmax(target_logits.float(), -1)
    lq = torch.log_softmax(draft_logits.float(), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """sum_x min(p(x), q(x)) per row: the acceptance rate of speculative sampling at temperature 1."""
    return torch.minimum(torch.softmax(target_logits.float(), -1), torch.softmax(draft_logits.float(), -1)).sum(-1)


LOSS_FNS = {"lk": lk_loss, "kl": kl_loss}


# --- the training-time test --------------------------------------------------------------------------------------
def ttt_mask(step: int, doc: torch.Tensor) -> torch.Tensor:
    """[B, T, step * T] bool: what query (step, p) sees among the rows of steps 1 .. step (step-major): step-1 rows
    at positions <= p - (step - 1), the step-i row at position p - (step - i) for i = 2 .. step; in p's document
    (doc [B, T] the rows' document ids)."""
    T = doc.shape[1]
    p = torch.arange(T, device=doc.device)[:, None]
    k = torch.arange(T, device=doc.device)[None]
    parts = [k <= p - (step - 1)] + [k == p - (step - i) for i in range(2, step + 1)]
    seen = torch.cat(parts, dim=1)  # [T, step * T]
    same = (doc[:, :, None] == doc[:, None, :]).repeat(1, 1, step)  # [B, T, step * T]
    return seen[None] & same


def shifted(x: torch.Tensor, d: int) -> torch.Tensor:
    """x [B, T, ...] moved d >= 0 positions later along T (row p holds row p - d; the first d rows are zeros)."""
    return x if d == 0 else torch.cat([torch.zeros_like(x[:, :d]), x[:, :-d]], 1)


def ttt_attention(attn, q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                  doc: torch.Tensor) -> torch.Tensor:
    """Step j = len(keys)'s attention under `ttt_mask` without its zero entries: of the j T keys the mask offers a
    query (j, p), it sees the step-1 rows at positions <= p - (j - 1) (a causal band) and one row of each later step
    i (position p - (j - i)). So the scores are one [T, T] block over the step-1 keys and j - 1 diagonals (a dot
    product per query), joined in one softmax in fp32: the math of `attn.masked` with `ttt_mask` (the same finite
    scores, the -inf ones left out), in O(T^2 + j T) instead of O(j T^2). `keys`: each step's expanded (keys
    [B, T, H, dk], values [B, T, H, dv]); q [B, T, H, dk]; doc [B, T] the rows' document ids."""
    j = len(keys)
    T = q.shape[1]
    dev = q.device
    qf = q.float()
    p = torch.arange(T, device=dev)
    k1, v1 = keys[0]
    band = (p[None, :] <= p[:, None] - (j - 1))[None] & (doc[:, :, None] == doc[:, None, :])  # [B, T, T]
    s1 = torch.einsum("bthd,blhd->bhtl", qf, k1.float()) * attn.scale
    parts = [s1.masked_fill(~band[:, None], float("-inf"))]
    vals = []
    for i in range(2, j + 1):
        d = j - i  # query p sees step i's row at p - d
        k_i, v_i = (shifted(t.float(), d) for t in keys[i - 1])
        ok = (p >= d)[None] & (doc == shifted(doc, d))  # [B, T]: that row exists and is of p's document
        s = torch.einsum("bthd,bthd->bht", qf, k_i) * attn.scale
        parts.append(s.masked_fill(~ok[:, None], float("-inf"))[..., None])
        vals.append(v_i)
    w = torch.softmax(torch.cat(parts, -1), dim=-1)  # [B, H, T, T + j - 1]
    o = torch.einsum("bhtl,blhd->bthd", w[..., :T], v1.float())
    for n, v_i in enumerate(vals):
        o = o + w[..., T + n].transpose(1, 2)[..., None] * v_i
    return o.to(q.dtype)


class TTTContext:
    """The MLA cache protocol (k3.model.cache.MLALayerCache) for the unrolled draft: each `attend` is the next
    step; it keeps the step's latent rows expanded to keys and values (once per step) and attends as `ttt_mask`
    says (`ttt_attention`; `exact_mask=True`: keeps the latent rows and attends through the explicit mask over
    every step's rows, the reference)."""

    def __init__(self, doc: torch.Tensor, exact_mask: bool = False):
        self.doc = doc
        self.exact_mask = exact_mask
        self.c: list[torch.Tensor] = []
        self.k_rope: list[torch.Tensor] = []
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []

    def attend(self, attn, q, c, k_rope):
        if self.exact_mask:
            self.c.append(c)
            self.k_rope.append(k_rope)
            mask = ttt_mask(len(self.c), self.doc)
            return attn.masked(q, torch.cat(self.c, 1), torch.cat(self.k_rope, 1), mask)
        self.keys.append(attn._expand(c, k_rope))
        return ttt_attention(attn, q, self.keys, self.doc)


@dataclass
class Unrolled:
    """One batch through the target and the unrolled draft: per step j (0-based list), the draft's logits [B, n, V]
    and which rows count [B, n]; the target's logits [B, n, V] at the rows' targets; the draft's outputs and
    inputs per step (hidden [B, n, D]; inputs[0] the fused target features [B, n, (k + 1) D])."""
    draft_logits: list[torch.Tensor]
    valid: list[torch.Tensor]
    target_logits: torch.Tensor
    outputs: list[torch.Tensor] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)


def target_features(target, ids: torch.Tensor, seg: torch.Tensor, blocks) -> tuple[torch.Tensor, torch.Tensor]:
    """(the concatenated features [h_a, h_b, h_final] [B, T, (k + 1) D], the target's logits [B, T, V]), no grad."""
    with torch.no_grad():
        out = target(ids, segment_ids=seg, features=tuple(blocks))
        return torch.cat(list(out.features) + [out.hidden_states], -1), out.logits


def unroll(target, draft: Eagle3Layer, ids: torch.Tensor, seg: torch.Tensor, steps: int = TTT_STEPS,
           exact_mask: bool = False) -> Unrolled:
    """The training-time test over a batch ids / seg [B, T] (module docstring); `exact_mask`: attention through the
    explicit mask (TTTContext's reference form)."""
    feats, logits = target_features(target, ids, seg, draft.blocks)
    n = ids.shape[1] - 2  # rows p = 0 .. T - 3: token p + 1 read, the target's p + 1 distribution (token p + 2)
    if n < 1:
        raise ValueError(f"rows of {ids.shape[1]} tokens are too short for the draft (at least 3)")
    with torch.no_grad():
        emb = target.model.embed_tokens(ids[:, 1:n + 1])
    # row p belongs to its own position's document (as at inference, where a request's first row is its position
    # 0 reading token 1); it counts when the target token p + 2 is in that document too
    doc = seg[:, :n]
    base = seg[:, 2:n + 2] == doc
    ctx = TTTContext(doc, exact_mask=exact_mask)
    pos = torch.arange(n, device=ids.device)
    res = Unrolled([], [], logits[:, 1:n + 1])
    h, fused = feats[:, :n], True
    for j in range(1, steps + 1):
        res.inputs.append(h)
        o = draft(h, emb, fused=fused, cache=ctx)
        res.outputs.append(o)
        res.draft_logits.append(target.head(o))
        a = pos - (j - 1)  # the anchor (committed position) of each row at this step
        ok = (a >= 0)[None] & base
        if j > 1:
            ok = ok & (doc.gather(1, a.clamp(min=0)[None].expand_as(doc)) == doc)
        res.valid.append(ok)
        # row p of the next step reads this step's output at row p - 1 (row 0 reads anything: its anchor is < 0,
        # and rows with anchor < 0 are never seen by a counted query)
        h, fused = torch.cat([o[:, :1], o[:, :-1]], 1), False
    return res


def ttt_loss(u: Unrolled, loss: str = "lk") -> tuple[torch.Tensor, list[float], list[int]]:
    """(the mean over steps of each step's mean loss over its counted rows, the acceptance estimate of each step,
    the counted rows of each step)."""
    fn = LOSS_FNS[loss]
    losses, acc, counts = [], [], []
    for dl, ok in zip(u.draft_logits, u.valid):
        n = int(ok.sum())
        counts.append(n)
        if n == 0:
            acc.append(float("nan"))
            continue
        t, d = u.target_logits[ok], dl[ok]
        losses.append(fn(t, d).mean())
        with torch.no_grad():
            acc.append(float(acceptance(t, d).mean()))
    if not losses:
        raise ValueError("no position of the batch counts for the draft loss (rows too short or documents of one "
                         "or two tokens)")
    return torch.stack(losses).mean(), acc, counts


def train_step(target, draft: Eagle3Layer, opt, ids: torch.Tensor, seg: torch.Tensor, loss: str = "lk",
               steps: int = TTT_STEPS) -> tuple[float, list[float]]:
    """One optimizer step of the draft on a batch: (the loss, the acceptance estimate of each unrolled step)."""
    u = unroll(target, draft, ids, seg, steps)
    value, acc, _ = ttt_loss(u, loss)
    opt.zero_grad(set_to_none=True)
    value.backward()
    opt.step()
    return float(value.detach()), acc


# --- the run -----------------------------------------------------------------------------------------------------
@dataclass
class DraftOptions:
    ckpt: str
    out: str | None = None  # default CK/draft
    steps: int = 200
    loss: str = "lk"
    qat: str | None = None
    data: list[str] = field(default_factory=list)  # text files (default: the default corpus's training split)
    max_corpus_mb: float | None = None
    blocks: tuple[int, ...] | None = None  # default k3.model.eagle3.default_feature_blocks
    seq_len: int = 256
    rows: int = 8  # rows per step
    lr: float = 1e-3
    seed: int = 0
    log_every: int = 10
    device: str = "auto"
    backends: object = None
    verify: bool = True
    ttt_steps: int = TTT_STEPS

    def validate(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r} is invalid: use {' or '.join(LOSSES)}")
        from k3.train.qat import check_qat_format

        check_qat_format(self.qat)
        for name in ("steps", "seq_len", "rows", "log_every", "ttt_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.seq_len < 3:
            raise ValueError(f"seq_len={self.seq_len} is too short for the draft (at least 3)")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be positive")


def token_rows(tok, docs, rows_needed: int, seq_len: int, seed: int) -> np.ndarray:
    """[rows_needed, seq_len] token rows: the documents in a seeded order, each followed by eos, tokenized only as
    far as needed (cycled when there is too little text)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    need = rows_needed * seq_len
    parts, total, i = [], 0, 0
    while total < need:
        chunk = [docs[order[(i + k) % len(order)]].text for k in range(16)]
        i += 16
        for ids in tok.encode_batch(chunk):
            parts.append(np.asarray(list(ids) + [tok.eos_id], dtype=np.int64))
            total += parts[-1].shape[0]
    return np.concatenate(parts)[:need].reshape(rows_needed, seq_len)


def load_target(ckpt: str, device, backends=None, verify: bool = True, qat: str | None = None):
    """The frozen target in fp32 (eval mode, no gradients); with `qat` its routed experts compute in MXFP4/MXFP8."""
    from k3.checkpoint import from_pretrained

    target = from_pretrained(ckpt, dtype=torch.float32, device=device, backends=backends, verify=verify)
    if qat is not None:
        from k3.model.mx_experts import quantize_experts
        from k3.train.qat import apply_qat

        quantize_experts(target, None, None)
        apply_qat(target, qat)
    target.eval().requires_grad_(False)
    return target


def train_draft(opts: DraftOptions, log=print, progress: bool = True) -> dict:
    """Train an EAGLE-3 draft for opts.ckpt and write it to opts.out (default CK/draft); returns a summary."""
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.draft_checkpoint import save_draft
    from k3.train.per_head_muon import PerHeadMuon
    from k3.train.run import load_corpus
    from k3.train.schedule import lr_multiplier

    opts.validate()
    if not os.path.isdir(opts.ckpt) or not os.path.isfile(os.path.join(opts.ckpt, "config.json")):
        raise FileNotFoundError(f"--ckpt {opts.ckpt}: no checkpoint there (a directory with config.json)")
    out = opts.out or os.path.join(opts.ckpt, "draft")
    device = pick_device(opts.device)
    target = load_target(opts.ckpt, device, opts.backends, opts.verify, opts.qat)
    draft = Eagle3Layer.from_target(target, opts.blocks)
    if opts.qat is not None:
        from k3.train.qat import apply_qat

        apply_qat(draft, opts.qat)
    draft.train()
    try:
        tok = load_any_tokenizer(opts.ckpt)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{opts.ckpt} has no usable tokenizer.json ({e})") from None
    train_docs, _ = load_corpus(opts.data, opts.max_corpus_mb, log=log)
    rows = token_rows(tok, train_docs, opts.steps * opts.rows, opts.seq_len, opts.seed)
    seg = np.zeros_like(rows)  # a new document right after every eos
    np.cumsum(rows[:, :-1] == tok.eos_id, axis=1, out=seg[:, 1:])
    torch.manual_seed(opts.seed)
    opt = PerHeadMuon(draft, lr=opts.lr)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    n_params = sum(p.numel() for p in draft.parameters())
    log(f"target {opts.ckpt}: {target.config.num_hidden_layers} layers, frozen; draft: MTP block + W_E3 "
        f"({n_params / 1e6:.2f}M parameters), features of AttnRes blocks {list(draft.blocks)} + the final hidden "
        f"state; loss {opts.loss}, {opts.ttt_steps}-step training-time test, {opts.steps} steps of {opts.rows} x "
        f"{opts.seq_len} tokens{f', QAT {opts.qat}' if opts.qat else ''}; on {device}")
    os.makedirs(out, exist_ok=True)
    metrics_path = os.path.join(out, "metrics.jsonl")
    open(metrics_path, "w").close()
    t0 = time.perf_counter()
    acc_sum = np.zeros(opts.ttt_steps)
    acc_n = 0
    last = {}
    for step in range(1, opts.steps + 1):
        mult = lr_multiplier((step - 1) / max(opts.steps, 1))
        for g in opt.param_groups:
            g["lr"] = g["initial_lr"] * mult
        sl = slice((step - 1) * opts.rows, step * opts.rows)
        ids = torch.from_numpy(rows[sl]).to(device)
        s = torch.from_numpy(seg[sl]).to(device)
        loss, acc = train_step(target, draft, opt, ids, s, opts.loss, opts.ttt_steps)
        acc_sum += np.nan_to_num(np.array(acc))
        acc_n += 1
        if step % opts.log_every == 0 or step == opts.steps:
            mean_acc = (acc_sum / acc_n).tolist()
            el = time.perf_counter() - t0
            last = {"step": step, "loss": loss, "accept": [round(a, 5) for a in mean_acc],
                    "lr": opts.lr * mult, "elapsed_s": round(el, 2),
                    "tokens_per_s": round(step * opts.rows * opts.seq_len / el, 1)}
            with open(metrics_path, "a") as f:
                f.write(json.dumps(last) + "\n")
            if progress:
                log(f"step {step}/{opts.steps}  loss {loss:.4f}  accept(1..{opts.ttt_steps}) "
                    + " ".join(f"{a:.3f}" for a in mean_acc) + f"  {last['tokens_per_s']:.0f} tok/s")
            acc_sum[:] = 0
            acc_n = 0
    info = {"loss": opts.loss, "steps": opts.steps, "qat": opts.qat, "ttt_steps": opts.ttt_steps,
            "seq_len": opts.seq_len, "rows": opts.rows, "lr": opts.lr, "seed": opts.seed, "data": opts.data,
            "last": last}
    save_draft(draft, out, opts.ckpt, info)
    log(f"wrote the draft to {out} (config.json, model.safetensors, metrics.jsonl)")
    return {"out": out, "last": last}
