"""``%backward_doctor on|off|status`` in a real IPython InteractiveShell (the kernel tests are in
``test_always_on_kernel.py``): which cells are watched, what they show, what is left behind."""
from __future__ import annotations

import gc
import re
import signal
import weakref
from unittest import mock

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

import backward_doctor as bd
from backward_doctor.frontends.trains import might_train
from backward_doctor.frontends.always_on import current

import fault_injection as fi

pytestmark = pytest.mark.ipython
ANSI = re.compile(r"\x1b\[[0-9;]*m")

SETUP = """
import torch, torch.nn as nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(16, 4)
"""
TRAIN = """
for i in range(40):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
"""
#: NaN at iteration 30 (unrecorded: 0, 1, 2 and powers of two are), from a division by zero on line 5
NAN_AT_30 = """
steps = 0
for i in range(40):
    opt.zero_grad()
    out = model(x)
    out = out / (i - 30) if i == 30 else out   # <-- root cause
    loss = out.pow(2).mean()
    loss.backward()
    opt.step()
    steps += 1
"""


@pytest.fixture
def shell():
    sh = InteractiveShell.instance()
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    yield sh
    sh.run_cell("%backward_doctor off", store_history=False)


def _run(shell, cell):
    with capture_output() as cap:
        result = shell.run_cell(cell, store_history=True)
    return result, cap


def _on(shell, options=""):
    _run(shell, "%backward_doctor off")
    result, cap = _run(shell, f"%backward_doctor on {options}")
    assert result.success, cap.stderr
    return cap.stdout


def backward_doctor_callbacks(shell):
    """The doctor's own callbacks among IPython's events."""
    return [f for fs in shell.events.callbacks.values() for f in fs
            if "backward_doctor" in getattr(f, "__module__", "") or "AlwaysOn" in repr(f)]


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def test_guess_of_which_cells_train():
    ns: dict = {}
    exec("def inner(m):\n    m(1).backward()\ndef outer(m):\n    for _ in range(2):\n        inner(m)\n"
         "class Exp:\n    def go(self):\n        outer(None)\ne = Exp()\ndef plot():\n    return 1\n", ns)
    assert might_train("loss.backward()", ns) and might_train("trainer.train()", ns)
    assert might_train("trainer.fit(model, loader)", ns) and might_train("opt.step()", ns)
    assert might_train("outer(net)", ns) and might_train("e.go()", ns)  # through the notebook's own code
    assert not might_train("plot()\nprint(df.head())\ny = model(x)", ns)
    assert not might_train("import numpy as np\nnp.mean([1, 2])", ns)  # a library's function is not followed
    # a plain tensor's methods are torch's (decided without a call); a subclass of the user's is followed
    exec("import torch\nclass Mine(torch.Tensor):\n    def total(self):\n        outer(None)\n", ns)
    ns.update(x=torch.zeros(2), w=torch.nn.Parameter(torch.zeros(2)))
    assert not might_train("n = len(x) + w.numel()\nx.sum()", ns) and might_train("x.backward()", ns)
    ns["m"] = torch.zeros(2).as_subclass(ns["Mine"])
    assert might_train("m.total()", ns)
    # the cell's names are kept by its text, its verdict is not: the same text re-run after a redefinition
    exec("def go(v):\n    return v\n", ns)
    assert not might_train("r = go(x)", ns)
    exec("def go(v):\n    v.sum().backward()\n", ns)
    assert might_train("r = go(x)", ns)
    ns["go"] = torch.zeros(1)
    assert not might_train("r = go(x)", ns)


def test_on_off_status_and_bad_arguments(shell):
    _run(shell, "%backward_doctor off")
    assert "off" in _run(shell, "%backward_doctor status")[1].stdout
    out = _on(shell, "--timeout 30 --quiet")
    assert out.startswith("backward_doctor: always on (timeout 30 s from the latest optimizer step, quiet); 0 cells")
    assert "recording with the" in out
    assert current(shell) is not None and "run_cell" in vars(shell)
    for bad in ("--timeout -1", "--memory-limit lots", "--engine turbo", "sideways"):
        result, cap = _run(shell, f"%backward_doctor {bad}")
        assert "UsageError" in cap.stderr + cap.stdout, bad
    assert "timeout 30 s" in _run(shell, "%backward_doctor status")[1].stdout  # the bad ones changed nothing
    assert "always on is off" in _run(shell, "%backward_doctor off")[1].stdout
    assert current(shell) is None and "run_cell" not in vars(shell)


