"""Tokenizers: a byte-level fallback (no training needed) and byte-level BPE via the `tokenizers` library.

`K3Tokenizer` wraps a `tokenizers.Tokenizer` so callers need not care where it came from: a
`tokenizer.json`, a BPE trained here (`train_bpe`), or a tiktoken rank file converted to byte-level BPE
(`load_any_tokenizer`). Every tokenizer made here is byte-level, so any string round-trips:
``tok.decode(tok.encode(s)) == s``. The text "<|endoftext|>" inside a document is encoded as ordinary
text, never as the end-of-text id, so documents cannot forge a document boundary.

The chat template's four markers (`CHAT_MARKUP`: [open], [sep], [close], [end_of_msg]; k3.serve.chat) are
reserved special tokens of every tokenizer made here, placed right after the learned vocabulary (bytes and
merges) and before any "<|reserved_N|>" padding: ids 257..260 in the byte-level tokenizer. Like the end-of-text
token, their text inside a document is encoded as ordinary bytes; only the chat renderer puts their ids in, and
each decodes to its text as one id. A tokenizer without them (an older checkpoint's) still serves chats, with the
markup as plain text.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from typing import Callable, Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from k3.files import atomic_write_text

EOS = "<|endoftext|>"
CHAT_MARKUP = ("[open]", "[sep]", "[close]", "[end_of_msg]")  # the chat template's markers (k3.serve.chat)

# Pre-tokenizer split in the style of cl100k: contractions, letters with one leading non-letter, digits
# in groups of up to three, punctuation runs (with trailing newlines), newline runs, other whitespace
# (leaving a single space to attach to the next word).
DEFAULT_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

DEFAULT_MAX_TRAIN_BYTES = 8_000_000


def byte_level_tokenizer(vocab_size: int | None = None) -> Tokenizer:
    """Id 0 is the end-of-text token; ids 1..256 are the 256 bytes; ids 257..260 the chat markup (CHAT_MARKUP).
    Every string round-trips.

    With `vocab_size` (> 261), the ids 261.. are filled with reserved special tokens "<|reserved_N|>" (never
    produced by encoding), so that a model with that vocabulary has a text for every id it can emit."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {EOS: 0}
    for i, ch in enumerate(sorted(alphabet)):
        vocab[ch] = i + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    tok.add_special_tokens(list(CHAT_MARKUP))
    if vocab_size is not None:
        _pad_reserved(tok, vocab_size)
    return tok


def _pad_reserved(tok: Tokenizer, vocab_size: int) -> None:
    """Fill the ids up to `vocab_size` with unused special tokens "<|reserved_N|>"."""
    have = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size < have:
        raise ValueError(f"vocab_size must be at least {have} for this tokenizer, got {vocab_size}")
    if vocab_size > have:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(vocab_size - have)])


