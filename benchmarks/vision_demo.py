"""The CPU demonstration of `k3 train --images` (BENCHMARKS.md, "Images: transcription demo"): a tiny model learns
to transcribe rendered lines of code, and the image share's effect on the text loss at equal text tokens.

    python benchmarks/vision_demo.py --out runs/vision_demo                     # every stage
    python benchmarks/vision_demo.py --out runs/vision_demo --stages render ocr

Stages (each skips what its output already holds, so a stopped run continues):
  render  single lines of Python code of this installation (--texts code: k3.data.render_pairs.source_files;
          printable ASCII, --min-chars to --max-chars characters after stripping; held out by the source file's
          content hash, k3.data.render_pairs.is_heldout_document, and a held-out line that is also a training line is
          dropped) or random digit strings of --min-chars to --max-chars digits (--texts digits; held out by the
          string's own hash), drawn in one face (DejaVu Sans Mono, else Pillow's default) at one size (--font-size
          px) in black on white, one 28 px encoder unit tall and as many units wide as the line needs;
          OUT/pairs/train.jsonl and heldout.jsonl with the prompt "Transcribe."
  ocr     `k3 train --preset tiny --images OUT/pairs/train.jsonl --image-share --ocr-share` for --ocr-minutes on
          the standard library's text, then the character error rate (k3.train.transcribe) on --cer-records held-out
          renders of the untrained model (the run's own initial weights: the same config and seed) and the trained one
  text    per seed (--seeds): --image-share 0 for --text-steps steps against --image-share --text-share for
          --text-steps / (1 - share) steps, so both read the same text tokens (every run has the vision encoder and
          the placeholder, so the two differ only in the image rows), compared on the final text held-out loss
The results go to OUT/results.json (each stage's) and are printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

PROMPT = "Transcribe."
FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"


def sh(argv: list[str]) -> None:
    from k3.cli import main

    print("$ k3 " + " ".join(argv), flush=True)
    rc = main(argv)
    if rc not in (0, None):
        raise SystemExit(f"k3 {argv[0]} failed with status {rc}")


def _results(out: str) -> dict:
    p = os.path.join(out, "results.json")
    return json.load(open(p)) if os.path.exists(p) else {}


def _save(out: str, key: str, value) -> None:
    from k3.files import atomic_write_text

    r = _results(out)
    r[key] = value
    atomic_write_text(os.path.join(out, "results.json"), json.dumps(r, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------------ render

def code_lines(min_chars: int, max_chars: int):
    """(line, document hash) of every distinct usable line of the installation's Python sources, in file order."""
    from k3.data.render_pairs import source_files
    from k3.data.sources import content_hash

    code, _ = source_files()
    seen = set()
    for _, path in code:
        try:
            data = open(path, "rb").read()
        except OSError:
            continue
        doc = content_hash(data)
        for ln in data.decode("utf-8", "replace").splitlines():
            s = ln.strip()
            if not (min_chars <= len(s) <= max_chars) or not all(32 <= ord(c) < 127 for c in s) or s in seen:
                continue
            seen.add(s)
            yield s, doc


def digit_strings(min_chars: int, max_chars: int, n: int, seed: int):
    """(string, hash) of `n` distinct random digit strings of min_chars to max_chars digits; a string's hash is its
    own, so a held-out string is never a training one."""
    from k3.data.sources import content_hash

    rng = random.Random(seed)
    seen = set()
    while len(seen) < n:
        s = "".join(rng.choice("0123456789") for _ in range(rng.randint(min_chars, max_chars)))
        if s not in seen:
            seen.add(s)
            yield s, content_hash(s.encode())


