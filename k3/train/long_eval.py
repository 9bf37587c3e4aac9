"""Long-context evaluation (`k3 eval --long`): passkey retrieval over a grid of context lengths and needle depths,
and the per-position loss on long held-out text out past the training length (the extrapolation curve).

Passkey retrieval (Mohtashami & Jaggi, 2023): a five-digit key is hidden at a chosen depth of filler text ("The pass
key is 12345. Remember it. 12345 is the pass key."), and the prompt ends by asking for it ("What is the pass key?
The pass key is "). The filler is real text, windows of the held-out documents, so the model reads what it was
trained on. Every item is drawn from its own seed: the same seed gives the same tokens, the key and its distractors.

Scoring needs no sampling. Each item carries K candidate keys (the true one at a random place among K - 1 distinct
distractors); the model's log-likelihood of each candidate after the prompt decides (chance 1/K; a tie at the top
counts as 1/(number tied), so a model that scores every key alike earns exactly chance). The exact-match rate is
reported too: whether the argmax at every key token, teacher-forced on the true key, is that token (greedy decoding
of the digits, without decoding). A K3 model reads the prompt once into a decode cache, and each candidate continues
from a copy of it (`candidate_logprobs`); any other model, given as a function returning the last positions' logits,
reads every prompt + candidate whole (`candidate_logprobs_full`, the reference the cached path is tested against).

The extrapolation curve: the next-token loss at each position of windows longer than the training length, averaged
over windows and reported in log-spaced buckets of position, so a model whose loss keeps falling with more context
extrapolates and one whose loss climbs past its training length does not (report §3.4: K3's MLA layers use no
positional encoding).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from k3.model.cache import K3Cache, KDACache, MLACache
from k3.model.model import K3ForCausalLM

HEADER = "There is a pass key hidden in this text. Find it and remember it.\n"
NEEDLE = ("\nThe pass key is ", "{key}", ". Remember it. ", "{key}", " is the pass key.\n")
QUESTION = "\nWhat is the pass key? The pass key is "
KEY_DIGITS = 5  # keys 10000..99999
MAX_KEY_TOKENS = KEY_DIGITS  # a byte-level tokenizer's token covers at least one character
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
FIRST_LENGTH = 4096


def min_length(tok) -> int:
    """The fewest prompt tokens that hold the task with `tok` (header, needle and question, no filler), for the
    longest tokenization of a key."""
    fixed = [HEADER, QUESTION] + [p for p in NEEDLE if p != "{key}"]
    return sum(len(tok.encode(t)) for t in fixed) + 2 * MAX_KEY_TOKENS


def check_lengths(tok, lengths: list[int]) -> None:
    """A ValueError naming the lengths too short to hold the task with `tok`, and the minimum."""
    short = [n for n in lengths if n < min_length(tok)]
    if short:
        raise ValueError(f"--lengths {','.join(map(str, short))}: too short to hold the passkey task, which takes "
                         f"{min_length(tok)} tokens with this tokenizer before any filler")


def default_lengths(max_length: int) -> list[int]:
    """4096, 8192, ... up to `max_length` (just `max_length` when it is below 4096)."""
    out, n = [], FIRST_LENGTH
    while n <= max_length:
        out.append(n)
        n *= 2
    return out or [max_length]


# ----------------------------------------------------------------------------------------------- the task


@dataclass(frozen=True)
class PasskeyItem:
    """One retrieval question. `input_ids` [length]: header, filler, needle, filler, question (the prompt; the
    answer follows it). `choices`: the K candidate keys' token ids, the true one at `answer`. `needle_start`: the
    needle's first token; `key_start`: the true key's first token inside the needle."""

    input_ids: np.ndarray
    choices: tuple[tuple[int, ...], ...]
    keys: tuple[str, ...]
    answer: int
    depth: float
    needle_start: int
    key_start: int

    @property
    def length(self) -> int:
        return len(self.input_ids)


def item_seed(seed: int, length: int, depth: float, index: int) -> np.random.SeedSequence:
    """The seed of item `index` of the cell (length, depth) of a run seeded `seed` (cells draw independently)."""
    return np.random.SeedSequence([seed, length, round(depth * 1_000_000), index])


def make_passkey_item(tok, filler: np.ndarray, length: int, depth: float, choices: int,
                      seed: int | np.random.SeedSequence) -> PasskeyItem:
    """The item of `seed`: a prompt of exactly `length` tokens with the needle starting `depth` of the way through
    the filler (0: right after the header, 1: right before the question), the filler a window of `filler` (a token
    stream of real text) at a seeded offset, wrapping around when the stream is shorter than the window."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} is outside [0, 1]")
    if choices < 2:
        raise ValueError(f"--choices {choices}: multiple choice needs at least 2 keys")
    if len(filler) == 0:
        raise ValueError("the filler text holds no tokens")
    rng = np.random.default_rng(seed)
    keys = [str(10 ** (KEY_DIGITS - 1) + int(k)) for k in rng.choice(9 * 10 ** (KEY_DIGITS - 1), choices,
                                                                        replace=False)]
    answer = int(rng.integers(choices))
    pieces = [tok.encode(p.format(key=keys[answer])) for p in NEEDLE]
    needle = [t for p in pieces for t in p]
    header, question = tok.encode(HEADER), tok.encode(QUESTION)
    n_filler = length - len(header) - len(needle) - len(question)
    if n_filler < 0:
        raise ValueError(f"length {length} cannot hold the passkey task: its header, needle and question take "
                         f"{length - n_filler} tokens with this tokenizer (use lengths of at least {min_length(tok)})")
    before = round(depth * n_filler)
    offset = int(rng.integers(len(filler)))
    text = np.take(filler, np.arange(offset, offset + n_filler), mode="wrap")
    ids = np.concatenate([np.asarray(header, dtype=np.int64), text[:before], np.asarray(needle, dtype=np.int64),
                          text[before:], np.asarray(question, dtype=np.int64)]).astype(np.int64)
    needle_start = len(header) + before
    return PasskeyItem(ids, tuple(tuple(tok.encode(k)) for k in keys), tuple(keys), answer, depth, needle_start,
                       needle_start + len(pieces[0]))


