"""Chat segments to token ids, and the stops of an assistant message (k3.serve.chat: escaping).

A tokenizer made by k3.data.tokenizer holds the four markers as special tokens; `encode_segments` gives the
markers those ids and encodes each text run on its own as ordinary text (special-token text inside a message stays
bytes). An older tokenizer without them gets the markers as text, each encoded on its own, so the tokens split at
the same places either way.
"""

from __future__ import annotations

import re

from k3.serve.chat_render import Segment, render_chat_segments
from k3.serve.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate


def markup_ids(tokenizer, template: ChatTemplate | None = None) -> dict[str, int] | None:
    """{marker: special token id} when the tokenizer has all four markers as special tokens, else None (an older
    tokenizer: markers are then encoded as text)."""
    t = template or DEFAULT_CHAT_TEMPLATE
    get = getattr(tokenizer, "special_token_id", None)
    if get is None:
        return None
    ids = {m: get(m) for m in t.markers}
    return ids if all(v is not None for v in ids.values()) else None


def segment_units(segments, ids: dict[str, int] | None) -> list[int | str]:
    """The segments as encoding units: a marker's special id (with `ids`), else a text to encode on its own (text
    runs are joined up to the next marker; a marker without an id is a text of its own)."""
    units: list[int | str] = []
    run: list[str] = []
    for s in segments:
        if not s.special:
            run.append(s.text)
            continue
        if run:
            units.append("".join(run))
            run = []
        units.append(ids[s.text] if ids is not None else s.text)
    if run:
        units.append("".join(run))
    return units


def encode_segments(tokenizer, segments, template: ChatTemplate | None = None) -> list[int]:
    """Token ids of `segments`: markers as special ids (when the tokenizer has them), each text run encoded on its
    own as ordinary text (the tokenizer never matches special tokens inside text)."""
    out: list[int] = []
    for u in segment_units(segments, markup_ids(tokenizer, template)):
        if isinstance(u, int):
            out.append(u)
        else:
            out.extend(tokenizer.encode(u))
    return out


def render_chat_ids(messages, tokenizer, template: ChatTemplate | None = None, add_generation_prompt: bool = True,
                    **options) -> list[int]:
    """The prompt token ids of a chat request (`options`: tools, tool_choice, response_format, reasoning_effort,
    thinking; see render_chat_segments)."""
    return encode_segments(tokenizer, render_chat_segments(messages, template, add_generation_prompt, **options),
                           template)


def chat_stop(tokenizer, template: ChatTemplate | None = None) -> tuple[list[str], list[int]]:
    """(stop strings, stop token ids) that end an assistant message: the end-of-message id when the tokenizer has
    the markup as special tokens (no stop string then: a message may write the text "[end_of_msg]"), else the
    end-of-message string."""
    t = template or DEFAULT_CHAT_TEMPLATE
    ids = markup_ids(tokenizer, t)
    if ids is not None:
        return [], [ids[t.end_of_message]]
    return [t.end_of_message], []


def stop_strings(template: ChatTemplate | None = None) -> list[str]:
    """The stop strings of a plain instruct-mode reply (ChatTemplate.stop), for a tokenizer without the markup."""
    return list((template or DEFAULT_CHAT_TEMPLATE).stop)


def split_markup(text: str, template: ChatTemplate | None = None) -> list[Segment]:
    """A rendering's text cut back into segments, every occurrence of a marker string taken as the marker (exact
    only when no message text contains a marker string; segments from the renderer or token ids are exact)."""
    t = template or DEFAULT_CHAT_TEMPLATE
    pat = re.compile("|".join(re.escape(m) for m in sorted(t.markers, key=len, reverse=True)))
    out, at = [], 0
    for mt in pat.finditer(text):
        if mt.start() > at:
            out.append(Segment(text[at:mt.start()], False))
        out.append(Segment(mt.group(), True))
        at = mt.end()
    if at < len(text):
        out.append(Segment(text[at:], False))
    return out
