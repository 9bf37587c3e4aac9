"""Losses with their own per-token tensors through `DistributedTrainer` (gloo, 2 ranks) against the single-process
Trainer on the same global batch: MOPD's MOPDLoss under --cp 2 (every row split in two, its behaviour and teacher
log-probs realigned and cut with the labels, responses crossing the cut) and under --dp-shard 2 (the two halves of
the batch holding very different numbers of response tokens, so only the global token count as `step_tokens` gives
the single-process mean), and RL's RLLoss (behaviour log-probs, advantages, staleness) under --cp 2.

Each run checks the first batch's gradients, the reported loss of every step and the weights after the last step
against the single process's; under --cp also the loss's own statistics, each rank's its segment's share.

Tolerances (fp32): the data-parallel run computes each row exactly as the single process's micro-batches do and
differs only in how FSDP2 sums the halves' gradients (here bitwise equal: the step's token count / 2 is exact) and
in the reported loss's division by that count / 2 then by 2 (observed 6e-7 relative): losses 1e-5 relative,
gradients 1e-5 of each tensor's largest entry. The context-parallel runs compute in another order (KCP's prefix
composition, attention over gathered rows, the segments' token sums): losses 1e-5 (observed 1.2e-6), gradients
2e-4 of each tensor's largest entry (observed 2e-5 MOPD, 5.6e-5 RL, on KDA's dt_bias / A_log, whose gradients sum
over the whole row; test_train_distributed.py sees 6e-5 there too). Weights after the steps: Per-Head Muon's
whole-block orthogonalization keeps the gradients' precision (1e-4; observed 2.7e-5), AdamW's update
m / (sqrt(v) + eps) is blind to a gradient's size and enlarges the rounding of near-zero ones (1e-3, see
test_train_distributed.py's ADAMW_TOL; observed 1.9e-4 on the embedding). The mistakes these tests are for move
far more: per-token tensors cut without the shift (losses 0.25 and 4.0 relative, gradients O(1)), log-probs read
in the single-process alignment under --cp (0.15 and 1.6), per-rank token means under --dp-shard (0.40).
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import randomize_, rel_err

from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.posttrain.distill import MOPDLoss
from k3.rl.loss import RLLoss, RLLossConfig
from k3.train.trainer import TrainConfig, Trainer

ROWS, T, STEPS, V = 4, 32, 2, 512
R_MAX = 0.6
LOSS_TOL = 1e-5
GRAD_TOL = {"dp": 1e-5, "cp": 2e-4}
MUON_TOL, ADAMW_TOL = 1e-4, 1e-3


def _model() -> K3ForCausalLM:
    cfg = K3Config.from_preset("tiny").replace(vocab_size=V, eos_token_id=0, pad_token_id=0,
                                               num_nextn_predict_layers=0)
    return randomize_(K3ForCausalLM(cfg), seed=0)


def _rows() -> dict:
    """Rows of prompt + response, right-padded (the padding its own document). Rows 0-1 (the first data rank's half)
    hold 3 and 4 response tokens, rows 2-3 21 and 29, and those responses cross the middle (the cp cut, at 16)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, V, (ROWS, T), generator=g)
    prompt = torch.tensor([[5], [4], [6], [3]])
    length = torch.tensor([[8], [8], [27], [T]])
    pos = torch.arange(T)
    seg = (pos >= length).long()
    ids = torch.where(seg == 0, ids, torch.zeros_like(ids))
    resp = (pos >= prompt) & (pos < length)
    labels = torch.where(resp, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels, "segment_ids": seg, "resp": resp}


def _logprobs(model, b) -> torch.Tensor:
    """log p(token t) at t (0 at t = 0), the current weights, whole rows."""
    with torch.no_grad():
        logits = model(b["input_ids"], segment_ids=b["segment_ids"]).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ROWS, 1), lp], 1)


def mopd_batch() -> dict:
    """MOPD's batch (k3.posttrain.distill): teacher and behaviour log-probs near the student's at the response
    tokens (the teacher's lower, so the reward is clearly non-zero and some tokens clip at R_MAX)."""
    b = _rows()
    resp = b.pop("resp")
    lp = _logprobs(_model(), b)
    g = torch.Generator().manual_seed(2)
    b["teacher"] = (lp - 0.5 + 0.8 * torch.randn(ROWS, T, generator=g)) * resp
    b["behaviour"] = (lp + 0.1 * torch.randn(ROWS, T, generator=g)) * resp
    return b


