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

The run is the Trainer's (k3.train.trainer), as pre-training's, SFT's, MOPD's and RL's are: its module is the
draft, its batches the token rows with their document ids (`DraftRows`, `draft_batch`), its loss `DraftLoss`
(through the loss seam, k3.train.losses; the frozen target inside gives the features and the distributions), so
the micro-batch loop, the OOM retry, the non-finite-step skip, the metrics log, the atomic checkpoints with exact
resume (`DraftOptions.resume`) and SIGINT / SIGTERM handling are the Trainer's. The draft has no QK-Clip, no
Quantile Balancing of its experts (their bias stays the pre-trained one) and no MTP term; gradients are not clipped.
Optimizer: Per-Head Muon for the draft's matrices, AdamW for its vectors (k3.train.per_head_muon), with the
training schedule (k3.train.schedule). `qat="mxfp4"`: the routed experts of the target and of the draft compute
in MXFP4 / MXFP8 (k3.train.qat.apply_qat), the post-training QAT configuration.
"""

from __future__ import annotations

import math
import os
import random
import shutil
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from k3.model.eagle3 import TTT_STEPS, Eagle3Layer
from k3.train.losses import LossOutput, MicroBatch
from k3.train.trainer import StepMetrics, TrainConfig, Trainer

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

    def token_positions(self, c):
        raise ValueError("the EAGLE-3 training-time test does not support the RoPE ablation (mla_use_nope false): "
                         "its unrolled steps have no single position per row")

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


def ttt_valid(seg: torch.Tensor, steps: int = TTT_STEPS) -> list[torch.Tensor]:
    """Which draft rows count at each unrolled step (module docstring), from the rows' document ids seg [B, T]: per
    step [B, T - 2] bool. Row p belongs to its own position's document (as at inference, where a request's first
    row is its position 0 reading token 1); it counts when the target token p + 2 is in that document too, and
    step j's anchor p - (j - 1) lies in the row and in that document."""
    n = seg.shape[1] - 2
    doc = seg[:, :n]
    base = seg[:, 2:n + 2] == doc
    pos = torch.arange(n, device=seg.device)
    valid = []
    for j in range(1, steps + 1):
        a = pos - (j - 1)  # the anchor (committed position) of each row at this step
        ok = (a >= 0)[None] & base
        if j > 1:
            ok = ok & (doc.gather(1, a.clamp(min=0)[None].expand_as(doc)) == doc)
        valid.append(ok)
    return valid


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
    ctx = TTTContext(seg[:, :n], exact_mask=exact_mask)  # row p's document: its own position's (`ttt_valid`)
    res = Unrolled([], ttt_valid(seg, steps), logits[:, 1:n + 1])
    h, fused = feats[:, :n], True
    for j in range(1, steps + 1):
        res.inputs.append(h)
        o = draft(h, emb, fused=fused, cache=ctx)
        res.outputs.append(o)
        res.draft_logits.append(target.head(o))
        # row p of the next step reads this step's output at row p - 1 (row 0 reads anything: its anchor is < 0,
        # and rows with anchor < 0 are never seen by a counted query)
        h, fused = torch.cat([o[:, :1], o[:, :-1]], 1), False
    return res


