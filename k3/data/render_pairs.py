"""`k3 data render-pairs`: image-text pairs rendered here, with no download (report §2.4, §3.1: the vision corpus's
OCR and visual-coding data, "code paired with rendered images").

Three kinds of pair:
  * code: a window of lines of a Python source of this installation (the standard library and site-packages,
    k3.data.sources.installation_files), rendered as text;
  * doc: a window of a documentation file (.rst, .md, .txt) or of a docstring of a Python source;
  * chart: a bar or line chart drawn with matplotlib from a few random integers, paired with its data as CSV (the
    values are written on the chart, so the image holds all of it).
The text of a code or doc pair is exactly what is drawn: printable ASCII (windows with other characters are
skipped, so no glyph can be missing from the font), tabs expanded to 4 spaces, trailing spaces and blank edge lines
removed; a line longer than the style's column limit is wrapped in the image and kept whole in the text.

Rendering: Pillow, with a monospace TrueType font of the system's packages (Debian's fonts-dejavu, fonts-liberation,
fonts-noto-mono, fonts-freefont; every face found is a style) or, without one, Pillow's default font. Each pair draws
its style: font face and size, colour theme, padding, line spacing and wrap column. The canvas is a multiple of the
encoder's unit (VisionConfig.pixel_multiple: 28 px) on both sides, and lines are added only while it stays within
`max_image_tokens`, so k3.data.images keeps the pixels as drawn (no resampling of the text).

Determinism: pair i is drawn from `random.Random(f"{seed}:{i}")` alone, so a seed gives byte-identical images and
texts (on the same installation, fonts and Pillow/matplotlib versions), and the first n pairs of a longer run are
the pairs of a shorter one.

Held out by document: a pair's document is the source file it was cut from (a chart's, its CSV); the document is
held out when the first 64 bits of the SHA-1 of its bytes (k3.data.sources.content_hash), over 2^64, are below
`heldout_share`. Every window of a held-out file is held out whatever the seed, and a held-out pair whose text also
occurs among the training pairs is dropped (counted).

Output, written into a temporary directory and swapped into place (k3.files.replace_dir):
    OUT/train.jsonl, OUT/heldout.jsonl   records in k3.data.images's pair form, image paths relative to OUT:
        {"text": ..., "images": [{"path": "images/0000012.png"}], "prompt": ..., "kind": "code",
         "source": "json/decoder.py:120", "document": "<16 hex digits>", "style": {...}}
    OUT/images/*.png                     one RGB PNG per pair
    OUT/meta.json                        the arguments, fonts, library versions and counts
"""

from __future__ import annotations

import ast
import functools
import glob
import hashlib
import io
import json
import math
import os
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field

