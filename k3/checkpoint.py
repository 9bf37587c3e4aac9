"""Checkpoints in the official K3 layout (checkpoint-layout.md): config.json + sharded safetensors + index.

Our modules differ from the files in four places, all mapped here and nowhere else:
  - names carry the multimodal wrapper's `language_model.` prefix on disk;
  - routed experts are stacked tensors in memory, `experts.{e}.w{1,2,3}` on disk (plain `.weight`, or MXFP4
    `weight_packed` + `weight_scale` when the config says the checkpoint is quantized);
  - `A_log` is [H] in memory and zero-padded to a multiple of 128 on disk;
  - MTP layers (ours; the release ships none) are stored as `model.layers.{L + d}` like DeepSeek-V3, their
    routed experts per expert like the backbone's (checkpoints that stored them stacked still load).
Only safetensors and JSON are read; nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
from collections import defaultdict
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from k3.config import K3Config, expert_activation_format
from k3.ops.mx import mxfp4_dequantize, mxfp4_quantize
from k3.files import read_json_file, replace_dir, write_synced
from k3.tensor_files import write_safetensors

PREFIX = "language_model."
# The routed experts of a backbone layer or of an MTP layer's block (stored per expert on disk alike).
_EXPERTS = r"((?:model\.layers\.\d+|mtp\.\d+\.block)\.block_sparse_moe\.experts)"
_EXPERT = re.compile(rf"^{_EXPERTS}\.(w[123])$")
# Experts held packed in memory (k3.model.mx_experts.PackedMXExperts): [E, ...] uint8 codes and scales.
_PACKED_EXPERT = re.compile(rf"^{_EXPERTS}\.(w[123])_(packed|scale)$")
_DISK_EXPERT = re.compile(rf"^{_EXPERTS}\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_MTP = re.compile(r"^mtp\.(\d+)\.(block\.)?(.*)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
# Tensors of the release's vision encoder (stored without the language_model. prefix).
_FOREIGN = ("vision_tower.", "mm_projector.")


class CheckpointError(ValueError):
    """A checkpoint is missing, broken or does not match the config; the message names what is wrong."""


INDEX = "model.safetensors.index.json"
# Index metadata key holding {shard file: SHA-256 hex} of the shards as written (our own; the release has none).
CHECKSUM_KEY = "k3_sha256"
_HASH_BLOCK = 8 << 20  # shards are GiBs: hash them in blocks, never whole in memory


def _is_mxfp4(cfg: K3Config) -> bool:
    q = cfg.quantization_config or {}
    return q.get("format") == "mxfp4-pack-quantized"


def _a_log_padded(h: int) -> int:
    return math.ceil(h / 128) * 128


# --- name mapping --------------------------------------------------------------------------------------
def _internal_to_disk_name(name: str, num_layers: int) -> str:
    if name.startswith("vision."):
        return name[len("vision."):]  # vision_tower.* / mm_projector.*: no language_model. prefix in the release
    m = _MTP.match(name)
    if m:
        name = f"model.layers.{num_layers + int(m.group(1))}.{m.group(3)}"
    return PREFIX + name


def _disk_to_internal_name(name: str, num_layers: int, num_mtp: int, vision: bool = False) -> str | None:
    """Returns None for vision tensors when the model has no vision encoder (a text-only load)."""
    if name.startswith(_FOREIGN):
        return "vision." + name if vision else None
    if not name.startswith(PREFIX):
        return name  # reported as unexpected by the caller
    name = name[len(PREFIX):]
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= num_layers:
        d = int(m.group(1)) - num_layers
        rest = m.group(2)
        if d >= num_mtp:
            return f"<skip:{name}>"
        own = rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "output_attn_res_norm", "output_attn_res_proj")
        return f"mtp.{d}.{rest}" if own else f"mtp.{d}.block.{rest}"
    return name


def state_dict_for_disk(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (official name, tensor) in layer order, converting our in-memory layout to the file layout."""
    cfg: K3Config = model.config
    quant = _is_mxfp4(cfg)
    from k3.model.model import FP32_PARAM_SUFFIXES

    sd = model.state_dict()
    if cfg.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, t in sd.items():
        t = t.detach()
        p = _PACKED_EXPERT.match(name)
        if p:  # already MXFP4 storage: written as it is, one tensor per expert
            if not quant:
                raise CheckpointError(f"{name} is held in MXFP4 storage, but the config has no MXFP4 "
                                      "quantization_config: save a packed model with its MXFP4 config")
            base = _internal_to_disk_name(p.group(1), cfg.num_hidden_layers)
            for e in range(t.shape[0]):
                yield f"{base}.{e}.{p.group(2)}.weight_{p.group(3)}", t[e].contiguous()
            continue
        m = _EXPERT.match(name)
        if dtype is not None and t.is_floating_point() and not name.endswith(FP32_PARAM_SUFFIXES) \
                and not (m and quant):  # MXFP4 rounds the weights themselves (as QAT's forward does), not a cast
            t = t.to(dtype)
        if m:
            base = _internal_to_disk_name(m.group(1), cfg.num_hidden_layers)
            for e in range(t.shape[0]):
                w = t[e]
                if quant:
                    packed, scale = mxfp4_quantize(w.float())
                    yield f"{base}.{e}.{m.group(2)}.weight_packed", packed
                    yield f"{base}.{e}.{m.group(2)}.weight_scale", scale
                else:
                    yield f"{base}.{e}.{m.group(2)}.weight", w.contiguous()
            continue
        if name.endswith("self_attn.A_log"):
            pad = torch.zeros(_a_log_padded(t.shape[0]), dtype=torch.float32)
            pad[: t.shape[0]] = t.float()
            t = pad
        yield _internal_to_disk_name(name, cfg.num_hidden_layers), t.contiguous()


