"""The ``detached`` rule on a model the cell builds itself: ``nn.init`` writes each parameter in place under
``no_grad`` (``uniform_``), which is its initialisation, not a use whose output was cut off. Before, a module
whose output never reaches the loss was reported as "line 7 runs it under torch.no_grad()", pointing at
``nn.Linear(...)`` in ``__init__``; a real cut in the same layout is still found at its line."""
from __future__ import annotations

import backward_doctor as bd

MODEL = """\
import torch
import torch.nn as nn
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 16); self.aux = nn.Linear(16, 16); self.head = nn.Linear(16, 1)
    def forward(self, x):
        h = torch.relu(self.body(x))
        {AUX}
        return self.head(h)
model = Net()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for step in range(3):
    xb = torch.randn(8, 16); yb = torch.randn(8, 1)
    loss = ((model(xb) - yb) ** 2).mean()
    loss.backward()
    opt.step(); opt.zero_grad()
"""


def _run(aux: str, engine: str) -> bd.Report:
    return bd.diagnose(MODEL.replace("{AUX}", aux), {}, engine=engine)


def test_an_output_that_never_reaches_the_loss_is_not_a_cut_at_init(engine):
    report = _run("extra = self.aux(h)  # computed for a metric, never in the loss", engine)
    assert report.findings == [], [(f.kind, f.line, f.message[:120]) for f in report.findings]


def test_a_real_no_grad_cut_in_the_same_layout_is_still_named_at_its_line(engine):
    report = _run("with torch.no_grad():\n            h = h + self.aux(h)", engine)
    f = next(f for f in report.findings if f.kind == "detached")
    assert f.line == MODEL.replace("{AUX}", "with torch.no_grad():\n            h = h + self.aux(h)").splitlines().index(
        "            h = h + self.aux(h)") + 1
    assert "torch.no_grad()" in f.message and "model.aux" in f.message
