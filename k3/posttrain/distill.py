"""`k3 distill`: Multi-Teacher On-Policy Distillation of a student from domain teachers (report §4.1.3).

One step: (1) the prompt pool is topped up to `rollouts_per_step` in-flight samples (prompts in a shuffled order,
epoch after epoch); (2) the serving engine advances every in-flight sample by at most `rollout_budget` tokens under
the current student (k3.posttrain.rollout: partial rollouts, a fresh engine and cache after every update); a
second round runs only when no sample finished in the first, so that every step has data; (3) each finished sample
is scored by the teacher of its prompt's tag (k3.posttrain.mopd.TeacherTable); (4) one optimizer step on
eq. 15's importance-sampled policy-gradient loss over the finished samples' response tokens (k3.posttrain.mopd:
the normalization is the step's response-token count). Unfinished samples stay in flight, with their behaviour
log-probs, and are trained on in the step they finish.

The optimizer, QK-Clip, Quantile Balancing, the learning-rate schedule, the metrics log, the atomic checkpoints and
the signal handling are the `k3 train` / `k3 sft` Trainer's, and so is the micro-batch loop (autocast, weight
casts, OOM retry): `MOPDTrainer` supplies only where a step's batch comes from (`_next_batch`: rollouts + teacher
scores) and its loss (`MOPDLoss`, through the Trainer's loss seam, k3.train.losses). A batch row is one sample,
prompt + response, right-padded (the padding its own segment); `seq_len` is `max_prompt_tokens + max_new_tokens`
and `batch_tokens` is `rollouts_per_step * seq_len`, so "rows per step" is the rollouts per step and --epochs counts
passes over the prompts. The in-flight samples are part of the trainer state: --resume continues them.

A QAT student (a `k3 sft --qat mxfp4` run's checkpoint, or an MXFP4 checkpoint) is trained with QAT and, since
the rollouts run on the same module, sampled with the same fake-quantized experts (report §4.1.4: rollout and
training share the quantization). The MTP layer, if any, is not trained here (its loss is next-token prediction).

metrics.jsonl, per step (besides the Trainer's loss, lr, grad_norm, ...): `reward` (mean clipped eq. 15 reward per
response token), `reverse_kl` (mean log pi_student - log pi_teacher per sampled token, unclipped: the sampled
reverse KL that distillation drives to 0), `clip_rate` (share of tokens whose log-ratio hit +-R_max), `samples`,
`response_len` (mean tokens per finished sample), `in_flight` (unfinished samples carried to the next step),
`stale_tokens` (trained tokens sampled by an older policy), `max_ratio` (largest importance ratio), `rollout_s`,
`teacher_s`, and `domains`: per domain {reward, reverse_kl, response_len, samples}.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from k3.model.batch import BatchInfo
from k3.posttrain.mopd import Prompt, TeacherTable, encode_prompt, opd_pg_loss, read_prompts, token_logprobs
from k3.posttrain.rollout import Rollout, RolloutEngine, default_engine_config
from k3.run_dir import holding_run_dir
from k3.train.losses import LossOutput, MicroBatch, target_logprobs, trained_mask
from k3.train.trainer import StepMetrics, Trainer, TrainConfig

CPU_DEFAULTS = dict(lr=5e-4)
GPU_DEFAULTS = dict(lr=1e-4)
IGNORE = -100


@dataclass
class DistillOptions:
    student: str | None = None  # the student's starting checkpoint (a resumed run: its own)
    teachers: list[str] = field(default_factory=list)  # TAG=CK
    prompts: list[str] = field(default_factory=list)  # prompt .jsonl files
    resume: bool = False
    rollouts_per_step: int = 8
    max_prompt_tokens: int = 256
    max_new_tokens: int = 128
    rollout_budget: int | None = None  # tokens per sample per step (None: max_new_tokens, no partial rollouts)
    r_max: float = 5.0
    cache_memory_mb: float = 256.0
    device: str = "auto"
    backends: Any = None
    verify: bool = True
    engine: Any = None  # an EngineConfig for the rollouts (None: default_engine_config(cache_memory_mb))
    # held-out prompt files (the --prompts format): every eval_every steps the student samples eval_samples responses
    # per prompt, and the sampled reverse KL to each prompt's teacher is logged (per domain, and as val_loss)
    heldout: list[str] = field(default_factory=list)
    eval_samples: int = 2

    def validate(self) -> None:
        for name in ("rollouts_per_step", "max_prompt_tokens", "max_new_tokens", "eval_samples"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"distill option '{name}' = {v!r} is invalid: must be an integer >= 1")
        b = self.rollout_budget
        if b is not None and (not isinstance(b, int) or b < 1):
            raise ValueError(f"distill option 'rollout_budget' = {b!r} is invalid: must be an integer >= 1")
        if not (self.r_max > 0 and np.isfinite(self.r_max)):
            raise ValueError(f"distill option 'r_max' = {self.r_max!r} is invalid: must be a positive number")

    @property
    def seq_len(self) -> int:
        return self.max_prompt_tokens + self.max_new_tokens


def distill_train_config(opts: DistillOptions, tcfg: TrainConfig) -> TrainConfig:
    """The trainer's row shape for MOPD: one row per sample, `rollouts_per_step` rows per step."""
    tcfg.seq_len = opts.seq_len
    tcfg.batch_tokens = opts.rollouts_per_step * opts.seq_len
    return tcfg


