"""Multi-teacher on-policy distillation (report §4.1.3) against off-policy distillation, at an equal student-token
budget: the sampled reverse KL of the student to each domain's teacher on held-out prompts, before and after.

    OMP_NUM_THREADS=2 python benchmarks/mopd_demo.py --work runs/mopd_demo          # CPU, tiny (BENCHMARKS.md)
    python benchmarks/mopd_demo.py --work runs/mopd_demo --preset k3-mini --device cuda --pretrain-steps 2000 \
        --teacher-steps 300 --batch-tokens 65536 --mopd-steps 200 --rollouts-per-step 64 --max-new-tokens 256 \
        --max-prompt-tokens 512 --records 20000 --heldout 128                     # one H200
    python benchmarks/mopd_demo.py --work DIR --base CKPT ...                     # start from an existing checkpoint

Steps (every model a checkpoint under --work, reused when present):
  1. data, two domains from the Python standard library, held out by file: "code", the docstring-to-code
     conversations of `k3 data sft-from-source` (the user gives a signature and docstring, the assistant writes
     the function); "docs", those of `k3 data docs-from-source` from the library's long docstrings (the user
     gives the opening of a docstring, the assistant continues it);
  2. base: `k3 train` of --preset on the standard library for --pretrain-steps (unless --base);
  3. teachers: `k3 sft` of the base on each domain's conversations (a code teacher and a docs teacher);
  4. MOPD: `k3 distill` of the base (the student) with `--teacher code=... --teacher docs=...` on the training
     prompts of both domains for --mopd-steps;
  5. off-policy distillation: the teachers sample responses to the same training prompts (each prompt its
     domain's teacher) until the samples hold as many response tokens as MOPD trained on, and `k3 sft` of the base
     on them for one epoch (the same rows per step and learning rate);
then for base, MOPD and off-policy: on --eval-prompts held-out prompts per domain, --eval-samples samples each from
the student (temperature 1, up to --max-new-tokens), the sampled reverse KL to the domain's teacher, mean over
sampled tokens of log pi_student - log pi_teacher (nats/token; 0 = the teacher's distribution). Prints the table
and one JSON object (also --out FILE).
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
    print(f"[mopd_demo {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_data(work: str, args) -> dict[str, tuple[str, str]]:
    from k3.data.docs_from_source import docs_from_source
    from k3.data.sft_from_source import sft_from_source, write_jsonl

    out = {}
    for dom in ("code", "docs"):
        tr, he = os.path.join(work, f"{dom}_train.jsonl"), os.path.join(work, f"{dom}_heldout.jsonl")
        if not (os.path.isfile(tr) and os.path.isfile(he)):
            if dom == "code":
                train, held, _ = sft_from_source([], max_chars=args.max_code_chars)
                short = lambda r: len(r["messages"][1]["content"]) <= args.max_prompt_chars  # noqa: E731
                train, held = [r for r in train if short(r)], [r for r in held if short(r)]
            else:
                train, held, _ = docs_from_source([])
            train, held = train[: args.records], held[: args.heldout]
            write_jsonl(train, tr)
            write_jsonl(held, he)
        out[dom] = (tr, he)
        _log(f"data {dom}: {sum(1 for _ in open(tr))} training, {sum(1 for _ in open(he))} held-out conversations")
    return out


def _tcfg(out: str, args, **kw):
    from k3.train.trainer import TrainConfig

    return TrainConfig(out=out, seq_len=kw.pop("seq_len", args.seq_len),
                       batch_tokens=kw.pop("batch_tokens", args.batch_tokens), lr=kw.pop("lr", args.lr), eval_every=10 ** 6, eval_batches=4, save_every_minutes=1e9,
                       seed=args.seed, **kw)


def pretrain(work: str, args) -> str:
    from k3.run_dir import latest_checkpoint
    from k3.serve.chat import save_chat_template
    from k3.train.run import RunOptions, run_training

    out = os.path.join(work, "base")
    if latest_checkpoint(out) is None:
        run_training(RunOptions(preset=args.preset, device=args.device, max_corpus_mb=args.corpus_mb,
                                vocab_size=args.vocab_size),
                     _tcfg(out, args, max_steps=args.pretrain_steps, lr=args.pretrain_lr, seq_len=256),
                     progress_bar=False, log=_log)
    ck = latest_checkpoint(out)
    save_chat_template(ck)
    return ck


def sft(work: str, name: str, base: str, data: str, args, **kw) -> str:
    from k3.posttrain.sft import SFTOptions, run_sft
    from k3.run_dir import latest_checkpoint

    out = os.path.join(work, name)
    if latest_checkpoint(out) is None:
        run_sft(SFTOptions(ckpt=base, data=[data], device=args.device), _tcfg(out, args, **kw), progress_bar=False,
                log=_log)
    return latest_checkpoint(out)


def prompt_file(work: str, name: str, files: dict[str, str]) -> str:
    """{domain: chat .jsonl} -> one MOPD prompt file (the records tagged with their domain), domains interleaved."""
    from k3.posttrain.distill import write_prompts_jsonl

    path = os.path.join(work, name)
    if not os.path.isfile(path):
        per = {d: [json.loads(line) for line in open(f)] for d, f in files.items()}
        recs = []
        for i in range(max(len(v) for v in per.values())):
            for d, v in per.items():
                if i < len(v):
                    recs.append({"messages": v[i]["messages"], "domain": d})
        write_prompts_jsonl(recs, path)
    return path


def mopd(work: str, base: str, teachers: dict[str, str], prompts: str, args) -> tuple[str, int, int]:
    from k3.posttrain.distill import DistillOptions, run_distill
    from k3.run_dir import latest_checkpoint

    out = os.path.join(work, "mopd")
    if latest_checkpoint(out) is None:
        opts = DistillOptions(student=base, teachers=[f"{d}={ck}" for d, ck in teachers.items()], prompts=[prompts],
                              rollouts_per_step=args.rollouts_per_step, max_prompt_tokens=args.max_prompt_tokens,
                              max_new_tokens=args.max_new_tokens, rollout_budget=args.rollout_budget,
                              r_max=args.r_max, device=args.device)
        run_distill(opts, _tcfg(out, args, max_steps=args.mopd_steps, lr=args.mopd_lr), progress_bar=False, log=_log)
    recs = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    recs = [r for r in recs if "reward" in r]
    tokens = int(round(sum(r["samples"] * r["response_len"] for r in recs)))
    return latest_checkpoint(out), tokens, len(recs)


def teacher_samples(work: str, teachers: dict[str, str], prompts: str, budget: int, args) -> tuple[str, int]:
    """Chat .jsonl of teacher responses to the MOPD prompts (cycled, each prompt's own domain's teacher) holding
    `budget` response tokens; returns (path, response tokens)."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.posttrain.mopd import encode_prompt, read_prompts
    from k3.posttrain.rollout import Rollout, RolloutEngine, default_engine_config
    from k3.serve.chat import load_chat_template

    path = os.path.join(work, "teacher_samples.jsonl")
    meta = path + ".tokens"
    if os.path.isfile(path) and os.path.isfile(meta):
        return path, int(open(meta).read())
    dev = pick_device(args.device)
    ps = read_prompts([prompts])
    some = next(iter(teachers.values()))
    tok, template = load_any_tokenizer(some), load_chat_template(some)
    engines = {d: RolloutEngine(from_pretrained(ck, dtype=torch.float32, device=dev), tok,
                                default_engine_config(), max_new_tokens=args.max_new_tokens,
                                stop=list(template.stop)) for d, ck in teachers.items()}
    ids = [encode_prompt(p, tok, template) for p in ps]
    order = [i for i in range(len(ps)) if len(ids[i]) <= args.max_prompt_tokens]
    recs, total, k = [], 0, 0
    while total < budget:
        chunk = [order[(k + j) % len(order)] for j in range(32)]
        k += 32
        for d, eng in engines.items():
            rs = [Rollout(uid=k * 1000 + j, prompt_index=i, prompt_ids=ids[i]) for j, i in enumerate(chunk)
                  if ps[i].domain == d]
            eng.advance(rs, seed=args.seed + k)
            for r in rs:
                toks = [t for t in r.tokens if t != tok.eos_id]
                text = tok.decode(toks)
                for s in template.stop:
                    text = text.split(s)[0]
                recs.append({"messages": ps[r.prompt_index].messages + [{"role": "assistant", "content": text}]})
                total += len(r.tokens)
                if total >= budget:
                    break
            if total >= budget:
                break
    from k3.data.sft_from_source import write_jsonl

    write_jsonl(recs, path)
    open(meta, "w").write(str(total))
    _log(f"off-policy data: {len(recs)} teacher samples, {total} response tokens (MOPD trained on {budget})")
    return path, total


