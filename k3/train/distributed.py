"""The training loop on several processes (torch.distributed): `DistributedTrainer` is the single-process
`Trainer` with its distributed hooks filled in, on a model already sharded by k3.parallel.parallelize.

* data: each data rank trains on its contiguous rows [r R/n, (r + 1) R/n) of every global batch of R rows, so the
  ranks together see exactly the single-process batch; FSDP2 averages the gradients over the ranks in backward.
  A loss normalized by the step's trained tokens gets their global count / the data ranks as `step_tokens`
  (`_step_tokens`), so that average is the global token mean however unevenly the ranks' rows hold tokens;
* the optimizer is built on the sharded parameters (Per-Head Muon gathers each block whole, see
  k3.train.per_head_muon); WeightCasts is off (FSDP2's MixedPrecisionPolicy casts);
* reported losses are averaged over the ranks; Quantile Balancing's routing counts (ExpertBalancer.update) and
  QK-Clip's per-head maxima (MaxLogitTracker.consume) are all-reduced there, so every rank keeps the same router
  bias and clips the same heads; QK-Clip scales each rank's rows of the sharded weights;
* the gradient norm is the norm over all ranks' shards; loop decisions taken from the clock or a signal (stop,
  save) are all-reduced so that every rank takes them together;
* context parallelism (a "cp" dimension of 2 or more): each forward is one packed row, split along the sequence
  over the cp ranks (k3.parallel.context_parallel), its labels and every other per-token tensor of the batch
  realigned with the positions first (k3.train.losses states the convention); each rank's loss (and MTP loss) is
  its segment's share of the row's, so it is scaled by cp in backward and the reported losses sum the cp ranks'
  shares; QK-Clip's maxima, each rank's over its own queries, are all-reduced like any rank's;
* rank 0 alone writes metrics.jsonl, loss.png and the progress bar;
* a checkpoint `step-N/` is the full model gathered to rank 0 and written in the official layout (`k3 eval` /
  `k3 serve` load it; its trainer_state files carry the settings and positions, no optimizer state), with the
  sharded training state in `step-N/sharded/` (k3.parallel.checkpoint.save_sharded, every rank its shards of the
  model and optimizer; `extra` the rest of the trainer state as JSON). `load` restores that folder into the
  parallelized model and optimizer at any world size and mesh (k3.parallel.checkpoint.load_sharded): expert-parallel
  runs (--ep > 1) included, their experts stored as the global tables, so a run saved at one --ep resumes at another
  that divides the expert count.
"""

from __future__ import annotations

import base64
import math
import os
import shutil
from dataclasses import asdict

import numpy as np

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from k3.model.gated_mla import GatedMLA
from k3.parallel.mesh import data_rank
from k3.files import fsync_dir
from k3.run_dir import SHARDED_DIR, holding_run_dir, sharded_state
from k3.train import state as state_io
from k3.train.checkpointing import checkpoint_path, save_checkpoint
from k3.train.losses import Loss
from k3.train.qk_clip import apply_qk_clip_, mla_layers
from k3.train.trainer import Trainer, TrainConfig, TrainingError

__all__ = ["DistributedTrainer"]