DEFAULT_HELDOUT_SHARE = 0.05
DEFAULT_MAX_IMAGE_TOKENS = 1024  # k3.data.images.DEFAULT_MAX_IMAGE_TOKENS (not imported: it pulls in torch)
DEFAULT_MAX_LINES = 16
KINDS = ("code", "doc", "chart")
KIND_WEIGHTS = {"code": 0.45, "doc": 0.35, "chart": 0.2}
PROMPTS = {
    "code": "Transcribe the code in the image exactly.",
    "doc": "Transcribe the text in the image exactly.",
    "chart": "Give the data of this chart as CSV.",
}
CODE_EXTENSIONS = (".py", ".pyi")
DOC_EXTENSIONS = (".rst", ".md", ".txt")
FONT_SIZES = (12, 14, 16, 18, 20, 24)
PADDINGS = (4, 8, 12, 16, 24)
LINE_SPACINGS = (1.0, 1.15, 1.3)
WRAP_COLUMNS = (48, 64, 80, 100, 120)
MIN_COLUMNS = 16  # a font size is used only where a line of this many characters fits the token budget
THEMES = {  # name: (background, foreground)
    "light": ((255, 255, 255), (20, 20, 20)),
    "dark": ((30, 30, 30), (220, 220, 220)),
    "solarized": ((253, 246, 227), (88, 110, 117)),
    "sepia": ((244, 236, 216), (67, 52, 34)),
    "terminal": ((0, 0, 0), (51, 255, 102)),
    "blueprint": ((22, 50, 110), (235, 240, 255)),
}
# Monospace faces of Debian's font packages, first found first.
FONT_PATTERNS = (
    "/usr/share/fonts/truetype/dejavu/DejaVuSansMono*.ttf",
    "/usr/share/fonts/truetype/liberation*/LiberationMono-*.ttf",
    "/usr/share/fonts/truetype/noto/NotoSansMono-*.ttf",
    "/usr/share/fonts/truetype/noto/NotoMono-*.ttf",
    "/usr/share/fonts/truetype/freefont/FreeMono*.ttf",
)
MAX_ATTEMPTS = 64  # windows tried for one pair before giving up (each draw comes from the pair's own generator)
CHART_UNITS = ((20, 14), (18, 12), (16, 12), (14, 10), (12, 9), (10, 8), (8, 6))  # (width, height) in 28 px units
CHART_LABELS = (
    ("month", ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")),
    ("day", ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")),
    ("fruit", ("apple", "banana", "cherry", "grape", "kiwi", "lemon", "mango", "pear")),
    ("team", ("red", "blue", "green", "gold", "teal", "gray", "pink", "plum")),
    ("region", ("north", "south", "east", "west", "center", "coast", "hills", "delta")),
)
CHART_SERIES = ("sales", "users", "errors", "visits", "score", "count", "orders", "clicks")
CHART_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf", "#555555")


@dataclass
class Pair:
    kind: str
    text: str
    image: object  # PIL.Image.Image, RGB
    source: str
    document: int  # content hash of the source document
    style: dict


@dataclass
class RenderStats:
    pairs: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    train: int = 0
    heldout: int = 0
    leaked: int = 0  # held-out pairs dropped: their text is also a training pair's
    seconds: float = 0.0


# ------------------------------------------------------------------------------------------------ sources

def monospace_fonts() -> list[str]:
    """The monospace TrueType faces installed (FONT_PATTERNS), in a fixed order; empty when there are none."""
    out = []
    for pat in FONT_PATTERNS:
        out += sorted(p for p in glob.glob(pat) if p not in out)
    return out


def source_files() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """((name, path) of the Python sources, of the documentation files) of this installation."""
    from k3.data.sources import installation_files

    files = installation_files()
    return ([f for f in files if f[0].endswith(CODE_EXTENSIONS)],
            [f for f in files if f[0].endswith(DOC_EXTENSIONS)])


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def clean_lines(lines: list[str]) -> list[str] | None:
    """Lines as they are drawn: tabs expanded, trailing spaces removed, blank lines at both ends dropped. None when
    a character is not printable ASCII or nothing is left."""
    out = [ln.expandtabs(4).rstrip() for ln in lines]
    if any(not (32 <= ord(c) < 127) for ln in out for c in ln):
        return None
    while out and not out[0]:
        out.pop(0)
    while out and not out[-1]:
        out.pop()
    return out or None


def _docstrings(text: str) -> list[tuple[int, str]]:
    """(line, cleaned docstring) of the module, classes and functions of a Python source."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append((getattr(node, "lineno", 1), doc))
    return sorted(out)


def _window(rng: random.Random, lines: list[str], max_lines: int) -> tuple[int, list[str]] | None:
    """(0-based first line, the cleaned window) of at most `max_lines` lines at a random place."""
    if not lines:
        return None
    k = rng.randint(1, max_lines)
    start = rng.randrange(len(lines))
    window = lines[start:start + k]
    got = clean_lines(window)
    lead = next((i for i, ln in enumerate(window) if ln.strip()), 0)  # blank lines clean_lines dropped
    return (start + lead, got) if got else None


def pick_text(rng: random.Random, kind: str, code: list, docs: list, max_lines: int):
    """(lines, source "name:line", document hash) of a code or doc window; None when the draw found nothing
    usable (the caller draws again)."""
    from k3.data.sources import content_hash

    use_docstring = kind == "doc" and (not docs or rng.random() < 0.5)
    pool = code if kind == "code" or use_docstring else docs
    if not pool:
        raise ValueError(f"this installation has no files for {kind} pairs")
    name, path = pool[rng.randrange(len(pool))]
    data = _read(path)
    if data is None:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if use_docstring:
        docs_ = _docstrings(text)
        if not docs_:
            return None
        line, doc = docs_[rng.randrange(len(docs_))]
        got = _window(rng, doc.splitlines(), max_lines)
        if got is None:
            return None
        return got[1], f"{name}:{line}", content_hash(data)
    got = _window(rng, text.splitlines(), max_lines)
    if got is None:
        return None
    return got[1], f"{name}:{got[0] + 1}", content_hash(data)


# ------------------------------------------------------------------------------------------------ drawing

@functools.lru_cache(maxsize=64)
def load_font(path: str | None, size: int):
    """A FreeType face at `size` px, or Pillow's default font at that size when `path` is None."""
    from PIL import ImageFont

    return ImageFont.truetype(path, size) if path else ImageFont.load_default(size=size)


def _units(px: float, unit: int) -> int:
    return max(1, math.ceil(px / unit))


def wrap(lines: list[str], columns: int) -> list[str]:
    """The visual lines of `lines` hard-wrapped at `columns` characters (an empty line stays one line)."""
    out = []
    for ln in lines:
        out += [ln[i:i + columns] for i in range(0, len(ln), columns)] or [""]
    return out


def layout(lines: list[str], font, pad: int, spacing: float, columns: int, unit: tuple[int, int],
           max_tokens: int) -> tuple[list[str], list[str], tuple[int, int], int] | None:
    """(logical lines kept, their visual lines, canvas (H, W), line height): the longest prefix of `lines` whose
    wrapped rendering fits `max_tokens` units of `unit` px; None when not even the first line fits."""
    mh, mw = unit
    ascent, descent = font.getmetrics()
    line_h = max(1, math.ceil((ascent + descent) * spacing))
    kept, vis, width = [], [], 0.0
    for ln in lines:
        more = wrap([ln], columns)
        w = max(width, max(font.getlength(v) for v in more))
        h = (len(vis) + len(more)) * line_h
        if _units(w + 2 * pad, mw) * _units(h + 2 * pad, mh) > max_tokens:
            break
        kept.append(ln)
        vis += more
        width = w
    while kept and not kept[-1]:  # a blank last line would be invisible in the image
        kept.pop()
        vis.pop()
    if not kept:
        return None
    H = _units(len(vis) * line_h + 2 * pad, mh) * mh
    W = _units(width + 2 * pad, mw) * mw
    return kept, vis, (H, W), line_h


@functools.lru_cache(maxsize=64)
def _font_sizes(font_path: str | None, pad_min: int, unit: tuple[int, int], max_tokens: int) -> list[int]:
    """The FONT_SIZES at which one line of MIN_COLUMNS characters fits the budget."""
    ok = []
    for s in FONT_SIZES:
        f = load_font(font_path, s)
        if layout(["M" * MIN_COLUMNS], f, pad_min, 1.0, MIN_COLUMNS, unit, max_tokens) is not None:
            ok.append(s)
    return ok


def draw_text(rng: random.Random, lines: list[str], fonts: list[str | None], unit: tuple[int, int],
              max_tokens: int):
    """(image, logical lines drawn, style) for a window of lines, in a style drawn from `rng`; None when no line
    fits."""
    from PIL import Image, ImageDraw

    font_path = fonts[rng.randrange(len(fonts))]
    sizes = _font_sizes(font_path, min(PADDINGS), unit, max_tokens)
    if not sizes:
        raise ValueError(f"max_image_tokens={max_tokens} is too small for a line of {MIN_COLUMNS} characters at "
                         f"{FONT_SIZES[0]} px: give at least a few dozen tokens")
    size = rng.choice(sizes)
    theme = rng.choice(sorted(THEMES))
    pad, spacing, columns = rng.choice(PADDINGS), rng.choice(LINE_SPACINGS), rng.choice(WRAP_COLUMNS)
    font = load_font(font_path, size)
    got = layout(lines, font, pad, spacing, columns, unit, max_tokens)
    if got is None:  # the drawn padding/columns are too wide for this budget: the narrowest that fit
        pad, columns = min(PADDINGS), MIN_COLUMNS
        got = layout(lines, font, pad, spacing, columns, unit, max_tokens)
    if got is None:
        return None
    kept, vis, (H, W), line_h = got
    bg, fg = THEMES[theme]
    img = Image.new("RGB", (W, H), bg)
    d = ImageDraw.Draw(img)
    for i, v in enumerate(vis):
        if v:
            d.text((pad, pad + i * line_h), v, font=font, fill=fg)
    style = {"font": os.path.basename(font_path) if font_path else "pillow-default", "size": size, "theme": theme,
             "padding": pad, "line_spacing": spacing, "wrap_columns": columns}
    return img, kept, style


def chart_data(rng: random.Random) -> tuple[str, str, list[str], list[str], list[list[int]]]:
    """(chart kind, x name, x labels, series names, values per series): a bar chart of one series over categories,
    or a line chart of one or two series over consecutive years."""
    kind = rng.choice(("bar", "line"))
    n = rng.randint(3, 8)
    if kind == "bar":
        xname, pool = CHART_LABELS[rng.randrange(len(CHART_LABELS))]
        start = rng.randrange(len(pool) - n + 1) if len(pool) >= n else 0
        labels = list(pool[start:start + n])
        series = [rng.choice(CHART_SERIES)]
    else:
        xname, y0 = "year", rng.randint(1990, 2020)
        labels = [str(y0 + i) for i in range(n)]
        series = rng.sample(CHART_SERIES, rng.randint(1, 2))
    values = [[rng.randint(0, 99) for _ in labels] for _ in series]
    return kind, xname, labels, series, values


def chart_csv(xname: str, labels: list[str], series: list[str], values: list[list[int]]) -> str:
    rows = [",".join([xname] + series)]
    rows += [",".join([x] + [str(v[i]) for v in values]) for i, x in enumerate(labels)]
    return "\n".join(rows)


def chart_figure(data: tuple, style: dict, width: int, height: int):
    """The matplotlib Figure (on an Agg canvas, no pyplot state) of `data` (chart_data's tuple) in `style`, width x
    height px; every label and value is written on it."""
    from matplotlib import rc_context
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    kind, xname, labels, series, values = data
    colors, face = style["colors"], style["face"]
    dpi = 100
    with rc_context({"font.size": style["font_size"]}):
        fig = Figure(figsize=(width / dpi, height / dpi), dpi=dpi, facecolor=face)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.set_facecolor(face)
        if kind == "bar":
            bars = ax.bar(labels, values[0], color=colors[0])
            ax.bar_label(bars, labels=[str(v) for v in values[0]], padding=1)
            ax.set_ylabel(series[0])
        else:
            for name, v, c in zip(series, values, colors):
                ax.plot(labels, v, marker="o", color=c, label=name)
                for x, y in zip(labels, v):
                    ax.annotate(str(y), (x, y), textcoords="offset points", xytext=(0, 4), ha="center", color=c)
            if len(series) > 1:
                ax.legend(loc="best")
            else:
                ax.set_ylabel(series[0])
        ax.set_ylim(0, 115)  # values are 0..99: room above the highest for its label
        ax.set_xlabel(xname)
        if style["grid"]:
            ax.grid(axis="y", alpha=0.4)
        fig.tight_layout()
        fig.canvas.draw()
    return fig


def draw_chart(rng: random.Random, unit: tuple[int, int], max_tokens: int):
    """(image, CSV text, style) of a chart drawn from `rng`: its size (a multiple of `unit`, at most `max_tokens`
    units), its data (chart_data) and its look."""
    import numpy as np
    from PIL import Image

    sizes = [(w, h) for w, h in CHART_UNITS if w * h <= max_tokens]
    if not sizes:
        w, h = CHART_UNITS[-1]
        raise ValueError(f"max_image_tokens={max_tokens} is too small for a chart: it needs at least {w * h}")
    wu, hu = rng.choice(sizes)
    data = chart_data(rng)
    style = {"chart": data[0], "font_size": rng.choice((7, 8, 9)), "grid": rng.random() < 0.5,
             "face": rng.choice(("white", "#f4f4f4")), "colors": rng.sample(CHART_COLORS, len(data[3]))}
    W, H = wu * unit[1], hu * unit[0]
    fig = chart_figure(data, style, W, H)
    rgba = np.asarray(fig.canvas.buffer_rgba())
    img = Image.fromarray(rgba[..., :3].copy(), "RGB")
    if img.size != (W, H):  # float figure inches can round a pixel away: pad or crop to the unit multiple
        full = Image.new("RGB", (W, H), (255, 255, 255))
        full.paste(img, (0, 0))
        img = full
    return img, chart_csv(*data[1:]), style


def make_pair(seed: int, index: int, kinds: tuple[str, ...], code: list, docs: list, fonts: list[str | None],
              unit: tuple[int, int] = (28, 28), max_tokens: int = DEFAULT_MAX_IMAGE_TOKENS,
              max_lines: int = DEFAULT_MAX_LINES) -> Pair:
    """Pair `index` of run `seed`: everything drawn from random.Random(f"{seed}:{index}")."""
    from k3.data.sources import content_hash

    rng = random.Random(f"{seed}:{index}")
    weights = [KIND_WEIGHTS[k] for k in kinds]
    kind = rng.choices(kinds, weights)[0]
    if kind == "chart":
        img, text, style = draw_chart(rng, unit, max_tokens)
        return Pair(kind, text, img, f"chart:{style['chart']}", content_hash(text.encode("utf-8")), style)
    for _ in range(MAX_ATTEMPTS):
        got = pick_text(rng, kind, code, docs, max_lines)
        if got is None:
            continue
        lines, source, doc = got
        drawn = draw_text(rng, lines, fonts, unit, max_tokens)
        if drawn is None:
            continue
        img, kept, style = drawn
        return Pair(kind, "\n".join(kept), img, source, doc, style)
    raise RuntimeError(f"pair {index} (seed {seed}): no usable {kind} text in {MAX_ATTEMPTS} draws")


# ------------------------------------------------------------------------------------------------- output

def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def is_heldout_document(document: int, heldout_share: float) -> bool:
    return document / 2.0 ** 64 < heldout_share


def render_pairs(out: str, n: int, seed: int = 0, heldout_share: float = DEFAULT_HELDOUT_SHARE,
                 kinds: tuple[str, ...] = KINDS, max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS,
                 max_lines: int = DEFAULT_MAX_LINES, files: tuple[list, list] | None = None,
                 fonts: list[str] | None = None, vision_config=None, progress: bool = True) -> RenderStats:
    """Write `n` pairs into the directory `out` (the module docstring); returns the counts. `files`: (code, docs)
    lists of (name, path) instead of the installation's; `fonts`: TrueType paths instead of monospace_fonts()
    (an empty list: Pillow's default font)."""
    from k3.config import VisionConfig
    from k3.files import replace_dir, write_synced

    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"n must be a positive integer, got {n!r}")
    if not 0.0 <= heldout_share < 1.0:
        raise ValueError(f"heldout_share must be in [0, 1), got {heldout_share}")
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise ValueError(f"kinds {list(kinds)} are invalid: a non-empty subset of {list(KINDS)}")
    if not (isinstance(max_lines, int) and max_lines >= 1):
        raise ValueError(f"max_lines must be a positive integer, got {max_lines!r}")
    if not (isinstance(max_image_tokens, int) and max_image_tokens >= 1):
        raise ValueError(f"max_image_tokens must be a positive integer, got {max_image_tokens!r}")
    cfg = vision_config or VisionConfig()
    unit = cfg.pixel_multiple
    code, docs = files if files is not None else (source_files() if set(kinds) - {"chart"} else ([], []))
    font_list: list[str | None] = list(monospace_fonts() if fonts is None else fonts) or [None]
    out = os.path.abspath(out)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.tmp-", dir=parent)
    stats = RenderStats()
    t0 = time.time()
    from tqdm import tqdm

    bar = tqdm(total=n, unit="pair", desc="rendering", disable=not progress, dynamic_ncols=True)
    try:
        os.makedirs(os.path.join(tmp, "images"))
        train_digests: set[bytes] = set()
        held: list[tuple[bytes, str, dict]] = []
        with open(os.path.join(tmp, "train.jsonl"), "w", encoding="utf-8") as train_f:
            for i in range(n):
                p = make_pair(seed, i, tuple(kinds), code, docs, font_list, unit, max_image_tokens, max_lines)
                rel = f"images/{i:07d}.png"
                write_synced(os.path.join(tmp, rel), png_bytes(p.image))
                rec = {"text": p.text, "images": [{"path": rel}], "prompt": PROMPTS[p.kind], "kind": p.kind,
                       "source": p.source, "document": f"{p.document:016x}", "style": p.style}
                digest = hashlib.sha1(p.text.encode("utf-8")).digest()
                stats.pairs[p.kind] += 1
                if is_heldout_document(p.document, heldout_share):
                    held.append((digest, rel, rec))
                else:
                    train_digests.add(digest)
                    train_f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                    stats.train += 1
                bar.update(1)
            train_f.flush()
            os.fsync(train_f.fileno())
        kept = []
        for digest, rel, rec in held:
            if digest in train_digests:
                os.unlink(os.path.join(tmp, rel))
                stats.leaked += 1
            else:
                kept.append(rec)
        stats.heldout = len(kept)
        write_synced(os.path.join(tmp, "heldout.jsonl"),
                     "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept).encode("utf-8"))
        stats.seconds = time.time() - t0
        write_synced(os.path.join(tmp, "meta.json"), (json.dumps(_meta(
            n, seed, heldout_share, kinds, max_image_tokens, max_lines, font_list, unit, stats), indent=2) + "\n"
        ).encode("utf-8"))
        replace_dir(tmp, out)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        bar.close()
    return stats


def _meta(n, seed, heldout_share, kinds, max_image_tokens, max_lines, fonts, unit, stats) -> dict:
    import matplotlib
    import PIL

    return {"n": n, "seed": seed, "heldout_share": heldout_share, "kinds": list(kinds),
            "max_image_tokens": max_image_tokens, "max_lines": max_lines, "pixel_multiple": list(unit),
            "fonts": [os.path.basename(f) if f else "pillow-default" for f in fonts],
            "pillow": PIL.__version__, "matplotlib": matplotlib.__version__,
            "counts": {k: v for k, v in asdict(stats).items() if k != "seconds"}}


# ---------------------------------------------------------------------------------------------------- CLI

def _kinds_arg(s: str) -> tuple[str, ...]:
    import argparse

    kinds = tuple(k.strip() for k in s.split(",") if k.strip())
    bad = [k for k in kinds if k not in KINDS]
    if not kinds or bad:
        raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(KINDS)}, got {s!r}")
    return kinds


def _share_arg(s: str) -> float:
    import argparse

    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1), got {s!r}")
    return v