def test_on_while_on_changes_the_options_and_keeps_the_count(shell):
    """``%backward_doctor on --quiet`` while on changes the options; the cells watched so far and the latest
    report stay (issue 47, item 7: it used to say "0 cells watched" again)."""
    _on(shell)
    _run(shell, SETUP)
    _run(shell, TRAIN)
    assert current(shell).watched == 1
    last = current(shell).last
    result, cap = _run(shell, "%backward_doctor on --quiet")
    assert result.success and "quiet); 1 cell watched" in cap.stdout, cap.stdout
    assert current(shell).watched == 1 and current(shell).last is last
    _run(shell, "%backward_doctor off")
    assert "0 cells watched" in _on(shell)  # (off, then on: a new count)


def test_cells_that_train_fine_show_nothing_and_compute_the_same(shell):
    ns_plain: dict = {}
    exec(SETUP, ns_plain)
    exec(TRAIN, ns_plain)
    _on(shell)
    _run(shell, SETUP)
    before = bd.last_report()
    result, cap = _run(shell, TRAIN)
    assert result.success and cap.stdout == "" and cap.outputs == []  # nothing shown
    report = bd.last_report()
    assert report is not before and report.ok and report.trace.iterations.steps == 40  # it was watched
    for a, b in zip(_weights(shell.user_ns["model"]), _weights(ns_plain["model"])):
        assert torch.equal(a, b)                                                       # bit-identical


def test_a_cell_without_autograd_is_not_watched_and_nothing_stays_installed(shell):
    _on(shell)
    _run(shell, SETUP)
    real_backward = torch.autograd.backward
    before = fi.baseline()
    last = bd.last_report()
    result, cap = _run(shell, "with torch.no_grad():\n    y = model(x)\nprint(y.shape)")
    assert result.success and cap.stdout == "torch.Size([16, 1])\n" and cap.outputs == []
    assert bd.last_report() is last                                   # no run was made
    assert torch.autograd.backward is real_backward and fi.baseline() == before
    from backward_doctor.frontends import always_on

    with mock.patch.object(always_on, "_search", wraps=always_on._search) as search:
        for _ in range(3):                                           # no call at all: passed straight on,
            result, cap = _run(shell, "z_ = 3\nz_")                  # and its text searched once
            assert result.success and result.result == 3 and bd.last_report() is last
    assert search.call_count == 1


def test_a_cell_of_data_run_again_skips_the_guess_but_not_the_trigger(shell):
    """A cell with a call whose names are all data (``n_ = len(x)``) is guessed once: run again, its text and its
    names' types decide (the installed wrapper's short path); the backward() trigger is armed all the same, and
    a name rebound to something else sends it back to the guess."""
    _on(shell)
    _run(shell, SETUP + "jobs = {'go': lambda t: t.sum().backward()}\nflag = False\n")
    cell = "n_ = len(x)\nif flag:\n    jobs['go'](x.requires_grad_())\n"
    last = bd.last_report()
    with mock.patch("backward_doctor.frontends.always_on.might_train", wraps=might_train) as guess:
        for _ in range(3):
            result, cap = _run(shell, cell)
            assert result.success and shell.user_ns["n_"] == 16 and cap.stdout == ""
        assert guess.call_count == 1 and bd.last_report() is last
        _run(shell, "flag = True")
        result, cap = _run(shell, cell)  # (a dict's function: the guess cannot see it, the trigger does)
        assert result.success and guess.call_count == 1
        report = bd.last_report()
        assert report is not last and any("began at the cell's first backward() (line 3)" in n
                                           for n in report.trace.notes)
        _run(shell, "flag = False\nclass Box(list):\n    pass\nx = Box(range(5))")
        guessed = guess.call_count
        result, cap = _run(shell, cell)
        assert result.success and shell.user_ns["n_"] == 5 and guess.call_count == guessed + 1


