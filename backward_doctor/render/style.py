"""The report's look, shared by the static page, the panel and the plots: colours, CSS, labels, and
:func:`esc`, which every piece of the user's text goes through before it reaches HTML.

>>> esc("</script><script>alert(1)</script>")
'&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;'
"""
from __future__ import annotations

import html
from typing import Any, Iterable

from ..trace.records import CATEGORIES


COLORS = {"error": "#c62828", "warning": "#b26a00", "info": "#1565c0", "ok": "#2e7d32"}
#: Colours of the memory categories (plots and HTML legends use the same).
CATEGORY_COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#76b7b2",
                   "activations": "#e15759", "other": "#bab0ac"}
CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
                   "activations": "saved activations", "other": "other"}


CSS = """
.bd{font-family:-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif;
 font-size:13px;line-height:1.45;color:#1f2328;background:#fff;max-width:1100px}
.bd *{box-sizing:border-box}
.bd h3{font-size:14px;margin:14px 0 6px;color:#1f2328;border-bottom:1px solid #e5e7eb;padding-bottom:3px}
.bd code,.bd pre,.bd .mono{font-family:"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace;font-size:12px}
.bd pre{margin:0;white-space:pre-wrap;word-break:break-word}
.bd .verdict{display:flex;align-items:flex-start;gap:10px;padding:10px 12px;border-radius:6px;
 border-left:6px solid var(--sev);background:#fafafa}
.bd .badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-weight:600;
 font-size:11px;text-transform:uppercase;letter-spacing:.03em;background:var(--sev);white-space:nowrap}
.bd .headline{font-size:15px;font-weight:600}
.bd .sub{color:#57606a}
.bd .facts{display:grid;grid-template-columns:repeat(auto-fit,minmax(190px,1fr));gap:8px;margin:10px 0}
.bd .fact{border:1px solid #e5e7eb;border-radius:6px;padding:6px 10px;background:#fff}
.bd .fact .k{color:#57606a;font-size:11px;text-transform:uppercase;letter-spacing:.04em}
.bd .fact .v{font-size:15px;font-weight:600}
.bd .gauge{height:6px;background:#eef0f3;border-radius:3px;margin-top:4px;overflow:hidden}
.bd .gauge>div{height:6px;border-radius:3px}
.bd .exc{background:#fff5f5;border:1px solid #f3c2c2;border-radius:6px;padding:6px 10px;margin:8px 0}
.bd .chip{display:inline-block;border:1px solid #d0d7de;border-radius:12px;padding:1px 9px;margin:2px 4px 2px 0;
 background:#f6f8fa;font-size:12px}
.bd .finding{border-left:4px solid var(--sev);padding:4px 10px;margin:8px 0;background:#fcfcfc}
.bd .src{border:1px solid #e5e7eb;border-radius:6px;overflow:hidden;margin:6px 0}
.bd .src .cap{background:#f6f8fa;color:#57606a;padding:2px 8px;font-size:11px;border-bottom:1px solid #e5e7eb}
.bd .src .ln{display:flex;white-space:pre;font-family:"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace;
 font-size:12px;padding:0 8px}
.bd .src .ln .no{color:#8c959f;min-width:3.2em;text-align:right;padding-right:10px;user-select:none}
.bd .src .ln.hit{background:#fff1c2;font-weight:600}
.bd .src .ln.hit .no{color:#8a6d00}
.bd table.t{border-collapse:collapse;margin:6px 0;width:100%}
.bd table.t th{text-align:left;font-weight:600;color:#57606a;border-bottom:1px solid #d0d7de;padding:3px 8px;
 font-size:12px;white-space:nowrap}
.bd table.t td{border-bottom:1px solid #f0f1f3;padding:3px 8px;vertical-align:top}
.bd table.t td.num,.bd table.t th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.bd table.t tr.hit td{background:#fff1c2}
.bd .bad{color:#c62828;font-weight:600}
.bd .good{color:#2e7d32;font-weight:600}
.bd .muted{color:#8c959f}
.bd .diff{border:1px solid #e5e7eb;border-radius:6px;padding:4px 0;margin:6px 0;overflow-x:auto}
.bd .diff div{white-space:pre;padding:0 8px;font-family:"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace;
 font-size:12px}
.bd .diff .add{background:#e6ffec}.bd .diff .del{background:#ffebe9}.bd .diff .hunk{color:#8250df;background:#f6f8fa}
.bd .chain{margin:4px 0;padding-left:0;list-style:none}
.bd .chain li{margin:2px 0}
.bd .chain li:before{content:"\\2192 ";color:#8c959f}
.bd .legend span{display:inline-block;margin-right:12px;font-size:12px}
.bd .legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;vertical-align:-1px}
.bd details>summary{cursor:pointer;color:#0b5cad;margin:4px 0}
.bd .graph{overflow:auto;border:1px solid #e5e7eb;border-radius:6px;background:#fff;max-height:760px}
.bd img.plot{max-width:100%;height:auto;display:block}
"""


def esc(text: Any) -> str:
    """HTML-escape anything shown to the user (quotes too, for attributes)."""
    return html.escape("" if text is None else str(text), quote=True)


def sev_color(sev: str) -> str:
    return COLORS.get(sev, COLORS["error"])


def legend_html(categories: Iterable[str] = CATEGORIES) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{CATEGORY_COLORS[c]}"></i>{esc(CATEGORY_LABELS[c])}</span>'
        for c in categories) + "</div>"