def read_tokenizer_json(path: str) -> Tokenizer:
    """`Tokenizer.from_file`, with a damaged file (truncated, not JSON, not a tokenizer) a ValueError naming it:
    the `tokenizers` library raises a bare Exception that names neither the file nor what is wrong with it."""
    try:
        return Tokenizer.from_file(path)
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 (the library's only error type for a bad file)
        raise ValueError(f"{path} is not a readable tokenizer ({e}): the file is truncated or corrupt") from None


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Load `tokenizer.json` from a file or a checkpoint directory."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    return read_tokenizer_json(path)


def bytes_to_unicode() -> dict[int, str]:
    """The byte-level alphabet: each byte maps to one printable character.

    Printable Latin-1 bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68 bytes
    (controls, space, DEL, NBSP, soft hyphen) map, in byte order, to the characters from U+0100 on.
    This is the mapping of the `tokenizers` ByteLevel pre-tokenizer and decoder.
    """
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def _byte_level_pre_tokenizer(pattern: str):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


class K3Tokenizer:
    """A byte-level tokenizer with an end-of-text id, whatever format it was loaded from."""

    def __init__(self, tokenizer: Tokenizer, eos_token: str = EOS):
        self.tokenizer = tokenizer
        # Special-token text inside documents is tokenized as plain text (see the module docstring).
        tokenizer.encode_special_tokens = True
        eos_id = tokenizer.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"tokenizer has no end-of-text token {eos_token!r}")
        self.eos_token = eos_token
        self.eos_id: int = eos_id
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0  # ids may have gaps
        self._special = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    # -------------------------------------------------------------------------------- construction
    @classmethod
    def byte_level(cls) -> "K3Tokenizer":
        return cls(byte_level_tokenizer())

    @classmethod
    def from_str(cls, json_str: str) -> "K3Tokenizer":
        return cls(Tokenizer.from_str(json_str))

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> "K3Tokenizer":
        path = os.fspath(path)
        try:
            return cls(load_tokenizer(path))
        except ValueError as e:  # no end-of-text token: name the file
            raise ValueError(str(e) if path in str(e) else f"{path}: {e}") from None

    # ------------------------------------------------------------------------------------ encoding
    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts at once with the (parallel) Rust batch encoder."""
        texts = list(texts)
        fast = getattr(self.tokenizer, "encode_batch_fast", None)  # no offsets: faster where available
        encodings = (fast or self.tokenizer.encode_batch)(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def special_token_id(self, token: str) -> int | None:
        """The id of `token` when it is a special token (never produced by `encode`), else None. A BPE may have
        learned the same text as an ordinary merge: that id is not special and is not returned."""
        return self._special.get(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tokenizer.id_to_token(i)

    def __len__(self) -> int:
        return self.vocab_size

    # ------------------------------------------------------------------------------ serialization
    def to_str(self) -> str:
        return self.tokenizer.to_str()

    def fingerprint(self) -> str:
        """A hex digest that changes whenever the tokenizer's behaviour can."""
        return hashlib.sha256(self.to_str().encode("utf-8")).hexdigest()

    def save(self, path: str | os.PathLike) -> str:
        """Write tokenizer.json atomically (temp file + os.replace). `path` is a directory (created if
        needed; the file is `path/tokenizer.json`) or a file path ending in .json. Returns the file path."""
        path = os.fspath(path)
        if os.path.isdir(path) or not path.endswith(".json"):
            os.makedirs(path, exist_ok=True)
            path = os.path.join(path, "tokenizer.json")
        atomic_write_text(path, self.to_str())
        return path

    def __repr__(self) -> str:
        return f"K3Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


# ------------------------------------------------------------------------------------ BPE training


