"""Agentic rollouts for RL: multi-turn episodes of the agent environments (k3.env) sampled by the serving engine
in-process over the module being trained, token in, token out, with partial rollouts (report §4.1.2, §5.3.1).

Token in, token out. A sample's training row is built from the tokens the model actually produced, never from a
re-rendering of its parsed messages (which may tokenize differently): the first prompt is the chat template's
rendering of the episode's first messages (`render_chat_ids`, the harness's tools declared); each turn's sampled
tokens (the end-of-message marker included) are appended as sampled, with their behaviour log-probs and the policy
version that sampled each; the parsed message goes to the episode (`Episode.step`), which runs its tool calls; what
the template writes after the message (the assistant's closing tag, the tool results, the next generation prompt)
is appended untrained, computed as the difference between the renderings of the conversation before and after
(`_continuation`). The next turn's prompt is the row so far, so the engine's prefix cache serves every earlier
turn. When the harness's context strategy rewrites history (the rendering after is no extension of the rendering
before), the row ends there and the next turn starts a new row of the same sample with the new rendering.

Partial rollouts. `AgentRollouts.run` advances every active sample until `stop()` says the iteration has enough
finished samples; generation then pauses: requests in the engine are aborted, each keeping the tokens sampled so
far in its turn (with their log-probs and versions); samples whose tool calls are running finish those calls. A
paused sample continues in the next `run` exactly where it stopped: its prompt is its row so far, the rest of its
turn is sampled by the then-current policy (the row's tokens then carry several versions). Its sandbox stays as it
was (no process of it runs between tool calls). The episode's wall clock is stopped while a sample waits for the
model or is paused (`Episode.suspend`): the wall budget counts the environment's time, not the batch's queueing.

Engines and caches. The engine is rebuilt when the policy version moves (its cache holds the old weights' states).
Before that, the prefixes of paused samples can be written back to host memory (`write_back`) and fetched into the
new engine (`prefetch`): the paused samples then resume without re-prefilling their prefixes, on states computed by
the policy that sampled them, as the report's external KV-cache pool does; `reprefill_avoided` counts the tokens.

Precision. The trained module holds fp32 weights. Where the trainer's forward runs under bf16 autocast (on CUDA),
rollouts do too (`autocast_bf16`): each weight is cast to bf16 once per policy version (a `WeightCasts` kept until
the policy changes or the engine is parked) and every engine step reads those copies, so the engine runs the bf16
kernels a served model runs and the behaviour log-probs are those of the trainer's own forward, up to summation
order. Without it the engine runs fp32 weights and activations.

Throttling (§5.3.1's auto-throttling scheduler): `Throttle` decides how many requests may be in the engine from its
running and queued requests and its cache use, so that contexts that grow turn after turn do not end in preemption
storms; it starts at `start` and adapts (additive increase while the cache has room and nothing queues,
multiplicative decrease under cache pressure, queueing or preemptions).
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from dataclasses import dataclass, field

import torch

from k3.env.client import Completion
from k3.env.episode import Episode
from k3.env.task import Task
from k3.model.common import use_weight_casts
from k3.ops.weight_cast import WeightCasts
from k3.serve.chat import AssistantParser, ChatTemplate, chat_stop, markup_ids, render_chat_ids
from k3.serve.engine import EngineConfig, LLMEngine, free_dropped_engines
from k3.serve.sampling import SamplingParams


@dataclass
class Row:
    """One training row of a sample: token ids; per token the behaviour log-prob and the policy version that
    sampled it (version -1: not sampled, not trained: prompts, tool results, template markup)."""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def extend(self, ids, logprobs=None, versions=None) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.versions.extend(versions if versions is not None else [-1] * len(ids))

    @property
    def sampled(self) -> int:
        return sum(v >= 0 for v in self.versions)


@dataclass
class Sample:
    """One trajectory: sample `k` of group `group` (a task), its episode and rows, and where it stands."""
    uid: int
    group: int
    task: Task
    episode: Episode
    rows: list[Row] = field(default_factory=lambda: [Row()])
    state: str = "new"  # new -> ready (a turn to sample) -> generating -> tools -> ready ... -> done
    turn_start: int = 0  # index in the last row where the current turn's sampled tokens begin
    turn_tokens: int = 0
    turns: int = 0
    output_tokens: int = 0  # sampled tokens over the whole trajectory (the report's T(y) for agentic tasks)
    thinking_tokens: int = 0  # of which inside think channels (T(y) for general tasks)
    reward: float | None = None  # the hidden verifier's
    success: bool = False
    train_reward: float | None = None  # what the optimizer sees (budget control may override the reward with -1)
    advantage: float = 0.0  # train_reward - its group's mean
    trajectory: dict | None = None
    error: str | None = None
    paused: int = 0  # times it was paused at the end of an iteration
    pieces: int = 0  # generation requests it took (a turn paused once takes two)
    view: list[dict] = field(default_factory=list)  # the messages the current turn's prompt renders

    @property
    def row(self) -> Row:
        return self.rows[-1]

    @property
    def done(self) -> bool:
        return self.state == "done"

    def versions(self) -> set[int]:
        return {v for r in self.rows for v in r.versions if v >= 0}


class Throttle:
    """How many requests may be in the engine at once, from runtime signals: running and queued requests, the
    cache's free share, preemptions. Starts at `start`; +`step` each check while the cache is below `high` use and
    nothing queues; x`backoff` (at least 1) when the cache is above `high`, requests queue, or a preemption
    happened since the last check. `fixed=True` keeps `start` (the comparison baseline)."""

    def __init__(self, start: int = 16, lo: int = 1, hi: int = 1024, high: float = 0.85, step: int = 2,
                 backoff: float = 0.7, fixed: bool = False, every: int = 4):
        if not 1 <= lo <= start <= hi:
            raise ValueError(f"throttle: need 1 <= lo ({lo}) <= start ({start}) <= hi ({hi})")
        self.limit, self.lo, self.hi, self.high, self.step, self.backoff = start, lo, hi, high, step, backoff
        self.fixed = fixed
        self._preemptions, self._calls, self.every = 0, 0, every
        self.trace: list[int] = [start]

    def update(self, engine: LLMEngine, demand: int | None = None) -> int:
        """Called before each engine step with the requests that want to be in the engine (`demand`: those in it
        and those queued); the limit moves at most once every `every` calls, and grows only while it binds."""
        self._calls += 1
        if self.fixed or self._calls % self.every:
            return self.limit
        st = engine.cache.stats()
        used = 1.0 - (st["free_pages"] + st["evictable_pages"]) / max(st["num_pages"], 1)
        queued = engine.scheduler.num_waiting
        pre = engine.metrics.preemptions
        if used > self.high or queued > 0 or pre > self._preemptions:
            self.limit = max(self.lo, int(self.limit * self.backoff))
        elif used < self.high * 0.8 and (demand is None or demand > self.limit):
            self.limit = min(self.hi, self.limit + self.step)
        self._preemptions = pre
        if not self.trace or self.trace[-1] != self.limit:
            self.trace.append(self.limit)
        return self.limit


@dataclass
class RolloutConfig:
    harness: object = "react"  # a preset name, a JSON file, a dict or a HarnessConfig
    sandbox_kind: str = "bwrap"
    max_turn_tokens: int = 512  # sampled tokens per assistant turn (also bounded by the task's token budget)
    effort: str | None = None  # the template's thinking-effort option (low/medium/high/max); thinking mode when set
    temperature: float = 1.0
    tool_workers: int = 4  # threads running tool calls and verifiers while the engine generates
    write_back: bool = True  # paused samples' prefixes to host memory across a policy update
    # Sample under bf16 autocast, as the trainer's forward runs on CUDA, with each fp32 weight cast to bf16 once per
    # policy version (k3.ops.weight_cast) rather than in every engine step. Off: the engine runs the fp32 weights.
    autocast_bf16: bool = False


class AgentRollouts:
    """Runs samples (`Sample`) of agent episodes on an engine over `model`; see the module docstring."""

    def __init__(self, model, tokenizer, template: ChatTemplate, cfg: RolloutConfig,
                 engine_config: EngineConfig | None = None, throttle: Throttle | None = None, log=print):
        if cfg.temperature not in (0.0, 1.0):
            raise ValueError(f"temperature={cfg.temperature!r}: rollouts sample at 1 (the behaviour log-probs are "
                             "the sampling distribution's) or 0 (greedy, for evaluation)")
        if markup_ids(tokenizer, template) is None:
            raise ValueError("this tokenizer has no chat markup tokens ([open] [sep] [close] [end_of_msg]): agent "
                             "rollouts need them (k3's tokenizers have them; an older checkpoint's tokenizer can be "
                             "rebuilt with them)")
        self.model, self.tok, self.template, self.cfg = model, tokenizer, template, cfg
        self.engine_config = engine_config or EngineConfig(cache_memory_mb=256.0, page_tokens=256,
                                                           hash_block_tokens=64, cuda_graphs=False)
        self.throttle = throttle or Throttle()
        self.log = log
        self.version = 0
        self.engines_built = 0
        self._engine: LLMEngine | None = None
        self._engine_version = -1
        self._host = None  # paused prefixes written back to host memory, fetched by the next engine
        self._casts: WeightCasts | None = None  # the bf16 weights of the current policy version (autocast_bf16)
        self.eom = chat_stop(tokenizer, template)[1][0]
        self.counters = {"prefetched_tokens": 0, "written_back_tokens": 0, "reprefill_avoided": 0,
                         "prefill_tokens": 0, "sampled_tokens": 0, "requests": 0, "preemptions": 0}
        self.pool = cf.ThreadPoolExecutor(max(1, cfg.tool_workers), thread_name_prefix="k3-rl-tools")

    # --- engines and policy versions -------------------------------------------------------------------------
    def policy_changed(self) -> None:
        """The weights changed: the next `run` uses a fresh engine (paused prefixes fetched from host memory)."""
        self.version += 1
        self._casts = None

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None or self._engine_version != self.version:
            self._drop_engine()  # the old pool freed before the new one is allocated
            self._engine = LLMEngine(self.model, self.tok, self.engine_config)
            self._engine_version = self.version
            self.engines_built += 1
            if self._host is not None:
                self.counters["prefetched_tokens"] += self._engine.prefetch(self._host)
                self._host = None
        return self._engine

    def park(self, samples: list[Sample]) -> None:
        """Before the trainer runs: write the prefixes of the paused `samples` back to host memory (if enabled),
        then drop the engine and its page pool, so that training has the memory."""
        if self._engine is not None and self.cfg.write_back:
            prefixes = [s.row.ids for s in samples if not s.done and s.state != "new"]
            if prefixes:
                self._host = self._engine.write_back(prefixes)
                self.counters["written_back_tokens"] += self._host.tokens
        self._casts = None  # the bf16 copies too: training has the memory
        self._drop_engine()

    def _drop_engine(self) -> None:
        """Drop the engine and free its page pool now (k3.serve.engine.free_dropped_engines)."""
        if self._engine is not None:
            self._engine = None
            free_dropped_engines()
        self._engine_version = -1

    def weight_casts(self) -> WeightCasts | None:
        """The current policy version's bf16 weight copies under `autocast_bf16` (made on first use), else None."""
        if not self.cfg.autocast_bf16:
            return None
        if self._casts is None:
            self._casts = WeightCasts()
        return self._casts

    def precision(self):
        """The context the engine's forwards run in: bf16 autocast with the version's weight casts, or nothing."""
        stack = contextlib.ExitStack()
        if self.cfg.autocast_bf16:
            dev = next(self.model.parameters()).device.type
            stack.enter_context(torch.autocast(dev, dtype=torch.bfloat16))
            stack.enter_context(use_weight_casts(self.model, self.weight_casts()))
        return stack

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self._drop_engine()

    # --- token in, token out ----------------------------------------------------------------------------------
    def _render(self, sample: Sample, messages: list[dict], generation: bool) -> list[int]:
        return render_chat_ids(messages, self.tok, self.template, generation, tools=sample.episode.tool_specs(),
                               reasoning_effort=self.cfg.effort, thinking=self.cfg.effort is not None)

    def _start(self, s: Sample) -> None:
        """Reset the episode (its sandbox made from the task's image) and render the first prompt."""
        try:
            s.episode.reset()
            s.view = list(s.episode.observation())  # a copy: the view may be the episode's own list
            s.row.extend(self._render(s, s.view, True))
        except Exception as e:
            s.episode._end("error", f"could not start the episode: {type(e).__name__}: {e}")
            self._finish(s)
            return
        s.turn_start, s.turn_tokens, s.state = len(s.row.ids), 0, "ready"

    def _continuation(self, s: Sample, sampled_eom: bool) -> None:
        """After a turn's tool calls: what the template writes between the sampled message and the next generation
        (untrained), appended to the row; a new row when the context strategy rewrote the history."""
        ep = s.episode
        before = self._render(s, s.view + [ep.messages[ep.steps[-1]["message_index"]]], False)
        s.view = list(ep.observation())
        after = self._render(s, s.view, True)
        if after[:len(before)] == before:
            tail = before[len(before) - before[::-1].index(self.eom):] if self.eom in before else []
            s.row.extend(([] if sampled_eom else [self.eom]) + tail + after[len(before):])
        else:  # the context strategy rewrote the history: a new row, prompt and all
            s.rows.append(Row())
            s.row.extend(after)
        s.turn_start, s.turn_tokens = len(s.row.ids), 0

    def _turn_limit(self, s: Sample) -> int:
        """Tokens the current turn may still sample: the turn's cap and the task's token budget, less what the
        turn and the earlier turns sampled."""
        ep = s.episode
        budget = s.task.budget.tokens - ep.counts["completion_tokens"] - s.turn_tokens
        per_turn = min(self.cfg.max_turn_tokens, ep.config.max_tokens_per_turn) - s.turn_tokens
        return max(0, min(budget, per_turn))

    def _parse(self, s: Sample) -> dict:
        ids = s.row.ids[s.turn_start:]
        p = AssistantParser(self.template, prefix="think" if self.cfg.effort is not None else "response",
                            tokenizer=self.tok)
        p.feed_ids(ids)
        p.finish()
        parsed = p.result()
        if parsed.reasoning:
            s.thinking_tokens += len(self.tok.encode(parsed.reasoning))
        return parsed.to_message([f"call_{s.turns + 1}_{k}" for k in range(len(parsed.tool_calls))])

    def _tool_step(self, s: Sample, finish_reason: str) -> Sample:
        """In a worker thread: the episode's step (tool calls), then the continuation or the verdict."""
        ep = s.episode
        sampled_eom = bool(s.row.ids) and s.row.ids[-1] == self.eom and s.turn_tokens > 0
        ep.resume()
        try:
            msg = self._parse(s)
            usage = {"prompt_tokens": s.turn_start, "completion_tokens": s.turn_tokens}
            ep.step(msg, Completion(msg, "tool_calls" if msg.get("tool_calls") else finish_reason, usage))
        except Exception as e:
            ep._end("error", f"step failed: {type(e).__name__}: {e}")
        s.turns += 1
        if ep.done:
            self._finish(s)
        else:
            try:
                self._continuation(s, sampled_eom)
                s.state = "ready"
                ep.suspend()  # waiting for the model again
            except Exception as e:
                ep._end("error", f"rendering the next turn failed: {type(e).__name__}: {e}")
                self._finish(s)
        return s

    def _finish(self, s: Sample) -> None:
        try:
            t = s.episode.finish()
            s.trajectory = t.to_dict()
            v = t.verdict or {}
            s.reward, s.success = float(v.get("reward", 0.0)), bool(v.get("success", False))
            s.error = t.error
        except Exception as e:  # a verifier or sandbox failure scores 0 and is kept, never stops the batch
            s.reward, s.success, s.error = 0.0, False, f"finishing the episode failed: {type(e).__name__}: {e}"
        s.state = "done"

    # --- the loop ---------------------------------------------------------------------------------------------
    def run(self, samples: list[Sample], stop=lambda: False, seed: int = 0) -> dict:
        """Advance `samples` (new, paused or ready ones; done ones are ignored) until all are done or `stop()`
        is true (checked whenever a sample finishes); then pause the rest. Returns this run's statistics."""
        eng = self.engine
        t0 = time.perf_counter()
        before = dict(cached=eng.metrics.prompt_tokens_cached, computed=eng.metrics.prompt_tokens_computed,
                      gen=eng.metrics.generation_tokens, pre=eng.metrics.preemptions)
        was_training = self.model.training
        live = {id(s): s for s in samples if not s.done}
        for s in live.values():
            if s.state == "new":
                self._start(s)
        queue = [s for s in samples if s.state == "ready"]
        queue.sort(key=lambda s: -s.paused)  # paused samples resume first
        in_engine: dict[str, Sample] = {}
        futures: dict[cf.Future, Sample] = {}
        stopped = False
        try:
            with torch.no_grad(), self.precision():
                while True:
                    if not stopped and stop():
                        stopped = True
                    limit = self.throttle.update(eng, len(in_engine) + len(queue))
                    while queue and not stopped and len(in_engine) < limit:
                        s = queue.pop(0)
                        n = self._turn_limit(s)
                        if n <= 0:  # no budget left: end the turn as it is
                            s.state = "tools"
                            futures[self.pool.submit(self._tool_step, s, "length")] = s
                            continue
                        s.pieces += 1
                        params = SamplingParams(max_tokens=n, temperature=self.cfg.temperature, logprobs=0,
                                                stop_token_ids=[self.eom],
                                                seed=(seed * 1_000_003 + s.uid * 7919 + s.pieces) % 2**63)
                        s.episode.suspend()
                        try:
                            seq = eng.add_request(list(s.row.ids), params)
                        except ValueError as e:  # the conversation outgrew the context or the page pool
                            s.episode.resume()
                            s.episode._end("error", f"the next turn cannot be sampled: {e}")
                            self._finish(s)
                            continue
                        in_engine[seq.request_id] = s
                        s.state = "generating"
                        self.counters["requests"] += 1
                    if stopped:  # pause: no more engine steps; the tool calls under way finish, then the rest waits
                        for f in cf.as_completed(list(futures)):
                            f.result()
                            s = futures.pop(f)
                            if s.state == "ready":
                                queue.append(s)
                        break
                    if eng.has_work():
                        for out in eng.step():
                            s = in_engine.get(out.request_id)
                            if s is None:
                                continue
                            for lp in out.logprobs:
                                s.row.extend([int(lp["token"])], [float(lp["logprob"])], [self.version])
                                s.turn_tokens += 1
                                s.output_tokens += 1
                            if out.finished:
                                del in_engine[out.request_id]
                                if out.finish_reason is not None and out.finish_reason.startswith("error"):
                                    s.episode.resume()
                                    s.episode._end("error", f"the engine failed: {out.finish_reason}")
                                    self._finish(s)
                                    continue
                                s.state = "tools"
                                futures[self.pool.submit(self._tool_step, s, out.finish_reason or "stop")] = s
                    done_f = [f for f in futures if f.done()]
                    if not eng.has_work() and futures and not done_f:
                        done_f = list(cf.wait(list(futures), return_when=cf.FIRST_COMPLETED).done)
                    for f in done_f:
                        s = futures.pop(f)
                        f.result()
                        if s.state == "ready":
                            queue.append(s)
                    if not queue and not in_engine and not futures and not eng.has_work():
                        break
        finally:
            for rid, s in list(in_engine.items()):  # pause: abort, keep the tokens sampled so far
                eng.abort_request(rid)
                s.state, s.paused = "ready", s.paused + 1
            for s in queue:
                if s.state == "ready" and not s.done:
                    s.paused += 1
            self.model.train(was_training)
        m = eng.metrics
        stats = {"rollout_s": time.perf_counter() - t0, "sampled_tokens": m.generation_tokens - before["gen"],
                 "prefill_tokens": m.prompt_tokens_computed - before["computed"],
                 "cached_tokens": m.prompt_tokens_cached - before["cached"],
                 "preemptions": m.preemptions - before["pre"], "paused": sum(not s.done for s in samples),
                 "concurrency": list(self.throttle.trace)}
        self.counters["sampled_tokens"] += stats["sampled_tokens"]
        self.counters["prefill_tokens"] += stats["prefill_tokens"]
        self.counters["preemptions"] += stats["preemptions"]
        return stats