# ------------------------------------------------------------------------------------------------ scoring


def _padded(items: list[PasskeyItem], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prompts [B, L], candidates [B, K, n] padded with `pad_id`, their lengths [B, K])."""
    n = max(len(c) for it in items for c in it.choices)
    K = len(items[0].choices)
    cands = torch.full((len(items), K, n), pad_id, dtype=torch.long)
    lens = torch.zeros(len(items), K, dtype=torch.long)
    for b, it in enumerate(items):
        for k, c in enumerate(it.choices):
            cands[b, k, :len(c)] = torch.tensor(c)
            lens[b, k] = len(c)
    return torch.from_numpy(np.stack([it.input_ids for it in items])), cands, lens


def _score_tokens(logits: torch.Tensor, cand: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, n, V] predicting the n candidate tokens cand [B, n] (valid: the first `lens` [B]) -> (summed
    log-likelihood [B] fp64, every valid token the argmax [B])."""
    lp = F.log_softmax(logits.float(), dim=-1)
    tok = lp.gather(-1, cand[..., None])[..., 0].double()
    valid = torch.arange(cand.shape[1], device=cand.device)[None] < lens[:, None]
    hit = (lp.argmax(-1) == cand) | ~valid
    return (tok * valid).sum(-1), hit.all(-1)


