"""Progressive context extension (k3.train.context_schedule): parsing, stage boundaries, the mixed and staged
loaders, a run that changes its row length at the right step, and resume at the right stage, length and position
equal to the uninterrupted run."""

import json
import os

import numpy as np
import pytest
import torch

from helpers import stop_after
from k3.config import K3Config
from k3.model.model import K3ForCausalLM
from k3.train.context_schedule import (MixedLoader, check_context_schedule, checkpointing_for,
                                       parse_context_schedule, stage_at_progress, stage_at_step, stage_starts)
from k3.train.run import staged_loader
from k3.train.trainer import Trainer, TrainConfig

SCHEDULE = [[64, 0.5], [128, 0.5]]


# ------------------------------------------------------------------------------------------- parsing


def test_parse_good_schedules():
    assert parse_context_schedule("8192:0.7,65536:0.2,262144:0.1") == [[8192, 0.7], [65536, 0.2], [262144, 0.1]]
    assert parse_context_schedule(" 64:0.5 , 128:0.5 ") == SCHEDULE
    assert parse_context_schedule("256:1") == [[256, 1.0]]


@pytest.mark.parametrize("text, match", [
    ("64:0.5,128:0.4", "sum to 0.9: they must sum to 1"),
    ("64:0.5,128:0.6", "sum to 1.1"),
    ("128:0.5,64:0.5", "must rise"),
    ("64:0.5,64:0.5", "must rise"),
    ("64-0.5,128:0.5", "item '64-0.5': expected LEN:SHARE"),
    ("64:half,128:0.5", "item '64:half'"),
    ("64.5:0.5,128:0.5", "item '64.5:0.5'"),
    ("", "expected LEN:SHARE items"),
    ("64:0.5,,128:0.5", "expected LEN:SHARE items"),
    ("4:0.5,128:0.5", "length 4: must be a whole number of tokens >= 8"),
    ("64:0,128:1", "share 0.0 \\(length 64\\): must be a number in \\(0, 1\\]"),
])
def test_parse_bad_schedules(text, match):
    with pytest.raises(ValueError, match=match):
        parse_context_schedule(text)


def test_schedule_against_the_run():
    check_context_schedule(SCHEDULE, batch_tokens=512)
    with pytest.raises(ValueError, match="length 100: must be a multiple of 64"):
        check_context_schedule([[64, 0.5], [100, 0.5]], batch_tokens=6400)
    with pytest.raises(ValueError, match="length 192: must be a multiple of 128 \\(64 x --cp 2"):
        check_context_schedule([[128, 0.5], [192, 0.5]], batch_tokens=384, cp=2)
    with pytest.raises(ValueError, match="length 192 does not divide --batch-tokens 256.*--batch-tokens 384"):
        check_context_schedule([[64, 0.5], [192, 0.5]], batch_tokens=256)
    with pytest.raises(ValueError, match="4 rows .* do not divide among the 8 data ranks"):
        check_context_schedule(SCHEDULE, batch_tokens=512, data_ranks=8)
    # the config refuses a schedule whose first length is not --seq-len, and a bad one, naming the option
    TrainConfig(max_steps=4, seq_len=64, batch_tokens=512, context_schedule=SCHEDULE).validate()
    with pytest.raises(ValueError, match="'seq_len' = 128 is invalid: with a context schedule .* first length, 64"):
        TrainConfig(max_steps=4, seq_len=128, batch_tokens=512, context_schedule=SCHEDULE).validate()
    with pytest.raises(ValueError, match="'context_schedule' .* does not divide --batch-tokens 320"):
        TrainConfig(max_steps=4, seq_len=64, batch_tokens=320, context_schedule=SCHEDULE).validate()
    with pytest.raises(ValueError, match="long_doc_share"):
        TrainConfig(max_steps=4, seq_len=64, batch_tokens=512, context_schedule=SCHEDULE,
                    long_doc_share=1.5).validate()


# ------------------------------------------------------------------------------------------- stages


def test_stage_boundaries():
    three = [[64, 0.7], [128, 0.2], [256, 0.1]]
    assert stage_starts(three, 100) == [0, 70, 90]
    assert stage_starts(three, 7) == [0, 5, 6]  # round(4.9), round(6.3)
    # stage k trains the steps after its start: step numbers 1-70, 71-90, 91-100
    assert [stage_at_step(three, s, 100) for s in (0, 69, 70, 89, 90, 99)] == [0, 0, 1, 1, 2, 2]
    # a stage that rounds to no step is skipped
    tiny = [[64, 0.9], [128, 0.04], [256, 0.06]]
    assert stage_starts(tiny, 10) == [0, 9, 9]
    assert stage_at_step(tiny, 9, 10) == 2
    # by time (--max-minutes alone): the last stage whose share has begun
    assert [stage_at_progress(three, p) for p in (0.0, 0.69, 0.7, 0.9, 0.95, 1.0)] == [0, 0, 1, 2, 2, 2]


