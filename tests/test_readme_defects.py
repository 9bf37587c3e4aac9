"""The README runs as written: each defect found by walking it, reproduced (these tests failed before the fix)."""

import os
import re
import stat

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")


def _section(heading: str) -> str:
    """The README's text under `heading` (a "## " line), up to the next heading of that level."""
    text = open(README, encoding="utf-8").read()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section, flags=re.M | re.S)


def _init_tiny(out, tokenizer="bpe") -> str:
    from k3.cli import main

    assert main(["init", "--preset", "tiny", "--tokenizer", tokenizer, "--out", str(out)]) == 0
    return str(out)


# --- 1. the quick start's BatchInfo and statistics snippet -------------------------------------------------------

def test_quick_start_batchinfo_snippet_runs_on_cpu(tmp_path):
    """The second Python snippet of "Quick start" named an undefined `seg_on_host` and moved the batch to "cuda"."""
    first, second = _blocks(_section("## Quick start"), "python")[:2]
    assert "BatchInfo" in second and "/tmp/t" in first
    ck = _init_tiny(tmp_path / "t")
    ns: dict = {}
    exec(compile(first.replace("/tmp/t", ck), "README.md: quick start 1", "exec"), ns)
    exec(compile(second, "README.md: quick start 2", "exec"), ns)
    out, ids, batch, model = ns["out"], ns["ids"], ns["batch"], ns["model"]
    T = ids.shape[1]
    assert batch.cu_seqlens_cpu.tolist() == [0, 3, T]  # the snippet's two packed documents
    cfg = model.config
    loads = out.stats.expert_loads()[1]
    assert loads.shape == (cfg.num_experts,) and int(loads.sum()) == T * cfg.num_experts_per_token
    assert out.stats.max_logit[3].shape == (cfg.num_attention_heads,)
    assert torch.isfinite(out.loss)


# --- 6. atomic writes keep the mode a plain open gives ------------------------------------------------------------

@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600)])
def test_atomic_writes_get_the_mode_of_a_plain_open(tmp_path, umask, mode):
    """Files written through k3.files (tempfile.mkstemp) were 0600 under umask 022: chat_template.json of `k3 init`,
    the draft's config.json and model.safetensors; every other file 0644."""
    from k3.checkpoint import from_pretrained
    from k3.draft_checkpoint import save_draft
    from k3.env.memory import MemoryStore
    from k3.files import _umask, atomic_write_text
    from k3.model.eagle3 import Eagle3Layer

    old = os.umask(umask)
    try:
        assert _umask() == umask
        ck = _init_tiny(tmp_path / "ck", tokenizer="bytes")
        draft = os.path.join(ck, "draft")
        save_draft(Eagle3Layer.from_target(from_pretrained(ck)), draft, ck)
        MemoryStore(str(tmp_path / "memory"), "arith").write("k", "v")
        open(tmp_path / "plain", "w").close()
    finally:
        os.umask(old)
    files = [os.path.join(ck, f) for f in os.listdir(ck) if os.path.isfile(os.path.join(ck, f))]
    files += [os.path.join(draft, f) for f in os.listdir(draft)] + [str(tmp_path / "memory" / "arith.json")]
    assert os.path.join(ck, "chat_template.json") in files and os.path.join(draft, "config.json") in files
    assert os.path.join(draft, "model.safetensors") in files
    assert {f: oct(stat.S_IMODE(os.stat(f).st_mode)) for f in files} == {f: oct(mode) for f in files}
    assert stat.S_IMODE(os.stat(tmp_path / "plain").st_mode) == mode
    # a file replaced keeps its own mode, as `open(path, "w")` leaves it
    path = os.path.join(ck, "chat_template.json")
    os.chmod(path, 0o640)
    atomic_write_text(path, "{}")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640


# --- 2. one checkpoint resolver for every flag that reads a model ---------------------------------------------------

