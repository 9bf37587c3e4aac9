"""Every command that BENCHMARKS.md and the other tracked Markdown files show parses with the parser of the program it
runs, and every flag it uses is listed by that program's `--help`.

Of README.md, only what its walk (tests/test_readme_blocks.py) does not run is checked here: the blocks a skip marker
keeps from running (GPUs, several hosts, the internet) and the inline commands. The other documents mostly show GPU
runs and hour-long benchmarks, so their commands are parsed, not run: a renamed or removed flag, a wrong choice, a
value of the wrong type or a missing required argument fails with the file, the line and the command.

What is a command:
- every simple command of a fenced bash/sh/shell/console block (skip markers do not matter: they are about running),
  after joining `\\` continuations; `&&`, `||`, `;`, `&`, `|` and parentheses separate commands, `#` starts a comment,
  redirections are dropped, `NAME=value` words before a command are its environment, and a line of assignments alone
  (`C="--out runs/x"`) defines a variable that `$C` later in the same block expands to;
- an inline code span outside the blocks that starts (after `NAME=value` words) with `k3 SUBCOMMAND`, `python` or
  `python3` running a script or `-m k3`, `torchrun`, a benchmark script's path or name (`rl_demo.py --stages
  mix`), or a test file with arguments (`tests/ops/test_x.py -m gpu`, what pytest runs). A span is a fragment of a command the prose talks about: arguments it leaves out (required ones, or the
  value of a flag it ends with) are not missing, but every flag it names must exist and every value it gives must be
  valid.

Placeholders (the documents' notation for "your value here"), each accepted wherever a value goes, of any type and
choice:
- `<anything in angle brackets>`, e.g. `--cold-start <the mixed cold start>`;
- a word in capitals of up to 12 characters that is not a flag, e.g. `--seeds S`, `--ckpt CK`;
- `$NAME` of a variable the block does not define (`$HOME`);
- a word containing `...` (`--teacher code=...`); `...` alone right after a flag that takes a value is that value
  (`--backend ...`), anywhere else it stands for arguments left out (`train_throughput.py ... --seq-len 8192` repeats
  the line above); either way the command's required arguments are not looked for.
Optional parts in square brackets (`[--profile --trace t.json.gz]`) are checked as if written without the brackets;
`a|b|c` with no space around the bars is "one of", and the command is checked once per alternative.

How each program is checked:
- `k3 ...` and `python -m k3 ...`: k3.cli.build_parser(), in this process;
- `python benchmarks/x.py ...` (any script of the repository): the parser the script builds, captured in one child
  process that runs each script's main up to its parse_args (what `--help` would run), so the script's own imports
  stay out of this process; each parser is built once;
- `torchrun ...`: torch's own torchrun parser, then the script or module it runs as above;
- `python -c CODE`: the code compiles;
- the programs in EXTERNAL (not part of the project): not parsed; their repository paths are still checked.
Parsers accept exact flag names only (no abbreviations: a document should spell flags out), and every word that names
a path inside the repository (`tests/...`, `benchmarks/...`, `k3/...`, `examples/...`, `docs/...`) must exist.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", "zsh"}
REPO_DIRS = ("benchmarks", "docs", "examples", "k3", "tests")

# Programs that are not part of the project, so there is no parser of ours to check them against; the reason each is
# here. Every entry must be used by some document (checked), so the list cannot outlive the commands it excuses.
EXTERNAL = {
    "pytest": "its options come from pytest, its plugins and the conftest files; the test paths it names are checked",
    "pip": "the installer; the README's install line runs in CI (.ci/run)",
    "lm_eval": "lm-evaluation-harness, an optional outside package (not a dependency of k3)",
}

_PLACEHOLDER = "\x00ph"  # marks a placeholder word after preprocessing (never in a real argument)
_ONE_OF = "\x01"  # stands for the bar of a|b|c after preprocessing


class DocumentError(AssertionError):
    """A command of a document that does not parse (the message names the file, the line and the command)."""


# ---------------------------------------------------------------------------------------------------------------------
# Finding the commands


@dataclasses.dataclass
class Command:
    path: str  # the document, relative to the repository root
    line: int  # 1-based line of the command's first word
    shown: str  # the command as the document shows it (one logical line, or the inline span)
    words: list[str]  # after expansion: placeholders are _PLACEHOLDER-prefixed words
    fragment: bool  # an inline span: arguments it leaves out are not missing
    env: dict = dataclasses.field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}: `{' '.join(self.shown.split())}`"


def is_placeholder(word: str) -> bool:
    return word.startswith(_PLACEHOLDER) or "..." in word


def _protect(line: str) -> tuple[str, list[str]]:
    """Replace the `<placeholders>` of a line by words shlex keeps whole (they would read as redirections)."""
    found: list[str] = []

    def keep(m):
        found.append(m.group(0))
        return f"'{_PLACEHOLDER}{len(found) - 1}'"

    return re.sub(r"<[^\s<>][^<>\n]*>", keep, line), found


_SEPARATORS = {"&&", "||", ";", "&", "|", ";;", "(", ")", "|&"}
_REDIRECTS = {">", ">>", "<", ">&", "&>", "<&", ">|", "&>>"}
_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def _expand(word: str, variables: dict[str, list[str]]) -> list[str]:
    """`$NAME`/`${NAME}` of a variable the block defined: its words (an unquoted expansion splits); any other `$`: a
    placeholder."""
    m = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", word)
    if m and m.group(1) in variables:
        return list(variables[m.group(1)])
    return [_PLACEHOLDER + word] if "$" in word else [word]


def split_commands(line: str, variables: dict[str, list[str]] | None = None,
                   where: str = "") -> list[tuple[list[str], dict]]:
    """The simple commands of one logical shell line: (words, environment) each, in order. `variables` (a block's
    assignments so far, as words) is read, and updated by a command of assignments alone."""
    variables = {} if variables is None else variables
    if "<<" in line:
        raise DocumentError(f"{where}: a here-document; show its command another way or check it by hand")
    line = re.sub(r"(?:^|(?<=\s))\[(--?\w[^\[\]\n]*)\]", r" \1 ", line)  # [--optional flags] -> --optional flags
    line = re.sub(r"(?<=[\w.-])\|(?=[\w.-])", _ONE_OF, line)  # a|b|c (no spaces) is one of them, not a pipe
    line, angled = _protect(line)

    def restore(word: str) -> str:
        word = re.sub(re.escape(_PLACEHOLDER) + r"(\d+)", lambda m: _PLACEHOLDER + angled[int(m.group(1))], word)
        if re.fullmatch(r"[A-Z][A-Z0-9_]{0,11}", word):  # a metavariable: S, N, CK
            return _PLACEHOLDER + word
        return word

    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer) + [";"]
    except ValueError as e:
        raise DocumentError(f"{where}: the shell cannot split it ({e})") from None
    commands: list[tuple[list[str], dict]] = []
    current: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok in _SEPARATORS:
            env = {}
            while current and _ASSIGNMENT.match(current[0]):
                name, _, value = current.pop(0).partition("=")
                env[name] = value
            if current:
                words = [current[0]] + [restore(w) for word in current[1:] for w in _expand(word, variables)]
                commands.append((words, env))
            elif env and tok != "|":  # assignments alone: the block's variables
                variables.update({k: [restore(w) for w in shlex.split(v)] for k, v in env.items()})
            current = []
        elif tok in _REDIRECTS:
            if current and current[-1].isdigit():
                current.pop()  # the descriptor of 2>file
            i += 1  # the redirection's target
        else:
            current.append(tok)
        i += 1
    return commands


def _logical_lines(source: str) -> list[tuple[int, str]]:
    """(0-based line offset, text) of each logical line: `\\` continuations joined, a `$ ` prompt dropped."""
    out = []
    lines = source.split("\n")
    i = 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i]
        out.append((start, re.sub(r"^\s*\$ ", "", text)))
        i += 1
    return out


@functools.cache
def _script_names() -> dict[str, str]:
    """Benchmark scripts by file name, for spans that name one without its folder (`rl_demo.py --stages mix`)."""
    folder = os.path.join(ROOT, "benchmarks")
    return {f: f"benchmarks/{f}" for f in os.listdir(folder) if f.endswith(".py") and not f.startswith("_")}


def _is_command_span(words: list[str]) -> bool:
    i = 0
    while i < len(words) and _ASSIGNMENT.match(words[i]):
        i += 1
    if i == len(words):
        return False
    first, rest = words[i], words[i + 1:]
    if first == "k3":
        return bool(rest)  # `k3` alone is the program's name
    if first in ("python", "python3"):
        return bool(rest) and (rest[0] in ("-m", "-c") or rest[0].endswith(".py"))
    if first == "torchrun":
        return True
    if first.endswith(".py"):  # a script's or a test file's name or path with arguments; alone it names the file
        return bool(rest) and (first in _script_names() or first in _script_names().values()
                               or first.startswith("tests/"))
    return False


def markdown_commands(text: str, path: str, skipped_only: bool = False) -> list[Command]:
    """The commands of a Markdown document: its shell blocks' and its command-like inline code spans'. With
    `skipped_only`, of the blocks only those a `<!-- doctest: skip (...) -->` marker keeps the README walk from
    running."""
    from sybil import Document
    from sybil.parsers.markdown.lexers import FencedCodeBlockLexer
    from test_readme_blocks import readme_blocks

    skipped = {b.line for b in readme_blocks(text, path) if b.skip}
    doc = Document(text, path)
    regions = sorted(FencedCodeBlockLexer(language=r"[\w-]*")(doc), key=lambda r: r.start)
    commands: list[Command] = []
    blanked = list(text)
    for r in regions:
        for k in range(r.start, r.end):  # the spans are looked for outside the blocks only
            if blanked[k] != "\n":
                blanked[k] = " "
        fence_line = text.count("\n", 0, r.start) + 1
        if str(r.lexemes["language"]) not in SHELL_LANGUAGES or (skipped_only and fence_line not in skipped):
            continue
        source = str(r.lexemes["source"])
        first_line = fence_line + 1
        variables: dict[str, list[str]] = {}
        for offset, line in _logical_lines(source):
            where = f"{path}:{first_line + offset}: `{' '.join(line.split())}`"
            for words, env in split_commands(line, variables, where):
                commands.append(Command(path, first_line + offset, line, words, False, env))
    outside = "".join(blanked)
    for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", outside):
        span = " ".join(m.group(1).split())
        line = outside.count("\n", 0, m.start()) + 1
        try:
            if not _is_command_span(shlex.split(_protect(span)[0])):
                continue
        except ValueError:
            continue  # not shell words (unbalanced quotes): prose, not a command
        for words, env in split_commands(span, {}, f"{path}:{line}: `{span}`"):
            commands.append(Command(path, line, span, words, True, env))
    return commands


def markdown_files() -> list[str]:
    """The tracked Markdown files, relative to the repository root."""
    out = subprocess.run(["git", "ls-files", "-z", "*.md"], check=False, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"git ls-files failed (the test reads the tracked Markdown files): {out.stderr}"
    return sorted(p for p in out.stdout.split("\0") if p)


def documented_commands() -> list[Command]:
    """Every command this test checks: all of every tracked Markdown file's, and of README.md those its walk
    (tests/test_readme_blocks.py) does not run: the blocks it skips and the inline spans."""
    commands = []
    for path in markdown_files():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            commands += markdown_commands(f.read(), path, skipped_only=path == "README.md")
    return commands


# ---------------------------------------------------------------------------------------------------------------------
# Checking them: k3's and torchrun's parsers here, the scripts' in a child process


class _ParseError(Exception):
    def __init__(self, prog: str, message: str):
        super().__init__(f"{prog}: {message}")
        self.prog, self.message = prog, message


class _Help(Exception):
    """--help was parsed: the parser printed nothing (prepare() silences it) and would have exited 0."""


def _tolerant_type(fn):
    @functools.wraps(fn)
    def convert(value):
        return value if is_placeholder(value) else fn(value)

    return convert


def prepare(parser: argparse.ArgumentParser, lenient: bool) -> argparse.ArgumentParser:
    """Make `parser` (and its subparsers) raise _ParseError instead of exiting, accept exact flag names only, take
    placeholders for any value, and, when `lenient`, require nothing. Changes the parser in place; returns it."""
    parser.allow_abbrev = False

    def error(message, p=parser):
        raise _ParseError(p.prog, message)

    def check_value(action, value, p=parser, check=parser._check_value):
        if not (isinstance(value, str) and is_placeholder(value)):
            check(action, value)

    def exit_(status=0, message=None, p=parser):
        if status == 0 and not message:
            raise _Help()  # --help: a command that parses
        raise _ParseError(p.prog, f"exits ({status}) {message or ''}")

    parser.error, parser._check_value, parser.exit = error, check_value, exit_
    parser.print_help = parser.print_usage = lambda file=None: None
    for action in parser._actions:
        if callable(action.type):
            action.type = _tolerant_type(action.type)
        if lenient:
            action.required = False
    if lenient:
        for group in parser._mutually_exclusive_groups:
            group.required = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                prepare(sub, lenient)
    return parser


def _chain(parser: argparse.ArgumentParser, words: list[str]) -> list[argparse.ArgumentParser]:
    """The parser and the subparsers `words` select (`k3 env run`: k3's, env's, run's)."""
    chain = [parser]
    for w in words:
        sub = next((a for a in chain[-1]._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is not None and w in sub.choices:
            chain.append(sub.choices[w])
    return chain


def parse(parser_for, argv: list[str], fragment: bool, elided: bool, own: int | None = None) -> str | None:
    """None when `argv` parses and each of its flags is one that `--help` lists; else what is wrong.
    `parser_for(lenient)` gives the program's prepared parser; `own` is how many of the words are the program's own
    (the rest are another program's: torchrun's script and its arguments), all of them by default."""
    lenient = parser_for(True)
    chain = _chain(lenient, argv[:own])
    # `...` right after a flag that takes a value is that value; anywhere else it stands for arguments left out
    takes_value = {f for p in chain for f, a in p._option_string_actions.items() if a.nargs != 0}
    keep = [w != "..." or (i > 0 and argv[i - 1] in takes_value) for i, w in enumerate(argv)]
    own = None if own is None else sum(keep[:own])
    argv = [w for w, k in zip(argv, keep) if k]

    def attempt(parser, words):
        try:
            parser.parse_args(words)
        except _Help:
            pass
        except _ParseError as e:
            # argparse names the top parser for words no subparser took; the reader ran the subcommand
            prog = chain[-1].prog if e.message.startswith("unrecognized arguments") else e.prog
            return f"{prog}: {e.message}".replace(_PLACEHOLDER, "")
        return None

    # first everything but the required arguments (an unknown flag is the news, not the argument it left missing)
    why = attempt(lenient, argv)
    if why and fragment and argv and re.search(rf"argument (\S+/)?{re.escape(argv[-1])}(/\S+)?: expected ", why):
        why = attempt(lenient, argv + [_PLACEHOLDER + "<value>"])  # a span that ends with a flag names the flag
    if why is None and not (fragment or elided):
        why = attempt(parser_for(False), argv)
    if why:
        return why
    # every flag used is one that --help lists (a flag hidden with help=SUPPRESS parses, but no reader can find it)
    helps = "\n".join(p.format_help() for p in chain)
    for w in argv[:own]:
        flag = w.split("=", 1)[0]
        if re.fullmatch(r"--?[A-Za-z][\w-]*", flag) and not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", helps):
            return f"{chain[-1].prog}: {flag} parses but its --help does not list it"
    return None


@functools.cache
def _k3_parser(lenient: bool) -> argparse.ArgumentParser:
    from k3.cli import build_parser

    return prepare(build_parser(), lenient)


@functools.cache
def _torchrun_parser(lenient: bool) -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "torchrun"
    return prepare(parser, lenient)


def _python_target(args: list[str]) -> tuple[str, list[str]] | None:
    """(`-m module` | `-c` | script path, its arguments) of a python command line's arguments."""
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "-c"):
            return (a + " " + args[i + 1], args[i + 2:]) if i + 1 < len(args) else None
        if a in ("-X", "-W"):
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return a, args[i + 1:]
    return None


@dataclasses.dataclass
class Job:
    """One program invocation to check: `program` is "k3", "torchrun", "python -c", "external:NAME" or a script's path
    relative to the repository root."""
    command: Command
    program: str
    argv: list[str]
    own: int | None = None  # torchrun: how many words are its own (the rest are its script's)


def jobs_of(command: Command) -> tuple[list[Job], list[str]]:
    """The invocations a command makes (torchrun makes two: its own and its script's), and the problems found
    already (an unknown program, a missing path)."""
    words, problems = command.words, []
    for w in words:
        path = w.split("=", 1)[-1].split("::", 1)[0]  # --flag=path, tests/x.py::test_name
        if (path.split("/", 1)[0] in REPO_DIRS and "/" in path and not is_placeholder(path)
                and not os.path.exists(os.path.join(ROOT, path))):
            problems.append(f"{command.where}: {path} does not exist")
    variants = [[]]
    for w in words:  # a|b|c: one of them; each is checked
        alternatives = w.split(_ONE_OF) if not is_placeholder(w) else [w.replace(_ONE_OF, "|")]
        variants = [v + [a] for v in variants for a in alternatives]
    jobs: list[Job] = []
    for argv in variants:
        prog, args = argv[0], argv[1:]
        if prog in ("python", "python3"):
            target = _python_target(args)
            if target is None:
                problems.append(f"{command.where}: python with no script, -m or -c")
                continue
            prog, args = target
            if prog == "-m k3":
                prog = "k3"
            elif prog == "-m pytest":
                prog = "pytest"
            elif prog.startswith("-c "):
                jobs.append(Job(command, "python -c", [prog[3:]]))
                continue
        if prog == "torchrun":
            try:
                ns = _torchrun_parser(True).parse_args(args)
            except (_ParseError, _Help):
                jobs.append(Job(command, "torchrun", args))  # it reports what is wrong
                continue
            if ns.training_script is None:  # a span may name torchrun's own flags alone
                if not command.fragment:
                    problems.append(f"{command.where}: torchrun runs no script")
                jobs.append(Job(command, "torchrun", args))
                continue
            jobs.append(Job(command, "torchrun", args, len(args) - len(ns.training_script_args) - 1))
            prog = ("-m " if ns.module else "") + ns.training_script
            args = ns.training_script_args
            if prog == "-m k3":
                prog = "k3"
        if prog.startswith("tests/") and prog.endswith(".py"):  # `tests/x.py -m gpu`: what pytest runs
            prog, args = "pytest", [prog] + args
        if prog == "k3":
            jobs.append(Job(command, "k3", args))
        elif prog in EXTERNAL:
            jobs.append(Job(command, "external:" + prog, args))
        elif prog.endswith(".py"):
            script = prog if "/" in prog else _script_names().get(prog, prog)
            if not os.path.isfile(os.path.join(ROOT, script)):
                problems.append(f"{command.where}: no script {prog} in the repository")
            else:
                jobs.append(Job(command, os.path.normpath(script), args))
        else:
            problems.append(f"{command.where}: '{prog}' is neither a program of the project nor in EXTERNAL "
                            "(add it there with the reason it cannot be checked)")
    return jobs, problems


def check(commands: list[Command]) -> list[str]:
    """What is wrong with `commands`, one message each (file:line, the command, the parser's complaint)."""
    problems: list[str] = []
    scripts: list[Job] = []
    for command in commands:
        jobs, found = jobs_of(command)
        problems += found
        for job in jobs:
            elided = "..." in job.argv
            if job.program == "k3":
                why = parse(_k3_parser, job.argv, command.fragment, elided)
            elif job.program == "torchrun":
                why = parse(_torchrun_parser, job.argv, command.fragment, elided, job.own)
            elif job.program == "python -c":
                try:
                    compile(job.argv[0], command.where, "exec")
                    why = None
                except SyntaxError as e:
                    why = f"python -c: {e}"
            elif job.program.startswith("external:"):
                why = None
            else:
                scripts.append(job)
                continue
            if why:
                problems.append(f"{command.where}: {why}")
    if scripts:
        request = [{"script": j.program, "argv": j.argv, "fragment": j.command.fragment} for j in scripts]
        for job, why in zip(scripts, _ask_child(request), strict=True):
            if why:
                problems.append(f"{job.command.where}: {why}")
    return problems


@functools.cache
def _child() -> subprocess.Popen:
    """The process that builds the scripts' parsers (each once) and parses with them, for every check of this test
    session: a script's imports (torch, the kernels) and its main up to parse_args stay out of the test process."""
    import atexit

    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--parse-scripts"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def stop():
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()

    atexit.register(stop)
    return proc


def _ask_child(request: list[dict]) -> list[str | None]:
    proc = _child()
    proc.stdin.write(json.dumps(request) + "\n")
    proc.stdin.flush()
    reply = proc.stdout.readline()
    assert reply, f"the script parser process exited ({proc.wait()}); its error is above"
    return json.loads(reply)


class _Captured(BaseException):  # not an Exception: a script's own `except Exception` must not swallow it
    def __init__(self, parser):
        self.parser = parser


def _capture_parser(script: str) -> argparse.ArgumentParser:
    """The parser `script` builds: its main runs (as `python script --help` would) up to its parse_args."""
    import runpy

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    saved = (sys.argv, sys.path[0], argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args)
    sys.argv, sys.path[0] = [script], os.path.dirname(os.path.abspath(script))
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        runpy.run_path(script, run_name="__main__")
    except _Captured as c:
        return c.parser
    finally:
        sys.argv, sys.path[0] = saved[0], saved[1]
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved[2], saved[3]
    raise RuntimeError(f"{script} finished without parsing its arguments")


@functools.cache
def _prepared_copy(parser: argparse.ArgumentParser, lenient: bool) -> argparse.ArgumentParser:
    import copy

    return prepare(copy.deepcopy(parser), lenient)


_BUILT: dict[str, argparse.ArgumentParser | str] = {}  # the child's parsers, by script


def _parse_scripts(request: list[dict]) -> list[str | None]:
    """The child process's work: each request's script parser (built once a script), and what is wrong, or None."""
    answers = []
    for r in request:
        script = r["script"]
        if script not in _BUILT:
            try:
                _BUILT[script] = _capture_parser(script)
            except BaseException as e:  # noqa: BLE001 -- a script that cannot build its parser is the answer
                _BUILT[script] = f"{script}: could not build its parser ({type(e).__name__}: {e})"
        parser = _BUILT[script]
        if isinstance(parser, str):
            answers.append(parser)
            continue
        parser.prog = script
        answers.append(parse(functools.partial(_prepared_copy, parser), r["argv"], r["fragment"], "..." in r["argv"]))
    return answers


# ---------------------------------------------------------------------------------------------------------------------
# The tests


def _benchmarks_block(needle: str) -> tuple[str, int]:
    """BENCHMARKS.md's text and the line of its command that contains `needle` (a real command the tests break)."""
    with open(os.path.join(ROOT, "BENCHMARKS.md"), encoding="utf-8") as f:
        text = f.read()
    found = [c.line for c in markdown_commands(text, "BENCHMARKS.md") if not c.fragment and needle in c.shown]
    assert found, f"BENCHMARKS.md shows no block command with {needle!r} any more: pick another for this test"
    return text, found[0]


def _check_line(text: str, line: int) -> list[str]:
    return check([c for c in markdown_commands(text, "BENCHMARKS.md") if c.line == line])


def test_documented_commands_parse():
    """Every command of every tracked Markdown file (README.md's that its walk does not run) parses with its
    program's parser and uses only flags its --help lists (about 10 s on 2 shared CPU cores, most of it the one child
    process that imports torch and builds the benchmark scripts' parsers)."""
    import time

    t0 = time.monotonic()
    commands = documented_commands()
    problems = check(commands)
    programs = {j.program for c in commands for j in jobs_of(c)[0]}
    print(f"{len(commands)} commands of {len(markdown_files())} Markdown files, {len(programs)} programs, "
          f"checked in {time.monotonic() - t0:.1f}s")
    assert not problems, f"{len(problems)} documented commands do not parse:\n" + "\n".join(problems)
    # the walk found what it checks: the k3 parser, torchrun's, and the scripts' (a lexer that finds nothing fails)
    assert {"k3", "torchrun", "python -c", "benchmarks/serve_bench.py", "benchmarks/rl_demo.py"} <= programs, programs
    assert sum(p.startswith("benchmarks/") for p in programs) >= 20, programs
    assert {c.path for c in commands} >= {"BENCHMARKS.md", "README.md"}


def test_external_programs_are_used():
    """EXTERNAL excuses only programs some document runs (an entry no command uses is stale)."""
    used = {j.program.removeprefix("external:") for c in documented_commands() for j in jobs_of(c)[0]}
    assert set(EXTERNAL) <= used, f"EXTERNAL entries no document runs: {sorted(set(EXTERNAL) - used)}"


def test_a_broken_benchmarks_command_fails():
    """The test of the test: real BENCHMARKS.md commands, each broken one way, fail with the file, the line and what
    is wrong; the unbroken ones pass."""
    text, line = _benchmarks_block("benchmarks/serve_bench.py --preset k3-mini --ttft 8192 --decode-batch 1 16 64")
    assert _check_line(text, line) == []
    broken = text.replace("--ttft 8192 --decode-batch 1 16 64", "--ttft 8192 --decode-batches 1 16 64", 1)
    problems = _check_line(broken, line)
    assert len(problems) == 1 and problems[0].startswith(f"BENCHMARKS.md:{line}: `python benchmarks/serve_bench.py")
    assert "unrecognized arguments: --decode-batches" in problems[0], problems

    text, line = _benchmarks_block("k3 eval --ckpt runs/main")
    assert _check_line(text, line) == []
    for old, new, why in [
        ("k3 eval --ckpt runs/main", "k3 eval --checkpoint runs/main", "unrecognized arguments: --checkpoint"),
        ("k3 eval --ckpt runs/main", "k3 eval --ckp runs/main", "unrecognized arguments: --ckp"),  # no abbreviations
        ("k3 eval --ckpt runs/main", "k3 eval --ckpt runs/main --batch-size 0", "argument --batch-size: "),
        ("k3 eval --ckpt runs/main", "k3 eval --max-batches 2", "the following arguments are required: --ckpt"),
        ("k3 eval --ckpt runs/main", "k3 evaluate --ckpt runs/main", "invalid choice: 'evaluate'"),
    ]:
        problems = _check_line(text.replace(old, new, 1), line)
        assert len(problems) == 1 and problems[0].startswith(f"BENCHMARKS.md:{line}: `{new}`: k3"), (new, problems)
        assert why in problems[0], (new, problems)


def test_wrong_choices_and_missing_paths_fail():
    """A wrong choice of a script's flag, one wrong alternative of a|b|c, and a test file that does not exist."""
    text, line = _benchmarks_block("--batch-tokens 32768|262144|1048576")
    assert _check_line(text, line) == []
    for old, new, why in [
        ("--backend fast", "--backend fastest", "argument --backend: invalid choice: 'fastest'"),
        ("32768|262144|1048576", "32768|lots|1048576", "argument --batch-tokens: invalid int value: 'lots'"),
        ("[--profile --trace t.json.gz]", "[--profile --tracefile t.json.gz]", "unrecognized arguments: --tracefile"),
    ]:
        start = text.index("--batch-tokens 32768|262144|1048576")
        region = text.rindex("```bash", 0, start)
        broken = text[:region] + text[region:].replace(old, new, 1)
        problems = _check_line(broken, line)
        assert problems and all(p.startswith(f"BENCHMARKS.md:{line}: ") for p in problems), (new, problems)
        assert any(why in p for p in problems), (new, problems)
    text, line = _benchmarks_block("tests/model/test_fast_backends_gpu.py")
    broken = text.replace("tests/model/test_fast_backends_gpu.py", "tests/model/test_fast_backend_gpu.py")
    problems = _check_line(broken, line)
    assert problems == [f"{c.where}: tests/model/test_fast_backend_gpu.py does not exist"
                        for c in markdown_commands(broken, "BENCHMARKS.md") if c.line == line], problems


def _doc(block: str = "", prose: str = "") -> list[Command]:
    return markdown_commands(f"{prose}\n\n```bash\n{block}```\n", "doc.md")


def test_shell_syntax():
    """Continuations, environment prefixes, variables, pipes, chains, comments and redirections: the words each
    program gets."""
    commands = _doc(
        "K3_X=1 OMP_NUM_THREADS=2 k3 train \\\n"
        "    --max-steps 2 && k3 eval --ckpt runs/k3 2>&1 | tail -3  # a comment --not-a-flag\n"
        'C="--preset tiny --seed 1"\n'
        "k3 init $C --out runs/x > log.txt; python -m k3 info $HOME/cfg.json\n"
        "torchrun --nproc-per-node 2 -m k3 train --ep 2 &\n")
    got = [(c.line, c.words, c.env) for c in commands]
    assert got == [
        (4, ["k3", "train", "--max-steps", "2"], {"K3_X": "1", "OMP_NUM_THREADS": "2"}),
        (4, ["k3", "eval", "--ckpt", "runs/k3"], {}),
        (4, ["tail", "-3"], {}),
        (7, ["k3", "init", "--preset", "tiny", "--seed", "1", "--out", "runs/x"], {}),
        (7, ["python", "-m", "k3", "info", _PLACEHOLDER + "$HOME/cfg.json"], {}),
        (8, ["torchrun", "--nproc-per-node", "2", "-m", "k3", "train", "--ep", "2"], {}),
    ], got
    assert "'tail' is neither a program of the project nor in EXTERNAL" in check(commands)[0]
    assert check([c for c in commands if c.words[0] != "tail"]) == []
    bad = _doc("torchrun --nproc-per-node 2 -m k3 train --epp 2\ntorchrun --nproc-per-nodes 2 -m k3 train\n")
    assert [p.split(": ", 2)[2] for p in check(bad)] == ["k3 train: unrecognized arguments: --epp 2",
                                                          "torchrun: unrecognized arguments: --nproc-per-nodes"]
    with pytest.raises(DocumentError, match="doc.md:4: .*here-document"):
        _doc("cat <<EOF\nx\nEOF\n")


def test_placeholders():
    """The documented placeholder rules: each stands for a value of any type; `...` alone elides arguments, or is
    the value of the flag before it; inline spans are fragments, blocks are whole commands."""
    ok = _doc("k3 init --preset tiny --out <dir> --seed N\n"
              "k3 generate ... --max-new-tokens <n>\n"  # --ckpt and the prompt elided
              "k3 route --backend ... --policy round-robin\n"
              "k3 distill --student runs/base --teacher code=... --prompts p.jsonl --out runs/mopd\n")
    assert check(ok) == []
    bad = _doc("k3 init --preset tiny --seed N\n"  # a block is a whole command: --out is missing
               "k3 generate ... --max-new-token <n>\n"  # elided arguments, but a flag that does not exist
               "k3 init --preset <p> --out o --seed 1.5\n")  # a placeholder is not a licence for other values
    assert [p.split(": ", 2)[2] for p in check(bad)] == [
        "k3 init: the following arguments are required: --out",
        "k3 generate: unrecognized arguments: --max-new-token",  # (<n> is taken for the prompt)
        "k3 init: argument --seed: invalid int value: '1.5'"]
    spans = _doc(prose="Run `k3 serve` or `k3 serve --speculative mtp`, `torchrun --nproc-per-node 1`, then `k3 "
                       "train\n--max-minutes 10`; `gpu_suite.py --load-cache` and `k3` and `benchmarks/rl_demo.py`.")
    assert [c.words for c in spans] == [["k3", "serve"], ["k3", "serve", "--speculative", "mtp"],
                                        ["torchrun", "--nproc-per-node", "1"], ["k3", "train", "--max-minutes", "10"],
                                        ["gpu_suite.py", "--load-cache"]]
    assert all(c.fragment for c in spans) and check(spans) == []
    bad = _doc(prose="`k3 serve --speculative mtpp` and `k3 serve --chkpt` and `gpu_suite.py --load-caches x`")
    problems = [p.split(": ", 2)[2] for p in check(bad)]
    assert len(problems) == 3 and problems[0].startswith("k3 serve: argument --speculative: invalid choice: 'mtpp'")
    assert problems[1:] == ["k3 serve: unrecognized arguments: --chkpt",
                            "benchmarks/gpu_suite.py: unrecognized arguments: --load-caches x"]


def test_a_flag_help_does_not_list_fails():
    """A flag that parses but --help hides (help=SUPPRESS) is not one a reader can find: it fails."""
    def parser_for(lenient):
        p = argparse.ArgumentParser(prog="tool")
        p.add_argument("--shown", type=int)
        p.add_argument("--hidden", type=int, help=argparse.SUPPRESS)
        return prepare(p, lenient)

    assert parse(parser_for, ["--shown", "1"], fragment=False, elided=False) is None
    assert parse(parser_for, ["--hidden", "1"], False, False) == "tool: --hidden parses but its --help does not list it"


if __name__ == "__main__" and sys.argv[1:] == ["--parse-scripts"]:
    # one request (a JSON list) a line in, one answer a line out; what the scripts print goes to stderr
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for request_line in sys.stdin:
        replies.write(json.dumps(_parse_scripts(json.loads(request_line))) + "\n")
        replies.flush()