def rl_batch() -> dict:
    """RL's batch (k3.rl.trainer): behaviour log-probs near the policy's, each row's advantage at its sampled tokens,
    and each token's staleness (policy versions behind: partial rollouts mix versions within a row)."""
    b = _rows()
    resp = b.pop("resp")
    lp = _logprobs(_model(), b)
    g = torch.Generator().manual_seed(3)
    b["behaviour"] = (lp + 0.3 * torch.randn(ROWS, T, generator=g)) * resp
    b["advantage"] = torch.tensor([[0.8], [-1.1], [0.5], [-0.4]]).expand(ROWS, T) * resp
    b["staleness"] = torch.randint(0, 3, (ROWS, T), generator=g) * resp
    return b


class _Recording:
    """A loss that records each micro-batch's reported share of the step's loss."""

    def __init__(self, loss):
        self.loss, self.values = loss, []

    def __call__(self, model, mb):
        out = self.loss(model, mb)
        self.values.append(float(out.value))
        return out


LOSSES = {"mopd": (lambda: _Recording(MOPDLoss(R_MAX)), mopd_batch),
          "rl": (lambda: _Recording(RLLoss(RLLossConfig(tau=0.05))), rl_batch)}
STATS = {"mopd": ("reward_sum", "log_ratio_sum", "tokens", "clipped"), "rl": ("tokens", "masked", "by_staleness")}


class _Batches:
    """The loader of a run that trains on one fixed batch."""

    num_rows, tokens_per_epoch = ROWS, ROWS * T

    def __init__(self, batch):
        self.batch = batch

    def next_batch(self):
        return {k: v.clone() for k, v in self.batch.items()}

    def state_dict(self):
        return {}

    def load_state_dict(self, st):
        pass


