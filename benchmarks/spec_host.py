"""The host's work in each stage of the speculative decoding cycle, the model's forwards and the targets' read-back
left out: what keeps the device waiting between one verification and the next once the forwards are CUDA graph
replays (report §5.4.2).

    python benchmarks/spec_host.py                                    # CPU: tiny, batch 1 and 8 (about a minute)
    python benchmarks/spec_host.py --preset k3-mini --batch 1 16 --json host.json

On a GPU a speculating engine's cycle is: the verification launched (host: the proposal taken, the rows, the
static buffers loaded, the graph replayed), the targets' read-back begun, the next proposal drafted ahead
(EngineConfig.draft_ahead), then the host waits for the targets and accepts, emits, commits, observes, plans the
next step and prepares the next verification. The device idles from the end of the drafting ahead until that next
launch whenever the host's work after the read-back takes longer than the drafting ahead's device time (the
verification's and the drafts' device times are in benchmarks/spec_decode.py --stage-times). This benchmark measures
that host work on any device, without a GPU: the engine runs the static-buffer steps the graphs capture, uncaptured
(EngineConfig.cuda_graphs="eager", the draft's chains likewise; on a CPU the paged MLA decode runs in Triton's
interpreter, `TRITON_INTERPRET=1`, set here), with an always-right draft (spec_decode.make_draft_right_: every draft
accepted on random weights, the steady state of a well-trained draft), and times each stage with
SpeculativeDecoder.stage_times in host mode (no device waits), less the time inside the model's forwards (the
static steps, eager forwards, the draft's steps) and inside the targets' read-back (on a GPU its wait for the
device; nothing on a CPU).

Printed per batch size and arm (`ahead`: drafting ahead, the default; `after`: EngineConfig.draft_ahead=False;
`vahead`: drafting and verifying ahead, EngineConfig.verify_ahead, whose launch moves the next verification's host
work before the read-back, into the `ahead` stage), as ms per cycle: each stage's host work, `engine` (the engine's
step outside the speculative decoder: planning, prefill bookkeeping, metrics), `total`, and `after_read_back`: the
host work between the targets' read-back and the next verification's launch (accept, commit, observe, engine, draft,
verify), which drafting ahead overlaps with its drafting steps' device time (and verifying ahead with the next
verification's); plus `model_ms` (the forwards' time here, a CPU's: not a GPU's), the tokens per cycle (all
accepted: num_draft_tokens + 1), `drafted_ahead` (the requests' proposals drafted ahead, and taken) and
`verified_ahead` (their verifications launched ahead, and used). Host times are this machine's CPU and Python; a GPU
host's differ by its single-thread speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spec_decode import ahead_counts, make_draft_right_, run, verified_counts  # noqa: E402

from k3.config import K3Config  # noqa: E402
from k3.data.tokenizer import K3Tokenizer  # noqa: E402
from k3.model.model import K3ForCausalLM  # noqa: E402
from k3.ops.registry import Backends  # noqa: E402
from k3.serve.cuda_graphs import DecodeGraphs  # noqa: E402
from k3.serve.engine import EngineConfig, LLMEngine  # noqa: E402
import k3.serve.runner as runner_module  # noqa: E402
from k3.serve.runner import ModelRunner  # noqa: E402
from k3.serve.scheduler import SchedulerConfig  # noqa: E402
from k3.serve.speculative.accept import GreedyReadBack  # noqa: E402
from k3.serve.speculative.decoder import SpeculativeDecoder, StageTimes  # noqa: E402
from k3.serve.speculative.draft import MTPDraft, _Chain  # noqa: E402

# where the model computes (and the read-back waits): their time is left out of the host's (classes' methods and the
# runner's module-level forwards, its eager verifications)
LEFT_OUT = ((DecodeGraphs, "_plain_step"), (DecodeGraphs, "_verify_step"), (ModelRunner, "_run"),
            (ModelRunner, "_replay_layers"), (ModelRunner, "flush"), (runner_module, "verify_on_pool"),
            (runner_module, "verify_replay_on_pool"), (_Chain, "_body"), (MTPDraft, "_first_step"),
            (MTPDraft, "_greedy_chain"), (MTPDraft, "_step"), (GreedyReadBack, "result"))


class _Clock:
    """Seconds spent inside the LEFT_OUT functions (the outermost call of nested ones), while `patched`."""

    def __init__(self):
        self.seconds, self._depth = 0.0, 0

    @contextlib.contextmanager
    def patched(self):
        saved = [(owner, name, vars(owner)[name]) for owner, name in LEFT_OUT]
        for owner, name, fn in saved:
            setattr(owner, name, self._timed(fn))
        try:
            yield self
        finally:
            for owner, name, fn in saved:
                setattr(owner, name, fn)

    def _timed(self, fn):
        clock = self

        def call(*a, **k):
            clock._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock._depth -= 1
                if clock._depth == 0:
                    clock.seconds += time.perf_counter() - t0
        return call


class HostStages(StageTimes):
    """StageTimes without device waits, each stage's time less the left-out time inside it."""

    def __init__(self, device, clock: _Clock):
        super().__init__(device, sync=False)
        self.clock, self.left_out = clock, dict.fromkeys(self.STAGES, 0.0)

    @contextlib.contextmanager
    def stage(self, name: str):
        before = self.clock.seconds
        with super().stage(name):
            yield
        self.left_out[name] += self.clock.seconds - before


