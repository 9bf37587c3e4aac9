"""The model under context parallelism (report §5.1.2): a tiny fp32 K3ForCausalLM's forward and backward on one
packed row split over 2 gloo ranks (KDA through KCP, the short conv with its carried inputs, Gated MLA over the
gathered latent, the MTP layer reading the next segment's first token, each rank's losses its tokens' share of the
row's means) against the single-process forward and backward on the whole row: the losses (summed over the ranks)
within 1e-5, every parameter's gradient (summed over the ranks) within 5e-5 relative to its largest entry (the KCP
tests' gradient bound), and QK-Clip's per-head max logits (MAX over the ranks) within 1e-5: the same queries
against the same keys, their inputs differing by KCP's fp32 summation order only."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import rel_err

from k3.config import K3Config
from k3.model.batch import BatchInfo
from k3.model.model import K3ForCausalLM
from k3.parallel.context_parallel import aligned_labels, cp_batch_info, mtp_lengths, split_packed_batch

# The second document crosses the cut at 32; the third starts at 33, so the MTP position 31 (rank 0's last) reads
# token 32 of rank 1 and position 32 (rank 1's first) reads the third document's first token.
T, DOCS = 64, [0, 20, 33, 64]
MTP_WEIGHT = 0.3


def tiny_model(mtp: bool) -> K3ForCausalLM:
    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=int(mtp))
    return K3ForCausalLM(cfg).init_weights(seed=0).float()


def row():
    gen = torch.Generator().manual_seed(1)
    cfg = K3Config.from_preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    seg = torch.repeat_interleave(torch.arange(len(DOCS) - 1), torch.tensor(DOCS).diff())[None]
    labels = ids.clone()
    labels[0, 5] = -100  # an ignored label
    labels[0, torch.tensor(DOCS[1:-1])] = -100  # document starts, as the packer masks them
    return ids, seg, labels


def total(out) -> torch.Tensor:
    return out.loss + (MTP_WEIGHT * out.mtp_loss if out.mtp_loss is not None else 0.0)


def worker(rank: int, P: int, store: str, out: str, mtp: bool):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = tiny_model(mtp)
        ids, seg, labels = row()
        part = split_packed_batch(ids, seg, P, labels=aligned_labels(labels))[rank]
        out_ = model(part.input_ids, labels=part.labels, batch=cp_batch_info(part, None), return_logits=False,
                     check_ids=False, stats=("max_logit",))
        total(out_).backward()
        losses = torch.stack([out_.loss.detach(), out_.mtp_loss.detach() if mtp else torch.zeros(())])
        dist.all_reduce(losses)
        maxima = {i: m.clone() for i, m in out_.stats.max_logit.items()}
        for m in maxima.values():
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[n] = g
        if rank == 0:
            torch.save({"losses": losses, "grads": grads, "maxima": maxima}, f"{out}/cp.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mtp", [False, True], ids=["backbone", "mtp"])
def test_model_forward_backward_over_two_ranks_matches_single_process(tmp_path, mtp):
    mp.start_processes(worker, args=(2, str(tmp_path / "store"), str(tmp_path), mtp), nprocs=2, start_method="fork")
    got = torch.load(tmp_path / "cp.pt")
    model = tiny_model(mtp)
    ids, seg, labels = row()
    out = model(ids, labels=labels, batch=BatchInfo.from_segment_ids(seg), return_logits=False, stats=("max_logit",))
    total(out).backward()
    assert rel_err(got["losses"][0], out.loss.detach()) < 1e-5
    if mtp:
        assert rel_err(got["losses"][1], out.mtp_loss.detach()) < 1e-5
    assert got["maxima"].keys() == out.stats.max_logit.keys()
    assert len(got["maxima"]) == 2 + mtp  # the tiny backbone's two Gated MLA layers, and the MTP block's
    for i, m in out.stats.max_logit.items():
        assert rel_err(got["maxima"][i], m) < 1e-5, (i, got["maxima"][i], m)
    for n, p in model.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        if want.abs().max() == 0:
            assert got["grads"][n].abs().max() == 0, n
            continue
        assert rel_err(got["grads"][n], want) < 5e-5, (n, rel_err(got["grads"][n], want))


def test_mtp_lengths_cut_the_last_segment():
    assert mtp_lengths((32, 32), 1) == (32, 31)
    assert mtp_lengths((22, 21, 21), 2) == (22, 21, 19)
    with pytest.raises(ValueError, match="more than 2 tokens"):
        mtp_lengths((30, 2), 2)


def test_shifted_refuses_a_context_parallel_record():
    class OneRank:  # a one-segment group
        lengths = (T,)

    ids, seg, labels = row()
    info = BatchInfo.from_segment_ids(seg, context=OneRank())
    with pytest.raises(ValueError, match="next segments' tokens"):
        info.shifted(1)