# --- saving ----------------------------------------------------------------------------------------
def save_pretrained(model: torch.nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None,
                    max_shard_bytes: int = 4 << 30,
                    extra_files: dict[str, bytes | dict[str, torch.Tensor]] | None = None) -> None:
    """Write config.json + `model-000NN-of-0000MM.safetensors` shards + index atomically (`write_checkpoint_dir`),
    the tensors in the official layout (`state_dict_for_disk`). `extra_files`: name -> bytes, or -> a dict of
    tensors written as a safetensors file."""
    # The config records the dtype the tensors are stored in (fp32 master weights save as float32).
    stored = dtype if dtype is not None else model.lm_head.weight.dtype
    cfg: K3Config = model.config
    write_checkpoint_dir(path, state_dict_for_disk(model, dtype), cfg.replace(dtype=_dtype_name(stored)).to_dict(),
                         max_shard_bytes=max_shard_bytes, extra_files=extra_files)


def write_checkpoint_dir(path: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
                         max_shard_bytes: int = 4 << 30,
                         extra_files: dict[str, bytes | dict[str, torch.Tensor]] | None = None) -> None:
    """Write `tensors` ((name, tensor) pairs, as stored) as `model-000NN-of-0000MM.safetensors` shards + index,
    `config` as config.json and `extra_files` (name -> bytes, or -> a dict of tensors written as a safetensors file)
    atomically: everything goes to a sibling temporary directory that replaces `path` only once complete. Every
    file and the directory are fsynced before the rename and the parent after it, so after a power loss `path` is
    the old checkpoint or the complete new one. The index records each shard's SHA-256 (`metadata.k3_sha256`),
    checked on load. Shards are written straight from the tensors' memory (k3.tensor_files)."""
    path = os.path.abspath(os.fspath(path))
    tmp = path + ".partial"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        # Each shard is written as soon as it is full (its tensors copied to the host one at a time), under a
        # temporary name: the final names hold the shard count, known at the end.
        written: list[tuple[str, list[str], str]] = []  # (temporary name, tensor names, SHA-256)
        shard: dict[str, torch.Tensor] = {}
        size = total = 0

        def flush() -> None:
            name = f"shard-{len(written) + 1:05d}.partial"
            written.append((name, list(shard), write_safetensors(os.path.join(tmp, name), shard,
                                                                 metadata={"format": "pt"})))
            shard.clear()

        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if shard and size + nbytes > max_shard_bytes:
                flush()
                size = 0
            shard[name] = t
            size += nbytes
            total += nbytes
        flush()
        n = len(written)
        weight_map, sums = {}, {}
        for i, (tmp_name, names, digest) in enumerate(written, start=1):
            fname = f"model-{i:05d}-of-{n:06d}.safetensors"  # the release's 5-digit/6-digit mix
            os.replace(os.path.join(tmp, tmp_name), os.path.join(tmp, fname))
            sums[fname] = digest
            weight_map.update(dict.fromkeys(names, fname))
        index = {"metadata": {"total_size": total, CHECKSUM_KEY: sums}, "weight_map": dict(sorted(weight_map.items()))}
        write_synced(os.path.join(tmp, INDEX), json.dumps(index, indent=2).encode("utf-8"))
        write_synced(os.path.join(tmp, "config.json"), (json.dumps(config, indent=2) + "\n").encode("utf-8"))
        for fname, data in (extra_files or {}).items():
            if isinstance(data, dict):  # tensors (e.g. the trainer state), written as a safetensors file
                write_safetensors(os.path.join(tmp, fname), data)
            else:
                write_synced(os.path.join(tmp, fname), data)
        replace_dir(tmp, path)  # syncs the directory's entries first: the renamed one never misses a file
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]


