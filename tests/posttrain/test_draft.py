"""EAGLE-3 draft training (report §4.1.4): the LK loss and its gradient, W_E3 = [0 0 I] reproducing the MTP layer,
the 7-step training-time test (own outputs fed back; its masked attention equal to recurrent drafting), the draft's
loss through the Trainer's loss seam, the frozen target, the draft's files, and `k3 train-draft` end to end with
its error messages and its resume."""

import copy
import functools
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from helpers import randomize_
from k3.checkpoint import save_pretrained
from k3.config import K3Config
from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer
from k3.draft_checkpoint import DraftError, load_draft, save_draft
from k3.model.cache import MLACache
from k3.model.eagle3 import Eagle3Layer, default_feature_blocks
from k3.model.model import K3ForCausalLM
from k3.posttrain.eagle3 import (DraftOptions, DraftRows, DraftTrainer, acceptance, draft_batch, draft_train_config,
                                  kl_loss, lk_loss, target_features, ttt_loss, unroll)

VOCAB = 512


@functools.lru_cache(maxsize=None)
def _target(layers: int = 5):
    cfg = K3Config.from_preset("tiny").replace(vocab_size=VOCAB, eos_token_id=0)
    if layers != 5:
        cfg = cfg.replace(num_hidden_layers=layers, kda_layers=[i + 1 for i in range(layers) if i % 2 == 0],
                          full_attn_layers=[i + 1 for i in range(layers) if i % 2 == 1])
    return randomize_(K3ForCausalLM(cfg), seed=5).eval().requires_grad_(False)


