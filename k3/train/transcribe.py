"""`k3 eval --transcribe HELDOUT.jsonl`: how well a model with images writes what a record's images say, as the
character error rate of its greedy answer.

For each record (k3.data.images: a pair, or a conversation whose last assistant message is the reference), the
prompt is the record's messages before that last assistant message, rendered by the chat template with the
generation prompt, each image its placeholder run; the model generates greedily (the images encoded at prefill,
then one token at a time through its decode cache) until the end-of-text id or a chat marker (the end of what the
assistant writes), or `max_new_tokens`, and at most max(2 x the reference's tokens, 16) tokens, so an untrained
model's endless output costs a bounded time (its error is then bounded by about 2 x the reference length plus the
reference length).

The character error rate is the Levenshtein distance between the answer and the reference (insertions, deletions
and substitutions of characters, each 1), summed over the records, over the references' characters summed: 0 is
perfect, 1 is as many errors as reference characters (an empty answer), and more is possible (a long wrong one).
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from k3.data.images import (DEFAULT_MAX_IMAGE_TOKENS, ImageSlot, ImageTextRecord, encode_units, load_record_images,
                            read_records, record_units)

DEFAULT_MAX_RECORDS = 200
DEFAULT_MAX_NEW_TOKENS = 256


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between two strings (unit costs), one numpy row per character of `a`: the insertion
    chain along a row is a running minimum (row[j] = min_k<=j (cand[k] + j - k))."""
    if not a or not b:
        return len(a) + len(b)
    aa = np.frombuffer(a.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    bb = np.frombuffer(b.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    j = np.arange(len(b) + 1, dtype=np.int64)
    prev = j.copy()
    for i, c in enumerate(aa):
        cand = np.empty_like(prev)
        cand[0] = i + 1
        cand[1:] = np.minimum(prev[1:] + 1, prev[:-1] + (bb != c))  # deletion, substitution / match
        prev = np.minimum.accumulate(cand - j) + j  # insertions
    return int(prev[-1])


def char_error_rate(hypotheses: list[str], references: list[str]) -> float:
    """Sum of edit distances over the sum of reference lengths (module docstring)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    total = sum(len(r) for r in references)
    if total == 0:
        raise ValueError("the references are empty: no character to score")
    return sum(edit_distance(h, r) for h, r in zip(hypotheses, references)) / total


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def prompt_of(rec: ImageTextRecord) -> tuple[list, int, str]:
    """(rendered units of the prompt with the generation prompt, images it holds, the reference text) of a record:
    its messages up to its last assistant message, which is the reference."""
    last = max((i for i, m in enumerate(rec.messages) if isinstance(m, dict) and m.get("role") == "assistant"),
               default=None)
    if last is None:
        raise ValueError(f"{rec.where}: the record has no assistant message to score")
    ref = _text_of(rec.messages[last].get("content"))
    units = record_units(rec, None, rec.messages[:last], add_generation_prompt=True)
    k = sum(isinstance(u, ImageSlot) for u in units)
    return units, k, ref


@torch.no_grad()
def greedy_answer(model, prompt_ids: list[int], pixels: list[torch.Tensor], stop_ids: set[int], max_new: int,
                  device) -> list[int]:
    """The model's greedy continuation of `prompt_ids` (images at its placeholders), stopping before a stop id."""
    cache = model.new_cache()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    logits = model(ids, cache=cache, pixel_values=[p.to(device) for p in pixels] or None,
                   logits_to_keep=1).logits[0, -1]
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(logits.float().argmax())
        if nxt in stop_ids:
            break
        out.append(nxt)
        logits = model(torch.tensor([[nxt]], device=device), cache=cache, logits_to_keep=1).logits[0, -1]
    return out


def transcribe(model, tok, path: str, device, max_records: int = DEFAULT_MAX_RECORDS,
               max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS,
               log=None) -> dict:
    """Greedy answers to the first `max_records` records of `path` and their character error rate:
    {"cer", "exact", "records", "chars", "seconds", "examples": [{"where", "reference", "answer", "errors"}, ...]}."""
    from k3.config import VisionConfig
    from k3.serve.chat import markup_ids
    from k3.train.image_training import image_placeholder_id

    if getattr(model, "vision", None) is None:
        raise ValueError("--transcribe: the model has no vision encoder (its config has no vision_config)")
    vc = VisionConfig.from_dict(model.config.vision_config)
    pid = image_placeholder_id(tok, "the checkpoint's tokenizer")
    stop = {tok.eos_id, *(markup_ids(tok) or {}).values()}
    model.eval()
    t0 = time.perf_counter()
    hyps, refs, examples = [], [], []
    for rec in read_records(path):
        if len(refs) >= max_records:
            break
        units, n_img, ref = prompt_of(rec)
        pixels = load_record_images(rec, vc, max_image_tokens)[:n_img]
        counts = [vc.num_image_tokens(p.shape[1], p.shape[2]) for p in pixels]
        ids, _ = encode_units(units, tok, pid, counts, rec.where)
        ids = ids[:-1].tolist()  # encode_units ends the rendering with eos: a prompt goes on
        cap = min(max_new_tokens, max(2 * len(tok.encode(ref)), 16))
        answer = tok.decode(greedy_answer(model, ids, pixels, stop, cap, device))
        hyps.append(answer)
        refs.append(ref)
        examples.append({"where": rec.where, "reference": ref, "answer": answer,
                         "errors": edit_distance(answer, ref)})
        if log is not None and len(refs) % 25 == 0:
            log(f"transcribed {len(refs)} records ({time.perf_counter() - t0:.0f}s)")
    if not refs:
        raise ValueError(f"{path} holds no records")
    return {"cer": char_error_rate(hyps, refs), "exact": sum(h == r for h, r in zip(hyps, refs)) / len(refs),
            "records": len(refs), "chars": sum(len(r) for r in refs), "seconds": time.perf_counter() - t0,
            "examples": examples}


def main(args, ckpt: str, model, tok, dev) -> int:
    """`k3 eval --transcribe FILE`: prints the character error rate and a few answers; --out DIR also writes
    DIR/transcribe.json (every answer)."""
    import os

    from k3.files import atomic_write_text

    r = transcribe(model, tok, args.transcribe, dev, max_records=args.max_records or DEFAULT_MAX_RECORDS,
                   max_new_tokens=args.max_new_tokens or DEFAULT_MAX_NEW_TOKENS)
    print(f"character error rate {r['cer']:.4f} ({r['records']} records of {args.transcribe}, {r['chars']:,} "
          f"reference characters; {r['exact']:.1%} transcribed exactly; {r['seconds']:.1f}s) by {ckpt}")
    for e in r["examples"][:5]:
        print(f"  {e['where']}: {e['errors']} errors\n    reference: {e['reference']!r}\n    answer:    {e['answer']!r}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "transcribe.json")
        atomic_write_text(path, json.dumps({"checkpoint": ckpt, "file": args.transcribe, **r}, indent=1) + "\n")
        print(f"wrote {path}")
    return 0
