"""IPython tier: the magic in a real InteractiveShell (no kernel, no browser)."""
from __future__ import annotations

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import backward_doctor as bd

pytestmark = pytest.mark.ipython


@pytest.fixture(scope="module")
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    yield sh


def _run(shell, cell, store_history=True):
    with capture_output() as cap:
        result = shell.run_cell(cell, store_history=store_history)
    return result, cap


SETUP = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(8, 1))
x = torch.randn(5, 4)
"""


def test_correct_cell_same_variables_out_and_ok_report(shell):
    _run(shell, SETUP)
    count = shell.execution_count
    result, cap = _run(shell, "%%backward_doctor\nz = torch.ones(2, requires_grad=True)\nw = (z * 3).sum()\nw.backward()\n41 + 1")
    assert shell.user_ns["z"].grad.tolist() == [3.0, 3.0]
    assert shell.user_ns["Out"][count] == 42          # Out[] as for a plain cell
    assert "Out[" in cap.stdout
    report = bd.last_report()
    assert report.ok
    shown = cap.outputs[-1].data                      # the report, displayed after the cell
    assert shown["text/plain"].startswith("backward_doctor: OK") and "text/html" in shown
    assert shell.execution_count == count + 1


def test_failing_cell_keeps_traceback_and_reports_root_cause(shell):
    _run(shell, SETUP)
    result, cap = _run(shell, "%%backward_doctor\nout = model(x)\nloss = out.pow(2).mean()\nloss.backward()")
    assert isinstance(result.error_in_exec, RuntimeError)  # the magic's run_cell result carries it
    assert "modified by an inplace operation" in cap.stdout  # PyTorch's own traceback shown
    f = bd.last_report().findings[0]
    assert (f.kind, f.line, f.module, f.op) == ("inplace", 1, "model.2", "aten::relu_")
    # Plain words, the cell as IPython names it, the module with its type
    assert cap.outputs[-1].data["text/plain"].startswith(
        f"backward_doctor: PROBLEM - Saved tensor modified in place at Cell In[{result.execution_count}], line 1, "
        "module model.2 (ReLU)")


def test_bad_arguments_give_usage_error_and_do_not_run(shell):
    shell.user_ns.pop("ran", None)
    for line in ("--timeout abc", "--memory-limit lots", "--fix nonsense", "--bogus", "--engine turbo"):
        result, cap = _run(shell, f"%%backward_doctor {line}\nran = True")
        assert "UsageError" in cap.stderr + cap.stdout, line
        assert "ran" not in shell.user_ns, line


def test_timeout_interrupts_and_reports_hang(shell):
    result, cap = _run(shell, "%%backward_doctor --timeout 0.5\nimport time\nfor _ in range(100):\n    time.sleep(0.1)")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    f = bd.last_report().findings[0]
    assert (f.kind, f.line) == ("hang", 3)


def test_memory_limit_simulates_oom(shell):
    _run(shell, SETUP)
    result, cap = _run(shell, "%%backward_doctor --memory-limit 100KB\nbig = model(x.repeat(500, 1))\nbig.sum().backward()")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    f = bd.last_report().findings[0]
    assert (f.kind, f.line, f.module) == ("oom", 1, "model.0")


def test_help_is_available(shell):
    doc = shell.find_cell_magic("backward_doctor").__doc__
    assert "--memory-limit" in doc and "--timeout" in doc and "--fix" in doc


def test_cells_defined_earlier_count_as_user_code(shell):
    _run(shell, "import torch\ndef step(t):\n    return (t / 0).sum()\n")
    _run(shell, "%%backward_doctor\nt = torch.ones(3, requires_grad=True)\nstep(t).backward()")
    f = bd.last_report().findings[0]
    assert f.kind == "nonfinite" and f.line == 3 and f.file.startswith("<ipython-input")


def test_memory_of_a_failed_oom_step_is_released(shell):
    """IPython keeps the last traceback; its frames would keep the forward's activations alive."""
    _run(shell, SETUP)
    _run(shell, "import weakref\nfreed = []\n"
                "class Probe(torch.nn.Module):\n"
                "    def forward(self, t):\n"
                "        h = t * 2\n"
                "        weakref.finalize(h.untyped_storage(), freed.append, True)\n"
                "        return torch.cat([h] * 50)\n"
                "probe = Probe()")
    result, cap = _run(shell, "%%backward_doctor --memory-limit 200KB\nout = probe(x.repeat(200, 1))")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    import gc
    gc.collect()
    assert shell.user_ns["freed"] == [True]


def test_engine_flag_picks_what_records_the_ops(shell):
    from backward_doctor.capture.native_capture import native_available

    _run(shell, "import torch\nlin = torch.nn.Linear(4, 2)\nx = torch.randn(5, 4)")
    step = "\nloss = lin(x).pow(2).mean()\nloss.backward()"
    _run(shell, "%%backward_doctor --engine python" + step)
    assert bd.last_report().trace.engine == "python" and bd.last_report().ok
    _run(shell, "%%backward_doctor" + step)
    assert bd.last_report().trace.engine == ("native" if native_available() else "python")
    _run(shell, "%%backward_doctor --memory-limit 1GB" + step)  # a simulated device: either engine
    assert bd.last_report().trace.engine == ("native" if native_available() else "python")
