"""The rough edges a new user and an outside client hit: a stale tokenizer in --out, a damaged tokenizer.json, bad
flags, a resume past a damaged checkpoint, the start-up of a run (compile cache, time to the first step, the first
evaluation), and what lm-evaluation-harness asks the server."""

import json
import os
import time

import pytest
from helpers import one_torch_thread

from k3.cli import main


@pytest.fixture
def one_thread():
    with one_torch_thread():
        yield


def _data_dir(path, n=6, salt=""):
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (path / f"m{i}.py").write_text("".join(f"def f{j}{salt}(x):\n    return x * {j} + {i}\n\n" for j in range(300)))
    return str(path)


def _train_argv(data, out, *extra):
    return ["train", "--data", data, "--out", out, "--seq-len", "64", "--batch-tokens", "512", "--vocab-size", "300",
            "--eval-every", "1000", "--no-progress", "--device", "cpu", *extra]


# --- 5: no pause in the QAT export -----------------------------------------------------------------------
def test_qat_export_does_not_sleep(tmp_path, monkeypatch):
    from k3.train import qat, run
    from k3.train.trainer import TrainConfig

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    tcfg = TrainConfig(out=str(tmp_path / "run"), max_steps=1, qat="mxfp4")

    class Done:
        cfg = tcfg

        def fit(self, progress_bar):
            return {"step": 1, "epochs": 0.1, "checkpoint": "ck", "interrupted": False}

    monkeypatch.setattr(run, "build_run", lambda *a, **k: Done())
    monkeypatch.setattr(qat, "export_run", lambda trainer, log: "exported")
    summary = run.run_training(run.RunOptions(), tcfg, progress_bar=False, log=lambda *a: None)
    assert summary["export"] == "exported" and slept == []


# --- 3: an unknown device or an out-of-range hyper-parameter is refused, naming the flag --------------------
@pytest.mark.parametrize("argv, flag", [
    (["train", "--device", "tpu"], "--device"),
    (["eval", "--ckpt", "x", "--device", "tpu"], "--device"),
    (["generate", "--ckpt", "x", "hi", "--device", "tpu"], "--device"),
    (["serve", "--ckpt", "x", "--device", "tpu"], "--device"),
    (["train", "--mtp-weight", "nan"], "--mtp-weight"),
    (["train", "--mtp-weight", "-1"], "--mtp-weight"),
    (["train", "--qk-clip-tau", "-1"], "--qk-clip-tau"),
    (["train", "--qk-clip-tau", "inf"], "--qk-clip-tau"),
    (["train", "--lr", "inf"], "--lr"),
    (["train", "--grad-clip", "nan"], "--grad-clip"),
    (["train", "--max-minutes", "inf"], "--max-minutes"),
    (["serve", "--ckpt", "x", "--port", "70000"], "--port"),
    (["serve", "--ckpt", "x", "--cache-memory-mb", "-5"], "--cache-memory-mb"),
    (["serve", "--ckpt", "x", "--max-num-seqs", "0"], "--max-num-seqs"),
])
def test_bad_flags_are_refused_at_parse_time_naming_the_flag(argv, flag, capsys):
    from k3.cli import build_parser

    with pytest.raises(SystemExit) as e:  # the parser only: a flag it let through must not start a run here
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"argument {flag}" in err.splitlines()[-1], err


def test_zero_mtp_weight_and_qk_clip_tau_stay_allowed():
    from k3.cli import build_parser

    args = build_parser().parse_args(["train", "--mtp-weight", "0", "--qk-clip-tau", "0", "--device", "cuda:1"])
    assert args.mtp_weight == 0 and args.qk_clip_tau == 0 and args.device == "cuda:1"


def test_an_unknown_device_is_one_line_wherever_it_comes_from():
    from k3.devices import pick_device

    with pytest.raises(ValueError, match="--device 'tpu'"):
        pick_device("tpu")
    assert str(pick_device("CPU")) == "cpu"


