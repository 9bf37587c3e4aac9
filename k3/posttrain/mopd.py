"""Multi-Teacher On-Policy Distillation (MOPD, report §4.1.3, eq. 15): the reward, the policy-gradient loss, the
teacher chosen by a prompt's (domain, effort) tag, and the prompt file.

The student samples a response y to a prompt x; the teacher of the prompt's tag scores every sampled token. The
per-token reward is eq. 15,

    r_t = clip(sg(log pi_teacher(y_t | x, y_<t) - log pi_theta(y_t | x, y_<t)), -R_max, R_max),

minus the per-token sampled reverse KL, with a stop-gradient: the reward is a number, not a path for gradients.
With a discount of 0 (each token is credited with its own reward, as in on-policy distillation) the loss of a step
is the importance-sampled policy gradient

    L = -(1/N) * sum over the step's response tokens of  rho_t * r_t,   rho_t = exp(log pi_theta(y_t) - sg(log mu(y_t)))

where mu is the behaviour policy that sampled y_t (its log-prob recorded at rollout time) and N is the number of
response tokens of the step (a token-level mean: every token weighs the same, so long responses weigh more than
short ones; micro-batches divide by the step's N, not their own). Its gradient is -(1/N) sum rho_t r_t
d log pi_theta(y_t): for tokens sampled by the current weights rho_t = 1 in value (it is kept in the graph; its
gradient is the plain score-function gradient), for the tokens of a partial rollout sampled by an older snapshot
rho_t corrects for the policy having moved. rho_t is not clipped (eq. 15 clips the reward; the ratios of one or two
steps' staleness stay near 1, and metrics.jsonl records their largest value).

Teacher tags: `--teacher code=CK` serves every prompt of domain "code" whatever its effort; `--teacher
code/high=CK` only those of domain "code" and effort "high". The exact (domain, effort) pair wins over the domain
alone; a prompt that matches neither is an error naming its record. Tags are case-sensitive.

Prompt file (JSON Lines, one record per line):

    {"messages": [{"role": "user", "content": "..."}, ...], "domain": "code", "effort": "high"}
    {"prompt": "raw text, no chat template", "domain": "docs"}

"messages" are rendered with the student's chat template and its instruct-mode generation prefix
(k3.serve.chat.render_chat_ids, as `k3 serve` does), and the response then ends at the template's stop strings or
eos; a trailing assistant message (the reference reply of an SFT record) is dropped: the student writes its own.
"prompt" is tokenized as it is and ends at eos. "effort" is optional; other keys are ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

TAG_RE = re.compile(r"^[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)?$")


class PromptError(ValueError):
    """A prompt file has a bad record; the message names the file, the line and the field."""


# --- eq. 15 and the loss ------------------------------------------------------------------------------------------

def opd_reward(teacher_logp: torch.Tensor, student_logp: torch.Tensor, r_max: float) -> torch.Tensor:
    """Eq. 15: clip(sg(log pi_teacher - log pi_student), -r_max, r_max), per token. No gradient flows through it."""
    if not r_max > 0:
        raise ValueError(f"r_max must be positive, got {r_max!r}")
    return (teacher_logp.detach() - student_logp.detach()).clamp(-r_max, r_max)


@dataclass
class OPDTerms:
    """A (micro-)batch's loss and its statistics, as device tensors (read back once by the caller)."""
    loss: torch.Tensor  # -(1/N) sum rho_t r_t over the masked tokens (N: the given normalizer)
    reward_sum: torch.Tensor  # [B] per row: sum of r_t
    log_ratio_sum: torch.Tensor  # [B] per row: sum of log pi_student - log pi_teacher (unclipped: reverse KL)
    tokens: torch.Tensor  # [B] per row: response tokens
    clipped: torch.Tensor  # scalar: tokens whose log-ratio was clipped
    max_ratio: torch.Tensor  # scalar: largest importance ratio rho_t


