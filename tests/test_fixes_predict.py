"""The OOM finding's predicted peaks against the peaks measured when each fix re-runs the step.

The device is simulated at 90% of the step's own peak, so the step runs out of memory near
where it peaks (in backward or late in the forward pass): there the prediction has seen
(nearly) the whole step. Running out early in the forward pass gives lower bounds
(``evidence["lower_bound"]``), tested separately.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import backward_doctor as bd
from backward_doctor.fixes import run_fix

try:
    from . import buggy_models as bm
    from .test_fixes import STEP, res_mlp, wide_mlp
except ImportError:
    import buggy_models as bm
    from test_fixes import STEP, res_mlp, wide_mlp

LM_STEP = """optimizer.zero_grad()
logits = model(tokens[:, :-1])
loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
loss.backward()
optimizer.step()
"""


def tiny_lm():
    torch.manual_seed(0)
    model = bm.LongContextLM(vocab_size=100, dim=32, n_head=4, max_len=256)
    return {"torch": torch, "F": F, "model": model, "tokens": torch.randint(0, 100, (8, 129)),
            "optimizer": torch.optim.AdamW(model.parameters(), lr=3e-4)}


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(32 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def small_cnn():
    torch.manual_seed(0)
    model = SmallCNN()
    return {"torch": torch, "F": F, "model": model, "xb": torch.randn(64, 3, 32, 32),
            "yb": torch.randint(0, 10, (64,)), "optimizer": torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)}


MODELS = {"mlp": (wide_mlp, STEP), "res_mlp": (res_mlp, STEP), "cnn": (small_cnn, STEP), "tiny_lm": (tiny_lm, LM_STEP)}


def measure(name, fraction):
    setup, src = MODELS[name]
    peak = bd.diagnose(src, setup()).trace.memory.peak_bytes
    original = bd.diagnose(src, setup(), memory_limit=int(peak * fraction))
    finding = original.findings[0]
    assert finding.kind == "oom"
    out = {}
    for fix, predicted in finding.evidence["predicted_peak"].items():
        fr = run_fix(src, setup(), fix, original=original).fix_result   # no limit: the fix's own peak
        assert fr.applied and fr.fits, fr.message
        out[fix] = (predicted, fr.comparison["after"]["peak_bytes"])
    return finding, out


@pytest.mark.parametrize("name", list(MODELS))
def test_predicted_peaks_within_20_percent_of_measured(name):
    finding, out = measure(name, 0.9)
    assert {"accumulate:2", "accumulate:4", "accumulate:8", "amp"} <= set(out)
    for fix, (predicted, measured) in out.items():
        assert abs(predicted - measured) <= 0.2 * measured, (fix, predicted, measured)
    if name == "res_mlp":                                  # repeated blocks: checkpointing is planned and measured
        assert "checkpoint" in out


def test_early_oom_predictions_are_lower_bounds():
    finding, out = measure("mlp", 0.35)
    assert finding.evidence["lower_bound"] is True
    for fix, (predicted, measured) in out.items():
        assert predicted <= measured * 1.05, fix
