"""The autograd graph by module (readable for a 12-layer transformer) and the plots' CUDA view."""
from __future__ import annotations

import re

import pytest

import backward_doctor as bd
from backward_doctor.render.graph import build_graph

TRANSFORMER = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = nn.LayerNorm(d); self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(d); self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.ln2(x))
        return x
class GPT(nn.Module):
    def __init__(self, vocab=100, d=32, n=12):
        super().__init__()
        self.embed = nn.Embedding(vocab, d); self.pos = nn.Parameter(torch.zeros(16, d))
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.ln_f = nn.LayerNorm(d); self.head = nn.Linear(d, vocab)
    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))
model = GPT()
idx = torch.randint(0, 100, (4, 16))
"""

STEP = """logits = model(idx)
loss = F.cross_entropy(logits.view(-1, 100), idx.view(-1))
loss.backward()"""


@pytest.fixture(scope="module")
def gpt_report():
    ns: dict = {}
    exec(TRANSFORMER, ns)
    return bd.diagnose(STEP, ns)


def node_titles(svg: str) -> list[str]:
    return re.findall(r'<text [^>]*font-weight="bold"[^>]*>([^<]*)</text>', svg)


def test_twelve_layer_transformer_shows_its_blocks(gpt_report):
    g = build_graph(gpt_report.trace, gpt_report)
    expanded = g.auto_expanded()
    view = g.view(expanded)
    assert len(view.nodes) <= 32
    ids = [n.id for n in view.nodes]
    assert [f"model.blocks.{i}" for i in range(12)] == [i for i in ids if i.startswith("model.blocks.")]
    assert all(n.composite for n in view.nodes if n.id.startswith("model.blocks."))
    svg = g.render_svg(expanded)
    titles = node_titles(svg)
    assert "▸ blocks.0" in titles and "▸ blocks.11" in titles and "embed" in titles and "head" in titles
    # The chain between blocks carries the measured saved tensors.
    assert svg.count("saved ") >= 12
    # Opening a block shows its layers, and the residual adds as separate nodes (a DAG, no back edges).
    inner = g.view(expanded | {"model.blocks.3"}, within="model.blocks.3")
    names = [n.id for n in inner.nodes]
    for part in ("ln1", "attn", "ln2", "mlp"):
        assert f"model.blocks.3.{part}" in names
    assert sum(1 for n in names if n.startswith("model.blocks.3#")) == 2
    order = {n.id: n.first for n in inner.nodes}
    assert all(order[a] < order[b] for a, b in inner.edges)


def test_panel_opens_and_closes_modules(gpt_report):
    pytest.importorskip("ipywidgets")
    from backward_doctor.frontends.panel import Panel

    p = Panel(gpt_report, STEP, {})
    p.tabs.selected_index = 2
    assert "model.blocks.5" in [v for _, v in p.graph_open.options]
    p.graph_open.value = "model.blocks.5"
    assert "ln1" in p.graph_html.value and "model.blocks.5" in p.graph_close.options[-1][1] or \
        "model.blocks.5" in [v for _, v in p.graph_close.options]
    assert "blocks.5.attn" in " ".join(node_titles(p.graph_html.value)) or "attn" in p.graph_html.value
    p.graph_close.value = "model.blocks"
    assert "model.blocks.5" not in [v for _, v in p.graph_close.options]
    p.graph_reset.click()
    assert "▸ blocks.0" in node_titles(p.graph_html.value)


def test_finding_inside_a_block_is_highlighted():
    ns: dict = {}
    exec(TRANSFORMER, ns)
    src = "logits = model(idx)\nloss = logits.pow(2).mean()\nloss.backward()"
    # An in-place write inside block 7's MLP activation, made by editing the module.
    ns["model"].blocks[7].mlp[1] = ns["torch"].nn.ReLU(inplace=True)
    ns["model"].blocks[7].mlp.insert(1, ns["torch"].nn.Sigmoid())
    report = bd.diagnose(src, ns)
    assert report.findings and report.findings[0].kind == "inplace"
    g = build_graph(report.trace, report)
    expanded = g.auto_expanded()
    hit = [n for n in g.view(expanded).nodes if n.highlight]
    assert len(hit) == 1 and hit[0].id.startswith("model.blocks.7"), [n.id for n in hit]


def test_cuda_memory_view_draws_allocator_lines():
    """On CUDA the timeline adds the allocator's allocated line and reserved maximum (synthetic figures)."""
    from backward_doctor.render import svg_plots

    report = bd.diagnose("import torch\nx = torch.randn(256, 256, requires_grad=True)\n(x @ x).sum().backward()")
    tr = report.trace
    tr.memory.device_total_bytes = 2 * tr.memory.peak_bytes
    tr.memory.cuda = {"allocated": 1, "reserved": 2, "max_allocated": tr.memory.peak_bytes,
                      "max_reserved": int(tr.memory.peak_bytes * 1.5),
                      "allocated_per_op": [int(v * 1.1) for v in (sum(c) for c in zip(*tr.memory.by_category.values()))]}
    svg = svg_plots.memory_timeline_svg(tr)
    assert "<title>CUDA allocated</title>" in svg and "device" in svg


def test_the_allocator_line_stays_inside_the_plot_and_is_named():
    """Seen on an H200: the allocator counts the whole process (tensors made before the step too), above the
    step's own peak; it was drawn off the top of the plot, over the phase names, with no legend."""
    import re

    from backward_doctor.render import svg_plots

    report = bd.diagnose("import torch\nx = torch.randn(256, 256, requires_grad=True)\n(x @ x).sum().backward()")
    tr = report.trace
    n = len(tr.memory.op_index)
    tr.memory.cuda = {"allocated_per_op": [3 * tr.memory.peak_bytes] * n}
    svg = svg_plots.memory_timeline_svg(tr)
    line = re.search(r'<polyline points="([^"]+)"[^>]*><title>CUDA allocated', svg).group(1)
    ys = [float(p.split(",")[1]) for p in line.split()]
    assert min(ys) >= 22                                   # the plot's top edge (``up``)
    assert ">CUDA allocated</text>" in svg and "(whole process)" in svg