# --- loading ---------------------------------------------------------------------------------------------
def _short(v, limit: int = 60) -> str:
    r = repr(v)
    return r if len(r) <= limit else r[: limit - 3] + "..."


def _read_index(path: str) -> tuple[dict[str, list[str] | None], dict[str, str]]:
    """(shard file -> tensor names, shard file -> recorded SHA-256) from the index, or the single-file layout
    (no checksums). Everything in the index is checked before use: a malformed one raises CheckpointError."""
    index = os.path.join(path, INDEX)
    if not os.path.exists(index):
        if os.path.exists(os.path.join(path, "model.safetensors")):
            return {"model.safetensors": None}, {}
        raise CheckpointError(f"no {INDEX} or model.safetensors in {path}")
    d = read_json_file(index, CheckpointError)

    def bad(what: str, allowed: str):
        raise CheckpointError(f"{index} is not a valid safetensors index: {what}; {allowed}")

    if not isinstance(d, dict):
        bad(f"the top level is a JSON {type(d).__name__}", "it must be an object with 'weight_map' and 'metadata'")
    unknown = sorted(set(d) - {"weight_map", "metadata"})
    if unknown:
        bad(f"unknown keys {unknown}", "only 'weight_map' and 'metadata' are allowed")
    if "weight_map" not in d:
        bad("'weight_map' is missing", "it maps every tensor name to its shard file")
    wm = d["weight_map"]
    if not isinstance(wm, dict) or not wm:
        bad(f"'weight_map' = {_short(wm)}", "must be a non-empty object mapping tensor names to shard file names")
    files: dict[str, list[str]] = defaultdict(list)
    for name, fname in wm.items():
        # a plain file name: an index must not point outside its checkpoint directory
        if not (isinstance(fname, str) and fname.endswith(".safetensors") and os.path.basename(fname) == fname
                and "\\" not in fname and not fname.startswith(".")):
            bad(f"'weight_map'[{_short(name)}] = {_short(fname)}",
                "must be the name of a .safetensors file in the checkpoint directory")
        files[fname].append(name)
    meta = d.get("metadata")
    meta = {} if meta is None else meta
    if not isinstance(meta, dict):
        bad(f"'metadata' = {_short(meta)}", "must be an object")
    total = meta.get("total_size")
    if total is not None and (isinstance(total, bool) or not isinstance(total, (int, float)) or not total >= 0):
        bad(f"'metadata.total_size' = {_short(total)}", "must be a non-negative number of bytes")
    sums = meta.get(CHECKSUM_KEY, {})
    if not isinstance(sums, dict):
        bad(f"'metadata.{CHECKSUM_KEY}' = {_short(sums)}", "must be an object mapping shard files to SHA-256 hex digests")
    for fname, digest in sums.items():
        if fname not in files:
            bad(f"'metadata.{CHECKSUM_KEY}' names {_short(fname)}", "which is not a shard of 'weight_map'")
        if not (isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest)):
            bad(f"'metadata.{CHECKSUM_KEY}'[{_short(fname)}] = {_short(digest)}", "must be 64 lowercase hex digits")
    for fname in files:
        if not os.path.isfile(os.path.join(path, fname)):
            raise CheckpointError(f"shard {fname} named in {index} is missing from {path}")
    return dict(files), dict(sums)


