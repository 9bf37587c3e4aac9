"""The EAGLE-3 draft's files (`k3 train-draft` writes them, `k3 serve --speculative eagle3` reads them).

A draft directory (default `CK/draft/` beside its target checkpoint CK) holds:

* `model.safetensors`: the draft's own parameters only, fp32, under the target's internal names of its MTP layer,
  `mtp.0.*` (`mtp.0.enorm.weight`, `mtp.0.eh_proj.weight`, `mtp.0.block.self_attn.q_a_proj.weight`, the routed
  experts stacked as `mtp.0.block.block_sparse_moe.experts.w1` [E, ., .] ...), and W_E3 as `eagle3.fc.weight`
  [D, (n + 1) D]. The embedding, final norm and output head are the target's and are not stored.
* `config.json`: {"format": "k3-eagle3-draft", "version": 1, "blocks": the fused AttnRes blocks, "hidden_size",
  "target": {"path": the target checkpoint as given, "config_digest": SHA-256 of its architecture (the config
  without dtype and quantization, so that a draft trained on the fp32 target also serves its MXFP4 export)},
  "train": {"loss", "steps", "qat", "ttt_steps", ...}}.
* `metrics.jsonl`: the training log (one JSON object per logged step), `loss.png` its loss curve.

Both weight and config files are written atomically, the config last: a directory with a config.json is complete.

While a run is unfinished (stopped by a signal, or killed), `checkpoints/step-N/` beside them hold its training
checkpoints (k3.train.checkpointing; `k3 train-draft --resume` continues from the newest, and a finished run
removes them): the same config.json, the same tensors written as an indexed shard with its SHA-256
(k3.checkpoint.write_checkpoint_dir), and the trainer state.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
from safetensors.torch import load_file, save

from k3.files import atomic_write_bytes, atomic_write_text, read_json_file

FORMAT, VERSION = "k3-eagle3-draft", 1
FC_NAME = "eagle3.fc.weight"
MTP_PREFIX = "mtp.0."
_NOT_ARCHITECTURE = ("torch_dtype", "dtype", "quantization_config")


class DraftError(ValueError):
    """A draft directory is missing, broken or belongs to another target; the message names what is wrong."""


def target_digest(cfg) -> str:
    """SHA-256 of the target's architecture: its config without dtype and quantization."""
    d = {k: v for k, v in cfg.to_dict().items() if k not in _NOT_ARCHITECTURE}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode("utf-8")).hexdigest()


def draft_state_dict(draft) -> dict[str, torch.Tensor]:
    out = {MTP_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in draft.mtp.state_dict().items()}
    out[FC_NAME] = draft.fc.weight.detach().float().contiguous().cpu()
    return out


def draft_config(draft, target_path: str, train_info: dict | None = None) -> dict:
    """The draft's config.json."""
    return {"format": FORMAT, "version": VERSION, "blocks": list(draft.blocks), "hidden_size": draft.config.hidden_size,
            "target": {"path": target_path, "config_digest": target_digest(draft.config)}, "train": train_info or {}}


def save_draft(draft, path: str, target_path: str, train_info: dict | None = None) -> str:
    """Write `draft` (k3.model.eagle3.Eagle3Layer) to directory `path` (created if needed)."""
    os.makedirs(path, exist_ok=True)
    atomic_write_bytes(os.path.join(path, "model.safetensors"), save(draft_state_dict(draft)))
    cfg = draft_config(draft, target_path, train_info)
    atomic_write_text(os.path.join(path, "config.json"), json.dumps(cfg, indent=1) + "\n")
    return path


def save_draft_checkpoint(draft, path: str, target_path: str, train_info: dict | None = None,
                          extra_files: dict | None = None) -> None:
    """A training checkpoint of `draft` as directory `path`, written atomically with `extra_files` (the trainer
    state): its config.json and its tensors as one indexed shard (k3.checkpoint.write_checkpoint_dir)."""
    from k3.checkpoint import write_checkpoint_dir

    write_checkpoint_dir(path, draft_state_dict(draft).items(), draft_config(draft, target_path, train_info),
                         extra_files=extra_files)


