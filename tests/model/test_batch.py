"""The per-batch record (k3.model.batch.BatchInfo): construction, its checks, and the model reading it."""

import dataclasses

import pytest
import torch

from helpers import randomize_, rel_err
from k3.model.batch import BatchInfo, packed_cu_seqlens
from k3.model.model import K3ForCausalLM


def _seg():
    seg = torch.zeros(2, 12, dtype=torch.long)
    seg[0, 5:] = 1
    seg[1, 3:] = 1
    seg[1, 8:] = 2
    return seg


def test_from_segment_ids_on_the_host_has_both_offsets():
    seg = _seg()
    info = BatchInfo.from_segment_ids(seg)
    want = torch.tensor([0, 5, 12, 15, 20, 24])
    assert torch.equal(packed_cu_seqlens(seg), want)
    assert info.segment_ids is seg and torch.equal(info.cu_seqlens, want) and torch.equal(info.cu_seqlens_cpu, want)
    assert info.cu_seqlens_cpu.device.type == "cpu" and info.logit_positions is None
    given = BatchInfo.from_segment_ids(seg, cu_seqlens_cpu=want.to(torch.int32))
    assert given.cu_seqlens.dtype == torch.int64 and torch.equal(given.cu_seqlens, want)
    moved = info.to("cpu")
    assert torch.equal(moved.cu_seqlens, want) and moved.cu_seqlens_cpu is info.cu_seqlens_cpu
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.segment_ids = None


def test_from_lengths_packs_documents_one_after_another():
    info = BatchInfo.from_lengths([3, 1, 4], logits_at_ends=True)
    assert info.segment_ids.tolist() == [[0, 0, 0, 1, 2, 2, 2, 2]]
    assert info.cu_seqlens.tolist() == info.cu_seqlens_cpu.tolist() == [0, 3, 4, 8]
    assert info.logit_positions.tolist() == [2, 3, 7]
    assert torch.equal(info.cu_seqlens, packed_cu_seqlens(info.segment_ids))
    rows = BatchInfo.from_lengths([[5, 7], [3, 5, 4]])
    assert torch.equal(rows.segment_ids, _seg()) and rows.cu_seqlens.tolist() == [0, 5, 12, 15, 20, 24]
    assert rows.logit_positions is None


@pytest.mark.parametrize("lengths, match", [
    ([3, 0], "positive ints"),
    ([2, 1.5], "positive ints"),
    ([], "at least one document"),
    ([[2, 2], [3]], "same number of tokens"),
])
def test_from_lengths_rejects_bad_lengths(lengths, match):
    with pytest.raises(ValueError, match=match):
        BatchInfo.from_lengths(lengths)


def test_from_lengths_logits_at_ends_needs_one_row():
    with pytest.raises(ValueError, match="one row"):
        BatchInfo.from_lengths([[2, 2], [4]], logits_at_ends=True)