class _Reached(Exception):
    """Raised in place of the work a command does with its checkpoint: carries the path it was given."""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A training run directory holding one complete checkpoint (a tiny model; its trainer state a stub) and an
    older incomplete one."""
    from k3.run_dir import COMPLETE_FILES

    run = tmp_path_factory.mktemp("runs") / "teacher_code"
    ck = _init_tiny(run / "checkpoints" / "step-0000300", tokenizer="bytes")
    with open(os.path.join(ck, "trainer_state.json"), "w") as f:
        f.write('{"train_config": {}}')
    open(os.path.join(ck, "trainer_state.safetensors"), "wb").close()
    assert all(os.path.isfile(os.path.join(ck, f)) for f in COMPLETE_FILES)
    os.makedirs(run / "checkpoints" / "step-0000400")  # a save cut short: never chosen
    return str(run)


def test_resolve_checkpoint_takes_a_run_dir_or_a_checkpoint_and_names_a_bad_path(run_dir, tmp_path):
    from k3.run_dir import CheckpointPathError, resolve_checkpoint

    ck = os.path.join(run_dir, "checkpoints", "step-0000300")
    said = []
    assert resolve_checkpoint(run_dir, "--teacher code", log=said.append) == ck
    assert said == [f"--teacher code: {run_dir} -> {ck}"]
    assert resolve_checkpoint(ck, "--teacher code", log=said.append) == ck and len(said) == 1  # itself, silently
    empty_run = tmp_path / "empty_run"
    os.makedirs(empty_run / "checkpoints" / "step-0000001")
    (tmp_path / "file").write_text("x")
    os.makedirs(tmp_path / "empty")
    for bad, why in [(tmp_path / "nowhere", "it does not exist"), (tmp_path / "file", "it is a file"),
                     (tmp_path / "empty", "no config.json and no checkpoints/"),
                     (empty_run, f"a run directory without a complete checkpoint in {empty_run / 'checkpoints'}")]:
        with pytest.raises(CheckpointPathError) as e:
            resolve_checkpoint(str(bad), "--student")
        msg = str(e.value)
        assert msg.startswith(f"--student: {bad}: no checkpoint there ({why}") and "expected a checkpoint directory" \
            in msg and "training run directory" in msg, msg


# Every command flag that reads a model: (argv, the flag as messages name it, where the command's work starts: patched
# to raise _Reached with the path it is given). CK stands for the path under test. `train --resume` reads its own
# --out and is not one of them.
_STUDENT = "teacher_code/checkpoints/step-0000300"  # a checkpoint (of run_dir), the student where CK is a teacher
_CKPT_FLAGS = {
    "eval --ckpt": (["eval", "--ckpt", "CK", "--device", "cpu"], "--ckpt", "k3.cli._load_for_inference"),
    "generate --ckpt": (["generate", "--ckpt", "CK", "hi", "--device", "cpu"], "--ckpt", "k3.cli._load_for_inference"),
    "serve --ckpt": (["serve", "--ckpt", "CK", "--device", "cpu"], "--ckpt", "k3.serve.cli.serve"),
    "sft --ckpt": (["sft", "--ckpt", "CK", "--data", "x.jsonl", "--device", "cpu"], "--ckpt",
                   "k3.posttrain.sft.run_sft"),
    "distill --student": (["distill", "--student", "CK", "--teacher", f"code={_STUDENT}", "--prompts", "p.jsonl",
                           "--device", "cpu"], "--student", "k3.posttrain.distill.run_distill"),
    "distill --teacher": (["distill", "--student", _STUDENT, "--teacher", "code=CK", "--prompts", "p.jsonl",
                           "--device", "cpu"], "--teacher code", "k3.posttrain.distill.run_distill"),
    "quantize --ckpt": (["quantize", "--ckpt", "CK", "--out", "q"], "--ckpt", "k3.train.qat.quantize_checkpoint"),
    "train-draft --ckpt": (["train-draft", "--ckpt", "CK", "--device", "cpu"], "--ckpt",
                           "k3.posttrain.eagle3.train_draft"),
    "rl --ckpt": (["rl", "--ckpt", "CK", "--tasks", "arith:2", "--device", "cpu"], "--ckpt", "k3.rl.trainer.run_rl"),
    "env run --ckpt": (["env", "run", "--ckpt", "CK", "--tasks", "arith:1", "--out", "e", "--sandbox", "none",
                        "--device", "cpu"], "--ckpt", "k3.serve.build.build_engine"),
    "chat-template ckpt": (["chat-template", "migrate", "CK"], "ckpt", "k3.serve.chat.migrate_chat_template"),
    "info model": (["info", "CK"], "model", "k3.config.K3Config.load"),
}


@pytest.mark.parametrize("flag", sorted(_CKPT_FLAGS))
def test_every_checkpoint_flag_takes_a_run_dir_or_a_checkpoint(flag, run_dir, tmp_path, monkeypatch, capsys):
    """`k3 distill --teacher code=runs/teacher_code` (the README's) stopped with "no checkpoint there" while
    --student and the other commands' --ckpt took the run directory: every flag now resolves alike."""
    from k3.cli import main

    argv, what, target = _CKPT_FLAGS[flag]

    def reached(path, *a, **kw):  # a path, or the run's options (SFTOptions.ckpt, DistillOptions, ...)
        if not isinstance(path, str):
            path = (path.teachers[0].split("=", 1)[1] if what.startswith("--teacher") else
                    getattr(path, "student", None) or path.ckpt)
        raise _Reached(path)

    monkeypatch.setattr(target, reached)
    monkeypatch.chdir(os.path.dirname(run_dir))  # where _STUDENT is
    ck = os.path.join(run_dir, "checkpoints", "step-0000300")
    for given in (run_dir, ck):
        with pytest.raises(_Reached) as e:
            main([a.replace("CK", given) for a in argv])
        assert e.value.args[0] == ck, (given, e.value.args[0])
        err = capsys.readouterr().err
        assert (f"k3: {what}: {run_dir} -> {ck}" in err) == (given == run_dir), err
    bad = str(tmp_path / "nowhere")
    if flag == "info model":  # a name that is no path may be a preset's misspelt: its message lists both
        with pytest.raises(SystemExit, match=re.escape(f"'{bad}' is neither a preset")):
            main(["info", bad])
        return
    assert main([a.replace("CK", bad) for a in argv]) == 2
    assert f"{what}: {bad}: no checkpoint there (it does not exist)" in capsys.readouterr().err


# --- 8. the installation's files in a venv that sees the system site-packages -------------------------------------

def test_installation_files_hold_in_a_venv_with_system_site_packages(tmp_path):
    """In a venv made with --system-site-packages, a file under both site-packages directories (pip, setuptools:
    installed in both) came twice under one name, and test_installation_files_cover_stdlib_and_site_packages failed.
    The venv's own copy, the one Python imports, is kept."""
    import json
    import subprocess
    import sys

    from k3.data.sources import installation_files

    # a documentation file of this Python's site-packages, copied into the venv's: the collision pip would make
    # (a text file, so that nothing imported in the venv changes)
    name, src = next((n, p) for n, p in installation_files()
                     if n.startswith(("site-packages/", "dist-packages/")) and n.endswith((".txt", ".md", ".rst")))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    own = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    copy = os.path.join(own, name.split("/", 1)[1])
    os.makedirs(os.path.dirname(copy), exist_ok=True)
    with open(copy, "w") as f:
        f.write("the venv's own copy\n")
    code = ("import json; from k3.data.sources import installation_files; "
            "print(json.dumps(installation_files()))")
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path,
                         env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    files = json.loads(out)
    names = [n for n, _ in files]
    assert len(set(names)) == len(names) and len({os.path.realpath(p) for _, p in files}) == len(files)
    assert dict(files)[name] == copy and os.path.realpath(src) not in {os.path.realpath(p) for _, p in files}
    assert any(n.endswith("numpy/__init__.py") for n in names)  # found in the system site-packages


# --- 7. every benchmark's --help shows its defaults ---------------------------------------------------------------

_BENCHMARKS = sorted(f for f in os.listdir(os.path.join(ROOT, "benchmarks"))
                     if f.endswith(".py") and "argparse" in open(os.path.join(ROOT, "benchmarks", f)).read())

# Runs each script as `python benchmarks/X.py --help` would (its directory first on sys.path, run as __main__), all
# in one process so that torch is imported once; the parser is caught where the script parses its arguments.
_HELP_PROBE = r"""
import argparse, io, json, runpy, sys, contextlib
root, names = sys.argv[1], sys.argv[2:]
out = {}
def short(v):  # how a help text may write a number: 0.0003 as 3e-4, 1.0 as 1
    if not isinstance(v, float):
        return [str(v)]
    m, e = format(v, "e").split("e")
    return [format(v, "g"), m.rstrip("0").rstrip(".") + "e" + str(int(e))]
def candidates(v):
    c = {str(v), repr(v), *short(v)}
    if isinstance(v, (list, tuple)):
        for f in (str, lambda x: short(x)[0]):
            c |= {" ".join(map(f, v)), ",".join(map(f, v))}
    return sorted(c)
class Caught(BaseException):
    pass
def probe(self, args=None, namespace=None):
    opts = [(a.option_strings, candidates(a.default)) for a in self._actions if a.option_strings
            and all(a.default is not v for v in (None, False, argparse.SUPPRESS))]
    raise Caught(self.format_help(), opts)
argparse.ArgumentParser.parse_known_args = probe
base = list(sys.path)
for name in names:
    path = f"{root}/benchmarks/{name}"
    sys.path[:] = [f"{root}/benchmarks"] + base
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
        out[name] = {"error": "no parser reached"}
    except Caught as e:
        out[name] = {"help": e.args[0], "options": e.args[1]}
    except BaseException as e:
        out[name] = {"error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def benchmark_help():
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _HELP_PROBE, ROOT, *_BENCHMARKS], capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _option_block(help_text: str, option: str) -> str:
    """The lines of `--help` that describe `option`: its invocation line and the indented lines after it."""
    lines = help_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if re.match(rf"\s{{2}}(\S+, )*{re.escape(option)}\b", ln))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("   ")), len(lines))
    return " ".join(lines[start:end])


@pytest.mark.parametrize("script", _BENCHMARKS)
def test_benchmark_help_shows_every_default(script, benchmark_help):
    """`benchmarks/mopd_demo.py --help` showed no defaults (nor did most benchmark scripts')."""
    got = benchmark_help[script]
    assert "help" in got, got
    assert len(_BENCHMARKS) >= 30 and "mopd_demo.py" in _BENCHMARKS
    missing = []
    for strings, values in got["options"]:
        block = re.sub(r"\s+", "", _option_block(got["help"], strings[0]))
        if "default" not in block or not any(re.sub(r"\s+", "", v) in block for v in values):
            missing.append((strings[0], values[0], block))
    assert not missing, (f"{script}: --help shows no default for {missing}; build its parser with formatter_class="
                         "k3.cli_args.DefaultsHelpFormatter (RawDefaultsHelpFormatter to print the description as "
                         "written)")


# --- 3. every input a README block uses is made by an earlier block ------------------------------------------------

def _readme_commands() -> list[list[str]]:
    """Every `k3 ...` command of the README's bash blocks, in order, as argument lists (continuations joined,
    comments dropped)."""
    import shlex

    text = open(README, encoding="utf-8").read()
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            args = shlex.split(line, comments=True)
            if args[:1] == ["k3"]:
                out.append(args[1:])
    return out


def test_readme_makes_every_data_file_and_run_it_reads_before_reading_it():
    """`data/code.jsonl` and `data/docs.jsonl` (the distillation teachers' data) and `data/prompts.jsonl` were made
    by no step of the README."""
    made, read = {"runs/k3"}, []  # runs/k3: `k3 train`'s default --out
    for args in _readme_commands():
        flags = dict(zip(args, args[1:]))
        for i, a in enumerate(args[:-1]):
            v = args[i + 1]
            if a in ("--data", "--prompts", "--ckpt", "--student") or (a == "--heldout" and args[0] != "data"):
                read.append((args[0], v))
            elif a == "--teacher":
                read.append((args[0], v.split("=", 1)[1]))
        missing = [(cmd, v) for cmd, v in read if v.startswith(("data/", "runs/")) and v not in made]
        assert not missing, (args, missing)
        read.clear()
        if "--out" in flags:
            made.add(flags["--out"])
            if flags.get("--qat") == "mxfp4":
                made.add(flags["--out"] + "/mxfp4")  # the QAT export
        if args[0] == "data" and "--heldout" in flags:
            made.add(flags["--heldout"])
    assert {"data/code.jsonl", "data/docs.jsonl", "runs/teacher_code", "runs/teacher_docs"} <= made


def test_docs_from_source_holds_out_the_files_sft_from_source_does_and_tags_the_domain(tmp_path, capsys):
    from k3.cli import main
    from k3.data.corpus import is_heldout
    from k3.posttrain.mopd import TeacherTable, read_prompts

    doc = "Opening line of the documentation.\n" + "More words about what this does.\n" * 12
    for i in range(8):
        (tmp_path / "src").mkdir(exist_ok=True)
        (tmp_path / "src" / f"m{i}.py").write_text(f'"""{doc}"""\n\n\ndef f{i}(x):\n    """{doc}"""\n    return x\n\n\n'
                                                  f'def short{i}():\n    """Too short."""\n    return 0\n')
    held = {f"m{i}.py" for i in range(8) if is_heldout(f"m{i}.py", 0.5)}
    assert 0 < len(held) < 8
    for cmd in ("docs-from-source", "sft-from-source"):
        assert main(["data", cmd, str(tmp_path / "src"), "--out", str(tmp_path / f"{cmd}.jsonl"), "--heldout",
                     str(tmp_path / f"{cmd}_heldout.jsonl"), "--heldout-fraction", "0.5", "--domain", "docs"]) == 0
    out = capsys.readouterr().out
    assert "8 files (%d held out, 0 unreadable or unparsable): 16 docstrings of at least 320 chars; wrote %d " \
        "conversations" % (len(held), 2 * (8 - len(held))) in out, out
    import json

    for cmd in ("docs-from-source", "sft-from-source"):
        recs = {part: [json.loads(x) for x in open(tmp_path / f"{cmd}{part}.jsonl")] for part in ("", "_heldout")}
        assert {r["source"].split(":")[0] for r in recs["_heldout"]} == held
        assert {r["source"].split(":")[0] for r in recs[""]} == {f"m{i}.py" for i in range(8)} - held
        assert all(r["domain"] == "docs" for part in recs.values() for r in part)
        ps = read_prompts([str(tmp_path / f"{cmd}.jsonl")], TeacherTable(["docs=CK"]))  # a prompt file as it is
        assert len(ps) == len(recs[""]) and all(p.domain == "docs" for p in ps)
    first = [json.loads(x) for x in open(tmp_path / "docs-from-source.jsonl")][0]
    text = doc.rstrip("\n")  # the docstring as ast.get_docstring gives it
    cut = text.rfind("\n", 0, 160)  # the last line break before 160 characters
    assert first["messages"][1:] == [
        {"role": "user", "content": f"Continue the documentation of {first['source']}:\n\n{text[:cut]}"},
        {"role": "assistant", "content": text[cut:cut + 320]}]