@pytest.mark.parametrize("field, value", [("mtp_weight", float("nan")), ("mtp_weight", -1.0), ("qk_clip_tau", -1.0),
                                          ("grad_clip", 0.0), ("save_every_minutes", float("nan")),
                                          ("eval_every", 0), ("eval_batches", 0), ("weight_decay", -0.1)])
def test_train_config_refuses_out_of_range_values(field, value):
    from k3.train.trainer import TrainConfig

    with pytest.raises(ValueError, match=field):
        TrainConfig(max_steps=1, **{field: value}).validate()


# --- 2: a damaged tokenizer.json is one line naming it, whichever command reads it ----------------------------
@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    ck = str(tmp_path_factory.mktemp("ck") / "tiny")
    assert main(["init", "--preset", "tiny", "--tokenizer", "bytes", "--out", ck]) == 0
    return ck


def _truncate(path, keep=100):
    data = open(path, "rb").read()
    open(path, "wb").write(data[:keep])


def _one_line_naming(capsys, text):
    err = [ln for ln in capsys.readouterr().err.strip().splitlines() if ln.strip()]
    assert len(err) == 1 and text in err[0] and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("command", ["eval", "generate", "serve"])
def test_a_truncated_tokenizer_is_one_line_naming_it(tiny_ckpt, tmp_path, command, capsys):
    import shutil

    ck = str(tmp_path / "ck")
    shutil.copytree(tiny_ckpt, ck)
    _truncate(os.path.join(ck, "tokenizer.json"))
    argv = {"eval": ["eval", "--ckpt", ck, "--device", "cpu"],
            "generate": ["generate", "--ckpt", ck, "hello", "--device", "cpu"],
            "serve": ["serve", "--ckpt", ck, "--device", "cpu", "--port", "0"]}[command]
    capsys.readouterr()
    assert main(argv) == 2
    line = _one_line_naming(capsys, os.path.join(ck, "tokenizer.json"))
    assert "truncated or corrupt" in line


def test_a_truncated_tokenizer_on_resume_is_one_line_naming_it(tiny_ckpt, tmp_path, capsys):
    import shutil

    from k3.train.state import dumps

    out = str(tmp_path / "run")
    ck = os.path.join(out, "checkpoints", "step-0000001")
    shutil.copytree(tiny_ckpt, ck)
    t, j = dumps({"step": 1, "train_config": {"seq_len": 64}})
    open(os.path.join(ck, "trainer_state.safetensors"), "wb").write(t)
    open(os.path.join(ck, "trainer_state.json"), "wb").write(j)
    _truncate(os.path.join(ck, "tokenizer.json"))
    capsys.readouterr()
    assert main(_train_argv(_data_dir(tmp_path / "data"), out, "--resume", "--max-steps", "2")) == 2
    _one_line_naming(capsys, os.path.join(ck, "tokenizer.json"))


def test_loading_a_damaged_tokenizer_raises_a_value_error_naming_the_file(tmp_path):
    from k3.data.tokenizer import K3Tokenizer, load_any_tokenizer, load_tokenizer

    path = tmp_path / "tokenizer.json"
    path.write_text('{"version": "1.0", "trunc')
    for load in (load_any_tokenizer, load_tokenizer, K3Tokenizer.from_file):
        with pytest.raises(ValueError, match=str(path)):
            load(path)


# --- 1: a tokenizer left in --out is reused only for the same data and size --------------------------------------
def _failing_after_the_tokenizer(data, out):
    """A run that trains its tokenizer and then stops: more tokens per batch than the data holds."""
    return _train_argv(data, out, "--max-steps", "1", "--batch-tokens", str(10**9))