@dataclass
class MOPDStepMetrics(StepMetrics):
    samples: int = 0
    response_len: float = 0.0
    reward: float = 0.0
    reverse_kl: float = 0.0
    clip_rate: float = 0.0
    max_ratio: float = 1.0
    stale_tokens: int = 0
    in_flight: int = 0
    rollout_rounds: int = 0
    rollout_s: float = 0.0
    teacher_s: float = 0.0
    domains: dict = field(default_factory=dict)


class PromptSource:
    """The prompts in a shuffled order (a new permutation each epoch, from the seed), and the samples in flight.
    Stands where the Trainer expects its loader (num_rows, tokens_per_epoch, state_dict)."""

    data_flag = "--prompts"  # what the Trainer's warning about repeated data names

    def __init__(self, prompts: list[Prompt], ids: list[list[int]], seq_len: int, seed: int = 0):
        self.prompts, self.ids, self.seed = prompts, ids, seed
        self.num_rows, self.seq_len = len(prompts), seq_len
        self.epoch, self.pos, self.next_uid = 0, 0, 0
        self.in_flight: list[Rollout] = []
        self._order = self._permutation(0)

    @property
    def tokens_per_epoch(self) -> int:
        return self.num_rows * self.seq_len

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def take(self) -> Rollout:
        if self.pos == self.num_rows:
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._permutation(self.epoch)
        i = int(self._order[self.pos])
        self.pos += 1
        r = Rollout(uid=self.next_uid, prompt_index=i, prompt_ids=list(self.ids[i]))
        self.next_uid += 1
        return r

    def fill(self, n: int) -> None:
        while len(self.in_flight) < n:
            self.in_flight.append(self.take())

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "next_uid": self.next_uid,
                "in_flight": [r.to_dict() for r in self.in_flight]}

    def load_state_dict(self, st: dict) -> None:
        self.epoch, self.pos, self.next_uid = st["epoch"], st["pos"], st["next_uid"]
        self._order = self._permutation(self.epoch)
        self.in_flight = [Rollout.from_dict(d) for d in st["in_flight"]]


