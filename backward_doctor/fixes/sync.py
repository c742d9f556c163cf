"""``sync``: make index errors surface at the line that caused them.

On CUDA an out-of-range index is a device-side assert reported at some later
synchronising call, and it leaves the CUDA context unusable. The rewrite checks
the offending index tensor (found from the original run's index evidence) before
any kernel reads it, and on CUDA synchronises after each statement of the step so
any other asynchronous error is reported at its own line. On the CPU errors are
already synchronous: only the explicit check is added.
"""
from __future__ import annotations

from typing import Any

import torch

from .accumulate import Rewrite, _owned_ids
from .amp import forward_region, model_device
from ..util.cell import Cell, NotApplicable, check_compiles


def _bad_index_tensors(cell: Cell, namespace: dict[str, Any], check: dict[str, Any], upto: int) -> list[tuple[str, int]]:
    """(name, first statement reading it) of integer tensors the cell reads that hold the bad values."""
    owned = _owned_ids(namespace)
    lo, hi = check["valid"]
    ignore = -100 if check.get("argument") == "target" else None
    out, seen = [], set()
    for i in range(upto + 1):
        for name in cell.loads_in_order(i):
            t = namespace.get(name)
            if name in seen or not isinstance(t, torch.Tensor) or id(t) in owned or t.is_floating_point() \
                    or t.is_complex() or t.dtype == torch.bool or t.numel() == 0 or t.device.type == "meta":
                continue
            seen.add(name)
            with torch.no_grad():
                bad = (t < lo) | (t > hi)
                if ignore is not None:
                    bad &= t != ignore
                if bool(bad.any()):
                    out.append((name, i))
    return out


def rewrite(source: str, namespace: dict[str, Any], original: Any) -> Rewrite:
    cell = Cell(source)
    b = cell.backward_index() if cell.backward_calls() else len(cell.stmts) - 1
    finding = next((f for f in getattr(original, "findings", []) if f.kind == "index_out_of_range"), None)
    check = finding.evidence if finding is not None and finding.evidence.get("valid") else None
    device = model_device(cell, namespace).type
    checks: dict[int, list[str]] = {}
    described = []
    if check is not None:
        lo, hi = check["valid"]
        for name, i in _bad_index_tensors(cell, namespace, check, b):
            cond = f"({name} < {lo}) | ({name} > {hi})"
            if check.get("argument") == "target":
                cond = f"(({cond}) & ({name} != -100))"
            where = f" ({finding.module}: {check.get('what')})" if finding.module else f" ({check.get('what')})"
            checks.setdefault(i, []).append(
                f"# backward_doctor fix sync: check `{name}` before a kernel reads it (on CUDA a bad index is a\n"
                f"# device-side assert that kills the CUDA context; here it is a readable error at this line).\n"
                f"if ({cond}).any():\n"
                f"    raise IndexError(f\"{name} holds values outside {lo}..{hi}{where}: \"\n"
                f"                     f\"{{{name}[{cond}].unique()[:8].tolist()}}\")\n")
            described.append(f"`{name}` (valid {lo}..{hi})")
    if not checks and device != "cuda":
        why = ("the original run shows no out-of-range index" if check is None else
               "the bad index values are made inside the cell, not read from a variable")
        raise NotApplicable(f"there is nothing to add here: {why}, and on the CPU errors already surface "
                            "at the line that caused them (sync matters on CUDA)")
    if device == "cuda":
        try:
            first, last, _ = forward_region(cell, namespace)
        except NotApplicable:
            first, last = 0, b
        sync_range = range(first, max(last, b) + 1)
    else:
        sync_range = range(0)
    parts = []
    for i, chunk in enumerate(cell.chunks):
        parts.extend(checks.get(i, []))
        parts.append(chunk)
        if i in sync_range:
            parts.append("torch.cuda.synchronize()  # backward_doctor fix sync: CUDA errors surface at the line above\n")
    code = ("import torch\n" if device == "cuda" and "torch" not in namespace else "") + "".join(parts)
    check_compiles(code)
    msg = ("Check " + ", ".join(described) + " before use" if described else "Synchronise after each statement") + \
        (" and synchronise after each statement of the step, so a device-side error names its own line"
         if device == "cuda" and described else "") + \
        (". On the CPU the check raises a readable IndexError; fix the data (or the embedding size) it names."
         if device != "cuda" else ". Synchronising slows the step down: keep it only while debugging.")
    return Rewrite(code=code, message=msg, details={"checked": described, "device": device})