def test_a_tokenizer_left_by_a_failed_run_is_not_reused_for_other_data(tmp_path, capsys):
    out = str(tmp_path / "run")
    tok_path = os.path.join(out, "tokenizer.json")
    assert main(_failing_after_the_tokenizer(_data_dir(tmp_path / "a"), out)) == 2
    first = open(tok_path).read()
    other = tmp_path / "b"
    other.mkdir()
    for i in range(4):
        (other / f"t{i}.txt").write_text(" ".join(f"the quick brown fox {i} jumps over the lazy dog {j}."
                                                  for j in range(400)))
    capsys.readouterr()
    assert main(_failing_after_the_tokenizer(str(other), out)) == 2
    text = capsys.readouterr().out
    assert open(tok_path).read() != first
    assert f"{tok_path} was trained on other data" in text and "training a new one" in text, text
    # the same data again: reused, and the log says so
    assert main(_failing_after_the_tokenizer(str(other), out)) == 2
    assert "reused" in capsys.readouterr().out


def test_cached_tokenizer_checks_size_and_data_fingerprint(tmp_path):
    from k3.data.tokenizer import TOKENIZER_SOURCE, cached_tokenizer

    texts = lambda: ["def f(x):\n    return x + 1\n" * 50]
    logs = []
    a = cached_tokenizer(tmp_path, texts, 300, data_fingerprint="A", log=logs.append)
    assert json.load(open(tmp_path / TOKENIZER_SOURCE))["data"] == "A" and logs == []
    assert cached_tokenizer(tmp_path, lambda: pytest.fail("trained again"), 300, data_fingerprint="A").to_str() \
        == a.to_str()
    cached_tokenizer(tmp_path, texts, 300, data_fingerprint="B", log=logs.append)
    assert len(logs) == 1 and "other data" in logs[0]
    cached_tokenizer(tmp_path, texts, 320, data_fingerprint="B", log=logs.append)
    assert len(logs) == 2 and "300 tokens, not 320" in logs[1]
    os.remove(tmp_path / TOKENIZER_SOURCE)  # one written before fingerprints were kept: not trusted
    cached_tokenizer(tmp_path, texts, 320, data_fingerprint="B", log=logs.append)
    assert len(logs) == 3 and "no record of the data" in logs[2]


