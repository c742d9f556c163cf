"""Generate the stored traces the unit tier reads (``tests/unit/fixtures/<name>.json``).

Not a test: run it by hand when the trace format or a rule changes on purpose::

    python tests/unit/make_fixtures.py            # every scenario
    python tests/unit/make_fixtures.py oom hang   # only these

Each scenario is one small cell (a few tiny layers) run through
``backward_doctor.diagnose(src, ns, engine="python")`` ``runs`` times in one namespace (the
across-run findings, ``stale_grad`` and ``graph_leak``, need a second run of the same cell). The
*last* run's trace is stored, with what the live run found::

    {"scenario": {...}, "trace": report.trace.to_dict(),
     "expected": {"kinds": [...], "first_kind": ..., "first_line": ..., "first_module": ...,
                  "ok": ..., "exception": ...}}

The generator refuses to write a fixture whose live findings miss the intended root cause (the
``kind`` below and the cell line marked ``# <-- root cause``), so a stored ``expected`` is always a
diagnosis a person checked. It also re-runs the rules on the trace read back from JSON and prints a
warning where they disagree with the live run (the tests then hold the stored trace to the live
answer, so such a fixture fails there too).
"""
from __future__ import annotations

import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")
ROOT_MARKER = "# <-- root cause"
#: Soft limit on one fixture file; the generator warns above it.
MAX_BYTES = 100_000


@dataclass
class Scenario:
    name: str
    kind: str | None  # the intended root cause (findings[0].kind); None: a healthy step, no findings
    source: str
    setup: Callable[[], dict]
    runs: int = 1
    options: dict[str, Any] = field(default_factory=dict)  # extra diagnose() arguments
    doc: str = ""

    @property
    def line(self) -> int | None:
        hits = [i for i, text in enumerate(self.source.splitlines(), 1) if ROOT_MARKER in text]
        if len(hits) > 1:
            raise LookupError(f"{self.name}: {ROOT_MARKER!r} marks {len(hits)} lines")
        return hits[0] if hits else None


def _ns(**values: Any) -> dict:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    ns = {"torch": torch, "nn": nn, "F": F, "math": math}
    ns.update(values)
    return ns


def _classifier(opt: str = "sgd", hidden: int = 8, **extra: Any) -> dict:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    optimizer = (torch.optim.SGD(model.parameters(), lr=0.1) if opt == "sgd"
                 else torch.optim.Adam(model.parameters(), lr=1e-3))
    return _ns(model=model, optimizer=optimizer, x=torch.randn(6, 4), y=torch.randint(0, 3, (6,)), **extra)


def _regressor(**extra: Any) -> dict:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    return _ns(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
               x=torch.randn(6, 4), y=torch.randn(6, 1), **extra)


def _backbone_head() -> dict:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    head = nn.Linear(8, 3)
    params = list(backbone.parameters()) + list(head.parameters())
    return _ns(backbone=backbone, head=head, optimizer=torch.optim.SGD(params, lr=0.1),
               x=torch.randn(6, 4), y=torch.randint(0, 3, (6,)))


def _two_heads() -> dict:
    import torch
    import torch.nn as nn

    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 8)
            self.head = nn.Linear(8, 3)
            self.aux = nn.Linear(8, 1)  # built, never called in forward

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    torch.manual_seed(0)
    model = TwoHeads()
    return _ns(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
               x=torch.randn(6, 4), y=torch.randint(0, 3, (6,)))


def _tied_lm() -> dict:
    import torch
    import torch.nn as nn

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 4)
            self.head = nn.Linear(4, 16, bias=False)
            self.head.weight = self.embed.weight  # one tensor: the output layer is the embedding

        def forward(self, ids):
            return self.head(torch.tanh(self.embed(ids)))

    torch.manual_seed(0)
    return _ns(model=TiedLM(), ids=torch.randint(0, 16, (2, 5)))


def _big_linear() -> dict:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 3))
    return _ns(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
               x=torch.randn(512, 64), y=torch.randint(0, 3, (512,)))


def _d(src: str) -> str:
    return textwrap.dedent(src)


_STEP = _d("""\
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    """)