def test_activation_checkpointing_rule():
    three = [[64, 0.5], [128, 0.25], [256, 0.25]]
    # the whole batch in one forward: every stage's forward holds --batch-tokens, so no stage needs it
    assert [checkpointing_for(three, k, 512, None, False, None) for k in range(3)] == [False] * 3
    # 2-row micro-batches: 128, 256, 512 tokens a forward: on where it exceeds the first stage's
    assert [checkpointing_for(three, k, 512, 2, False, None) for k in range(3)] == [False, True, True]
    assert [checkpointing_for(three, k, 512, None, False, 256) for k in range(3)] == [False, False, True]
    assert [checkpointing_for(three, k, 512, 2, True, None) for k in range(3)] == [True] * 3


# ------------------------------------------------------------------------------------------- loaders


def _stream(n=40_000, seed=0, lo=1, hi=97):
    # A learnable synthetic stream: a noisy periodic sequence with document breaks (eos = 0).
    rng = np.random.default_rng(seed)
    base = np.tile(np.arange(lo, hi, dtype=np.int32), n // (hi - lo) + 1)[:n]
    noise = rng.integers(lo, hi + 100, size=n, dtype=np.int32)
    s = np.where(rng.random(n) < 0.1, noise, base)
    s[rng.random(n) < 0.01] = 0
    return s.astype(np.int32)


def _long():
    # "long documents": tokens 300-511, so their rows are told apart from the corpus's (1-196)
    return _stream(20_000, seed=3, lo=300, hi=412), "long-fp"


def test_mixed_loader_takes_the_share_by_a_running_count_and_resumes():
    from k3.data.packing import PackedLoader

    def make(rows):
        return MixedLoader(PackedLoader(_stream(), 128, rows, 0, seed=1), PackedLoader(_long()[0], 128, rows, 0, seed=1),
                           0.3, rows)

    for rows in (1, 3, 4):
        m = make(rows)
        counts = []
        for _ in range(20):
            b = m.next_batch()
            assert b["input_ids"].shape == (rows, 128)
            is_long = (b["input_ids"] >= 300).any(1)
            k = int(is_long.sum())
            assert is_long[:k].all() and not is_long[k:].any()  # long rows first
            counts.append(k)
        assert sum(counts) == int(np.floor(20 * rows * 0.3 + 1e-9))  # the share holds over any run of steps
        assert max(counts) - min(counts) <= 1
    # resume: a loader restored from a state continues with the same batches
    m = make(3)
    for _ in range(5):
        m.next_batch()
    st = json.loads(json.dumps(m.state_dict()))
    want = [m.next_batch() for _ in range(4)]
    r = make(3)
    r.load_state_dict(st)
    for a in want:
        b = r.next_batch()
        assert all(torch.equal(a[k], b[k]) for k in a)


def _cfg():
    # two layers (one KDA, one MLA), so that the runs below take a few seconds on a busy CPU
    return K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0, num_hidden_layers=2,
                                                kda_layers=[1], full_attn_layers=[2])


def _trainer(out, max_steps, schedule=SCHEDULE, long=True, log=None, **kw):
    torch.manual_seed(0)
    model = K3ForCausalLM(_cfg()).init_weights(seed=0)
    tc = TrainConfig(out=str(out), max_steps=max_steps, seq_len=schedule[0][0] if schedule else 64, batch_tokens=256,
                     lr=3e-3, eval_every=100, eval_batches=1, save_every_minutes=1e9, context_schedule=schedule, **kw)
    if schedule:
        loader = staged_loader(tc, _stream(), "corpus-fp", 0, _long() if long else None)
    else:
        from k3.data.packing import PackedLoader
        loader = PackedLoader(_stream(), tc.seq_len, tc.rows_per_step, 0, seed=0)
    return Trainer(model, tc, loader, eval_stream=_stream(2000, seed=1), eos_id=0,
                   log=log if log is not None else (lambda *a: None))


def _steps(out):
    return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"loss"' in l]