def _config(out: str, mode: str) -> TrainConfig:
    # micro-batches of 2 rows: the single process's are the data ranks' halves; under --cp one row per forward
    return TrainConfig(out=out, max_steps=STEPS, seq_len=T, batch_tokens=ROWS * T, eval_every=10**6, lr=1e-2,
                       micro_batch_rows=1 if mode == "cp" else ROWS // 2)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _stats(extras: list[dict], keys) -> dict:
    """The loss's statistics of one step over its micro-batches: per-row ones ([rows] each) by row, the others
    added up."""
    out = {}
    for k in keys:
        vals = [x[k].detach().double().cpu() for x in extras]
        per_row = k in ("reward_sum", "log_ratio_sum") or (k == "tokens" and vals[0].dim() == 1)
        out[k] = torch.cat(vals) if per_row else torch.stack(vals).sum(0)
    return out


def run(trainer, keys) -> dict:
    """The first batch's gradients (reduced), every step's reported loss, the first batch's statistics and
    micro-batch values, and the weights after the steps (full tensors) of `trainer`; collective when it is
    distributed."""
    batch = trainer._next_batch()
    bias = [m.gate.e_score_correction_bias.clone() for m in trainer.moe_layers]
    _, _, extras = trainer._accumulate(batch, trainer.cfg.micro_batch_rows, bias)
    trainer._all_reduce_grads()
    grads = {n: _full(p.grad).detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.optimizer.zero_grad(set_to_none=True)
    for bal in trainer.balancers:
        bal.discard()
    if trainer.max_logits is not None:
        trainer.max_logits.discard()
    losses = [trainer.train_step().loss for _ in range(STEPS)]
    params = {n: _full(p).detach().clone() for n, p in trainer.model.named_parameters()}
    return {"grads": grads, "losses": losses, "stats": _stats(extras, keys), "params": params,
            "values": list(trainer.loss.values)}


def init(rank: int, world: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))


def worker(rank: int, world: int, store: str, out: str, kind: str, mode: str, batch: dict) -> None:
    from k3.parallel.mesh import ParallelDims
    from k3.parallel.parallelize import ParallelizeOptions, parallelize
    from k3.train.distributed import DistributedTrainer

    init(rank, world, store)
    try:
        model = _model()
        mesh = ParallelDims.from_flags(world, None, cp=2 if mode == "cp" else 1).build_mesh("cpu")
        parallelize(model, mesh, ParallelizeOptions())
        trainer = DistributedTrainer(model, _config(out, mode), _Batches(batch), mesh, loss=LOSSES[kind][0]())
        got = run(trainer, STATS[kind])
        torch.save(got, f"{out}-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def batches():
    torch.set_num_threads(1)
    return {kind: make() for kind, (_, make) in LOSSES.items()}


def single_process(tmp_path, kind: str, mode: str, batch: dict) -> dict:
    model = _model()
    return run(Trainer(model, _config(str(tmp_path / "single"), mode), _Batches(batch), log=lambda *a: None,
                       loss=LOSSES[kind][0]()), STATS[kind])


def distributed(tmp_path, kind: str, mode: str, batch: dict) -> list[dict]:
    out = str(tmp_path / "run")
    mp.start_processes(worker, args=(2, str(tmp_path / "store"), out, kind, mode, batch), nprocs=2,
                       start_method="fork")
    return [torch.load(f"{out}-{r}.pt") for r in range(2)]


def _adamw_names() -> set[str]:
    from k3.train.per_head_muon import describe_param_groups

    return {n for n, rule in describe_param_groups(_model()).items() if rule.startswith("adamw")}


def check(got: dict, ref: dict, mode: str) -> None:
    """A rank's run against the single process's: losses, first gradients, weights after the steps."""
    for s, (a, b) in enumerate(zip(got["losses"], ref["losses"]), start=1):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"step {s}: loss {a} vs single-process {b}"
    assert got["grads"].keys() == ref["grads"].keys()
    for n, g in got["grads"].items():
        err = rel_err(g, ref["grads"][n])
        assert err <= GRAD_TOL[mode], f"gradient of {n} differs from the single-process one by {err:.2e}"
    adamw = _adamw_names()
    for n, p in got["params"].items():
        tol = ADAMW_TOL if n in adamw else MUON_TOL
        err = rel_err(p, ref["params"][n])
        assert err <= tol, f"{n} after {STEPS} steps differs from the single-process one by {err:.2e}"


@pytest.mark.parametrize("kind", ["mopd", "rl"])
def test_per_token_loss_under_context_parallel_matches_single_process(tmp_path, batches, kind):
    # --cp 2: each row's labels, log-probs, advantages and staleness shifted one place left and cut at token 16,
    # where the long responses continue on the second rank (their first token there predicted by the first rank's
    # last position), against one process taking the same rows one per forward.
    batch = batches[kind]
    ref = single_process(tmp_path, kind, "cp", batch)
    ranks = distributed(tmp_path, kind, "cp", batch)
    for got in ranks:
        check(got, ref, "cp")
    # the loss's statistics are each rank's segment's: together (by row, by staleness) the single process's
    for k, want in ref["stats"].items():
        torch.testing.assert_close(ranks[0]["stats"][k] + ranks[1]["stats"][k], want, rtol=1e-5, atol=1e-5, msg=k)
    if kind == "mopd":  # both halves of the long rows hold response tokens; the clip at R_MAX takes part
        assert all((r["stats"]["tokens"][2:] > 0).all() for r in ranks) and ref["stats"]["clipped"] > 0


def test_mopd_loss_under_data_parallel_is_the_global_token_mean(tmp_path, batches):
    # --dp-shard 2: rank 0 trains rows 0-1 (7 response tokens), rank 1 rows 2-3 (50); each divides its token sum by
    # the global count / 2, so FSDP2's average over the ranks is the single process's global token mean.
    batch = batches["mopd"]
    ref = single_process(tmp_path, "mopd", "dp", batch)
    ranks = distributed(tmp_path, "mopd", "dp", batch)
    for got in ranks:
        check(got, ref, "dp")
    n = [int((batch["labels"][h:h + 2, 1:] != -100).sum()) for h in (0, 2)]
    assert [int(r["stats"]["tokens"].sum()) for r in ranks] == n
    # per-rank token means (each rank's sum / its own count) would report and train their average instead: with
    # these halves far outside the tolerance. The single process's micro-batches are the halves: value_h = S_h / N.
    v = ref["values"][:2]
    mean_of_means = (v[0] * sum(n) / n[0] + v[1] * sum(n) / n[1]) / 2
    assert abs(mean_of_means - ref["losses"][0]) > 1e3 * LOSS_TOL * abs(ref["losses"][0])
