"""Speculative decoding against plain decoding on a trained checkpoint, side by side in one run (report §5.4.2).

    python benchmarks/spec_decode.py --ckpt runs/k3                                 # CPU (speed meaningless)
    python benchmarks/spec_decode.py --ckpt runs/main --batch 1 4 16 64 --max-tokens 128 --json spec.json   # GPU

Prompts: consecutive --prompt-tokens windows of held-out text: the --prompts files (.txt/.md/.py/.rst: the file is a
document; .jsonl: each line's "text"), else the standard library files the training split holds out (by the same
stable hash), so a long document gives several prompts and a machine with few held-out files still has enough. For
each batch size, three engines over the same loaded model, greedy:

    off    no speculation (CUDA graphs where the model allows them)
    spec   --speculative mtp (or --draft DIR: eagle3) on every step
    auto   the same with --speculative-auto: speculation per batch size where it measures faster
    replay (--replay-after) spec with the accepted positions replayed right after acceptance
           (EngineConfig.fused_replay=False; the default engines fuse the replay into the next verification)
    vahead (--verify-ahead) spec with each proposal drafted ahead verified ahead too (EngineConfig.verify_ahead)

each generates --max-tokens tokens for every request after the engine's warm-up as `k3 serve` runs it at startup
(LLMEngine.warm_up: every graph bucket, the draft's first step at every power-of-two count of positions) and a
warm-up generation of the same prompts and length, so every CUDA graph the timed generation replays (each decode
bucket, prefill chunk and verification length) is captured, and every kernel it runs tuned, before the timing
starts; `graphs_made_while_timed` counts any made inside it anyway (it should be 0), and `graphs_off` gives, per arm,
why its steps ran without CUDA graphs (null where they ran on them: on a GPU every arm's should be null).
Reported: decode tokens/s (from the step where every request has its first token to the end), the speed-up
against off, the mean accepted length (tokens emitted per verification), whether the outputs equal off's (they
must: greedy speculation is lossless; where bf16 near-ties make the arms differ, `divergence` gives each differing
request's first differing position and the plain run's top-2 logit margin there, from a teacher-forced forward of
the prompt and the plain output before it), and the KDA state bytes one verified request-step moves with replay
(the committed state read and written once, the projected inputs of the T verified positions kept) against
per-position snapshots (T states written, one read back at the rollback). `floor_speedup` (MTP drafts) is the
speed-up the spec arm would have if both it and off ran at the weight-bandwidth floor with the accepted length
measured (benchmarks/hybrid_decode_cost.py, `speculation_floor_speedup`: the cycle reads the drafting steps' and the
verification's weights, a plain step one token's): the ceiling that weight traffic alone sets. With `--stage-times`,
`stage_ms` breaks a speculating engine's cycle down into its stages (draft, ahead, verify, accept, commit, observe;
mean ms per cycle, from one more generation that waits for the device at every stage boundary, so its total is a
little above the timed run's).
The implementations are the environment's (K3_<OP>_BACKEND=..., as the k3 commands read it).
`ahead`: per speculating arm, its timed generation's proposals drafted ahead and taken (EngineConfig.draft_ahead;
`--draft-after` adds the arm `after`, the same speculation with every proposal drafted after its acceptance;
`--no-auto` leaves the auto arm out). `--right-draft` makes the draft always right on any weights (synthetic:
`make_draft_right_`), for the cycle at full acceptance without a trained model. `verified`: per speculating arm, the
requests' verifications launched ahead and used in its timed generation (EngineConfig.verify_ahead: `--verify-ahead`
adds the arm `vahead`).
`auto_steps`: the auto engine's timed generation step by step, by the switch's arm (steps, mean and largest ms) and
its slowest steps.
With `--stage-kernels N`, one more generation under torch.profiler gives `stage_kernels`: per stage, the device
kernels that ran in it per cycle (count, ms, the N costliest; counted by their time inside the stage's range, so a
CUDA graph replay's kernels and Triton's count too; on a CPU the operators' host time instead); `--uncaptured`
profiles an engine running the same static-buffer steps without capture, for the same kernels launched one by one.
With `--host-profile N`, one more generation per engine under cProfile gives `host_profile`: the N serving
functions with the most cumulative host time, as calls and ms per engine step (a read-back's wait for the device
included), to find the host's share of a step.
`auto_switch` is the switch's decision per batch bucket, `auto_switch_rates` each arm's median tokens/s over the
decode-only steps it measured there.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import json
import os
import sys
import time

import torch
from torch.autograd import DeviceType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hybrid_decode_cost import speculation_floor_speedup  # noqa: E402


def _log(msg: str) -> None:
    print(f"[spec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")


def prompt_documents(files: list[str]):
    """The texts of `files` (see the module docstring), in order; a bad file or line stops with its name."""
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise SystemExit(f"{path}:{i}: not JSON ({e.msg})")
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise SystemExit(f"{path}:{i}: expected an object with a string \"text\" field")
                    yield rec["text"]
        elif path.endswith(TEXT_SUFFIXES):
            try:
                yield open(path, encoding="utf-8").read()
            except (OSError, UnicodeDecodeError) as e:
                raise SystemExit(f"{path}: cannot be read as UTF-8 text ({e})")
        else:
            raise SystemExit(f"{path}: --prompts takes {', '.join(TEXT_SUFFIXES)} or .jsonl files")


def heldout_documents():
    """The texts of the standard library files the training split holds out."""
    from k3.data.corpus import is_heldout, stdlib_files, stdlib_root

    root = stdlib_root()
    for path in stdlib_files():
        if is_heldout(os.path.relpath(path, root)):
            try:
                yield open(path, encoding="utf-8").read()
            except (OSError, UnicodeDecodeError):
                continue


def heldout_prompts(tok, n: int, length: int, files: list[str] | None = None) -> list[list[int]]:
    """`n` prompts of `length` tokens: consecutive windows of each document's tokens, documents in order."""
    out, docs = [], 0
    for text in (prompt_documents(files) if files else heldout_documents()):
        ids = tok.encode(text)
        docs += 1
        for a in range(0, len(ids) - length + 1, length):
            out.append(ids[a:a + length])
            if len(out) == n:
                return out
    where = ", ".join(files) if files else "the held-out standard library"
    raise SystemExit(f"{where}: {docs} documents give only {len(out)} windows of {length} tokens, {n} are needed; "
                     "lower --prompt-tokens or give more text with --prompts")


