"""Sharded checkpoints of a distributed run with torch.distributed.checkpoint (DCP), and export of a sharded model
to the official layout (k3.checkpoint).

A sharded checkpoint is one directory:
  - DCP's files: `__{rank}_{i}.distcp` (each rank's shards of the model and optimizer tensors) and `.metadata`
    (which slices of which tensor live where), written by `dcp.save` and resharded by `dcp.load` onto any world
    size and any FSDP layout of the same model;
  - `sharded_state.json` (rank 0): the caller's `extra` (step, data position, RNG, balancer state: JSON values)
    and the non-tensor leaves of the optimizer state (param groups' hyperparameters and parameter names);
  - `config.json`: the model's config, so that a run can rebuild the model before loading (load_config).

Expert parallelism (--ep > 1): each ep rank holds another slice [E/R, ...] of every routed-expert table under the
same name (k3.parallel.expert_parallel), FSDP2-sharded again over the ranks that hold the same experts. What DCP
writes and reads presents each such table, and every optimizer state tensor of its shape (momentum, Adam moments),
as one DTensor of the global shape [E, ...] over this rank's own storage, split over an ("ep", "shard") mesh, so
the files hold each expert at its global id and a load at another ep size, FSDP2 layout or world size reads each
rank's rows from there into the live tensors. torch's state-dict helpers (get_state_dict, set_state_dict) see the
parameters as they are; only the flat tensors handed to DCP are rewritten (_with_global_experts). The optimizer's
per-expert blocks stay the loading run's E / ep (PerHeadMuon.load_state_dict keeps its groups' block layout).

Only tensors go through DCP: DCP stores any other value with a full pickle and reads it back with
`torch.load(weights_only=False)`, so every non-tensor leaf is split off into the JSON file instead. What remains
pickled is DCP's own format: the tensors (read with `torch.load(weights_only=True)`) and `.metadata`, which
torch writes with `pickle.dump` and reads with `pickle.load`; load only checkpoints that this or another trusted
run wrote. Nothing of our own is pickled.

Atomicity: every rank writes into `<path>.partial` (DCP fsyncs its files), rank 0 adds the JSON files, and after
all ranks agree that everything is written rank 0 renames the directory to `path` and fsyncs the parent. A rank
that dies before the rename leaves only the `.partial` directory, which load_sharded refuses
(k3.run_dir.clean_interrupted removes it at the next start).

Without an initialized process group every function works in the single process (a plain, unsharded model).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from k3.checkpoint import CheckpointError, save_pretrained
from k3.files import read_json_file, replace_dir, write_synced

STATE_FILE = "sharded_state.json"
METADATA_FILE = ".metadata"  # DCP's
# A directory holding all of these was renamed into place complete.
SHARDED_COMPLETE_FILES = (METADATA_FILE, STATE_FILE, "config.json")
FORMAT = "k3-sharded-1"
_TENSOR = "__tensor__"

# DCP warns on every single-process save and load, which this module asks for explicitly (no_dist).
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


# --- process-group helpers -------------------------------------------------------------------------------
def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _all_ok(ok: bool) -> bool:
    """Whether every rank reports `ok` (a MIN all-reduce; a barrier too). True without a process group."""
    if not dist.is_initialized():
        return ok
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=dev)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _on_rank0(what: str, fn) -> None:
    """Run `fn` on rank 0; every rank raises if it failed (so none waits at a later collective for it)."""
    err: BaseException | None = None
    if _rank() == 0:
        try:
            fn()
        except Exception as e:  # re-raised below, after the other ranks learn of it
            err = e
    if not _all_ok(err is None):
        if err is not None:
            raise err
        raise RuntimeError(f"rank 0 failed while {what}; see its log")


# --- expert-parallel experts as the global tables ----------------------------------------------------------
def _expert_tables(model: nn.Module) -> dict[str, Any]:
    """{parameter name: its ExpertParallelExperts} of every routed-expert table split over two or more ep ranks
    (`w1`, `w3`, `w2`: the same names on every ep rank, each holding another slice of the experts)."""
    from k3.parallel.expert_parallel import ExpertParallelExperts

    return {f"{name}.{w}": m for name, m in model.named_modules()
            if isinstance(m, ExpertParallelExperts) and m.ep_size > 1 for w in ("w1", "w3", "w2")}


def _table_layout(m, p: torch.Tensor, meshes: dict) -> tuple[DeviceMesh, tuple]:
    """The mesh and placements over which the global [E, ...] table of `m` is split, `p` being this rank's slice
    [E/R, ...]: dimension "ep" over the ep ranks (rank r holds experts [r E/R, (r + 1) E/R), `expert_range`), and,
    when FSDP2 sharded the slice (a DTensor Shard(0) over the ranks holding the same experts), dimension "shard"
    over those ranks. DTensor splits the ep slice again over the second dimension as torch.chunk does, which is
    FSDP2's split, so [Shard(0), Shard(0)] places every local row at its global expert id (checked in
    _global_table). `meshes` caches the meshes across the tables of one save or load (all share their groups)."""
    if not isinstance(p, DTensor):
        key = (id(m.group), p.device.type)
        if key not in meshes:
            meshes[key] = DeviceMesh.from_group(m.group, p.device.type, mesh_dim_names=("ep",))
        return meshes[key], (Shard(0),)
    inner = p.device_mesh
    if inner.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise NotImplementedError(f"sharded checkpoints of expert-parallel experts need them sharded by FSDP2 "
                                  f"along the experts over one mesh dimension; got placements {p.placements} on a "
                                  f"{inner.ndim}-D mesh")
    key = (id(m.group), id(inner))
    if key not in meshes:
        # The global ranks of the ep x shard grid: each ep rank contributes the ranks of its shard mesh (in
        # ep-rank order: that is the group's rank order).
        mine = inner.mesh.reshape(-1).to(device=p.to_local().device, dtype=torch.int64)
        grid = mine.new_empty(m.ep_size * mine.numel())
        dist.all_gather_into_tensor(grid, mine, group=m.group)
        meshes[key] = DeviceMesh.from_group([m.group, inner.get_group()], inner.device_type,
                                            mesh=grid.view(m.ep_size, -1).cpu(), mesh_dim_names=("ep", "shard"))
    return meshes[key], (Shard(0), Shard(0))


def _global_table(m, p: torch.Tensor, t: torch.Tensor, meshes: dict) -> DTensor:
    """`t` (the parameter `p` of `m` or a state tensor of its shape and sharding) as a DTensor of the global table
    [E, ...] on the ep x shard mesh, sharing this rank's storage (a load writes into it)."""
    if isinstance(t, DTensor) != isinstance(p, DTensor) or (
            isinstance(t, DTensor) and (t.device_mesh != p.device_mesh or t.placements != p.placements)):
        raise NotImplementedError(f"a state tensor of expert table {tuple(p.shape)} is laid out unlike the table")
    mesh, placements = _table_layout(m, p, meshes)
    local = t.to_local() if isinstance(t, DTensor) else t
    shape = torch.Size((m.num_experts, *p.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    with torch.no_grad():
        out = DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)
    if local.numel():  # the rows' global ids: the ep slice's first expert plus FSDP2's offset within the slice
        (chunk,) = out.__create_chunk_list__()
        within = t.__create_chunk_list__()[0].offsets[0] if isinstance(t, DTensor) else 0
        if chunk.offsets[0] != m.expert_range[0] + within or tuple(chunk.sizes) != tuple(local.shape):
            raise RuntimeError(f"expert rows [{chunk.offsets[0]}, +{chunk.sizes[0]}) of the global table disagree "
                               f"with this rank's experts from {m.expert_range[0] + within} ({local.shape[0]} rows)")
    return out


def _with_global_experts(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (_split's flat keys) with every expert-parallel table, the parameter ("model/<name>") and its
    optimizer state of its shape ("optim/state/<name>/<key>": momentum, Adam moments), replaced by the global
    [E, ...] DTensor over its own storage (_global_table): DCP then writes and reads each expert's rows at its
    global id, so a checkpoint loads at any ep size. Other tensors (a step count) pass unchanged."""
    tables = _expert_tables(model)
    if not tables:
        return tensors
    params = dict(model.named_parameters())
    meshes: dict = {}
    out = dict(tensors)
    for key, t in tensors.items():
        parts = key.split("/")
        name = parts[1] if parts[0] == "model" and len(parts) == 2 else (
            parts[2] if parts[:2] == ["optim", "state"] and len(parts) == 4 else None)
        if name in tables and t.shape == params[name].shape:
            out[key] = _global_table(tables[name], params[name], t, meshes)
    return out


def _copy_back(loaded: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    """After dcp.load into the global views: each view's rows into its live tensor where they do not share
    storage (from_local keeps the local tensor, so normally nothing is copied)."""
    for key, t in tensors.items():
        g = loaded[key]
        if g is t:
            continue
        src, dst = g.to_local(), t.to_local() if isinstance(t, DTensor) else t
        if src.data_ptr() != dst.data_ptr():
            with torch.no_grad():
                dst.copy_(src)


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of the parallelized `model` on rank 0's CPU (an empty dict on the other
    ranks), expert-parallel tables whole [E, ...] (gathered over the ep and FSDP ranks). Collective."""
    tables = _expert_tables(model)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if tables:
        params, meshes = dict(model.named_parameters()), {}
        for name, m in tables.items():
            p = params[name]
            with torch.no_grad():
                whole = _global_table(m, p, p.detach(), meshes).full_tensor()
            if _rank() == 0:
                full[name] = whole.cpu()
            del whole
    return full if _rank() == 0 else {}


# --- tensors for DCP, everything else for JSON ------------------------------------------------------------
def _split(obj: Any, key: str = "") -> tuple[dict[str, torch.Tensor], Any]:
    """(flat {key: tensor}, a JSON document of `obj` with tensors replaced by references to their keys). Keys are
    the path of names ("optim/state/<param fqn>/exp_avg"), the same on every rank and at every world size."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(o: Any, k: str) -> Any:
        if isinstance(o, torch.Tensor):
            tensors[k] = o
            return {_TENSOR: k}
        if isinstance(o, dict):
            if any(not isinstance(n, (str, int)) or isinstance(n, bool) for n in o):
                raise TypeError(f"state keys must be str or int, got {sorted(map(repr, o))[:4]} at {k!r}")
            return {"__dict__": [[n, walk(v, f"{k}/{n}" if k else str(n))] for n, v in o.items()]}
        if isinstance(o, (list, tuple)):
            return {"__list__": [walk(v, f"{k}/{i}") for i, v in enumerate(o)], "__tuple__": isinstance(o, tuple)}
        if o is None or isinstance(o, (bool, int, float, str)):
            return o
        raise TypeError(f"cannot store {type(o).__name__} at {k!r} in a sharded checkpoint (tensors and JSON "
                        "values only)")

    return tensors, walk(obj, key)


def _join(doc: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The object `doc` describes, its tensor references resolved in `tensors` (the inverse of _split; None for a
    reference not in `tensors`)."""
    if isinstance(doc, dict):
        if _TENSOR in doc:
            return tensors.get(doc[_TENSOR])
        if "__dict__" in doc:
            return {n: _join(v, tensors) for n, v in doc["__dict__"]}
        if "__list__" in doc:
            items = [_join(v, tensors) for v in doc["__list__"]]
            return tuple(items) if doc.get("__tuple__") else items
    return doc


def _train_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """{"model": sharded model state dict, "optim": the optimizer's, keyed by parameter names} (DTensors under
    FSDP2). An optimizer without state yet gets it initialized by a zero step, so a load has tensors to fill."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


# --- saving -------------------------------------------------------------------------------------------------
def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: dict[str, Any]) -> None:
    """Save `model`'s and `optimizer`'s state (each rank its shards) and `extra` (JSON values, rank 0's copy) as
    the checkpoint directory `path`, atomically. Every rank calls it with the same `path` on a file system they
    share. On failure `path` is untouched (the previous checkpoint of that name, if any, survives) and a
    `<path>.partial` may remain. Expert-parallel tables are stored whole, each expert at its global id."""
    path = os.path.abspath(os.fspath(path))
    tmp = path + ".partial"

    def prepare() -> None:
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)

    state = _train_state(model, optimizer)
    tensors, doc = _split(state)
    # Checked on every rank before any file is written: a value JSON cannot hold fails everywhere alike.
    state_text = json.dumps({"format": FORMAT, "world_size": dist.get_world_size() if dist.is_initialized() else 1,
                             "extra": extra, "state": doc})
    config_text = json.dumps(model.config.to_dict(), indent=2) + "\n"
    tensors = _with_global_experts(model, tensors)
    _on_rank0(f"creating {tmp}", prepare)
    dcp.save(tensors, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=not dist.is_initialized())

    def finish() -> None:
        write_synced(os.path.join(tmp, STATE_FILE), state_text.encode("utf-8"))
        write_synced(os.path.join(tmp, "config.json"), config_text.encode("utf-8"))
        replace_dir(tmp, path)

    _on_rank0(f"finishing {path}", finish)  # also the barrier: no rank returns before the rename


# --- loading ------------------------------------------------------------------------------------------------
def _check_complete(path: str):
    """DCP's metadata of the complete sharded checkpoint `path`, every data file it names checked to be present
    and long enough; CheckpointError naming the file otherwise."""
    if path.endswith(".partial"):
        raise CheckpointError(f"{path} is an unfinished save (a .partial directory is renamed when complete)")
    if not os.path.isdir(path):
        hint = (f"; {path}.partial exists: its save was never completed" if os.path.isdir(path + ".partial")
                else "")
        raise CheckpointError(f"sharded checkpoint {path} does not exist{hint}")
    meta_path = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(meta_path):
        official = os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(
            os.path.join(path, STATE_FILE))
        raise CheckpointError(f"{path} is not a sharded (DCP) checkpoint: {meta_path} is missing"
                              + (" (it looks like the official layout: load it with k3.checkpoint)" if official
                                 else ""))
    for f in (STATE_FILE, "config.json"):
        if not os.path.isfile(os.path.join(path, f)):
            raise CheckpointError(f"sharded checkpoint {path} is incomplete: {os.path.join(path, f)} is missing")
    try:
        meta = FileSystemReader(path).read_metadata()
    except Exception as e:  # a torn or foreign .metadata: whatever pickle raises
        raise CheckpointError(f"{meta_path} is not DCP metadata: {type(e).__name__}: {e}") from None
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in sorted(ends.items()):
        f = os.path.join(path, rel)
        if not os.path.isfile(f):
            raise CheckpointError(f"sharded checkpoint {path} is incomplete: {f} is missing")
        if os.path.getsize(f) < end:
            raise CheckpointError(f"sharded checkpoint {path} is damaged: {f} has {os.path.getsize(f)} bytes, "
                                  f"its metadata needs {end}")
    return meta


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` holds the files of a complete sharded checkpoint (cheap: no metadata is read)."""
    path = os.fspath(path)
    return not path.endswith(".partial") and all(os.path.isfile(os.path.join(path, f))
                                                 for f in SHARDED_COMPLETE_FILES)


def _show(names, limit: int = 6) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def load_sharded(path: str | os.PathLike, model: nn.Module,
                 optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load the sharded checkpoint `path` into the already parallelized `model` and its `optimizer` (None: the
    weights only), at any world size and sharding, expert parallelism of any ep size included (DCP reads each
    rank's slices of every tensor, an expert's rows from its global id), and return the `extra` it was saved
    with. Every rank calls it. CheckpointError naming the file when `path` is not a complete sharded checkpoint
    or does not hold what the model and optimizer have."""
    path = os.path.abspath(os.fspath(path))
    meta = _check_complete(path)
    saved = read_json_file(os.path.join(path, STATE_FILE), CheckpointError)
    if not isinstance(saved, dict) or saved.get("format") != FORMAT or not {"extra", "state"} <= saved.keys():
        raise CheckpointError(f"{os.path.join(path, STATE_FILE)} is not a {FORMAT} state file")
    template = _train_state(model, optimizer)
    if optimizer is not None:
        # Parameters that never had a gradient have no optimizer state in the checkpoint; the template's (from
        # the initializing zero step) is left out, and loading the optimizer state drops it.
        saved_optim = _join(saved["state"], {})
        saved_optim = saved_optim.get("optim") if isinstance(saved_optim, dict) else None
        if not isinstance(saved_optim, dict) or not isinstance(saved_optim.get("state"), dict):
            raise CheckpointError(f"sharded checkpoint {path} holds no optimizer state")
        template["optim"]["state"] = {n: v for n, v in template["optim"]["state"].items()
                                      if n in saved_optim["state"]}
    tensors, _ = _split(template)
    have = set(meta.state_dict_metadata)
    missing = set(tensors) - have
    if missing:
        raise CheckpointError(f"sharded checkpoint {path} lacks {len(missing)} tensors of the model/optimizer: "
                              f"{_show(missing)}")
    unexpected = {k for k in have - set(tensors) if optimizer is not None or not k.startswith("optim/")}
    if unexpected:
        raise CheckpointError(f"sharded checkpoint {path} has {len(unexpected)} tensors the model/optimizer "
                              f"lacks: {_show(unexpected)}")
    views = _with_global_experts(model, tensors)
    dcp.load(views, storage_reader=FileSystemReader(path), no_dist=not dist.is_initialized())  # in place
    _copy_back(views, tensors)
    doc = saved["state"]
    if optimizer is None:
        doc = {"__dict__": [[n, v] for n, v in doc["__dict__"] if n == "model"]}
    state = _join(doc, tensors)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        # strict=False: parameters without optimizer state (never a gradient) are allowed; the model's keys were
        # checked above.
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=StateDictOptions(strict=False))
    return saved["extra"]


# --- export -------------------------------------------------------------------------------------------------
def export_pretrained(model: nn.Module, path: str | os.PathLike, dtype: torch.dtype | None = None,
                      max_shard_bytes: int = 4 << 30, extra_files: dict[str, bytes] | None = None) -> None:
    """Write the (FSDP-sharded, perhaps expert-parallel) `model` as an official-layout checkpoint at `path`
    (k3.checkpoint.save_pretrained, so k3.from_pretrained and `k3 serve` load it): the full state dict is gathered
    to rank 0's CPU (full_state_dict), loaded into a plain K3ForCausalLM of the same config there and saved; the
    other ranks wait. Every rank calls it. `dtype`, `max_shard_bytes`, `extra_files` as for save_pretrained."""
    full = full_state_dict(model)

    def write() -> None:
        from k3.model.model import K3ForCausalLM

        with torch.device("meta"):
            plain = K3ForCausalLM(model.config)
        plain.to_empty(device="cpu")
        for name, t in list(plain.named_parameters()) + list(plain.named_buffers()):
            if name in full and t.dtype != full[name].dtype:  # keep the sharded model's dtypes
                t.data = t.data.to(full[name].dtype)
        plain.load_state_dict(full, strict=True)
        save_pretrained(plain, path, dtype=dtype, max_shard_bytes=max_shard_bytes, extra_files=extra_files)

    _on_rank0(f"exporting {os.fspath(path)}", write)
