"""A training run's checkpoints: `OUT/checkpoints/step-NNNNNNN/` holds the model in the official layout plus
`trainer_state.safetensors` + `trainer_state.json` (the trainer state as k3.train.state stores it: optimizer,
balancing state, data position, RNG) and the tokenizer; `latest.json` names the newest, and only the newest
`keep` stay.

The directory is written by k3.checkpoint.save_pretrained (or the run's own writer of its module, e.g. the EAGLE-3
draft's, through k3.checkpoint.write_checkpoint_dir) as `step-N.partial/`, every file and the directory fsynced,
then renamed into place: a crash never leaves a half-written `step-N`. Which checkpoints are complete,
retention, and the clean-up after a crash are k3.run_dir's.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from k3.checkpoint import load_state_into, save_pretrained
from k3.run_dir import prune
from k3.files import atomic_write_text

TRAINER_STATE_FILES = ("trainer_state.safetensors", "trainer_state.json")


def checkpoint_name(step: int) -> str:
    return f"step-{step:07d}"


def checkpoint_path(out: str, step: int) -> str:
    """Where the run in `out` keeps its checkpoint of `step`."""
    return os.path.join(out, "checkpoints", checkpoint_name(step))


def save_checkpoint(model, out: str, step: int, trainer_state: tuple, tokenizer_json: bytes | None,
                    keep: int, log=print, extra_files: dict[str, bytes] | None = None,
                    save_model: Callable[..., None] = save_pretrained) -> str:
    """Write the checkpoint of `step` (the model, `trainer_state` as k3.train.state.dumps or dump_parts gives it, the
    tokenizer, `extra_files` such as the chat template), then `latest.json`, then prune to the `keep` newest.
    `save_model(model, path, extra_files=...)` writes the directory atomically with the model's files, config.json
    and an index among them (default: the official layout). Returns its path."""
    ckdir = os.path.join(out, "checkpoints")
    name = checkpoint_name(step)
    path = os.path.join(ckdir, name)
    extra = dict(extra_files or {})
    extra.update(zip(TRAINER_STATE_FILES, trainer_state))
    if tokenizer_json is not None:
        extra["tokenizer.json"] = tokenizer_json
    save_model(model, path, extra_files=extra)
    atomic_write_text(os.path.join(ckdir, "latest.json"), json.dumps({"checkpoint": name, "step": step}))
    prune(ckdir, name, keep, log=log)
    return path


def load_checkpoint(model, ckpt_dir: str, verify: bool = True,
                    load_model: Callable[..., None] = load_state_into) -> tuple[str, bytes]:
    """Load the checkpoint's weights into `model` (`load_model(model, ckpt_dir, verify=...)`, default: the official
    layout; `verify`: check the shards' SHA-256 digests) and return its trainer state as k3.train.state.loads takes
    it: (the path of its tensors' safetensors file, its JSON bytes)."""
    load_model(model, ckpt_dir, verify=verify)
    tensors, doc = (os.path.join(ckpt_dir, f) for f in TRAINER_STATE_FILES)
    if not os.path.isfile(tensors):
        raise FileNotFoundError(f"{tensors} is missing: the checkpoint is incomplete")
    with open(doc, "rb") as f:
        return tensors, f.read()