def make_draft_right_(model) -> int:
    """Synthetic (--right-draft): every layer's output projections zeroed, so that the residual stream carries the
    token's embedding alone and the target's next token is a function of its current token; the MTP layer made to
    read the next token's embedding alone (eh_proj = [I, 0], enorm 1), so that its draft is the target's next token
    after that one: every draft accepted (to rounding), on any weights. The kernels and their shapes are the model's
    own, so a cycle costs what it costs with a trained draft that is always right. Returns the tensors zeroed."""
    if not len(model.mtp):
        raise ValueError("--right-draft needs a model with an MTP layer")
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.w2", "routed_expert_up_proj.weight")):
                p.zero_()
                n += 1
        D = model.config.hidden_size
        for mtp in model.mtp:
            mtp.eh_proj.weight.zero_()
            mtp.eh_proj.weight[:, :D] = torch.eye(D, dtype=mtp.eh_proj.weight.dtype)
            mtp.enorm.weight.fill_(1.0)
    return n


def ahead_counts(engine) -> dict[str, int]:
    """The draft's proposals drafted ahead and taken so far (EngineConfig.draft_ahead; zeros without chains)."""
    spec = engine.speculative
    chains = getattr(spec.draft, "chains", None) if spec is not None else None
    return dict(chains.counts) if chains is not None else {"ahead": 0, "taken": 0}


def verified_counts(engine) -> dict[str, int]:
    """The requests' verifications launched ahead and used so far (EngineConfig.verify_ahead)."""
    m = engine.metrics
    return {"launched": m.spec_verified_ahead, "used": m.spec_verified_ahead_used}