def load_draft_checkpoint(draft, path: str, verify: bool = True) -> None:
    """Fill `draft` from the training checkpoint `path` (`save_draft_checkpoint`), which must be of a draft of the
    same layout for the same target architecture; `verify`: check the shard's SHA-256."""
    from k3.checkpoint import CheckpointError, read_checkpoint_tensors

    cfg = read_draft_config(path)
    _check_target(cfg, path, draft.config)
    if list(cfg["blocks"]) != list(draft.blocks):
        raise DraftError(f"{path} is a draft of AttnRes blocks {cfg['blocks']}, this run's fuses {list(draft.blocks)}")
    try:
        sd = read_checkpoint_tensors(path, verify=verify)
    except CheckpointError as e:
        raise DraftError(str(e)) from None
    _fill(draft, sd, path)


def read_draft_config(path: str) -> dict:
    cp = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        raise DraftError(f"draft directory {path} does not exist (train one with `k3 train-draft --ckpt CK --out "
                         f"{path}`)")
    if not os.path.isfile(cp):
        raise DraftError(f"{path} holds no config.json: not a (finished) EAGLE-3 draft")
    cfg = read_json_file(cp, DraftError)
    if not isinstance(cfg, dict) or cfg.get("format") != FORMAT:
        raise DraftError(f"{cp}: format is {cfg.get('format') if isinstance(cfg, dict) else cfg!r}, expected "
                         f"{FORMAT!r}")
    if cfg.get("version") != VERSION:
        raise DraftError(f"{cp}: version {cfg.get('version')!r} is not supported (this k3 reads version {VERSION})")
    blocks = cfg.get("blocks")
    if not isinstance(blocks, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in blocks):
        raise DraftError(f"{cp}: blocks must be a list of AttnRes block numbers, got {blocks!r}")
    return cfg


def load_draft(path: str, target):
    """The draft in directory `path` for `target` (a K3ForCausalLM), on the target's device and dtype. Refuses a
    draft trained for a target of another architecture, naming both."""
    from k3.model.eagle3 import Eagle3Layer

    cfg = read_draft_config(path)
    _check_target(cfg, path, target.config)
    try:
        draft = Eagle3Layer(target.config, tuple(cfg["blocks"]))
    except ValueError as e:
        raise DraftError(f"{path}/config.json: {e}") from None
    wp = os.path.join(path, "model.safetensors")
    if not os.path.isfile(wp):
        raise DraftError(f"{path} holds no model.safetensors")
    try:
        sd = load_file(wp)
    except Exception as e:  # a torn or foreign file: one line, not a traceback
        raise DraftError(f"{wp} is not a readable safetensors file ({type(e).__name__}: {e})") from None
    _fill(draft, sd, wp)
    from k3.model.common import set_backends
    from k3.model.mx_experts import expert_formats, quantize_experts

    p = next(target.parameters())
    draft = draft.to(device=p.device, dtype=p.dtype)
    fmt = expert_formats(target)
    if fmt != (None, None):  # the experts compute as the target's do (an MXFP4 deployment: as QAT trained them)
        quantize_experts(draft, *fmt)
    return set_backends(draft, target.backends).eval()


def _check_target(cfg: dict, path: str, target_config) -> None:
    """Refuse a draft (its config.json `cfg`) trained for a target of another architecture, naming both."""
    want = target_digest(target_config)
    got = (cfg.get("target") or {}).get("config_digest")
    if got != want:
        raise DraftError(f"the draft in {path} was trained for another target ({(cfg.get('target') or {}).get('path')}"
                         f", architecture digest {str(got)[:12]}), not this one (digest {want[:12]}: "
                         f"{target_config.num_hidden_layers} layers, hidden {target_config.hidden_size}, vocabulary "
                         f"{target_config.vocab_size})")


def _fill(draft, sd: dict[str, torch.Tensor], where: str) -> None:
    """Copy the draft's tensors `sd` (as `draft_state_dict` names them; read from `where`) into `draft`, checking
    the layout and every shape."""
    want_sd = draft_state_dict(draft)
    missing, extra = sorted(set(want_sd) - set(sd)), sorted(set(sd) - set(want_sd))
    if missing or extra:
        raise DraftError(f"{where} does not match the draft layout: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, v in want_sd.items():
        if sd[k].shape != v.shape:
            raise DraftError(f"{where}: {k} has shape {tuple(sd[k].shape)}, the draft needs {tuple(v.shape)}")
    draft.mtp.load_state_dict({k[len(MTP_PREFIX):]: v for k, v in sd.items() if k.startswith(MTP_PREFIX)})
    with torch.no_grad():
        draft.fc.weight.copy_(sd[FC_NAME])