def test_a_two_stage_run_changes_length_at_the_right_step(tmp_path, one_thread):
    msgs = []
    tr = _trainer(tmp_path / "a", 4, log=msgs.append, micro_batch_rows=2)
    shapes = []
    orig = tr._next_batch
    tr._next_batch = lambda: shapes.append(tuple((b := orig())["input_ids"].shape)) or b
    checkpointing = []
    tr._accumulate = (lambda acc: lambda *a: checkpointing.append(tr.model.model.activation_checkpointing)
                      or acc(*a))(tr._accumulate)
    tr.fit(progress_bar=False)
    # 256 tokens a step at both lengths: 4 rows of 64, then 2 of 128; from the second stage on, half of the rows
    # from the long documents (the running count: 1 of 2)
    assert shapes == [(4, 64), (4, 64), (2, 128), (2, 128)]
    recs = _steps(tmp_path / "a")
    assert [(r["step"], r["stage"], r["seq_len"]) for r in recs] == [(1, 0, 64), (2, 0, 64), (3, 1, 128), (4, 1, 128)]
    # 2-row micro-batches: 128 tokens a forward, then 256: the second stage checkpoints activations
    assert checkpointing == [False, False, True, True]
    assert any("context stage 2/2 from step 3: rows of 128 tokens, 2 a step, 50% of them from long documents, "
               "activation checkpointing on" in m for m in msgs), msgs
    # the learning-rate schedule spans the run: the same as a run without stages
    plain = _trainer(tmp_path / "b", 4, schedule=None)
    plain.fit(progress_bar=False)
    assert [r["lr"] for r in recs] == [r["lr"] for r in _steps(tmp_path / "b")]
    # the checkpoint records the stage, its length and the position in its stream
    st = json.load(open(tmp_path / "a" / "checkpoints" / "step-0000004" / "trainer_state.json"))
    from k3.train.state import unflatten

    loader = unflatten(None, st)["loader"]
    assert loader["stage"] == 1 and loader["seq_len"] == 128 and loader["stage_loader"]["served"] == 4


@pytest.mark.parametrize("stop", [3, 2])  # mid-stage (the second stage's stream part-read); at the boundary
def test_resume_continues_at_the_right_stage_and_equals_the_uninterrupted_run(tmp_path, one_thread, stop):
    straight = _trainer(tmp_path / "a", 5)
    straight.fit(progress_bar=False)
    first = _trainer(tmp_path / "b", 5)
    stop_after(first, stop)
    assert first.fit(progress_bar=False)["step"] == stop
    resumed = _trainer(tmp_path / "b", 5)
    resumed.load(os.path.join(tmp_path / "b", "checkpoints", f"step-{stop:07d}"))
    assert resumed.step == stop and resumed.loader.stage == (1 if stop == 3 else 0)
    resumed.fit(progress_bar=False)
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), n
    ra, rb = _steps(tmp_path / "a"), _steps(tmp_path / "b")
    assert [(r["step"], r["stage"], r["seq_len"]) for r in rb] == [(r["step"], r["stage"], r["seq_len"]) for r in ra]
    assert [(1, 0, 64), (3, 1, 128), (5, 1, 128)] == [(r["step"], r["stage"], r["seq_len"]) for r in ra][::2]
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]


def test_a_state_without_stages_is_refused(tmp_path):
    tr = _trainer(tmp_path, 4)
    with pytest.raises(ValueError, match="saved without --context-schedule"):
        tr.loader.load_state_dict({"epoch": 0, "position": 0, "seed": 0})
    with pytest.raises(ValueError, match="context stage 1 at length 256, which the schedule"):
        tr.loader.load_state_dict({"stage": 1, "seq_len": 256, "stage_loader": {}})


# ------------------------------------------------------------------------------------------- long documents