def fork_cache(cache: K3Cache) -> K3Cache:
    """A copy of a contiguous decode cache that can be advanced without changing `cache`: the layer caches are new
    objects over the same tensors (a forward replaces a KDA state; MLA rows go to new tensors or past the rows held
    at the fork, MLACache.fork)."""
    layers = []
    for c in cache.layers:
        if isinstance(c, KDACache):
            n = KDACache()
            n.state, n.conv = c.state, list(c.conv)
        elif isinstance(c, MLACache):
            n = c.fork()
        else:
            raise TypeError(f"fork_cache copies the contiguous caches only, not a {type(c).__name__}")
        layers.append(n)
    out = K3Cache(layers, packed=cache.packed)
    out.seq_len = cache.seq_len
    return out


@torch.no_grad()
def candidate_logprobs(model: K3ForCausalLM, prompts: torch.Tensor, cands: torch.Tensor, lens: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate's log-likelihood after its prompt and whether teacher-forced greedy decoding reproduces it:
    prompts [B, L], cands [B, K, n] (the first lens [B, K] tokens valid) -> ([B, K] fp64, [B, K] bool). The prompts
    are read once into a decode cache; each candidate continues from a fork of it, so the cost is one prefill plus
    K forwards of n tokens."""
    cache = model.new_cache()
    first = model(prompts, cache=cache, logits_to_keep=1).logits  # [B, 1, V]: predicts each candidate's first token
    logp, hit = [], []
    for k in range(cands.shape[1]):
        rest = model(cands[:, k], cache=fork_cache(cache)).logits  # position j predicts token j + 1
        lp, h = _score_tokens(torch.cat([first, rest[:, :-1]], dim=1), cands[:, k], lens[:, k])
        logp.append(lp)
        hit.append(h)
    return torch.stack(logp, 1), torch.stack(hit, 1)


@torch.no_grad()
def candidate_logprobs_full(logits_fn, prompts: torch.Tensor, cands: torch.Tensor, lens: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """`candidate_logprobs` by reading every prompt + candidate whole: `logits_fn(ids [B, T], m)` returns the logits
    of the last m positions [B, m, V]. The reference, and the path of any model without a K3 decode cache."""
    n = cands.shape[2]
    logp, hit = [], []
    for k in range(cands.shape[1]):
        logits = logits_fn(torch.cat([prompts, cands[:, k]], dim=1), n + 1)[:, :n]
        lp, h = _score_tokens(logits, cands[:, k], lens[:, k])
        logp.append(lp)
        hit.append(h)
    return torch.stack(logp, 1), torch.stack(hit, 1)


def item_scores(logp: torch.Tensor, hit: torch.Tensor, answers: torch.Tensor) -> tuple[list[float], list[bool]]:
    """Per item: the multiple-choice score (1 / the number of candidates tied at the top when the true one is among
    them, else 0) and the exact match (greedy reproduces the true key)."""
    top = logp == logp.max(dim=1, keepdim=True).values
    right = top.gather(1, answers[:, None])[:, 0]
    score = torch.where(right, 1.0 / top.sum(1).double(), torch.zeros_like(right, dtype=torch.float64))
    return score.tolist(), hit.gather(1, answers[:, None])[:, 0].tolist()


class LengthDoesNotFit(RuntimeError):
    """One row of this length ran out of device memory."""


def score_items(model, items: list[PasskeyItem], device, rows: int, pad_id: int = 0) -> tuple[list[float], list[bool]]:
    """(multiple-choice score, exact match) of each item, `rows` items per forward (halved on running out of device
    memory; LengthDoesNotFit when a single row does not fit). `model`: a K3ForCausalLM (the cached path) or a
    function `(ids [B, T], m) -> logits of the last m positions` (the whole-sequence path)."""
    scores, exact = [], []
    i = 0
    while i < len(items):
        chunk = items[i:i + rows]
        prompts, cands, lens = (t.to(device) for t in _padded(chunk, pad_id))
        logp = None
        try:
            if isinstance(model, K3ForCausalLM):
                logp, hit = candidate_logprobs(model, prompts, cands, lens)
            else:
                logp, hit = candidate_logprobs_full(model, prompts, cands, lens)
        except torch.OutOfMemoryError:
            pass  # handled below, once the exception no longer holds the forward's tensors
        if logp is None:
            torch.cuda.empty_cache()
            if rows == 1:
                raise LengthDoesNotFit(f"one row of {chunk[0].length:,} tokens does not fit in device memory")
            rows = max(1, rows // 2)
            continue
        s, x = item_scores(logp.cpu(), hit.cpu(), torch.tensor([it.answer for it in chunk]))
        scores += s
        exact += x
        i += len(chunk)
    return scores, exact


def passkey_grid(model, tok, filler: np.ndarray, lengths: list[int], depths: list[float], items: int, choices: int,
                 seed: int, device, batch_tokens: int, log=print) -> dict:
    """The depth x length grid, lengths in increasing order, one progress line per cell; stops at the first length
    of which one row does not fit (`largest_fit` then names the last that did)."""
    cells, stopped = [], None
    for length in sorted(lengths):
        try:
            for depth in depths:
                t0 = time.monotonic()
                batch = [make_passkey_item(tok, filler, length, depth, choices, item_seed(seed, length, depth, i))
                         for i in range(items)]
                s, x = score_items(model, batch, device, max(1, batch_tokens // length), pad_id=tok.eos_id)
                cell = {"length": length, "depth": depth, "items": items, "accuracy": sum(s) / items,
                        "exact_match": sum(x) / items, "chance": 1.0 / choices,
                        "seconds": round(time.monotonic() - t0, 2)}
                cells.append(cell)
                log(f"passkey length {length:>9,} depth {depth:4.2f}: accuracy {cell['accuracy']:.3f} "
                    f"(chance {1 / choices:.3f}), exact match {cell['exact_match']:.3f}, {items} items, "
                    f"{cell['seconds']:.1f} s")
        except LengthDoesNotFit as e:
            stopped = length
            cells = [c for c in cells if c["length"] != length]
            log(f"passkey: stopped at length {length:,}: {e}")
            break
    done = sorted({c["length"] for c in cells})
    return {"lengths": done, "depths": list(depths), "items_per_cell": items, "choices": choices,
            "chance": 1.0 / choices, "seed": seed, "cells": cells, "largest_fit": done[-1] if done else None,
            "did_not_fit": stopped}


# ------------------------------------------------------------------------------------- per-position loss


@torch.no_grad()
def position_losses(model: K3ForCausalLM, windows: torch.Tensor, rows: int = 1, chunk: int = 4096) -> np.ndarray:
    """The mean next-token loss at each position of `windows` [N, L] (token ids): entry p is the loss of token p + 1
    read after p + 1 tokens, averaged over the windows; [L - 1] fp64. The head runs `chunk` positions at a time, so
    memory holds [rows, chunk, V] logits at any length."""
    model.eval()
    N, L = windows.shape
    total = torch.zeros(L - 1, dtype=torch.float64)
    for i in range(0, N, rows):
        ids = windows[i:i + rows]
        hidden = model.model(ids)
        for s in range(0, L - 1, chunk):
            e = min(s + chunk, L - 1)
            logits = model.head(hidden[:, s:e]).float()
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, s + 1:e + 1].reshape(-1),
                                 reduction="none").view(ids.shape[0], e - s)
            total[s:e] += ce.sum(0).double().cpu()
    return (total / N).numpy()


def bucket_edges(length: int, per_octave: int = 2, extra: tuple[int, ...] = ()) -> list[int]:
    """Edges of log-spaced buckets of context size (tokens read) covering 1 .. length - 1: [1, 2, 3, 4, 5, 8, ...]
    at `per_octave` per doubling, plus any `extra` edges inside (the training length), ending at `length`."""
    edges = {1, length}
    k = 0
    while (e := int(2 ** (k / per_octave))) < length:
        edges.add(e)
        k += 1
    edges.update(e for e in extra if 1 < e < length)
    return sorted(edges)


def bucket_curve(per_position: np.ndarray, windows: int, train_length: int | None = None) -> dict:
    """Buckets of the per-position losses (entry p: context p + 1): each {start, end (context sizes, end
    exclusive), loss, tokens}; with `train_length`, the mean loss within it and beyond it."""
    L = len(per_position) + 1
    ctx = np.arange(1, L)
    edges = bucket_edges(L, extra=(train_length,) if train_length else ())
    buckets = []
    for a, b in zip(edges[:-1], edges[1:]):
        sel = (ctx >= a) & (ctx < b)
        buckets.append({"start": a, "end": b, "loss": float(per_position[sel].mean()),
                        "tokens": int(sel.sum()) * windows})
    out = {"length": L, "windows": windows, "train_length": train_length, "buckets": buckets,
           "mean_loss": float(per_position.mean())}
    if train_length and train_length < L:
        out["loss_within_train_length"] = float(per_position[ctx < train_length].mean())
        out["loss_beyond_train_length"] = float(per_position[ctx >= train_length].mean())
    return out


def cut_windows(docs: list[np.ndarray], length: int, n: int) -> np.ndarray:
    """Up to `n` non-overlapping windows [m, length] cut inside documents (token arrays) of at least `length`
    tokens, taken round-robin across the documents (the first window of each, then the second, ...)."""
    per_doc = [[d[j * length:(j + 1) * length] for j in range(len(d) // length)] for d in docs]
    out = []
    for j in range(max((len(w) for w in per_doc), default=0)):
        out += [w[j] for w in per_doc if j < len(w)]
    if not out:
        longest = max((len(d) for d in docs), default=0)
        raise ValueError(f"no document holds {length:,} tokens (the longest has {longest:,}): use a shorter "
                         "--extrapolation-length or longer documents")
    return np.stack(out[:n]).astype(np.int64)


# ------------------------------------------------------------------------------------------- the command


def saved_train_length(ckpt: str) -> int | None:
    """The sequence length a checkpoint was trained at (its trainer_state.json's train_config), or None for a
    checkpoint without one (`k3 init`'s, an exported model)."""
    import json
    import os

    from k3.checkpoint import CheckpointError
    from k3.train.state import unflatten

    path = os.path.join(ckpt, "trainer_state.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            saved = unflatten(None, json.loads(f.read().decode("utf-8")))
        seq_len = saved["train_config"]["seq_len"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); the checkpoint is damaged") from None
    return int(seq_len) if isinstance(seq_len, int) else None


def long_documents(data: list[str] | None, tok, log=print) -> tuple[list[np.ndarray], str]:
    """The held-out long text as token arrays, and what it is: the held-out split of `data`, or by default the
    standard library's held-out files (as `k3 eval` scores them), their texts joined in order into one document
    (the files are short; a window then crosses file boundaries, which the text marks with blank lines).

    Not k3.data.long_docs's held-out packages: they are held out by package name, and their files are training
    files of the default corpus one at a time, so their text is not held out from a model trained on that corpus
    (and this standard library holds out only a few small packages)."""
    from k3.train.run import load_corpus

    _, heldout = load_corpus(data or [], None, log=lambda *a: None)
    if not heldout:
        raise ValueError(f"--data {' '.join(data or [])} has no held-out documents")
    what = (f"the held-out split of --data {' '.join(data)}" if data else "the standard library's held-out files")
    text = "\n\n".join(d.text for d in heldout)
    ids = np.asarray(tok.encode(text), dtype=np.int64)
    log(f"long text: {what}, {len(heldout)} documents joined into one of {len(ids):,} tokens")
    return [ids], f"{what}, {len(heldout)} documents joined into one"


def _atomic_png(fig, path: str) -> None:
    import io

    from k3.files import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())


def plot_heatmap(grid: dict, path: str) -> None:
    """passkey_heatmap.png: accuracy per (depth, length) cell, annotated, chance in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = grid["lengths"], grid["depths"]
    acc = np.full((len(depths), len(lengths)), np.nan)
    for c in grid["cells"]:
        acc[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
    fig, ax = plt.subplots(figsize=(1.2 * len(lengths) + 2.5, 0.6 * len(depths) + 1.8))
    im = ax.imshow(acc, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i in range(len(depths)):
        for j in range(len(lengths)):
            if not np.isnan(acc[i, j]):
                ax.text(j, i, f"{acc[i, j]:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), [_short(n) for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(f"passkey accuracy ({grid['items_per_cell']} items per cell, chance {grid['chance']:.2f})",
                 fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    _atomic_png(fig, path)
    plt.close(fig)


def plot_extrapolation(curve: dict, path: str) -> None:
    """extrapolation.png: mean loss per position bucket against context size (log x), the training length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b = curve["buckets"]
    x = [math.sqrt(c["start"] * max(c["start"], c["end"] - 1)) for c in b]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [c["loss"] for c in b], "o-", ms=3)
    if curve.get("train_length"):
        ax.axvline(curve["train_length"], color="gray", ls="--", lw=1, label=f"training length {curve['train_length']:,}")
        ax.legend()
    ax.set_xscale("log")
    ax.set_xlabel("tokens of context (position)")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"per-position loss, {curve['windows']} windows of {curve['length']:,} tokens", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _atomic_png(fig, path)
    plt.close(fig)


def _short(n: int) -> str:
    return f"{n // 2**20}M" if n % 2**20 == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def format_table(grid: dict) -> str:
    """The accuracy grid as text: a row per depth, a column per length."""
    lengths = grid["lengths"]
    acc = {(c["depth"], c["length"]): c["accuracy"] for c in grid["cells"]}
    lines = ["depth \\ length " + "".join(f"{_short(n):>8}" for n in lengths)]
    for d in grid["depths"]:
        lines.append(f"{d:>14g} " + "".join(f"{acc[(d, n)]:8.2f}" if (d, n) in acc else f"{'-':>8}"
                                            for n in lengths))
    return "\n".join(lines)


def extrapolation_curve(model, docs: list[np.ndarray], length: int, windows: int, train_length: int | None,
                        device, rows: int, log=print) -> dict:
    """The per-position loss over up to `windows` windows of `length` tokens (`cut_windows`), `rows` per forward,
    bucketed."""
    w = torch.from_numpy(cut_windows(docs, length, windows)).to(device)
    t0 = time.monotonic()
    per_position = position_losses(model, w, rows=rows)
    curve = bucket_curve(per_position, len(w), train_length)
    log(f"per-position loss: {len(w)} windows of {length:,} tokens, mean {curve['mean_loss']:.4f}"
        + (f", within the training length {curve['loss_within_train_length']:.4f}, beyond it "
           f"{curve['loss_beyond_train_length']:.4f}" if "loss_beyond_train_length" in curve else "")
        + f" ({time.monotonic() - t0:.1f} s)")
    return curve


def run_long_eval(model, tok, device, out: str, docs: list[np.ndarray], docs_what: str, lengths: list[int],
                  depths: list[float], items: int, choices: int, seed: int, extrapolation_length: int | None,
                  windows: int, train_length: int | None, batch_tokens: int, log=print) -> dict:
    """The passkey grid, then the extrapolation curve (at `extrapolation_length`, by default the grid's largest
    length that fit, cut to the longest document), written to OUT/long_eval.json, passkey_heatmap.png and
    extrapolation.png; returns the JSON's record."""
    import json
    import os

    from k3.files import atomic_write_text

    check_lengths(tok, lengths)
    model.eval()
    filler = np.concatenate(docs)
    grid = passkey_grid(model, tok, filler, lengths, depths, items, choices, seed, device, batch_tokens, log)
    grid["filler"] = f"{docs_what} ({len(filler):,} tokens)"
    if not grid["cells"]:
        raise ValueError(f"not even one row of {grid['did_not_fit']:,} tokens fits in device memory")
    log(format_table(grid))
    length = extrapolation_length or min(grid["largest_fit"], max(len(d) for d in docs))
    rows = max(1, batch_tokens // length)
    while True:  # out of device memory: half the rows, then (unless the length was asked for) half the length
        curve = None
        try:
            curve = extrapolation_curve(model, docs, length, windows, train_length, device, rows, log)
        except torch.OutOfMemoryError:
            pass
        if curve is not None:
            break
        torch.cuda.empty_cache()
        if rows > 1:
            rows //= 2
        elif extrapolation_length is None and length >= 4:
            log(f"per-position loss: one window of {length:,} tokens does not fit; trying {length // 2:,}")
            length //= 2
        else:
            raise ValueError(f"--extrapolation-length {length:,}: one window does not fit in device memory")
    curve["documents"] = docs_what
    record = {"passkey": grid, "extrapolation": curve}
    os.makedirs(out, exist_ok=True)
    atomic_write_text(os.path.join(out, "long_eval.json"), json.dumps(record, indent=1) + "\n")
    plot_heatmap(grid, os.path.join(out, "passkey_heatmap.png"))
    plot_extrapolation(curve, os.path.join(out, "extrapolation.png"))
    log(f"wrote {os.path.join(out, 'long_eval.json')}, passkey_heatmap.png and extrapolation.png")
    return record


# the flags of `k3 eval --long` (k3/cli.py), each None unless given
LONG_FLAGS = ("lengths", "max_length", "depths", "items", "choices", "seed", "extrapolation_length", "windows",
              "train_length", "batch_tokens", "out")
DEFAULTS = dict(depths=DEPTHS, items=20, choices=10, seed=0, windows=4, batch_tokens=32768, out="long_eval",
                cpu_max_length=4096, gpu_max_length=2 ** 20)


def _number_list(flag: str, text: str, kind, ok, allowed: str) -> list:
    try:
        values = [kind(v) for v in text.split(",")]
    except ValueError:
        values = None
    if not values or not all(ok(v) for v in values):
        raise ValueError(f"{flag} {text!r}: expected a comma-separated list of {allowed}")
    return sorted(set(values))


def main(args, ckpt: str, model, tok, device, log=print) -> int:
    """`k3 eval --long`: the flags' defaults resolved (lengths 4096, 8192, ... up to --max-length, on a CPU 4096
    unless given, else 1M stopping at the first that does not fit), then `run_long_eval`."""
    d = DEFAULTS
    depths = (_number_list("--depths", args.depths, float, lambda v: 0 <= v <= 1, "fractions in [0, 1]")
              if args.depths is not None else list(d["depths"]))
    if args.lengths is not None:
        lengths = _number_list("--lengths", args.lengths, int, lambda v: v > 0, "positive token counts")
        if args.max_length is not None:
            lengths = [n for n in lengths if n <= args.max_length]
    else:
        cap = args.max_length
        if cap is None:
            cap = d["cpu_max_length"] if device.type == "cpu" else d["gpu_max_length"]
            if device.type == "cpu":
                log(f"on a CPU the lengths stop at {cap:,} (--max-length raises it)")
        lengths = default_lengths(cap)
    if not lengths:
        raise ValueError(f"no length left: every --lengths value is above --max-length {args.max_length}")
    check_lengths(tok, lengths)
    train_length = args.train_length if args.train_length is not None else saved_train_length(ckpt)
    docs, what = long_documents(args.data, tok, log)
    pick = {k: getattr(args, k) if getattr(args, k) is not None else d[k]
            for k in ("items", "choices", "seed", "windows", "batch_tokens", "out")}
    run_long_eval(model, tok, device, pick["out"], docs, what, lengths, depths, pick["items"], pick["choices"],
                  pick["seed"], args.extrapolation_length, pick["windows"], train_length, pick["batch_tokens"], log)
    return 0
