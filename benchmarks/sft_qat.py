"""SFT and MXFP4 QAT on the docstring-to-code task (report §4.1.1, §4.1.4): held-out reply loss and compile rate.

    python benchmarks/sft_qat.py --work runs/sft_qat                         # CPU, tiny, a few minutes
    python benchmarks/sft_qat.py --work runs/sft_qat --preset k3-mini --pretrain-steps 2000 --sft-steps 300 \
        --seq-len 2048 --batch-tokens 65536 --records 20000 --source installation --generate 200   # one H200
    python benchmarks/sft_qat.py --work DIR --base CKPT ...                   # start from an existing checkpoint

Steps (every model a checkpoint under --work):
  1. data: `k3 data sft-from-source` on the standard library (--source installation: and the installed packages; held
     out by file), capped at --records training and --heldout held-out conversations;
  2. base: `k3 train` of --preset on the standard library for --pretrain-steps (unless --base);
  3. SFT: `k3 sft` of the base on the training conversations, unquantized, for --sft-steps;
  4. SFT + QAT: the same run with --qat mxfp4 (MXFP4 expert weights, MXFP8 expert inputs throughout), exported;
  5. SFT + PTQ: `k3 quantize` of the SFT checkpoint (MXFP4 weights, MXFP8 expert inputs);
  6. with --noise-seeds K: K more unquantized SFT runs, seeds --seed+1 .. --seed+K (only the data order differs),
     whose held-out losses beside the first one's measure the run-to-run noise (`sft_seed_std`): a PTQ loss below
     it leaves `qat_recovery` undetermined;
  7. with --qat-phase N, a paired comparison that the seed noise of step 6 does not blur: from the SFT model, N more
     steps unquantized (`phase`) and the same N steps, same seed and data, with MXFP4 QAT (`phase_qat`, exported),
     and `phase` quantized by PTQ (`phase_ptq`). The two runs start from the same weights and see the same rows, so
     they differ only by the quantization in the forward; with --noise-seeds K the same pair (and its PTQ) for each
     of the K other seeds (`phase_seed{s}`, `phase_qat_seed{s}`, `phase_ptq_seed{s}`): one recovery per pair
     (`qat_phase_recoveries`), whose spread is the pairing's noise;
A finished stage keeps only what the later steps read (the SFT model's files, the QAT run's export), not its
run's checkpoints with their optimizer state (~2x the model each); before any stage runs, the free disk space is
checked against what the remaining stages write. --base takes a checkpoint or a run directory (its newest complete
checkpoint; a `.partial` one left by an interrupted save never counts).
then for base, SFT, SFT+PTQ and SFT+QAT: the held-out loss over the assistant's tokens (nats/token) and, for
--generate held-out prompts, the fraction of greedy completions (up to --max-new-tokens, cut at the template's
stop strings) that `compile()`. `qat_recovery` = (PTQ loss - QAT loss) / (PTQ loss - SFT loss): the share of the
loss that PTQ loses which QAT wins back (the issue's goal: >= 2/3); `qat_phase_recovery` the same for the paired
phase runs (and `qat_phase_recoveries` per seed). Prints one JSON object (also --out FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _log(msg: str) -> None:
    print(f"[sft_qat {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def source_paths(source: str) -> list[str]:
    """The trees the conversations come from: [] (the standard library, sft_from_source's default) or, for
    "installation", the standard library's tree and every site-packages directory outside it."""
    if source == "stdlib":
        return []
    from k3.data.sources import site_roots, stdlib_root

    root = stdlib_root()
    return [root] + [p for p in site_roots() if not p.startswith(root + os.sep)]


def make_data(work: str, records: int, heldout: int, source: str = "stdlib") -> tuple[str, str]:
    from k3.data.sft_from_source import sft_from_source, write_jsonl

    train_path, held_path = os.path.join(work, "train.jsonl"), os.path.join(work, "heldout.jsonl")
    if not (os.path.isfile(train_path) and os.path.isfile(held_path)):
        train, held, st = sft_from_source(source_paths(source), max_records=records, max_heldout=heldout)
        write_jsonl(train, train_path)
        write_jsonl(held, held_path)
        _log(f"data: {st.train} training, {st.heldout} held-out conversations ({st.files} files)")
    return train_path, held_path


def _tcfg(out: str, steps: int, args, **kw):
    from k3.train.trainer import TrainConfig

    return TrainConfig(out=out, max_steps=steps, seq_len=args.seq_len, batch_tokens=args.batch_tokens,
                       lr=kw.pop("lr", args.sft_lr), eval_every=max(steps, 1), eval_batches=8,
                       save_every_minutes=1e9, seed=args.seed, **kw)


def pretrain(work: str, args) -> str:
    from k3.run_dir import latest_checkpoint
    from k3.serve.chat import save_chat_template
    from k3.train.run import RunOptions, run_training

    out = os.path.join(work, "base")
    if latest_checkpoint(out) is None:
        run_training(RunOptions(preset=args.preset, device=args.device, max_corpus_mb=args.corpus_mb,
                                vocab_size=args.vocab_size),
                     _tcfg(out, args.pretrain_steps, args, lr=args.pretrain_lr), progress_bar=False, log=_log)
    ck = latest_checkpoint(out)
    save_chat_template(ck)  # the default template, written as `k3 init` does
    return ck


def resolve_base(base: str) -> str:
    """--base as a checkpoint: a run directory's newest complete checkpoint, else the path itself."""
    from k3.run_dir import latest_checkpoint

    if os.path.isdir(os.path.join(base, "checkpoints")):
        ck = latest_checkpoint(base)
        if ck is None:
            raise SystemExit(f"sft_qat: --base {base} is a run directory without a complete checkpoint")
        return ck
    if not os.path.isfile(os.path.join(base, "config.json")):
        raise SystemExit(f"sft_qat: --base {base} is neither a checkpoint (no config.json) nor a run directory "
                         f"(no checkpoints/): train one first (k3 train --out {base}) or leave --base out")
    return base


def stage_result(work: str, name: str, qat: str | None) -> str:
    """What a finished stage leaves for the later steps: the QAT run's MXFP4 export, the SFT run's model."""
    return os.path.join(work, name, "mxfp4" if qat else "model")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def keep_model_only(ckpt: str, dest: str) -> str:
    """`dest`: the checkpoint `ckpt` without its trainer state (hard links where the file system has them, else
    copies), written as dest.partial and renamed, so an interrupted call leaves no half model behind."""
    import shutil

    from k3.train.checkpointing import TRAINER_STATE_FILES

    tmp = dest + ".partial"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    for f in sorted(os.listdir(ckpt)):
        src = os.path.join(ckpt, f)
        if f in TRAINER_STATE_FILES or not os.path.isfile(src):
            continue
        try:
            os.link(src, os.path.join(tmp, f))
        except OSError:
            shutil.copy2(src, os.path.join(tmp, f))
    os.rename(tmp, dest)
    return dest


def drop_run_checkpoints(out: str) -> None:
    """A finished stage's run checkpoints (weights and optimizer state) go; its result stays."""
    import shutil

    ckdir = os.path.join(out, "checkpoints")
    if os.path.isdir(ckdir):
        freed = _dir_bytes(ckdir)
        shutil.rmtree(ckdir)
        _log(f"{os.path.basename(out)}: removed its run checkpoints ({freed / 2**30:.1f} GiB), kept its result")


def sft(work: str, name: str, base: str, train: str, held: str, args, qat: str | None, steps: int | None = None) -> str:
    from k3.posttrain.sft import SFTOptions, run_sft
    from k3.run_dir import INDEX, complete_checkpoints, latest_checkpoint
    from k3.train.qat import export_checkpoint

    steps = args.sft_steps if steps is None else steps
    out = os.path.join(work, name)
    result = stage_result(work, name, qat)
    if os.path.isfile(os.path.join(result, INDEX)):  # finished by an earlier invocation
        drop_run_checkpoints(out)
        return result
    done = complete_checkpoints(os.path.join(out, "checkpoints"))
    if not (done and done[-1][0] >= steps):  # a fresh run, or one an earlier invocation left short
        if done:
            _log(f"{name}: resuming the run left at step {done[-1][0]} of {steps}")
        run_sft(SFTOptions(ckpt=base, data=[train], heldout=[held], device=args.device, resume=bool(done)),
                _tcfg(out, steps, args, qat=qat), progress_bar=False, log=_log)
    if qat and not os.path.isfile(os.path.join(result, INDEX)):  # trained, the export cut short: from its checkpoint
        export_checkpoint(latest_checkpoint(out), out, log=_log)
    elif not qat:
        keep_model_only(latest_checkpoint(out), result)
    drop_run_checkpoints(out)
    return result


def seed_stages(args) -> list[tuple[str, int]]:
    """The --noise-seeds reference runs: (stage name, seed)."""
    return [(f"sft_seed{args.seed + i}", args.seed + i) for i in range(1, args.noise_seeds + 1)]


def _with_seed(args, seed: int):
    return argparse.Namespace(**{**vars(args), "seed": seed})


def disk_needed(work: str, base: str, extra: tuple[str, ...] = (), qat_extra: tuple[str, ...] = (),
                ptq_extra: tuple[str, ...] = ()) -> int:
    """Bytes the stages not yet finished will write: per training stage one checkpoint (fp32 weights and the
    optimizer state; the base run's own trainer state gives its size, else ~2x the weights); the exports (MXFP4
    QAT and PTQ) at most half the fp32 weights each. `extra`: more unquantized SFT stages (the seed runs and the
    phase runs), `qat_extra` more QAT stages, `ptq_extra` more PTQ outputs."""
    from k3.checkpoint import INDEX, load_config
    from k3.model.model import K3ForCausalLM
    from k3.train.checkpointing import TRAINER_STATE_FILES

    with torch.device("meta"):
        n = sum(p.numel() for p in K3ForCausalLM(load_config(base)).parameters())
    weights = 4 * n
    state_file = os.path.join(base, TRAINER_STATE_FILES[0])
    state = os.path.getsize(state_file) if os.path.isfile(state_file) else 2 * weights
    need = 0
    stages = (("sft", None), ("sft_qat", "mxfp4")) + tuple((e, None) for e in extra) \
        + tuple((e, "mxfp4") for e in qat_extra)
    for name, qat in stages:
        if not os.path.isfile(os.path.join(stage_result(work, name, qat), INDEX)):
            have = _dir_bytes(os.path.join(work, name, "checkpoints"))
            need += max(weights + state - have, 0) + (weights // 2 if qat else 0)
    for name in ("sft_ptq",) + tuple(ptq_extra):
        if not os.path.isdir(os.path.join(work, name)):
            need += weights // 2
    return need


def check_disk(work: str, base: str, extra: tuple[str, ...] = (), qat_extra: tuple[str, ...] = (),
               ptq_extra: tuple[str, ...] = ()) -> None:
    import shutil

    need, free = disk_needed(work, base, extra, qat_extra, ptq_extra), shutil.disk_usage(work).free
    _log(f"disk: the remaining stages write up to {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB free")
    if need > free:
        raise SystemExit(f"sft_qat: the remaining stages need up to {need / 2**30:.1f} GiB in {work}, and its disk "
                         f"has {free / 2**30:.1f} GiB free. Free space (a base run keeps --keep-checkpoints "
                         f"checkpoints, 2 by default: keep only the one passed as --base) or choose another --work.")


def heldout_loss(ckpt: str, held: str, args) -> float:
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.posttrain.sft import load_chat_data
    from k3.serve.chat import load_chat_template
    from k3.train.evaluate import evaluate_batches

    dev = pick_device(args.device)
    model = from_pretrained(ckpt, dtype=torch.float32, device=dev)
    tok = load_any_tokenizer(ckpt)
    packed = load_chat_data([held], tok, load_chat_template(ckpt), args.seq_len, False, "held-out",
                            log=lambda *a: None)
    return evaluate_batches(model, packed.eval_batches(8), dev, autocast_bf16=dev.type == "cuda")


def compile_rate(ckpt: str, held: str, args) -> float:
    from k3.data.tokenizer import load_any_tokenizer
    from k3.devices import pick_device
    from k3.posttrain.chat_data import read_chat_jsonl
    from k3.serve.build import load_for_generation
    from k3.serve.chat import load_chat_template, render_chat
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    if args.generate == 0:
        return float("nan")
    dev = pick_device(args.device)
    model = load_for_generation(ckpt, dev)  # as `k3 serve` runs it (bfloat16 on a GPU)
    tok = load_any_tokenizer(ckpt)
    template = load_chat_template(ckpt)
    recs, _ = read_chat_jsonl(held)
    recs = recs[: args.generate]
    engine = LLMEngine(model, tok, EngineConfig(cache_memory_mb=args.cache_mb))
    prompts = [tok.encode(render_chat(r.messages[:-1], template)) for r in recs]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0, stop=list(template.stop))
    ok = 0
    for seq in engine.generate(prompts, params):
        text = tok.decode(seq.output_ids)
        for s in template.stop:
            text = text.split(s)[0]
        try:
            with warnings.catch_warnings():  # the generated program's own warnings (an invalid escape, ...)
                warnings.simplefilter("ignore")
                compile(text, "<generated>", "exec", dont_inherit=True)
            ok += 1
        except (SyntaxError, ValueError):
            pass
    return ok / len(recs)


def recovery(plain: float, ptq: float, qat: float) -> float | None:
    """The share of what PTQ loses against the unquantized model that QAT wins back; None when PTQ loses nothing."""
    lost = ptq - plain
    return round((ptq - qat) / lost, 3) if lost > 0 else None


def main(argv=None) -> int:
    from k3.cli_args import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--work", required=True, help="directory for the data and every checkpoint (reused if present)")
    p.add_argument("--base", help="an existing base checkpoint (skips pre-training)")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="auto")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--corpus-mb", type=float, default=8.0, help="pre-training text (standard library), MB")
    p.add_argument("--pretrain-steps", type=int, default=120)
    p.add_argument("--pretrain-lr", type=float, default=3e-3)
    p.add_argument("--sft-steps", type=int, default=40)
    p.add_argument("--sft-lr", type=float, default=1e-3)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--records", type=int, default=3000, help="training conversations")
    p.add_argument("--source", choices=["stdlib", "installation"], default="stdlib",
                   help="the conversations' code: the standard library, or it and every installed package")
    p.add_argument("--heldout", type=int, default=150, help="held-out conversations")
    p.add_argument("--generate", type=int, default=40, help="held-out prompts completed for the compile rate")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--cache-mb", type=float, default=512.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise-seeds", type=int, default=0, metavar="K",
                   help="K more unquantized SFT runs with other seeds: the run-to-run noise of the held-out loss")
    p.add_argument("--qat-phase", type=int, default=0, metavar="N",
                   help="the paired comparison: N more steps from the SFT model unquantized and with QAT (step 7)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if args.noise_seeds < 0:
        p.error(f"--noise-seeds must be >= 0, got {args.noise_seeds}")
    if args.qat_phase < 0:
        p.error(f"--qat-phase must be >= 0, got {args.qat_phase}")

    os.makedirs(args.work, exist_ok=True)
    t0 = time.perf_counter()
    train, held = make_data(args.work, args.records, args.heldout, args.source)
    base = resolve_base(args.base) if args.base else pretrain(args.work, args)
    from k3.train.qat import quantize_checkpoint

    seeds = seed_stages(args)
    # the phase pairs: (suffix, seed); "" is the first one, of --seed
    pairs = [("", args.seed)] + [(f"_seed{seed}", seed) for _, seed in seeds] if args.qat_phase else []
    check_disk(args.work, base, tuple(name for name, _ in seeds) + tuple(f"phase{x}" for x, _ in pairs),
               tuple(f"phase_qat{x}" for x, _ in pairs), tuple(f"phase_ptq{x}" for x, _ in pairs))
    sft_ck = sft(args.work, "sft", base, train, held, args, None)
    qat_ck = sft(args.work, "sft_qat", base, train, held, args, "mxfp4")
    ptq_ck = os.path.join(args.work, "sft_ptq")
    if not os.path.isdir(ptq_ck):
        quantize_checkpoint(sft_ck, ptq_ck)
    seed_cks = {name: sft(args.work, name, base, train, held, _with_seed(args, seed), None)
                for name, seed in seeds}
    models = {"base": base, "sft": sft_ck, "sft_ptq_mxfp4": ptq_ck, "sft_qat_mxfp4": qat_ck}
    for x, seed in pairs:  # step 7: both runs of a pair from the SFT model, same seed and rows
        a = _with_seed(args, seed)
        phase_ck = sft(args.work, f"phase{x}", sft_ck, train, held, a, None, steps=args.qat_phase)
        phase_qat_ck = sft(args.work, f"phase_qat{x}", sft_ck, train, held, a, "mxfp4", steps=args.qat_phase)
        phase_ptq_ck = os.path.join(args.work, f"phase_ptq{x}")
        if not os.path.isdir(phase_ptq_ck):
            quantize_checkpoint(phase_ck, phase_ptq_ck)
        models.update({f"phase{x}": phase_ck, f"phase_ptq_mxfp4{x}": phase_ptq_ck, f"phase_qat_mxfp4{x}": phase_qat_ck})
    res = {"preset": args.preset, "sft_steps": args.sft_steps, "qat_phase_steps": args.qat_phase,
           "seq_len": args.seq_len, "batch_tokens": args.batch_tokens, "heldout_reply_loss": {}, "compile_rate": {}}
    for name, ck in models.items():
        res["heldout_reply_loss"][name] = round(heldout_loss(ck, held, args), 6)
        res["compile_rate"][name] = round(compile_rate(ck, held, args), 3)
        _log(f"{name}: loss {res['heldout_reply_loss'][name]}, compile rate {res['compile_rate'][name]}")
    loss = res["heldout_reply_loss"]
    if seeds:
        import statistics

        runs = [loss["sft"]] + [round(heldout_loss(ck, held, args), 6) for ck in seed_cks.values()]
        res["sft_seed_losses"] = runs
        res["sft_seed_std"] = round(statistics.stdev(runs), 6)
        _log(f"SFT over {len(runs)} seeds: losses {runs}, standard deviation {res['sft_seed_std']}")
    lost = loss["sft_ptq_mxfp4"] - loss["sft"]
    res["ptq_loss_increase"] = round(lost, 6)
    res["qat_loss_increase"] = round(loss["sft_qat_mxfp4"] - loss["sft"], 6)
    res["qat_recovery"] = recovery(loss["sft"], loss["sft_ptq_mxfp4"], loss["sft_qat_mxfp4"])
    if pairs:
        res["phase_ptq_loss_increase"] = round(loss["phase_ptq_mxfp4"] - loss["phase"], 6)
        res["phase_qat_loss_increase"] = round(loss["phase_qat_mxfp4"] - loss["phase"], 6)
        res["qat_phase_recovery"] = recovery(loss["phase"], loss["phase_ptq_mxfp4"], loss["phase_qat_mxfp4"])
        res["qat_phase_recoveries"] = [recovery(loss[f"phase{x}"], loss[f"phase_ptq_mxfp4{x}"],
                                                loss[f"phase_qat_mxfp4{x}"]) for x, _ in pairs]
        _log(f"QAT phase of {args.qat_phase} steps, per seed: recovery {res['qat_phase_recoveries']}")
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
