r"""The report's look, shared by the static page, the panel and the plots: colours, CSS, labels, and
:func:`esc`, which every piece of the user's text goes through before it reaches HTML.

>>> esc("</script><script>alert(1)</script>")
'&lt;/script&gt;&lt;script&gt;alert(1)&lt;/script&gt;'

A report handed over is untrusted, and its strings can carry control characters (an escape sequence that
clears the terminal or prints a fake green "OK", a carriage return or backspaces over a line, a bell) and
bidirectional overrides (U+202E shows ``evil.py`` as ``yp.live``). :func:`neutralise` shows each one as its
escape (``\x1b``, ``\u202e``); the text renderers pass every line through it and :func:`esc` every value.

>>> neutralise("\x1b[2J\x1b[32mOK\x07\r\u202eyp.live\n")
'\\x1b[2J\\x1b[32mOK\\x07\\r\\u202eyp.live\\n'
>>> neutralise("a\tb\nc", keep="\n\t")
'a\tb\nc'
>>> esc("\x1b]8;;http://x\x1b\\ok")
'\\x1b]8;;http://x\\x1b\\ok'
"""
from __future__ import annotations

import html
import re
from typing import Any, Iterable

from ..trace.records import CATEGORIES


COLORS = {"error": "#c62828", "warning": "#b26a00", "info": "#1565c0", "ok": "#2e7d32"}
#: Colours of the memory categories (plots and HTML legends use the same).
CATEGORY_COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer": "#76b7b2",
                   "activations": "#e15759", "other": "#bab0ac"}
CATEGORY_LABELS = {"parameters": "parameters", "gradients": "gradients", "optimizer": "optimizer state",
                   "activations": "saved activations", "other": "other"}


#: JupyterLab's theme variables with the light values as fallbacks: the cards follow a dark theme in
#: JupyterLab and look the same as before on a static page. Highlights are translucent so they read on
#: either background.
INK, INK2, INK3 = "var(--jp-ui-font-color1,#1f2328)", "var(--jp-ui-font-color2,#57606a)", "var(--jp-ui-font-color3,#8c959f)"
BG, BG2 = "var(--jp-layout-color1,#fff)", "var(--jp-layout-color2,#f6f8fa)"
LINE, LINE2 = "var(--jp-border-color1,#d0d7de)", "var(--jp-border-color2,#e5e7eb)"
HIT = "rgba(255,193,7,.28)"

