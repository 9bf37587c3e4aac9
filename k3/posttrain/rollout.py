"""Rollouts for on-policy training: the serving engine in-process, partial rollouts, and a policy version that
retires the engine's caches whenever the weights change.

The rollouts run on the serving engine (k3.serve.engine.LLMEngine: continuous batching, prefix cache on) over the
very module the trainer updates, so the rollout numerics are the training numerics (a QAT student's experts are
fake-quantized in both). The engine's prefix cache and KDA checkpoints hold states computed by the weights that
were current when they were written; after an optimizer step they belong to an older policy, and a hit would
continue a new sample from an old policy's states. So `RolloutEngine` counts policy versions
(`policy_changed()`, called after every optimizer step) and builds a fresh engine whenever the version moved
since the last one was built: nothing of the old cache survives an update. Within one version the prefix cache
works as in serving (prompts shared by several samples, continuations of partial rollouts).

Partial rollouts (the report's partial rollout training): a sample advances by at most `budget` tokens per call
of `advance`. One that neither stopped nor reached `max_new_tokens` is kept, unfinished, and continues in a later
call from exactly where it stopped: its prompt and its tokens so far are the new request's prompt, and the
continuation is sampled by the policy current at that call. Its `behaviour_logprobs` keep, per token, the log-prob
under the policy that sampled it (recorded by the engine at sampling time), and `versions` the policy version, so
the loss can correct the older tokens with importance ratios. Greedy decoding of a sample cut into pieces gives
exactly the tokens of one uninterrupted generation under the same weights. (A stop string split across two pieces
is not seen: the engine matches stop strings within one request's output; the sample then ends at eos or
`max_new_tokens`.)

Sampling is at temperature 1 with no top-k / top-p, so that the recorded log-probs are those of the distribution
the tokens are drawn from (the behaviour policy); temperature 0 (greedy) is for evaluation and tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from k3.serve.engine import EngineConfig, LLMEngine, free_dropped_engines
from k3.serve.sampling import SamplingParams


@dataclass
class Rollout:
    uid: int  # unique per sample of a run
    prompt_index: int
    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # the response so far (a final eos included)
    behaviour_logprobs: list[float] = field(default_factory=list)  # per token: log mu(y_t), the sampling policy's
    versions: list[int] = field(default_factory=list)  # per token: the policy version that sampled it
    finished: bool = False
    finish_reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Rollout":
        return cls(**d)


def default_engine_config(cache_memory_mb: float = 256.0) -> EngineConfig:
    """The rollout engine's settings: small hash blocks so that prompts of a few hundred tokens are shared through
    the prefix cache; no CUDA graphs (the engine is rebuilt after every update, graphs would be captured again
    each time)."""
    return EngineConfig(cache_memory_mb=cache_memory_mb, page_tokens=256, hash_block_tokens=64, cuda_graphs=False)


class RolloutEngine:
    def __init__(self, model, tokenizer=None, config: EngineConfig | None = None, max_new_tokens: int = 128,
                 budget: int | None = None, stop: list[str] | None = None, temperature: float = 1.0):
        if temperature not in (0.0, 1.0):
            raise ValueError(f"temperature={temperature!r}: rollouts sample at 1 (the behaviour log-probs are the "
                             "sampling distribution's) or 0 (greedy)")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if budget is not None and budget < 1:
            raise ValueError(f"the rollout budget must be >= 1 token, got {budget}")
        self.model, self.tokenizer = model, tokenizer
        self.config = config or default_engine_config()
        self.max_new_tokens, self.budget = max_new_tokens, budget or max_new_tokens
        self.stop, self.temperature = list(stop or []), float(temperature)
        self.version = 0  # the policy version: +1 after every weight update
        self.engines_built = 0
        self._engine: LLMEngine | None = None
        self._engine_version = -1

    def policy_changed(self) -> None:
        """The weights changed (an optimizer step): the next rollout runs on a fresh engine, with an empty cache."""
        self.version += 1

    def retire(self) -> None:
        """Drop the engine (and its cache) without a policy change: the next rollout starts on an empty cache, as
        if the rollouts since the last weight update had not run (held-out evaluation leaves training alone)."""
        if self._engine is not None:
            self._engine = None
            free_dropped_engines()  # its pool freed now, not at the cycle collector's next run
        self._engine_version = -1

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None or self._engine_version != self.version:
            self.retire()  # release the old pool before the new one is allocated
            self._engine = LLMEngine(self.model, self.tokenizer, self.config)
            self._engine_version = self.version
            self.engines_built += 1
        return self._engine

    def advance(self, rollouts: list[Rollout], seed: int = 0) -> int:
        """Advance every unfinished rollout by at most `budget` tokens, all in one batched generation under the
        current policy; returns the tokens sampled. Sample i of call seeded `seed` draws from its own generator,
        seeded from (seed, uid), so results do not depend on the batch."""
        was_training = self.model.training
        eng = self.engine
        todo = [r for r in rollouts if not r.finished]
        reqs = {}
        for r in todo:
            n = min(self.budget, self.max_new_tokens - len(r.tokens))
            params = SamplingParams(max_tokens=n, temperature=self.temperature, logprobs=0, stop=self.stop,
                                    seed=(seed * 1_000_003 + r.uid) % 2**63)
            seq = eng.add_request(r.prompt_ids + r.tokens, params)
            reqs[seq.request_id] = r
        sampled = 0
        try:
            with torch.no_grad():
                while eng.has_work():
                    for out in eng.step():
                        r = reqs.get(out.request_id)
                        if r is None:
                            continue
                        for lp in out.logprobs:  # the eos that stops a request has its logprob here too
                            r.tokens.append(int(lp["token"]))
                            r.behaviour_logprobs.append(float(lp["logprob"]))
                            r.versions.append(self.version)
                            sampled += 1
                        if out.finished:
                            if out.finish_reason is not None and out.finish_reason.startswith("error"):
                                raise RuntimeError(f"rollout {r.uid}: {out.finish_reason}")
                            if out.finish_reason == "stop" or len(r.tokens) >= self.max_new_tokens:
                                r.finished, r.finish_reason = True, ("stop" if out.finish_reason == "stop"
                                                                     else "length")
        finally:
            self.model.train(was_training)
        return sampled
