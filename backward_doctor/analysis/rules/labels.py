"""``label_misalignment``: a language model trained on targets shifted twice. Nothing raises; it learns the
wrong task.

A causal language model predicts token ``t+1`` from tokens ``0..t``. Hugging Face's ``*ForCausalLM`` models
(``GPT2LMHeadModel``, ``LlamaForCausalLM``, ...) do that shift themselves: given ``labels``, their loss
(``transformers.loss.loss_utils.ForCausalLMLoss``) pads the labels with -100 and drops their first token, so
``labels=input_ids`` is right. A cell that shifts too (``model(input_ids=ids[:, :-1], labels=ids[:, 1:])``)
shifts twice: each position is scored against the token *two* ahead. The loss falls, just never as low, and
generation comes out garbled.

Read from two places, both needed:

- the trace: a loss op that ran inside a model (``Where.module`` set) whose target was made from an integer
  tensor by a ``constant_pad_nd`` or a ``slice`` in that model (the model's own shift), followed back through
  views and copies by storage key;
- the cell's source: the call on that line passes ``labels=`` an expression that is (or was assigned from) a
  slice starting at 1 on the last axis of the same tensor the inputs slice up to -1.

A model that computes its loss on the targets as given (a custom LM, T5's and BERT's ``labels``), labels
masked with -100, or unshifted labels say nothing.

>>> from backward_doctor.trace import Trace
>>> label_misalignment(Trace())
[]
"""
from __future__ import annotations

import ast

from ..findings import Finding, at, code_at, looped
from ...trace.records import OpRecord, Trace, Where
from .flow import numel, trained_ops

_NLL = {"aten::nll_loss_forward", "aten::nll_loss2d_forward", "aten::nll_loss", "aten::nll_loss_nd",
        "aten::cross_entropy_loss"}
#: ops whose output holds their first input's values (possibly fewer of them): followed back
_PASS = {"aten::view", "aten::reshape", "aten::_unsafe_view", "aten::contiguous", "aten::clone", "aten::_to_copy",
         "aten::to", "aten::flatten", "aten::alias", "aten::detach", "aten::lift_fresh"}
#: calls on a tensor that keep its values (stripped when comparing expressions)
_KEEP = {"clone", "contiguous", "to", "long", "cuda", "cpu", "detach"}


def _model_shift(trace: Trace, loss: OpRecord) -> OpRecord | None:
    """The ``slice`` inside the model that shifted the loss's target (``labels[..., 1:]``, of the labels or of
    their -100 padding), or None when the target reached the loss unshifted.

    Followed back by storage key from the loss through copies (``contiguous``, ``clone``, casts): at each step,
    the value read is made by its latest writer that is not a view; a slice of that value inside a model,
    read where the next op read it (its output's shape is what was read, its input's the writer's), is the
    model's shift. Keys are reused once freed, hence latest writers; T5 slicing its labels into decoder
    inputs reads them elsewhere and says nothing."""
    if len(loss.in_keys) < 2 or not loss.in_keys[1] or len(loss.inputs) < 2:
        return None
    reader, key, read = loss, loss.in_keys[1], loss.inputs[1].shape
    for _ in range(16):  # a short chain: pad, slice, contiguous, view
        before = trace.ops[:reader.index]
        prod = next((op for op in reversed(before) if op.phase == "forward" and key in op.out_keys
                     and key not in op.in_keys), None)
        made = prod.outputs[prod.out_keys.index(key)].shape if prod and len(prod.outputs) > 0 else None
        for op in before[prod.index + 1 if prod else 0:]:
            if (op.op == "aten::slice" and op.in_keys[:1] == [key] and op.where.module
                    and op.where.cell_line == loss.where.cell_line and op.inputs and op.outputs
                    and op.inputs[0].dtype.startswith("int") and op.outputs[0].shape != op.inputs[0].shape
                    and (made is None or op.inputs[0].shape == made)
                    and numel(op.outputs[0].shape) == numel(read)):
                return op
        if prod is None or prod.op not in _PASS or not prod.in_keys or not prod.inputs:
            return None
        reader, key, read = prod, prod.in_keys[0], prod.inputs[0].shape
    return None


def _strip(node: ast.expr) -> ast.expr:
    """``ids[:, 1:].clone().contiguous()`` -> ``ids[:, 1:]``."""
    while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _KEEP):
        node = node.func.value
    return node


def _assigned(tree: ast.Module, name: str, line: int) -> ast.expr | None:
    """The expression last assigned to ``name`` at or above ``line`` (``a, b = x, y`` pairwise)."""
    found: tuple[int, ast.expr] | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or node.lineno > line:
            continue
        for target in node.targets:
            if isinstance(target, ast.Name) and target.id == name:
                value: ast.expr | None = node.value
            elif (isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                  and len(target.elts) == len(node.value.elts)):
                value = next((v for t, v in zip(target.elts, node.value.elts)
                              if isinstance(t, ast.Name) and t.id == name), None)
            else:
                continue
            if value is not None and (found is None or node.lineno >= found[0]):
                found = (node.lineno, value)
    return found[1] if found else None


def _resolve(tree: ast.Module, node: ast.expr, line: int) -> ast.expr:
    """``node`` with names replaced by what the cell assigned them (one level deep per name, a few names)."""
    for _ in range(4):
        node = _strip(node)
        if not isinstance(node, ast.Name):
            return node
        value = _assigned(tree, node.id, line)
        if value is None:
            return node
        node = value
    return _strip(node)