def graphs_made(engine) -> int:
    """CUDA graphs (static-buffer steps) the engine has made so far: decode buckets, prefill chunks, verifications,
    and the MTP draft's captured greedy chains."""
    g = getattr(engine.runner, "graphs", None)
    chains = getattr(engine.draft, "chains", None) if engine.draft is not None else None
    return (0 if g is None else g.made) + (0 if chains is None else len(chains.made))


def graphs_off(engine) -> str | None:
    """Why the engine's steps ran without CUDA graphs (None: they ran on them): a capture that failed turns them off
    for good and the engine serves eagerly, which a timing must not pass for the captured engine's."""
    g = getattr(engine.runner, "graphs", None)
    return "the engine has no CUDA graphs (off, or not on CUDA)" if g is None else g.disabled


@torch.no_grad()
def divergence(model, prompts, plain, other) -> list[dict]:
    """For each request whose outputs differ: the first differing position and the plain run's top-2 logit margin
    there (a teacher-forced forward of the prompt and the plain output before that position)."""
    out = []
    dev = next(model.parameters()).device
    for i, (p, a, b) in enumerate(zip(prompts, plain, other)):
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        ids = torch.tensor([list(p) + a[:pos]], device=dev)
        top2 = model(ids, logits_to_keep=1).logits[0, -1].float().topk(2).values
        out.append(dict(request=i, position=pos, top2_margin=round(float(top2[0] - top2[1]), 5)))
    return out


def state_bytes(cfg, T: float) -> dict:
    """KDA bytes one verified request-step of T positions moves, over all KDA layers: replay vs snapshots."""
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    state = H * K * K * 4 + 3 * H * K * (cfg.kda_short_conv_kernel_size - 1) * 4  # fp32 state + conv tails
    inputs = (3 * H * K + 3 * H * K + H * K + H) * 4  # pre-conv q, k, v; q, k, v; decay logits; beta, per position
    n = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_kda_layer(i))
    return {"replay": round(n * (2 * state + T * inputs)), "snapshots": round(n * (T * state + state))}


def run(engine, prompts, max_tokens: int, trace: list | None = None) -> tuple[list[list[int]], float]:
    """Generate greedily -> (the outputs, decode tokens/s). `trace`: a list that gets each step as [step, arm, ms,
    tokens emitted] (arm "speculative" when the step's decode steps speculated, else "plain"; ms the step's wall time,
    which includes the device's work: every step reads its sampled tokens back)."""
    from k3.serve.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    seqs = [engine.add_request(list(p), params) for p in prompts]
    spec = engine.speculative if trace is not None else None
    decided: list[bool] = []
    if spec is not None:
        decide = spec.decide
        spec.decide = lambda batch: decided.append(decide(batch)) or decided[-1]  # the switch's answer, recorded
    t_first = None
    try:
        while engine.has_work():
            n, t0 = len(decided), time.perf_counter()
            outs = engine.step()
            if trace is not None:
                arm = "speculative" if decided[n:] and decided[-1] else "plain"
                trace.append([len(trace), arm, round((time.perf_counter() - t0) * 1e3, 3),
                              sum(len(o.new_token_ids) for o in outs)])
            if t_first is None and all(s.output_ids for s in seqs):
                t_first = time.perf_counter()
    finally:
        if spec is not None:
            spec.decide = decide
    t_end = time.perf_counter()
    n = sum(len(s.output_ids) - 1 for s in seqs)
    return [s.output_ids for s in seqs], n / max(t_end - (t_first or t_end), 1e-9)


def steps_by_arm(trace: list, slowest: int = 5) -> dict:
    """A `run` trace summed up: per arm the steps, their mean and largest ms (the first step, the prefill, apart),
    and the `slowest` steps."""
    out = {}
    for arm in ("speculative", "plain"):
        ms = [s[2] for s in trace[1:] if s[1] == arm]
        out[arm] = dict(steps=len(ms), mean_ms=round(sum(ms) / len(ms), 3) if ms else None,
                        max_ms=max(ms) if ms else None)
    out["slowest"] = sorted(trace[1:], key=lambda s: -s[2])[:slowest]
    return out


