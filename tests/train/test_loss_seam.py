"""The Trainer's loss seam (k3.train.losses): each run's loss, driven through `Trainer._accumulate` in micro-batches
of unequal sizes, gives the step loss and the gradients of the same loss written out here from its definition on
plain forwards (not through the seam); a loss with its own per-token tensors and statistics (an RL loss's shape)
plugs into the plain Trainer.

Tolerances (fp32 on CPU): the seam and the direct computation differ only in summation order (micro-batch sums vs
whole-batch sums, chunked head loss vs full logits), ~1e-7 relative seen: losses at 1e-6 relative, gradients at
1e-5 of each tensor's largest entry."""

import pytest
import torch
import torch.nn.functional as F

from helpers import randomize_
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.posttrain.distill import MOPDLoss
from k3.train.losses import LossOutput, MicroBatch
from k3.train.trainer import Trainer, TrainConfig

ROWS, T, MB = 5, 24, 2  # micro-batches of 2, 2 and 1 rows


class _Batches:
    """The loader of a run that trains on one fixed batch."""

    def __init__(self, batch):
        self.batch, self.num_rows, self.tokens_per_epoch = batch, ROWS, ROWS * T

    def next_batch(self):
        return {k: v.clone() for k, v in self.batch.items()}

    def state_dict(self):
        return {}


def _model(mtp: bool, seed=0):
    cfg = K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0,
                                               **({} if mtp else {"num_nextn_predict_layers": 0}))
    torch.manual_seed(seed)
    return randomize_(K3ForCausalLM(cfg), seed=seed)


def _trainer(tmp_path, model, batch, loss=None, cls=Trainer):
    tc = TrainConfig(out=str(tmp_path), max_steps=1, seq_len=T, batch_tokens=ROWS * T, micro_batch_rows=MB)
    return cls(model, tc, _Batches(batch), log=lambda *a: None, loss=loss)


def _seam(tr, batch):
    """(the step's reported loss, MTP loss, the loss's statistics per micro-batch, the gradients) through the seam."""
    bias = [m.gate.e_score_correction_bias.clone() for m in tr.moe_layers]
    loss, mtp, extras = tr._accumulate(batch, MB, bias)
    grads = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}
    tr.model.zero_grad(set_to_none=True)
    return loss, mtp, extras, grads


def _direct_grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_grads_close(got, want):
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-5 * float(want[n].abs().max()) + 1e-12, msg=n)


def _sft_batch(seed=0):
    """Rows of two documents each, a random 40% of the tokens labelled (SFT's reply tokens)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (ROWS, T), generator=g)
    seg = (torch.arange(T) >= torch.randint(4, T - 4, (ROWS, 1), generator=g)).long()
    labels = torch.where(torch.rand(ROWS, T, generator=g) < 0.4, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels, "segment_ids": seg}


def test_next_token_loss_is_the_row_weighted_mean_of_micro_batch_losses(tmp_path):
    model = _model(mtp=True)
    batch = _sft_batch()
    loss, mtp, extras, grads = _seam(_trainer(tmp_path, model, batch), batch)
    # by definition: micro-batch i's mean cross-entropy over its labelled tokens (+ 0.3 x its MTP loss), weighted by
    # its share of the rows; from the full logits (the seam's loss uses the chunked head loss)
    want, want_ce, want_mtp = 0, 0.0, 0.0
    for s in range(0, ROWS, MB):
        part = {k: v[s:s + MB] for k, v in batch.items()}
        out = model(part["input_ids"], labels=part["labels"], segment_ids=part["segment_ids"])
        ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, 512), part["labels"][:, 1:].reshape(-1), ignore_index=-100)
        w = part["input_ids"].shape[0] / ROWS
        want = want + w * (ce + 0.3 * out.mtp_loss)
        want_ce += w * float(ce.detach())
        want_mtp += w * float(out.mtp_loss.detach())
    assert float(loss) == pytest.approx(want_ce, rel=1e-6)
    assert float(mtp) == pytest.approx(want_mtp, rel=1e-6)
    assert extras == [{}, {}, {}]
    _assert_grads_close(grads, _direct_grads(model, want))


def _mopd_batch(model, seed=1):
    """MOPD rows: prompt + response, right-padded (the padding its own document); teacher and behaviour log-probs
    near the student's at the response tokens (the teacher's lower, so the reward is clearly non-zero)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 512, (ROWS, T), generator=g)
    prompt = torch.randint(3, 8, (ROWS, 1), generator=g)
    length = torch.randint(12, T + 1, (ROWS, 1), generator=g)
    pos = torch.arange(T)
    seg = (pos >= length).long()
    ids = torch.where(seg == 0, ids, torch.zeros_like(ids))
    resp = (pos >= prompt) & (pos < length)
    labels = torch.where(resp, ids, torch.full_like(ids, -100))
    with torch.no_grad():
        lp = _logprobs(model(ids, segment_ids=seg).logits, ids)
    teacher = (lp - 0.5 + 0.8 * torch.randn(ROWS, T, generator=g)) * resp
    behaviour = (lp + 0.1 * torch.randn(ROWS, T, generator=g)) * resp
    return {"input_ids": ids, "labels": labels, "segment_ids": seg, "behaviour": behaviour, "teacher": teacher}


