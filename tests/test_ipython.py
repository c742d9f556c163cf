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
    # (the instance is shared by every IPython-tier module: start from an empty namespace, so that the
    # tensors an earlier module left do not count against a simulated memory limit here)
    sh.reset(new_session=False)
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


# --------------------------------------------------------------------------- issue 16: the notebook as a newcomer meets it
import re
import threading

ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOOP = """
import time
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for i in range(8):
    time.sleep(0.25)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
"""
MLP = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), nn.Linear(8, 1))
x = torch.randn(5, 4)
"""


@pytest.fixture
def kernel_like(shell, monkeypatch):
    """The shell as the magic sees it in Jupyter (``shell.kernel`` set): placeholder, progress, panel."""
    monkeypatch.setattr(shell, "kernel", object(), raising=False)
    return shell


def test_placeholder_shows_progress_then_gives_way_to_the_panel(kernel_like):
    shell = kernel_like
    _run(shell, MLP)
    result, cap = _run(shell, "%%backward_doctor" + LOOP)
    first, *updates, panel = cap.outputs
    display_id = first.transient["display_id"]
    # Displayed before the cell ran, so in a notebook a report can take the place above a traceback
    assert first.data["text/plain"] == "backward_doctor: running…" and not first.update
    assert all(o.update and o.transient["display_id"] == display_id for o in updates), updates
    lines = [o.data["text/plain"] for o in updates[:-1]]
    assert len(lines) >= 2 and all(ln.startswith("backward_doctor: running… ") for ln in lines), lines
    assert any(re.search(r"\d+\.\d s, \d+ iterations?", ln) for ln in lines), lines  # seconds and iterations
    # The cell did not raise: the placeholder is emptied and the panel follows what the cell printed
    # (issue 47 item 7; a real kernel and the browser: test_magic_kernel.py, test_browser_layout.py)
    assert updates[-1].data == {"text/plain": ""}
    assert not panel.update and not panel.transient.get("display_id")
    assert "application/vnd.jupyter.widget-view+json" in panel.data
    assert panel.data["text/plain"].startswith("backward_doctor: OK")
    assert not [t for t in threading.enumerate() if t.name == "backward_doctor-progress"]  # the poller stopped


def test_ctrl_c_stops_the_cell_and_the_report_so_far_still_shows(kernel_like):
    shell = kernel_like
    _run(shell, MLP)
    cell = ("%%backward_doctor\nimport os, signal, threading, time\n"
            "threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGINT)).start()  # a Ctrl-C, as the kernel sends it\n"
            "loss = model(x).sum()\nloss.backward()\nfor _ in range(300):\n    time.sleep(0.1)\n")
    t0 = __import__("time").perf_counter()
    result, cap = _run(shell, cell)
    assert __import__("time").perf_counter() - t0 < 20
    assert isinstance(result.error_in_exec, KeyboardInterrupt)  # the cell stopped, and is marked failed
    assert "KeyboardInterrupt" in ANSI.sub("", cap.stdout)    # with the user's traceback
    assert cap.outputs[-1].update and cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM")
    assert bd.last_report().trace.exception.type == "KeyboardInterrupt" and bd.last_report().trace.op_count > 0
    text = str(bd.last_report())  # without --timeout: the interrupt's traceback is the main thread's stack
    assert "unknown code" not in text and "MainThread (main):" in text and "in <module>: time.sleep(0.1)" in text
    assert not [t for t in threading.enumerate() if t.name == "backward_doctor-progress"]
    assert "showtraceback" not in vars(shell)                    # the shell's own method is back


def test_the_doctors_frames_are_hidden_from_the_traceback_but_not_from_the_exception(shell):
    _run(shell, SETUP)
    result, cap = _run(shell, "%%backward_doctor --engine python --memory-limit 100KB\n"
                              "big = model(x.repeat(500, 1))\nbig.sum().backward()")
    shown = ANSI.sub("", cap.stdout)
    assert "OutOfMemoryError" in shown and "Linear.forward" in shown  # the user's and torch's frames stay
    assert "backward_doctor" not in shown.split("OutOfMemoryError: ")[0].replace("backward_doctor memory_limit", "")
    assert "_raise_simulated_oom" not in shown
    tb, names = result.error_in_exec.__traceback__, []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "_raise_simulated_oom" in names                            # the exception itself is untouched
    assert "showtraceback" not in vars(shell)


def test_places_are_named_as_ipython_names_them(shell):
    _run(shell, "import torch, torch.nn as nn\n"
                "class Block(nn.Module):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.lin = nn.Linear(4, 4)\n"
                "    def forward(self, t):\n"
                "        return torch.log(self.lin(t) - 100)\n"
                "net = nn.Sequential(Block())\nx = torch.randn(3, 4)")
    defined = shell.execution_count - 1
    result, cap = _run(shell, "%%backward_doctor\nloss = net(x).sum()\nloss.backward()")
    report = bd.last_report()
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.file is not None                  # the raw file is kept...
    assert f.place == f"Cell In[{defined}]" and f.function == "Block.forward"
    assert f.location().startswith(f"Cell In[{defined}], line 7, in Block.forward")
    assert report.places[""] == f"Cell In[{result.execution_count}]"  # the cell's own number, not the next one
    text = cap.outputs[-1].data["text/plain"]
    assert f"Cell In[{defined}], line 7, in Block.forward" in text.splitlines()[0]
    assert f"Cell In[{defined}], line 7" in cap.outputs[-1].data["text/html"]
    again = bd.Report.from_dict(report.to_dict())                         # ...and the names travel in the JSON
    assert again.findings[0].location() == f.location() and again.findings[0].file == f.file


def test_the_traceback_numbers_the_cell_as_its_prompt(shell):
    _run(shell, MLP)
    result, cap = _run(shell, "%%backward_doctor\ny = model(x)\nz = y.view(2, 3)")
    shown = ANSI.sub("", cap.stdout)
    assert f"Cell In[{result.execution_count}], line 2" in shown, shown[-800:]
    assert f"Cell In[{result.execution_count + 1}]" not in shown


def test_load_ext_says_the_native_recorder_builds_in_the_background(monkeypatch, tmp_path):
    """The line states the build time measured on this machine (the last build), else the usual range."""
    from backward_doctor import native
    from backward_doctor.frontends import magic

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "needs_build", lambda: True)
    monkeypatch.setattr(native, "missing_tool", lambda: None)
    monkeypatch.setattr(native, "_reason", None)
    line = magic.first_use_line()
    assert "native recorder in the background (once per torch version; usually 1-2 minutes, up to 6" in line
    assert "records every iteration of a loop" in line and "footer" in line
    native._write_stamp(93.6)                                  # what a build here leaves behind
    assert "(once per torch version; the last build on this machine took 94 s)" in magic.first_use_line()
    monkeypatch.setattr(native, "needs_build", lambda: False)
    assert magic.first_use_line() == ""


def test_the_report_footer_says_which_recorder_ran(shell):
    _run(shell, MLP)
    _run(shell, "%%backward_doctor --engine python\nmodel(x).sum().backward()")
    assert "ops recorded by the Python recorder" in str(bd.last_report())
    assert "ops recorded by the Python recorder" in bd.last_report().to_html()


def test_a_broken_compiler_banner_stays_out_of_the_notebook(monkeypatch, capfd, tmp_path):
    """The background build runs in a child process whose output is kept: torch's "!! WARNING !!" banner
    never reaches the cell's output, and the reason is what the first-use line and the footer say."""
    import subprocess as sp

    from backward_doctor import native
    from backward_doctor.frontends import magic

    banner = ("\n!! WARNING !!\n\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\nYour compiler (c++) is not compatible...\n"
              "RuntimeError: Error building extension 'backward_doctor_native'")
    ran = []
    monkeypatch.setattr(native, "cached", lambda: False)
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_thread", None)
    monkeypatch.setattr(sp, "run", lambda cmd, **kw: ran.append(cmd) or sp.CompletedProcess(cmd, 1, "", banner))
    native.build_in_background().join(60)
    out = capfd.readouterr()
    assert ran and "WARNING" not in out.out + out.err                 # nothing printed
    assert native.status()["reason"] == "RuntimeError: Error building extension 'backward_doctor_native'"
    assert "could not be built: RuntimeError: Error building extension" in magic.first_use_line()


