"""The model under context parallelism (report §5.1.2): a tiny fp32 K3ForCausalLM's forward and backward on one
packed row split over 2 gloo ranks (KDA through KCP, the short conv with its carried inputs, Gated MLA over the
gathered latent, each rank's loss its tokens' share of the row's mean) against the single-process forward and
backward on the whole row: the loss (summed over the ranks) within 1e-5, every parameter's gradient (summed over
the ranks) within 5e-5 relative to its largest entry (the KCP tests' gradient bound)."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import rel_err

from k3.config import K3Config
from k3.model.batch import BatchInfo
from k3.model.model import K3ForCausalLM
from k3.parallel.context_parallel import aligned_labels, cp_batch_info, split_packed_batch

T, DOCS = 64, [0, 20, 64]  # the second document crosses the cut at 32


def tiny_model() -> K3ForCausalLM:
    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=0)
    return K3ForCausalLM(cfg).init_weights(seed=0).float()


def row():
    gen = torch.Generator().manual_seed(1)
    cfg = K3Config.from_preset("tiny")
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=gen)
    seg = torch.repeat_interleave(torch.arange(len(DOCS) - 1), torch.tensor(DOCS).diff())[None]
    labels = ids.clone()
    labels[0, 5] = -100  # an ignored label
    return ids, seg, labels


def worker(rank: int, P: int, store: str, out: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=P,
                            timeout=datetime.timedelta(seconds=60))
    try:
        model = tiny_model()
        ids, seg, labels = row()
        part = split_packed_batch(ids, seg, P, labels=aligned_labels(labels))[rank]
        out_ = model(part.input_ids, labels=part.labels, batch=cp_batch_info(part, None), return_logits=False,
                     check_ids=False)
        out_.loss.backward()
        loss = out_.loss.detach().clone()
        dist.all_reduce(loss)
        grads = {}
        for n, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[n] = g
        if rank == 0:
            torch.save({"loss": loss, "grads": grads}, f"{out}/cp.pt")
    finally:
        dist.destroy_process_group()


def test_model_forward_backward_over_two_ranks_matches_single_process(tmp_path):
    mp.start_processes(worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, start_method="fork")
    got = torch.load(tmp_path / "cp.pt")
    model = tiny_model()
    ids, seg, labels = row()
    loss = model(ids, labels=labels, batch=BatchInfo.from_segment_ids(seg), return_logits=False).loss
    loss.backward()
    assert rel_err(got["loss"], loss.detach()) < 1e-5
    for n, p in model.named_parameters():
        want = p.grad if p.grad is not None else torch.zeros_like(p)
        if want.abs().max() == 0:
            assert got["grads"][n].abs().max() == 0, n
            continue
        assert rel_err(got["grads"][n], want) < 5e-5, (n, rel_err(got["grads"][n], want))


def test_mtp_under_context_parallelism_raises():
    cfg = K3Config.from_preset("tiny").replace(num_nextn_predict_layers=1)
    model = K3ForCausalLM(cfg).init_weights(seed=0).float()

    class OneRank:  # a one-segment group: counts pass through
        def token_count(self, n):
            return n

    ids, seg, labels = row()
    info = BatchInfo.from_segment_ids(seg, context=OneRank())
    with pytest.raises(ValueError, match="multi-token prediction"):  # the loss refuses before anything runs
        model._context_loss(torch.zeros(1, T, cfg.hidden_size), None, aligned_labels(labels), info.context)
