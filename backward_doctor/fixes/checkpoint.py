"""``checkpoint``: run chosen submodules through ``torch.utils.checkpoint`` (non-reentrant).

The modules are chosen from the original run's trace (see ``analysis/fix_plan.py``): the
activations saved for backward are added up per module and up the module tree; the
modules at the depth whose checkpointing removes most bytes win. The rewritten cell
defines a small context manager and runs the forward pass inside
``with checkpointing(model.blocks[0], ...)``, every module named with its class, so
the modules are checkpointed for this step only. Gradients are those of the original
step, bit for bit on CPU.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import torch

from ..capture import namespace as ns_mod
from ..trace.records import Trace
from .accumulate import Rewrite
from ..analysis.fix_plan import checkpoint_plan, inclusive, path_key, saved_by_module
from .amp import forward_region
from ..util.cell import Cell, NotApplicable, check_compiles, fresh_name, indent
from ..util.units import format_bytes

def module_expr(namespace: dict[str, Any], path: str) -> tuple[str, torch.nn.Module] | None:
    """A readable expression for the module at ``path`` (``model.blocks[2]``) and the module itself."""
    for root_name, root in ns_mod.modules(namespace):
        if path != root_name and not path.startswith(root_name + "."):
            continue
        expr, mod = root_name, root
        rest = path[len(root_name):].lstrip(".")
        for comp in rest.split(".") if rest else []:
            child = mod._modules.get(comp)
            if child is None:
                return None
            if comp.isdigit() and isinstance(mod, (torch.nn.Sequential, torch.nn.ModuleList)):
                expr += f"[{comp}]"
            elif comp.isidentifier() and getattr(mod, comp, None) is child:
                expr += f".{comp}"
            else:
                expr += f".get_submodule({comp!r})"
            mod = child
        return expr, mod
    return None


def _unseen_siblings(namespace: dict[str, Any], chosen: list[str]) -> list[str]:
    """Siblings of the chosen modules, of the same class, that the failed run never reached (blocks after the OOM)."""
    by_parent: dict[str, list[str]] = {}
    for path in chosen:
        if "." in path:
            by_parent.setdefault(path.rsplit(".", 1)[0], []).append(path)
    extra = []
    for parent, kids in by_parent.items():
        found = module_expr(namespace, parent)
        if found is None:
            continue
        classes = {type(found[1].get_submodule(k.rsplit(".", 1)[1])) for k in kids}
        if len(classes) != 1:
            continue
        cls = classes.pop()
        for name, child in found[1].named_children():
            path = f"{parent}.{name}"
            if isinstance(child, cls) and type(child) is cls and path not in kids:
                extra.append(path)
    return extra


@dataclass
class Plan:
    """The modules to checkpoint (trace paths, and each as a readable expression with its module) and the
    activations saved for backward in all, by the chosen ones, and kept at the peak with checkpointing."""

    chosen: list[str]
    exprs: list[tuple[str, torch.nn.Module]]
    total: int
    chosen_bytes: int
    kept: int


def plan(namespace: dict[str, Any], original: Any) -> Plan:
    """The modules whose checkpointing keeps the fewest activations, from the original run's trace."""
    trace: Trace | None = getattr(original, "trace", None)
    if trace is None or not trace.ops:
        raise NotApplicable("checkpointing needs the original run's trace to choose modules, and there is none")
    finding = next((f for f in getattr(original, "findings", []) if f.kind == "oom"), None)
    by_module = finding.evidence.get("by_module") if finding else None
    chosen, total, kept = checkpoint_plan(trace, by_module)
    saved = saved_by_module(trace, by_module)
    if not saved:
        raise NotApplicable("the original run shows no activations saved for backward inside any module, "
                            "so there is nothing for checkpointing to drop")
    incl = inclusive(saved)
    top = max(saved.items(), key=lambda kv: kv[1])
    if not chosen or kept > 0.9 * total:
        raise NotApplicable(
            f"checkpointing would not lower the peak: {top[1] * 100 // max(total, 1)}% of the saved activations are "
            f"made by {top[0]}'s own forward code, and a checkpointed module is recomputed whole during backward, "
            "so its activations come back at once. Use accumulate (smaller micro-batches) or amp instead.")
    unseen = _unseen_siblings(namespace, chosen) if trace.exception is not None else []
    chosen = sorted(chosen + unseen, key=path_key)
    exprs = []
    for path in chosen:
        found = module_expr(namespace, path)
        if found is None:
            raise NotApplicable(f"module {path} from the trace is not reachable from the namespace any more")
        expr, mod = found
        if "forward" in vars(mod):
            raise NotApplicable(f"{expr} already has its own `forward` attribute (patched or compiled); "
                                "checkpointing it here could undo that")
        exprs.append((expr, mod))
    return Plan(chosen, exprs, total, sum(incl.get(p, 0) for p in chosen), kept)


