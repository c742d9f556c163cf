"""Plain-text report: what a terminal, a log file or CI shows. Every line is shown as it is laid out here: a
report's string cannot add a line or drive the terminal (control and bidi characters shown as escapes).

>>> from backward_doctor.report import Report
>>> print(render_text(Report()).splitlines()[0])
backward_doctor: OK - the step ran and nothing looks wrong
"""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from ..analysis.findings import source_line
from ..report.renderers import Renderer, register
from ..util.units import format_bytes
from .style import lines
from .view import hang_threads, op_place, phase_counts, refused_fixes
from .workers import worker_lines
from .wording import (finding_title, fix_code_lines, fix_failed, fix_next_step, frame_label, ok_headline,
                      original_verdict, recorder_words)

if TYPE_CHECKING:
    from ..report.fix_result import FixResult
    from ..report.report import Report

_WIDTH = 100


def _wrap(text: str, indent: str) -> list[str]:
    return textwrap.wrap(text, _WIDTH, initial_indent=indent, subsequent_indent=indent) or [indent]


def summary_line(report: "Report") -> str:
    tr = report.trace
    phases = phase_counts(tr)
    parts = [f"{tr.op_count} ops in {tr.duration_s:.2f} s"]
    if phases:
        parts[-1] += " (" + ", ".join(f"{p} {n}" for p, n in phases.items()) + ")"
    mem = tr.memory
    if mem.peak_bytes:
        peak = tr.op(mem.peak_index)
        place = op_place(tr, peak, report.places)
        at = (f" at {peak.op} ({place})" if place else f" at {peak.op}") if peak else ""
        limit = f" of {format_bytes(mem.limit_bytes)} limit" if mem.limit_bytes else ""
        parts.append(f"peak live tensors {format_bytes(mem.peak_bytes)}{limit}{at}")
    return "; ".join(parts)


def render_text(report: "Report") -> str:
    """The whole report as text (verdict, summary, each finding with its source line)."""
    tr = report.trace
    out: list[str] = []
    fr = report.fix_result
    before = original_verdict(fr) if report.ok and fr is not None and fr.applied and fr.fits else ""
    if before:  # a fixed run: "OK" alone would hide what the original step did
        slow = f" (ops up to {fr.slowdown:g}x slower with it)" if fr.slowdown else ""
        out.append(f"backward_doctor: FIXED - the step ran with {fr.name}{slow}; without it: {before}")
    elif report.ok:
        out.append(f"backward_doctor: OK - {ok_headline(tr)}")
    else:
        top = report.findings[0] if report.findings else None
        verdict = f"{finding_title(top)} at {top.location()}" if top else "the step did not complete"
        out.append(f"backward_doctor: PROBLEM - {verdict}")
    out.append("  " + summary_line(report))
    if report.exception:
        out.extend(_wrap(f"exception: {report.exception.splitlines()[0]}", "  "))
    for i, f in enumerate(report.findings, 1):
        out.append("")
        out.append(f"[{i}] {finding_title(f)} at {f.location()} ({f.kind}, {f.severity})")
        code = source_line(tr, f.line, f.file)
        if code:
            out.append(f"    > {f.line:>4} | {code}")
        if f.op:
            out.append(f"    op: {f.op}")
        out.extend(_wrap(f.message, "    "))
        fix = fix_code_lines(f)  # the fix as code, as the user would write it (none: no label over nothing)
        if fix:
            out.append("    fix:")
            out.extend(("      " + ln) if ln else "" for ln in fix)
        offers = report.fix_offers or {}
        offered = [n for n in f.fixes if not offers.get(n)]
        if offered:
            out.append(f"    fixes: {', '.join(offered)}  (re-run with fix=NAME / --fix NAME)")
        if i == 1:  # once, under the root cause
            for names, why in refused_fixes(report):
                out.extend(_wrap(f"not offered for this cell: {names} - {why}", "    "))
        ev = f.evidence
        if f.kind == "oom" and ev.get("predicted_peak_text"):
            preds = ", ".join(f"{k} {v}" for k, v in ev["predicted_peak_text"].items())
            bound = " (lower bounds: the step failed before its peak)" if ev.get("lower_bound") else ""
            out.extend(_wrap(f"predicted peak{bound}: {preds}", "    "))
            if ev.get("by_module"):
                mods = ", ".join(f"{k} {format_bytes(v)}" for k, v in list(ev["by_module"].items())[:6])
                out.extend(_wrap(f"by module: {mods}", "    "))
    if tr.failed_op and any(f.op == tr.failed_op.op for f in report.findings):
        out.append("")
        out.append(f"failing op {tr.failed_op.op} inputs:")
        for m in tr.failed_op.inputs:
            out.append(f"    {m.short():<28} {m.stats.text() if m.stats else ''}")
    if any(f.kind == "hang" for f in report.findings):
        out.append("")
        out.append("thread stacks (innermost last):")
        shown, folded = hang_threads(tr)
        for stack in shown:
            out.append(f"  {stack.name}{' (main)' if stack.is_main else ''}:")
            if not stack.frames:
                out.append("    (no Python frames were seen in this thread)")
            for fi in stack.frames[-8:]:
                loc = frame_label(fi, report.places)
                out.append(f"    {loc} in {fi.function}: {fi.code}")
        if folded:
            out.extend(_wrap(f"(library threads that never ran your code: {', '.join(folded)})", "  "))
    if tr.loaders and any(f.kind == "dataloader_worker" for f in report.findings):
        out.append("")
        out.extend(worker_lines(tr, report.places))
    for note in tr.notes:
        out.append(f"  note: {note}")
    if report.fix_result is not None:
        out.extend(_fix_lines(report.fix_result))
    out.append("")
    out.append(f"  ({tr.op_count:,} ops recorded by {recorder_words(report)})")
    return lines(out)