def stage_render(a) -> None:
    from PIL import Image, ImageDraw, ImageFont

    from k3.data.render_pairs import is_heldout_document, png_bytes
    from k3.files import replace_dir, write_synced

    dest = os.path.join(a.out, "pairs")
    if os.path.exists(os.path.join(dest, "heldout.jsonl")):
        print(f"render: {dest} exists")
        return
    font = ImageFont.truetype(FONT, a.font_size) if os.path.exists(FONT) else ImageFont.load_default(a.font_size)
    if a.texts == "digits":
        lines = list(digit_strings(a.min_chars, a.max_chars, round((a.pairs + a.heldout) * 1.2), a.seed))
    else:
        lines = list(code_lines(a.min_chars, a.max_chars))
        random.Random(a.seed).shuffle(lines)
    train, held = [], []
    for s, doc in lines:
        (held if is_heldout_document(doc, a.heldout_share) else train).append(s)
    train = train[:a.pairs]
    train_set = set(train)
    held = [s for s in held if s not in train_set][:a.heldout]
    tmp = dest + ".tmp"
    os.makedirs(os.path.join(tmp, "images"), exist_ok=True)
    ascent, descent = font.getmetrics()
    t0 = time.time()
    for split, texts in (("train", train), ("heldout", held)):
        recs = []
        for i, s in enumerate(texts):
            w = math.ceil((font.getlength(s) + 2 * a.pad) / 28) * 28
            img = Image.new("RGB", (w, 28), (255, 255, 255))
            ImageDraw.Draw(img).text((a.pad, (28 - ascent - descent) // 2), s, font=font, fill=(0, 0, 0))
            rel = f"images/{split}-{i:06d}.png"
            write_synced(os.path.join(tmp, rel), png_bytes(img))
            recs.append(json.dumps({"text": s, "images": [{"path": rel}], "prompt": PROMPT}) + "\n")
        write_synced(os.path.join(tmp, f"{split}.jsonl"), "".join(recs).encode("utf-8"))
    replace_dir(tmp, dest)
    info = {"texts": a.texts, "train": len(train), "heldout": len(held), "font": os.path.basename(FONT) if os.path.exists(FONT) else
            "pillow-default", "font_size": a.font_size, "chars": [a.min_chars, a.max_chars],
            "seconds": round(time.time() - t0, 1)}
    _save(a.out, "render", info)
    print(f"render: {info}")


# --------------------------------------------------------------------------------------------------------- ocr

def train_argv(a, out: str, share: float, seed: int, budget: list[str], eval_every: int | None = None,
               eval_batches: int = 2) -> list[str]:
    return ["train", "--preset", "tiny", "--images", os.path.join(a.out, "pairs", "train.jsonl"),
            "--image-share", str(share), "--out", out, "--seq-len", str(a.seq_len), "--batch-tokens",
            str(a.batch_tokens), "--max-corpus-mb", str(a.corpus_mb), "--data-cache", os.path.join(a.out, "data"),
            "--seed", str(seed), "--eval-every", str(eval_every or a.eval_every), "--eval-batches",
            str(eval_batches), "--device", "cpu", "--no-progress", *budget]


def untrained_model(ckpt: str, seed: int):
    """The model a run of `ckpt`'s config starts from (k3.train.run.build_run: torch.manual_seed(seed), then
    init_weights(seed)), before any step."""
    import torch

    from k3.checkpoint import load_config
    from k3.model.model import K3ForCausalLM

    torch.manual_seed(seed)
    return K3ForCausalLM(load_config(ckpt)).init_weights(seed=seed)


def stage_ocr(a) -> None:
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.run_dir import latest_checkpoint
    from k3.train.transcribe import transcribe

    if "ocr" in _results(a.out):
        print("ocr: done")
        return
    run = os.path.join(a.out, "ocr")
    if latest_checkpoint(run) is None:
        sh(train_argv(a, run, a.ocr_share, a.seed, ["--max-minutes", str(a.ocr_minutes)]))
    ckpt = latest_checkpoint(run)
    tok = load_any_tokenizer(ckpt)
    held = os.path.join(a.out, "pairs", "heldout.jsonl")
    res = {}
    for name, model in (("untrained", untrained_model(ckpt, a.seed)), ("trained", from_pretrained(ckpt))):
        r = transcribe(model, tok, held, "cpu", max_records=a.cer_records, max_new_tokens=64)
        res[name] = {k: r[k] for k in ("cer", "exact", "records", "chars", "seconds")}
        res[name]["examples"] = r["examples"][:8]
        print(f"ocr: {name}: CER {r['cer']:.3f}, exact {r['exact']:.1%} ({r['records']} records)")
    recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
    last = [r for r in recs if "loss" in r][-1]
    val = [r for r in recs if "val_loss" in r]
    res["run"] = {"steps": last["step"], "minutes": a.ocr_minutes, "image_share": a.ocr_share,
                  "images_seen": sum(r.get("images", 0) for r in recs if "loss" in r),
                  "images_per_s": last.get("images_per_s"), "text_tokens_per_s": last.get("text_tokens_per_s"),
                  "val_loss": [val[0]["val_loss"], val[-1]["val_loss"]],
                  "image_val_loss": [val[0].get("image_val_loss"), val[-1].get("image_val_loss")]}
    _save(a.out, "ocr", res)


# -------------------------------------------------------------------------------------------------------- text

def stage_text(a) -> None:
    done = _results(a.out).get("text", {})
    for seed in a.seeds:
        for share in (0.0, a.text_share):
            key = f"seed{seed}-share{share:g}"
            if key in done:
                continue
            run = os.path.join(a.out, "text", key)
            steps = round(a.text_steps / (1 - share))
            from k3.run_dir import latest_checkpoint

            if latest_checkpoint(run) is None:
                # held-out loss at the start and the end only, over --text-eval-batches batches
                sh(train_argv(a, run, share, seed, ["--max-steps", str(steps)], eval_every=steps,
                              eval_batches=a.text_eval_batches))
            recs = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))]
            val = [r for r in recs if "val_loss" in r]
            steps_recs = [r for r in recs if "loss" in r]
            done[key] = {"seed": seed, "image_share": share, "steps": steps,
                         "text_tokens": sum(r["text_tokens"] for r in steps_recs),
                         "images": sum(r["images"] for r in steps_recs),
                         "val_loss": val[-1]["val_loss"], "image_val_loss": val[-1].get("image_val_loss")}
            _save(a.out, "text", done)
            print(f"text: {key}: {done[key]}")


