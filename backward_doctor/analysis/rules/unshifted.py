"""``label_misalignment``, the other half: a causal language model scored against its own inputs, unshifted.

``logits = model(x)`` then ``F.cross_entropy(logits.view(-1, V), x.view(-1))`` trains each position to output
the token it was just given: the model learns to copy its input, the loss falls to ~0 in a few steps, and it
has learnt nothing about the next token. Nothing raises.

Read from two places, both needed:

- the trace: a loss op (``nll_loss``) whose target is, through views and copies, the very tensor an embedding
  of the model read as its indices, all of it (the same storage key and as many elements);
- the cell's source: the loss's target expression and the model call's input expression are the same once
  names are followed and reshapes dropped (``x.view(-1)`` and ``x``). nanoGPT's ``x, y = data[i:i+T],
  data[i+1:i+1+T]`` share a storage but differ here, and ``x[:, 1:]`` against ``logits[:, :-1]`` is shifted.

Only token-prediction losses over an embedding's input count: an autoencoder's MSE against its input, or a
masked LM's loss against the unmasked tokens (another tensor), say nothing.

>>> from backward_doctor.trace import Trace
>>> unshifted_targets(Trace())
[]
"""
from __future__ import annotations

import ast
from bisect import bisect_left

from ..findings import Finding, at, code_at, looped
from ...trace.records import OpRecord, Trace, Where
from .flow import numel, trained_ops
from .labels import _NLL, _PASS, _assigned

#: calls that reshape or copy a tensor without changing which tokens it holds, in order
_SAME_TOKENS = {"view", "reshape", "flatten", "contiguous", "clone", "to", "long", "cuda", "cpu", "detach"}


def _same(tree: ast.Module, node: ast.expr, line: int) -> str:
    """``node`` as a comparable string: names followed to what the cell assigned, reshapes dropped."""
    for _ in range(6):
        while (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr in _SAME_TOKENS):
            node = node.func.value
        if not isinstance(node, ast.Name):
            break
        value = _assigned(tree, node.id, line)
        if value is None or not (isinstance(value, (ast.Name, ast.Subscript)) or (
                isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute)
                and value.func.attr in _SAME_TOKENS)):
            break  # a name made otherwise (``next(it)``, ``torch.randint``) is its own tensor
        node = value
    return ast.dump(node)


class _Writers:
    """For each storage key, the forward ops that made it (not views of it) and the embeddings that read it as
    indices, in order: built once, so each loss's walk back is a few look-ups, not a scan of the trace."""

    def __init__(self, trace: Trace) -> None:
        self.made: dict[int, list[int]] = {}
        self.embedded: dict[int, list[int]] = {}
        for op in trace.ops:
            if op.phase != "forward":
                continue
            for k in op.out_keys:
                if k and k not in op.in_keys:
                    self.made.setdefault(k, []).append(op.index)
            if op.op == "aten::embedding" and len(op.in_keys) > 1 and op.where.module:
                self.embedded.setdefault(op.in_keys[1], []).append(op.index)

    @staticmethod
    def last(indices: list[int] | None, before: int) -> int | None:
        """The last of ``indices`` before ``before``."""
        i = bisect_left(indices or [], before)
        return indices[i - 1] if indices and i > 0 else None


def _target_source(trace: Trace, loss: OpRecord, writers: _Writers) -> OpRecord | None:
    """The embedding op whose indices are the loss's target, whole (through views and copies), or None."""
    if len(loss.in_keys) < 2 or not loss.in_keys[1] or len(loss.inputs) < 2:
        return None
    key, before, n = loss.in_keys[1], loss.index, numel(loss.inputs[1].shape)
    for _ in range(8):
        made = writers.last(writers.made.get(key), before)
        emb = trace.op(writers.last(writers.embedded.get(key), before))
        if emb is not None and (made is None or emb.index > made):  # read after the key's latest writer
            return emb if numel(emb.inputs[1].shape) == n else None
        prod = trace.op(made)
        if prod is None or prod.op not in _PASS or not prod.in_keys:
            return None
        key, before = prod.in_keys[0], prod.index
    return None


def _calls_at(tree: ast.Module, line: int) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.lineno <= line <= (n.end_lineno or n.lineno)]


def _target_arg(call: ast.Call) -> ast.expr | None:
    kw = next((k.value for k in call.keywords if k.arg in ("target", "labels", "targets")), None)
    return kw if kw is not None else (call.args[1] if len(call.args) >= 2 else None)