def test_the_record_checks_its_fields():
    seg = _seg()
    cu = packed_cu_seqlens(seg)
    cases = [
        (dict(segment_ids=seg.float()), "segment_ids must be an integer"),
        (dict(segment_ids=seg[0]), r"segment_ids must be an integer \[batch, tokens\]"),
        (dict(cu_seqlens=cu), "cu_seqlens needs the segment_ids"),
        (dict(cu_seqlens_cpu=cu), "cu_seqlens_cpu needs the segment_ids"),
        (dict(segment_ids=seg, cu_seqlens=cu[None]), "cu_seqlens must be a 1-D integer tensor"),
        (dict(segment_ids=seg, cu_seqlens=cu, cu_seqlens_cpu=cu[None]), "1-D host tensor"),
        (dict(segment_ids=seg, cu_seqlens=cu, cu_seqlens_cpu=cu.to("meta")), "1-D host tensor"),
        (dict(segment_ids=seg, cu_seqlens=cu, cu_seqlens_cpu=cu.float()), "1-D host tensor"),
        (dict(segment_ids=seg, cu_seqlens=cu, cu_seqlens_cpu=cu.flip(0)), r"rise strictly from 0 to B\*T = 24"),
        (dict(segment_ids=seg, cu_seqlens=cu, cu_seqlens_cpu=cu[:-1]), r"to B\*T = 24"),
        (dict(segment_ids=seg, cu_seqlens=cu[:-1], cu_seqlens_cpu=cu), "must be the same offsets"),
        (dict(segment_ids=seg, cu_seqlens_cpu=cu), "host copy of cu_seqlens"),
        (dict(logit_positions=torch.zeros(2, 2, dtype=torch.long)), "logit_positions must be a 1-D integer"),
        (dict(logit_positions=torch.zeros(2)), "logit_positions must be a 1-D integer"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            BatchInfo(**kwargs)
    with pytest.raises(ValueError, match="segment_ids must be an integer"):
        BatchInfo.from_segment_ids(seg.float())
    with pytest.raises(ValueError, match="1-D host tensor"):
        BatchInfo.from_segment_ids(seg, cu_seqlens_cpu=cu.to("meta"))
    BatchInfo(segment_ids=seg)  # segment ids alone: for a stack without KDA layers (the MTP block)
    BatchInfo(logit_positions=torch.tensor([3]))


def test_shifted_keeps_the_segment_ids_of_the_later_positions():
    seg = _seg()
    s = BatchInfo.from_segment_ids(seg).shifted(2)
    assert torch.equal(s.segment_ids, seg[:, 2:]) and s.cu_seqlens is None and s.cu_seqlens_cpu is None
    assert BatchInfo().shifted(1).segment_ids is None


@torch.no_grad()
def test_model_reads_the_record_as_it_read_segment_ids(tiny_cfg):
    model = randomize_(K3ForCausalLM(tiny_cfg), seed=3).eval()
    lens = [[7, 9], [4, 12]]
    info = BatchInfo.from_lengths(lens)
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = model(ids, segment_ids=info.segment_ids).logits
    assert torch.equal(model(ids, batch=info).logits, ref)
    # each document alone gives the same logits (MLA and KDA both stop at the document's start)
    parts = []
    for r, row in enumerate(lens):
        start = 0
        for n in row:
            parts.append(rel_err(model(ids[r:r + 1, start:start + n]).logits, ref[r:r + 1, start:start + n]))
            start += n
    assert max(parts) < 1e-4
    # logit_positions: the logits of those positions only
    one = BatchInfo.from_lengths([5, 6, 5], logits_at_ends=True)
    ids1 = ids[:1]
    out = model(ids1, batch=one).logits
    full = model(ids1, segment_ids=one.segment_ids).logits
    # (the head's GEMM over 3 rows instead of 16 may round differently: fp32 ~1e-6)
    assert out.shape == (1, 3, tiny_cfg.vocab_size) and rel_err(out, full[:, [4, 10, 15]]) < 1e-6


def test_model_checks_the_record_against_its_input(tiny_cfg):
    model = K3ForCausalLM(tiny_cfg).init_weights(seed=0).eval()
    ids = torch.randint(0, tiny_cfg.vocab_size, (2, 12))
    seg = _seg()
    with pytest.raises(ValueError, match=r"segment_ids must have the input's shape \[batch=2, tokens=12\]"):
        model(ids, batch=BatchInfo.from_segment_ids(seg[:, :10]))
    with pytest.raises(ValueError, match="not both"):
        model(ids, segment_ids=seg, batch=BatchInfo.from_segment_ids(seg))
    with pytest.raises(ValueError, match="segment_ids must be an integer"):
        model(ids, segment_ids=seg.float())
    with pytest.raises(ValueError, match="no logits_to_keep and no labels"):
        model(ids, labels=ids, batch=BatchInfo(logit_positions=torch.tensor([3])))
    with pytest.raises(ValueError, match="no logits_to_keep"):
        model(ids, logits_to_keep=1, batch=BatchInfo(logit_positions=torch.tensor([3])))
    with pytest.raises(ValueError, match="need a packed cache"):
        model(ids, cache=model.new_cache(), segment_ids=seg)
    # a KDA layer needs the documents' offsets, which a record of segment ids alone does not have
    with pytest.raises(ValueError, match="KDA layers need the documents' offsets"):
        model(ids, batch=BatchInfo(segment_ids=seg))


def test_flex_block_mask_is_built_once_per_record():
    pytest.importorskip("torch.nn.attention.flex_attention")
    info = BatchInfo.from_segment_ids(_seg())
    a = info.flex_block_mask(torch.device("cpu"))
    assert info.flex_block_mask(torch.device("cpu")) is a
    assert BatchInfo.from_segment_ids(_seg()).flex_block_mask(torch.device("cpu")) is not a  # another batch


def test_rebuilt_field_by_field_the_record_keeps_one_memo():
    # FSDP2's mixed-precision input cast rebuilds each dataclass argument of a unit field by field
    # (dataclasses.replace with every field) and copies dicts; the record must survive that, and its copies must
    # share the per-batch values (the flex block mask is built once per forward, not once per layer).
    import dataclasses

    from torch.distributed.utils import _apply_to_tensors

    info = BatchInfo.from_lengths([[3, 5]])
    copy = dataclasses.replace(info, **{f.name: getattr(info, f.name) for f in dataclasses.fields(info)})
    cast = _apply_to_tensors(lambda t: t.clone(), {"batch": info})["batch"]
    for other in (copy, cast):
        assert isinstance(other, BatchInfo) and torch.equal(other.segment_ids, info.segment_ids)
        assert other._memo is info._memo