def opd_pg_loss(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, r_max: float,
                behaviour_logp: torch.Tensor | None = None, normalizer: float | torch.Tensor | None = None) -> OPDTerms:
    """The importance-sampled policy-gradient loss of eq. 15's reward. All [B, T]: `student_logp` log pi_theta of
    the sampled tokens (with gradient), `teacher_logp`, `behaviour_logp` (None: the samples are the current
    policy's, rho_t = exp(logp - sg(logp)) = 1), `mask` True at response tokens. `normalizer`: N of the loss (None:
    the mask's token count; a micro-batch passes its step's count)."""
    mask = mask.bool()
    m = mask.to(student_logp.dtype)
    r = opd_reward(teacher_logp, student_logp, r_max) * m
    ref = student_logp.detach() if behaviour_logp is None else behaviour_logp.detach()
    log_rho = torch.where(mask, student_logp - ref, torch.zeros_like(student_logp))
    rho = torch.exp(log_rho)
    n = m.sum() if normalizer is None else normalizer
    if not torch.is_tensor(n):
        n = torch.tensor(float(n), dtype=student_logp.dtype, device=student_logp.device)
    loss = -(rho * r).sum() / n.clamp_min(1)
    raw = (teacher_logp.detach() - student_logp.detach())
    return OPDTerms(loss=loss, reward_sum=r.sum(-1).detach(), log_ratio_sum=(-raw * m).sum(-1),
                    tokens=m.sum(-1), clipped=((raw.abs() > r_max) & mask).sum(),
                    max_ratio=(rho.detach() * m).amax() if mask.any() else torch.ones((), device=rho.device))


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, <t]) from logits [B, T, V] of a forward over ids [B, T]: [B, T], 0 at t = 0
    (nothing predicts the first token). Computed in fp32 (fp64 logits stay fp64)."""
    x = logits[:, :-1]
    lp = torch.log_softmax(x if x.dtype == torch.float64 else x.float(), -1)
    lp = lp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)


# --- teacher tags -------------------------------------------------------------------------------------------------

def parse_teacher_spec(spec: str) -> tuple[str, str | None, str]:
    """`DOMAIN=CK` or `DOMAIN/EFFORT=CK` -> (domain, effort or None, checkpoint)."""
    if "=" not in spec:
        raise ValueError(f"--teacher {spec!r}: expected TAG=CHECKPOINT with TAG = DOMAIN or DOMAIN/EFFORT "
                         "(e.g. code=runs/code_sft or code/high=runs/code_high)")
    tag, ck = spec.split("=", 1)
    if not TAG_RE.match(tag):
        raise ValueError(f"--teacher {spec!r}: tag {tag!r} is invalid: use DOMAIN or DOMAIN/EFFORT, each of letters, "
                         "digits, '_', '-' or '.'")
    if not ck:
        raise ValueError(f"--teacher {spec!r}: the checkpoint path is empty")
    domain, _, effort = tag.partition("/")
    return domain, effort or None, ck


class TeacherTable:
    """Which teacher scores which prompt: the exact (domain, effort) tag first, then the domain's (any effort)."""

    def __init__(self, specs: list[str]):
        if not specs:
            raise ValueError("--teacher: give at least one TAG=CHECKPOINT")
        self.tags: dict[tuple[str, str | None], str] = {}
        for s in specs:
            d, e, ck = parse_teacher_spec(s)
            if (d, e) in self.tags:
                raise ValueError(f"--teacher {s!r}: tag {_tag(d, e)!r} is given twice "
                                 f"(first for {self.tags[(d, e)]})")
            self.tags[(d, e)] = ck

    def tag_for(self, domain: str, effort: str | None) -> tuple[str, str | None] | None:
        """The tag whose teacher scores a prompt of (domain, effort), or None when no teacher does."""
        if effort is not None and (domain, effort) in self.tags:
            return domain, effort
        return (domain, None) if (domain, None) in self.tags else None

    def describe(self) -> str:
        return ", ".join(_tag(d, e) for d, e in self.tags)


def _tag(domain: str, effort: str | None) -> str:
    return domain if effort is None else f"{domain}/{effort}"


# --- the prompt file ----------------------------------------------------------------------------------------------

@dataclass
class Prompt:
    where: str  # FILE:LINE
    domain: str
    effort: str | None
    messages: list[dict] | None = None
    text: str | None = None


def check_prompt_record(rec) -> Prompt:
    """One prompt record, or ValueError naming the field that is wrong (`where` is filled in by the reader)."""
    from k3.serve.chat import ROLES, message_text, render_chat_segments

    if not isinstance(rec, dict):
        raise ValueError(f"a record must be a JSON object, got a JSON {type(rec).__name__}")
    dom = rec.get("domain")
    if not isinstance(dom, str) or not dom:
        raise ValueError(f"field 'domain' = {dom!r} is invalid: every prompt needs a domain tag (a non-empty string) "
                         "that picks its teacher")
    eff = rec.get("effort")
    if eff is not None and (not isinstance(eff, str) or not eff):
        raise ValueError(f"field 'effort' = {eff!r} is invalid: a non-empty string or absent")
    if ("messages" in rec) == ("prompt" in rec):
        raise ValueError("give exactly one of 'messages' (a chat) or 'prompt' (raw text)")
    if "prompt" in rec:
        if not isinstance(rec["prompt"], str) or not rec["prompt"]:
            raise ValueError(f"field 'prompt' must be a non-empty string, got {rec['prompt']!r:.60}")
        return Prompt("", dom, eff, text=rec["prompt"])
    msgs = rec["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise ValueError("field 'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES or "content" not in m:
            raise ValueError(f"field 'messages[{i}]' must be an object with a 'role' (one of {list(ROLES)}) and "
                             "'content'")
        if not (m["content"] is None and m["role"] == "assistant"):
            message_text(m["content"], i)
    if msgs[-1]["role"] == "assistant":
        msgs = msgs[:-1]  # the reference reply: the student writes its own
    if not msgs:
        raise ValueError("field 'messages' holds only an assistant message: there is no prompt")
    render_chat_segments(msgs)  # tool calls and results: a ValueError names the field
    return Prompt("", dom, eff, messages=msgs)


def read_prompts(paths: list[str], table: TeacherTable | None = None) -> list[Prompt]:
    """Every record of the prompt files, checked (and, with `table`, each matched to a teacher) before any work."""
    out = []
    for path in paths:
        try:
            f = open(path, encoding="utf-8")
        except OSError as e:
            raise PromptError(f"--prompts {path}: cannot be read ({e.strerror})") from None
        with f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{n}"
                try:
                    p = check_prompt_record(json.loads(line))
                except json.JSONDecodeError as e:
                    raise PromptError(f"{where}: not valid JSON ({e.msg})") from None
                except ValueError as e:
                    raise PromptError(f"{where}: {e}") from None
                p.where = where
                if table is not None and table.tag_for(p.domain, p.effort) is None:
                    raise PromptError(f"{where}: no teacher for domain {p.domain!r}"
                                      f"{'' if p.effort is None else f' effort {p.effort!r}'}; the teachers' tags "
                                      f"are {table.describe()} (add --teacher {p.domain}=CK)")
                out.append(p)
    if not out:
        raise PromptError(f"--prompts {' '.join(paths)}: no prompt records")
    return out


def encode_prompt(p: Prompt, tok, template) -> list[int]:
    """The prompt's token ids, as `k3 serve` would build them (the chat markup as the tokenizer's special ids)."""
    from k3.serve.chat import render_chat_ids

    return tok.encode(p.text) if p.text is not None else render_chat_ids(p.messages, tok, template)