class DistributedTrainer(Trainer):
    """`Trainer` over the ranks of `mesh` (dims "dp", "ep", "cp"); `model` is already parallelized over it and
    every rank's loader yields the same global batches (same data, same seed). `loss`: as the Trainer's (its
    per-token tensors are split with the labels under context parallelism, k3.train.losses)."""

    def __init__(self, model, tcfg: TrainConfig, train_loader, mesh: DeviceMesh, eval_stream=None, eos_id: int = 0,
                 tokenizer_json: bytes | None = None, log=print, loss: Loss | None = None):
        self.mesh = mesh
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.data_index, self.data_ranks = data_rank(mesh)
        rows = tcfg.rows_per_step
        if rows % self.data_ranks:
            raise ValueError(f"the global batch has {rows} rows (--batch-tokens {tcfg.batch_tokens} / --seq-len "
                             f"{tcfg.seq_len}), which does not divide by the {self.data_ranks} data ranks")
        super().__init__(model, tcfg, train_loader, eval_stream=eval_stream, eos_id=eos_id,
                         tokenizer_json=tokenizer_json, log=log if self.rank == 0 else _quiet, loss=loss)
        self.writes_files = self.rank == 0
        self.retries_oom = False
        self.cp = mesh["cp"].size()
        if self.cp > 1:
            self._check_context_parallel(tcfg)

    def _check_context_parallel(self, tcfg: TrainConfig) -> None:
        """Context parallelism splits one packed row per forward over the "cp" ranks (report §5.1.2). The MTP layers
        run over the same segments (each reading the next segment's first tokens), and QK-Clip's per-head maxima
        of each segment's queries are all-reduced (MAX) over every rank, cp ranks included, as any other rank's."""
        if tcfg.micro_batch_rows not in (None, 1):
            raise ValueError(f"--cp runs one packed row per forward; --micro-batch-rows {tcfg.micro_batch_rows} "
                             f"cannot apply")
        tcfg.micro_batch_rows = 1
        self.cp_rank, self.cp_group = self.mesh["cp"].get_local_rank(), self.mesh["cp"].get_group()

    # --- hooks of the single-process loop ------------------------------------------------------------
    def _next_batch(self) -> dict:
        batch = self.loader.next_batch()
        rows = batch["input_ids"].shape[0]
        if rows % self.data_ranks:
            raise ValueError(f"a batch of {rows} rows does not divide by the {self.data_ranks} data ranks")
        n = rows // self.data_ranks
        lo = self.data_index * n
        return {k: v[lo:lo + n] for k, v in batch.items()}

    def _step_tokens(self, batch: dict) -> torch.Tensor:
        """The step's trained tokens over all data ranks / their number D: the mean over all ranks of each rank's
        count (the cp ranks of a data rank hold its rows, so the sum over the world counts every token cp times,
        and world = D cp). Rank r's loss S_r / step_tokens (S_r its token sum), scaled by cp in backward and
        averaged over the world by FSDP2, gives the gradient of sum_r S_r / (D step_tokens) = S / N, the global
        token mean; `_reduce_losses`' sum over ranks / D reports the same S / N. One all-reduce a step."""
        local = float((batch["labels"][:, 1:] != -100).sum())
        n = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(n, op=dist.ReduceOp.SUM)
        return (n / self.world).float()

    def _micro_batch(self, host: dict):
        """Under context parallelism: this rank's segment of the micro-batch's one packed row, its record carrying
        the cp group (k3.parallel.context_parallel). The labels are aligned with the positions first, as the split
        needs, and so is every other per-token tensor (first dims [1, T], e.g. behaviour log-probs, advantages:
        shifted one place left, 0 at the row's last position), cut at the same points (k3.train.losses states
        the convention); a tensor of another shape comes whole. Each rank's loss is its segment's share of the
        row's, so the cp ranks' losses sum to it: scaled by cp in backward, FSDP2's average over all ranks becomes
        the sum over cp and the mean over data ranks."""
        if self.cp == 1:
            return super()._micro_batch(host)
        from k3.parallel.context_parallel import aligned_labels, cp_batch_info, split_packed_batch, split_rows
        from k3.tensors import to_device_async

        ids = host["input_ids"]
        parts = split_packed_batch(ids, host["segment_ids"], self.cp, labels=aligned_labels(host["labels"]))
        mine, plan = parts[self.cp_rank], [p.segment for p in parts]
        info = cp_batch_info(mine, self.cp_group).to(self.device)
        out = {"input_ids": mine.input_ids, "labels": mine.labels}
        for k, v in host.items():
            if k not in ("input_ids", "labels", "segment_ids"):
                per_token = v.dim() >= 2 and v.shape[:2] == ids.shape
                out[k] = split_rows(aligned_labels(v, fill=0), plan)[self.cp_rank] if per_token else v
        return info, {k: to_device_async(v, self.device) for k, v in out.items()}, float(self.cp)

    def _weight_casts(self):
        return None  # FSDP2 casts the parameters for each unit's forward and reduces through autograd's hooks

    def _reduce_losses(self, loss: torch.Tensor, mtp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = torch.stack([loss, mtp])
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        both /= self.world // self.cp  # the cp ranks' losses are shares of one row's: summed, not averaged
        return both[0], both[1]

    def _clip_grad_norm(self) -> torch.Tensor:
        """The total norm over every rank's gradient shards (dense parameters sharded over all ranks, experts over
        their ("dp", "cp") ranks: every element lives on exactly one rank), then the single-process clip."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        dev = local[0].device if local else self.device
        sq = torch.zeros((), dtype=torch.float32, device=dev)
        for g in local:
            if g.numel():
                sq += torch.linalg.vector_norm(g, dtype=torch.float32) ** 2
        dist.all_reduce(sq, op=dist.ReduceOp.SUM)
        total = sq.sqrt()
        coef = torch.clamp(self.cfg.grad_clip / (total + 1e-6), max=1.0)
        nonempty = [g for g in local if g.numel()]
        if nonempty:
            torch._foreach_mul_(nonempty, coef.to(nonempty[0].device))
        return total

    @torch.no_grad()
    def _apply_qk_clip(self, maxima: list) -> dict:
        """QK-Clip on the sharded weights: the single-device clip on plain ones-columns gives each weight row's
        scale, and every rank applies its own rows of it to its shard."""
        layers = mla_layers(self.model)
        stand_ins = [_RowScales(m) for m in layers]
        result = apply_qk_clip_(_Layers(stand_ins), maxima, self.cfg.qk_clip_tau)
        if result["clipped_heads"]:
            for m, s in zip(layers, stand_ins):
                for lin, rows in ((m.q_b_proj, s.q_b_proj.weight), (m.kv_b_proj, s.kv_b_proj.weight)):
                    _scale_rows_(lin.weight, rows[:, 0])
        return result

    def _agree(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    # --- files ------------------------------------------------------------------------------------
    def fit(self, progress_bar: bool = True) -> dict:
        if self.rank == 0:
            with holding_run_dir(self.cfg.out):
                return self._fit(progress_bar)
        return self._fit(progress_bar)

    def save(self) -> str:
        """Write the checkpoint of this step (collective: every rank calls it): the sharded training state as
        `step-N.sharded/` (all ranks; expert-parallel tables as their global [E, ...] tensors, see
        k3.parallel.checkpoint), then the full model gathered to rank 0 as the official-layout `step-N/`, then
        rank 0 moves the sharded state in as `step-N/sharded/`. Returns the checkpoint's path."""
        from k3.parallel.checkpoint import _on_rank0, save_sharded

        path = checkpoint_path(self.cfg.out, self.step)
        if self._saved_step == self.step:
            return path
        staged = path + ".sharded"
        save_sharded(staged, self.model, self.optimizer, self.sharded_extra())
        self._save_gathered()

        def move() -> None:
            dest = os.path.join(path, SHARDED_DIR)
            if os.path.exists(dest):  # re-saving a step: the new state replaces the old one
                os.replace(dest, dest + ".old")
                shutil.rmtree(dest + ".old")
            os.replace(staged, dest)
            fsync_dir(path)

        _on_rank0(f"moving {staged} into {path}", move)
        self._saved_step = self.step
        return path

    def _save_gathered(self) -> None:
        """Gather the full model to rank 0 (expert-parallel tables whole) and write it there as a regular
        checkpoint (collective)."""
        from k3.model.model import K3ForCausalLM
        from k3.parallel.checkpoint import full_state_dict

        sd = full_state_dict(self.model)
        if self.rank == 0:
            plain = K3ForCausalLM(self.model.config)
            plain.load_state_dict(sd, strict=True)
            state = state_io.dump_parts(self.state_dict())
            save_checkpoint(plain, self.cfg.out, self.step, state, tokenizer_json=self.tokenizer_json,
                            keep=self.cfg.keep_checkpoints, log=self.log)
        dist.barrier()

    def state_dict(self) -> dict:
        """The single-process trainer state without the (sharded) optimizer state."""
        return {
            "step": self.step, "elapsed": self.elapsed, "bad_steps": self.bad_steps,
            "optimizer": None,
            "balancers": [b.state_dict() for b in self.balancers],
            "loader": self.loader.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "train_config": asdict(self.cfg),
            "world_size": self.world,
        }

    def sharded_extra(self) -> dict:
        """The trainer state besides the model's and optimizer's tensors, as JSON values (save_sharded's
        `extra`): the same on every rank (the loader yields the global batches; balancer state and RNG are kept
        identical by the all-reduces and the common seed), so rank 0's copy serves any world size."""
        return {
            "step": self.step, "elapsed": self.elapsed, "bad_steps": self.bad_steps,
            "balancers": [{k: _tensor_to_json(v) if isinstance(v, torch.Tensor) else v
                           for k, v in b.state_dict().items()} for b in self.balancers],
            "loader": self.loader.state_dict(),
            "torch_rng": _tensor_to_json(torch.get_rng_state()),
            "train_config": asdict(self.cfg),
            "world_size": self.world,
        }

    def load_sharded_extra(self, st: dict) -> None:
        self.step, self.elapsed, self.bad_steps = int(st["step"]), float(st["elapsed"]), int(st["bad_steps"])
        if len(st["balancers"]) != len(self.balancers):
            raise TrainingError(f"the checkpoint holds {len(st['balancers'])} balancer states, the model has "
                                f"{len(self.balancers)} balanced layers")
        for b, s in zip(self.balancers, st["balancers"]):
            b.load_state_dict({k: _tensor_from_json(v) if _is_json_tensor(v) else v for k, v in s.items()})
        self.loader.load_state_dict(st["loader"])
        torch.set_rng_state(_tensor_from_json(st["torch_rng"]))

    def load(self, ckpt_dir: str, verify: bool = True) -> None:
        """Restore the model, optimizer and trainer state from the sharded state of the checkpoint `ckpt_dir`
        (`step-N/sharded/`; collective), whatever world size and mesh wrote it: another --dp-shard, --ep or --cp
        (each expert's rows are read from its global id, so any ep size that divides the experts will do; the
        optimizer's expert groups keep this run's E / ep blocks). `verify` is for the single-process
        checkpoint's digests; DCP checks its files' sizes against its metadata."""
        from k3.parallel.checkpoint import load_sharded

        sub = sharded_state(ckpt_dir)
        if sub is None:
            raise TrainingError(f"{ckpt_dir} holds no sharded training state ({os.path.join(ckpt_dir, SHARDED_DIR)}"
                                "): it was saved by a single process (or by an expert-parallel run of an older "
                                "version, which wrote the gathered model only); resume it in a single process")
        extra = load_sharded(sub, self.model, self.optimizer)
        try:
            self.load_sharded_extra(extra)
        except (KeyError, TypeError, ValueError) as e:
            raise TrainingError(f"trainer state in {sub} is unreadable ({type(e).__name__}: {e}); "
                                "the checkpoint is damaged") from None
        if os.path.abspath(ckpt_dir) == os.path.abspath(checkpoint_path(self.cfg.out, self.step)):
            self._saved_step = self.step  # resuming from this run's own checkpoint of this step


_JSON_TENSOR = "__tensor_b64__"


def _tensor_to_json(t: torch.Tensor) -> dict:
    """A small CPU-copyable tensor as JSON: its dtype, shape and raw bytes in base64."""
    a = t.detach().cpu().contiguous().numpy()
    return {_JSON_TENSOR: base64.b64encode(a.tobytes()).decode("ascii"), "dtype": str(a.dtype),
            "shape": list(a.shape)}


def _is_json_tensor(v) -> bool:
    return isinstance(v, dict) and _JSON_TENSOR in v


def _tensor_from_json(d: dict) -> torch.Tensor:
    a = np.frombuffer(base64.b64decode(d[_JSON_TENSOR]), dtype=np.dtype(d["dtype"])).reshape(d["shape"])
    return torch.from_numpy(a.copy())


def _quiet(*args, **kwargs) -> None:
    """The log of ranks other than 0."""


class _Layers(torch.nn.Module):
    """A module holding the stand-ins, so that mla_layers finds them in the model's order."""

    def __init__(self, layers: list):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)


