"""The notebook panel (ipywidgets): summary, memory, root cause, graph, ops and fix buttons.

The only module that imports ipywidgets. The magic shows a :class:`Panel` when the
front end can display widgets; everything else falls back to the text or HTML report.

Widget state stays small: plots are PNG bytes in ``Image`` widgets, sections are HTML
strings of bounded size (top rows of tables, one graph view at a time), and the trace
itself never goes into widget state.

A fix button re-runs the cell with the fix in a background thread, so the progress
bar and the Cancel button stay live; the after-view shows the comparison, the diff and
the code to keep, with a button that inserts that code as a new cell below the panel's
cell (see ``docs/panel.md`` for what was tried and what works in which front end).
"""
from __future__ import annotations

import logging
import threading
import traceback
from typing import TYPE_CHECKING, Any, Callable

import ipywidgets as W

from ..render import sections as S, style, view, wording
from ..render.style import esc
from ..report.places import name_places
from .keep_code import keep_html
from .panel_export import ExportRow

if TYPE_CHECKING:
    from ..report.report import Report

log = logging.getLogger(__name__)

_TABS = ("Memory", "Root cause", "Autograd graph", "Ops")
#: An HTML widget's content is a flex item, and a flex item is never narrower than its longest unbreakable
#: line by default: a diff's long line widened the after-view past the cell's right edge (its headline cut
#: off). At min-width 0 it takes the cell's width: text wraps, the diff scrolls in its own box.
_PANEL_CSS = (".backward-doctor-panel .widget-html-content,.backward-doctor-panel .jupyter-widget-html-content"
              "{min-width:0}.backward-doctor-panel .bd .verdict>div{min-width:0;overflow-wrap:anywhere}")
#: A button keeps its whole text (a flex item shrinks by default: the Export buttons became "Memory sna…" beside
#: the line saying where a file went, and a fix button grows once a slowdown is measured); a row wraps instead.
_BUTTON = {"width": "auto", "flex": "0 0 auto"}

def _wrap(body: str) -> str:
    return f'<div class="bd">{body}</div>'


def load_run_fix() -> Callable[..., Any]:
    """``backward_doctor.fixes.run_fix`` (imported when a fix button is first clicked: it pulls in the fixes)."""
    from ..fixes import run_fix

    return run_fix