def _limit_text(texts: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """The texts in order, stopping after `max_bytes` UTF-8 bytes (the last one cut to fit)."""
    left = max_bytes
    for t in texts:
        if left is None:
            yield t
            continue
        if left <= 0:
            return
        data = t.encode("utf-8", errors="replace")
        if len(data) > left:
            yield data[:left].decode("utf-8", errors="ignore")
            return
        left -= len(data)
        yield t


def train_bpe(texts: Iterable[str], vocab_size: int, *, max_train_bytes: int | None = DEFAULT_MAX_TRAIN_BYTES,
              min_frequency: int = 2, pattern: str = DEFAULT_SPLIT_PATTERN, pad_to_vocab_size: bool = True,
              show_progress: bool = False) -> K3Tokenizer:
    """Train a byte-level BPE with the `tokenizers` library; "<|endoftext|>" is id 0 (eos).

    Text is split with `pattern` (cl100k-style by default), mapped to the 256-character byte-level
    alphabet (all 256 bytes are in the vocabulary, ids 1..256, so every string round-trips), and merged
    by `trainers.BpeTrainer`. Only the first `max_train_bytes` bytes of `texts` (default 8 MB; None: all)
    are read, which keeps training to seconds on two cores. Deterministic for the same input.

    The chat markup (CHAT_MARKUP) follows the merges, so the merges fill `vocab_size` - 4 ids. If the text
    runs out of pairs occurring `min_frequency` times before that, the vocabulary is padded with unused special
    tokens "<|reserved_N|>" after the markup (when `pad_to_vocab_size`), so `vocab_size` is always exactly the
    size asked for.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    least = len(alphabet) + 1 + len(CHAT_MARKUP)
    if vocab_size < least:
        raise ValueError(f"vocab_size must be at least {least} (eos + 256 bytes + {len(CHAT_MARKUP)} chat markup "
                         f"tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pattern)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_MARKUP),
        min_frequency=min_frequency,
        show_progress=show_progress,
        special_tokens=[EOS],
        initial_alphabet=sorted(alphabet),
    )
    tok.train_from_iterator(_limit_text(texts, max_train_bytes), trainer=trainer)
    tok.add_special_tokens(list(CHAT_MARKUP))
    if pad_to_vocab_size:
        _pad_reserved(tok, vocab_size)
    out = K3Tokenizer(tok)
    assert out.eos_id == 0, out.eos_id
    return out


TOKENIZER_SOURCE = "tokenizer.source.json"  # beside a run's tokenizer.json: what it was trained on (cached_tokenizer)


def cached_tokenizer(run_dir: str | os.PathLike, texts_fn: Callable[[], Iterable[str]], vocab_size: int,
                     data_fingerprint: str | None = None, log: Callable[[str], object] | None = None,
                     **train_kwargs) -> K3Tokenizer:
    """`run_dir/tokenizer.json` when it was trained here for the same request: `vocab_size` ids, and the data
    fingerprint and training options recorded beside it (`TOKENIZER_SOURCE`) equal to these. Otherwise train a BPE
    on `texts_fn()` (called only then), save it there atomically with that record, and return it; a tokenizer that
    was there is replaced, and `log` says why (a run that failed after training its tokenizer leaves it in --out,
    and another run in the same --out must not take it for its own). `data_fingerprint`: a digest of the training
    data's sources (k3.data.shards.source_fingerprint)."""
    import json

    run_dir = os.fspath(run_dir)
    path = os.path.join(run_dir, "tokenizer.json")
    record = {"vocab_size": vocab_size, "data": data_fingerprint,
              "train": {k: train_kwargs[k] for k in sorted(train_kwargs)}}
    if os.path.exists(path):
        why = None
        try:
            tok = K3Tokenizer.from_file(path)
        except (OSError, ValueError) as e:  # unreadable or without an eos token: replace it
            tok, why = None, f"it is unreadable ({e})"
        if tok is not None and tok.vocab_size != vocab_size:
            why = f"it has {tok.vocab_size} tokens, not {vocab_size}"
        if why is None:
            try:
                with open(os.path.join(run_dir, TOKENIZER_SOURCE), encoding="utf-8") as f:
                    saved = json.load(f)
            except (OSError, ValueError):
                saved = None
            if not isinstance(saved, dict):
                why = f"there is no record of the data it was trained on ({TOKENIZER_SOURCE})"
            elif saved.get("data") != data_fingerprint or saved.get("train") != record["train"]:
                why = "it was trained on other data"
            elif saved.get("vocab_size") != vocab_size:
                why = f"it was trained for {saved.get('vocab_size')} tokens, not {vocab_size}"
        if why is None:
            return tok
        if log is not None:
            log(f"tokenizer: {path} was not trained for this run: {why}; training a new one"
                if not why.startswith("it was trained on other data") else
                f"tokenizer: {path} was trained on other data (left by an earlier run in this directory); "
                "training a new one")
    tok = train_bpe(texts_fn(), vocab_size, **train_kwargs)
    try:  # the old record goes first: a crash between the two writes leaves no record, so no false match
        os.remove(os.path.join(run_dir, TOKENIZER_SOURCE))
    except FileNotFoundError:
        pass
    tok.save(path)
    atomic_write_text(os.path.join(run_dir, TOKENIZER_SOURCE), json.dumps(record, sort_keys=True))
    return tok


def num_merges(tok: K3Tokenizer) -> int:
    """How many BPE merges `tok` has (0: a byte-level tokenizer, every byte one token)."""
    import json

    model = json.loads(tok.to_str()).get("model") or {}
    return len(model.get("merges") or [])


# ----------------------------------------------------------------------------- tiktoken conversion


def read_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """Read a tiktoken rank file: lines "<base64 of the token's bytes> <rank>"."""
    path = os.fspath(path)
    ranks: dict[bytes, int] = {}
    seen: set[int] = set()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError("expected '<base64 token> <rank>'")
                token = base64.b64decode(parts[0], validate=True)
                rank = int(parts[1])
                if rank < 0 or not token:
                    raise ValueError("empty token or negative rank")
            except (ValueError, binascii.Error) as e:
                raise ValueError(f"{path}:{lineno}: not a tiktoken rank line ({e})") from None
            if token in ranks or rank in seen:
                raise ValueError(f"{path}:{lineno}: duplicate token or rank {rank}")
            ranks[token] = rank
            seen.add(rank)
    if not ranks:
        raise ValueError(f"{path}: no tokens")
    return ranks


def _rank_bpe(piece: bytes, ranks: dict[bytes, int], max_rank: int) -> list[bytes]:
    """Merge `piece` byte by byte, always joining the adjacent pair whose join has the lowest rank
    below `max_rank`, until no such pair is left."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, best_i = max_rank, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < best:
                best, best_i = r, i
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """For every multi-byte token, the two tokens whose merge makes it, ordered by its rank.

    The split is the one rank-based BPE reaches on the token's own bytes using only lower ranks. A
    token that BPE cannot build that way (possible in hand-edited files) takes the split into two
    lower-ranked tokens with the smallest larger rank, or gets no merge (it is then only produced when
    a whole pre-token equals it, which the converted model does, like tiktoken, via ignore_merges).
    """
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = _rank_bpe(token, ranks, rank)
        if len(parts) != 2:
            cands = [(max(ranks[token[:i]], ranks[token[i:]]), i) for i in range(1, len(token))
                     if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank]
            if not cands:
                continue
            i = min(cands)[1]
            parts = [token[:i], token[i:]]
        merges.append((parts[0], parts[1]))
    return merges


def tiktoken_to_tokenizer(ranks: dict[bytes, int], pattern: str = DEFAULT_SPLIT_PATTERN,
                          special_tokens: dict[str, int] | None = None, eos_token: str = EOS) -> Tokenizer:
    """A `tokenizers` byte-level BPE equivalent to rank-based BPE over `ranks` after a `pattern` split.

    Token ids are the ranks. Special tokens get the given ids (above every rank; gaps are filled with
    "<|reserved_N|>"); `eos_token` is added after the largest id when `special_tokens` lacks it.
    """
    b2u = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"tiktoken ranks do not cover every byte (missing {len(missing)}, e.g. {missing[0]}); "
                         "byte-level BPE needs all 256")
    vocab = {to_str(t): r for t, r in ranks.items()}
    # Unused ranks get placeholders no text can produce (U+2400 is outside the byte-level alphabet), so
    # ids stay the ranks and ids added later do not collide with them.
    for r in sorted(set(range(max(ranks.values()) + 1)) - set(ranks.values())):
        vocab[f"\u2400unused_{r}"] = r
    merges = [(to_str(a), to_str(b)) for a, b in _merges_from_ranks(ranks)]
    model = models.BPE(vocab=vocab, merges=merges, ignore_merges=True)
    tok = Tokenizer(model)
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pattern)
    tok.decoder = decoders.ByteLevel()

    specials = dict(special_tokens or {})
    if eos_token not in specials:
        specials[eos_token] = max([*ranks.values(), *specials.values()]) + 1
    if len(set(specials.values())) != len(specials):
        raise ValueError(f"special token ids are not distinct: {specials}")
    # Added tokens take the next free id, so ids must be contiguous after the ranks: fill gaps.
    next_id = max(ranks.values()) + 1
    for name, i in sorted(specials.items(), key=lambda kv: kv[1]):
        if i < next_id:
            raise ValueError(f"special token {name!r} id {i} must be above the largest rank {next_id - 1}")
        while next_id < i:
            tok.add_special_tokens([f"<|reserved_{next_id}|>"])
            next_id += 1
        tok.add_special_tokens([name])
        if tok.token_to_id(name) != i:
            raise ValueError(f"could not place special token {name!r} at id {i}")
        next_id += 1
    return tok


def _is_tokenizer_json(path: str) -> bool:
    if path.endswith(".json"):
        return True
    with open(path, "rb") as f:
        head = f.read(64).lstrip()
    return head.startswith(b"{")


def load_any_tokenizer(path: str | os.PathLike, *, pattern: str = DEFAULT_SPLIT_PATTERN,
                       special_tokens: dict[str, int] | None = None, eos_token: str = EOS) -> K3Tokenizer:
    """Load a tokenizer.json (a file, or a directory holding one) or a tiktoken rank file (e.g.
    tiktoken.model: lines "<base64 token bytes> <rank>"; also found in a directory as tiktoken.model
    or a single *.tiktoken file). A tiktoken file is converted to byte-level BPE (see
    `tiktoken_to_tokenizer`), pre-tokenized with `pattern`, with `special_tokens` and eos added."""
    path = os.fspath(path)
    if os.path.isdir(path):
        candidates = [os.path.join(path, "tokenizer.json"), os.path.join(path, "tiktoken.model")]
        candidates += sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".tiktoken"))
        found = [c for c in candidates if os.path.isfile(c)]
        if not found:
            raise FileNotFoundError(f"no tokenizer.json, tiktoken.model or *.tiktoken in {path}")
        path = found[0]
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no tokenizer at {path}")
    if _is_tokenizer_json(path):
        try:
            return K3Tokenizer(read_tokenizer_json(path), eos_token=eos_token)
        except ValueError as e:  # no end-of-text token: name the file
            raise ValueError(str(e) if path in str(e) else f"{path}: {e}") from None
    tok = tiktoken_to_tokenizer(read_tiktoken_ranks(path), pattern=pattern, special_tokens=special_tokens,
                                eos_token=eos_token)
    return K3Tokenizer(tok, eos_token=eos_token)