CSS = """
.bd{font-family:var(--jp-ui-font-family,-apple-system,BlinkMacSystemFont,"Segoe UI",Roboto,Helvetica,Arial,sans-serif);
 font-size:13px;line-height:1.45;color:INK;background:BG;max-width:1100px}
.bd *{box-sizing:border-box}
.bd h3{font-size:14px;margin:14px 0 6px;color:INK;border-bottom:1px solid LINE2;padding-bottom:3px}
.bd code,.bd pre,.bd .mono{font-family:var(--jp-code-font-family,"SFMono-Regular",Menlo,Consolas,"DejaVu Sans Mono",monospace);
 font-size:12px}
.bd pre{margin:0;white-space:pre-wrap;word-break:break-word}
.bd .verdict{display:flex;align-items:flex-start;gap:10px;padding:10px 12px;border-radius:6px;
 border-left:6px solid var(--sev);background:BG2}
.bd .badge{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;font-weight:600;
 font-size:11px;letter-spacing:.02em;background:var(--sev);white-space:nowrap}
.bd .headline{font-size:15px;font-weight:600}
.bd .sub{color:INK2}
.bd .facts{display:grid;grid-template-columns:repeat(auto-fit,minmax(190px,1fr));gap:8px;margin:10px 0}
.bd .fact{border:1px solid LINE2;border-radius:6px;padding:6px 10px;background:BG}
.bd .fact .k{color:INK2;font-size:11px;text-transform:uppercase;letter-spacing:.04em}
.bd .fact .v{font-size:15px;font-weight:600}
.bd .gauge{height:6px;background:LINE2;border-radius:3px;margin-top:4px;overflow:hidden}
.bd .gauge>div{height:6px;border-radius:3px}
.bd .exc{background:rgba(248,81,73,.08);border:1px solid rgba(198,40,40,.35);border-radius:6px;padding:6px 10px;
 margin:8px 0}
.bd .chip{display:inline-block;border:1px solid LINE;border-radius:12px;padding:1px 9px;margin:2px 4px 2px 0;
 background:BG2;font-size:12px}
.bd .finding{border-left:4px solid var(--sev);padding:4px 10px;margin:8px 0;background:BG}
.bd .src{border:1px solid LINE2;border-radius:6px;overflow:hidden;margin:6px 0}
.bd .src .cap{background:BG2;color:INK2;padding:2px 8px;font-size:11px;border-bottom:1px solid LINE2}
.bd .src .ln{display:flex;white-space:pre;font-family:var(--jp-code-font-family,"SFMono-Regular",Menlo,Consolas,
 "DejaVu Sans Mono",monospace);font-size:12px;padding:0 8px}
.bd .src .ln .no{color:INK3;min-width:3.2em;text-align:right;padding-right:10px;user-select:none}
.bd .src .ln.hit{background:HIT;font-weight:600}
.bd .src .ln.hit .no{color:INK2}
.bd table.t{border-collapse:collapse;margin:6px 0;width:100%}
.bd table.t th{text-align:left;font-weight:600;color:INK2;border-bottom:1px solid LINE;padding:3px 8px;
 font-size:12px;white-space:nowrap}
.bd table.t td{border-bottom:1px solid LINE2;padding:3px 8px;vertical-align:top;text-align:left}
.bd table.t td.num,.bd table.t th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.bd table.t tr.hit td{background:HIT}
.bd .bad{color:var(--jp-error-color1,#c62828);font-weight:600}
.bd .good{color:var(--jp-success-color1,#2e7d32);font-weight:600}
.bd .muted{color:INK3}
.bd .diff{border:1px solid LINE2;border-radius:6px;padding:4px 0;margin:6px 0;overflow-x:auto}
.bd .diff div{white-space:pre;padding:0 8px;font-family:var(--jp-code-font-family,"SFMono-Regular",Menlo,Consolas,
 "DejaVu Sans Mono",monospace);font-size:12px}
.bd .diff .add{background:rgba(46,160,67,.18)}.bd .diff .del{background:rgba(248,81,73,.18)}
.bd .diff .hunk{color:#8250df;background:BG2}
.bd .chain{margin:4px 0;padding-left:0;list-style:none}
.bd .chain li{margin:2px 0}
.bd .chain li:before{content:"\\2192 ";color:INK3}
.bd .legend span{display:inline-block;margin-right:12px;font-size:12px}
.bd .legend i{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:4px;vertical-align:-1px}
.bd details>summary{cursor:pointer;color:var(--jp-content-link-color,#0b5cad);margin:4px 0}
.bd .graph{overflow:auto;border:1px solid LINE2;border-radius:6px;background:BG;max-height:760px}
.bd img.plot{max-width:100%;height:auto;display:block}
.bd .bd-fix-failed .headline{color:var(--jp-error-color1,#c62828)}
.bd .bd-next{margin-top:4px}
"""
for _name, _value in (("INK3", INK3), ("INK2", INK2), ("INK", INK), ("BG2", BG2), ("BG", BG), ("LINE2", LINE2),
                      ("LINE", LINE), ("HIT", HIT)):
    CSS = CSS.replace(_name, _value)


#: C0 controls (but tab and newline, which :func:`neutralise` keeps when asked), DEL, C1 controls, and the
#: invisible format characters that reorder or hide text: bidi marks, embeddings, overrides and isolates
#: (U+061C, U+200E-U+200F, U+202A-U+202E, U+2066-U+2069), zero-width ones, line/paragraph separators, BOM
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u180e\u200b-\u200f\u2028-\u202e"
                     "\u2060-\u206f\ufeff\ufff9-\ufffb]")
_TAB_NEWLINE = re.compile("[\t\n]")


_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    ch = m.group()
    c = ord(ch)
    return _NAMED.get(ch) or (f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}")


def neutralise(text: str, keep: str = "") -> str:
    """``text`` with every control and bidi character shown as its escape (``\\x1b``, ``\\u202e``), so a
    report's string cannot drive the terminal or reorder what is read; ``keep``: any of tab and newline, left
    as they are (where the renderer itself lays out lines)."""
    text = _UNSAFE.sub(_escape, text)
    if "\n" in keep and "\t" in keep:
        return text
    return _TAB_NEWLINE.sub(lambda m: m.group() if m.group() in keep else _escape(m), text)


def lines(out: list[str]) -> str:
    """A text report's lines joined: each stays one line whatever a report's string holds (a newline, an
    escape sequence, a carriage return or a bidi override inside it is shown as its escape)."""
    return "\n".join(neutralise(line, keep="\t") for line in out)


def esc(text: Any) -> str:
    """HTML-escape anything shown to the user (quotes too, for attributes), control and bidi characters
    shown as their escapes (:func:`neutralise`; tabs and newlines kept: ``<pre>`` lays lines out)."""
    return html.escape(neutralise("" if text is None else str(text), keep="\n\t"), quote=True)


def sev_color(sev: str) -> str:
    return COLORS.get(sev, COLORS["error"])


def legend_html(categories: Iterable[str] = CATEGORIES) -> str:
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{CATEGORY_COLORS[c]}"></i>{esc(CATEGORY_LABELS[c])}</span>'
        for c in categories) + "</div>"
