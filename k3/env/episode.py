"""The episode runner: one task, one harness, one policy, one sandbox, start to verdict.

    ep = Episode(task, "coder", policy, sandbox_kind="bwrap")
    trajectory = ep.run()          # reset, then policy -> step until done, then the hidden verifier

or driven from outside, one turn at a time (as an RL rollout worker does):

    messages = ep.reset()
    while not ep.done:
        completion = policy.complete(ep.observation(), ep.tool_specs(), max_tokens=..., temperature=...)
        ep.step(completion.message, completion)
    trajectory = ep.finish()

An episode ends with a reason: "submitted" (a submission ended it), "answered" (an assistant message without tool
calls; its content is the answer), "max_turns", "max_tokens" (completion tokens over the budget), "timeout" (wall
time), or "error" (the sandbox could not be made, or the policy failed: the message is kept, nothing is raised, so
one failing episode never stops a batch). Parallel tool calls of one message run in order, each result carrying
its call's id. The hidden verifier then judges a fork of the final sandbox, and every sandbox is closed.

The wall budget bounds every command (a tool call gets at most the time left) and is checked between turns; a
policy call itself is bounded by the policy's own timeout.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import replace

from k3.env.client import Completion, Policy, normalize_message
from k3.env.context import ContextManager
from k3.env.harness import HarnessConfig, build_tools, render_system_prompt
from k3.env.memory import MemoryStore
from k3.env.presets import load_harness
from k3.env.sandbox import Limits, Sandbox, create_sandbox
from k3.env.skills import SkillLibrary
from k3.env.task import Budget, Task, Verdict
from k3.env.tools import ToolContext, call_tool
from k3.env.trajectory import COUNT_FIELDS, Trajectory


class Episode:
    """`sandbox`: work in this existing sandbox instead of making one from the task's image (a sub-agent sharing
    its parent's; the episode then never closes it). `verify=False` skips the hidden verifier (sub-agents)."""

    def __init__(self, task: Task, harness: "str | dict | HarnessConfig", policy: Policy, sandbox_kind: str = "bwrap",
                 limits: Limits | None = None, *, sandbox: Sandbox | None = None, depth: int = 0,
                 verify: bool = True, kernel_device: str = "cpu"):
        self.task = task
        self.config = load_harness(harness)
        self.policy = policy
        self.sandbox_kind = sandbox_kind
        self.limits = limits
        self.depth = depth
        self.verify = verify
        self.kernel_device = kernel_device
        self.sandbox = sandbox
        self._owns_sandbox = sandbox is None
        self.context = ContextManager(self.config.context)
        self.messages: list[dict] = []
        self.steps: list[dict] = []
        self.subagents: list[dict] = []
        self.counts = {k: 0 for k in COUNT_FIELDS}
        self.tools = {}
        self.ctx: ToolContext | None = None
        self.done = False
        self.end_reason: str | None = None
        self.error: str | None = None
        self.answer: str | None = None
        self._t0 = time.monotonic()
        self._started_at = ""
        self._deadline = None
        self._context_info: dict = {}
        self._suspended_at: float | None = None
        self._suspended_s = 0.0  # wall time spent suspended (not counted against the budget)

    # -- life cycle ---------------------------------------------------------------------------------------------
    def reset(self) -> list[dict]:
        """Make the sandbox from the task's image and the first messages (system prompt, task); returns them."""
        self._t0 = time.monotonic()
        self._started_at = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self._deadline = self._t0 + self.task.budget.wall_seconds
        if self.sandbox is None:
            self.sandbox = create_sandbox(self.sandbox_kind, None, limits=self.limits)
            for path, content in self.task.image.items():
                self.sandbox.write_file(path, content)
        cfg = self.config
        memory = MemoryStore(cfg.memory_dir, self.task.family) if cfg.memory_dir else None
        skills = SkillLibrary(cfg.skills_dir) if cfg.skills_dir else None
        self.tools = build_tools(cfg, self.task, self.depth)
        self.ctx = ToolContext(self.sandbox, self.task, deadline=self._deadline, memory=memory, skills=skills,
                               delegate=self._delegate, kernel_device=self.kernel_device)
        self.messages = [{"role": "system", "content": render_system_prompt(cfg, self.tools, memory, skills)},
                         {"role": "user", "content": self.task.prompt}]
        return list(self.messages)

    def tool_specs(self) -> list[dict]:
        return [t.spec() for t in self.tools.values()]

    def observation(self) -> list[dict]:
        """The messages to send to the policy now: the context strategy applied (what it did is recorded with the
        next step)."""
        view, info = self.context.view(self.messages, self.policy)
        usage = info.get("summary_usage")
        if usage:   # the summary is the policy's own generation: it counts against the episode's budget
            self.counts["prompt_tokens"] += int(usage.get("prompt_tokens", 0))
            self.counts["completion_tokens"] += int(usage.get("completion_tokens", 0))
        self._context_info = info
        return view

    def step(self, message: dict, completion: Completion | None = None, *, policy_s: float | None = None) -> list[dict]:
        """Record one assistant message, run its tool calls in order, and return their result messages."""
        if self.ctx is None or self.done:
            raise RuntimeError(f"step() needs a running episode: call reset() first ({self.end_reason or 'not reset'})")
        turn = self.counts["turns"] + 1
        msg = normalize_message(message, f"call_{turn}")
        self.messages.append(msg)
        self.counts["turns"] = turn
        usage = completion.usage if completion else {}
        self.counts["prompt_tokens"] += int(usage.get("prompt_tokens", 0))
        self.counts["completion_tokens"] += int(usage.get("completion_tokens", 0))
        record = {"turn": turn, "message_index": len(self.messages) - 1, "policy_s": policy_s,
                  "finish_reason": completion.finish_reason if completion else None, "usage": usage,
                  "extras": completion.extras if completion else {}, "context": self._context_info, "tool_calls": []}
        self._context_info = {}
        results = []
        for call in msg.get("tool_calls", []):
            name, args = call["function"]["name"], call["function"]["arguments"]
            if self.ctx.finished:
                text, error, wall = "not run: a submission at an earlier call of this message ended the episode", \
                    False, 0.0
            else:
                out = call_tool(self.tools, self.ctx, name, args, self.config.max_output_chars)
                text, error, wall = out.text, out.error, out.wall_s
                self.counts["tool_calls"] += 1
                self.counts["tool_errors"] += int(error)
            results.append({"role": "tool", "tool_call_id": call["id"], "name": name, "content": text})
            record["tool_calls"].append({"id": call["id"], "name": name, "error": error, "wall_s": wall})
        self.messages.extend(results)
        self.steps.append(record)
        self.counts["submissions"] = self.ctx.submissions
        self._check_end(msg)
        return results

    def suspend(self) -> None:
        """Stop the episode's wall clock (an RL rollout waits for the batched policy, or is paused while the
        trainer runs): the time until `resume()` does not count against the task's wall budget."""
        if self._suspended_at is None:
            self._suspended_at = time.monotonic()

    def resume(self) -> None:
        """Restart the wall clock stopped by `suspend()`: the deadline moves by the time it was stopped."""
        if self._suspended_at is not None:
            gap = time.monotonic() - self._suspended_at
            self._suspended_at = None
            if self._deadline is not None:
                self._deadline += gap
                if self.ctx is not None:
                    self.ctx.deadline = self._deadline
            self._suspended_s += gap

    def _check_end(self, msg: dict) -> None:
        b = self.task.budget
        if self.ctx.finished:
            self._end("submitted")
        elif not msg.get("tool_calls"):
            self.answer = msg.get("content") or ""
            self._end("answered")
        elif self.counts["completion_tokens"] >= b.tokens:
            self._end("max_tokens")
        elif self.counts["turns"] >= b.turns:
            self._end("max_turns")
        elif time.monotonic() >= self._deadline:
            self._end("timeout")

    def _end(self, reason: str, error: str | None = None) -> None:
        self.done, self.end_reason, self.error = True, reason, error

    def run(self) -> Trajectory:
        """The whole episode; never raises for what the sandbox, the policy or the model do."""
        try:
            self.reset()
        except Exception as e:
            self._end("error", f"could not start the episode: {type(e).__name__}: {e}")
            return self.finish()
        while not self.done:
            if time.monotonic() >= self._deadline:
                self._end("timeout")
                break
            try:
                view = self.observation()
                left = self.task.budget.tokens - self.counts["completion_tokens"]
                if left <= 0:
                    self._end("max_tokens")
                    break
                t = time.perf_counter()
                completion = self.policy.complete(view, self.tool_specs(), max_tokens=min(
                    self.config.max_tokens_per_turn, left), temperature=self.config.temperature)
                policy_s = time.perf_counter() - t
            except Exception as e:     # the server is down, refused the request, or returned garbage
                self._end("error", f"policy failed: {type(e).__name__}: {e}")
                break
            try:
                self.step(completion.message, completion, policy_s=policy_s)
            except Exception as e:     # tools report their own failures; this is a failure of the episode itself
                self._end("error", f"step failed: {type(e).__name__}: {e}")
        return self.finish()

    def finish(self) -> Trajectory:
        """Run the hidden verifier on a fork of the final sandbox, close every sandbox, return the trajectory."""
        if not self.done:
            self._end("error", "finish() before the episode ended")
        if self.ctx is not None and self.answer is None:
            self.answer = self.ctx.answer
        verdict = None
        try:
            if self.verify and self.ctx is not None:      # the episode started: its sandbox is whole
                verdict = self._hidden_verdict().to_dict()
        finally:
            if self._owns_sandbox and self.sandbox is not None:
                self.sandbox.close()
        return Trajectory(
            task_id=self.task.id, family=self.task.family, split=self.task.split, harness=self.config.name,
            harness_config=self.config.to_dict(), messages=self.messages, steps=self.steps, answer=self.answer,
            verdict=verdict, end_reason=self.end_reason, error=self.error, counts=dict(self.counts),
            wall_s=time.monotonic() - self._t0, started_at=self._started_at,
            public_verdicts=list(self.ctx.public_verdicts) if self.ctx else [], subagents=self.subagents)

    def _hidden_verdict(self) -> Verdict:
        try:
            fork = self.sandbox.fork()
        except Exception as e:
            return Verdict(0.0, False, f"could not fork the sandbox for the verifier: {type(e).__name__}: {e}")
        try:
            v = self.task.verify(fork, self.answer)
            if not isinstance(v, Verdict):
                raise TypeError(f"verify returned {type(v).__name__}, not Verdict")
            return v
        except Exception as e:   # a verifier bug scores 0 and is kept in the details, never crashes the batch
            return Verdict(0.0, False, f"the verifier failed: {type(e).__name__}: {e}")
        finally:
            fork.close()

    # -- the subagent module --------------------------------------------------------------------------------------
    def _delegate(self, instructions: str) -> str:
        """Run a sub-episode on `instructions` with the subagent harness, on a fork of this sandbox (or on this
        sandbox itself), within this episode's remaining time; return its final answer."""
        sub = self.config.subagent
        n = len(self.subagents) + 1
        left = max(1.0, self._deadline - time.monotonic())
        task = replace(self.task, id=f"{self.task.id}/sub{n}", prompt=instructions, image={}, tools=None,
                       budget=Budget(turns=sub.turns, tokens=sub.tokens, wall_seconds=left), public_verify=None)
        sandbox = self.sandbox if sub.share_sandbox else self.sandbox.fork()
        try:
            episode = Episode(task, sub.harness, self.policy, sandbox=sandbox, depth=self.depth + 1, verify=False,
                              kernel_device=self.kernel_device)
            trajectory = episode.run()
        finally:
            if not sub.share_sandbox:
                sandbox.close()
        self.subagents.append(trajectory.to_dict())
        if trajectory.answer is not None:
            return trajectory.answer
        return f"(the sub-agent ended without an answer: {trajectory.end_reason}" + \
            (f": {trajectory.error})" if trajectory.error else ")")

