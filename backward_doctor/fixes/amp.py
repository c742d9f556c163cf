"""``amp``: forward pass and loss under ``torch.autocast`` (16-bit activations, fp32 weights kept).

bfloat16 where the device supports it (CPU, Ampere and newer GPUs): same range as
float32, no loss scaling needed. float16 (``amp:fp16``, or a GPU without bf16)
needs a ``GradScaler``: the rewrite scales the loss, steps through the scaler and
updates it. ``backward()`` stays outside the autocast block, as PyTorch recommends.

>>> import torch
>>> ns = {"model": torch.nn.Linear(3, 1), "x": torch.ones(8, 3), "torch": torch}
>>> print(rewrite("opt.zero_grad()\\nloss = model(x).sum()\\nloss.backward()\\nopt.step()\\n", ns).code, end="")
opt.zero_grad()
# backward_doctor fix amp: the forward pass and the loss run in bfloat16 where it is safe (matmuls,
# convolutions); autocast keeps float32 where precision matters. Weights stay float32. Backward runs
# outside the block, in the dtypes the forward chose.
with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
    loss = model(x).sum()
loss.backward()
opt.step()
"""
from __future__ import annotations

import ast
from typing import Any

import torch

from ..capture import namespace as ns_mod
from .accumulate import Rewrite
from ..util.cell import Cell, NotApplicable, check_compiles, fresh_name, indent


def model_device(cell: Cell, namespace: dict[str, Any]) -> torch.device:
    """Device of the first module the cell reads that has parameters (CPU when none)."""
    read = set().union(*(cell.loads(i) for i in range(len(cell.stmts)))) if cell.stmts else set()
    mods = [(name, m) for name, m in ns_mod.modules(namespace)]
    mods.sort(key=lambda nm: nm[0].split(".")[0] not in read)
    for _, m in mods:
        for p in m.parameters():
            return p.device
    return torch.device("cpu")


