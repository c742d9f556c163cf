"""The panel's export row: buttons that write the report as files other tools open (a memory snapshot
for pytorch.org/memory_viz, a trace for ui.perfetto.dev), next to the notebook, and say where.

The files are written by the registered renderers (``memory_viz``, ``perfetto``) through the report's
``save_memory_snapshot``/``save_trace``; nothing goes into widget state but the file's name.

>>> from backward_doctor.report import Report
>>> export_name(Report(), "memory_viz")
'backward_doctor_run0_memory.pickle'
"""
from __future__ import annotations

import os
from typing import Any

import ipywidgets as W

from ..render.style import esc
from ..util.units import format_bytes

#: renderer -> (button text, file name part, suffix, the viewer to open it in)
EXPORTS = {"memory_viz": ("Memory snapshot", "memory", ".pickle", "pytorch.org/memory_viz"),
           "perfetto": ("Trace", "trace", ".json", "ui.perfetto.dev or chrome://tracing")}


def export_name(report: Any, kind: str) -> str:
    """The file name an export gets: the run's number keeps runs of the same cell apart."""
    _, part, suffix, _ = EXPORTS[kind]
    return f"backward_doctor_run{report.trace.run_id}_{part}{suffix}"


class ExportRow:
    """``row.widget``: one button per export and a line saying what was written (into ``folder``, default
    the kernel's working folder: the notebook's own in Jupyter)."""

    def __init__(self, report: Any, folder: str | None = None) -> None:
        self.report = report
        self.folder = folder
        # The line saying what was written takes the room that is left, and the next line when too little is:
        # as a flex item beside the buttons it squeezed them ("Memory sna…", "Tr…") once it had text.
        self.status = W.HTML("", layout=W.Layout(flex="1 1 260px", min_width="0"))
        self.buttons: dict[str, W.Button] = {}
        for kind, (text, _, _, viewer) in EXPORTS.items():
            b = W.Button(description=text, icon="download", tooltip=f"write a file to open in {viewer}",
                         layout=W.Layout(width="auto", flex="0 0 auto"))
            b.on_click(lambda _b, k=kind: self.save(k))
            self.buttons[kind] = b
        label = W.HTML('<div class="bd"><b>Export</b> <span class="sub">(open in other tools)</span></div>',
                       layout=W.Layout(flex="0 0 auto"))
        self.widget = W.HBox([label, *self.buttons.values(), self.status],
                             layout=W.Layout(align_items="center", flex_flow="row wrap"))
        self.widget.add_class("bd-export")

    def save(self, kind: str) -> str | None:
        """Write the ``kind`` export (what its button does); its path, or None when it could not be written."""
        path = os.path.join(self.folder or os.getcwd(), export_name(self.report, kind))
        save = self.report.save_memory_snapshot if kind == "memory_viz" else self.report.save_trace
        try:
            save(path)
        except Exception as exc:  # noqa: BLE001 - said in the panel, never raised into the front end
            self.status.value = f'<div class="bd"><span class="bad">Could not write {esc(path)}: ' \
                                f"{esc(type(exc).__name__)}: {esc(exc)}</span></div>"
            return None
        viewer = EXPORTS[kind][3]
        self.status.value = (f'<div class="bd"><span class="sub">Wrote <code>{esc(os.path.basename(path))}</code> '
                             f"({esc(format_bytes(os.path.getsize(path)))}) next to the notebook: open it in "
                             f"{esc(viewer)}.</span></div>")
        return path
