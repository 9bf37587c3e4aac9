"""Two kinds of autonomous execution tasks (k3.env.tasks.autonomous) about data and files.

- "aggregate_csv": write aggregate.py, which turns data.csv into out.csv (one row per group, one aggregate).
  Public verifier: runs the script on the workspace's data and reports each wrong row. Hidden verifier: the
  final out.csv must be right, and the script must also be right on held-out data (other rows, columns in
  another order, a quoted field with a comma), which exists only in the verifier's fork.
- "organize_files": move the files of inbox/ into archive/ by a naming rule. Public verifier: where the files
  are (up to three misplaced ones named). Hidden verifier: every file in place with its content unchanged,
  inbox/ empty and nothing else in archive/.
"""

from __future__ import annotations

import csv
import hashlib
import io
import random

from k3.env.sandbox import SandboxError
from k3.env.task import Budget, Task, Verdict
from k3.env.tasks.common import PYTHON, action, describe_failure, split_of

TEST_FRACTION = 0.2
SCRIPT_SECONDS = 30.0
REGIONS = ("north", "south", "east", "west", "central", "coast")
PRODUCTS = ("apple", "pear", "plum", "fig", "kiwi", "lime")
COLUMNS = ("order_id", "region", "product", "units", "price")
# aggregate -> (what the prompt says, is it a float)
AGGREGATES = {"total_units": ("the sum of units", False), "orders": ("the number of rows", False),
              "mean_price": ("the mean of price", True), "max_price": ("the largest price", True),
              "revenue": ("the sum of units * price", True)}


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


# --- aggregate_csv -----------------------------------------------------------------------------------------------

def _rows(rng: random.Random, n: int, products=PRODUCTS) -> list[dict]:
    return [{"order_id": str(1000 + i), "region": rng.choice(REGIONS), "product": rng.choice(products),
             "units": str(rng.randint(1, 50)), "price": f"{rng.randint(50, 5000) / 100:.2f}"} for i in range(n)]


def _csv(rows: list[dict], columns=COLUMNS) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def expected_table(rows: list[dict], key: str, agg: str) -> list[tuple[str, float]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r[key], []).append(r)
    out = []
    for k in sorted(groups):
        g = groups[k]
        units, prices = [int(r["units"]) for r in g], [float(r["price"]) for r in g]
        value = {"total_units": sum(units), "orders": len(g), "mean_price": sum(prices) / len(g),
                 "max_price": max(prices), "revenue": sum(u * p for u, p in zip(units, prices))}[agg]
        out.append((k, value))
    return out


def compare_table(name: str, text: str | None, key: str, agg: str,
                  want: list[tuple[str, float]]) -> tuple[str, int, int, list[str]]:
    """(name, rows right, rows expected, what is wrong) for an out.csv's text against the expected table; a float
    is right within half a cent (two decimals are asked for)."""
    if text is None:
        return name, 0, len(want), ["out.csv does not exist"]
    lines = list(csv.reader(io.StringIO(text)))
    if not lines or [c.strip() for c in lines[0]] != [key, agg]:
        return name, 0, len(want), [f"the header is {lines[0] if lines else 'missing'}, expected {[key, agg]}"]
    got, problems, right = lines[1:], [], 0
    if len(got) != len(want):
        problems.append(f"{len(got)} data rows, expected {len(want)} (one per {key})")
    for i, (k, v) in enumerate(want):
        row = got[i] if i < len(got) else None
        try:
            ok = row is not None and row[0] == k and abs(float(row[1]) - v) <= 0.005 + 1e-9
        except (ValueError, IndexError):
            ok = False
        right += ok
        if not ok:
            problems.append(f"row {i + 1}: got {row}, expected {[k, f'{v:.2f}' if AGGREGATES[agg][1] else v]}")
    return name, right, len(want), problems


def _check_script(name: str, fork, data: str | None, key: str, agg: str,
                  want: list[tuple[str, float]]) -> tuple[str, int, int, list[str]]:
    """Run aggregate.py in `fork` (on `data` as data.csv when given) and compare the out.csv it writes."""
    if "aggregate.py" not in fork.list_files():
        return name, 0, len(want), ["aggregate.py does not exist"]
    if data is not None:
        fork.write_file("data.csv", data)
    res = fork.exec(f"rm -rf out.csv && {PYTHON} aggregate.py", timeout=SCRIPT_SECONDS)
    try:
        text = fork.read_file("out.csv").decode("utf-8", "replace")
    except SandboxError:
        text = None
    result = compare_table(name, text, key, agg, want)
    if not res.ok:
        result[3].insert(0, f"aggregate.py failed ({describe_failure(res)})")
    return result


