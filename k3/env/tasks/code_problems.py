"""The problems of the `code` family: a function's signature and docstring, a reference implementation written
here, and a generator of its inputs.

Many mirror a standard-library function (`original`, e.g. "statistics.median"): the tests check the reference
against it on generated inputs, and a solution may not import the module that holds it (`forbid`). The others are
classic small algorithms. Inputs are Python literals (ints, finite floats, strings, bytes, lists, tuples), so
they travel to the sandbox as text; the docstring's examples are made from the reference at instance time.
"""

from __future__ import annotations

import random
import string
import textwrap
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Problem:
    name: str
    source: str                           # the reference: a def with its docstring, self-contained
    gen: Callable[[random.Random], tuple]  # one call's arguments
    original: str = ""                    # "module.function" this problem mirrors, if any
    forbid: tuple[str, ...] = ()          # modules a solution may not import (the original's, at least)


def ints(r, lo_n=0, hi_n=12, lo=-50, hi=50):
    return [r.randint(lo, hi) for _ in range(r.randint(lo_n, hi_n))]


def word(r, lo=0, hi=10, alphabet=string.ascii_lowercase):
    return "".join(r.choice(alphabet) for _ in range(r.randint(lo, hi)))


def words(r, lo=0, hi=8, alphabet="abcde"):
    return [word(r, 1, 4, alphabet) for _ in range(r.randint(lo, hi))]


def _p(name, source, gen, original="", forbid=()):
    if original and not forbid:
        forbid = (original.rsplit(".", 1)[0],)
    return Problem(name, textwrap.dedent(source).strip() + "\n", gen, original, tuple(forbid))


