"""The code to keep, in a notebook: buttons that insert it as a new cell below the panel's cell or copy
it, running in the browser alone (no kernel round trip). What works in which front end is in
`docs/panel.md`; the user's code is escaped wherever it appears.

>>> '&lt;script&gt;' in keep_html('<script>')
True
"""
from __future__ import annotations

import html

from ..render.style import esc

#: Runs on click in the browser: inserts the code as a new cell below the panel's cell.
#: Classic Notebook: ``Jupyter.notebook`` API. JupyterLab 4 / Notebook 7: the click has
#: made the panel's cell active; the cell toolbar's "insert below" button adds the cell
#: and a paste event puts the code into its editor. Anything else: copy to clipboard.
KEEP_JS = r"""(function(btn){
var box=btn.closest('.bd-keep'),code=box.querySelector('textarea').value,st=box.querySelector('.bd-keep-status');
function say(m){st.textContent=m;}
function copy(){try{if(navigator.clipboard){navigator.clipboard.writeText(code);return true;}}catch(e){}
 var ta=box.querySelector('textarea');ta.hidden=false;ta.select();var ok=false;try{ok=document.execCommand('copy');}catch(e){}
 ta.hidden=true;return ok;}
function fallback(){say(copy()?'Copied: paste it into a cell (Ctrl+V / Cmd+V).':'Select the code above and copy it.');}
var J=window.Jupyter;
if(J&&J.notebook&&J.notebook.insert_cell_below){var el=btn.closest('.cell'),cs=J.notebook.get_cells(),idx=-1;
 for(var i=0;i<cs.length;i++)if(el&&cs[i].element[0]===el)idx=i;
 var c=J.notebook.insert_cell_below('code',idx>=0?idx:undefined);c.set_text(code);
 J.notebook.select(J.notebook.find_cell_index(c));return say('Inserted as a new cell below.');}
var cell=btn.closest('.jp-Cell'),nb=cell&&cell.closest('.jp-Notebook'),ins=null;
if(cell){ins=cell.querySelector('[data-command="notebook:insert-cell-below"]');
 var p=cell.closest('.jp-NotebookPanel');if(!ins&&p)ins=p.querySelector('[data-command="notebook:insert-cell-below"]');}
if(!ins||!nb)return fallback();
var before=Array.prototype.slice.call(nb.querySelectorAll('.jp-Cell'));ins.click();var t0=Date.now();
(function wait(){var all=nb.querySelectorAll('.jp-Cell'),nc=null;
 for(var i=0;i<all.length;i++)if(before.indexOf(all[i])<0)nc=all[i];
 var cm=nc&&nc.querySelector('.cm-content');
 if(!cm){if(Date.now()-t0<3000)return setTimeout(wait,50);return fallback();}
 cm.focus();var dt=new DataTransfer();dt.setData('text/plain',code);
 cm.dispatchEvent(new ClipboardEvent('paste',{clipboardData:dt,bubbles:true,cancelable:true}));
 setTimeout(function(){var first=code.split('\n')[0].trim();
  if((cm.textContent||'').indexOf(first)>=0)say('Inserted as a new cell below.');else fallback();},150);})();
})(this)"""


COPY_JS = r"""(function(btn){var box=btn.closest('.bd-keep'),code=box.querySelector('textarea').value,
st=box.querySelector('.bd-keep-status');var done=function(){st.textContent='Copied.';};
try{navigator.clipboard.writeText(code).then(done,function(){st.textContent='Select the code above and copy it.';});}
catch(e){st.textContent='Select the code above and copy it.';}})(this)"""


#: Theme variables (JupyterLab light or dark), the light look as fallback.
_BTN = ("border:1px solid var(--jp-border-color1,#d0d7de);border-radius:6px;background:var(--jp-layout-color2,#f6f8fa);"
        "color:var(--jp-ui-font-color1,#1f2328);padding:3px 12px;margin:4px 6px 4px 0;cursor:pointer;font-size:13px")


def keep_html(code: str) -> str:
    """Buttons that insert the code to keep into the notebook or copy it (pure front end), and the code."""
    return (f'<div class="bd bd-keep"><div><b>Code to keep</b> <span class="sub">(the whole cell with the fix)'
            f'</span></div>'
            f'<button class="bd-insert" style="{_BTN};background:#1f883d;color:#fff;border-color:#1a7f37" '
            f'onclick="{html.escape(KEEP_JS, quote=True)}">Insert as a new cell below</button>'
            f'<button class="bd-copy" style="{_BTN}" onclick="{html.escape(COPY_JS, quote=True)}">Copy code</button>'
            f'<span class="bd-keep-status" style="color:var(--jp-ui-font-color2,#57606a)"></span>'
            f'<details><summary>Show the code</summary><div class="src"><pre style="padding:6px 8px">{esc(code)}'
            f"</pre></div></details><textarea hidden>{esc(code)}</textarea></div>")