def _table_verdict(results: list[tuple[str, int, int, list[str]]]) -> Verdict:
    right = sum(r for _, r, _, _ in results)
    total = sum(t for _, _, t, _ in results)
    ok = all(r == t and not p for _, r, t, p in results)
    details = "; ".join(f"{name}: {r}/{t} rows right" + (" (" + "; ".join(p[:3]) + ")" if p else "")
                        for name, r, t, p in results)
    return Verdict(float(ok), ok, details, {"pass_fraction": right / max(total, 1)})


def aggregate_task(rng: random.Random, split: str, max_submissions: int, budget: Budget) -> Task:
    while True:
        key, agg = rng.choice(("region", "product")), rng.choice(sorted(AGGREGATES))
        rows = _rows(rng, rng.randint(15, 40))
        data = _csv(rows)
        if split_of(f"aggregate_csv/{key}/{agg}/{data}", TEST_FRACTION) == split:
            break
    held_rows = _rows(rng, rng.randint(10, 30), PRODUCTS + ("fig, dried",))
    held_columns = tuple(rng.sample(COLUMNS, len(COLUMNS)))
    want, held_want = expected_table(rows, key, agg), expected_table(held_rows, key, agg)
    held_data = _csv(held_rows, held_columns)
    fmt = "with two decimals" if AGGREGATES[agg][1] else "as an integer"
    prompt = (f"Write aggregate.py: it reads data.csv (CSV with a header row; columns may come in any order and "
              f"fields may be quoted) and writes out.csv with the header `{key},{agg}` and one row per distinct "
              f"{key}, sorted by {key}, where {agg} is {AGGREGATES[agg][0]} over that {key}'s rows, {fmt}. Run it "
              f"so out.csv exists. `submit` runs it and reports; you have {max_submissions} submissions. The hidden "
              "check also runs it on other data.")

    def public_verify(sandbox, answer):
        fork = sandbox.fork()
        try:
            result = _check_script("data.csv", fork, None, key, agg, want)
        finally:
            fork.close()
        return _table_verdict([result])

    def verify(sandbox, answer):
        try:
            final = sandbox.read_file("out.csv").decode("utf-8", "replace")
        except SandboxError:
            final = None
        return _table_verdict([compare_table("the final out.csv", final, key, agg, want),
                               _check_script("held-out data", sandbox, held_data, key, agg, held_want)])

    return Task(id=f"autonomous/aggregate_csv/{key}/{agg}/{digest(data)}", family="autonomous",
                prompt=prompt, image={"data.csv": data}, verify=verify, public_verify=public_verify,
                max_submissions=max_submissions, budget=budget, split=split,
                metadata={"kind": "aggregate_csv", "key": key, "aggregate": agg})


AGGREGATE_SCRIPT = '''"""out.csv: {agg} of data.csv by {key}."""
import csv

groups = {{}}
with open("data.csv", newline="") as f:
    for row in csv.DictReader(f):
        groups.setdefault(row["{key}"], []).append((int(row["units"]), float(row["price"])))
with open("out.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\\n")
    w.writerow(["{key}", "{agg}"])
    for k in sorted(groups):
        g = groups[k]
        v = {expr}
        w.writerow([k, v if isinstance(v, int) else f"{{v:.2f}}"])
'''
EXPRESSIONS = {"total_units": "sum(u for u, _ in g)", "orders": "len(g)",
               "mean_price": "sum(p for _, p in g) / len(g)",
               "max_price": "max(p for _, p in g)", "revenue": "sum(u * p for u, p in g)"}


# --- organize_files ----------------------------------------------------------------------------------------------

PREFIXES = ("IMG", "scan", "Report", "invoice", "notes", "Clip")
EXTENSIONS = ("jpg", "txt", "pdf", "csv")
# rule -> (how the prompt states it, the target of (prefix, y, m, d, ext, name))
RULES = {
    "by_month": ("archive/<YYYY>/<MM>/<the original file name>",
                 lambda p, y, m, d, e, name: f"archive/{y}/{m}/{name}"),
    "by_type": ("archive/<extension>/<YYYY>-<MM>-<DD>_<prefix in lower case>.<extension>",
                lambda p, y, m, d, e, name: f"archive/{e}/{y}-{m}-{d}_{p.lower()}.{e}"),
    "by_year": ("archive/<YYYY>/<the original file name in lower case>",
                lambda p, y, m, d, e, name: f"archive/{y}/{name.lower()}"),
}