SCENARIOS: list[Scenario] = [
    Scenario("healthy_step", None, _STEP, _classifier, runs=2,
             doc="a correct SGD step (run twice: no across-run finding either)"),
    Scenario("inplace_on_saved_tensor", "inplace", _d("""\
        optimizer.zero_grad()
        h = model[0](x)
        a = torch.sigmoid(h)
        a.mul_(2)  # <-- root cause
        loss = F.cross_entropy(model[2](a), y)
        loss.backward()
        optimizer.step()
        """), _classifier, doc="sigmoid's output (saved for its backward) scaled in place"),
    Scenario("no_grad_forward", "no_grad_path", _d("""\
        optimizer.zero_grad()
        with torch.no_grad():
            logits = model(x)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """), _classifier, doc="the whole forward under no_grad: backward() raises"),
    Scenario("detached_features", "detached", _d("""\
        optimizer.zero_grad()
        feats = backbone(x).detach()  # <-- root cause
        loss = F.cross_entropy(head(feats), y)
        loss.backward()
        optimizer.step()
        """), _backbone_head, doc="the backbone's output detached: its parameters never learn, nothing raises"),
    Scenario("nan_from_log_of_negative", "nonfinite", _d("""\
        optimizer.zero_grad()
        pred = model(x)
        loss = torch.log(pred - 10).mean()  # <-- root cause
        loss.backward()
        optimizer.step()
        """), _regressor, doc="log of a negative number: the first NaN, which reaches loss and gradients"),
    Scenario("oom_under_memory_limit", "oom", _d("""\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        """), _big_linear, options={"memory_limit": "2MB"},
             doc="a step that needs more than a simulated 2 MB device"),
    Scenario("hang_timeout", "hang", _d("""\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        while True:  # <-- root cause
            pass
        """), _classifier, options={"timeout": 0.5}, doc="a loop that never ends, stopped by timeout="),
    Scenario("shape_mismatch", "shape_mismatch", _d("""\
        optimizer.zero_grad()
        h = model[0](x)
        out = h @ torch.ones(4, 3)  # <-- root cause
        loss = F.cross_entropy(out, y)
        loss.backward()
        """), _classifier, doc="a matmul of [6, 8] by [4, 3]"),
    Scenario("label_out_of_range", "index_out_of_range", _d("""\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y + 1)  # <-- root cause
        loss.backward()
        optimizer.step()
        """), _classifier, doc="labels shifted to 1..3 for 3 classes"),
    Scenario("backward_twice", "backward_twice", _d("""\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        loss.backward()  # <-- root cause
        optimizer.step()
        """), _classifier, doc="a second backward through a freed graph"),
    Scenario("stale_grad_no_zero_grad", "stale_grad", _d("""\
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()  # <-- root cause
        """), _classifier, runs=2, doc="zero_grad() missing: the second run steps on summed gradients"),
    Scenario("graph_leak_append_loss", "graph_leak", _d("""\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        history.append(loss)  # <-- root cause
        """), lambda: _classifier(history=[]), runs=2,
             doc="losses kept as tensors: every entry keeps its run's graph"),
    Scenario("unused_layer_is_silent", None, _STEP, _two_heads,
             doc="a layer built in __init__ and never called: no gradient, and no finding (by design: "
                 "orphan_params is for parameters the optimizer no longer matches)"),
    Scenario("layer_replaced_after_optimizer", "orphan_params", _d("""\
        model[2] = nn.Linear(8, 3)  # <-- root cause
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        """), _classifier, doc="a fresh head the optimizer never sees (its old one is stepped, unused)"),
    Scenario("untied_head_reassigned", "untied_weights", _d("""\
        model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # <-- root cause
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, 16), ids[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        """), _tied_lm, doc="an output layer tied to the embedding in __init__, given a parameter of its own: "
                             "two tensors trained apart"),
    Scenario("dtype_mismatch", "dtype_mismatch", _d("""\
        optimizer.zero_grad()
        logits = model(x.double())  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        """), _classifier, doc="float64 input into float32 weights"),
    Scenario("broadcast_mse", "broadcast", _d("""\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """), lambda: {**_regressor(), "y": __import__("torch").randn(6)},
             doc="[6, 1] predictions against [6] targets broadcast to [6, 6]"),
    Scenario("accumulation_zero_grad_every_micro_batch", "grad_accumulation", _d("""\
        accum_steps = 2
        for i in range(2):
            loss = F.cross_entropy(model(x), y) / accum_steps
            loss.backward()
            if (i + 1) % accum_steps == 0:
                optimizer.step()
            optimizer.zero_grad()  # <-- root cause
        """), _classifier, doc="zero_grad() one indent too far out: each micro-batch wipes the one before it"),
    Scenario("amp_clip_before_unscale", "amp_misuse", _d("""\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <-- root cause
        scaler.step(optimizer)
        scaler.update()
        """), lambda: _classifier(scaler=__import__("torch").amp.GradScaler("cpu")),
             doc="gradients clipped while they still carry the GradScaler's loss scale"),
    Scenario("script_in_source", "shape_mismatch", _d("""\
        note = "</script><script>alert(1)</script>"
        out = torch.ones(2) + torch.ones(3)  # <-- root cause
        """), _ns, doc="user text that would be markup: every renderer must escape it"),
]