def stage_times(engine, prompts, max_tokens: int, device) -> dict[str, float]:
    """One more generation with the speculative cycle's stages timed (SpeculativeDecoder.stage_times): the mean ms
    per cycle of each stage and of the whole cycle."""
    from k3.serve.speculative.decoder import StageTimes

    engine.speculative.stage_times = st = StageTimes(device)
    try:
        run(engine, prompts, max_tokens)
    finally:
        engine.speculative.stage_times = None
    return st.per_cycle_ms()


def host_profile(engine, prompts, max_tokens: int, top: int) -> dict:
    """One more generation under cProfile: the host's time per engine step in each of the `top` functions of k3 with
    the most cumulative time, and the step count. On a GPU whose steps wait
    for the device only at their read-backs, a function's time is its host work plus any wait inside it (the
    read-backs: `tolist`, `item`), so the list shows where the host spends a step and where it waits."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    steps = [0]
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    try:
        prof.enable()
        run(engine, prompts, max_tokens)
        prof.disable()
    finally:
        del engine.step  # the class's again
    st = pstats.Stats(prof).stats
    rows = []
    for (path, line, name), (_, calls, _, cum, _) in st.items():
        if "/k3/" in path:
            rows.append((f"{path[path.rfind('/k3/') + 1:]}:{line}({name})", calls, cum))
    rows.sort(key=lambda r: -r[2])
    n = max(steps[0], 1)
    return {"steps": steps[0], "top": [[f, round(c / n, 2), round(t * 1e3 / n, 4)] for f, c, t in rows[:top]]}


def stage_kernels(events, cycles: int, top: int) -> dict[str, dict]:
    """Per stage of the speculative cycle (the ``spec.<stage>`` ranges StageTimes marks), from a profile's `events`:
    the device's work in it, or, when the profile holds no device work at all (CPU), the operators' own host time.
    Device events (kernels, copies) count in the stage whose range holds their start: StageTimes waits for the device
    at both ends of a range, so a stage's work runs inside it. That takes in what the launching operator would miss:
    a CUDA graph replay's kernels and Triton's (launched through the driver, under no operator). Profiles without
    device events but with kernels hung on their operators are read from those. Per cycle: the count, the ms, and
    the `top` costliest by name as [name, count, ms]."""
    found = {}
    ranges = [ev for ev in events if ev.name.startswith("spec.")]
    # the device's events, less the ranges' own copies on the device's timeline (a profiler's user annotations)
    on_device = [ev for ev in events if getattr(ev, "device_type", DeviceType.CPU) != DeviceType.CPU
                 and not ev.name.startswith("spec.") and not getattr(ev, "is_user_annotation", False)]
    if on_device:
        spans = sorted((ev.time_range.start, ev.time_range.end, ev.name[len("spec."):]) for ev in ranges)
        starts = [s for s, _, _ in spans]
        for ev in spans:
            found.setdefault(ev[2], {})
        for k in on_device:
            t = k.time_range.start
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= spans[i][1]:
                c = found[spans[i][2]].setdefault(k.name, [0, 0.0])
                c[0] += 1
                c[1] += k.time_range.elapsed_us()
        return _per_cycle(found, "kernels", cycles, top)
    any_kernel = any(getattr(ev, "kernels", None) for ev in events)
    for ev in ranges:
        acc = found.setdefault(ev.name[len("spec."):], {})
        stack = [ev]
        while stack:
            e = stack.pop()
            stack.extend(e.cpu_children)
            if any_kernel:
                items = [(k.name, k.duration) for k in e.kernels]
            else:
                items = [(e.name, e.self_cpu_time_total)] if e is not ev and e.name.startswith("aten::") else []
            for name, us in items:
                c = acc.setdefault(name, [0, 0.0])
                c[0] += 1
                c[1] += us
    return _per_cycle(found, "kernels" if any_kernel else "host operators", cycles, top)


def _per_cycle(found: dict[str, dict], kind: str, cycles: int, top: int) -> dict[str, dict]:
    n = max(cycles, 1)
    out = {}
    for stage, acc in found.items():
        ranked = sorted(acc.items(), key=lambda kv: -kv[1][1])
        out[stage] = dict(kind=kind, count=round(sum(c for c, _ in acc.values()) / n, 2),
                          ms=round(sum(us for _, us in acc.values()) / 1e3 / n, 4),
                          top=[[name[:90], round(c / n, 2), round(us / 1e3 / n, 4)] for name, (c, us) in ranked[:top]])
    return out


def profiled_stages(engine, prompts, max_tokens: int, device, top: int) -> dict[str, dict]:
    """One more generation under torch.profiler with the cycle's stages marked: :func:`stage_kernels` of it."""
    from torch.profiler import ProfilerActivity, profile

    from k3.serve.speculative.decoder import StageTimes

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    engine.speculative.stage_times = st = StageTimes(device)
    try:
        with profile(activities=acts) as prof:
            run(engine, prompts, max_tokens)
    finally:
        engine.speculative.stage_times = None
    return stage_kernels(prof.events(), st.cycles, top)


