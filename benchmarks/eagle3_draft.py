"""EAGLE-3 draft fine-tuning (report §4.1.4): the pre-trained MTP layer vs EAGLE-3 drafts trained with KL and LK.

    python benchmarks/eagle3_draft.py --work runs/eagle3                    # CPU: tiny target, a few minutes each
    python benchmarks/eagle3_draft.py --work runs/eagle3 --base CKPT        # an existing target checkpoint
    python benchmarks/eagle3_draft.py --work runs/eagle3 --gpu              # one GPU: k3-mini (not run on CPU)

Steps:
  1. target: `k3 train --preset tiny` for --pretrain-minutes on the default corpus (unless --base); with --gpu the
     preset is k3-mini on the GPU defaults;
  2. two drafts from the target's MTP layer, `k3 train-draft` with the same steps, data and seed: --loss kl and
     --loss lk;
  3. on held-out prompts (the default corpus's held-out documents, never trained on): the training-time-test
     acceptance estimate sum_x min(p, q) per unrolled step (W_E3 = [0 0 I] is the pre-trained MTP layer exactly),
     and, through the serving engine at batch 1 with --num-draft-tokens drafts, the mean accepted length (the
     engine's metric: tokens emitted per verification) and decode speed against no speculation, greedy (outputs
     checked equal to non-speculative) and at temperature 1.
Prints one JSON object (also --out FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _log(msg: str) -> None:
    print(f"[eagle3 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def pretrain(work: str, args) -> str:
    from k3.run_dir import latest_checkpoint
    from k3.train.run import CPU_DEFAULTS, GPU_DEFAULTS, RunOptions, run_training
    from k3.train.trainer import TrainConfig

    out = os.path.join(work, "target")
    ck = latest_checkpoint(out)
    if ck is not None:
        return ck
    d = GPU_DEFAULTS if args.gpu else CPU_DEFAULTS
    tcfg = TrainConfig(out=out, max_minutes=args.pretrain_minutes, seq_len=d["seq_len"],
                       batch_tokens=d["batch_tokens"], lr=d["lr"], seed=args.seed)
    run_training(RunOptions(preset=d["preset"], device=args.device), tcfg, progress_bar=False, log=_log)
    return latest_checkpoint(out)


def train_drafts(ck: str, work: str, args) -> dict[str, str]:
    from k3.posttrain.eagle3 import DraftOptions, train_draft

    out = {}
    for loss in ("kl", "lk"):
        d = os.path.join(work, f"draft-{loss}")
        if not os.path.isfile(os.path.join(d, "config.json")):
            t0 = time.perf_counter()
            train_draft(DraftOptions(ckpt=ck, out=d, steps=args.steps, loss=loss, qat=args.qat, seq_len=args.seq_len,
                                     rows=args.rows, lr=args.lr, seed=args.seed, device=args.device,
                                     max_corpus_mb=args.max_corpus_mb, log_every=max(1, args.steps // 10)), log=_log)
            _log(f"draft {loss}: {time.perf_counter() - t0:.0f} s")
        out[loss] = d
    return out


def heldout_rows(ck: str, args):
    """Held-out token rows (the corpus's held-out documents) and prompts (their first --prompt-tokens tokens)."""
    import numpy as np

    from k3.data.tokenizer import load_any_tokenizer
    from k3.posttrain.eagle3 import token_rows
    from k3.train.run import load_corpus

    tok = load_any_tokenizer(ck)
    _, held = load_corpus([], args.max_corpus_mb, log=_log)
    rows = token_rows(tok, held, args.eval_rows, args.seq_len, seed=args.seed + 1)
    seg = np.zeros_like(rows)
    np.cumsum(rows[:, :-1] == tok.eos_id, axis=1, out=seg[:, 1:])
    prompts = []
    for d in held:
        ids = tok.encode(d.text)
        if len(ids) >= args.prompt_tokens:
            prompts.append(list(ids[:args.prompt_tokens]))
        if len(prompts) == args.prompts:
            break
    return tok, torch.from_numpy(rows), torch.from_numpy(seg), prompts


@torch.no_grad()
def ttt_acceptance(target, draft, rows, seg, device) -> list[float]:
    from k3.posttrain.eagle3 import acceptance, unroll

    sums, counts = torch.zeros(7), torch.zeros(7)
    for i in range(0, rows.shape[0], 4):
        u = unroll(target, draft, rows[i:i + 4].to(device), seg[i:i + 4].to(device))
        for j, (dl, ok) in enumerate(zip(u.draft_logits, u.valid)):
            sums[j] += float(acceptance(u.target_logits[ok], dl[ok]).sum())
            counts[j] += int(ok.sum())
    return [round(float(a), 4) for a in sums / counts.clamp(min=1)]


def decode(target, tok, prompts, spec: str, draft_dir: str | None, args, temperature: float) -> dict:
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    eng = LLMEngine(target, tok, EngineConfig(cache_memory_mb=args.cache_mb, speculative=spec, draft=draft_dir,
                                              num_draft_tokens=args.k, cuda_graphs=args.gpu and spec == "off"))
    eng.eos_id = None  # every request decodes max_new_tokens
    outs, t_decode, n_tokens = [], 0.0, 0
    for i, p in enumerate(prompts):  # batch 1: one request at a time
        params = SamplingParams(max_tokens=args.max_new_tokens, temperature=temperature, seed=args.seed + i)
        seq = eng.add_request(p, params)
        while seq.first_token_at is None:  # prefill (and the first token): not decode time
            eng.step()
        t0 = time.perf_counter()
        while eng.has_work():
            eng.step()
        if target.model.embed_tokens.weight.device.type == "cuda":
            torch.cuda.synchronize()
        t_decode += time.perf_counter() - t0
        n_tokens += len(seq.output_ids) - 1
        outs.append(seq.output_ids)
    m = eng.metrics
    return {"outputs": outs, "decode_tok_s": n_tokens / t_decode,
            "mean_accepted_length": m.mean_accepted_length if m.spec_verifications else 1.0,
            "verifications": m.spec_verifications}


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--work", required=True)
    ap.add_argument("--base", help="an existing target checkpoint (skips step 1)")
    ap.add_argument("--gpu", action="store_true", help="k3-mini on the GPU defaults (device cuda)")
    ap.add_argument("--pretrain-minutes", type=float, default=15.0)
    ap.add_argument("--steps", type=int, default=150, help="draft training steps (each loss)")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--qat", choices=["mxfp4"], default=None)
    ap.add_argument("--max-corpus-mb", type=float, default=None)
    ap.add_argument("--eval-rows", type=int, default=16, help="held-out rows for the acceptance estimate")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3, help="draft tokens per verification")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--cache-mb", type=float, default=256.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None)
    ap.add_argument("--out")
    args = ap.parse_args()
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    if args.gpu and args.seq_len == 256:  # k3-mini rows; the training-time test's explicit masked attention holds
        args.seq_len, args.rows = 2048, min(args.rows, 4)  # O(7^2 T^2) scores per row: fewer rows per step
    os.makedirs(args.work, exist_ok=True)
    torch.set_num_threads(max(1, torch.get_num_threads()))

    from k3.draft_checkpoint import load_draft
    from k3.model.eagle3 import Eagle3Layer
    from k3.posttrain.eagle3 import load_target

    t0 = time.perf_counter()
    ck = args.base or pretrain(args.work, args)
    _log(f"target {ck}")
    drafts = train_drafts(ck, args.work, args)
    tok, rows, seg, prompts = heldout_rows(ck, args)
    target = load_target(ck, torch.device(args.device), qat=args.qat)
    res = {"target": ck, "device": args.device, "draft_steps": args.steps, "rows": args.rows, "seq_len": args.seq_len,
           "num_draft_tokens": args.k, "prompts": len(prompts), "prompt_tokens": args.prompt_tokens,
           "max_new_tokens": args.max_new_tokens, "ttt_acceptance": {}, "decode": {}}
    res["ttt_acceptance"]["mtp"] = ttt_acceptance(target, Eagle3Layer.from_target(target).eval(), rows, seg,
                                                  args.device)
    for loss, d in drafts.items():
        res["ttt_acceptance"][f"eagle3-{loss}"] = ttt_acceptance(target, load_draft(d, target), rows, seg, args.device)
    _log(f"held-out acceptance estimates per step: {res['ttt_acceptance']}")
    target = load_target(ck, torch.device(args.device))  # the serving engine's own model object
    for temp in [float(t) for t in args.temperatures.split(",")]:
        runs = {"off": decode(target, tok, prompts, "off", None, args, temp),
                "mtp": decode(target, tok, prompts, "mtp", None, args, temp)}
        for loss, d in drafts.items():
            runs[f"eagle3-{loss}"] = decode(target, tok, prompts, "eagle3", d, args, temp)
        base = runs["off"]["decode_tok_s"]
        key = f"temperature {temp:g}"
        res["decode"][key] = {
            name: {"mean_accepted_length": round(r["mean_accepted_length"], 3),
                   "decode_tok_s": round(r["decode_tok_s"], 1), "speedup": round(r["decode_tok_s"] / base, 3),
                   **({"same_output_as_off": r["outputs"] == runs["off"]["outputs"]} if temp == 0 else {})}
            for name, r in runs.items()}
        _log(f"{key}: {json.dumps(res['decode'][key])}")
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
