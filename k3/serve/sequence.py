"""One request's life: tokens, sampling parameters, status, timing and its incremental detokenization."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from k3.serve.cache.prefix import MediaSpan
from k3.serve.sampling import SamplingParams

_ids = itertools.count()


@dataclass(frozen=True)
class PromptImage:
    """An image of a prompt: the encoder's input `pixel_values` [3, H, W] (k3.data.images.load_pixels), its
    placeholder run prompt_ids[start:start + length] (length = VisionConfig.num_image_tokens(H, W)), and `digest`,
    the hash of its content that the prefix cache keys its blocks on (k3.serve.images.image_digest)."""

    pixel_values: torch.Tensor
    start: int
    length: int
    digest: bytes

    @property
    def end(self) -> int:
        return self.start + self.length


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] = field(default_factory=list)
    # With params.prompt_logprobs: one entry per prompt token scored so far, None for the first (nothing predicts
    # it), then {"token", "logprob", "top": [(id, logprob), ...]} as for generated tokens.
    prompt_logprobs: list[dict | None] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV / state are in the cache
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    finish_reason: str | None = None
    text: str = ""  # detokenized output (stop strings cut off)
    # (n, decode(output_ids[:n])) for the longest n seen that ends on a whole character: the postprocessor decodes
    # only the tokens after it (k3.serve.postprocess, byte-level tokenizers)
    decoded: tuple[int, str] = (0, "")
    arrival: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None
    preemptions: int = 0
    generator: torch.Generator | None = None
    images: list[PromptImage] = field(default_factory=list)  # in prompt order, their runs disjoint
    # The encoder's output of each image still to prefill ([length, D] each; None: not encoded, or done with),
    # computed at the first prefill chunk that needs one and sliced by the chunks (k3.serve.engine)
    image_embeds: list | None = None

    @property
    def media(self) -> tuple[MediaSpan, ...]:
        """The prompt's images as the prefix cache salts its block hashes with them."""
        return tuple(MediaSpan(im.start, im.end, im.digest) for im in self.images)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_range(self, start: int, end: int) -> list[int]:
        """tokens[start:end] without building the whole list (a decode step needs only the last token)."""
        P = len(self.prompt_ids)
        if end <= P:
            return self.prompt_ids[start:end]
        if start >= P:
            return self.output_ids[start - P:end - P]
        return self.prompt_ids[start:] + self.output_ids[:end - P]

    def token_view(self, end: int) -> "TokenView":
        """tokens[:end] without a copy (its length and slices), for readers that look at a few new blocks."""
        return TokenView(self, end)

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs are asked for and not all computed yet: its prompt must be run, not served from cache."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def pending(self) -> int:
        """Tokens to feed before the next token can be sampled: the prompt (in chunks) at first, then the last
        sampled token (one decode step). After a preemption, the prompt and earlier outputs again."""
        return len(self.prompt_ids) + len(self.output_ids) - self.num_computed

    def __hash__(self) -> int:
        return hash(self.request_id)


class TokenView:
    """The first `end` tokens of a Sequence, read in place: len() and indexing/slicing, no list built."""

    __slots__ = ("seq", "end")

    def __init__(self, seq: Sequence, end: int):
        if not 0 <= end <= seq.num_tokens:
            raise ValueError(f"end={end} is outside [0, {seq.num_tokens}]")
        self.seq, self.end = seq, end

    def __len__(self) -> int:
        return self.end

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(self.end)
            if step != 1:
                return self.seq.token_range(0, self.end)[i]
            return self.seq.token_range(a, max(a, b))
        if i < 0:
            i += self.end
        if not 0 <= i < self.end:
            raise IndexError(f"token index {i} out of range for {self.end} tokens")
        P = len(self.seq.prompt_ids)
        return self.seq.prompt_ids[i] if i < P else self.seq.output_ids[i - P]