def _last_slice(node: ast.expr) -> tuple[str, ast.Slice] | None:
    """(the sliced tensor's source, the last axis's slice) for ``x[:, a:b]`` / ``x[..., a:b]`` / ``x[a:b]``."""
    if not isinstance(node, ast.Subscript):
        return None
    sl = node.slice
    last = sl.elts[-1] if isinstance(sl, ast.Tuple) and sl.elts else sl
    if not isinstance(last, ast.Slice) or last.step is not None:
        return None
    return ast.dump(node.value), last


def _int(node: ast.expr | None) -> int | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value if isinstance(node.operand.value, int) else None
    return None


def _double_shift(tree: ast.Module, call: ast.Call, line: int) -> tuple[ast.expr, ast.expr, ast.expr] | None:
    """(the labels argument, the inputs argument, the tensor both slice) when the call passes
    ``labels=x[..., 1:]`` and ``input_ids=x[..., :-1]`` (directly or through names)."""
    labels = next((k.value for k in call.keywords if k.arg == "labels"), None)
    inputs = next((k.value for k in call.keywords if k.arg == "input_ids"), call.args[0] if call.args else None)
    if labels is None or inputs is None:
        return None
    lab, inp = _last_slice(_resolve(tree, labels, line)), _last_slice(_resolve(tree, inputs, line))
    if lab is None or inp is None or lab[0] != inp[0]:
        return None
    if _int(lab[1].lower) == 1 and lab[1].upper is None and inp[1].lower in (None,) and _int(inp[1].upper) == -1:
        base = _resolve(tree, labels, line)
        assert isinstance(base, ast.Subscript)
        return labels, inputs, base.value
    return None


def _fix(source: str, call: ast.Call, labels: ast.expr, inputs: ast.expr, base: ast.expr) -> str:
    """The call's line with both arguments replaced by the unshifted tensor: ``model(input_ids=ids, labels=ids)``."""
    lines = source.splitlines()
    if not (call.lineno == call.end_lineno == labels.lineno == inputs.lineno) or call.lineno > len(lines):
        return ""
    text = lines[call.lineno - 1]
    whole = ast.get_source_segment(source, base) or ""
    if not whole:
        return ""
    for node in sorted((labels, inputs), key=lambda n: n.col_offset, reverse=True):
        text = text[:node.col_offset] + whole + text[node.end_col_offset:]
    return text.strip() + "  # the model shifts the labels itself"


def _call_at(tree: ast.Module, line: int) -> ast.Call | None:
    """The call on cell line ``line`` that passes ``labels=``."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno)
                and any(k.arg == "labels" for k in node.keywords)):
            return node
    return None


def label_misalignment(trace: Trace) -> list[Finding]:
    """Labels shifted by the cell and again by the model (a Hugging Face causal LM), named at the call.

    >>> label_misalignment(Trace(source="out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])"))
    []
    """
    if not trace.source or "labels" not in trace.source:
        return []
    try:
        tree = ast.parse(trace.source)
    except SyntaxError:
        return []
    feeding: set[int] | None = None
    out: list[Finding] = []
    seen: set[int] = set()
    for op in trace.ops:
        if op.phase != "forward" or op.op not in _NLL or not op.where.module:
            continue
        line = op.where.cell_line  # the cell's line that called the model (the model may live in a file)
        if line is None or line in seen:
            continue
        shift = _model_shift(trace, op)
        call = _call_at(tree, line) if shift is not None else None
        found = _double_shift(tree, call, line) if call is not None else None
        if found is None:
            continue
        if feeding is None:  # only losses a backward() started from: what the model trains on
            feeding = trained_ops(trace)
        if op.index not in feeding:
            continue
        seen.add(line)
        labels, inputs, base = found
        lab_src = ast.get_source_segment(trace.source, labels) or "labels"
        base_src = ast.get_source_segment(trace.source, base) or "the tokens"
        model = op.where.module.split(".")[0]
        fix = _fix(trace.source, call, labels, inputs, base)
        code = code_at(trace, line)
        msg = (f"Line {line} (`{code}`) gives `{model}` labels the cell already shifted (`{lab_src}`, one token "
               f"ahead of the inputs), and `{model}` shifts labels itself (its loss drops the first label: "
               "position t is scored against label t+1), so each position is trained to predict the token two "
               f"ahead, not the next one. Nothing raises: the loss falls, just never as low, and generation "
               f"comes out garbled. Pass the same tokens as inputs and labels (`{base_src}`): the model "
               "shifts them.") + (f" Fix: `{fix}`." if fix else "")
        its = trace.iterations
        iteration = looped(trace, its.iteration_of(op.index)) if its.library else None
        where = Where(line=line, cell_line=line, module=op.where.module,
                      function=op.where.function if op.where.file is None else None)
        out.append(at("label_misalignment", where, msg, op=op.op, title="Labels shifted twice",
                      iteration=iteration,
                      evidence={"problem": "double_shift", "op_index": op.index, "shift_op": shift.op,
                                "shift_index": shift.index, "labels": lab_src, "tokens": base_src,
                                "model": model, "fix_code": fix}))
    return out


__all__ = ["label_misalignment"]
