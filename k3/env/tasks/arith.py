"""`arith`: short tool-assisted arithmetic and string puzzles, a family a small model learns in minutes on a CPU.

Each instance is one line ("What is 48213*9071+17?", "Reverse 'qzkeb'.") whose answer is a short number or
string that is tedious to get right without running code: a correct agent calls the python tool once and
submits what it printed. Instances come from a seeded generator without end; an instance is held out ("test")
by a stable hash of its prompt, so the two splits never share a question.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable, Iterator

from k3.env.task import Budget, Task, TaskFamily, Verdict, register_family
from k3.env.tasks.common import action, check_n, split_of

TEST_FRACTION = 0.1
LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOWELS = "aeiou"


def _word(rng: random.Random, lo: int = 6, hi: int = 12) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


# kind -> rng -> (prompt, python code that prints the answer); the answer is what the code prints
def _mul_add(rng):
    a, b, c = rng.randint(1000, 99999), rng.randint(100, 9999), rng.randint(1, 999)
    return f"What is {a}*{b}+{c}?", f"print({a}*{b}+{c})"


def _mul_sub(rng):
    a, b, c = rng.randint(1000, 99999), rng.randint(100, 9999), rng.randint(1, 99999)
    return f"What is {a}*{b}-{c}?", f"print({a}*{b}-{c})"


def _pow_mod(rng):
    a, e, m = rng.randint(2, 999), rng.randint(5, 40), rng.randint(7, 9973)
    return f"What is {a}**{e} % {m}?", f"print({a}**{e} % {m})"


def _floordiv(rng):
    a, b = rng.randint(10**5, 10**8), rng.randint(7, 999)
    return f"What is {a}//{b}?", f"print({a}//{b})"


def _reverse(rng):
    w = _word(rng)
    return f"Reverse '{w}'.", f"print('{w}'[::-1])"


def _vowels(rng):
    w = _word(rng, 10, 24)
    return f"How many vowels in '{w}'?", f"print(sum(c in '{VOWELS}' for c in '{w}'))"


def _sort_letters(rng):
    w = _word(rng)
    return f"Sort the letters of '{w}'.", f"print(''.join(sorted('{w}')))"


def _digit_sum(rng):
    n = rng.randint(10**8, 10**12)
    return f"Digit sum of {n}?", f"print(sum(map(int, str({n}))))"


def _reverse_vowels(rng):
    w = _word(rng, 8, 16)
    return (f"Reverse '{w}' and count its vowels.",
            f"s = '{w}'[::-1]\nprint(s, sum(c in '{VOWELS}' for c in s))")


KINDS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "mul_add": _mul_add, "mul_sub": _mul_sub, "pow_mod": _pow_mod, "floordiv": _floordiv, "reverse": _reverse,
    "vowels": _vowels, "sort_letters": _sort_letters, "digit_sum": _digit_sum, "reverse_vowels": _reverse_vowels,
}


def solve(code: str) -> str:
    """What `code` prints, without its trailing newline (the generator's own code: trusted, pure, tiny)."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(code, {})
    return buf.getvalue().strip()


def normalize(answer: str) -> str:
    """The comparable form of an answer: surrounding space, quotes, backticks and a final period dropped, inner
    runs of space collapsed, lower case, and a number's thousands separators removed."""
    s = " ".join(str(answer).split()).strip("`'\" ").rstrip(".").strip("`'\" ").lower()
    if s.replace(",", "").replace("_", "").lstrip("-").isdigit():
        s = s.replace(",", "").replace("_", "")
    return s


def _verifier(expected: str):
    def verify(sandbox, answer):
        if answer is None:
            return Verdict(0.0, False, "no answer was submitted", {"expected": expected})
        ok = normalize(answer) == normalize(expected)
        return Verdict(float(ok), ok, "correct" if ok else f"expected {expected!r}, got {answer!r}",
                       {"expected": expected, "answer": answer})
    return verify


def make_task(kind: str, prompt: str, code: str, split: str) -> Task:
    """The task of one generated question; its id is a stable hash of the prompt (the same question, the same id)."""
    expected = solve(code)
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:12]
    return Task(id=f"arith/{kind}/{digest}", family="arith", prompt=prompt, verify=_verifier(expected), split=split,
                tools=("python", "submit"), budget=Budget(turns=4, tokens=512, wall_seconds=60.0),
                metadata={"kind": kind, "code": code, "expected": expected})


@register_family("arith")
class Arith(TaskFamily):
    description = "one-line arithmetic and string puzzles solved with the python tool; a short exact answer"

    def instances(self, split: str, n: int, seed: int = 0) -> Iterator[Task]:
        check_n(split, n)
        rng = random.Random(f"arith/{seed}")
        kinds = sorted(KINDS)
        made = 0
        while made < n:
            kind = rng.choice(kinds)
            prompt, code = KINDS[kind](rng)
            if split_of(f"arith/{prompt}", TEST_FRACTION) != split:
                continue
            yield make_task(kind, prompt, code, split)
            made += 1

    @staticmethod
    def scripted_solution(task: Task) -> list[dict]:
        """Run the generator's code with the python tool, then submit what it printed."""
        return [action("python", code=task.metadata["code"]), action("submit", answer=task.metadata["expected"])]