def main() -> None:
    from k3.cli_args import RawDefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDefaultsHelpFormatter)
    ap.add_argument("--ckpt", required=True, help="a trained checkpoint (or run directory) with an MTP layer")
    ap.add_argument("--draft", default=None,
                    help="an EAGLE-3 draft directory (k3 train-draft) instead of the MTP layer")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--replay-after", action="store_true",
                    help="a fourth engine, `replay`: speculation on every step with the accepted positions replayed "
                         "right after acceptance (EngineConfig.fused_replay=False) instead of in the next "
                         "verification (the default)")
    ap.add_argument("--fused-replay", dest="replay_after", action="store_true",
                    help="the earlier name of --replay-after (in BENCHMARKS.md's earlier records the arm "
                         "`fused` is today's default `spec`, and their `spec` today's `replay`)")
    ap.add_argument("--prompts", nargs="+", default=None, metavar="FILE",
                    help="held-out text to take the prompts from (.txt/.md/.py/.rst or .jsonl with \"text\"); "
                         "default: the standard library files the training split holds out")
    ap.add_argument("--stage-times", action="store_true",
                    help="after each speculating engine's timed generation, one more with the cycle's stages timed "
                         "(waiting for the device at each stage boundary): `stage_ms` per arm, the mean ms per "
                         "cycle of draft, ahead (drafting ahead), verify, accept, commit and observe")
    ap.add_argument("--stage-kernels", type=int, default=0, metavar="N",
                    help="one more generation per speculating engine under torch.profiler: per stage of the cycle, "
                         "its kernels' count and device ms per cycle and the N costliest (`stage_kernels`; on a CPU "
                         "the operators' host time)")
    ap.add_argument("--uncaptured", action="store_true",
                    help="with --stage-kernels: profile an engine that runs the same static-buffer steps without "
                         "capturing them (cuda_graphs='eager'): the verification's and the other graph steps' kernels "
                         "launched one by one, against the captured engine's replays")
    ap.add_argument("--host-profile", type=int, default=0, metavar="N",
                    help="one more generation per engine under cProfile: `host_profile`, the N serving functions with "
                         "the most cumulative host time, as calls and ms per engine step (read-backs included)")
    ap.add_argument("--right-draft", action="store_true",
                    help="synthetic: zero every layer's output projections and make the MTP layer read the next "
                         "token alone, so that every draft is accepted (`make_draft_right_`): the cycle at full "
                         "acceptance on any weights (the outputs are a token-to-token map, the kernels the model's)")
    ap.add_argument("--draft-after", action="store_true",
                    help="one more engine, `after`: speculation on every step with each proposal drafted after its "
                         "acceptance (EngineConfig.draft_ahead=False) instead of ahead of it where the last "
                         "verification accepted every draft (the default)")
    ap.add_argument("--verify-ahead", action="store_true",
                    help="one more engine, `vahead`: spec with the verification of each proposal drafted ahead "
                         "launched before the acceptance before it is read back (EngineConfig.verify_ahead)")
    ap.add_argument("--no-auto", action="store_true", help="leave out the --speculative-auto engine")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cache-mb", type=float, default=8192)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from k3.checkpoint import from_pretrained
    from k3.cli import _resolve_ckpt
    from k3.data.tokenizer import load_any_tokenizer
    from k3.info import model_info
    from k3.ops.registry import backends_from_env
    from k3.serve.engine import EngineConfig, LLMEngine, free_dropped_engines
    from k3.serve.scheduler import SchedulerConfig

    ckpt = _resolve_ckpt(args.ckpt)
    dev = torch.device(args.device)
    # the implementations as the environment pins them (K3_<OP>_BACKEND=..., as the k3 commands read it)
    model = from_pretrained(ckpt, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32,
                            packed_experts="auto", backends=backends_from_env(os.environ)).eval()
    if args.right_draft:
        _log(f"--right-draft: {make_draft_right_(model)} output projections zeroed, the MTP layer reads the next token")
    tok = load_any_tokenizer(ckpt)
    prompts = heldout_prompts(tok, max(args.batch), args.prompt_tokens, args.prompts)
    rows = []
    for B in args.batch:
        res = {}
        modes = ("off", "spec") + (() if args.no_auto else ("auto",)) + (("replay",) if args.replay_after else ()) \
            + (("after",) if args.draft_after else ()) + (("vahead",) if args.verify_ahead else ())
        for mode in modes:
            spec = "off" if mode == "off" else ("eagle3" if args.draft else "mtp")
            cfg = EngineConfig(cache_memory_mb=args.cache_mb, max_model_len=args.prompt_tokens + args.max_tokens + 64,
                               speculative=spec, draft=args.draft if spec == "eagle3" else None,
                               num_draft_tokens=args.num_draft_tokens, speculative_auto=mode == "auto",
                               fused_replay=False if mode == "replay" else None, draft_ahead=mode != "after",
                               verify_ahead=mode == "vahead",
                               scheduler=SchedulerConfig(max_num_seqs=max(B, 1), max_step_tokens=max(8192, 8 * B)))
            eng = LLMEngine(model, tok, cfg)
            eng.eos_id = None  # every request generates max_tokens tokens
            # warm-up as `k3 serve` starts (every graph bucket, the draft's first step at every count of positions),
            # then the same generation, so every graph the timed one replays is made (and compiled) now
            eng.warm_up()
            run(eng, prompts[:B], args.max_tokens)
            m0 = (eng.metrics.spec_verifications, eng.metrics.draft_tokens_accepted)
            g0, a0, va0 = graphs_made(eng), ahead_counts(eng), verified_counts(eng)
            trace = [] if mode == "auto" else None  # where an auto generation's time goes, step by step
            outs, rate = run(eng, prompts[:B], args.max_tokens, trace)
            v = eng.metrics.spec_verifications - m0[0]
            acc = eng.metrics.draft_tokens_accepted - m0[1]
            res[mode] = dict(tokens_per_s=round(rate, 1), outputs=outs,
                             mean_accepted_length=round((acc + v) / v, 3) if v else None, verifications=v,
                             graphs_made_while_timed=graphs_made(eng) - g0, graphs_off=graphs_off(eng),
                             ahead={k: n - a0[k] for k, n in ahead_counts(eng).items()},
                             verified={k: n - va0[k] for k, n in verified_counts(eng).items()})
            if dev.type == "cuda" and res[mode]["graphs_off"]:
                _log(f"batch {B} {mode}: ran WITHOUT CUDA graphs: {res[mode]['graphs_off']}")
            if mode == "auto" and eng.spec_switch is not None:
                res[mode]["switch"] = {str(k): st["speculative"] for k, st in eng.spec_switch.state().items()}
                # what the switch measured per bucket: each arm's median tokens/s over its decode-only steps
                res[mode]["switch_rates"] = {str(k): {a: None if st[f"{a}_tokens_per_s"] is None
                                                      else round(st[f"{a}_tokens_per_s"], 1) for a in ("spec", "plain")}
                                             for k, st in eng.spec_switch.state().items()}
            if args.stage_times and mode != "off":
                res[mode]["stage_ms"] = stage_times(eng, prompts[:B], args.max_tokens, dev)
                _log(f"batch {B} {mode}: per cycle {res[mode]['stage_ms']}")
            if trace is not None:
                res[mode]["steps"] = steps_by_arm(trace)
                _log(f"batch {B} auto: timed steps by arm {res[mode]['steps']}")
            if args.stage_kernels and mode != "off":
                if args.uncaptured:  # the same engine on the static buffers uncaptured: each kernel in its stage
                    del eng
                    free_dropped_engines()
                    eng = LLMEngine(model, tok, dataclasses.replace(cfg, cuda_graphs="eager"))
                    eng.eos_id = None
                    run(eng, prompts[:B], args.max_tokens)  # its warm-up
                res[mode]["stage_kernels"] = profiled_stages(eng, prompts[:B], args.max_tokens, dev,
                                                             args.stage_kernels)
                for stage, k in res[mode]["stage_kernels"].items():
                    _log(f"batch {B} {mode} {stage}: {k['count']} {k['kind']}, {k['ms']} ms per cycle; top: "
                         + "; ".join(f"{n} x{c} {ms} ms" for n, c, ms in k["top"]))
            if args.host_profile:
                res[mode]["host_profile"] = host_profile(eng, prompts[:B], args.max_tokens, args.host_profile)
                _log(f"batch {B} {mode}: host ms per step: "
                     + "; ".join(f"{f} {ms}" for f, _, ms in res[mode]["host_profile"]["top"][:12]))
            _log(f"batch {B} {mode}: {rate:.1f} tok/s, accepted length {res[mode]['mean_accepted_length']}")
            del eng
            free_dropped_engines()  # its cache pool freed before the next engine allocates one
        T = res["spec"]["mean_accepted_length"] or 1.0
        auto = res.get("auto", {})
        row = dict(batch=B, off_tok_s=res["off"]["tokens_per_s"],
                   **{f"{m}_tok_s": res[m]["tokens_per_s"] for m in modes[1:]},
                   **{f"{m}_speedup": round(res[m]["tokens_per_s"] / res["off"]["tokens_per_s"], 3) for m in modes[1:]},
                   mean_accepted_length=res["spec"]["mean_accepted_length"],
                   outputs_equal=all(res[m]["outputs"] == res["off"]["outputs"] for m in modes),
                   divergence={m: divergence(model, prompts[:B], res["off"]["outputs"], res[m]["outputs"])
                               for m in modes[1:] if res[m]["outputs"] != res["off"]["outputs"]},
                   graphs_made_while_timed={m: res[m]["graphs_made_while_timed"] for m in res},
                   graphs_off={m: res[m]["graphs_off"] for m in res},
                   ahead={m: res[m]["ahead"] for m in modes[1:]},
                   verified={m: res[m]["verified"] for m in modes[1:]},
                   **({"stage_ms": {m: res[m]["stage_ms"] for m in res if "stage_ms" in res[m]}}
                      if args.stage_times else {}),
                   **({"stage_kernels": {m: res[m]["stage_kernels"] for m in res if "stage_kernels" in res[m]}}
                      if args.stage_kernels else {}),
                   **({"host_profile": {m: res[m]["host_profile"] for m in res}} if args.host_profile else {}),
                   auto_switch=auto.get("switch"), auto_switch_rates=auto.get("switch_rates"),
                   **({"auto_steps": auto["steps"]} if "steps" in auto else {}),
                   floor_speedup=None if args.draft else round(speculation_floor_speedup(
                       model.config, model_info(model.config), B, args.num_draft_tokens,
                       min(max(T, 1.0), args.num_draft_tokens + 1)), 3),
                   kda_bytes_per_request_step=state_bytes(model.config, args.num_draft_tokens + 1),
                   verified_positions=args.num_draft_tokens + 1, accepted_positions=T)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ckpt=ckpt, device=str(dev), draft=args.draft, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