def reverse_kl(student: str, teachers: dict[str, str], held: dict[str, str], args) -> dict[str, float]:
    """Per domain: mean over the student's sampled tokens of log pi_student - log pi_teacher on held-out prompts
    (k3.posttrain.distill.sampled_reverse_kl, what `k3 distill --heldout` logs)."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.posttrain.distill import sampled_reverse_kl
    from k3.posttrain.mopd import Prompt, encode_prompt
    from k3.posttrain.rollout import RolloutEngine, default_engine_config
    from k3.serve.chat import load_chat_template

    dev = pick_device(args.device)
    model = from_pretrained(student, dtype=torch.float32, device=dev)
    tok, template = load_any_tokenizer(student), load_chat_template(student)
    eng = RolloutEngine(model, tok, default_engine_config(), max_new_tokens=args.max_new_tokens,
                        stop=list(template.stop))
    out = {}
    for d, f in held.items():
        recs = [json.loads(line) for line in open(f)]
        prompts = [Prompt("", d, None, messages=r["messages"][:-1]) for r in recs]
        pairs = [(p, encode_prompt(p, tok, template)) for p in prompts]
        pairs = [(p, x) for p, x in pairs if len(x) <= args.max_prompt_tokens][: args.eval_prompts]
        teacher = from_pretrained(teachers[d], dtype=torch.float32, device=dev)
        out[d] = sampled_reverse_kl(model, eng, pairs, lambda i: teacher, args.eval_samples, seed=args.seed + 12345,
                                    device=dev)[0]
    return out


def main(argv=None) -> int:
    from k3.cli_args import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--work", required=True, help="directory for the data and every checkpoint (reused if present)")
    p.add_argument("--base", help="an existing base checkpoint (skips pre-training)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--corpus-mb", type=float, default=4.0, help="pre-training text (standard library), MB")
    p.add_argument("--pretrain-steps", type=int, default=40)
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--teacher-steps", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3, help="teachers' and the off-policy student's SFT rate")
    p.add_argument("--seq-len", type=int, default=256, help="SFT rows")
    p.add_argument("--batch-tokens", type=int, default=2048, help="SFT tokens per step (teachers)")
    p.add_argument("--records", type=int, default=2000, help="training conversations per domain")
    p.add_argument("--heldout", type=int, default=64, help="held-out conversations per domain")
    p.add_argument("--max-code-chars", type=int, default=600, help="longest function of the code data")
    p.add_argument("--max-prompt-chars", type=int, default=400, help="longest code prompt (user message)")
    p.add_argument("--mopd-steps", type=int, default=20)
    p.add_argument("--mopd-lr", type=float, default=1e-3)
    p.add_argument("--rollouts-per-step", type=int, default=8)
    p.add_argument("--max-prompt-tokens", type=int, default=160)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rollout-budget", type=int, default=None)
    p.add_argument("--r-max", type=float, default=5.0)
    p.add_argument("--eval-prompts", type=int, default=12, help="held-out prompts per domain")
    p.add_argument("--eval-samples", type=int, default=2, help="student samples per held-out prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)

    os.makedirs(args.work, exist_ok=True)
    t0 = time.perf_counter()
    data = make_data(args.work, args)
    base = args.base or pretrain(args.work, args)
    _log(f"base {base} ({time.perf_counter() - t0:.0f} s)")
    teachers = {d: sft(args.work, f"teacher_{d}", base, data[d][0], args, max_steps=args.teacher_steps)
                for d in data}
    _log(f"teachers {teachers} ({time.perf_counter() - t0:.0f} s)")
    held = {d: data[d][1] for d in data}
    res = {"preset": args.preset, "device": args.device, "reverse_kl": {}}
    res["reverse_kl"]["base"] = reverse_kl(base, teachers, held, args)
    prompts = prompt_file(args.work, "prompts.jsonl", {d: data[d][0] for d in data})
    mopd_ck, budget, steps = mopd(args.work, base, teachers, prompts, args)
    _log(f"MOPD: {steps} steps, {budget} response tokens ({time.perf_counter() - t0:.0f} s)")
    samples, off_tokens = teacher_samples(args.work, teachers, prompts, budget, args)
    seq = args.max_prompt_tokens + args.max_new_tokens
    off_ck = sft(args.work, "offpolicy", base, samples, args, epochs=1.0, seq_len=seq,
                 batch_tokens=args.rollouts_per_step * seq, lr=args.mopd_lr)
    res["reverse_kl"]["mopd"] = reverse_kl(mopd_ck, teachers, held, args)
    res["reverse_kl"]["offpolicy_sft"] = reverse_kl(off_ck, teachers, held, args)
    res.update(mopd_steps=steps, mopd_response_tokens=budget, offpolicy_response_tokens=off_tokens,
               wall_s=round(time.perf_counter() - t0, 1))
    rk = res["reverse_kl"]
    print("| student | " + " | ".join(f"reverse KL to the {d} teacher (nats/token)" for d in data) + " |")
    print("|---|" + "---|" * len(data))
    for name in rk:
        print(f"| {name} | " + " | ".join(f"{rk[name][d]:.3f}" for d in data) + " |")
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