def _logprobs(logits, ids):
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp], 1)


def test_mopd_loss_is_eq15_over_the_whole_step(tmp_path):
    model = _model(mtp=False)
    batch = _mopd_batch(model)
    r_max = 0.6
    loss, mtp, extras, grads = _seam(_trainer(tmp_path, model, batch, loss=MOPDLoss(r_max)), batch)
    assert mtp is None and len(extras) == 3
    # eq. 15 on the whole batch: L = -(1/N) sum rho_t r_t over the N response tokens,
    # r_t = clip(sg(log pi_teacher - log pi_student), +-R), rho_t = exp(log pi_student - log mu)
    lp = _logprobs(model(batch["input_ids"], segment_ids=batch["segment_ids"]).logits, batch["input_ids"])
    mask = batch["labels"] != -100
    raw = batch["teacher"] - lp.detach()
    r = raw.clamp(-r_max, r_max) * mask
    rho = torch.exp(torch.where(mask, lp - batch["behaviour"], torch.zeros_like(lp)))
    want = -(rho * r).sum() / mask.sum()
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-6) and abs(float(want.detach())) > 0.1
    _assert_grads_close(grads, _direct_grads(model, want))
    # its statistics, per micro-batch, as outputs
    cat = {k: torch.cat([x[k] for x in extras]) for k in ("reward_sum", "log_ratio_sum", "tokens")}
    torch.testing.assert_close(cat["reward_sum"], r.sum(-1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(cat["log_ratio_sum"], (-raw * mask).sum(-1), rtol=1e-6, atol=1e-5)
    assert cat["tokens"].tolist() == mask.sum(-1).float().tolist()
    assert sum(int(x["clipped"]) for x in extras) == int(((raw.abs() > r_max) & mask).sum()) > 0
    assert max(float(x["max_ratio"]) for x in extras) == pytest.approx(float((rho.detach() * mask).max()), rel=1e-6)


class _AdvantageLoss:
    """An RL-shaped loss: per-token advantages and behaviour log-probs from the batch, an importance-weighted
    policy gradient plus a penalty term, its own statistics returned."""

    def __init__(self, beta):
        self.beta, self.seen = beta, []

    def __call__(self, model, mb: MicroBatch) -> LossOutput:
        t = mb.tensors
        self.seen.append((t["row"][:, 0].tolist(), mb.rows))
        out = model(t["input_ids"], batch=mb.info, check_ids=False, stats=mb.stats)
        lp = _logprobs(out.logits, t["input_ids"])
        mask = t["labels"] != -100
        ratio = torch.exp(torch.where(mask, lp - t["behaviour"], torch.zeros_like(lp)))
        pg = -(ratio * t["advantages"] * mask).sum()
        penalty = ((lp - t["behaviour"]) ** 2 * mask).sum()
        loss = (pg + self.beta * penalty) / mb.step_tokens
        return LossOutput(loss, loss.detach().double(), out.stats,
                          extra={"penalty": penalty.detach(), "tokens": mask.sum()})


class _RLTrainer(Trainer):
    def _finish_step(self, metrics, extras):
        self.extras = extras
        return metrics


def test_an_rl_loss_plugs_in_with_its_tensors_and_statistics(tmp_path):
    model = _model(mtp=False)
    batch = _mopd_batch(model)
    batch["advantages"] = torch.randn(ROWS, T, generator=torch.Generator().manual_seed(2))
    batch["row"] = torch.arange(ROWS)[:, None].expand(ROWS, T).clone()
    loss = _AdvantageLoss(beta=0.1)
    tr = _trainer(tmp_path, model, batch, loss=loss, cls=_RLTrainer)
    with torch.no_grad():  # the penalty at the step's starting weights, on the whole batch
        lp = _logprobs(model(batch["input_ids"], segment_ids=batch["segment_ids"]).logits, batch["input_ids"])
    mask = batch["labels"] != -100
    penalty = float(((lp - batch["behaviour"]) ** 2 * mask).sum())
    before = [p.detach().clone() for p in model.parameters()]
    m = tr.train_step()
    # each micro-batch got its own rows of every per-token tensor, and its share of the step
    assert loss.seen == [([0, 1], 0.4), ([2, 3], 0.4), ([4], 0.2)]
    assert [int(x["tokens"]) for x in tr.extras] == [int(mask[s:s + MB].sum()) for s in range(0, ROWS, MB)]
    assert sum(float(x["penalty"]) for x in tr.extras) == pytest.approx(penalty, rel=1e-5)
    assert m.mtp_loss is None and not m.skipped and m.grad_norm > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