def sampled_reverse_kl(model, rollout: RolloutEngine, prompts: list[tuple[Prompt, list[int]]], teacher_of,
                       samples: int, seed: int, device) -> tuple[float, dict]:
    """The sampled reverse KL of `model` to the teachers on `prompts` ((Prompt, token ids) pairs): `samples` whole
    responses per prompt from `rollout` (which runs `model`), seeded by `seed`; each sampled token's
    log pi_model - log pi_teacher under `teacher_of(prompt index)`. Returns (the token mean over all prompts, per
    domain {"reverse_kl", "tokens"}). The engine's cache is dropped afterwards (`RolloutEngine.retire`) and the
    model's train/eval mode restored."""
    was_training = model.training
    rs = [Rollout(uid=i * samples + j, prompt_index=i, prompt_ids=list(ids))
          for i, (_, ids) in enumerate(prompts) for j in range(samples)]
    budget, rollout.budget = rollout.budget, rollout.max_new_tokens  # whole responses
    try:
        while any(not r.finished for r in rs):
            rollout.advance(rs, seed=seed)
    finally:
        rollout.budget = budget
        rollout.retire()
    rows = [r.prompt_ids + r.tokens for r in rs]
    own = score_rows(model, rows, device)
    groups: dict = {}
    for k, r in enumerate(rs):
        groups.setdefault(id(teacher_of(r.prompt_index)), (teacher_of(r.prompt_index), []))[1].append(k)
    sums: dict = {}
    for teacher, idx in groups.values():
        theirs = score_rows(teacher, [rows[k] for k in idx], device)
        for j, k in enumerate(idx):
            r = rs[k]
            a, b = len(r.prompt_ids), len(r.prompt_ids) + len(r.tokens)
            acc = sums.setdefault(prompts[r.prompt_index][0].domain, [0.0, 0])
            acc[0] += float((own[k, a:b] - theirs[j, a:b]).sum())
            acc[1] += b - a
    model.train(was_training)
    total = sum(n for _, n in sums.values())
    return (sum(v for v, _ in sums.values()) / max(total, 1),
            {d: {"reverse_kl": v / max(n, 1), "tokens": n} for d, (v, n) in sorted(sums.items())})