def test_quiet_leaves_nothing_where_the_placeholder_was(kernel_like):
    shell = kernel_like
    _run(shell, MLP)
    result, cap = _run(shell, "%%backward_doctor --quiet\nmodel(x).sum().backward()")
    assert bd.last_report().ok
    assert cap.outputs[0].data["text/plain"] == "backward_doctor: running…"
    assert cap.outputs[-1].update and cap.outputs[-1].data == {"text/plain": ""}


def test_a_front_end_that_cannot_show_the_placeholder_still_gets_the_report():
    from backward_doctor.frontends.running import RunningNotice

    shown = []

    def display(obj, display_id=None):
        if display_id:
            raise RuntimeError("no display ids here")
        shown.append(obj)

    with RunningNotice(display, read=lambda: None, interval=0.01) as notice:
        ran = True                                   # the cell runs all the same
    notice.replace("the report")
    assert ran and shown == ["the report"]
    assert not [t for t in threading.enumerate() if t.name == "backward_doctor-progress"]


def test_no_temporary_file_name_reaches_the_screen(shell, monkeypatch):
    """In a kernel IPython compiles each cell as a temporary file (``/tmp/ipykernel_1/2266957156.py``); every
    place a person reads (the verdict, the root-cause box, the memory plot's peak label, the text report)
    names it as tracebacks do, ``Cell In[2]``; the raw file stays in ``finding.file`` and the JSON."""
    from ipykernel.compiler import XCachingCompiler

    monkeypatch.setattr(shell, "compile", XCachingCompiler())
    _run(shell, "import torch, torch.nn as nn, torch.nn.functional as F\n"
                "class Net(nn.Module):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256))\n"
                "    def forward(self, x):\n"
                "        h = self.body(x)\n"
                "        return torch.cat([h, h * 2], 0)\n"
                "net = Net()\nxb = torch.randn(1024, 64)")
    defined = shell.execution_count - 1
    result, cap = _run(shell, "%%backward_doctor --memory-limit 3MB\nout = net(xb)\nout.sum().backward()")
    report = bd.last_report()
    f = report.findings[0]
    assert f.kind == "oom" and "ipykernel_" in f.file                   # the raw file is kept in the finding
    assert report.trace.memory.peak_index is not None
    shown = [cap.outputs[-1].data["text/plain"], cap.outputs[-1].data["text/html"], report.to_html(), str(report)]
    for text in shown:
        assert "ipykernel_" not in text and f.file.rsplit("/", 1)[-1] not in text, text[:300]
    html = report.to_html()
    assert f"root cause: Cell In[{defined}], line 8" in html
    assert f"aten::relu · Cell In[{defined}], line 7 · net.body.1" in html    # the memory plot's peak label
    assert f"(Cell In[{defined}], line 7)" in str(report).splitlines()[1]     # the text summary's peak
    # A peak in backward: the op's forward line, said the same way by the summary line and the plot.
    _run(shell, "small = torch.randn(8, 64)")
    _run(shell, "%%backward_doctor\nout = net(small)\nout.pow(2).sum().backward()")
    report = bd.last_report()
    peak = report.trace.op(report.trace.memory.peak_index)
    if peak.phase == "backward":
        assert "(backward of Cell In[" in str(report).splitlines()[1]
    for text in (str(report), report.to_html()):
        assert "ipykernel_" not in text