class _RowScales(GatedMLA):
    """A Gated MLA layer's head geometry with [rows, 1] ones-weights in place of q_b_proj / kv_b_proj: QK-Clip
    applied to it leaves each weight row's scale in these columns."""

    def __init__(self, m: GatedMLA):
        torch.nn.Module.__init__(self)
        self.layer_idx, self.num_heads, self.dn, self.dr, self.dv = m.layer_idx, m.num_heads, m.dn, m.dr, m.dv
        dev = m.q_b_proj.weight.device
        self.q_b_proj = _Ones(m.q_b_proj.weight.shape[0], dev)
        self.kv_b_proj = _Ones(m.kv_b_proj.weight.shape[0], dev)


class _Ones(torch.nn.Module):
    def __init__(self, rows: int, device: torch.device):
        super().__init__()
        self.weight = torch.ones(rows, 1, dtype=torch.float64, device=device)


def _scale_rows_(w: torch.Tensor, scale: torch.Tensor) -> None:
    """w[i, :] *= scale[i] (fp64 product, rounded once, as QK-Clip does), on this rank's rows of a sharded w."""
    if isinstance(w, DTensor):
        mesh = w.device_mesh
        rows = DTensor.from_local(scale, mesh, [Replicate()] * mesh.ndim).redistribute(mesh, w.placements)
        local, scale = w.to_local(), rows.to_local()
    else:
        local = w.data
    if local.numel():
        local.copy_((local.double() * scale.to(local.device)[:, None]).to(local.dtype))