def ttt_terms(u: Unrolled, loss: str = "lk", totals: list[int] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the loss: the mean over steps of each step's mean loss over its counted rows; per step the summed acceptance
    estimate of its counted rows [steps]; per step its counted rows [steps]), as tensors. `totals`: each step's
    counted rows in the whole batch when `u` is one part of it (a micro-batch; default: `u`'s own): each step's
    term is then the part's sum over the batch's count, and the mean is over the steps with rows in the batch, so
    that the parts' losses add up to the batch's."""
    fn = LOSS_FNS[loss]
    counts = torch.stack([ok.sum() for ok in u.valid])
    totals = counts.tolist() if totals is None else list(totals)
    steps_counted = sum(1 for n in totals if n)
    if not steps_counted:
        raise ValueError("no position of the batch counts for the draft loss (rows too short or documents of one "
                         "or two tokens)")
    terms, acc = [], []
    for dl, ok, n in zip(u.draft_logits, u.valid, totals):
        t, d = u.target_logits[ok], dl[ok]
        if n:
            terms.append(fn(t, d).sum() / n)
        with torch.no_grad():
            acc.append(acceptance(t, d).sum())
    return torch.stack(terms).sum() / steps_counted, torch.stack(acc), counts


def ttt_loss(u: Unrolled, loss: str = "lk") -> tuple[torch.Tensor, list[float], list[int]]:
    """(the mean over steps of each step's mean loss over its counted rows, the acceptance estimate of each step
    (NaN for a step without counted rows), the counted rows of each step)."""
    value, acc, counts = ttt_terms(u, loss)
    return value, (acc / counts).tolist(), counts.tolist()


# --- the run on the Trainer ----------------------------------------------------------------------------------------
def draft_batch(ids: torch.Tensor, seg: torch.Tensor, steps: int = TTT_STEPS) -> dict[str, torch.Tensor]:
    """A step's batch for the Trainer from token rows ids [B, T] and their document ids seg [B, T]: `input_ids`,
    `segment_ids`; `labels` the tokens the rows are scored at (p + 2 for row p; the Trainer counts them for the
    tokens per second: the loss reads the target's distributions, not them); `ttt_rows` [B, steps] each unrolled
    step's counted rows in the whole batch (`ttt_valid`), the same on every row, so that every micro-batch has the
    step's counts (`DraftLoss`)."""
    counts = torch.stack([ok.sum() for ok in ttt_valid(seg, steps)])
    labels = ids.clone()
    labels[:, :2] = -100
    return {"input_ids": ids, "labels": labels, "segment_ids": seg,
            "ttt_rows": counts[None].expand(ids.shape[0], steps).contiguous()}


class DraftRows:
    """The run's token rows in order, `rows` per step, as `draft_batch`es: the Trainer's loader."""

    data_flag = "--data"  # what the Trainer's warning about repeated data names

    def __init__(self, ids: np.ndarray, seg: np.ndarray, rows: int, ttt_steps: int = TTT_STEPS):
        self.ids, self.seg, self.rows, self.ttt_steps = ids, seg, rows, ttt_steps
        self.num_rows, self.tokens_per_epoch = ids.shape[0], ids.size
        self.pos = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self.pos + self.rows > self.num_rows:  # past the rows cut for the run (a resumed run given more steps)
            self.pos = 0
        sl = slice(self.pos, self.pos + self.rows)
        self.pos += self.rows
        return draft_batch(torch.from_numpy(self.ids[sl]), torch.from_numpy(self.seg[sl]), self.ttt_steps)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, st: dict) -> None:
        self.pos = st["pos"]


class DraftLoss:
    """The training-time test's loss (`unroll`, `ttt_terms`) of a micro-batch of `draft_batch` rows through the
    Trainer's loss seam (k3.train.losses); the trained module is the draft, the frozen `target` gives the features
    and the distributions. Each step's rows are summed over the count of the whole step's batch (`ttt_rows`), so
    that the micro-batches' losses add up to the step's. Its statistics (`extra`): per unrolled step, the summed
    acceptance estimate and the counted rows of the micro-batch."""

    def __init__(self, target, loss: str = "lk", steps: int = TTT_STEPS):
        self.target, self.loss, self.steps = target, loss, steps

    def __call__(self, draft, mb: MicroBatch) -> LossOutput:
        t = mb.tensors
        u = unroll(self.target, draft, t["input_ids"], mb.info.segment_ids, self.steps)
        value, accept, rows = ttt_terms(u, self.loss, t["ttt_rows"][0].tolist())
        return LossOutput(value, value.detach().double(), None, extra={"accept_sum": accept, "rows": rows})


@dataclass
class DraftStepMetrics(StepMetrics):
    # on the logged steps: each unrolled step's acceptance estimate, the mean over the steps since the last logged one
    accept: list[float] | None = None


class DraftTrainer(Trainer):
    """The Trainer with the draft as its module, `DraftRows` as its loader and `DraftLoss` as its loss; its
    checkpoints are the draft's (k3.draft_checkpoint.save_draft_checkpoint, with the trainer state)."""

    def __init__(self, draft: Eagle3Layer, tcfg, rows: DraftRows, target, loss: str, target_path: str,
                 train_info: dict, progress: bool = True, log=print):
        super().__init__(draft, tcfg, rows, log=log, loss=DraftLoss(target, loss, rows.ttt_steps))
        self.target_path, self.train_info, self.print_progress = target_path, train_info, progress
        self._accept_sum, self._accept_steps = np.zeros(rows.ttt_steps), 0

    def _finish_step(self, m: StepMetrics, extras: list[dict]) -> DraftStepMetrics:
        """The step's record, with the acceptance estimates on the logged steps, and the progress line."""
        accept = torch.stack([x["accept_sum"] for x in extras]).sum(0)
        rows = torch.stack([x["rows"] for x in extras]).sum(0)
        self._accept_sum += np.nan_to_num(np.array((accept / rows).tolist()))
        self._accept_steps += 1
        out = DraftStepMetrics(**asdict(m))
        if self.step % self.cfg.log_every == 0 or self.done():
            mean = (self._accept_sum / self._accept_steps).tolist()
            out.accept = [round(a, 5) for a in mean]
            self._accept_sum[:] = 0
            self._accept_steps = 0
            if self.print_progress:
                self.log(f"step {out.step}/{self.step_budget()}  loss {out.loss:.4f}  accept(1..{len(mean)}) "
                         + " ".join(f"{a:.3f}" for a in mean) + f"  {out.tokens_per_s:.0f} tok/s")
        return out

    def save(self) -> str | None:
        """A checkpoint, unless the run is done: then its result is the draft, which `train_draft` writes."""
        return None if self.done() else super().save()

    def _save_model(self, model, path: str, extra_files: dict) -> None:
        from k3.draft_checkpoint import save_draft_checkpoint

        save_draft_checkpoint(model, path, self.target_path, self.train_info, extra_files)

    def _load_model(self, model, path: str, verify: bool) -> None:
        from k3.draft_checkpoint import load_draft_checkpoint

        load_draft_checkpoint(model, path, verify=verify)

    def state_dict(self) -> dict:
        st = super().state_dict()
        st["accept_window"] = {"sum": self._accept_sum.tolist(), "steps": self._accept_steps}
        return st

    def load_state_dict(self, st: dict) -> None:
        super().load_state_dict(st)
        self._accept_sum = np.array(st["accept_window"]["sum"], dtype=np.float64)
        self._accept_steps = st["accept_window"]["steps"]


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
    resume: bool = False  # continue the unfinished run in `out` from its newest checkpoint

    def validate(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"loss={self.loss!r} is invalid: use {' or '.join(LOSSES)}")
        from k3.train.qat import check_qat_format

        check_qat_format(self.qat)
        for name in ("steps", "seq_len", "rows", "log_every", "ttt_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive integer")
        if self.seq_len < 8:  # the Trainer's shortest row (k3.train.config)
            raise ValueError(f"seq_len={self.seq_len} is too short for the draft (at least 8)")
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


# the settings a resumed run must share with the run it continues (--steps may grow)
RESUME_SAME = ("loss", "qat", "ttt_steps", "seq_len", "rows", "lr", "seed", "data")


def draft_train_config(opts: DraftOptions, out: str, device) -> TrainConfig:
    """The Trainer's settings for the draft: `steps` steps of `rows` rows, the peak learning rate with the default
    schedule, no gradient clipping, no QK-Clip, no Quantile Balancing, fp32 (no autocast)."""
    return TrainConfig(out=out, max_steps=opts.steps, seq_len=opts.seq_len, batch_tokens=opts.rows * opts.seq_len,
                       lr=opts.lr, grad_clip=math.inf, balance="none", qk_clip_tau=0.0, log_every=opts.log_every,
                       seed=opts.seed, device=str(device), qat=opts.qat)


def train_draft(opts: DraftOptions, log=print, progress: bool = True) -> dict:
    """Train an EAGLE-3 draft for opts.ckpt and write it to opts.out (default CK/draft); returns a summary: `out`,
    `last` (the last logged step's record), `step`, and `interrupted` / `signal` when a signal stopped the run
    before its end (its checkpoint is then in OUT/checkpoints, and no draft is written: `resume` continues it)."""
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.draft_checkpoint import read_draft_config, save_draft
    from k3.run_dir import clean_interrupted, holding_run_dir, latest_checkpoint, resume_checkpoint
    from k3.train.run import load_corpus

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
    try:
        tok = load_any_tokenizer(opts.ckpt)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"{opts.ckpt} has no usable tokenizer.json ({e})") from None
    train_docs, _ = load_corpus(opts.data, opts.max_corpus_mb, log=log)
    ids = token_rows(tok, train_docs, opts.steps * opts.rows, opts.seq_len, opts.seed)
    seg = np.zeros_like(ids)  # a new document right after every eos
    np.cumsum(ids[:, :-1] == tok.eos_id, axis=1, out=seg[:, 1:])
    torch.manual_seed(opts.seed)
    info = {"loss": opts.loss, "steps": opts.steps, "qat": opts.qat, "ttt_steps": opts.ttt_steps,
            "seq_len": opts.seq_len, "rows": opts.rows, "lr": opts.lr, "seed": opts.seed, "data": opts.data}
    ckdir = os.path.join(out, "checkpoints")
    with holding_run_dir(out):
        clean_interrupted(ckdir, log=log)
        resume_from, skipped = resume_checkpoint(out) if opts.resume else (None, [])
        if opts.resume and resume_from is None:
            raise ValueError(f"--resume: no checkpoint found in {ckdir} (a finished run keeps none)"
                             + "".join(f"; {p} is {why}" for p, why in skipped))
        if not opts.resume and latest_checkpoint(out) is not None:
            raise ValueError(f"{out} holds an unfinished draft run ({latest_checkpoint(out)}); pass --resume to "
                             f"continue it, or remove {ckdir} to start over")
        if resume_from is not None:
            saved = read_draft_config(resume_from).get("train", {})
            for k in RESUME_SAME:
                if saved.get(k) != info[k]:
                    raise ValueError(f"--resume: the run in {out} trains with {k}={saved.get(k)!r}, not {info[k]!r}; "
                                     "give it the same settings (only --steps may change)")
        else:
            for f in ("metrics.jsonl", "loss.png"):  # a new run's log starts empty
                if os.path.exists(os.path.join(out, f)):
                    os.remove(os.path.join(out, f))
        tcfg = draft_train_config(opts, out, device)
        trainer = DraftTrainer(draft, tcfg, DraftRows(ids, seg, opts.rows, opts.ttt_steps), target, opts.loss,
                               opts.ckpt, info, progress=progress, log=log)
        if resume_from is not None:
            if skipped:
                log(f"--resume: skipping {'; '.join(f'{p} ({why})' for p, why in skipped)}")
            trainer.load(resume_from, verify=opts.verify)
            log(f"resumed from {resume_from} at step {trainer.step}")
        n_params = sum(p.numel() for p in draft.parameters())
        log(f"target {opts.ckpt}: {target.config.num_hidden_layers} layers, frozen; draft: MTP block + W_E3 "
            f"({n_params / 1e6:.2f}M parameters), features of AttnRes blocks {list(draft.blocks)} + the final hidden "
            f"state; loss {opts.loss}, {opts.ttt_steps}-step training-time test, {opts.steps} steps of {opts.rows} x "
            f"{opts.seq_len} tokens{f', QAT {opts.qat}' if opts.qat else ''}; on {device}")
        summary = trainer.fit(progress_bar=False)
        logged = [r for r in trainer.history if "accept" in r]
        last = {} if not logged else {
            "step": logged[-1]["step"], "loss": logged[-1]["loss"], "accept": logged[-1]["accept"],
            "lr": logged[-1]["lr"], "elapsed_s": round(logged[-1]["elapsed_s"], 2),
            "tokens_per_s": round(logged[-1]["tokens_per_s"], 1)}
        result = {"out": out, "last": last, "step": summary["step"], "interrupted": summary["interrupted"],
                  "signal": summary["signal"]}
        if summary["interrupted"] and trainer.step < opts.steps:
            log(f"stopped at step {trainer.step} of {opts.steps}: checkpoint {summary['checkpoint']}; no draft "
                "written (--resume continues the run)")
            return result
        save_draft(draft, out, opts.ckpt, {**info, "last": last})
        shutil.rmtree(ckdir, ignore_errors=True)  # the run is finished: its result is the draft
    log(f"wrote the draft to {out} (config.json, model.safetensors, metrics.jsonl)")
    return result