def wrapped(cell: Cell, namespace: dict[str, Any], first: int, last: int, chosen: Plan) -> str:
    """The cell with statements ``first..last`` inside ``with checkpointing(...)``, the small context manager
    the rewritten cell defines first (the modules are patched for that block only)."""
    taken = cell.all_names() | set(namespace)
    helper = fresh_name("checkpointing", taken)
    exprs = chosen.exprs
    parent = chosen.chosen[0].rsplit(".", 1)[0]
    parent_found = module_expr(namespace, parent)
    if parent_found and isinstance(parent_found[1], (torch.nn.Sequential, torch.nn.ModuleList)) \
            and [m for _, m in exprs] == list(parent_found[1]):
        # Every block of a Sequential / ModuleList: the container says it, and the comment lists them.
        with_line = f"with {helper}(*{parent_found[0]}):\n"
    else:
        with_line = f"with {helper}(\n" + "".join(f"    {e},  # {type(m).__name__}\n" for e, m in exprs) + "):\n"
    head = ["import contextlib\n", "import functools\n", "from torch.utils.checkpoint import checkpoint\n", "\n",
            "\n",
            "@contextlib.contextmanager\n",
            f"def {helper}(*modules):\n",
            '    """Activation checkpointing for these modules inside the block: each keeps only its inputs in\n',
            "    forward and recomputes its activations during backward (same gradients, about one more forward\n",
            '    pass of compute). Outside the block the modules are as they were."""\n',
            "    for module in modules:\n",
            "        module.forward = functools.partial(checkpoint, module.forward, use_reentrant=False)\n",
            "    try:\n",
            "        yield\n",
            "    finally:\n",
            "        for module in modules:\n",
            "            del module.forward  # back to the class's own forward\n",
            "\n", "\n"]
    about = (f"backward_doctor fix checkpoint: {module_names(chosen)} keep only their inputs in forward; backward "
             "recomputes their activations.")
    lines = [f"# {text}\n" for text in textwrap.wrap(about, 98)] + [with_line]
    for i in range(first, last + 1):
        lines.append(indent(cell.chunks[i]))
    prefix = cell.kept(range(first))  # untouched lines stay as written (`a; b`)
    suffix = cell.kept(range(last + 1, len(cell.stmts)))
    code = "".join(head) + prefix + "".join(lines) + suffix
    check_compiles(code)
    return code


def module_names(chosen: Plan) -> str:
    """Every module, with its class: nothing hidden."""
    return ", ".join(f"{e} ({type(m).__name__})" for e, m in chosen.exprs)


def plan_message(chosen: Plan) -> str:
    n = len(chosen.chosen)
    return (f"Checkpoint {n} module{'s' if n > 1 else ''}: {module_names(chosen)}. They hold "
            f"{format_bytes(chosen.chosen_bytes)} of the {format_bytes(chosen.total)} of activations saved for "
            f"backward; with checkpointing about {format_bytes(chosen.kept)} stay saved at the peak.")


def rewrite(source: str, namespace: dict[str, Any], original: Any) -> Rewrite:
    cell = Cell(source)
    first, last, with_backward = forward_region(cell, namespace)
    chosen = plan(namespace, original)
    code = wrapped(cell, namespace, first, last, chosen)
    warnings = []
    if with_backward:
        warnings.append("forward and backward are one statement here, so the modules stay patched during backward")
    return Rewrite(code=code, message=plan_message(chosen), warnings=warnings,
                   details={"modules": chosen.chosen, "saved_bytes": chosen.total, "kept_bytes": chosen.kept})