def _expected(report: Any) -> dict:
    first = report.findings[0] if report.findings else None
    return {"kinds": [f.kind for f in report.findings],
            "first_kind": first.kind if first else None,
            "first_line": first.line if first else None,
            "first_file": first.file if first else None,
            "first_module": first.module if first else None,
            "ok": report.ok,
            "exception": report.exception}


def generate(sc: Scenario) -> tuple[dict, list[str]]:
    """Run ``sc`` and return (the fixture, problems found)."""
    import backward_doctor as bd
    from backward_doctor.analysis import analyze
    from backward_doctor.trace import Trace

    ns = sc.setup()
    report = None
    for _ in range(sc.runs):
        report = bd.diagnose(sc.source, ns, engine="python", **sc.options)
    assert report is not None
    expected = _expected(report)
    problems = []
    if sc.kind is None:
        if not report.ok:
            problems.append(f"meant to be healthy, got {expected['kinds']} / {report.exception!r}")
    else:
        if expected["first_kind"] != sc.kind:
            problems.append(f"first finding {expected['first_kind']!r} (all: {expected['kinds']}), meant {sc.kind!r}")
        if sc.line is not None and (expected["first_line"], expected["first_file"]) != (sc.line, None):
            problems.append(f"root cause at line {expected['first_line']} of {expected['first_file'] or 'the cell'}, "
                            f"marked line {sc.line}")
    data = report.trace.to_dict()
    stored = Trace.from_dict(json.loads(json.dumps(data)))
    again = [f.to_dict() for f in analyze(stored)]
    live = [f.to_dict() for f in report.findings]
    if again != live:
        diff = [k for k in range(max(len(again), len(live)))
                if k >= len(again) or k >= len(live) or again[k] != live[k]]
        problems.append(f"WARNING: rules on the stored trace differ from the live run at findings {diff}: "
                        f"live {[f['kind'] for f in live]}, stored {[f['kind'] for f in again]}")
    fixture = {"scenario": {"name": sc.name, "source": sc.source, "runs": sc.runs,
                            "options": sc.options, "engine": "python", "doc": sc.doc},
               "trace": data, "expected": expected}
    return fixture, problems


def main(argv: list[str]) -> int:
    import torch

    torch.set_num_threads(1)
    wanted = set(argv)
    unknown = wanted - {s.name for s in SCENARIOS}
    if unknown:
        print(f"unknown scenarios: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    os.makedirs(FIXTURES, exist_ok=True)
    failed = 0
    for sc in SCENARIOS:
        if wanted and sc.name not in wanted:
            continue
        fixture, problems = generate(sc)
        hard = [p for p in problems if not p.startswith("WARNING")]
        for p in problems:
            print(f"  {sc.name}: {p}", file=sys.stderr)
        if hard:
            failed += 1
            print(f"{sc.name}: NOT written", file=sys.stderr)
            continue
        path = os.path.join(FIXTURES, sc.name + ".json")
        text = json.dumps(fixture, indent=1, sort_keys=True) + "\n"
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(text)
        size = len(text.encode("utf-8"))
        big = "  (over the size limit!)" if size > MAX_BYTES else ""
        print(f"{sc.name}: {fixture['expected']['kinds']} first line {fixture['expected']['first_line']}, "
              f"{size / 1000:.1f} kB{big}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