def _input_arg(call: ast.Call) -> ast.expr | None:
    kw = next((k.value for k in call.keywords if k.arg in ("input_ids", "input", "idx", "x")), None)
    return kw if kw is not None else (call.args[0] if call.args else None)


def _fix(source: str, call: ast.Call, scores: ast.expr, target: ast.expr) -> str:
    """The loss line scoring positions ``:-1`` against tokens ``1:`` when both arguments are ``t.view(...)`` /
    ``t.reshape(...)`` of the unflattened tensors; '' otherwise (the message says it in words)."""
    parts = []
    for node, cut in ((scores, "[:, :-1]"), (target, "[:, 1:]")):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("view", "reshape")):
            return ""
        base, args = ast.get_source_segment(source, node.func.value), [ast.get_source_segment(source, a)
                                                                         for a in node.args]
        if not base or None in args:
            return ""
        parts.append((node, f"{base}{cut}.reshape({', '.join(str(a) for a in args)})"))
    lines = source.splitlines()
    if not (call.lineno == call.end_lineno == scores.lineno == target.lineno) or call.lineno > len(lines):
        return ""
    text = lines[call.lineno - 1]
    for node, new in sorted(parts, key=lambda p: p[0].col_offset, reverse=True):
        text = text[:node.col_offset] + new + text[node.end_col_offset:]
    return text.strip() + "  # position t predicts token t+1"


def unshifted_targets(trace: Trace) -> list[Finding]:
    """A token-prediction loss whose target is the model's own input, unshifted, named at the loss line.

    >>> unshifted_targets(Trace(source="loss = F.cross_entropy(model(x), x)"))
    []
    """
    if not trace.source or not any(op.op == "aten::embedding" for op in trace.ops):
        return []  # no token inputs: nothing to be unshifted (and no scan per loss op)
    try:
        tree = ast.parse(trace.source)
    except SyntaxError:
        return []
    feeding: set[int] | None = None
    out: list[Finding] = []
    seen: set[int] = set()
    writers = _Writers(trace)
    for op in trace.ops:
        if op.phase != "forward" or op.op not in _NLL:
            continue
        line = op.where.cell_line
        emb = _target_source(trace, op, writers) if line is not None and line not in seen else None
        if emb is None or emb.where.cell_line in (None, line):
            continue  # a model's own loss (on the line that called it) shifts or not by design
        loss_call = next((c for c in _calls_at(tree, line) if _target_arg(c) is not None), None)
        model_calls = [c for c in _calls_at(tree, emb.where.cell_line) if _input_arg(c) is not None]
        if loss_call is None or not model_calls:
            continue
        target = _target_arg(loss_call)
        assert target is not None
        want = _same(tree, target, line)
        model_call = next((c for c in model_calls if _same(tree, _input_arg(c), line) == want), None)  # type: ignore[arg-type]
        if model_call is None:
            continue
        if feeding is None:  # only losses a backward() started from: what the model trains on
            feeding = trained_ops(trace)
        if op.index not in feeding:
            continue
        seen.add(line)
        tgt_src = ast.get_source_segment(trace.source, target) or "the target"
        inp_src = ast.get_source_segment(trace.source, _input_arg(model_call)) or "the input"  # type: ignore[arg-type]
        model = emb.where.module.split(".")[0] if emb.where.module else "the model"
        fix = _fix(trace.source, loss_call, loss_call.args[0], target) if loss_call.args else ""
        msg = (f"The loss at line {line} (`{code_at(trace, line)}`) scores `{model}`'s output against "
               f"`{tgt_src}`, the very tokens `{model}` read at line {emb.where.cell_line} (`{inp_src}`), unshifted: "
               "each position is trained to output the token it was just given, so the model learns to copy "
               "its input, the loss falls to ~0 within a few steps and it predicts nothing. Nothing raises. "
               "Score position t against token t+1: the outputs `[:, :-1]` against the tokens `[:, 1:]`.") \
            + (f" Fix: `{fix}`." if fix else "")
        its = trace.iterations
        iteration = looped(trace, its.iteration_of(op.index)) if its.library else None
        out.append(at("label_misalignment", Where(line=line, cell_line=line, function=op.where.function), msg,
                      op=op.op, title="Targets are the inputs (no shift)", iteration=iteration,
                      evidence={"problem": "no_shift", "op_index": op.index, "embedding_index": emb.index,
                                "target": tgt_src, "input": inp_src, "model_line": emb.where.cell_line,
                                "model": model, "fix_code": fix}))
    return out


__all__ = ["unshifted_targets"]