def test_the_trigger_opens_a_watch_only_for_the_running_cell_of_this_thread(shell):
    """Between ``on`` and ``off`` the backward() trigger stays armed and finds the cell itself: a backward()
    outside any cell (a widget's callback), in a silent run or in another thread opens nothing, and each leaves
    it armed for the next cell; a cell's own run of another cell is watched for itself; no event callback is
    left registered after a cell that opened a watch."""
    _on(shell)
    _run(shell, SETUP + "jobs = {'go': lambda t: t.sum().backward()}\n")
    callbacks = list(shell.events.callbacks["post_run_cell"])
    last = bd.last_report()
    model, x = shell.user_ns["model"], shell.user_ns["x"]
    model(x).sum().backward()                                            # no cell running
    result = shell.run_cell("jobs['go'](model(x))", silent=True)        # a silent run
    assert result.success and bd.last_report() is last
    result, cap = _run(shell, "import threading\nt_ = threading.Thread(target=jobs['go'], args=(model(x),))\n"
                              "t_.start(); t_.join()")                  # another thread's backward()
    assert result.success and cap.outputs == [] and bd.last_report() is last
    assert shell.events.callbacks["post_run_cell"] == callbacks
    result, cap = _run(shell, "jobs['go'](model(x))\nraise KeyError('after')")
    assert isinstance(result.error_in_exec, KeyError) and bd.last_report() is not last
    assert cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM") and "KeyError" in cap.stdout
    assert shell.events.callbacks["post_run_cell"] == callbacks and "showtraceback" not in vars(shell)
    last = bd.last_report()
    inner = "jobs['go'](model(x))\nraise IndexError('inner')"
    result, cap = _run(shell, f"r_ = get_ipython().run_cell({inner!r})\nok_ = 1")
    assert result.success and isinstance(shell.user_ns["r_"].error_in_exec, IndexError)
    report = bd.last_report()
    assert report is not last and report.trace.exception is not None and report.trace.exception.type == "IndexError"
    assert shell.events.callbacks["post_run_cell"] == callbacks and "showtraceback" not in vars(shell)


def test_a_watch_opened_under_a_result_ipython_left_behind_ends_with_the_next_cell(shell):
    """IPython's machinery raising inside a cell leaves its result as the one running; a ``backward()`` in a
    widget's callback after that opens a watch for that cell, which has ended already: the next cell's end
    ends it (no traceback held back for good), while a cell a watched cell runs itself does not."""
    _on(shell)
    _run(shell, SETUP)
    callbacks = list(shell.events.callbacks["post_run_cell"])
    left, _ = _run(shell, "1")
    shell.displayhook.exec_result = left                          # (as IPython leaves it when it raised)
    model, x = shell.user_ns["model"], shell.user_ns["x"]
    model(x).sum().backward()                                     # a widget's callback, between cells
    assert "showtraceback" in vars(shell)                         # a watch opened, tracebacks held
    result, cap = _run(shell, "y_ = 2")
    assert result.success and "showtraceback" not in vars(shell)
    assert shell.events.callbacks["post_run_cell"] == callbacks
    result, cap = _run(shell, "raise KeyError('shown')")
    assert "KeyError" in cap.stdout


def test_a_watched_cell_runs_without_the_trigger_and_a_cell_wrapping_backward_keeps_it(shell):
    """While a cell guessed to train runs, the trigger is out of ``torch.autograd.backward`` (the capture wraps
    the real one: no call of the trigger's at each iteration); after a cell that wrapped ``backward`` itself the
    trigger sits over that wrapper (not under it twice), still opens a watch, and ``off`` leaves the cell's."""
    _on(shell)
    _run(shell, SETUP + "jobs = {'go': lambda t: t.sum().backward()}\nseen = []\n")
    trigger = torch.autograd.backward
    real = trigger.__wrapped__
    result, _ = _run(shell, TRAIN + "seen.append(torch.autograd.backward)\n")
    assert result.success and shell.user_ns["seen"][0].__wrapped__ is real and torch.autograd.backward is trigger
    try:
        result, _ = _run(shell, TRAIN + "mine_ = torch.autograd.backward\n"
                                        "torch.autograd.backward = lambda *a, **k: mine_(*a, **k)\n")
        assert result.success and shell.user_ns["mine_"].__wrapped__ is real   # (it wrapped the capture's)
        assert torch.autograd.backward.__wrapped__.__name__ == "<lambda>"      # the trigger, over the cell's
        last = bd.last_report()
        result, cap = _run(shell, "jobs['go'](model(x))\nraise KeyError('after')")
        assert bd.last_report() is not last
        assert cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM")
        _run(shell, "%backward_doctor off")
        assert torch.autograd.backward.__name__ == "<lambda>"
    finally:
        _run(shell, "%backward_doctor off")
        torch.autograd.backward = real


def test_nan_at_iteration_30_is_reported_without_running_the_cell_again(shell):
    _on(shell)
    _run(shell, SETUP)
    result, cap = _run(shell, NAN_AT_30)
    assert result.success                                      # NaN raises nothing: the cell ran to its end
    assert shell.user_ns["steps"] == 40                        # once: the replay ran in a copy of the namespace
    f = bd.last_report().findings[0]
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::div", 5, 30), str(bd.last_report())
    shown = cap.outputs[-1].data["text/plain"]
    assert shown.startswith(f"backward_doctor: PROBLEM - NaN/Inf created here at Cell In[{result.execution_count}], "
                            "line 5, in iteration 30")