ARMS = ("ahead", "after", "vahead")


def measure(model, tok, batch: int, arm: str, max_tokens: int, prompt_tokens: int, k: int) -> dict:
    """One engine's host time per cycle (module docstring) over a generation of `max_tokens` per request, after a
    warm-up generation; `arm` one of ARMS."""
    if arm not in ARMS:
        raise ValueError(f"arm={arm!r}: one of {', '.join(ARMS)}")
    cfg = EngineConfig(cache_memory_mb=256 + 16 * batch, max_model_len=prompt_tokens + max_tokens + 64,
                       speculative="mtp", num_draft_tokens=k, speculative_auto=False, draft_ahead=arm != "after",
                       verify_ahead=arm == "vahead", cuda_graphs="eager",
                       scheduler=SchedulerConfig(max_num_seqs=batch, max_step_tokens=max(8192, prompt_tokens * batch)))
    eng = LLMEngine(model, tok, cfg)
    if eng.runner.graphs is None:
        raise RuntimeError("the engine does not run the static-buffer steps (cuda_graphs='eager' refused): see its "
                           "notice above")
    eng.eos_id = None
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt_tokens,), generator=g).tolist()
               for _ in range(batch)]
    eng.warm_up()
    run(eng, prompts, max(2 * (k + 1), max_tokens // 4))  # every step's buffers made, the chains too
    clock = _Clock()
    spec: SpeculativeDecoder = eng.speculative
    spec.stage_times = st = HostStages(next(model.parameters()).device, clock)
    in_verify, steps = [0.0, 0.0], [0.0, 0.0]  # (wall, left out) inside SpeculativeDecoder.verify, and engine steps
    verify, step = spec.verify, eng.step

    def timed(fn, acc):
        def call(*a, **kw):
            t0, l0 = time.perf_counter(), clock.seconds
            try:
                return fn(*a, **kw)
            finally:
                acc[0] += time.perf_counter() - t0
                acc[1] += clock.seconds - l0
        return call

    spec.verify, eng.step = timed(verify, in_verify), timed(step, steps)
    before, vbefore = ahead_counts(eng), verified_counts(eng)
    try:
        with clock.patched():
            out, _ = run(eng, prompts, max_tokens)
    finally:
        spec.verify, eng.step, spec.stage_times = verify, step, None
    n = max(st.cycles, 1)
    host = {s: (st.seconds[s] - st.left_out[s]) * 1e3 / n for s in st.STAGES}
    # the engine's step outside the decoder: everything but the decoder's verify, the prefill step's forward left out
    host["engine"] = ((steps[0] - steps[1]) - (in_verify[0] - in_verify[1])) * 1e3 / n
    total = sum(host.values())
    critical = sum(host[s] for s in ("accept", "commit", "observe", "engine", "draft", "verify"))
    tokens = sum(len(o) for o in out) / n
    return {"batch": batch, "arm": arm, "cycles": st.cycles,
            "tokens_per_cycle": round(tokens / batch, 3),
            "host_ms": {s: round(v, 3) for s, v in host.items()},
            "total_ms": round(total, 3), "after_read_back_ms": round(critical, 3),
            "drafted_ahead": {k: v - before[k] for k, v in ahead_counts(eng).items()},
            "verified_ahead": {k: v - vbefore[k] for k, v in verified_counts(eng).items()},
            "model_ms": round(steps[1] * 1e3 / n, 3)}


def main() -> None:
    from k3.cli_args import DefaultsHelpFormatter

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--num-draft-tokens", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (the static steps uncaptured: eager kernels)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    if min(args.batch) < 1 or args.max_tokens < 2 * (args.num_draft_tokens + 1) or args.prompt_tokens < 1:
        ap.error("--batch and --prompt-tokens must be positive, --max-tokens at least 2 * (num_draft_tokens + 1)")
    torch.set_num_threads(1)  # the host's one thread, as a serving process drives its GPU
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the paged MLA decode's kernel on CPU tensors
    cfg = K3Config.from_preset(args.preset)
    if cfg.num_nextn_predict_layers < 1:
        cfg = cfg.replace(num_nextn_predict_layers=1)
    dev = torch.device(args.device)
    # the static-buffer steps need the kernels a graph can capture (nothing read back): the paged MLA decode and the
    # grouped experts
    backends = Backends(per_op={"mla_decode": "triton", "moe": "grouped"})
    model = K3ForCausalLM(cfg, backends=backends).init_weights(seed=0)
    model = model.to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32).eval()
    make_draft_right_(model)
    tok = K3Tokenizer.byte_level()
    rows = []
    for B in args.batch:
        for arm in ARMS:
            r = measure(model, tok, B, arm, args.max_tokens, args.prompt_tokens, args.num_draft_tokens)
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        from k3.files import atomic_write_text

        atomic_write_text(args.json, json.dumps({"preset": args.preset, "device": str(dev), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
