"""Another thread trains while the doctor watches a cell (issue 46, items 4-5): the process-wide hooks (optimizer
steps, module forwards) belong to the thread that runs the step. Before, a background thread's optimizer steps went
through the capture's hooks: the accumulation watch raised ``AttributeError: '_step_where'`` into that thread (the
kernel could die), its parameters were registered into the run's ledger (its frees mutated the ledger while the
step read it; its weights were screened while it updated them), the cell's report counted its steps and blamed its
line for stale gradients. Now the other thread runs exactly as without the doctor (its weights bit-identical to a
plain run of as many steps) and the report is the cell's own."""
from __future__ import annotations

import threading
import time
import traceback

import pytest
import torch

import backward_doctor as bd

CELL = "for i in range(50):\n    opt.zero_grad()\n    loss = model(x).pow(2).mean()\n    loss.backward()\n    opt.step()\n"


class Background:
    """A thread training its own model until stopped; what it raised; how many steps it took."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.steps = 0
        self._stop = threading.Event()
        self.model, self.opt, self.x, self.y = self.make()
        self.thread = threading.Thread(target=self._run, daemon=True, name="background-training")

    @staticmethod
    def make():
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3), torch.randn(64, 8, generator=g), \
            torch.randn(64, 1, generator=g)

    @staticmethod
    def step(model, opt, x, y) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.step(self.model, self.opt, self.x, self.y)
                self.steps += 1
        except BaseException:  # noqa: BLE001 - what the doctor raised into this thread is the finding
            self.errors.append(traceback.format_exc())

    def __enter__(self) -> "Background":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(60)

    def check(self) -> None:
        """No error in the thread, and its weights what as many plain steps give."""
        assert not self.errors, self.errors[0]
        assert self.steps > 0
        model, opt, x, y = self.make()
        for _ in range(self.steps):
            self.step(model, opt, x, y)
        for p, q in zip(self.model.parameters(), model.parameters()):
            assert torch.equal(p, q)


def _cell_namespace() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "x": torch.randn(32, 4)}


def test_diagnose_while_another_thread_trains(engine):
    with Background() as bg:
        for _ in range(8):
            report = bd.diagnose(CELL, _cell_namespace(), engine=engine)
            assert report.findings == [] and report.exception is None, report
            assert report.trace.iterations.steps == 50, report.trace.iterations.steps
            assert not any("stopped" in n for n in report.trace.notes), report.trace.notes
    bg.check()


@pytest.mark.ipython
def test_always_on_while_another_thread_trains():
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    with capture_output():
        shell.run_cell("%load_ext backward_doctor", store_history=False)
        shell.run_cell("%backward_doctor on", store_history=False)
    try:
        with Background() as bg:
            for _ in range(6):
                shell.user_ns.update(_cell_namespace())
                with capture_output() as shown:
                    result = shell.run_cell(CELL, store_history=True)
                assert result.success, result.error_in_exec
                assert shown.outputs == [] and "backward_doctor" not in shown.stdout, shown.stdout
                report = bd.last_report()
                assert report.trace.iterations.steps == 50 and report.findings == [], report
        bg.check()
    finally:
        with capture_output():
            shell.run_cell("%backward_doctor off", store_history=False)


@pytest.mark.slow
def test_always_on_in_a_real_kernel_while_a_thread_trains(tmp_path):
    """Item 4 as it was found: a kernel with always on, a background thread training its own model while cells
    train. The thread lives on (it died with the doctor's AttributeError, and the kernel could die), and each
    watched cell shows nothing and counts its own 50 steps."""
    from test_always_on_kernel import _execute, _text

    start = ("import torch, backward_doctor as bd\nfrom test_threads import Background, CELL, _cell_namespace\n"
             "bg = Background().__enter__()\n")
    train = "globals().update(_cell_namespace())\n" + CELL
    cells = _execute(["%load_ext backward_doctor", start, "%backward_doctor on", train, train, train,
                      "print('steps', bd.last_report().trace.iterations.steps)",
                      "bg.__exit__(None, None, None)\nbg.check()\nprint('background ok', bg.steps > 0)"], tmp_path)
    for c in cells[3:6]:
        assert c.outputs == [], c.outputs  # (a watched cell that trains fine shows nothing)
    assert "steps 50" in _text(cells[6]), cells[6].outputs
    assert "background ok True" in _text(cells[7]), cells[7].outputs


def _seen_training(bg: Background) -> None:
    """Until the doctor has seen ``bg``'s thread in torch's code (then it is remembered): the first look can find it
    in its own code between torch's calls, the gap ``elsewhere.py`` says."""
    from backward_doctor.capture.elsewhere import busy_threads

    deadline = time.monotonic() + 30
    while "background-training" not in busy_threads().values() and not bg.errors and time.monotonic() < deadline:
        time.sleep(0.001)


def _with_background(bg: Background) -> dict:
    return {**_cell_namespace(), "bg": bg}


def test_diagnose_with_the_training_thread_in_the_namespace(engine):
    """The crash as a kernel met it (CI, stop 53): the training thread's object is a variable of the notebook
    (``bg = Background()``), so the scan before the step found ``bg.model`` and read its parameters' ``.grad``
    while that thread's backward() wrote them: a segmentation fault within a few cells (plain PyTorch does the
    same, the doctor or not, for a ``p.grad`` read from another thread). Now, while another thread runs PyTorch,
    what the cell does not name is left alone and said; the cell's own model is scanned as before."""
    with Background() as bg:
        _seen_training(bg)
        for _ in range(30):
            report = bd.diagnose(CELL, _with_background(bg), engine=engine)
            assert report.findings == [] and report.exception is None, report
            assert report.trace.iterations.steps == 50, report.trace.iterations.steps
            left = [n for n in report.trace.notes if "left alone" in n]
            assert len(left) == 1 and left[0].startswith("`bg.model` was left alone: another thread "
                                                         "(`background-training`)"), report.trace.notes
            names = {p.name for p in report.trace.params}
            assert any(n.startswith("model.") for n in names) and not any(n.startswith("bg.") for n in names), names
    bg.check()


def test_the_orphan_watch_leaves_the_training_threads_model_alone(engine):
    """The registry's watches are told what is left alone (``WatchContext.left_alone``): the orphan watch, which
    reads the namespace's models at the end of the run, does not read ``bg.model`` (a module its optimizer does
    not hold included) while that thread trains it; with the thread not started, the same module is recorded."""
    idle = Background()  # (not started)
    idle.model[0].extra = torch.nn.Linear(2, 2)  # (trainable, in no optimizer, never run: what the watch records)
    report = bd.diagnose(CELL, _with_background(idle), engine=engine)
    assert [u.module for u in report.trace.unoptimized] == ["bg.model.0.extra"], report.trace.unoptimized
    with Background() as bg:
        bg.model[0].extra = torch.nn.Linear(2, 2)
        _seen_training(bg)
        for _ in range(5):
            report = bd.diagnose(CELL, _with_background(bg), engine=engine)
            assert report.exception is None and report.trace.unoptimized == [], (report.trace.unoptimized,
                                                                                  report.trace.notes)
    del bg.model[0].extra  # (the thread's own weights, checked against as many plain steps)
    bg.check()


def test_with_no_other_thread_running_nothing_is_left_alone():
    """The scan reads the whole namespace as before when no other thread runs PyTorch (a thread that was made but
    not started; one that finished), and what the cell names is always read (``Elsewhere.leaves``)."""
    from backward_doctor.capture.elsewhere import Elsewhere

    bg = Background()  # (not started)
    report = bd.diagnose(CELL, _with_background(bg))
    assert not [n for n in report.trace.notes if "left alone" in n], report.trace.notes
    assert any(p.name.startswith("bg.model.") for p in report.trace.params)
    away = Elsewhere({1: "t"}, frozenset({"bg", "model"}))
    assert away.leaves("bg.model") is None and away.leaves("model") is None and away.leaves("other.m") == "t"


def test_a_snapshot_leaves_the_training_threads_model_alone():
    """A replay's or a fix's rollback copies the namespace's models and puts them back after: another thread's
    model is neither read nor put back (that would rewind its training)."""
    from backward_doctor.capture.elsewhere import elsewhere
    from backward_doctor.run.snapshot import Snapshot, estimate_bytes

    with Background() as bg:
        ns = _with_background(bg)
        away = elsewhere(CELL, ns)
        snap = Snapshot.take(ns, away=away)
        held = {id(t) for t, *_ in snap.tensors}
        assert held == {id(p) for p in ns["model"].parameters()}, len(held)
        assert [type(o).__name__ for o, *_ in snap.optimizers] == ["SGD"]
        assert 0 < estimate_bytes(ns, away=away) <= sum(p.numel() * 4 * 2 for p in ns["model"].parameters())
    bg.check()


def test_a_finished_thread_does_not_hide_the_next_one():
    """Threads seen running PyTorch are remembered by weak reference. One that finished and was collected is
    forgotten, and the next training thread is seen. (Its entry once stayed behind, every later call failed, and
    ``elsewhere()`` left nothing alone for the rest of the process.)"""
    import gc
    import time

    from backward_doctor.capture.elsewhere import busy_threads

    def seen() -> bool:  # (a training thread is in its own code for a moment between torch's calls)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if "background-training" in busy_threads().values():
                return True
            time.sleep(0.001)
        return False

    for _ in range(2):
        with Background() as bg:
            assert seen()
        bg.check()
        del bg
        gc.collect()
        assert "background-training" not in busy_threads().values()
