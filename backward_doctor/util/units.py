"""Byte sizes: parse ``"300MB"`` / ``"2GiB"`` and format byte counts for people.

>>> parse_size("2GiB")
2147483648
>>> format_bytes(1536)
'1.5 KiB'
"""
from __future__ import annotations

import math
import os
import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str | None) -> int | None:
    """Return ``value`` as a number of bytes (None stays None).

    Accepts an int, or a string with an SI (``MB``) or binary (``MiB``) unit.
    Raises ``ValueError`` with the accepted forms for anything else.

    >>> parse_size("300MB"), parse_size(1024), parse_size(None)
    (300000000, 1024, None)
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"memory size must be bytes or a string like '300MB', not {value!r}")
    if isinstance(value, (int, float)):
        if not 1 <= value < math.inf:  # (also false for NaN)
            raise ValueError(f"memory size must be a positive finite number of bytes (at least 1), not {value!r}")
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
            if size > 0:
                return size
            raise ValueError(f"memory size {value!r} is less than one byte")
    raise ValueError(
        f"cannot read memory size {value!r}: use bytes (int) or a string like "
        "'300MB', '1.5GB', '512MiB', '2GiB'"
    )


_TRIED_RE = re.compile(r"Tried to allocate ([0-9]*\.?[0-9]+) ?(B|KiB|MiB|GiB|TiB)\b")


def allocator_request(message: str) -> int | None:
    """The size of the allocation that failed, as CUDA's caching allocator words its out-of-memory error (None
    when the message does not say: it is rounded to two decimals, so this is within 0.5% of the request).

    >>> allocator_request("CUDA out of memory. Tried to allocate 256.00 GiB. GPU 0 has a total capacity of ...")
    274877906944
    >>> allocator_request("DefaultCPUAllocator: not enough memory") is None
    True
    """
    match = _TRIED_RE.search(message)
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()]) if match else None


def format_bytes(n: int | float | None) -> str:
    """Human-readable binary size: ``format_bytes(3 * 2**20) == '3.0 MiB'``."""
    if n is None:
        return "?"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} TiB"  # pragma: no cover - unreachable


def format_us(us: float, compact: bool = False) -> str:
    """A duration given in microseconds: ``format_us(1500) == '1.5 ms'``; ``compact`` drops the space
    (``'1.5ms'``) for tight labels such as graph nodes."""
    sep = "" if compact else " "
    if us >= 1e6:
        return f"{us / 1e6:.1f}{sep}s" if compact else f"{us / 1e6:.2f}{sep}s"
    if us >= 1e3:
        return f"{us / 1e3:.1f}{sep}ms"
    return f"{us:.0f}{sep}µs"


def scale_unit(n: float) -> tuple[float, str]:
    """The binary unit a plot's axis of values up to ``n`` bytes is drawn in: (bytes per unit, name).

    >>> scale_unit(3 * 2**20)
    (1048576.0, 'MiB')
    """
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n >= scale:
            return float(scale), name
    return 1.0, "B"


def available_ram() -> int | None:
    """Bytes of RAM available now (None where the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