PROBLEMS: list[Problem] = [
    _p("median", '''
    def median(values):
        """The median of a non-empty list of numbers: the middle value of the sorted list, or the mean of the two
        middle values (a float) when its length is even."""
        s = sorted(values)
        m = len(s) // 2
        return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2
    ''', lambda r: (ints(r, 1),), "statistics.median"),
    _p("median_low", '''
    def median_low(values):
        """The low median of a non-empty list: the middle value of the sorted list, or the smaller of the two
        middle values when its length is even."""
        return sorted(values)[(len(values) - 1) // 2]
    ''', lambda r: (ints(r, 1),), "statistics.median_low"),
    _p("median_high", '''
    def median_high(values):
        """The high median of a non-empty list: the middle value of the sorted list, or the larger of the two
        middle values when its length is even."""
        return sorted(values)[len(values) // 2]
    ''', lambda r: (ints(r, 1),), "statistics.median_high"),
    _p("mode", '''
    def mode(values):
        """The most common value of a non-empty list; among equally common values, the one seen first."""
        counts = {}
        for v in values:
            counts[v] = counts.get(v, 0) + 1
        top = max(counts.values())
        return next(v for v in values if counts[v] == top)
    ''', lambda r: (ints(r, 1, 12, 0, 5),), "statistics.mode"),
    _p("multimode", '''
    def multimode(values):
        """The list of the most common values, in the order they first occur ([] for an empty list)."""
        counts = {}
        for v in values:
            counts[v] = counts.get(v, 0) + 1
        top = max(counts.values(), default=0)
        return [v for v in counts if counts[v] == top]
    ''', lambda r: (words(r, 0, 10, "abc"),), "statistics.multimode"),
    _p("harmonic_mean", '''
    def harmonic_mean(values):
        """The harmonic mean of a non-empty list of positive numbers: len(values) / sum(1 / x), a float."""
        return len(values) / sum(1 / v for v in values)
    ''', lambda r: (ints(r, 1, 8, 1, 100),), "statistics.harmonic_mean"),
    _p("commonprefix", '''
    def commonprefix(strings):
        """The longest string that starts every string of the list ('' for an empty list)."""
        if not strings:
            return ""
        lo, hi = min(strings), max(strings)
        i = 0
        while i < len(lo) and lo[i] == hi[i]:
            i += 1
        return lo[:i]
    ''', lambda r: ([w for w in ("ab" * r.randint(0, 2) + word(r, 0, 3, "ab") for _ in range(r.randint(0, 5)))],),
       "os.path.commonprefix", ("os", "posixpath", "genericpath", "ntpath")),
    _p("encode_long", '''
    def encode_long(x):
        """The shortest little-endian two's-complement bytes of the integer x; b'' for 0."""
        if x == 0:
            return b""
        n = 1
        while not -(1 << (8 * n - 1)) <= x < (1 << (8 * n - 1)):
            n += 1
        return (x % (1 << (8 * n))).to_bytes(n, "little")
    ''', lambda r: (r.randint(-2 ** r.randint(1, 70), 2 ** r.randint(1, 70)),), "pickle.encode_long"),
    _p("decode_long", '''
    def decode_long(data):
        """The integer whose little-endian two's-complement bytes are `data` (0 for b'')."""
        x = sum(b << (8 * i) for i, b in enumerate(data))
        return x - (1 << (8 * len(data))) if data and data[-1] >= 128 else x
    ''', lambda r: (bytes(r.randrange(256) for _ in range(r.randint(0, 9))),), "pickle.decode_long"),
    _p("bisect_left", '''
    def bisect_left(a, x):
        """The index where x would be inserted in the sorted list a to keep it sorted, before any equal items."""
        lo, hi = 0, len(a)
        while lo < hi:
            mid = (lo + hi) // 2
            if a[mid] < x:
                lo = mid + 1
            else:
                hi = mid
        return lo
    ''', lambda r: (sorted(ints(r, 0, 12, 0, 9)), r.randint(-1, 10)), "bisect.bisect_left"),
    _p("bisect_right", '''
    def bisect_right(a, x):
        """The index where x would be inserted in the sorted list a to keep it sorted, after any equal items."""
        lo, hi = 0, len(a)
        while lo < hi:
            mid = (lo + hi) // 2
            if x < a[mid]:
                hi = mid
            else:
                lo = mid + 1
        return lo
    ''', lambda r: (sorted(ints(r, 0, 12, 0, 9)), r.randint(-1, 10)), "bisect.bisect_right"),
    _p("nsmallest", '''
    def nsmallest(n, values):
        """The n smallest values of the list, in ascending order (all of them when n >= len(values))."""
        return sorted(values)[:max(n, 0)]
    ''', lambda r: (r.randint(0, 6), ints(r)), "heapq.nsmallest"),
    _p("rgb_to_hsv", '''
    def rgb_to_hsv(r, g, b):
        """(hue, saturation, value), each in [0, 1], of a color whose r, g, b are in [0, 1]; hue 0 for grays."""
        mx, mn = max(r, g, b), min(r, g, b)
        if mx == mn:
            return 0.0, 0.0, mx
        d = mx - mn
        if mx == r:
            h = ((g - b) / d) % 6
        elif mx == g:
            h = (b - r) / d + 2
        else:
            h = (r - g) / d + 4
        return h / 6, d / mx, mx
    ''', lambda r: tuple(r.randint(0, 8) / 8 for _ in range(3)), "colorsys.rgb_to_hsv"),
    _p("comb", '''
    def comb(n, k):
        """The number of ways to choose k items from n without order: n! / (k! (n - k)!), 0 when k > n."""
        if k > n:
            return 0
        c = 1
        for i in range(min(k, n - k)):
            c = c * (n - i) // (i + 1)
        return c
    ''', lambda r: (r.randint(0, 60), r.randint(0, 40)), "math.comb"),
    _p("isqrt", '''
    def isqrt(n):
        """The integer square root of n >= 0: the largest integer whose square is at most n."""
        x = n
        y = (x + 1) // 2
        while y < x:
            x, y = y, (y + n // y) // 2
        return x
    ''', lambda r: (r.randint(0, 10 ** r.randint(1, 30)),), "math.isqrt"),
    _p("gcd_all", '''
    def gcd_all(values):
        """The greatest common divisor of a list of integers (non-negative; 0 for an empty list or all zeros)."""
        g = 0
        for v in values:
            a, b = abs(g), abs(v)
            while b:
                a, b = b, a % b
            g = a
        return g
    ''', lambda r: ([r.randint(0, 20) * r.choice([1, 6, 12]) for _ in range(r.randint(0, 5))],), "math.gcd"),
    _p("fnmatch", '''
    def fnmatch(name, pattern):
        """Whether `name` matches the shell pattern: '*' matches any run of characters (empty too), '?' any one
        character, every other character itself (case-sensitive)."""
        m = [[False] * (len(pattern) + 1) for _ in range(len(name) + 1)]
        m[0][0] = True
        for j, p in enumerate(pattern, 1):
            m[0][j] = m[0][j - 1] and p == "*"
        for i, c in enumerate(name, 1):
            for j, p in enumerate(pattern, 1):
                if p == "*":
                    m[i][j] = m[i - 1][j] or m[i][j - 1]
                else:
                    m[i][j] = m[i - 1][j - 1] and (p == "?" or p == c)
        return m[len(name)][len(pattern)]
    ''', lambda r: (word(r, 0, 6, "ab"), word(r, 0, 5, "ab*?")), "fnmatch.fnmatchcase", ("fnmatch", "re", "glob")),
    _p("capwords", '''
    def capwords(s):
        """The words of s (split on whitespace) each capitalized (first letter upper, the rest lower), joined
        by single spaces."""
        return " ".join(w[:1].upper() + w[1:].lower() for w in s.split())
    ''', lambda r: (" ".join(word(r, 1, 5, "abcXYZ") for _ in range(r.randint(0, 4))) + " " * r.randint(0, 2),),
       "string.capwords"),
    _p("quote", '''
    def quote(s):
        """s percent-encoded for a URL path: every UTF-8 byte that is not an ASCII letter, digit or one of
        '_.-~/' becomes '%XX' (upper-case hex)."""
        safe = set(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-~/")
        return "".join(chr(b) if b in safe else "%%%02X" % b for b in s.encode("utf-8"))
    ''', lambda r: (word(r, 0, 10, "aZ9 /%?&=~-é€"),), "urllib.parse.quote", ("urllib",)),
    _p("crc32", '''
    def crc32(data):
        """The CRC-32 (IEEE 802.3, as zlib computes it) of the bytes `data`, an unsigned 32-bit integer."""
        crc = 0xFFFFFFFF
        for b in data:
            crc ^= b
            for _ in range(8):
                crc = (crc >> 1) ^ (0xEDB88320 if crc & 1 else 0)
        return crc ^ 0xFFFFFFFF
    ''', lambda r: (bytes(r.randrange(256) for _ in range(r.randint(0, 12))),), "zlib.crc32", ("zlib", "binascii")),
    _p("adler32", '''
    def adler32(data):
        """The Adler-32 checksum of the bytes `data` (as zlib computes it), an unsigned 32-bit integer."""
        a, b = 1, 0
        for x in data:
            a = (a + x) % 65521
            b = (b + a) % 65521
        return (b << 16) | a
    ''', lambda r: (bytes(r.randrange(256) for _ in range(r.randint(0, 12))),), "zlib.adler32"),
    _p("isleap", '''
    def isleap(year):
        """Whether `year` is a leap year of the Gregorian calendar."""
        return year % 400 == 0 or (year % 4 == 0 and year % 100 != 0)
    ''', lambda r: (r.choice([r.randint(1, 3000), r.randint(0, 30) * 100]),), "calendar.isleap"),
    _p("leapdays", '''
    def leapdays(y1, y2):
        """The number of Gregorian leap years in range(y1, y2), for 0 < y1 <= y2."""
        def before(y):
            y -= 1
            return y // 4 - y // 100 + y // 400
        return before(y2) - before(y1)
    ''', lambda r: (lambda a, b: (min(a, b), max(a, b)))(r.randint(1, 3000), r.randint(1, 3000)), "calendar.leapdays"),
    _p("weekday", '''
    def weekday(year, month, day):
        """The day of the week of a Gregorian date, 0 for Monday to 6 for Sunday."""
        t = [0, 3, 2, 5, 0, 3, 5, 1, 4, 6, 2, 4]
        y = year - (month < 3)
        return (y + y // 4 - y // 100 + y // 400 + t[month - 1] + day + 6) % 7
    ''', lambda r: (r.randint(1900, 2100), r.randint(1, 12), r.randint(1, 28)), "calendar.weekday",
       ("calendar", "datetime", "time")),
    _p("days_in_month", '''
    def days_in_month(year, month):
        """The number of days of a month (1-12) of a Gregorian year."""
        if month == 2:
            return 29 if year % 4 == 0 and (year % 100 != 0 or year % 400 == 0) else 28
        return 30 if month in (4, 6, 9, 11) else 31
    ''', lambda r: (r.choice([r.randint(1800, 2200), 1900, 2000, 2100]), r.randint(1, 12)), "calendar.monthrange",
       ("calendar", "datetime", "time")),
    _p("most_common", '''
    def most_common(items, n):
        """The n most common items as (item, count) pairs by decreasing count; equal counts keep the order in
        which the items first occur."""
        counts = {}
        for x in items:
            counts[x] = counts.get(x, 0) + 1
        return sorted(counts.items(), key=lambda kv: -kv[1])[:n]
    ''', lambda r: (list(word(r, 0, 14, "abcd")), r.randint(0, 4)), "collections.Counter", ("collections",)),
    _p("accumulate", '''
    def accumulate(values):
        """The running sums of the list: [v0, v0 + v1, v0 + v1 + v2, ...]."""
        out, total = [], 0
        for v in values:
            total += v
            out.append(total)
        return out
    ''', lambda r: (ints(r),), "itertools.accumulate", ("itertools",)),
    _p("luhn_valid", '''
    def luhn_valid(number):
        """Whether the digit string passes the Luhn checksum (every second digit from the right doubled, 9
        subtracted from doubles above 9, the total divisible by 10)."""
        total = 0
        for i, ch in enumerate(reversed(number)):
            d = int(ch) * (2 if i % 2 else 1)
            total += d - 9 if d > 9 else d
        return total % 10 == 0
    ''', lambda r: (word(r, 1, 16, string.digits),)),
    _p("roman_to_int", '''
    def roman_to_int(s):
        """The value of a Roman numeral (I V X L C D M, subtractive forms like IV and CM)."""
        v = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
        total = 0
        for a, b in zip(s, s[1:] + " "):
            total += -v[a] if b != " " and v[a] < v[b] else v[a]
        return total
    ''', lambda r: (_roman(r.randint(1, 3999)),)),
    _p("int_to_roman", '''
    def int_to_roman(n):
        """The Roman numeral of 1 <= n <= 3999, with subtractive forms (IV, IX, XL, XC, CD, CM)."""
        out = ""
        for value, sym in ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),
                           (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")):
            while n >= value:
                out, n = out + sym, n - value
        return out
    ''', lambda r: (r.randint(1, 3999),)),
    _p("rle_encode", '''
    def rle_encode(s):
        """Run-length encoding: each run of a repeated character as the character and the run's length,
        e.g. 'aaab' -> 'a3b1'."""
        out, i = [], 0
        while i < len(s):
            j = i
            while j < len(s) and s[j] == s[i]:
                j += 1
            out.append(f"{s[i]}{j - i}")
            i = j
        return "".join(out)
    ''', lambda r: (word(r, 0, 14, "aab"),)),
    _p("rle_decode", '''
    def rle_decode(s):
        """The inverse of run-length encoding: letters each followed by a decimal count, e.g. 'a3b12'."""
        out, i = [], 0
        while i < len(s):
            j = i + 1
            while j < len(s) and s[j].isdigit():
                j += 1
            out.append(s[i] * int(s[i + 1:j]))
            i = j
        return "".join(out)
    ''', lambda r: ("".join(r.choice("xyz") + str(r.randint(1, 12)) for _ in range(r.randint(0, 4))),)),
    _p("caesar", '''
    def caesar(text, shift):
        """text with every ASCII letter moved `shift` places along the alphabet (wrapping, case kept); other
        characters unchanged."""
        out = []
        for c in text:
            if "a" <= c <= "z" or "A" <= c <= "Z":
                base = ord("a") if c.islower() else ord("A")
                c = chr(base + (ord(c) - base + shift) % 26)
            out.append(c)
        return "".join(out)
    ''', lambda r: (word(r, 0, 12, "abzAYZ !,"), r.randint(-30, 30))),
    _p("is_palindrome", '''
    def is_palindrome(s):
        """Whether s reads the same backwards, counting only its letters and digits and ignoring case."""
        t = [c.lower() for c in s if c.isalnum()]
        return t == t[::-1]
    ''', lambda r: (_mirror(r),)),
    _p("word_counts", '''
    def word_counts(text):
        """A dict from each lower-cased word of text (split on whitespace) to its number of occurrences."""
        counts = {}
        for w in text.lower().split():
            counts[w] = counts.get(w, 0) + 1
        return counts
    ''', lambda r: (" ".join(r.choice(["a", "B", "b", "cc", "Cc"]) for _ in range(r.randint(0, 8))),)),
    _p("flatten", '''
    def flatten(nested):
        """The non-list items of an arbitrarily nested list, in order, as one flat list."""
        out = []
        for x in nested:
            out.extend(flatten(x) if isinstance(x, list) else [x])
        return out
    ''', lambda r: (_nested(r, 3),)),
    _p("chunks", '''
    def chunks(values, size):
        """The list cut into consecutive lists of `size` items (the last may be shorter)."""
        return [values[i:i + size] for i in range(0, len(values), size)]
    ''', lambda r: (ints(r, 0, 10), r.randint(1, 4))),
    _p("transpose", '''
    def transpose(matrix):
        """The transpose of a rectangular matrix given as a list of rows ([] for [])."""
        return [list(col) for col in zip(*matrix)]
    ''', lambda r: (_matrix(r),)),
    _p("spiral", '''
    def spiral(matrix):
        """The entries of a rectangular matrix (list of rows) in clockwise spiral order from the top left."""
        out = []
        m = [list(row) for row in matrix]
        while m:
            out += m.pop(0)
            m = [list(row) for row in zip(*m)][::-1]
        return out
    ''', lambda r: (_matrix(r),)),
    _p("matmul", '''
    def matmul(a, b):
        """The matrix product of a (n x k) and b (k x m), lists of rows of integers."""
        return [[sum(x * y for x, y in zip(row, col)) for col in zip(*b)] for row in a]
    ''', lambda r: _matmul_args(r)),
    _p("primes_up_to", '''
    def primes_up_to(n):
        """The primes <= n, ascending."""
        sieve = [True] * (n + 1)
        out = []
        for i in range(2, n + 1):
            if sieve[i]:
                out.append(i)
                for j in range(i * i, n + 1, i):
                    sieve[j] = False
        return out
    ''', lambda r: (r.randint(0, 120),)),
    _p("prime_factors", '''
    def prime_factors(n):
        """The prime factors of n >= 1 with multiplicity, ascending ([] for 1)."""
        out, p = [], 2
        while p * p <= n:
            while n % p == 0:
                out.append(p)
                n //= p
            p += 1
        return out + ([n] if n > 1 else [])
    ''', lambda r: (r.randint(1, 10 ** 6),)),
    _p("fib_mod", '''
    def fib_mod(n, m):
        """The n-th Fibonacci number modulo m (F0 = 0, F1 = 1)."""
        a, b = 0, 1
        for _ in range(n):
            a, b = b, (a + b) % m
        return a % m
    ''', lambda r: (r.randint(0, 500), r.randint(1, 1000))),
    _p("collatz_steps", '''
    def collatz_steps(n):
        """How many steps of n -> n / 2 (n even) or 3n + 1 (n odd) take n >= 1 to 1."""
        steps = 0
        while n != 1:
            n = n // 2 if n % 2 == 0 else 3 * n + 1
            steps += 1
        return steps
    ''', lambda r: (r.randint(1, 10000),)),
    _p("to_base", '''
    def to_base(n, base):
        """The digits of the integer n in `base` (2-36), using 0-9 then a-z, with a '-' for negatives."""
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"
        if n == 0:
            return "0"
        sign, n, out = "-" if n < 0 else "", abs(n), ""
        while n:
            n, d = divmod(n, base)
            out = digits[d] + out
        return sign + out
    ''', lambda r: (r.randint(-10 ** 6, 10 ** 6), r.randint(2, 36))),
    _p("lcs_length", '''
    def lcs_length(a, b):
        """The length of the longest common subsequence of the strings a and b."""
        prev = [0] * (len(b) + 1)
        for x in a:
            cur = [0]
            for j, y in enumerate(b):
                cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
            prev = cur
        return prev[-1]
    ''', lambda r: (word(r, 0, 10, "abc"), word(r, 0, 10, "abc"))),
    _p("edit_distance", '''
    def edit_distance(a, b):
        """The Levenshtein distance between a and b: the fewest single-character insertions, deletions and
        substitutions that turn a into b."""
        prev = list(range(len(b) + 1))
        for i, x in enumerate(a, 1):
            cur = [i]
            for j, y in enumerate(b, 1):
                cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
            prev = cur
        return prev[-1]
    ''', lambda r: (word(r, 0, 8, "abc"), word(r, 0, 8, "abc"))),
    _p("lis_length", '''
    def lis_length(values):
        """The length of the longest strictly increasing subsequence of the list."""
        best = []
        for i, v in enumerate(values):
            best.append(1 + max((best[j] for j in range(i) if values[j] < v), default=0))
        return max(best, default=0)
    ''', lambda r: (ints(r, 0, 12, 0, 20),)),
    _p("max_subarray", '''
    def max_subarray(values):
        """The largest sum of a non-empty contiguous slice of a non-empty list of integers."""
        best = cur = values[0]
        for v in values[1:]:
            cur = max(v, cur + v)
            best = max(best, cur)
        return best
    ''', lambda r: (ints(r, 1, 12, -20, 20),)),
    _p("two_sum", '''
    def two_sum(values, target):
        """The pair of indices (i, j), i < j, with values[i] + values[j] == target, the smallest i first and then
        the smallest j; None when there is none."""
        for i in range(len(values)):
            for j in range(i + 1, len(values)):
                if values[i] + values[j] == target:
                    return (i, j)
        return None
    ''', lambda r: (ints(r, 0, 8, 0, 9), r.randint(0, 18))),
    _p("balanced", '''
    def balanced(s):
        """Whether the brackets ()[]{} in s are balanced and properly nested (other characters ignored)."""
        stack, pairs = [], {")": "(", "]": "[", "}": "{"}
        for c in s:
            if c in "([{":
                stack.append(c)
            elif c in pairs and (not stack or stack.pop() != pairs[c]):
                return False
        return not stack
    ''', lambda r: (word(r, 0, 10, "()[]{}x"),)),
    _p("merge_intervals", '''
    def merge_intervals(intervals):
        """The union of closed intervals [a, b] (lists, a <= b) as a sorted list of disjoint intervals; intervals
        that touch (share an end point) merge."""
        out = []
        for a, b in sorted(intervals):
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return out
    ''', lambda r: ([sorted([r.randint(0, 20), r.randint(0, 20)]) for _ in range(r.randint(0, 6))],)),
    _p("rotate", '''
    def rotate(values, k):
        """The list rotated right by k places (k may be negative or exceed the length)."""
        if not values:
            return []
        k %= len(values)
        return values[-k:] + values[:-k] if k else list(values)
    ''', lambda r: (ints(r, 0, 8), r.randint(-10, 10))),
    _p("dedupe", '''
    def dedupe(values):
        """The list without repeats, keeping each value's first occurrence in order."""
        seen, out = set(), []
        for v in values:
            if v not in seen:
                seen.add(v)
                out.append(v)
        return out
    ''', lambda r: (ints(r, 0, 12, 0, 6),)),
    _p("count_inversions", '''
    def count_inversions(values):
        """The number of pairs i < j with values[i] > values[j]."""
        return sum(values[i] > values[j] for i in range(len(values)) for j in range(i + 1, len(values)))
    ''', lambda r: (ints(r, 0, 12, 0, 9),)),
    _p("camel_to_snake", '''
    def camel_to_snake(name):
        """A camelCase or PascalCase identifier of ASCII letters in snake_case: an underscore before every upper-case
        letter except a leading one, then all lower case."""
        return "".join(("_" + c if c.isupper() and i else c) for i, c in enumerate(name)).lower()
    ''', lambda r: (word(r, 1, 10, "abcABC"),)),
    _p("snake_to_camel", '''
    def snake_to_camel(name):
        """A snake_case identifier in camelCase: the first word as it is, every later word capitalized (first
        letter upper, the rest lower), empty words (repeated underscores) dropped."""
        parts = [p for p in name.split("_") if p]
        return (parts[0] + "".join(p.capitalize() for p in parts[1:])) if parts else ""
    ''', lambda r: ("_".join(word(r, 0, 4, "abcD") for _ in range(r.randint(1, 4))),)),
    _p("moving_average", '''
    def moving_average(values, k):
        """The means of every window of k consecutive values, as floats ([] when the list is shorter than k)."""
        return [sum(values[i:i + k]) / k for i in range(len(values) - k + 1)]
    ''', lambda r: (ints(r, 0, 10, -10, 10), r.randint(1, 4))),
    _p("pascal_row", '''
    def pascal_row(n):
        """Row n of Pascal's triangle (row 0 is [1])."""
        row = [1]
        for _ in range(n):
            row = [a + b for a, b in zip([0] + row, row + [0])]
        return row
    ''', lambda r: (r.randint(0, 25),)),
    _p("digital_root", '''
    def digital_root(n):
        """The repeated digit sum of n >= 0 until a single digit remains."""
        while n >= 10:
            n = sum(int(d) for d in str(n))
        return n
    ''', lambda r: (r.randint(0, 10 ** r.randint(1, 20)),)),
    _p("next_permutation", '''
    def next_permutation(values):
        """The next permutation of the list in lexicographic order, or the list sorted ascending when it is the
        last one."""
        a = list(values)
        i = len(a) - 2
        while i >= 0 and a[i] >= a[i + 1]:
            i -= 1
        if i < 0:
            return sorted(a)
        j = len(a) - 1
        while a[j] <= a[i]:
            j -= 1
        a[i], a[j] = a[j], a[i]
        return a[:i + 1] + a[i + 1:][::-1]
    ''', lambda r: (ints(r, 0, 6, 0, 4),)),
    _p("gray_code", '''
    def gray_code(n):
        """The n-bit reflected Gray code sequence as integers, starting at 0 ([0] for n = 0)."""
        return [i ^ (i >> 1) for i in range(1 << n)]
    ''', lambda r: (r.randint(0, 6),)),
    _p("hamming", '''
    def hamming(a, b):
        """The number of bit positions where the non-negative integers a and b differ."""
        return bin(a ^ b).count("1")
    ''', lambda r: (r.randint(0, 2 ** 40), r.randint(0, 2 ** 40))),
    _p("interleave", '''
    def interleave(a, b):
        """The characters of a and b alternately (a first), the rest of the longer one at the end."""
        out = [x + y for x, y in zip(a, b)]
        return "".join(out) + a[len(b):] + b[len(a):]
    ''', lambda r: (word(r, 0, 6, "abc"), word(r, 0, 6, "XYZ"))),
]


def _roman(n: int) -> str:
    ns: dict = {}
    exec(PROBLEMS_BY_NAME["int_to_roman"].source, ns)
    return ns["int_to_roman"](n)


def _mirror(r):
    """A string that is often a palindrome up to case, spaces and commas."""
    w = word(r, 0, 5, "ab ,")
    return w + r.choice(["", " ", "x"]) + w[::-1].upper()


def _nested(r, depth):
    return [(_nested(r, depth - 1) if depth and r.random() < 0.3 else r.randint(0, 9)) for _ in range(r.randint(0, 4))]


def _matmul_args(r):
    n, k, m = r.randint(1, 4), r.randint(1, 4), r.randint(1, 4)
    return [ints(r, k, k, -5, 5) for _ in range(n)], [ints(r, m, m, -5, 5) for _ in range(k)]


def _matrix(r):
    rows, cols = r.randint(0, 4), r.randint(1, 4)
    return [ints(r, cols, cols, 0, 9) for _ in range(rows)]


PROBLEMS_BY_NAME = {p.name: p for p in PROBLEMS}