def test_a_dataloader_hang_names_no_thread_of_the_kernel_or_the_doctor(kernel_like):
    """A loop stuck on its DataLoader workers, in Jupyter (the progress poller runs): the message and the
    stacks name the threads that matter, never the doctor's poller or multiprocessing's queue feeders."""
    shell = kernel_like
    _run(shell, "import time, torch\nfrom torch.utils.data import DataLoader, Dataset\n"
                "class Slow(Dataset):\n    def __len__(self): return 64\n"
                "    def __getitem__(self, i):\n        time.sleep(60)\n        return torch.randn(4)\n")
    defined = shell.execution_count - 1
    result, cap = _run(shell, "%%backward_doctor --timeout 3\nfor xb in DataLoader(Slow(), batch_size=8, "
                              "num_workers=2):\n    xb.sum()")
    report = bd.last_report()
    f = report.findings[0]
    # The workers are what is stuck: named at the line of the Dataset they are in, with their stacks
    # (the main process only waits for their batch).
    assert (f.kind, f.line, f.function, f.place) == ("dataloader_worker", 6, "Slow.__getitem__", f"Cell In[{defined}]")
    assert "QueueFeederThread" not in f.message and "backward_doctor" not in f.message
    text = str(report)
    assert "backward_doctor-progress" not in text and "QueueFeederThread" not in text
    assert f"Cell In[{defined}], line 6 in Slow.__getitem__: time.sleep(60)" in text
    assert "profiler::" not in f.message