class Panel:
    """Interactive report for one diagnosed cell. ``panel.widget`` is the root widget.

    ``source``/``namespace``/``memory_limit``/``timeout``: what the fix buttons re-run
    (the magic passes the cell, ``shell.user_ns`` and its options). ``run_fix``
    replaces ``backward_doctor.fixes.run_fix`` (tests).
    """

    def __init__(self, report: "Report", source: str | None = None, namespace: dict[str, Any] | None = None, *,
                 memory_limit: int | None = None, timeout: float | None = None,
                 run_fix: Callable[..., Any] | None = None) -> None:
        self.report = report
        self.source = report.trace.source if source is None else source
        self.namespace = namespace
        self.memory_limit = memory_limit if memory_limit is not None else report.trace.memory.limit_bytes
        self.timeout = timeout if timeout is not None else report.trace.timeout_s
        self._run_fix = run_fix
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self.after_report: "Report | None" = None
        self._graph = None
        self._expanded: set[str] = set()
        self._built: set[int] = set()
        self._rows: dict[str, list[view.OpRow]] = {}

        self.style = W.HTML(f"<style>{style.CSS}{_PANEL_CSS}</style>")
        self.summary = W.HTML(_wrap(S.summary_html(report)))
        # Fixes: one button per fix that applies, progress and cancel, the after-view.
        self.fix_options = view.applicable_fixes(report)
        self.fix_buttons: dict[str, W.Button] = {}
        for opt in self.fix_options:
            b = W.Button(description=f"Try {opt.arg}", tooltip=f"{opt.title}: {opt.description}",
                         button_style="primary", icon="wrench", layout=W.Layout(**_BUTTON))
            b.on_click(lambda _b, o=opt: self.start_fix(o.arg))
            self.fix_buttons[opt.arg] = b
        self.progress = W.FloatProgress(value=0.0, min=0.0, max=1.0, layout=W.Layout(width="260px"))
        self.progress_text = W.HTML("")
        self.cancel_button = W.Button(description="Cancel", icon="stop", button_style="warning",
                                      layout=W.Layout(**_BUTTON))
        self.cancel_button.on_click(lambda _b: self.cancel())
        self.progress_box = W.HBox([self.progress, self.cancel_button, self.progress_text],
                                   layout=W.Layout(display="none", align_items="center", flex_flow="row wrap"))
        self.status = W.HTML("")
        self.after = W.HTML("")
        self.after_plot = W.HTML(layout=W.Layout(display="none", max_width="1000px"))
        self.after_plot.add_class("bd-after-plot")
        self.keep = W.HTML("")
        fix_label = W.HTML('<div class="bd"><b>Fixes</b> <span class="sub">(re-run the cell with the fix and '
                           'compare)</span></div>' if self.fix_options else "")
        from ..render.html import refused_html

        refused = refused_html(report)  # the fixes this cell does not allow, and why: no button that refuses
        self.refused = W.HTML(_wrap(refused) if refused else "")
        self.after_caption = W.HTML("")
        buttons = W.HBox(list(self.fix_buttons.values()), layout=W.Layout(flex_flow="row wrap"))
        self.fix_box = W.VBox([fix_label, buttons, self.refused, self.progress_box,
                               self.status, self.after, self.keep, self.after_caption, self.after_plot],
                              layout=W.Layout(display="flex" if self.fix_options or refused else "none"))
        self.fix_box.add_class("bd-fix-box")
        # Tabs, filled when first shown.
        self.memory_toggle = W.ToggleButtons(options=["timeline", "by module"], value="timeline",
                                             style={"button_width": "100px"})
        self.memory_plot = W.HTML(layout=W.Layout(max_width="1000px"))
        self.memory_plot.add_class("bd-memory-plot")
        self.memory_note = W.HTML("")
        self.memory_toggle.observe(lambda _c: self._show_memory(), names="value")
        self.findings = W.HTML("")
        self.graph_open = W.Dropdown(description="Open", options=[], layout=W.Layout(width="320px"))
        self.graph_close = W.Dropdown(description="Close", options=[], layout=W.Layout(width="320px"))
        self.graph_reset = W.Button(description="Reset view", layout=W.Layout(**_BUTTON))
        self.graph_html = W.HTML("")
        self.graph_open.observe(self._on_open, names="value")
        self.graph_close.observe(self._on_close, names="value")
        self.graph_reset.on_click(lambda _b: self._reset_graph())
        self.ops_group = W.ToggleButtons(options=[("op", "op"), ("module", "module"), ("line", "line")], value="op",
                                         description="group by", style={"button_width": "80px"})
        self.ops_sort = W.ToggleButtons(options=[("time", "time"), ("memory", "memory"), ("count", "count"),
                                                 ("name", "name")], value="time", description="sort by",
                                        style={"button_width": "80px"})
        self.ops_html = W.HTML("")
        self.ops_group.observe(lambda _c: self._show_ops(), names="value")
        self.ops_sort.observe(lambda _c: self._show_ops(), names="value")
        pages = [W.VBox([self.memory_toggle, self.memory_plot, self.memory_note]),
                 W.VBox([self.findings]),
                 W.VBox([W.HBox([self.graph_open, self.graph_close, self.graph_reset],
                                layout=W.Layout(flex_flow="row wrap")), self.graph_html]),
                 W.VBox([self.ops_group, self.ops_sort, self.ops_html])]
        self.tabs = W.Tab(children=pages, titles=_TABS)
        top = report.root_cause
        start = 1 if top is not None and top.kind not in ("oom",) else 0
        self.tabs.selected_index = start
        self.tabs.observe(lambda c: self._fill(c["new"]), names="selected_index")
        self._fill(start)
        self.export = ExportRow(report)  # memory snapshot and trace files for other tools
        self.widget = W.VBox([self.style, self.summary, self.fix_box, self.tabs, self.export.widget],
                             layout=W.Layout(max_width="1120px"))
        self.widget.add_class("backward-doctor-panel")
        if getattr(report, "fix_result", None) is not None:  # ``--fix``: the fixed run, with the code to keep
            self.fix_box.layout.display = "flex"
            self.show_result(report)

    # ---------------------------------------------------------------- display
    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        """The widget, with the static HTML report and the text report as fallbacks (nbviewer, GitHub)."""
        data = dict(self.widget._repr_mimebundle_() or {})
        data["text/plain"] = str(self.report)
        try:
            data["text/html"] = self.report.to_html()
        except Exception:  # noqa: BLE001 - the widget and the text still show
            log.warning("the report's HTML could not be drawn", exc_info=True)
        return data

    def _fill(self, index: int | None) -> None:
        if index is None or index in self._built:
            return
        self._built.add(index)
        try:
            [self._show_memory, self._show_findings, self._show_graph, self._show_ops][index]()
        except Exception as exc:  # a section that cannot be drawn must not break the panel
            log.warning("panel section %d could not be drawn", index, exc_info=True)
            self._built.discard(index)
            target = [self.memory_note, self.findings, self.graph_html, self.ops_html][index]
            target.value = _wrap(f'<div class="bad">This section could not be drawn: {esc(type(exc).__name__)}: '
                                 f"{esc(exc)}</div>")

    def _show_memory(self) -> None:
        from ..render import svg_plots

        tr = self.report.trace
        if self.memory_toggle.value == "timeline":
            self.memory_plot.value = _wrap(svg_plots.memory_timeline_svg(tr, places=self.report.places))
            self.memory_note.value = _wrap(
                '<div class="sub">Live tensor bytes after each op, by category; shaded bands are the phases '
                "of the step. The dashed line is the memory limit (or the device), ▼ the peak, ✖ where memory "
                "ran out.</div>")
        else:
            data, how = view.memory_by_module(tr)
            self.memory_plot.value = _wrap(svg_plots.memory_by_module_svg(tr, data=(data, how)))
            self.memory_note.value = _wrap(f'<div class="sub">Memory by module {esc(how)}.</div>')

    def _show_findings(self) -> None:
        self.findings.value = _wrap(S.findings_html(self.report))

    def _show_graph(self) -> None:
        from ..render.graph import build_graph

        if self._graph is None:
            self._graph = build_graph(self.report.trace, self.report)
            self._expanded = self._graph.auto_expanded()
        self._draw_graph()

    def _draw_graph(self) -> None:
        from ..render.graph_svg import legend_html

        g = self._graph
        self.graph_html.value = _wrap(legend_html() + f'<div class="graph">{g.render_svg(self._expanded)}</div>')
        opts = g.expandable(self._expanded)
        self.graph_open.unobserve(self._on_open, names="value")
        self.graph_close.unobserve(self._on_close, names="value")
        self.graph_open.options = [("module…", "")] + [(m, m) for m in opts]
        self.graph_open.value = ""
        self.graph_close.options = [("module…", "")] + [(m, m) for m in sorted(self._expanded)]
        self.graph_close.value = ""
        self.graph_open.observe(self._on_open, names="value")
        self.graph_close.observe(self._on_close, names="value")

    def expand(self, module: str) -> None:
        """Open a collapsed module in the graph view."""
        if self._graph is None:
            self._show_graph()
        self._expanded = set(self._expanded) | {module}
        self._draw_graph()

    def collapse(self, module: str) -> None:
        if self._graph is None:
            self._show_graph()
        self._expanded = {m for m in self._expanded if m != module and not m.startswith(module + ".")}
        self._draw_graph()

    def _on_open(self, change: dict) -> None:
        if change["new"]:
            self.expand(change["new"])

    def _on_close(self, change: dict) -> None:
        if change["new"]:
            self.collapse(change["new"])

    def _reset_graph(self) -> None:
        if self._graph is not None:
            self._expanded = self._graph.auto_expanded()
            self._draw_graph()

    def _show_ops(self) -> None:
        group = self.ops_group.value
        rows = self._rows.get(group)
        if rows is None:
            rows = self._rows[group] = view.op_rows(self.report.trace, group, self.report.places)
        self.ops_html.value = _wrap(S.ops_table_html(self.report.trace, group, self.ops_sort.value, limit=30,
                                                     rows=rows))

    # ---------------------------------------------------------------- fixes
    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start_fix(self, fix: str) -> None:
        """Re-run the cell with ``fix`` in a background thread (what a fix button does)."""
        if self.running:
            self.status.value = _wrap('<div class="sub">A fix is already running: wait for it or cancel it.</div>')
            return
        try:
            runner = self._run_fix or load_run_fix()
        except (ImportError, AttributeError) as exc:
            self._not_available(fix, exc)
            return
        if self.namespace is None:
            self.status.value = _wrap('<div class="sub">This panel was built without the notebook namespace, so '
                                      "it cannot re-run the cell.</div>")
            return
        self._cancel.clear()
        self.after.value = ""
        self.keep.value = ""
        self.after_caption.value = ""
        self.after_plot.layout.display = "none"
        self.progress.value = 0.0
        self.progress.bar_style = ""
        self.progress_text.value = f"<span>running the cell with <code>{esc(fix)}</code>…</span>"
        self.progress_box.layout.display = "flex"
        self.status.value = ""
        for b in self.fix_buttons.values():
            b.disabled = True
        self._thread = threading.Thread(target=self._fix_thread, args=(runner, fix), daemon=True,
                                        name="backward_doctor-fix")
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the running fix finishes (tests, scripts)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def cancel(self) -> None:
        if self.running:
            self._cancel.set()
            self.progress_text.value = "<span>cancelling…</span>"

    def _progress(self, fraction: float, text: str = "") -> None:
        try:
            self.progress.value = max(0.0, min(1.0, float(fraction)))
        except (TypeError, ValueError):
            pass
        if text:
            self.progress_text.value = f"<span>{esc(text)}</span>"

    def _fix_thread(self, runner: Callable[..., Any], fix: str) -> None:
        try:
            after = runner(self.source, self.namespace, fix, original=self.report, timeout=self.timeout,
                           memory_limit=self.memory_limit, rollback=True, progress=self._progress,
                           cancel=self._cancel.is_set)
        except (NotImplementedError, ValueError) as exc:
            self._done()
            self._not_available(fix, exc)
            return
        except BaseException as exc:  # noqa: BLE001 - shown to the user, never raised in a thread
            self._done()
            self.progress.bar_style = "danger"
            tb = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            self.status.value = _wrap(f'<div class="exc"><b>The fix run failed</b> <code>{esc(tb)}</code></div>')
            return
        self._done()
        # Code from other cells is named as in the original (``Cell In[2]``, never the kernel's temporary file);
        # the rewritten cell is no cell of the notebook (its lines differ from the original's): "the fixed cell".
        name_places(after, self.namespace,
                    lambda file: "the fixed cell" if file is None else self.report.places.get(file))
        self.show_result(after)

    def _done(self) -> None:
        self.progress_box.layout.display = "none"
        for b in self.fix_buttons.values():
            b.disabled = False

    def _not_available(self, fix: str, exc: BaseException) -> None:
        self.status.value = _wrap(
            f'<div class="exc" style="background:rgba(255,193,7,.12);border-color:rgba(178,106,0,.4)"><b>The fix <code>{esc(fix)}</code> is '
            f"not available yet</b> in this version of backward_doctor ({esc(type(exc).__name__)}: {esc(exc)}). "
            "The findings above still say what to change by hand.</div>")

    def show_result(self, after: "Report") -> None:
        """Show a fix run's report: comparison, diff, its memory timeline, the code to keep."""
        from ..render.html import fix_after_html

        self.after_report = after
        result = getattr(after, "fix_result", None)
        if result is None:
            self.status.value = _wrap('<div class="exc">The fix run returned no result.</div>')
            return
        cancelled = bool(result.cancelled)
        body = fix_after_html(result, with_code=False)
        if cancelled:
            body = '<div class="sub"><b>Cancelled.</b> The namespace was restored.</div>' + body
        self.after.value = _wrap(body)
        tr = after.trace
        if tr.memory.op_index:
            try:
                from ..render import svg_plots

                self.after_plot.value = _wrap(svg_plots.memory_timeline_svg(tr, height=300, places=after.places))
                self.after_plot.layout.display = "block"
                self.after_caption.value = _wrap("<div><b>Memory of the run with the fix</b></div>")
            except Exception:  # the comparison above already says what changed
                log.warning("the fixed run's memory plot could not be drawn", exc_info=True)
                self.after_plot.layout.display = "none"
        code = result.code
        slow = self.fix_buttons.get(result.name)
        if result.slowdown and slow is not None:  # measured: the button says so from now on
            slow.description = f"Try {result.name} (ops up to {result.slowdown:g}x slower here)"
            slow.button_style = ""
        if code and result.applied and result.fits:  # only a fix that worked offers its code to insert
            self.keep.value = keep_html(code)
        elif wording.fix_failed(result):
            self._offer_next(result)
        self.status.value = ""

    def _offer_next(self, result: Any) -> None:
        """After a fix that did not work, a button for the next one to try (``accumulate:8`` after
        ``accumulate:4``), unless there already is one."""
        nxt = wording.next_fix_arg(result)
        if nxt is None or nxt in self.fix_buttons:
            return
        b = W.Button(description=f"Try {nxt}", tooltip=wording.fix_next_step(result), button_style="primary",
                     icon="wrench", layout=W.Layout(**_BUTTON))
        b.on_click(lambda _b, arg=nxt: self.start_fix(arg))
        self.fix_buttons[nxt] = b
        row = self.fix_box.children[1]
        row.children = tuple(row.children) + (b,)