def _fix_lines(fr: "FixResult") -> list[str]:
    """The fix section: verdict, before/after numbers, the code to keep."""
    if fr.cancelled:
        state = "cancelled"
    elif not fr.applied:
        state = "not applied"
    else:
        state = "applied, the step ran" if fr.fits else "DID NOT WORK: the step still fails with it"
        if fr.fits and fr.slowdown:
            state += f", but ops ran up to {fr.slowdown:g}x slower than in the original"
    out = ["", f"fix {fr.name}: {state}"]
    out.extend(_wrap(fr.message, "    "))
    cmp = fr.comparison or {}
    before, after = cmp.get("before") or {}, cmp.get("after") or {}
    numbers = []
    if after.get("peak_bytes") and cmp.get("predicted_peak"):
        bound = " (a lower bound: memory ran out early)" if cmp.get("predicted_is_lower_bound") else ""
        numbers.append(f"predicted peak {format_bytes(cmp['predicted_peak'])}{bound}, "
                       f"measured {format_bytes(after['peak_bytes'])}")
    if after.get("step_s") is not None and before.get("step_s") is not None:
        numbers.append(f"step {after['step_s']:.3f} s (original {before['step_s']:.3f} s"
                       f"{'' if before.get('completed') else ', until it failed'})")
    if numbers:
        out.extend(_wrap("; ".join(numbers), "    "))
    if fix_failed(fr):
        out.extend(_wrap("Next: " + fix_next_step(fr).replace("`", ""), "    "))
    ew = fr.elsewhere or {}
    if ew and fr.applied:  # knobs an earlier cell built: the edit is there; the run set them on the live objects
        if ew.get("place"):
            out.extend(_wrap(f"where the arguments are built: {ew['place']}: {ew['setting']}", "    "))
            out.extend("      " + ln for ln in (ew.get("diff") or "").splitlines())
        else:
            out.extend(_wrap("where the arguments are built: not in this kernel's input history; set them on the "
                             f"live object: {ew.get('live')}", "    "))
    if fr.code and fr.applied and fr.fits:
        # Printed as it is, between two rulers, so it pastes into a cell or a file unchanged.
        out.append("    code to keep (between the lines):" if not ew else
                   "    or as a new cell, setting them on the live objects (between the lines):")
        out.append("-" * 40 + " 8< " + "-" * 40)
        out.extend(fr.code.rstrip("\n").splitlines())
        out.append("-" * 40 + " >8 " + "-" * 40)
    return out


@register
class TextRenderer(Renderer):
    """``str(report)``: the report as plain text."""

    name, suffix = "text", ".txt"

    def render(self, report: "Report") -> str:
        if hasattr(report, "ranks"):  # the combined report of a distributed run
            from .ranks import ranks_text

            return ranks_text(report)
        return render_text(report)


@register
class JsonRenderer(Renderer):
    """The report as JSON (``report.to_dict()``): what ``render`` reads back."""

    name, suffix = "json", ".json"

    def render(self, report: "Report") -> str:
        import json

        return json.dumps(report.to_dict())