def score_rows(model, rows: list[list[int]], device, chunk: int = 8) -> torch.Tensor:
    """log p(row[t] | row[:t]) under `model` for right-padded rows: [N, T] (0 at t = 0 and in the padding), in
    forwards of `chunk` rows (the [rows, T, V] logits of a large vocabulary are the memory that matters)."""
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    seg = torch.ones(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        seg[i, :len(r)] = 0
    was = model.training
    model.eval()
    parts = []
    try:
        with torch.no_grad():
            for s in range(0, len(rows), chunk):
                info = BatchInfo.from_segment_ids(seg[s:s + chunk]).to(device)
                x = ids[s:s + chunk].to(device)
                parts.append(token_logprobs(model(x, batch=info, check_ids=False).logits, x).cpu())
    finally:
        model.train(was)
    return torch.cat(parts) * (seg == 0)


class MOPDLoss:
    """Eq. 15's importance-sampled policy-gradient loss (k3.posttrain.mopd.opd_pg_loss) of a micro-batch of
    `MOPDTrainer` rows: the student's log-probs of the sampled tokens from one forward, against the batch's
    `teacher` and `behaviour` log-probs at the response tokens (labels != -100), all elementwise in the micro-batch's
    alignment (k3.train.losses: a context-parallel segment's are shifted with its labels). Divided by the step's
    response-token count, so the micro-batches' losses sum to the step's token mean. Its statistics (`extra`): per
    row the summed reward, log-ratio and response tokens (a context-parallel rank: its segment's), and the clipped
    tokens and largest importance ratio of the micro-batch."""

    def __init__(self, r_max: float):
        self.r_max = r_max

    def __call__(self, model, mb: MicroBatch) -> LossOutput:
        t = mb.tensors
        out = model(t["input_ids"], batch=mb.info, check_ids=False, stats=mb.stats)
        terms = opd_pg_loss(target_logprobs(out.logits, mb), t["teacher"], trained_mask(mb), self.r_max,
                            behaviour_logp=t["behaviour"], normalizer=mb.step_tokens)
        extra = {"reward_sum": terms.reward_sum, "log_ratio_sum": terms.log_ratio_sum, "tokens": terms.tokens,
                 "clipped": terms.clipped, "max_ratio": terms.max_ratio}
        return LossOutput(terms.loss, terms.loss.detach().double(), out.stats, extra=extra)


class MOPDTrainer(Trainer):
    """The Trainer with rollouts + teacher scores as its batches and eq. 15's policy gradient as its loss."""

    def __init__(self, model, tcfg: TrainConfig, source: PromptSource, rollout: RolloutEngine, teachers: dict,
                 table: TeacherTable, r_max: float, heldout: list[tuple[Prompt, list[int]]] | None = None,
                 eval_samples: int = 2, **kw):
        super().__init__(model, tcfg, source, loss=MOPDLoss(r_max), **kw)
        self.rollout, self.teachers, self.table = rollout, teachers, table
        self.heldout, self.eval_samples = list(heldout or []), eval_samples
        self._info: dict = {}  # what the step's `_next_batch` knows of its samples beyond the batch's tensors

    # --- held-out evaluation -------------------------------------------------------------------------------
    def evaluate(self) -> float | None:
        """The sampled reverse KL of the student to the teachers on the held-out prompts: `eval_samples` responses
        per prompt from the current policy (seeded the same at every evaluation, apart from the training rollouts:
        the training run is the same with or without it), each token's log pi_student - log pi_teacher under its
        prompt's teacher; the token mean over all prompts is returned (logged as val_loss) and each domain's in
        `eval_record` (val_domains)."""
        if not self.heldout:
            return None
        tags = {i: self.table.tag_for(p.domain, p.effort) for i, (p, _) in enumerate(self.heldout)}
        mean, doms = sampled_reverse_kl(self.model, self.rollout, self.heldout, lambda i: self.teachers[tags[i]],
                                        self.eval_samples, seed=self.cfg.seed * 7919 + 104729, device=self.device)
        self._eval_extra = {"val_domains": doms}
        return mean

    # --- where a step's batch comes from ------------------------------------------------------------------
    def _next_batch(self) -> dict:
        src, model = self.loader, self.model
        t0 = time.perf_counter()
        src.fill(self.cfg.rows_per_step)
        rounds = 0
        while True:  # a second round only if nothing finished: each round adds >= 1 token per sample, so it ends
            self.rollout.advance(src.in_flight, seed=self.cfg.seed * 7919 + self.step * 131 + rounds)
            rounds += 1
            done = [r for r in src.in_flight if r.finished]
            if done:
                break
        src.in_flight = [r for r in src.in_flight if not r.finished]
        model.train()
        t1 = time.perf_counter()
        rows = [r.prompt_ids + r.tokens for r in done]
        T = max(len(r) for r in rows)
        n = len(done)
        batch = {"input_ids": torch.zeros(n, T, dtype=torch.long), "labels": torch.full((n, T), IGNORE),
                 "segment_ids": torch.ones(n, T, dtype=torch.long), "behaviour": torch.zeros(n, T),
                 "teacher": torch.zeros(n, T)}
        for i, (r, row) in enumerate(zip(done, rows)):
            p, L = len(r.prompt_ids), len(row)
            batch["input_ids"][i, :L] = torch.tensor(row)
            batch["segment_ids"][i, :L] = 0
            batch["labels"][i, p:L] = torch.tensor(r.tokens)
            batch["behaviour"][i, p:L] = torch.tensor(r.behaviour_logprobs)
        by_tag: dict = {}
        for i, r in enumerate(done):
            pr = src.prompts[r.prompt_index]
            by_tag.setdefault(self.table.tag_for(pr.domain, pr.effort), []).append(i)
        for tag, idx in by_tag.items():
            lp = score_rows(self.teachers[tag], [rows[i] for i in idx], self.device)
            batch["teacher"][idx, :lp.shape[1]] = lp
        self._info = {"domains": [src.prompts[r.prompt_index].domain for r in done],
                      "stale": sum(v != self.rollout.version for r in done for v in r.versions),
                      "rounds": rounds, "rollout_s": t1 - t0, "teacher_s": time.perf_counter() - t1,
                      "in_flight": len(src.in_flight)}
        return batch

    # --- its metrics ---------------------------------------------------------------------------------------------
    def _finish_step(self, m: StepMetrics, extras: list[dict]) -> MOPDStepMetrics:
        """The step's record with MOPDLoss's statistics (overall and per domain) and the rollouts'; an applied update
        retires the rollout engine's cache (it holds the old policy's states)."""
        if not m.skipped:
            self.rollout.policy_changed()  # the engine's cache holds the old policy's states: never reuse them
        reward = torch.cat([x["reward_sum"] for x in extras]).double().cpu()
        lkl = torch.cat([x["log_ratio_sum"] for x in extras]).double().cpu()
        toks = torch.cat([x["tokens"] for x in extras]).double().cpu()
        clipped = float(sum(x["clipped"] for x in extras))
        max_ratio = float(max(x["max_ratio"] for x in extras))
        n = float(toks.sum())
        doms: dict = {}
        for d in sorted(set(self._info["domains"])):
            sel = torch.tensor([x == d for x in self._info["domains"]])
            nd = float(toks[sel].sum())
            doms[d] = {"reward": float(reward[sel].sum()) / max(nd, 1),
                       "reverse_kl": float(lkl[sel].sum()) / max(nd, 1),
                       "response_len": nd / int(sel.sum()), "samples": int(sel.sum())}
        out = MOPDStepMetrics(**asdict(m), samples=len(toks), response_len=n / max(len(toks), 1),
                              reward=float(reward.sum()) / max(n, 1), reverse_kl=float(lkl.sum()) / max(n, 1),
                              clip_rate=clipped / max(n, 1), max_ratio=max_ratio, stale_tokens=self._info["stale"],
                              in_flight=self._info["in_flight"], rollout_rounds=self._info["rounds"],
                              rollout_s=self._info["rollout_s"], teacher_s=self._info["teacher_s"], domains=doms)
        self.log(f"step {out.step}: reward {out.reward:+.3f} (" + ", ".join(
            f"{d} {v['reward']:+.3f}" for d, v in doms.items()) + f"), reverse KL {out.reverse_kl:.3f}, "
            f"length {out.response_len:.1f}, clip {100 * out.clip_rate:.1f}%, loss {out.loss:+.4f}, "
            f"{out.in_flight} in flight")
        return out

    def state_dict(self) -> dict:
        st = super().state_dict()
        st["rollout_version"] = self.rollout.version
        return st

    def load_state_dict(self, st: dict) -> None:
        super().load_state_dict(st)
        self.rollout.version = st["rollout_version"]


# --- building a run -------------------------------------------------------------------------------------------

def student_qat(ck: str) -> str | None:
    """"mxfp4" when the checkpoint was trained with QAT (its trainer state says so) or holds MXFP4 experts."""
    from k3.checkpoint import _is_mxfp4, load_config

    path = os.path.join(ck, "trainer_state.json")
    if os.path.isfile(path):
        from k3.cli_args import _saved_train_config

        if _saved_train_config(ck).get("qat") == "mxfp4":
            return "mxfp4"
    return "mxfp4" if _is_mxfp4(load_config(ck)) else None


def load_teachers(table: TeacherTable, student_cfg, student_tok, device, backends, verify: bool, log=print) -> dict:
    """{tag: teacher model} (one model per distinct checkpoint), each checked against the student."""
    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.model.common import stack_projections

    loaded: dict[str, Any] = {}
    out = {}
    for (d, e), ck in table.tags.items():
        tag = d if e is None else f"{d}/{e}"
        if ck not in loaded:
            if not os.path.isdir(ck) or not os.path.isfile(os.path.join(ck, "config.json")):
                raise ValueError(f"--teacher {tag}={ck}: no checkpoint there (a directory with config.json and "
                                 "safetensors)")
            model = from_pretrained(ck, dtype=torch.float32, device=device, backends=backends, verify=verify)
            if model.config.vocab_size != student_cfg.vocab_size:
                raise ValueError(f"--teacher {tag}={ck}: vocabulary of {model.config.vocab_size} tokens, the "
                                 f"student's has {student_cfg.vocab_size}: a teacher must share the student's "
                                 "tokenizer (its log-probs are read at the student's tokens)")
            if os.path.isfile(os.path.join(ck, "tokenizer.json")):
                if load_any_tokenizer(ck).fingerprint() != student_tok.fingerprint():
                    raise ValueError(f"--teacher {tag}={ck}: its tokenizer.json differs from the student's: a "
                                     "teacher must share the student's tokenizer")
            model.requires_grad_(False)
            # inference only: each layer's projections of one input as one GEMM, as the student's are once the
            # rollout engine has stacked them (the same GEMMs on both sides: a teacher equal to the student scores
            # every token exactly as the student does)
            stack_projections(model)
            loaded[ck] = model
            log(f"teacher {tag}: {ck} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
        out[(d, e)] = loaded[ck]
    return out


def build_distill_run(opts: DistillOptions, tcfg: TrainConfig, log=print) -> MOPDTrainer:
    from k3.posttrain.sft import load_fp32_base, prepare_run_dir
    from k3.serve.chat import chat_template_json, stop_strings
    from k3.train.run import _tokenizer_json_bytes

    opts.validate()
    distill_train_config(opts, tcfg)
    tcfg.validate()
    table = TeacherTable(opts.teachers)
    prompts = read_prompts(opts.prompts, table)
    device, resume_from = prepare_run_dir(tcfg, opts.device, opts.resume, log)
    src = resume_from or opts.student
    if src is None:
        raise ValueError("--student: give the checkpoint to distill into")
    model, tok, template = load_fp32_base(src, device, opts.backends, opts.verify, what="--student ", qat=tcfg.qat)
    teachers = load_teachers(table, model.config, tok, device, opts.backends, opts.verify, log)

    def encoded(ps):
        ids, kept, too_long = [], [], 0
        for p in ps:
            x = encode_prompt(p, tok, template)
            if len(x) > opts.max_prompt_tokens:
                too_long += 1
                continue
            ids.append(x)
            kept.append(p)
        return ids, kept, too_long

    ids, kept, too_long = encoded(prompts)
    if not kept:
        raise ValueError(f"every prompt is longer than --max-prompt-tokens {opts.max_prompt_tokens}")
    heldout = []
    if opts.heldout:
        h_ids, h_kept, h_long = encoded(read_prompts(opts.heldout, table))
        if not h_kept:
            raise ValueError(f"every held-out prompt is longer than --max-prompt-tokens {opts.max_prompt_tokens}")
        heldout = list(zip(h_kept, h_ids))
        log(f"held-out prompts: {len(h_kept)}, {opts.eval_samples} samples each every {tcfg.eval_every} steps; "
            f"{h_long} left out, longer than --max-prompt-tokens {opts.max_prompt_tokens}")
    counts: dict = {}
    for p in kept:
        counts[p.domain] = counts.get(p.domain, 0) + 1
    log(f"prompts: {len(kept)} ({', '.join(f'{d} {n}' for d, n in sorted(counts.items()))}); {too_long} left out, "
        f"longer than --max-prompt-tokens {opts.max_prompt_tokens}")
    torch.manual_seed(tcfg.seed)
    source = PromptSource(kept, ids, opts.seq_len, seed=tcfg.seed)
    chat = any(p.messages is not None for p in kept)
    rollout = RolloutEngine(model, tok, opts.engine or default_engine_config(opts.cache_memory_mb),
                            max_new_tokens=opts.max_new_tokens, budget=opts.rollout_budget,
                            stop=stop_strings(template) if chat else None)
    trainer = MOPDTrainer(model, tcfg, source, rollout, teachers, table, opts.r_max, heldout=heldout,
                          eval_samples=opts.eval_samples, eos_id=tok.eos_id,
                          tokenizer_json=_tokenizer_json_bytes(tok), log=log,
                          extra_files={"chat_template.json": chat_template_json(template).encode("utf-8")})
    if resume_from is not None:
        trainer.load(resume_from, verify=opts.verify)
        log(f"resumed from {resume_from} at step {trainer.step} ({len(source.in_flight)} samples in flight)")
    log(f"student: {src} on {device}{f', QAT {tcfg.qat}' if tcfg.qat else ''}; {opts.rollouts_per_step} rollouts "
        f"per step, up to {opts.max_new_tokens} new tokens, {rollout.budget} per step; R_max {opts.r_max:g}")
    return trainer


def run_distill(opts: DistillOptions, tcfg: TrainConfig, progress_bar: bool = True, log=print) -> dict:
    with holding_run_dir(tcfg.out):
        trainer = build_distill_run(opts, tcfg, log)
        summary = trainer.fit(progress_bar=progress_bar)
        if tcfg.qat is not None:
            from k3.train.qat import export_run

            summary["export"] = export_run(trainer, log)
    recs = [h for h in trainer.history if "reverse_kl" in h]
    if recs:
        summary["first_reverse_kl"], summary["last_reverse_kl"] = recs[0]["reverse_kl"], recs[-1]["reverse_kl"]
    msg = f"stopped at step {summary['step']}" if summary.get("interrupted") else f"finished at step {summary['step']}"
    if recs:
        msg += f": sampled reverse KL {summary['first_reverse_kl']:.3f} -> {summary['last_reverse_kl']:.3f}"
    if summary.get("first_val_loss") is not None and summary.get("last_val_loss") is not None:
        msg += f", held out {summary['first_val_loss']:.3f} -> {summary['last_val_loss']:.3f}"
    log(f"{msg}; checkpoint {summary['checkpoint']}")
    return summary


def write_prompts_jsonl(records: list[dict], path: str) -> None:
    from k3.files import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in records))