def cmd_render_pairs(args) -> int:
    try:
        st = render_pairs(args.out, args.n, seed=args.seed, heldout_share=args.heldout_share, kinds=args.kinds,
                          max_image_tokens=args.max_image_tokens, max_lines=args.max_lines)
    except ValueError as e:
        raise SystemExit(f"k3 data render-pairs: {e}")
    rate = sum(st.pairs.values()) / max(st.seconds, 1e-9)
    print(f"rendered {sum(st.pairs.values())} pairs ({', '.join(f'{v} {k}' for k, v in st.pairs.items())}) in "
          f"{st.seconds:.1f} s ({rate:.1f} pairs/s): {st.train} training pairs in "
          f"{os.path.join(args.out, 'train.jsonl')}, {st.heldout} held out in "
          f"{os.path.join(args.out, 'heldout.jsonl')} ({st.leaked} held-out pairs dropped: their text is also a "
          "training pair's)")
    return 0


def add_parser(dsub) -> None:
    """Register `k3 data render-pairs` on the `k3 data` subcommands."""
    from k3 import cli_args as cli

    d = dsub.add_parser("render-pairs", formatter_class=cli.DefaultsHelpFormatter,
                        help="image-text pairs rendered here (code and documentation of this installation drawn as "
                             "text images, matplotlib charts with their data), for k3.data.images",
                        description="Render image-text pairs without any download: windows of this installation's "
                                    "Python sources and documentation drawn with a monospace font, and bar/line "
                                    "charts paired with their CSV. Held out by a hash of the source document.")
    d.add_argument("--out", required=True, metavar="DIR",
                   help="output directory (train.jsonl, heldout.jsonl, images/, meta.json; replaced atomically)")
    d.add_argument("--n", type=cli._positive_int, required=True, help="pairs to render (training and held out)")
    d.add_argument("--seed", type=int, default=0, help="the same seed renders byte-identical pairs")
    d.add_argument("--heldout-share", type=_share_arg, default=DEFAULT_HELDOUT_SHARE,
                   help="share of source documents held out, by the hash of their content")
    d.add_argument("--kinds", type=_kinds_arg, default=",".join(KINDS), metavar="KIND[,KIND]",
                   help=f"which pairs: a comma-separated subset of {','.join(KINDS)} (drawn in the proportions "
                        f"{', '.join(f'{k} {w:g}' for k, w in KIND_WEIGHTS.items())}, renormalized)")
    d.add_argument("--max-image-tokens", type=cli._positive_int, default=DEFAULT_MAX_IMAGE_TOKENS,
                   help="largest image, in encoder tokens of 28x28 px (lines are added only while the image fits)")
    d.add_argument("--max-lines", type=cli._positive_int, default=DEFAULT_MAX_LINES,
                   help="most lines of text in one code or doc pair")
    d.set_defaults(fn=cmd_render_pairs)