def main(argv=None) -> int:
    from k3.cli_args import RawDefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    p.add_argument("--out", default="runs/vision_demo", help="the demonstration's directory")
    p.add_argument("--stages", nargs="+", default=["render", "ocr", "text"], choices=["render", "ocr", "text"],
                   help="stages to run, in order")
    p.add_argument("--seed", type=int, default=0, help="seed of the line sample and of the ocr run (default 0)")
    p.add_argument("--pairs", type=int, default=20000, help="training renders (default 20000)")
    p.add_argument("--heldout", type=int, default=500, help="held-out renders at most (default 500)")
    p.add_argument("--heldout-share", type=float, default=0.05, help="share of source files held out (default 0.05)")
    p.add_argument("--texts", default="code", choices=["code", "digits"],
                   help="what the renders show: lines of the installation's Python code, or random digit strings "
                        "(held out by the string's own hash) (default code)")
    p.add_argument("--min-chars", type=int, default=4, help="shortest line (default 4)")
    p.add_argument("--max-chars", type=int, default=16, help="longest line (default 16)")
    p.add_argument("--font-size", type=int, default=20, help="font size in px (default 20: 12 px a character)")
    p.add_argument("--pad", type=int, default=4, help="left/right padding in px (default 4)")
    p.add_argument("--seq-len", type=int, default=128, help="row length (default 128)")
    p.add_argument("--batch-tokens", type=int, default=1024, help="tokens per step (default 1024)")
    p.add_argument("--corpus-mb", type=float, default=8.0, help="--max-corpus-mb of the text (default 8)")
    p.add_argument("--eval-every", type=int, default=100, help="default 100")
    p.add_argument("--ocr-share", type=float, default=0.75, help="image share of the ocr run (default 0.75)")
    p.add_argument("--ocr-minutes", type=float, default=12.0, help="training minutes of the ocr run (default 12)")
    p.add_argument("--cer-records", type=int, default=200, help="held-out renders scored (default 200)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds of the text stage (default 0 1)")
    p.add_argument("--text-share", type=float, default=0.2, help="the image share compared with 0 (default 0.2)")
    p.add_argument("--text-steps", type=int, default=40, help="steps of the share-0 runs (default 40)")
    p.add_argument("--text-eval-batches", type=int, default=16,
                   help="held-out text batches of the text stage's final evaluation (default 16)")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    for stage in a.stages:
        {"render": stage_render, "ocr": stage_ocr, "text": stage_text}[stage](a)
    print(f"done in {(time.time() - t0) / 60:.1f} min; results in {os.path.join(a.out, 'results.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
