"""Fix names: ``accumulate`` / ``accumulate:k``, ``amp`` / ``amp:bf16`` / ``amp:fp16``, ``checkpoint``, ``sync``.

>>> parse_fix("accumulate:4")
FixSpec(kind='accumulate', arg=4)
>>> parse_fix("amp").name
'amp'
>>> parse_fix("accumulate:1")
Traceback (most recent call last):
ValueError: accumulate:k needs a whole number k >= 2 (micro-batches per step), not '1'
"""
from __future__ import annotations

from dataclasses import dataclass

#: Fixes backward_doctor can apply (names used by findings' ``fixes`` lists).
KNOWN_FIXES = ("accumulate", "amp", "sync", "checkpoint")
_AMP_DTYPES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}


@dataclass(frozen=True)
class FixSpec:
    kind: str
    arg: int | str | None = None

    @property
    def name(self) -> str:
        return self.kind if self.arg is None else f"{self.kind}:{self.arg}"


def parse_fix(fix: object) -> FixSpec:
    """Validate a fix name; raise ``ValueError`` saying what is accepted."""
    if not isinstance(fix, str) or not fix.strip():
        raise ValueError(f"fix must be a string such as 'accumulate:4', not {fix!r}")
    kind, sep, arg = fix.strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KNOWN_FIXES:
        raise ValueError(f"unknown fix {fix!r}: choose one of {', '.join(KNOWN_FIXES)} "
                         "(accumulate takes an optional ':k', amp an optional ':bf16' or ':fp16')")
    arg = arg.strip()
    if not sep:
        return FixSpec(kind)
    if kind == "accumulate":
        if not arg.isdigit() or int(arg) < 2:
            raise ValueError(f"accumulate:k needs a whole number k >= 2 (micro-batches per step), not {arg!r}")
        return FixSpec(kind, int(arg))
    if kind == "amp":
        if arg.lower() not in _AMP_DTYPES:
            raise ValueError(f"amp takes ':bf16' or ':fp16', not {arg!r}")
        return FixSpec(kind, _AMP_DTYPES[arg.lower()])
    raise ValueError(f"fix {kind!r} takes no argument (got {fix!r})")