def test_a_failing_step_shows_the_report_then_the_users_traceback(shell):
    _on(shell)
    _run(shell, SETUP)
    cell = "out = model(x)\nout = out.relu_()\nout.sigmoid_()\nout.sum().backward()"
    result, cap = _run(shell, cell)
    assert isinstance(result.error_in_exec, RuntimeError)
    text = ANSI.sub("", cap.stdout)
    assert "modified by an inplace operation" in text and "backward_doctor/" not in text
    shown = cap.outputs[-1].data["text/plain"]
    assert shown.startswith("backward_doctor: PROBLEM - Saved tensor modified in place"), shown[:200]
    assert "showtraceback" not in vars(shell)


def test_a_typo_before_any_op_is_left_to_the_traceback(shell):
    _on(shell)
    _run(shell, SETUP)
    result, cap = _run(shell, "loss = modle(x).sum()\nloss.backward()")
    assert isinstance(result.error_in_exec, NameError) and "NameError" in cap.stdout
    assert cap.outputs == []


def test_the_cell_magic_wins(shell):
    _on(shell)
    _run(shell, SETUP)
    result, cap = _run(shell, "%%backward_doctor\n" + TRAIN)
    assert result.success and len(cap.outputs) == 1          # the magic's report, once
    assert cap.outputs[0].data["text/plain"].startswith("backward_doctor: OK")


def test_a_backward_the_guess_missed_opens_the_watch_there(shell):
    _on(shell)
    _run(shell, SETUP + "jobs = {'go': lambda t: t.sum().backward()}\n")
    real_backward = torch.autograd.backward
    last = bd.last_report()
    result, cap = _run(shell, "h = model(x)\njobs['go'](h)\nh.nope")
    assert isinstance(result.error_in_exec, AttributeError)
    report = bd.last_report()
    assert report is not last and report.trace.op_count > 0
    assert any("began at the cell's first backward() (line 2)" in n for n in report.trace.notes)
    assert cap.outputs and cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM")
    assert torch.autograd.backward is real_backward


def test_a_hang_is_no_optimizer_step_for_the_timeout(shell):
    _on(shell, "--timeout 1")
    _run(shell, SETUP)
    # 2.5 s of steady stepping is not a hang (each step comes well within the timeout)...
    result, cap = _run(shell, "import time\nfor i in range(10):\n    time.sleep(0.25)\n    opt.zero_grad()\n"
                              "    model(x).pow(2).mean().backward()\n    opt.step()\n")
    assert result.success and cap.outputs == [], ANSI.sub("", cap.stdout)
    # ...a loop that stops stepping is, and is interrupted
    cell = "import time\nfor i in range(3):\n    model(x).sum().backward()\n    opt.step()\ntime.sleep(60)"
    result, cap = _run(shell, cell)
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    f = bd.last_report().findings[0]
    assert (f.kind, f.line) == ("hang", 5)
    assert "made no progress for 1 s (no optimizer step completed; 3 steps had)" in f.message
    assert cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM - The step hangs")


def test_out_of_memory_under_a_memory_limit(shell):
    _on(shell, "--memory-limit 100KB")
    _run(shell, SETUP)
    result, cap = _run(shell, "big = model(x[:5].repeat(500, 1))\nbig.sum().backward()")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    f = bd.last_report().findings[0]
    assert (f.kind, f.line, f.module) == ("oom", 1, "model.0")
    assert cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM - Out of memory")