def _shard_files(path: str) -> dict[str, list[str] | None]:
    """Map shard file -> tensor names, from the index (or the single-file layout)."""
    return _read_index(path)[0]


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(_HASH_BLOCK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _verify_shard(path: str, fname: str, expected: str) -> None:
    got = sha256_file(os.path.join(path, fname))
    if got != expected:
        raise CheckpointError(
            f"shard {fname} in {path} does not match the SHA-256 its index records (file {got[:16]}..., index "
            f"{expected[:16]}...): it is truncated or corrupt, or was modified after the save; --no-verify "
            "(verify=False) loads it anyway")


def _iter_disk_tensors(path: str, files: dict[str, list[str] | None], wanted,
                       checksums: dict[str, str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    for fname, names in files.items():
        fpath = os.path.join(path, fname)
        if names is not None and not any(wanted(n) for n in names):
            continue  # nothing to read from this shard (a layers=N load)
        if checksums and fname in checksums:
            _verify_shard(path, fname, checksums[fname])  # just before reading: the file is then in the page cache
        try:
            with safe_open(fpath, framework="pt") as f:
                keys = list(f.keys())
                missing = [n for n in (names or []) if n not in keys]
                if missing:
                    raise CheckpointError(f"{fname} lacks tensors its index assigns to it: {_show(missing)}")
                for k in keys:
                    if wanted(k):
                        yield k, f.get_tensor(k)
        except CheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
            raise CheckpointError(f"cannot read {fpath}: {e} (the file is truncated or corrupt)") from None


def _show(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def read_checkpoint_tensors(path: str, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `path` under its stored name (sharded with an index, or one
    model.safetensors), as written (no layout conversion: a checkpoint of another module than K3ForCausalLM).
    `verify`: check each shard against the SHA-256 its index records."""
    files, checksums = _read_index(path)
    return dict(_iter_disk_tensors(path, files, lambda name: True, checksums if verify else None))


def load_state_into(model: torch.nn.Module, path: str, strict: bool = True, layer_limit: int | None = None,
                    verify: bool = True) -> None:
    """Fill `model`'s parameters and buffers from the checkpoint at `path`, converting the file layout.
    Tensors of decoder layers >= `layer_limit` (and MTP layers) are skipped without being read. `verify`: check
    each shard read against the SHA-256 its index records (checkpoints without checksums load unchecked)."""
    cfg: K3Config = model.config
    L, n_mtp = cfg.num_hidden_layers, len(getattr(model, "mtp", []))
    targets = dict(model.named_parameters())
    targets.update(dict(model.named_buffers()))
    if cfg.tie_word_embeddings:
        targets.pop("lm_head.weight", None)
    filled: set[str] = set()
    expert_parts: dict[tuple[str, str], dict[int, dict[str, torch.Tensor]]] = defaultdict(lambda: defaultdict(dict))
    unexpected, mismatched = [], []
    files, checksums = _read_index(path)

    def assign(name: str, t: torch.Tensor, disk_name: str) -> None:
        dst = targets[name]
        if name.endswith("self_attn.A_log") and t.dim() == 1 and t.shape[0] >= dst.shape[0]:
            t = t[: dst.shape[0]]  # the release pads [H] to a multiple of 128 (entries beyond H are 0)
        if tuple(t.shape) != tuple(dst.shape):
            mismatched.append(f"{disk_name}: file {tuple(t.shape)} vs model {tuple(dst.shape)}")
            return
        with torch.no_grad():
            dst.copy_(t.to(dst.dtype))
        filled.add(name)

    def wanted(disk_name: str) -> bool:
        if layer_limit is None or not disk_name.startswith(PREFIX):
            return True
        m = _LAYER.match(disk_name[len(PREFIX):])
        return m is None or int(m.group(1)) < layer_limit

    for disk_name, t in _iter_disk_tensors(path, files, wanted, checksums if verify else None):
        name = _disk_to_internal_name(disk_name, L, n_mtp, vision=getattr(model, "vision", None) is not None)
        if name is None:
            continue
        if name.startswith("<skip:"):
            if strict and layer_limit is None:
                unexpected.append(disk_name)
            continue
        m = _DISK_EXPERT.match(name)
        if m:
            key = (f"{m.group(1)}.{m.group(3)}", m.group(4))
            expert_parts[(key[0], "")][int(m.group(2))][m.group(4)] = t
            continue
        if name not in targets:
            unexpected.append(disk_name)
            continue
        assign(name, t, disk_name)

    for (name, _), per_expert in expert_parts.items():
        if name not in targets and f"{name}_packed" in targets:  # experts held packed: the storage as it is
            _fill_packed(name, per_expert, targets, filled, mismatched)
            continue
        if name not in targets:
            unexpected.append(PREFIX + name)
            continue
        dst = targets[name]
        E = dst.shape[0]
        have = sorted(per_expert)
        if have != list(range(E)):
            missing_e = sorted(set(range(E)) - set(have))
            extra_e = sorted(set(have) - set(range(E)))
            if missing_e:
                mismatched.append(f"{PREFIX}{name}: experts missing {missing_e[:8]}{'...' if len(missing_e) > 8 else ''}")
            if extra_e:
                mismatched.append(f"{PREFIX}{name}: experts beyond num_experts={E}: {extra_e[:8]}")
            continue
        with torch.no_grad():
            for e in range(E):
                parts = per_expert[e]
                if "weight" in parts:
                    w = parts["weight"]
                elif "weight_packed" in parts and "weight_scale" in parts:
                    try:
                        w = mxfp4_dequantize(parts["weight_packed"], parts["weight_scale"], dtype=torch.float32)
                    except ValueError as err:
                        mismatched.append(f"{PREFIX}{name} expert {e}: {err}")
                        break
                else:
                    mismatched.append(f"{PREFIX}{name} expert {e}: needs `weight` or `weight_packed`+`weight_scale`")
                    break
                if tuple(w.shape) != tuple(dst.shape[1:]):
                    mismatched.append(f"{PREFIX}{name} expert {e}: file {tuple(w.shape)} vs model {tuple(dst.shape[1:])}")
                    break
                dst[e].copy_(w.to(dst.dtype))
            else:
                filled.add(name)

    missing = [n for n in targets if n not in filled]
    problems = []
    if missing:
        problems.append(f"missing tensors: {_show(_internal_to_disk_name(n, L) for n in missing)}")
    if unexpected and strict:
        problems.append(f"unexpected tensors: {_show(unexpected)}")
    if mismatched:
        problems.append(f"mis-shaped tensors: {_show(mismatched)}")
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config: " + "; ".join(problems))


def _fill_packed(name: str, per_expert: dict, targets: dict, filled: set, mismatched: list) -> None:
    """Copy the experts' `weight_packed` / `weight_scale` of `name` (e.g. `...experts.w1`) into the stacked uint8
    buffers `name_packed` / `name_scale` of packed experts, checking every expert, shape and dtype."""
    dst = {part: targets[f"{name}_{part}"] for part in ("packed", "scale")}
    E = dst["packed"].shape[0]
    if sorted(per_expert) != list(range(E)):
        mismatched.append(f"{PREFIX}{name}: experts {sorted(set(range(E)) ^ set(per_expert))[:8]} missing or "
                          f"beyond num_experts={E}")
        return
    with torch.no_grad():
        for e in range(E):
            parts = per_expert[e]
            if "weight_packed" not in parts or "weight_scale" not in parts:
                mismatched.append(f"{PREFIX}{name} expert {e}: packed experts need `weight_packed` + `weight_scale` "
                                  "(an MXFP4 checkpoint)")
                return
            for part in ("packed", "scale"):
                t = parts[f"weight_{part}"]
                if t.dtype != torch.uint8 or tuple(t.shape) != tuple(dst[part].shape[1:]):
                    mismatched.append(f"{PREFIX}{name} expert {e} weight_{part}: file {tuple(t.shape)} {t.dtype} vs "
                                      f"model {tuple(dst[part].shape[1:])} torch.uint8")
                    return
                dst[part][e].copy_(t)
    filled.update(f"{name}_{part}" for part in ("packed", "scale"))


def load_config(path: str | os.PathLike) -> K3Config:
    """A checkpoint's config.json, strictly checked (it must give the model's shape); CheckpointError naming
    the file and the problem otherwise."""
    from k3.config import ConfigError

    f = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(f):
        raise CheckpointError(f"{os.fspath(path)} has no config.json: not a checkpoint directory")
    try:
        return K3Config.load(f, strict=True)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None  # the message already names the file


def _packed_choice(packed_experts: bool | str, device: torch.device, backends) -> bool:
    if packed_experts not in (True, False, "auto"):
        raise ValueError(f"packed_experts={packed_experts!r} must be True, False or 'auto'")
    if packed_experts != "auto":
        return packed_experts
    from k3.ops.registry import Target, dispatch, notice

    if dispatch("mx_moe", Target(device), backends).name != "torch":
        return True
    notice(f"the MXFP4 experts are decoded at load into dense weights: op mx_moe runs on its reference on {device}, "
           "which would decode every touched expert in every forward (the packed kernels, on CUDA: "
           "mx_moe=triton_grouped, K3_MX_MOE_BACKEND=triton_grouped)")
    return False


def from_pretrained(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                    layers: int | None = None, strict: bool = True, backends=None, verify: bool = True,
                    packed_experts: bool | str = False):
    """Load a checkpoint in the official layout. `layers=N` builds and loads only the first N decoder layers
    (plus embedding, output site, final norm and head), for analysing a slice of a large checkpoint. `backends`
    (k3.ops.registry.Backends, None: the default) is given to the model (K3ForCausalLM.set_backends).
    `verify`: check the shards against the SHA-256 digests their index records (see load_state_into).
    `packed_experts`: True keeps an MXFP4 checkpoint's routed experts in their storage in memory, decoded inside
    the expert computation (k3.model.mx_experts.PackedMXExperts: a quarter of bf16's memory; serving only, they
    have no parameters to train); other checkpoints load as usual. False (the default) decodes them once, at load,
    into dense weights of the model's dtype. "auto" (the inference commands): packed where op ``mx_moe`` runs
    on its kernels for `device` (which decode in registers), else decoded at load with a notice saying why: the
    op's reference decodes every touched expert in every forward, far slower than dense GEMMs."""
    from k3.model.model import K3ForCausalLM

    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    cfg = load_config(path)
    _read_index(path)  # a broken index fails here, before the (possibly large) allocation
    if layers is not None:
        if not isinstance(layers, int) or not 1 <= layers <= cfg.num_hidden_layers:
            raise CheckpointError(f"layers={layers!r} must be an integer in [1, {cfg.num_hidden_layers}]")
        cfg = cfg.replace(
            num_hidden_layers=layers, num_nextn_predict_layers=0,
            kda_layers=[i for i in cfg.kda_layers if i <= layers],
            full_attn_layers=[i for i in cfg.full_attn_layers if i <= layers],
        )
    target_dtype = dtype if dtype is not None else cfg.torch_dtype
    device = torch.device(device) if device is not None else torch.device("cpu")
    act = expert_activation_format(cfg.quantization_config)
    packed = _is_mxfp4(cfg) and _packed_choice(packed_experts, device, backends)
    with torch.device("meta"):
        model = K3ForCausalLM(cfg, backends=backends)
        if packed:
            from k3.model.mx_experts import packed_experts_layout

            packed_experts_layout(model.model, activations=act)  # the backbone's; the MTP layer's stay dense
    try:
        model.to_empty(device=device)
    except (RuntimeError, MemoryError) as e:  # e.g. a config.json whose sizes describe a far larger model
        n = sum(p.numel() for p in model.parameters())
        raise CheckpointError(f"the model {os.path.join(path, 'config.json')} describes ({n:,} parameters) does "
                              f"not fit in {device} memory: {str(e).splitlines()[0]}") from None
    model.set_dtype(target_dtype)
    # With layers=N the later layers are in the files but deliberately neither read nor reported.
    load_state_into(model, path, strict=strict, layer_limit=layers, verify=verify)
    if act == "mxfp8":
        # A checkpoint trained with MXFP8 expert inputs (QAT, report §4.1.4) is computed the same way here: the
        # decoded MXFP4 weights are exact already, the experts' GEMM inputs are rounded as in training.
        from k3.model.mx_experts import quantize_experts

        quantize_experts(model, weights=None, activations="mxfp8")
    model.eval()
    return model