def test_long_document_tokens_from_packages(tmp_path):
    from k3.data.tokenizer import K3Tokenizer, byte_level_tokenizer
    from k3.train.run import long_doc_tokens

    root = tmp_path / "lib"
    for p in ("alpha", "beta"):
        (root / p).mkdir(parents=True)
        (root / p / "__init__.py").write_text(f"from .core import run  # {p}\n")
        (root / p / "core.py").write_text("def run():\n    return 1\n" * 40)
    (root / "gamma").mkdir()
    (root / "gamma" / "__init__.py").write_text("x = 1\n")  # too short to be a long document
    tok = K3Tokenizer(byte_level_tokenizer(512))
    msgs = []
    stages = [[64, 0.5], [256, 0.5]]
    stream, fp = long_doc_tokens(tok, str(tmp_path / "cache"), stages, log=msgs.append, root=str(root))
    from k3.data.long_docs import long_documents

    docs = long_documents(min_chars=3 * 256, root=str(root), heldout_fraction=0.0)
    heldout = long_documents(heldout=True, min_chars=3 * 256, root=str(root))
    want = [d for d in long_documents(min_chars=3 * 256, root=str(root))]
    assert [d.name for d in docs] == ["alpha", "beta"] and len(want) + len(heldout) == 2
    text = tok.decode([int(t) for t in stream if t != tok.eos_id])
    assert text == "".join(d.text for d in want)
    assert (stream == tok.eos_id).sum() == len(want) and fp.startswith("long-docs:")
    assert "long documents: " in msgs[0]
    again, fp2 = long_doc_tokens(tok, str(tmp_path / "cache"), stages, log=msgs.append, root=str(root))
    assert fp2 == fp and np.array_equal(again, stream)
    with pytest.raises(ValueError, match="fewer than one row of 1,000,000"):
        long_doc_tokens(tok, str(tmp_path / "cache"), [[64, 0.5], [256, 0.25], [1_000_000, 0.25]], root=str(root))


# ------------------------------------------------------------------------------------------- k3 train


def test_cli_schedule_with_long_documents_and_resume(tmp_path, monkeypatch, capsys):
    """`k3 train --context-schedule` on the default corpus (here a small stand-in for the standard library, and
    its packages as the long documents): the length changes at the right step, the long documents are read, and
    --resume keeps the run's schedule (another is refused)."""
    import k3.data.long_docs
    import k3.train.run
    from k3.cli import main
    from k3.data.sources import data_units

    lib = tmp_path / "lib"
    for i in range(4):
        (lib / f"pkg{i}").mkdir(parents=True)
        (lib / f"pkg{i}" / "__init__.py").write_text(f"from .core import f0\nVERSION = {i}\n")
        (lib / f"pkg{i}" / "core.py").write_text("".join(f"def f{j}(x):\n    return x * {j} + {i}\n\n"
                                                        for j in range(200)))
    monkeypatch.setattr(k3.train.run, "corpus_units", lambda data, mb, full_default: (data_units([str(lib)]),
                                                                                      "a stand-in corpus"))
    monkeypatch.setattr(k3.data.long_docs, "stdlib_root", lambda: str(lib))
    out = str(tmp_path / "run")
    common = ["train", "--out", out, "--batch-tokens", "256", "--vocab-size", "300", "--eval-every", "100",
              "--eval-batches", "1", "--no-progress", "--device", "cpu", "--preset", "tiny"]
    assert main(common + ["--max-steps", "4", "--context-schedule", "64:0.5,128:0.5", "--seq-len", "128"]) == 2
    assert "--seq-len 128 with --context-schedule 64:0.5,128:0.5" in capsys.readouterr().err
    assert main(common + ["--max-steps", "4", "--context-schedule", "64:0.5,128:0.5"]) == 0
    text = capsys.readouterr().out
    assert "long documents: 3 standard-library packages" in text  # one of the 4 held out
    assert "context stage 2/2 from step 3: rows of 128 tokens, 2 a step, 50% of them from long documents" in text
    assert [(r["step"], r["seq_len"]) for r in _steps(out)] == [(1, 64), (2, 64), (3, 128), (4, 128)]
    assert main(common + ["--max-steps", "6", "--resume", "--context-schedule", "64:0.25,128:0.75"]) == 2
    assert "was trained with --context-schedule 64:0.5,128:0.5" in capsys.readouterr().err
    assert main(common + ["--max-steps", "6", "--resume"]) == 0  # the run's own schedule: stage 2 continues
    assert "context stage 2/2 continued at step 5" in capsys.readouterr().out
    assert [(r["step"], r["stage"], r["seq_len"]) for r in _steps(out)][4:] == [(5, 1, 128), (6, 1, 128)]


def test_time_budget_stages_by_training_time(tmp_path):
    # --max-minutes alone: the shares are of the training time
    tr = _trainer(tmp_path, None, max_minutes=1.0)
    assert tr.step_budget() is None and tr.context_stage() == 0
    tr.elapsed = 29.9
    assert tr.context_stage() == 0
    tr.elapsed = 30.0
    assert tr.context_stage() == 1
    tr.loader.enter(1)
    tr.elapsed = 0.0  # never back to an earlier stage
    assert tr.context_stage() == 1
