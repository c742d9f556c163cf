"""``make demo``: the guided tour, executed headlessly and written as one self-contained HTML page.

``python -m backward_doctor.frontends.demo`` runs ``notebooks/00_tour.ipynb`` top to bottom in a
real Jupyter kernel (nbclient), keeps the static view of every panel (the widget view
needs a live kernel; the panel's output also carries the report as plain HTML), and
writes the executed notebook as ``out/tour.html``: styles inline, plots as data URIs,
no script, nothing fetched. It prints the page's path.

``python -m backward_doctor.frontends.demo --text`` prints instead the reports of the failures
users bring (see ``shared/seeds``), diagnosed headlessly: each scenario is a small,
complete training step on CPU; ``memory_limit`` stands in for a small GPU and
``timeout`` for a user's patience.

Running the tour needs the ``demo`` extra (``pip install -e '.[demo]'``: nbclient,
nbconvert, ipykernel); ``--text`` needs nothing more than the package.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api import diagnose

#: The notebooks of a source checkout (``pip install -e .``, ``make demo``).
NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
TOUR = NOTEBOOK_DIR / "00_tour.ipynb"
DEFAULT_OUT = Path("out") / "tour.html"
#: An ipywidgets view: needs a live kernel and the widget manager's JavaScript (from a CDN in nbconvert).
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
RAISES = "raises-exception"
CELL_TIMEOUT = 120  # seconds per cell

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(64, 256)
y = torch.randint(0, 10, (64,))
"""


# A batch whose activations do not fit the (simulated) 40 MB device: shown failing, then fixed.
OOM_CELL = """
xb = torch.randn(8192, 256)
yb = torch.randint(0, 10, (8192,))
loss = F.cross_entropy(model(xb), yb)
loss.backward()
opt.step(); opt.zero_grad()
"""


@dataclass
class Scenario:
    title: str
    folklore: str
    source: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    setup: str = SETUP


SCENARIOS = [
    Scenario(
        "loss.backward() hangs (seed: 'Why does PyTorch sometimes hang when calling loss.backward()?')",
        "Folklore blames memory fragmentation. Measured: the backward is waiting on a lock.",
        """
        import threading
        lock = threading.Lock()
        class Gate(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()
            @staticmethod
            def backward(ctx, g):
                with lock:              # the lock is held by the logging thread below
                    return g
        lock.acquire()                  # a 'logger' took it and never released it
        loss = F.cross_entropy(Gate.apply(model(x)), y)
        loss.backward()
        """, {"timeout": 2.0}),
    Scenario(
        "backward() crashes out of memory (seeds: 'crashing during backward', 'CUDA OOM but not on CPU')",
        "Folklore: `del` tensors and empty the cache. Measured: activations of a big batch fill the card.",
        OOM_CELL, {"memory_limit": "40MB"}),
    Scenario(
        "the same step with fix='accumulate' (issue 4: fixes)",
        "The cell runs, the state is rolled back, the rewritten cell runs: measured, with the code to keep.",
        OOM_CELL, {"memory_limit": "40MB", "fix": "accumulate"}),
    Scenario(
        "the 'no_grad saves memory' advice (seed: 'CUDA OOM but not on CPU', example 1)",
        "The article computes outputs under no_grad, then calls backward: there is no graph at all.",
        """
        with torch.no_grad():
            outputs = model(x)
        loss = F.cross_entropy(outputs, y)
        loss.backward()
        """),
    Scenario(
        "device-side assert in backward (seed: 'failing with a CUDA assertion error')",
        "Folklore blames NaN. Measured: a class label outside 0..C-1.",
        """
        y_bad = y.clone(); y_bad[3] = 10    # labels 1..10 instead of 0..9
        loss = F.cross_entropy(model(x), y_bad)
        loss.backward()
        """),
    Scenario(
        "NaN appears after some iterations (seed: 'CUDA assertion error', cause 1)",
        "The NaN is made by one op on one line; everything after it only carries it.",
        """
        logits = model(x) * 1000                      # a temperature bug: logits in the hundreds
        probs = torch.softmax(logits, dim=1)          # underflows to exactly 0 for some classes
        loss = -torch.log(probs[torch.arange(64), y]).mean()
        loss.backward()
        """),
    Scenario(
        "in-place op breaks backward (seed: 'CUDA assertion error', cause 2)",
        "PyTorch raises at backward(); the cause is the in-place write in forward.",
        """
        h = torch.sigmoid(model[0](x))
        h += 0.1                                         # in-place on a tensor sigmoid saved
        loss = F.cross_entropy(model[2:](model[1](h)), y)
        loss.backward()
        """),
    Scenario(
        "a correct step",
        "The doctor stays silent when nothing is wrong.",
        """
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step(); opt.zero_grad()
        """),
]


def print_scenarios() -> int:
    """``--text``: one text report per seed scenario."""
    for i, sc in enumerate(SCENARIOS, 1):
        ns: dict[str, Any] = {}
        exec(sc.setup, ns)
        source = textwrap.dedent(sc.source).strip("\n")
        print("=" * 100)
        print(f"{i}. {sc.title}")
        print(f"   {sc.folklore}")
        print("-" * 100)
        print(textwrap.indent(source, "   | "))
        print("-" * 100, flush=True)
        print(diagnose(source, ns, **sc.kwargs))
        print(flush=True)
    return 0