# --- 4: --resume past a damaged newest checkpoint says so before training, naming both ------------------------
@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run with complete checkpoints of steps 2 and 3, and its data directory."""
    root = tmp_path_factory.mktemp("resume")
    data, out = _data_dir(root / "data"), str(root / "run")
    assert main(_train_argv(data, out, "--max-steps", "3", "--save-every-minutes", "1e-9")) == 0
    return data, out


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    return str(dst)


def _ck(out, step):
    return os.path.join(out, "checkpoints", f"step-{step:07d}")


def _shard(ck):
    names = sorted(f for f in os.listdir(ck) if f.startswith("model") and f.endswith(".safetensors"))
    return os.path.join(ck, names[0])


@pytest.mark.parametrize("damage", ["config.json", "trainer_state.safetensors", "truncated"])
def test_resume_says_before_training_which_checkpoint_it_skips_and_which_it_uses(two_checkpoints, tmp_path, damage,
                                                                                  capsys):
    data, src = two_checkpoints
    out = _copy_run(src, tmp_path / "run")
    if damage == "truncated":
        _truncate(_shard(_ck(out, 3)), keep=os.path.getsize(_shard(_ck(out, 3))) // 2)
    else:
        os.remove(os.path.join(_ck(out, 3), damage))
    capsys.readouterr()
    assert main(_train_argv(data, out, "--resume", "--max-steps", "4")) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    skip = next(i for i, ln in enumerate(lines) if "skipping" in ln)
    assert _ck(out, 3) in lines[skip] and _ck(out, 2) in lines[skip], lines[skip]
    assert ("truncated" if damage == "truncated" else damage) in lines[skip]
    assert skip < next(i for i, ln in enumerate(lines) if ln.startswith("resumed from"))
    assert skip < next(i for i, ln in enumerate(lines) if ln.startswith("data: "))  # before the run's plan
    assert "--no-verify" not in text


def test_resume_from_a_lone_truncated_checkpoint_does_not_suggest_no_verify(two_checkpoints, tmp_path, capsys):
    import shutil

    data, src = two_checkpoints
    out = _copy_run(src, tmp_path / "run")
    shutil.rmtree(_ck(out, 2))
    shard = _shard(_ck(out, 3))
    _truncate(shard, keep=os.path.getsize(shard) // 2)
    capsys.readouterr()
    assert main(_train_argv(data, out, "--resume", "--max-steps", "4")) == 2
    line = _one_line_naming(capsys, shard)
    assert "truncated" in line and "--no-verify" not in line


def test_a_corrupt_newest_checkpoint_names_the_older_complete_one(two_checkpoints, tmp_path, capsys):
    data, src = two_checkpoints
    out = _copy_run(src, tmp_path / "run")
    shard = _shard(_ck(out, 3))
    with open(shard, "r+b") as f:  # same size, other bytes: the digest check finds it
        f.seek(os.path.getsize(shard) - 16)
        f.write(b"\x55" * 16)
    capsys.readouterr()
    assert main(_train_argv(data, out, "--resume", "--max-steps", "4")) == 2
    line = _one_line_naming(capsys, _ck(out, 3))
    assert _ck(out, 2) in line


# --- 6: compiled kernels persist; time to the first step is reported; --max-minutes counts training steps ----------
def test_the_compile_caches_default_to_the_user_cache_folder(tmp_path, monkeypatch):
    from k3.cli_args import use_compile_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    assert main(["info", "tiny"]) == 0  # every command sets them up before it runs
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "k3" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == "/somewhere/else"  # one already set is kept
    monkeypatch.delenv("TRITON_CACHE_DIR")
    use_compile_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "k3" / "triton")


def _tiny_trainer(out, log, **kw):
    import numpy as np
    import torch

    from k3.config import K3Config
    from k3.data.packing import PackedLoader
    from k3.model.model import K3ForCausalLM
    from k3.train.trainer import TrainConfig, Trainer

    torch.manual_seed(0)
    cfg = K3Config.from_preset("tiny").replace(vocab_size=512, eos_token_id=0, pad_token_id=0)
    model = K3ForCausalLM(cfg).init_weights(seed=0)
    kw = {"eval_every": 1000, "save_every_minutes": 1e9, "save_checkpoints": False, **kw}
    tc = TrainConfig(out=str(out), seq_len=64, batch_tokens=256, **kw)
    stream = np.tile(np.arange(1, 97, dtype=np.int32), 400)
    loader = PackedLoader(stream, tc.seq_len, tc.rows_per_step, eos_id=0, seed=0)
    return Trainer(model, tc, loader, eval_stream=stream[:2000], eos_id=0, log=log)


def _slow_first_step(tr, monkeypatch, seconds):
    real, calls = tr._accumulate, []

    def accumulate(*a, **k):
        calls.append(1)
        if len(calls) == 1:  # as a first step that compiles kernels
            time.sleep(seconds)
        return real(*a, **k)

    monkeypatch.setattr(tr, "_accumulate", accumulate)


def test_a_slow_first_step_is_not_counted_against_max_minutes(tmp_path, monkeypatch, one_thread):
    logs = []
    tr = _tiny_trainer(tmp_path, logs.append, max_minutes=3 / 60)  # 3 s of training
    tr.setup_s = 1.5
    _slow_first_step(tr, monkeypatch, 4.0)
    summary = tr.fit(progress_bar=False)
    assert summary["step"] > 1, "the first step's 4 s of warm-up ended a 3 s run"
    assert summary["warmup_s"] >= 3.5 and tr.elapsed < 3 + 3.5  # the budget plus at most one step
    first = next(ln for ln in logs if ln.startswith("step 1 after "))
    assert "1.5s reading the data and building the model" in first and "held-out evaluation" in first
    assert any(ln.startswith("warm-up: ") and "not counted" in ln for ln in logs)


def test_the_clock_starts_after_setup_and_evaluation(tmp_path, monkeypatch, one_thread):
    tr = _tiny_trainer(tmp_path, lambda *a: None, max_steps=3)
    real = tr.evaluate
    monkeypatch.setattr(tr, "evaluate", lambda: (time.sleep(2.0), real())[1])
    t0 = time.perf_counter()
    tr.fit(progress_bar=False)
    assert tr.elapsed <= time.perf_counter() - t0 - 2.0  # the steps' time only, whatever the machine's speed


# --- 7: the evaluation before the first step says what it does; a CPU reads a capped share by default ------------
def test_the_first_evaluation_is_announced_with_its_size(tmp_path, one_thread):
    logs = []
    tr = _tiny_trainer(tmp_path, logs.append, max_steps=1, eval_batches=2)
    tr.fit(progress_bar=False)
    i = next(i for i, ln in enumerate(logs) if ln.startswith("held-out evaluation before step 1: "))
    assert "2 batches, 512 of 2,000 tokens" in logs[i]
    assert logs[i + 1].startswith("held-out loss at step 0: ")


def test_cpu_runs_cap_the_evaluation_by_default_and_the_flag_overrides_it():
    from k3.cli import build_parser
    from k3.cli_args import _train_config
    from k3.train.run import CPU_DEFAULTS, GPU_DEFAULTS

    args = build_parser().parse_args(["train", "--max-steps", "1"])
    assert _train_config(args, CPU_DEFAULTS).eval_batches == 16
    assert _train_config(args, GPU_DEFAULTS).eval_batches == 64
    args = build_parser().parse_args(["train", "--max-steps", "1", "--eval-batches", "3"])
    assert _train_config(args, CPU_DEFAULTS).eval_batches == 3


# --- 9: lm-evaluation-harness's remote tokenizer; framing errors and the read timeout ------------------------------
@pytest.fixture(scope="module")
def served(tiny_ckpt):
    """An app over the tiny checkpoint (and its tokenizer), as `k3 serve` builds it."""
    from types import SimpleNamespace

    from k3.checkpoint import from_pretrained
    from k3.data.tokenizer import load_any_tokenizer
    from k3.serve.app import create_app
    from k3.serve.engine import EngineConfig, LLMEngine

    tok = load_any_tokenizer(tiny_ckpt)
    engine = LLMEngine(from_pretrained(tiny_ckpt), tok, EngineConfig(cache_memory_mb=16, page_tokens=32,
                                                                     hash_block_tokens=16, max_model_len=256))
    return SimpleNamespace(tok=tok, make=lambda **kw: create_app(engine, tok, "tiny", **kw))


def test_tokenizer_endpoints_answer_as_lm_eval_reads_them(served):
    from fastapi.testclient import TestClient

    with TestClient(served.make()) as http:
        # lm_eval.utils.check_remote_tokenizer_support: /tokenizer_info with an "eos_token", /tokenize with a list
        info = http.get("/tokenizer_info")
        assert info.status_code == 200 and info.json()["eos_token"] == "<|endoftext|>"
        r = http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False})
        assert r.status_code == 200 and r.json()["tokens"] == served.tok.encode("test")
        # RemoteTokenizer.eos_token_id: the first id of /tokenize of eos_token
        eos = http.post("/tokenize", json={"prompt": info.json()["eos_token"], "add_special_tokens": False})
        assert eos.json()["tokens"] == [served.tok.eos_id]
        # inside a text, the end-of-text text stays ordinary text, as in a completion prompt
        mixed = http.post("/tokenize", json={"prompt": "a<|endoftext|>"}).json()["tokens"]
        assert served.tok.eos_id not in mixed and mixed == served.tok.encode("a<|endoftext|>")
        text = "def f(x):\n    return x"
        ids = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": text}
        bad = http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert http.post("/tokenize", json={"prompt": 5}).json()["error"]["type"] == "invalid_request_error"


def test_tokenizer_endpoints_need_the_api_key(served):
    from fastapi.testclient import TestClient

    with TestClient(served.make(api_key="s3cret")) as http:
        assert http.get("/tokenizer_info").status_code == 401
        assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
        ok = http.get("/tokenizer_info", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200


@pytest.fixture
def live_server(served):
    """The app on a loopback port with the server's HTTP options and a 1 s read timeout."""
    import socket
    import threading

    import uvicorn

    from k3.serve.http import uvicorn_options

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(served.make(), log_level="warning", lifespan="on",
                                           **uvicorn_options(read_timeout_s=1.0)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(30)
    sock.close()


def _exchange(port, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send `data`, read until the server closes the connection; (the bytes read, seconds until the close)."""
    import socket

    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as s:
        s.sendall(data)
        chunks = []
        while True:
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    return b"".join(chunks), time.monotonic() - t0


def _status_and_json(raw: bytes):
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_a_body_shorter_than_its_content_length_times_out_with_a_json_408(live_server):
    raw, took = _exchange(live_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                       b"Content-Length: 100\r\n\r\n{\"model\": ")
    status, body = _status_and_json(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout" and took < 8


def test_a_head_cut_off_times_out_and_a_silent_connection_is_closed(live_server):
    raw, took = _exchange(live_server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    assert _status_and_json(raw)[0] == 408 and took < 8
    raw, took = _exchange(live_server, b"")
    assert raw == b"" and took < 8


@pytest.mark.parametrize("data", [b"GARBAGE\r\n\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                                  b"zz\r\n{}\r\n0\r\n\r\n"])
def test_malformed_framing_gets_an_openai_shaped_400(live_server, data):
    status, body = _status_and_json(_exchange(live_server, data)[0])
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "malformed_http_request"


def test_lm_eval_scores_a_loglikelihood_task_with_tokenizer_backend_auto(served, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")  # not installed: skipped
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from k3.serve.local import serve_in_thread

    with serve_in_thread(served.make()) as port:
        lm = LocalCompletionsAPI(model="tiny", base_url=f"http://127.0.0.1:{port}/v1/completions",
                                 tokenizer_backend="auto", max_length=256)
        assert lm.tokenizer_backend == "remote"
        from lm_eval.api.instance import Instance

        reqs = [Instance("loglikelihood", {}, ("def f(x):", " return x"), 0),
                Instance("loglikelihood", {}, ("1 + 1 =", " 2"), 1)]
        out = lm.loglikelihood(reqs)
        assert len(out) == 2 and all(lp <= 0 for lp, _ in out)
    del lm_eval


def test_lm_eval_runs_the_two_item_example_task_offline(served, monkeypatch):
    """examples/lm_eval/two_item.yaml through lm-eval's own evaluator and task loader (the `lm_eval` command's path),
    against the server with tokenizer_backend=auto, nothing downloaded."""
    pytest.importorskip("lm_eval")  # not installed: skipped
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from k3.serve.local import serve_in_thread

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)  # the task's data path is relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with serve_in_thread(served.make()) as port:
        res = simple_evaluate(model="local-completions", tasks=["two_item"],
                              model_args=f"model=tiny,base_url=http://127.0.0.1:{port}/v1/completions,"
                                         "tokenizer_backend=auto,max_length=256",
                              task_manager=TaskManager(include_path=os.path.join(root, "examples", "lm_eval")))
    acc = res["results"]["two_item"]["acc,none"]
    assert 0.0 <= acc <= 1.0 and res["n-samples"]["two_item"]["effective"] == 2


# --- Deliverable 3: the served model's name is the run's, whichever checkpoint of it is served -----------------------
def test_the_default_model_name_is_the_run_name_for_every_checkpoint(tmp_path):
    from k3.serve.cli import default_model_name

    run = tmp_path / "my-run"
    for step in (100, 200):
        assert default_model_name(str(run / "checkpoints" / f"step-{step:07d}")) == "my-run"
    assert default_model_name(str(tmp_path / "released-ckpt") + "/") == "released-ckpt"


def test_serve_answers_to_the_run_name_and_model_name_overrides(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    import uvicorn

    import k3.serve.cli as serve_cli

    names = []
    engine = SimpleNamespace(runner=SimpleNamespace(graphs=None), max_model_len=8,
                             cache_stats=lambda: {"num_pages": 1, "page_bytes": 1},
                             warm_up=lambda: {"graphs": 0, "draft_counts": []})
    monkeypatch.setattr(serve_cli, "build_engine", lambda *a, **k: (engine, None, None))
    monkeypatch.setattr(serve_cli, "create_app", lambda eng, tok, name, **k: names.append(name))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: names.append(kw["http"].__name__))
    ck = tmp_path / "run7" / "checkpoints" / "step-0000005"
    ck.mkdir(parents=True)
    (ck / "config.json").write_text("{}")
    for c in (ck / "config.json", ck / "COMPLETE"):
        c.touch()
    assert main(["serve", "--ckpt", str(ck), "--device", "cpu"]) == 0
    assert main(["serve", "--ckpt", str(ck), "--device", "cpu", "--model-name", "mine"]) == 0
    assert names == ["run7", "K3H11Protocol", "mine", "K3H11Protocol"]


# --- 8: what the commands report --------------------------------------------------------------------------------
def test_eval_with_max_batches_reports_the_tokens_it_scored(tiny_ckpt, tmp_path, capsys):
    data = _data_dir(tmp_path / "data", n=60)
    capsys.readouterr()
    assert main(["eval", "--ckpt", tiny_ckpt, "--data", data, "--seq-len", "16", "--batch-size", "2",
                 "--max-batches", "1", "--device", "cpu"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "(32 of " in line and "(1 batches)" in line and f"held-out split of --data {data}" in line, line


def test_generate_on_a_cpu_says_nothing_about_cuda_graphs(tiny_ckpt, capsys):
    assert main(["generate", "--ckpt", tiny_ckpt, "x", "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "CUDA graphs" not in capsys.readouterr().err


def test_serve_asks_no_cuda_graphs_on_a_cpu(monkeypatch):
    import k3.serve.cli as serve_cli
    from k3.cli import build_parser

    seen = []
    monkeypatch.setattr(serve_cli, "cmd_serve", lambda args: seen.append(args.cuda_graphs) or 0)
    assert build_parser().parse_args(["serve", "--ckpt", "x", "--device", "cpu"]).fn(
        build_parser().parse_args(["serve", "--ckpt", "x", "--device", "cpu"])) == 0
    assert seen == [False]


def test_the_summary_after_a_resume_gives_the_loss_before_it(tmp_path, one_thread):
    logs = []
    tr = _tiny_trainer(tmp_path, logs.append, max_steps=2, eval_every=1, eval_batches=1, save_checkpoints=True)
    first = tr.fit(progress_bar=False)
    before = first["last_val_loss"]
    tr2 = _tiny_trainer(tmp_path, logs.append, max_steps=3, eval_every=1, eval_batches=1, save_checkpoints=True)
    tr2.load(first["checkpoint"])
    summary = tr2.fit(progress_bar=False)
    assert summary["first_val_loss"] == before and summary["first_val_step"] == 2
    assert summary["last_val_loss"] != before


def test_the_resume_summary_line_says_which_loss_is_from_before(monkeypatch, tmp_path):
    from k3.train import run
    from k3.train.trainer import TrainConfig

    tcfg = TrainConfig(out=str(tmp_path), max_steps=3)

    class Done:
        cfg = tcfg

        def fit(self, progress_bar):
            return {"step": 3, "epochs": 0.1, "checkpoint": "ck", "interrupted": False, "start_step": 2,
                    "first_val_step": 2, "first_val_loss": 4.0, "last_val_loss": 3.5}

    monkeypatch.setattr(run, "build_run", lambda *a, **k: Done())
    logs = []
    run.run_training(run.RunOptions(), tcfg, progress_bar=False, log=logs.append)
    assert "held-out loss 4.000 (step 2, before this resume) -> 3.500" in logs[-1]