def _random_fc(draft, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        draft.fc.weight.copy_(torch.randn(draft.fc.weight.shape, generator=g) * 0.05)
    return draft


def _batch(B=2, T=40, seed=0, doc_start=23):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    seg = torch.zeros_like(ids)
    seg[:, doc_start:] = 1
    return ids, seg


# --- losses ------------------------------------------------------------------------------------------------------
def test_lk_loss_and_gradient_match_the_direct_formula():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 11, generator=g, dtype=torch.float64) * 2
    z = (torch.randn(6, 11, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    p, q = torch.softmax(t, -1), torch.softmax(z, -1)
    direct = -torch.log(torch.minimum(p, q).sum(-1))
    got = lk_loss(t, z)
    torch.testing.assert_close(got.double(), direct, rtol=1e-6, atol=1e-7)  # the op computes in fp32
    # gradient: A = sum_x min(p, q); dA/dz_k = [q_k < p_k] q_k - q_k sum_{x: q_x < p_x} q_x; dL/dz = -dA/dz / A
    lk64 = -torch.logsumexp(torch.minimum(torch.log_softmax(t, -1), torch.log_softmax(z, -1)), -1)
    (gz,) = torch.autograd.grad(lk64.sum(), z)
    below = (q < p).double()
    A = torch.minimum(p, q).sum(-1, keepdim=True)
    hand = -(below * q - q * (below * q).sum(-1, keepdim=True)) / A
    torch.testing.assert_close(gz, hand.detach(), rtol=1e-10, atol=1e-12)
    # and against a double-precision central difference of the direct formula
    eps = 1e-6
    for r, k in [(0, 0), (2, 5), (5, 10)]:
        zp, zm = z.detach().clone(), z.detach().clone()
        zp[r, k] += eps
        zm[r, k] -= eps
        f = lambda zz: -torch.log(torch.minimum(p[r], torch.softmax(zz[r], -1)).sum())  # noqa: E731
        fd = (f(zp) - f(zm)) / (2 * eps)
        assert abs(float(fd) - float(gz[r, k])) < 1e-7
    # the fp32 op's gradient agrees with the double one to fp32 rounding
    z32 = z.detach().float().requires_grad_(True)
    (g32,) = torch.autograd.grad(lk_loss(t.float(), z32).sum(), z32)
    torch.testing.assert_close(g32.double(), gz, rtol=1e-4, atol=1e-6)
    # its value is minus the log of the acceptance rate
    torch.testing.assert_close(torch.exp(-got), acceptance(t, z).detach().double().float(), rtol=1e-6, atol=1e-7)


def test_kl_loss_is_kl_p_q():
    g = torch.Generator().manual_seed(1)
    t, z = torch.randn(4, 9, generator=g), torch.randn(4, 9, generator=g)
    want = torch.nn.functional.kl_div(torch.log_softmax(z, -1), torch.log_softmax(t, -1), log_target=True,
                                      reduction="none").sum(-1)
    torch.testing.assert_close(kl_loss(t, z), want, rtol=1e-6, atol=1e-6)
    assert float(kl_loss(t, t).abs().max()) < 1e-6 and float(lk_loss(t, t).abs().max()) < 1e-6


# --- the draft layer ---------------------------------------------------------------------------------------------
def test_fusion_at_init_is_the_pretrained_mtp_layer_exactly():
    m = _target()
    ids, _ = _batch(T=30)
    draft = Eagle3Layer.from_target(m)
    assert draft.blocks == default_feature_blocks(m.config) == (1, 2)  # tiny: 3 AttnRes blocks
    feats, _ = target_features(m, ids, torch.zeros_like(ids), draft.blocks)
    hidden = feats[..., -m.config.hidden_size:]
    emb = m.model.embed_tokens(ids[:, 1:])
    with torch.no_grad():
        want, _ = m.mtp[0](hidden[:, :-1], emb)
        got = draft(feats[:, :-1], emb, fused=True)
    # x [0 0 I] is exact in fp32 (each output is one product by 1 plus products by 0): equal bit for bit
    assert torch.equal(got, want)


def test_features_are_the_attn_res_block_outputs():
    m = _target()
    ids, _ = _batch(B=1, T=12)
    with torch.no_grad():  # both forwards in one grad mode: the ops pick their forms by it
        out = m(ids, features=(1, 2, 3))
    # block b = the sum of the outputs of layers 2(b - 1) and 2(b - 1) + 1 (two per layer: mixer and FFN), recorded
    # as the layers add them to a stream of their own
    from k3.model.attn_res import AttnResStream

    class Recording(AttnResStream):
        added = []

        def add(self, o):
            self.added.append(o)
            super().add(o)

    with torch.no_grad():
        stream = Recording(m.model.embed_tokens(ids), 2, m.config.rms_norm_eps)
        for layer in m.model.layers:
            layer(stream, None)
    outs = Recording.added
    assert len(outs) == 10
    for f, (lo, hi) in zip(out.features, [(0, 4), (4, 8), (8, 10)]):
        want = outs[lo]
        for o in outs[lo + 1:hi]:
            want = want + o
        assert torch.equal(f, want), (lo, (f - want).abs().max())
    with torch.no_grad():
        assert torch.equal(out.hidden_states, m(ids).hidden_states)  # asking for features changes nothing
    with pytest.raises(ValueError, match=r"AttnRes block 4 is out of range: this model has 3 blocks"):
        m(ids, features=(1, 4))
    with pytest.raises(ValueError, match=r"block 0 is out of range"):
        Eagle3Layer(m.config, (0, 2))
    assert default_feature_blocks(K3Config.from_preset("k3-mini")) == (1, 4)


# --- the training-time test --------------------------------------------------------------------------------------
def test_unroll_feeds_each_step_the_previous_steps_outputs():
    m = _target()
    draft = _random_fc(Eagle3Layer.from_target(m))
    ids, seg = _batch()
    u = unroll(m, draft, ids, seg)
    assert len(u.outputs) == 7
    feats, _ = target_features(m, ids, seg, draft.blocks)
    assert torch.equal(u.inputs[0], feats[:, :ids.shape[1] - 2])
    for j in range(1, 7):  # step j + 1's row p reads step j's output at row p - 1
        assert torch.equal(u.inputs[j][:, 1:], u.outputs[j - 1][:, :-1])
    # counted rows: anchor p - j >= 0 and target token in the anchor's document
    n = ids.shape[1] - 2
    for j, ok in enumerate(u.valid):
        for p in range(n):
            a = p - j
            want = a >= 0 and int(seg[0, a]) == int(seg[0, p + 2])
            assert bool(ok[0, p]) == want, (j, p)


def test_banded_ttt_attention_equals_the_explicit_mask_forward_and_backward():
    """`ttt_attention` (a causal band over the step-1 keys and one diagonal per later step, O(T^2 + j T)) against
    the explicit `ttt_mask` over every step's rows (O(j T^2)), for all 7 steps, rows of three documents: outputs
    and the gradients of q and of every step's latent rows within 1e-5 (fp32; the same finite scores summed in
    another order)."""
    from k3.posttrain.eagle3 import TTTContext

    m = _target()
    attn = next(mod for mod in Eagle3Layer.from_target(m).modules() if hasattr(mod, "masked"))
    g = torch.Generator().manual_seed(3)
    B, T, H = 2, 33, attn.num_heads
    doc = torch.zeros(B, T, dtype=torch.long)
    doc[:, 9:] = 1
    doc[1, 20:] = 2
    R, dr = attn.kv_b_proj.weight.shape[1], attn.dr
    steps = [(torch.randn(B, T, H, attn.dn + dr, generator=g).requires_grad_(),
              torch.randn(B, T, R, generator=g).requires_grad_(), torch.randn(B, T, dr, generator=g).requires_grad_())
             for _ in range(7)]
    w = torch.randn(7, B, T, H, attn.dv, generator=g)

    def run(exact):
        ctx = TTTContext(doc, exact_mask=exact)
        outs = [ctx.attend(attn, q, c, kr) for q, c, kr in steps]
        loss = sum((o * w[i]).sum() for i, o in enumerate(outs))
        grads = torch.autograd.grad(loss, [t for st in steps for t in st])
        return [o.detach() for o in outs], grads

    (got, dgot), (want, dwant) = run(False), run(True)
    for a, b in zip(got + list(dgot), want + list(dwant)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_ttt_mask_equals_recurrent_drafting():
    """Draft outputs of the training path at step j, position p equal those of drafting recurrently from the
    committed position a = p - (j - 1) with a decode cache, as the serving draft does. fp32: the training path
    expands keys per head, the decode path attends in the absorbed form, and the difference (~1e-7 at step 1) is
    amplified by the recurrence through the random MoE block to at most ~1e-4 at step 7; a wrong context (e.g. a
    row of another document, or of the wrong step) changes the outputs by 1e-2 .. 1."""
    m = _target()
    draft = _random_fc(Eagle3Layer.from_target(m), seed=1)
    ids, seg = _batch(B=1, T=40, doc_start=17)
    u = unroll(m, draft, ids, seg)
    feats, _ = target_features(m, ids, seg, draft.blocks)
    emb = m.model.embed_tokens
    checked = 0
    with torch.no_grad():
        for a, start in [(5, 0), (12, 0), (20, 17), (29, 17)]:  # anchors in either document, its first position
            cache = MLACache()
            # the committed rows of the anchor's document, built from target features; token t + 1 read at t
            h = draft(feats[:, start:a + 1], emb(ids[:, start + 1:a + 2]), fused=True, cache=cache)[:, -1:]
            for j in range(1, 8):
                p = a + j - 1
                if p + 2 >= ids.shape[1] or seg[0, p + 2] != seg[0, a]:
                    assert p + 2 >= ids.shape[1] or not bool(u.valid[j - 1][0, p])  # leaves the document
                    break
                if j > 1:
                    h = draft(h, emb(ids[:, p + 1:p + 2]), fused=False, cache=cache)
                assert bool(u.valid[j - 1][0, p])
                tol = 1e-6 if j == 1 else 2e-4
                torch.testing.assert_close(u.outputs[j - 1][0, p], h[0, 0], rtol=tol, atol=tol)
                checked += 1
    assert checked >= 20


def _trainer(tmp_path, target, draft, ids, seg, loss="lk", micro_batch_rows=None):
    """The Trainer of `k3 train-draft` (its settings, `DraftTrainer`) over the one batch ids / seg [B, T]."""
    B, T = ids.shape
    opts = DraftOptions(ckpt="ck", steps=1, loss=loss, seq_len=T, rows=B, lr=1e-2, log_every=1)
    tcfg = draft_train_config(opts, str(tmp_path), "cpu")
    tcfg.micro_batch_rows = micro_batch_rows
    return DraftTrainer(draft, tcfg, DraftRows(ids.numpy(), seg.numpy(), B), target, loss, "ck", {}, progress=False,
                        log=lambda *a: None)


def _seam_step(tmp_path, target, draft, ids, seg, loss="lk"):
    """One optimizer step of the draft on a batch through the Trainer: (the loss, the acceptance estimate of each
    unrolled step)."""
    m = _trainer(tmp_path, target, draft, ids, seg, loss).train_step()
    return m.loss, m.accept


def test_the_draft_loss_through_the_trainer_seam_is_the_ttt_loss(tmp_path):
    """The draft's loss driven through `Trainer._accumulate` in micro-batches of unequal sizes (2, 2 and 1 rows whose
    documents differ, so that each unrolled step's counted rows differ between micro-batches) gives the step loss,
    the gradients, the counted rows and the acceptance estimates of `ttt_loss` on the whole batch, written out here
    from `unroll` (not through the seam), for both losses; and the whole batch as one micro-batch (the default) is
    `ttt_loss` bit for bit, in fp32.

    Tolerances: the micro-batches are compared with target and draft in fp64 (the loss and the attention core still
    compute in fp32): loss and acceptance at 1e-6 relative, gradients at 1e-5 of each tensor's largest entry (~2e-6
    seen). In fp32 a batch of another shape rounds its GEMMs differently, and the 7-step recurrence through the
    random MoE block amplifies that until the whole batch's own fp32 gradients are only within ~5e-4 of the fp64
    ones: micro-batches then differ from it at that level, which says nothing about the seam."""
    m = _target()
    B, T = 5, 32
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    seg = torch.zeros_like(ids)
    for r, starts in enumerate([[10], [3, 20], [], [25], [6, 14, 22]]):  # where each row's next documents begin
        for s in starts:
            seg[r, s:] += 1
    batch = draft_batch(ids, seg)
    for loss in ("lk", "kl"):
        for target, mb in ((copy.deepcopy(m).double(), 2), (m, B)):
            draft = _random_fc(Eagle3Layer.from_target(target), seed=4).train()
            tr = _trainer(tmp_path, target, draft, ids, seg, loss)
            bias = [x.gate.e_score_correction_bias.clone() for x in tr.moe_layers]
            value, mtp, extras = tr._accumulate(batch, mb, bias)
            grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
            draft.zero_grad(set_to_none=True)
            want, acc, counts = ttt_loss(unroll(target, draft, ids, seg), loss)
            want.backward()
            want_grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.grad is not None}
            assert mtp is None and not any(p.grad is not None for p in target.parameters())
            assert grads.keys() == want_grads.keys() and "fc.weight" in grads
            if mb == B:  # one micro-batch: the same operations as ttt_loss
                assert float(value) == float(want.detach())
                assert all(torch.equal(grads[n], want_grads[n]) for n in want_grads)
                continue
            assert len(extras) == 3
            assert float(value) == pytest.approx(float(want.detach()), rel=1e-6)
            for n in want_grads:
                torch.testing.assert_close(grads[n], want_grads[n], rtol=0,
                                           atol=1e-5 * float(want_grads[n].abs().max()) + 1e-12, msg=n)
            rows = torch.stack([x["rows"] for x in extras])
            assert rows.sum(0).tolist() == counts and len(set(map(tuple, rows.tolist()))) == 3  # unequal parts
            accept = torch.stack([x["accept_sum"] for x in extras]).sum(0) / rows.sum(0)
            torch.testing.assert_close(accept.double(), torch.tensor(acc, dtype=torch.float64), rtol=1e-6, atol=0)


def test_a_train_step_leaves_the_target_frozen_and_trains_the_draft(tmp_path):
    m = _target()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    draft = Eagle3Layer.from_target(m).train()
    start = {k: v.clone() for k, v in draft.state_dict().items()}
    ids, seg = _batch()
    loss, acc = _seam_step(tmp_path, m, draft, ids, seg, "lk")
    assert len(acc) == 7 and all(0 < a <= 1 for a in acc) and loss > 0
    assert all(p.grad is None for p in m.parameters())
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    changed = [k for k, v in draft.state_dict().items() if not torch.equal(v, start[k])]
    assert "fc.weight" in changed and any(k.startswith("mtp.block.") for k in changed)
    # the loss is the mean over steps of each step's mean over its counted rows
    u = unroll(m, draft, ids, seg)
    total, acc2, counts = ttt_loss(u, "kl")
    per = [kl_loss(u.target_logits[ok], d[ok]).mean() for d, ok in zip(u.draft_logits, u.valid)]
    torch.testing.assert_close(total, torch.stack(per).mean())
    assert counts == [int(ok.sum()) for ok in u.valid]


# --- files and the command ---------------------------------------------------------------------------------------
def test_draft_files_round_trip_and_refuse_another_target(tmp_path):
    m = _target()
    draft = _random_fc(Eagle3Layer.from_target(m), seed=2)
    save_draft(draft, str(tmp_path / "d"), "ck", {"loss": "lk"})
    back = load_draft(str(tmp_path / "d"), m)
    for (k, v), (k2, v2) in zip(draft.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(v, v2)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["blocks"] == [1, 2] and cfg["format"] == "k3-eagle3-draft"
    other = _target(layers=7)
    with pytest.raises(DraftError, match=r"was trained for another target \(ck.*7 layers"):
        load_draft(str(tmp_path / "d"), other)
    with pytest.raises(DraftError, match="does not exist"):
        load_draft(str(tmp_path / "missing"), m)


def _checkpoint(d):
    m = _target()
    tok = K3Tokenizer(byte_level_tokenizer(VOCAB))
    save_pretrained(m, d, extra_files={"tokenizer.json": tok.to_str().encode()})
    return d


def test_train_draft_command_end_to_end_and_bad_inputs(tmp_path, capsys):
    from k3.cli import main

    ck = _checkpoint(str(tmp_path / "ck"))
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    rc = main(["train-draft", "--ckpt", ck, "--steps", "2", "--rows", "2", "--seq-len", "24", "--data", str(text),
               "--log-every", "1", "--device", "cpu"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "step 2/2" in out and "accept(1..7)" in out
    d = os.path.join(ck, "draft")  # the default place, where `k3 serve --speculative eagle3` looks
    rows = [json.loads(x) for x in open(os.path.join(d, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and all(len(r["accept"]) == 7 for r in rows)
    cfg = json.loads(open(os.path.join(d, "config.json")).read())
    assert cfg["train"]["loss"] == "lk" and cfg["train"]["steps"] == 2 and cfg["target"]["path"] == ck
    load_draft(d, _target())
    # bad inputs: a clear message and exit status 2
    assert main(["train-draft", "--ckpt", str(tmp_path / "nope"), "--steps", "1", "--device", "cpu"]) == 2
    assert "no checkpoint there" in capsys.readouterr().err
    assert main(["train-draft", "--ckpt", ck, "--steps", "1", "--blocks", "1,9", "--data", str(text),
                 "--device", "cpu", "--out", str(tmp_path / "x")]) == 2
    assert "AttnRes block 9 is out of range: this model has 3 blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train-draft", "--ckpt", ck, "--blocks", "1"])
    assert "expected two AttnRes block numbers" in capsys.readouterr().err


def test_qat_runs_target_and_draft_experts_in_mxfp4(tmp_path):
    from k3.cli import main
    from k3.model.mx_experts import expert_formats
    from k3.posttrain.eagle3 import load_target

    ck = _checkpoint(str(tmp_path / "ck"))
    target = load_target(ck, torch.device("cpu"), qat="mxfp4")
    assert expert_formats(target) == ("mxfp4", "mxfp8") and not any(p.requires_grad for p in target.parameters())
    text = tmp_path / "text.txt"
    text.write_text("for i in range(10):\n    print(i)\n" * 40)
    assert main(["train-draft", "--ckpt", ck, "--steps", "1", "--rows", "2", "--seq-len", "24", "--data", str(text),
                 "--qat", "mxfp4", "--device", "cpu", "--out", str(tmp_path / "d"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "d" / "config.json").read_text())["train"]["qat"] == "mxfp4"
    # served beside an MXFP4 target, the draft's experts compute as the target's do
    assert expert_formats(load_draft(str(tmp_path / "d"), target)) == ("mxfp4", "mxfp8")


def test_a_stopped_run_resumes_to_the_draft_of_an_uninterrupted_one(tmp_path, capsys, monkeypatch):
    """`k3 train-draft` stopped after step 2 of 4 (as Ctrl-C stops it: the step finished, a checkpoint saved) writes
    no draft and refuses to start over without --resume; --resume then ends with the uninterrupted run's draft bit
    for bit, its metrics.jsonl holding each step once with the same losses and acceptance, and the checkpoints
    removed."""
    from k3.cli import main
    from k3.posttrain import eagle3

    ck = _checkpoint(str(tmp_path / "ck"))
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 20 + "x = [i * i for i in range(9)]\n" * 20)
    args = ["train-draft", "--ckpt", ck, "--steps", "4", "--rows", "2", "--seq-len", "24", "--data", str(text),
            "--log-every", "1", "--device", "cpu", "--no-progress"]
    a, b = tmp_path / "a", tmp_path / "b"
    assert main(args + ["--out", str(a)]) == 0
    assert not (a / "checkpoints").exists()  # a finished run's result is the draft

    step = eagle3.DraftTrainer.train_step

    def step_then_stop(self):
        m = step(self)
        self._stop_requested = self.step == 2
        return m

    monkeypatch.setattr(eagle3.DraftTrainer, "train_step", step_then_stop)
    assert main(args + ["--out", str(b)]) == 130
    assert "stopped at step 2 of 4" in capsys.readouterr().out
    assert not (b / "config.json").exists() and (b / "checkpoints" / "step-0000002").is_dir()
    monkeypatch.setattr(eagle3.DraftTrainer, "train_step", step)
    assert main(args + ["--out", str(b)]) == 2
    assert "pass --resume to continue it" in capsys.readouterr().err
    assert main(args + ["--out", str(b), "--resume", "--lr", "2e-3"]) == 2
    assert "trains with lr=0.001, not 0.002" in capsys.readouterr().err
    assert main(args + ["--out", str(b), "--resume"]) == 0
    assert "at step 2" in capsys.readouterr().out
    want, got = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    ra, rb = ([json.loads(x) for x in open(d / "metrics.jsonl")] for d in (a, b))
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    assert [(r["loss"], r["accept"]) for r in ra] == [(r["loss"], r["accept"]) for r in rb]
    assert not (b / "checkpoints").exists()
    assert main(args + ["--out", str(b), "--resume"]) == 2
    assert "no checkpoint found" in capsys.readouterr().err
