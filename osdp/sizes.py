"""Byte sizes: parse what users write ("16GiB", "16000MB") and print sizes back."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from numbers import Integral, Real
from typing import Any

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_AMBIGUOUS = {"k", "m", "g", "t", "ki", "mi", "gi", "ti"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?|\.\d+)\s*([A-Za-z]*)\s*$")
_SIZE_HELP = (
    "examples: 16GiB, '16 GiB', 1.5GB, 512MiB, 2048 (bytes); units are case-insensitive: "
    "kB MB GB TB (powers of 1000), KiB MiB GiB TiB (powers of 1024)"
)


def parse_size(x: Any) -> int:
    """Bytes from an int or a string like "16GiB" / "1.5 GB" / "2048"; ValueError on anything else.

    Strict on purpose: a memory budget that is silently misread (GB vs GiB, a
    stray "16 GB GB") produces a plan that does not fit. Fractional results are
    rounded down to whole bytes.
    """
    def bad(reason: str) -> ValueError:
        return ValueError(f"invalid memory size {x!r}: {reason}; {_SIZE_HELP}")

    if isinstance(x, bool) or x is None:
        raise bad("expected a number of bytes or a string with a unit")
    if isinstance(x, Integral):
        n = int(x)
    elif isinstance(x, Real):
        if not (math.isfinite(x) and float(x).is_integer()):
            raise bad("a plain number is a count of bytes and must be whole")
        n = int(x)
    elif isinstance(x, str):
        m = _SIZE_RE.match(x)
        if x.strip().startswith("-"):
            raise bad("a memory size must be positive")
        if m is None:
            raise bad("expected a number followed by an optional unit")
        number, unit = m.group(1), m.group(2).lower()
        if unit in _AMBIGUOUS:
            raise bad(f"unit {m.group(2)!r} is ambiguous, write {number}{unit[0].upper()}B or {number}{unit[0].upper()}iB")
        if unit not in _UNITS:
            raise bad(f"unknown unit {m.group(2)!r}")
        if not unit and "." in number:
            raise bad("a plain number is a count of bytes and must be whole")
        n = math.floor(Fraction(number) * _UNITS[unit])
    else:
        raise bad(f"expected int or str, got {type(x).__name__}")
    if n <= 0:
        raise bad("a memory size must be positive")
    return n


def format_bytes(n: float) -> str:
    """Human-readable binary size: 512 B, 1.50 KiB, 16.00 GiB (signed, for differences)."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    if n < 1024:
        return f"{sign}{n:g} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.2f} {unit}"
    raise AssertionError("unreachable")
