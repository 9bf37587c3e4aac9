"""Context management (report §4.2.1): what part of the conversation the policy sees at each turn.

The episode keeps the whole conversation; a `ContextManager` derives the messages sent to the policy from it:
- `keep_all`: everything.
- `drop_old_tool_outputs`: past the token budget, tool outputs are replaced by a one-line placeholder, oldest
  first, until the view fits; the last `keep_recent` messages stay whole.
- `summarize`: past the budget, the policy itself summarizes the turns before the last `keep_recent` messages
  (and any earlier summary); the view is then the system prompt, the task, the summary and the recent turns.
  A cut is always at the start of a turn, so no tool result is separated from the call it answers.
Tokens are estimated (`client.estimate_tokens`); a budget needs the order of magnitude, not a tokenizer.
"""

from __future__ import annotations

from k3.env.client import Policy, estimate_tokens
from k3.env.harness import ContextConfig

SUMMARY_PROMPT = ("You are summarizing the earlier part of an agent's work on a task so that it can continue "
                  "with less context. Keep every fact it will need: what it found, what it changed (files, "
                  "commands), what failed and why, and what remains to do. Be concise.")
SUMMARY_HEADER = "Summary of the earlier part of this task:\n"
_TRANSCRIPT_CHARS = 2000        # each message's share of the transcript the summarizer reads


def placeholder(msg: dict) -> str:
    return f"[output of {msg.get('name') or 'a tool'} omitted to save context: {len(msg.get('content') or '')} " \
           f"characters]"


class ContextManager:
    """One per episode (the `summarize` strategy keeps its summary between turns)."""

    def __init__(self, config: ContextConfig):
        self.config = config
        self.summary: str | None = None
        self.cut = 2              # messages[2:cut] are covered by the summary (0: system, 1: the task)

    def view(self, messages: list[dict], policy: Policy) -> tuple[list[dict], dict]:
        """The messages to send, and a record of what was done to fit them (for the trajectory)."""
        strategy = self.config.strategy
        if strategy == "keep_all":
            return messages, {}
        if strategy == "drop_old_tool_outputs":
            return self._drop(messages)
        return self._summarize(messages, policy)

    def _drop(self, messages: list[dict]) -> tuple[list[dict], dict]:
        out = list(messages)
        total = estimate_tokens(out)
        dropped = 0
        for i in range(len(out) - self.config.keep_recent):
            if total <= self.config.budget_tokens:
                break
            m = out[i]
            if m.get("role") == "tool":
                new = {**m, "content": placeholder(m)}
                total += estimate_tokens(new) - estimate_tokens(m)
                out[i] = new
                dropped += 1
        return out, ({"dropped_tool_outputs": dropped} if dropped else {})

    def _current(self, messages: list[dict]) -> list[dict]:
        head = messages[:2]
        if self.summary is not None:
            head = head + [{"role": "user", "content": SUMMARY_HEADER + self.summary}]
        return head + messages[self.cut:]

    def _summarize(self, messages: list[dict], policy: Policy) -> tuple[list[dict], dict]:
        view = self._current(messages)
        if estimate_tokens(view) <= self.config.budget_tokens:
            return view, {}
        last = len(messages) - self.config.keep_recent
        starts = [i for i in range(self.cut, last + 1) if i < len(messages) and messages[i].get("role") == "assistant"]
        new_cut = max((i for i in starts if i > self.cut), default=None)
        if new_cut is None:
            return view, {}         # nothing old enough to summarize: send what there is
        transcript = ([f"EARLIER SUMMARY:\n{self.summary}"] if self.summary else []) + \
            [_render(m) for m in messages[self.cut:new_cut]]
        completion = policy.complete(
            [{"role": "system", "content": SUMMARY_PROMPT},
             {"role": "user", "content": f"The task:\n{messages[1].get('content')}\n\nThe work so far:\n\n"
                                         + "\n\n".join(transcript)}],
            [], max_tokens=self.config.summary_max_tokens, temperature=0.0)
        summarized = new_cut - self.cut
        self.summary = (completion.message.get("content") or "").strip() or "(empty summary)"
        self.cut = new_cut
        return self._current(messages), {"summarized_messages": summarized, "summary": self.summary,
                                         "summary_usage": completion.usage}


def _render(m: dict) -> str:
    role = m.get("role", "?").upper()
    text = m.get("content") or ""
    if m.get("role") == "tool":
        role = f"TOOL RESULT ({m.get('name') or '?'})"
    calls = [f"  -> called {c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls") or []]
    body = text if len(text) <= _TRANSCRIPT_CHARS else text[:_TRANSCRIPT_CHARS] + " [...]"
    return "\n".join([f"{role}: {body}"] + [c[:_TRANSCRIPT_CHARS] for c in calls])