def _inbox(rng: random.Random, rule: str) -> dict[str, tuple[str, str]]:
    """inbox file name -> (target path, content), names in two date styles, targets distinct."""
    files: dict[str, tuple[str, str]] = {}
    n = rng.randint(8, 14)
    while len(files) < n:
        p, e = rng.choice(PREFIXES), rng.choice(EXTENSIONS)
        y, m, d = str(rng.randint(2019, 2024)), f"{rng.randint(1, 12):02d}", f"{rng.randint(1, 28):02d}"
        name = rng.choice([f"{p}_{y}{m}{d}_{rng.randint(1, 99)}.{e}", f"{p}-{y}-{m}-{d}.{e}"])
        target = RULES[rule][1](p, y, m, d, e, name)
        if name not in files and target not in {t for t, _ in files.values()}:
            files[name] = (target, f"{p} {y}-{m}-{d} {rng.getrandbits(64):016x}\n")
    return files


def organize_task(rng: random.Random, split: str, max_submissions: int, budget: Budget) -> Task:
    while True:
        rule = rng.choice(sorted(RULES))
        files = _inbox(rng, rule)
        if split_of(f"organize_files/{rule}/{sorted(files)}", TEST_FRACTION) == split:
            break
    moves = {f"inbox/{name}": target for name, (target, _) in files.items()}
    contents = {target: content for target, content in files.values()}
    example = next(iter(files))
    prompt = (f"Move every file of inbox/ to {RULES[rule][0]}, taking the date from the file name (it is written "
              f"YYYYMMDD or YYYY-MM-DD) and the prefix (the part before the date, without '_' or '-'). For example "
              f"inbox/{example} goes to {files[example][0]}. Keep the contents; leave nothing in inbox/. "
              f"`submit` reports where the files are; you have {max_submissions} submissions.")

    def public_verify(sandbox, answer):
        present = set(sandbox.list_files())
        missing = [t for t in contents if t not in present]
        n = len(contents) - len(missing)
        details = f"{n}/{len(contents)} files where the rule puts them" + (
            "; missing: " + ", ".join(missing[:3]) if missing else "")
        return Verdict(n / len(contents), not missing, details, {"pass_fraction": n / len(contents)})

    def verify(sandbox, answer):
        present = set(sandbox.list_files())
        wrong = [t for t, c in contents.items()
                 if t not in present or sandbox.read_file(t).decode("utf-8", "replace") != c]
        left = [f for f in present if f.startswith("inbox/")]
        extra = [f for f in present if f.startswith("archive/") and f not in contents]
        ok = not (wrong or left or extra)
        problems = [f"{len(wrong)} files missing or changed" if wrong else "",
                    f"{len(left)} files left in inbox/" if left else "",
                    f"{len(extra)} unexpected files in archive/" if extra else ""]
        right = len(contents) - len(wrong)
        return Verdict(float(ok), ok, "; ".join(p for p in problems if p) or "every file in place",
                       {"pass_fraction": right / (len(contents) + len(left) + len(extra))})

    return Task(id=f"autonomous/organize_files/{rule}/{digest(str(sorted(files)))}", family="autonomous",
                prompt=prompt, image={f"inbox/{name}": content for name, (_, content) in files.items()},
                verify=verify, public_verify=public_verify, max_submissions=max_submissions, budget=budget, split=split,
                metadata={"kind": "organize_files", "rule": rule, "moves": moves})


# --- the kinds ---------------------------------------------------------------------------------------------------

def make(kind: str, rng: random.Random, split: str, max_submissions: int, budget: Budget) -> Task:
    maker = {"aggregate_csv": aggregate_task, "organize_files": organize_task}
    if kind not in maker:
        raise ValueError(f"autonomous data kind must be one of {sorted(maker)}, got {kind!r}")
    return maker[kind](rng, split, max_submissions, budget)


def solution(task: Task) -> list[dict]:
    """The actions of a correct agent: write and run the script, or move the files; then submit."""
    m = task.metadata
    if m["kind"] == "aggregate_csv":
        script = AGGREGATE_SCRIPT.format(key=m["key"], agg=m["aggregate"], expr=EXPRESSIONS[m["aggregate"]])
        return [action("shell", command="head -5 data.csv"),
                action("write_file", path="aggregate.py", content=script),
                action("shell", command=f"{PYTHON} aggregate.py && cat out.csv"), action("submit", answer="out.csv")]
    code = f"import os\nfor src, dst in {sorted(m['moves'].items())!r}:\n    os.renames(src, dst)\n"
    return [action("shell", command="ls inbox"), action("python", code=code),
            action("submit", answer="moved the files")]