def test_ctrl_c_in_a_watched_cell(shell):
    _on(shell)
    _run(shell, SETUP)
    cell = ("import os, signal, threading, time\n"
            "threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "for i in range(100000):\n    model(x).sum().backward()\n    opt.step()\n    time.sleep(0.01)\n")
    # A process started in the background by a shell without job control ignores SIGINT from the start (POSIX):
    # so did a CI run of the whole suite started so, and this loop ran its 100,000 iterations. Python's usual
    # handler, as a terminal (and ipykernel, while a cell runs) has it.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        result, cap = _run(shell, cell)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    report = bd.last_report()
    assert report.findings[0].kind == "hang" and "interrupted by hand" in report.findings[0].message
    assert cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM")


def _tensors_shaped_as(t):
    """Tensors alive (the gc's view) with ``t``'s shape, parameters aside: gradients, copies."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.shape == t.shape)


def test_off_leaves_nothing_behind_and_nothing_of_the_cells_is_kept(shell):
    _run(shell, "%backward_doctor off")
    _run(shell, SETUP)
    _run(shell, TRAIN)  # (gradients exist: the count below compares like with like)
    real_backward, run_cell = torch.autograd.backward, shell.run_cell
    before = fi.baseline()
    alive = _tensors_shaped_as(shell.user_ns["model"][0].weight)
    _on(shell, "--timeout 20")
    _run(shell, "import weakref\nbatch = torch.randn(256, 4)\nprobe = weakref.ref(batch)\n" + NAN_AT_30
         + "del batch")
    assert bd.last_report().findings[0].kind == "nonfinite"  # (iteration 30 replayed from a kept state)
    _run(shell, "model(x).sum().backward()\nraise ValueError('boom')")
    _run(shell, "%backward_doctor off")
    gc.collect()
    assert shell.user_ns["probe"]() is None                      # the cell's tensor is not held
    left = fi.leftovers(before, {"model": shell.user_ns["model"]})
    assert left == [], left
    assert torch.autograd.backward is real_backward and shell.run_cell == run_cell and "run_cell" not in vars(shell)
    assert "showtraceback" not in vars(shell) and backward_doctor_callbacks(shell) == []
    # the weights kept to replay iteration 30 were released: no copy of them is alive
    assert _tensors_shaped_as(shell.user_ns["model"][0].weight) <= alive


def test_a_silent_finding_gets_one_quiet_line(shell):
    _on(shell)
    _run(shell, SETUP)
    leaky = "keep = []\nfor i in range(20):\n    opt.zero_grad()\n    l = model(x).sum()\n    keep.append(l)\n" \
            "    l.backward()\n    opt.step()\n"
    result, cap = _run(shell, leaky)
    assert result.success and cap.outputs == []
    assert cap.stdout.startswith("backward_doctor: Graphs of earlier iterations kept alive at "
                                 f"Cell In[{result.execution_count}], line 5"), cap.stdout
    assert cap.stdout.count("\n") == 1
    _on(shell, "--quiet")
    result, cap = _run(shell, leaky)
    assert result.success and cap.stdout == "" and bd.last_report().findings[0].kind == "graph_leak"


ONE_STEP = "opt.zero_grad()\nloss = model(x).pow(2).mean()\nloss.backward()\nopt.step()\n"


def test_a_single_step_runs_asleep_within_the_budget_and_computes_the_same(shell):
    ns_plain: dict = {}
    exec(SETUP, ns_plain)
    exec(ONE_STEP, ns_plain)
    _on(shell)
    _run(shell, SETUP)
    result, cap = _run(shell, ONE_STEP)
    assert result.success and cap.stdout == "" and cap.outputs == []
    report = bd.last_report()
    if report.trace.engine != "native":
        pytest.skip("the cost budget is the native recorder's (the Python tier records every op)")
    # nothing recorded op by op, and the report says what did not run
    assert report.trace.op_count == 0 and report.trace.iterations.steps == 1 and report.ok
    assert any(n.startswith("always on recorded nothing op by op (the step ran with the recorder asleep")
               for n in report.trace.notes), report.trace.notes
    assert str(report).startswith("backward_doctor: OK - the step ran and nothing went wrong (watched, not recorded "
                                  "op by op: the silent checks did not run)"), str(report)[:200]
    html = report.to_html()
    assert "the ops ran with the recorder asleep" in html and "no op ran" not in html
    for a, b in zip(_weights(shell.user_ns["model"]), _weights(ns_plain["model"])):
        assert torch.equal(a, b)


def test_a_step_that_fails_asleep_is_replayed_whole_in_a_copy_of_the_names(shell):
    _on(shell)
    _run(shell, SETUP + "runs = []\n")
    cell = "runs.append(1)\nn_runs = len(runs)\nout = model(x)\nout = out.relu_()\nout.sigmoid_()\nout.sum().backward()"
    result, cap = _run(shell, cell)
    assert isinstance(result.error_in_exec, RuntimeError)
    report = bd.last_report()
    assert report.findings[0].kind == "inplace" and report.findings[0].line == 5
    assert cap.outputs[-1].data["text/plain"].startswith("backward_doctor: PROBLEM - Saved tensor modified in place")
    if report.trace.engine == "native":
        assert any("the cell was run again from the state saved when it raised" in n for n in report.trace.notes)
    # the replay ran in a copy of the notebook's names: the name it assigns is the user's run's (a list it
    # appends to is the one thing that shows the second run, as the note says)
    assert shell.user_ns["n_runs"] == 1


def test_gradients_stepped_again_in_a_later_cell_get_the_quiet_line(shell):
    _on(shell)
    _run(shell, SETUP)
    cell = "loss = model(x).pow(2).mean()\nloss.backward()\nopt.step()\n"   # no zero_grad()
    result, cap = _run(shell, cell)
    assert result.success and cap.stdout == ""
    result, cap = _run(shell, cell)
    assert result.success and cap.outputs == []
    assert cap.stdout.startswith(f"backward_doctor: Gradients were never zeroed at Cell In[{result.execution_count}], "
                                 "line 3"), cap.stdout
    assert [f.kind for f in bd.last_report().findings] == ["stale_grad"]
    _run(shell, "opt.zero_grad()")
    result, cap = _run(shell, "opt.zero_grad()\n" + cell)   # zeroed first: nothing stale
    assert result.success and cap.stdout == "", cap.stdout


def test_a_long_cheap_loop_records_some_iterations_within_the_budget(shell):
    _on(shell)
    _run(shell, SETUP)
    result, cap = _run(shell, TRAIN.replace("range(40)", "range(300)"))
    assert result.success and cap.stdout == ""
    its = bd.last_report().trace.iterations
    if bd.last_report().trace.engine != "native":
        pytest.skip("the cost budget is the native recorder's")
    assert its.steps == 300 and its.recorded and 0 not in its.recorded
    assert set(its.recorded) <= {1, 2, 4, 8, 16, 32, 64, 128, 256}, its.recorded


HOOKS_SEEN = """
from torch.nn.modules import module as _m
hooks = []
for i in range(300):
    hooks.append((len(_m._global_forward_hooks), len(model[0].weight._post_accumulate_grad_hooks or {})))
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
"""


def test_asleep_from_the_start_no_hook_is_installed_until_an_iteration_is_recorded(shell):
    """Always on's first iteration is not recorded: the module and parameter hooks are not installed while the
    namespace is scanned only to come off at the first op; a recorded iteration has them, and its ops are named
    by module."""
    _on(shell)
    _run(shell, SETUP)
    result, cap = _run(shell, HOOKS_SEEN)
    assert result.success, cap.stderr
    report = bd.last_report()
    if report.trace.engine != "native":
        pytest.skip("the cost budget is the native recorder's")
    hooks, recorded = shell.user_ns["hooks"], report.trace.iterations.recorded
    assert hooks[0] == (0, 0) and recorded and 0 not in recorded
    # an iteration's first line runs after the previous step decided whether it is recorded
    assert all(hooks[k] == (1, 1) for k in recorded if k < 300), (recorded, [hooks[k] for k in recorded])
    assert all(hooks[k] == (0, 0) for k in range(300) if k not in recorded)
    assert {op.where.module for op in report.trace.ops if op.phase == "forward"} >= {"model.0", "model.2"}
    assert not torch.nn.modules.module._global_forward_hooks
    # a single step, never recorded: not one hook was made (not even to be taken off again)
    made, register = [], torch.Tensor.register_post_accumulate_grad_hook

    def counted(self, hook):
        made.append(hook)
        return register(self, hook)

    with mock.patch.object(torch.Tensor, "register_post_accumulate_grad_hook", counted):
        result, cap = _run(shell, "opt.zero_grad()\nloss = model(x).pow(2).mean()\nloss.backward()\nopt.step()\n")
    assert result.success and bd.last_report().trace.op_count == 0 and made == []


def test_a_step_that_takes_its_batch_from_an_iterator_is_not_run_again(shell):
    _on(shell)
    _run(shell, SETUP + "it = iter([x, x * float('nan'), x])\n")
    cell = "xb = next(it)\nxb = next(it)\nloss = model(xb).pow(2).mean()\nloss.backward()\nopt.step()"
    result, cap = _run(shell, cell)
    assert result.success
    report = bd.last_report()
    assert report.trace.iterations.first_nonfinite == 0 and cap.outputs  # NaN/Inf: the report is shown
    # the replay would have taken the iterator's next item: not run again, and the report says why
    assert torch.equal(next(shell.user_ns["it"]), shell.user_ns["x"])
    if report.trace.engine == "native":
        assert any("take the next item of an iterator it reads" in n for n in report.trace.notes), report.trace.notes


@pytest.fixture
def scalars_only(monkeypatch):
    """CUDA's first tier, on the CPU: the Python recorder screens only the scalars a forward makes (a screen of
    every op would synchronise the device after each)."""
    from backward_doctor.run import step

    monkeypatch.setattr(step, "screens_every_op", lambda: False)


def test_nan_in_a_loop_screened_only_at_scalars_is_replayed_at_its_iteration(shell, scalars_only):
    plain: dict = {}
    exec(SETUP + NAN_AT_30, plain)
    _on(shell, "--engine python")
    _run(shell, SETUP)
    result, cap = _run(shell, NAN_AT_30)
    assert result.success and shell.user_ns["steps"] == 40     # the cell ran once; the replay ran in a copy
    report = bd.last_report()
    f = report.findings[0]
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::div", 5, 30), str(report)
    assert report.trace.engine == "python" and report.trace.iterations.replayed == 30
    assert any("NaN/Inf first appeared in iteration 30, which ran with its ops screened for NaN/Inf only where "
               "they made a scalar" in n and "that iteration alone was replayed" in n for n in report.trace.notes)
    for a, b in zip(_weights(shell.user_ns["model"]), _weights(plain["model"])):   # as the plain run left them
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_a_single_step_screened_only_at_scalars_is_replayed_whole(shell, scalars_only):
    _on(shell, "--engine python")
    _run(shell, SETUP + "runs = []\n")
    cell = ("runs.append(1)\nn_runs = len(runs)\nopt.zero_grad()\nout = model(x).log()\nloss = out.mean()\n"
            "loss.backward()\nopt.step()\n")
    result, cap = _run(shell, cell)
    assert result.success and shell.user_ns["n_runs"] == 1
    report = bd.last_report()
    f = report.findings[0]
    assert (f.kind, f.op, f.line) == ("nonfinite", "aten::log", 4), str(report)
    assert any("the cell was run again from the state saved when NaN/Inf first showed" in n
               for n in report.trace.notes), report.trace.notes


def test_a_clean_loop_screened_only_at_scalars_keeps_no_state(shell, scalars_only):
    """No copy of the model before the cell (always on would hold it for every cell): none is taken unless NaN
    shows."""
    from backward_doctor.run import snapshot

    taken = []
    real = snapshot.take_if_it_fits

    def spy(*a, **k):
        taken.append(1)
        return real(*a, **k)

    _on(shell, "--engine python")
    _run(shell, SETUP)
    with mock.patch.object(snapshot, "take_if_it_fits", spy), \
            mock.patch("backward_doctor.run.iteration_replay.take_if_it_fits", spy):
        result, _ = _run(shell, TRAIN)
    assert result.success and bd.last_report().ok and taken == []


@pytest.fixture
def python_sampled(monkeypatch, scalars_only):
    """Always on as it runs once the process uses CUDA, on the CPU: the Python recorder samples the loop within
    the cost budget (asleep: its dispatch mode off the stack) and screens only scalars when awake."""
    from backward_doctor.capture import python_sampling

    monkeypatch.setattr(python_sampling, "samples_here", lambda: True)
    monkeypatch.setattr(python_sampling, "trains_on_cuda", lambda params: True)


def test_a_cpu_loop_in_a_process_that_uses_cuda_is_recorded_in_full(shell, monkeypatch, scalars_only):
    """Asleep, the Python tier could not count a CPU loop's memory (the CUDA allocator's count is not its): a
    step whose parameters are on the CPU is recorded every iteration, as before."""
    from backward_doctor.capture import python_sampling

    monkeypatch.setattr(python_sampling, "samples_here", lambda: True)
    _on(shell, "--engine python")
    _run(shell, SETUP)
    result, _ = _run(shell, TRAIN)
    its = bd.last_report().trace.iterations
    assert result.success and its.recorded == list(range(41)) and its.live_kind == "ledger", its.recorded


def test_the_python_recorder_sleeps_through_a_long_loop_and_leaves_nothing_on(shell, python_sampled):
    cell = TRAIN.replace("range(40)", "range(300)")
    plain: dict = {}
    exec(SETUP + cell, plain)
    _on(shell, "--engine python")
    _run(shell, SETUP)
    before = fi.baseline()
    result, cap = _run(shell, cell)
    assert result.success and cap.outputs == []
    report = bd.last_report()
    its = report.trace.iterations
    assert report.ok and report.trace.engine == "python" and its.steps == 300
    assert 0 < len(its.recorded) < 10 and report.trace.op_count < 10 * 42, its.recorded   # (42 ops an iteration)
    assert any("iterations were recorded op by op" in n for n in report.trace.notes)
    for a, b in zip(_weights(shell.user_ns["model"]), _weights(plain["model"])):
        assert torch.equal(a, b)
    assert fi.leftovers(before, shell.user_ns) == []
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    assert not is_in_torch_dispatch_mode()      # (torch's flags put back as its modes leave: compile stays compiled)


def test_nan_in_an_iteration_the_python_recorder_slept_through_is_replayed(shell, python_sampled):
    _on(shell, "--engine python")
    _run(shell, SETUP)
    result, _ = _run(shell, NAN_AT_30)
    assert result.success and shell.user_ns["steps"] == 40
    report = bd.last_report()
    f = report.findings[0]
    assert (f.kind, f.op, f.line, f.iteration) == ("nonfinite", "aten::div", 5, 30), str(report)
    assert 30 not in report.trace.iterations.recorded and report.trace.iterations.replayed == 30
    assert any("NaN/Inf first appeared in iteration 30, which ran with the recorder off" in n
               for n in report.trace.notes), report.trace.notes


def test_a_step_that_raises_asleep_on_the_python_recorder_is_replayed_whole(shell, python_sampled):
    _on(shell, "--engine python")
    _run(shell, SETUP + "runs = []\n")
    cell = "runs.append(1)\nn_runs = len(runs)\nout = model(x)\nout = out.relu_()\nout.sigmoid_()\nout.sum().backward()"
    result, cap = _run(shell, cell)
    assert isinstance(result.error_in_exec, RuntimeError) and shell.user_ns["n_runs"] == 1
    report = bd.last_report()
    assert (report.findings[0].kind, report.findings[0].line) == ("inplace", 5), str(report)
    assert any("the cell was run again from the state saved when it raised" in n for n in report.trace.notes)


def test_a_mode_the_cell_enters_while_the_python_recorder_sleeps_keeps_it_asleep(shell, python_sampled):
    """Woken above the cell's own mode, the doctor's would be popped by that mode's exit: it stays asleep."""
    _on(shell, "--engine python")
    _run(shell, SETUP + """
from torch.utils._python_dispatch import TorchDispatchMode
class Counting(TorchDispatchMode):
    n = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Counting.n += 1
        return func(*args, **(kwargs or {}))
""")
    before = fi.baseline()
    cell = TRAIN.replace("range(40)", "range(64)").replace(
        "    opt.zero_grad()\n", "    opt.zero_grad()\n    m = Counting().__enter__() if i == 3 else None\n")
    result, cap = _run(shell, cell + "m3 = Counting.n\n")
    assert result.success, cap.stderr
    assert torch._C._len_torch_dispatch_stack() == 1                     # the cell's own mode, still on
    torch._C._get_dispatch_stack_at(0).__exit__(None, None, None)
    assert fi.leftovers(before, shell.user_ns) == []
    report = bd.last_report()
    assert report.trace.iterations.recorded == [] or max(report.trace.iterations.recorded) <= 3, \
        report.trace.iterations.recorded
    assert shell.user_ns["m3"] > 0