# --------------------------------------------------------------------------- the tour as HTML
def kernel_env() -> dict[str, str]:
    """The kernel's environment: it imports this copy of backward_doctor, and uses one intra-op
    thread unless told otherwise (on a small shared machine, idle-spinning OpenMP threads make
    the tour's small matrix products many times slower)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def execute(path: Path, timeout: int = CELL_TIMEOUT):  # -> nbformat.NotebookNode
    """Run the notebook at ``path`` top to bottom in a fresh kernel; the executed notebook.

    Cells tagged ``raises-exception`` may fail (they show a failing step on purpose); any
    other error is left in the outputs and reported by :func:`unexpected_errors`.
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    # log_level: the kernel's warning that its local TCP ports are not encrypted is noise here.
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"],
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute(env=kernel_env())
    return nb


def unexpected_errors(nb) -> list[str]:  # noqa: ANN001 - a NotebookNode
    """One line per code cell that raised although it is not tagged ``raises-exception``, or is
    tagged and did not raise."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        tagged = RAISES in cell.get("metadata", {}).get("tags", [])
        first = (cell.source.strip().splitlines() or [""])[0]
        if errors and not tagged:
            problems.append(f"cell {i} ({first}) raised {errors[0].get('ename')}: {errors[0].get('evalue')}")
        elif tagged and not errors:
            problems.append(f"cell {i} ({first}) is tagged {RAISES!r} but did not raise")
    return problems


def static_views(nb):  # noqa: ANN001, ANN201 - NotebookNode in, the same notebook out
    """Keep what a page without a kernel can show: drop the widget view of every output that
    also carries HTML (the panel's static report), and the notebook's saved widget state (which
    would make nbconvert load the widget manager from a CDN)."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data")
            if data and WIDGET_VIEW in data and ("text/html" in data or "text/plain" in data):
                del data[WIDGET_VIEW]
    nb.metadata.pop("widgets", None)
    return nb


#: nbconvert's JupyterLab template minus everything it would fetch: require.js, MathJax and
#: mermaid from a CDN, and the widget manager. CSS is inlined by the template itself.
_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""

_REMOTE = re.compile(r"""<(?:script|link|img|iframe|source|video|audio)\b[^>]*?\b(?:src|href)\s*=\s*["']?\s*"""
                     r"""(?:https?:)?//""", re.IGNORECASE)
_REMOTE_CSS = re.compile(r"""(?:url\(\s*["']?|@import\s+["'])\s*(?:https?:)?//""", re.IGNORECASE)


def remote_references(page: str) -> list[str]:
    """What in ``page`` would be fetched from the network when it is opened (empty: nothing).

    >>> remote_references('<img src="data:image/png;base64,AA"><a href="https://pytorch.org">docs</a>')
    []
    >>> remote_references('<script src="https://cdn.example/x.js"></script>')
    ['<script src="https://']
    """
    return [m.group(0) for m in _REMOTE.finditer(page)] + [m.group(0) for m in _REMOTE_CSS.finditer(page)]


def to_html(nb) -> str:  # noqa: ANN001 - a NotebookNode
    """The executed notebook as one self-contained page (nbconvert's JupyterLab look)."""
    from jinja2 import DictLoader
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(extra_loaders=[DictLoader({"bd_static.html.j2": _TEMPLATE})],
                            template_file="bd_static.html.j2", embed_images=True)
    page, _ = exporter.from_notebook_node(static_views(nb))
    remote = remote_references(page)
    if remote:
        raise RuntimeError(f"the page would fetch from the network: {remote[:3]}")
    return page


def write_tour(notebook: Path = TOUR, out: Path = DEFAULT_OUT) -> tuple[Path, list[str]]:
    """Execute ``notebook``, write it as HTML to ``out``; (the page's path, unexpected errors)."""
    nb = execute(notebook)
    problems = unexpected_errors(nb)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(to_html(nb), encoding="utf-8")
    return out.resolve(), problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backward_doctor.frontends.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", action="store_true",
                        help="print the seed scenarios' reports as text instead of writing the tour")
    parser.add_argument("--notebook", type=Path, default=TOUR, metavar="IPYNB",
                        help="the notebook to run and write (default: notebooks/00_tour.ipynb)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, metavar="HTML",
                        help="where to write the page (default: out/tour.html)")
    args = parser.parse_args(argv)
    if args.text:
        return print_scenarios()
    if not args.notebook.is_file():
        print(f"backward_doctor.frontends.demo: {args.notebook} not found (the tour ships with a source checkout; "
              "pass --notebook PATH)", file=sys.stderr)
        return 2
    try:
        import nbclient  # noqa: F401
        import nbconvert  # noqa: F401
    except ImportError as exc:
        print(f"backward_doctor.frontends.demo: {exc.name} is missing: pip install -e '.[demo]' (or use --text)",
              file=sys.stderr)
        return 2
    print(f"running {args.notebook} in a Jupyter kernel ...", flush=True)
    t0 = time.perf_counter()
    path, problems = write_tour(args.notebook, args.out)
    print(f"ran in {time.perf_counter() - t0:.0f} s")
    for p in problems:
        print(f"backward_doctor.frontends.demo: unexpected: {p}", file=sys.stderr)
    print(path)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