def _setup_like(cell: Cell, i: int) -> bool:
    stmt = cell.stmts[i]
    return (isinstance(stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
            or cell.is_call(i, "zero_grad") or cell.is_call(i, "train") or cell.is_call(i, "eval"))


def forward_region(cell: Cell, namespace: dict[str, Any]) -> tuple[int, int, bool]:
    """(first, last) statement indices of the forward pass and loss, and whether ``last`` is the backward.

    The forward starts at the first statement that calls a model from the namespace (else at the
    first statement that is not set-up: imports, definitions, ``zero_grad()``, ``train()``).
    """
    b = cell.backward_index()
    start = cell.forward_start(namespace, b)
    if start is None:
        start = next((i for i in range(b) if not _setup_like(cell, i)), b)
    if start == b:
        # Forward and backward in one statement (``loss_fn(model(x), y).backward()``), or no forward here.
        recv = cell.backward_receiver()
        if recv is None or not any(isinstance(n, ast.Call) for n in ast.walk(recv)):
            raise NotApplicable("the forward pass is not in this cell (the statement before backward() is "
                                "not here); run the fix on the cell that computes the loss")
        return b, b, True
    return start, b - 1, False


def rewrite(source: str, namespace: dict[str, Any], dtype: str | None = None) -> Rewrite:
    cell = Cell(source)
    b = cell.backward_index()
    first, last, with_backward = forward_region(cell, namespace)
    device = model_device(cell, namespace)
    dev = device.type
    if dtype is None:
        dtype = "bf16"
        if dev == "cuda" and not torch.cuda.is_bf16_supported():
            dtype = "fp16"
    if dev not in ("cpu", "cuda", "xpu", "mps"):
        raise NotApplicable(f"the model is on {dev!r}, where torch.autocast is not available")
    already = [n for n in ast.walk(cell.tree) if isinstance(n, ast.Call) and "autocast" in ast.unparse(n.func)]
    if already:
        raise NotApplicable(f"the cell already uses autocast (line {already[0].lineno})")
    torch_dtype = "torch.bfloat16" if dtype == "bf16" else "torch.float16"
    taken = cell.all_names() | set(namespace)
    warnings: list[str] = []
    lines = []
    scaler = None
    if dtype == "fp16":
        scaler = "scaler" if isinstance(namespace.get("scaler"), torch.amp.GradScaler) or "scaler" not in taken \
            else fresh_name("amp_scaler", taken)
        lines += [f"try:  # one GradScaler for the whole training run: its loss scale adapts from step to step\n",
                  f"    {scaler}\n",
                  f"except NameError:\n",
                  f'    {scaler} = torch.amp.GradScaler("{dev}")\n']
    lines += [f"# backward_doctor fix amp: the forward pass and the loss run in {'bfloat16' if dtype == 'bf16' else 'float16'} "
              "where it is safe (matmuls,\n",
              "# convolutions); autocast keeps float32 where precision matters. Weights stay float32. Backward runs\n",
              "# outside the block, in the dtypes the forward chose.\n"]
    if scaler:
        lines.append("# float16 has a narrow range: the GradScaler scales the loss up before backward and unscales the\n"
                     "# gradients before the step (skipping a step whose gradients overflowed).\n")
    lines.append(f'with torch.autocast(device_type="{dev}", dtype={torch_dtype}):\n')
    call = cell.backward_call()
    recv = cell.backward_receiver()

    def scaled(i: int) -> str:
        if scaler is None or recv is None or i != b:
            return cell.chunks[i]
        if isinstance(recv, ast.Call) and isinstance(recv.func, ast.Attribute) and recv.func.attr == "scale":
            return cell.chunks[i]  # already scaled
        lo, hi = cell.span(recv)
        return cell.edited(i, [(lo, hi, f"{scaler}.scale({cell.segment(recv)})")])

    for i in range(first, last + 1):
        lines.append(indent(scaled(i)))
    if with_backward:
        warnings.append("forward and backward are one statement here, so backward runs inside the autocast block; "
                        "split the loss into its own line to keep backward outside it")
    elif b != last:
        lines.append(scaled(b))
    prefix = cell.kept(range(first))  # untouched lines stay as written (`a; b`)
    rest = []
    stepped = False
    for i in range(max(b, last) + 1, len(cell.stmts)):
        steps = [c for c in cell.calls_attr(i, ("step",)) if isinstance(c.func.value, ast.Name)
                 and isinstance(namespace.get(c.func.value.id), torch.optim.Optimizer)]
        if scaler and steps and cell.is_call(i, "step"):
            opt = steps[0].func.value.id
            rest.append(f"{scaler}.step({opt})  # unscales the gradients; skips the step if they overflowed\n")
            stepped = True
        else:
            rest.append(cell.chunks[i])
    if scaler and stepped:
        # update once, after the last optimizer step
        last_step = max(j for j, text in enumerate(rest) if text.startswith(f"{scaler}.step("))
        rest.insert(last_step + 1, f"{scaler}.update()  # adapt the loss scale for the next step\n")
    elif scaler:
        raise NotApplicable("amp:fp16 needs a GradScaler around the optimizer step, and the cell has no plain "
                            "`optimizer.step()` line after backward to route through it")
    code = ("import torch\n" if "torch" not in namespace and "torch" not in cell.all_names() else "") + \
        prefix + "".join(lines) + "".join(rest)
    check_compiles(code)
    what = "bfloat16" if dtype == "bf16" else "float16 with a GradScaler"
    lo_line, hi_line = cell.stmts[first].lineno, cell.stmts[last].end_lineno
    where = f"line {lo_line}" if lo_line == hi_line else f"lines {lo_line}-{hi_line}"
    msg = (f"Run the forward pass and the loss ({where}) under "
           f"torch.autocast({dev!r}) in {what}: activations saved for backward take half the memory; weights, "
           "gradients and optimizer state stay float32. The loss is close to, not equal to, the float32 loss.")
    return Rewrite(code=code, message=msg, warnings=warnings,
                   details={"dtype": dtype, "device": dev, "lines": [cell.stmts[first].lineno, cell.stmts[last].end_lineno]})