def test_out_of_memory_in_an_iteration_slept_through_is_placed_in_it(shell, python_sampled):
    """(Seen on an H200: "in iteration 0", the op count of the sleeping recorder taken for the op that ran out.)
    The allocator's error is raised by hand here, with CUDA's wording."""
    _on(shell, "--engine python")
    _run(shell, SETUP)
    cell = TRAIN.replace("    loss.backward()\n", "    if i == 12:\n        raise torch.OutOfMemoryError("
                         "'CUDA out of memory. Tried to allocate 256.00 GiB. GPU 0 has a total capacity "
                         "of 139.80 GiB')\n"
                         "    loss.backward()\n")
    result, _ = _run(shell, cell)
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    f = bd.last_report().findings[0]
    assert (f.kind, f.iteration, f.evidence["loop_value"]) == ("oom", 12, "i = 12"), str(bd.last_report())
    assert f.evidence["requested"] == 256 << 30


def test_a_device_side_assert_while_the_python_recorder_slept_says_how_to_find_the_index(shell, python_sampled):
    """Asleep, ops are not pre-checked: the device-side assert a CUDA kernel raises then (simulated here by its
    message) gets a note saying what to run once the kernel is restarted."""
    _on(shell, "--engine python")
    _run(shell, SETUP)
    cell = TRAIN.replace("    loss.backward()\n", "    if i == 20:\n        raise RuntimeError("
                         "'CUDA error: device-side assert triggered')\n    loss.backward()\n")
    result, _ = _run(shell, cell)
    assert isinstance(result.error_in_exec, RuntimeError)
    notes = bd.last_report().trace.notes
    assert any("run the cell under `%%backward_doctor`, which checks the indices of every op" in n for n in notes)


def test_out_of_memory_offers_only_the_fixes_that_apply_to_the_cell(shell):
    """Always on shows the panel (or the report) with a fix button only where the fix can be applied (issue 45):
    checkpointing cannot lower this peak, so it is advice text with the reason, not a button that refuses."""
    _on(shell, "--memory-limit 100KB")
    _run(shell, SETUP)
    result, cap = _run(shell, "big = model(x[:5].repeat(500, 1))\nbig.sum().backward()")
    report = bd.last_report()
    assert report.fix_offers is not None and report.fix_offers["accumulate"] == report.fix_offers["amp"] == ""
    assert report.fix_offers["checkpoint"].startswith("checkpointing would not lower the peak")
    text = cap.outputs[-1].data["text/plain"]
    assert "fixes: accumulate, amp  (" in text and "not offered for this cell: checkpoint - checkpointing" in text
