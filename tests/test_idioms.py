"""Compatibility tier of training idioms: correct training code, written as real scripts write it, stays correct.

Every idiom of ``tests/idioms.py`` (every optimizer of ``torch.optim``, schedulers, ``GradScaler``s, autocast,
SWA and EMA, ``torch.func``, tied weights, parametrizations, a GAN, eval blocks, the ways to zero gradients,
accumulation, nanoGPT's ``train.py`` loop, pytorch/examples' mnist, a ``transformers.Trainer``, Lightning and
Accelerate) runs plainly, then under each entry point of the doctor, on both engines, each time in a fresh
namespace from the same seed:

- ``diagnose(cell, ns, engine=...)``;
- ``%%backward_doctor --engine ...`` in a real IPython ``InteractiveShell`` (one per module);
- ``%backward_doctor on --engine ...`` (always on), the cell run as it is;
- ``python -m backward_doctor run --engine ... tests/idioms_script.py`` (one process per engine runs every
  idiom, one after the other; a plain ``python tests/idioms_script.py`` is the reference);
- the library callbacks (``DoctorCallback``, ``DoctorLightningCallback``) where a library runs the loop.

Each must let the cell complete (no exception escapes into the user's code), report nothing (no finding at
all), and leave every parameter, gradient, buffer, optimizer ``state_dict()`` tensor and hyperparameter,
scheduler, ``GradScaler``, averaged model, logged loss and the RNG bit-identical to the plain run (dtype and
shape included: ``idioms.state_of``). A failing test says everything that went wrong at once.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

import backward_doctor as bd

import idioms
from idioms import IDIOMS

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve().parent / "idioms_script.py"
TIMEOUT = 60                       # seconds: the doctor's own hang limit, for every entry point
NAMES = list(IDIOMS)
CALLBACK_NAMES = [n for n, it in IDIOMS.items() if it.library in ("hf", "lightning")]


# ----------------------------------------------------------------------------- the plain run, once per idiom
_PLAIN: dict[str, tuple[list[str], dict[str, Any], str]] = {}


def plain(name: str) -> tuple[list[str], dict[str, Any], str]:
    """The names the plain run's namespace holds, its state (``idioms.state_of``) and what it printed."""
    if name not in _PLAIN:
        ns = idioms.build(name)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(IDIOMS[name].cell, f"<idiom {name}>", "exec"), ns)
        names = sorted(k for k in ns if not k.startswith("_"))
        _PLAIN[name] = (names, idioms.state_of(ns, names), out.getvalue())
    return _PLAIN[name]


def comparable(printed: str) -> str:
    """What a cell printed, less what differs from run to run by nature: the Trainer's timings, IPython's ``Out[]``."""
    return "\n".join(line for line in printed.splitlines()
                     if "train_runtime" not in line and not re.match(r"Out\[\d+\]:", line))


def _findings(findings) -> list[str]:
    return [f"finding {f.kind} ({f.severity}): {f.title} at {os.path.basename(f.file or '?')}:{f.line}"
            for f in findings]


def _own_errors(notes: list[str]) -> list[str]:
    """The doctor's own errors that a guard kept out of the cell (``capture/guard.py``): a watch that stopped."""
    return [f"the doctor's own error (note): {n[:400]}" for n in notes if "the doctor's own error" in n]


def _report_problems(report, engine: str) -> list[str]:
    problems = []
    if report.exception is not None:
        problems.append(f"report.exception: {report.exception}")
    if report.trace.engine != engine:
        problems.append(f"engine: {report.trace.engine}")
    return problems + _findings(report.findings) + _own_errors(report.trace.notes)


def _doctor_frames(exc: BaseException) -> str:
    """Where in backward_doctor an exception was raised (its innermost frames there), or its last frame."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if f"{os.sep}backward_doctor{os.sep}" in f.filename]
    shown = mine[-3:] or frames[-1:]
    return " <- ".join(f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} in {f.name}" for f in reversed(shown))


def _check(name: str, problems: list[str], ns: dict[str, Any]) -> None:
    names, reference, _ = plain(name)
    problems += [f"state: {d}" for d in idioms.differences(reference, idioms.state_of(ns, names))]
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


def test_every_idiom_trains_plainly_and_the_same_twice():
    """The tier's own check: each plain run changes the weights, and two plain runs are bit-identical."""
    for name in NAMES:
        names, first, _ = plain(name)
        ns = idioms.build(name)
        start = idioms.state_of(ns, names)
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(IDIOMS[name].cell, f"<idiom {name}>", "exec"), ns)
        assert idioms.differences(first, idioms.state_of(ns, names)) == [], name
        moved = [k for k, v in first.items() if isinstance(v, tuple) and isinstance(start.get(k), tuple)
                 and ".weight" in k and not k.endswith(".grad") and v[:2] == start[k][:2]
                 and not torch.equal(v[2], start[k][2])]
        assert moved, f"{name}: no weight changed"


# ----------------------------------------------------------------------------- diagnose()
@pytest.mark.parametrize("name", NAMES)
def test_diagnose(name: str, engine: str) -> None:
    plain(name)
    ns = idioms.build(name)
    report = bd.diagnose(IDIOMS[name].cell, ns, engine=engine, timeout=TIMEOUT)
    _check(name, _report_problems(report, engine), ns)


# ----------------------------------------------------------------------------- IPython: the magic and always on
@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.reset(new_session=False)
    sh.run_cell("%load_ext backward_doctor", store_history=False)
    yield sh
    sh.run_cell("%backward_doctor off", store_history=False)
    sh.reset(new_session=False)


def _run(shell, cell: str):
    from IPython.utils.capture import capture_output

    with capture_output() as cap:
        result = shell.run_cell(cell, store_history=True)
    return result, cap


def _fresh(shell, name: str) -> dict[str, Any]:
    """The shell's namespace emptied of the previous test's names, then filled by the idiom's setup (as earlier
    cells would have). (Not ``shell.reset()``: its ``gc.collect()`` costs ~0.3 s a test.)"""
    for key in [k for k in shell.user_ns if not k.startswith("_") and k not in shell.user_ns_hidden]:
        del shell.user_ns[key]
    return idioms.build(name, shell.user_ns)


def _cell_outcome(result, before, report, engine: str) -> list[str]:
    problems = []
    if result.error_in_exec is not None:
        exc = result.error_in_exec
        problems.append(f"exception in the cell: {type(exc).__name__}: {exc} (raised at {_doctor_frames(exc)})")
    elif result.error_before_exec is not None:
        problems.append(f"error before the cell ran: {result.error_before_exec!r}")
    if report is None or report is before:
        problems.append("no report: the cell was not watched")
    else:
        problems += [p for p in _report_problems(report, engine)
                     if not (p.startswith("report.exception") and result.error_in_exec is not None)]
    return problems


@pytest.mark.ipython
@pytest.mark.parametrize("name", NAMES)
def test_magic(name: str, engine: str, shell) -> None:
    plain(name)
    _fresh(shell, name)
    before = bd.last_report()
    result, cap = _run(shell, f"%%backward_doctor --engine {engine} --timeout {TIMEOUT}\n{IDIOMS[name].cell}")
    problems = _cell_outcome(result, before, bd.last_report(), engine)
    _check(name, problems, shell.user_ns)


@pytest.mark.ipython
@pytest.mark.parametrize("name", NAMES)
def test_always_on(name: str, engine: str, shell) -> None:
    _, _, printed = plain(name)
    _fresh(shell, name)
    _run(shell, "%backward_doctor off")
    result, cap = _run(shell, f"%backward_doctor on --engine {engine} --timeout {TIMEOUT}")
    assert result.success, cap.stdout + cap.stderr
    try:
        before = bd.last_report()
        result, cap = _run(shell, IDIOMS[name].cell)
        report = bd.last_report()
    finally:
        _run(shell, "%backward_doctor off")
    problems = _cell_outcome(result, before, report, engine)
    if not IDIOMS[name].trains_visibly:   # (no backward(), no step(): always on need not watch it)
        problems = [p for p in problems if not p.startswith("no report")]
    if cap.outputs:
        problems.append(f"shown: {[o.data.get('text/plain', '')[:200] for o in cap.outputs]}")
    doctor_lines = [line for line in cap.stdout.splitlines() if line.startswith("backward_doctor")]
    if doctor_lines:
        problems.append(f"printed: {doctor_lines}")
    elif comparable(cap.stdout) != comparable(printed):
        problems.append(f"stdout differs from the plain run's: {cap.stdout[:300]!r}")
    _check(name, problems, shell.user_ns)


# ----------------------------------------------------------------------------- the library callbacks
@pytest.mark.parametrize("name", CALLBACK_NAMES)
def test_callback(name: str, engine: str, tmp_path) -> None:
    from backward_doctor import integrations

    plain(name)
    make = integrations.DoctorCallback if IDIOMS[name].library == "hf" else integrations.DoctorLightningCallback
    cb = make(tmp_path, engine=engine, timeout=TIMEOUT)
    ns = idioms.build(name, callbacks=[cb])
    problems = []
    try:
        exec(compile(IDIOMS[name].cell, f"<idiom {name}>", "exec"), ns)
    except Exception as exc:  # noqa: BLE001 - the failure is reported with the rest
        problems.append(f"exception: {type(exc).__name__}: {exc} (raised at {_doctor_frames(exc)})")
    if cb.report is None:
        problems.append("no report: the callback watched nothing")
    else:
        problems += _report_problems(cb.report, engine)
    if os.listdir(tmp_path):
        problems.append(f"wrote {sorted(os.listdir(tmp_path))}")
    _check(name, problems, ns)


# ----------------------------------------------------------------------------- python -m backward_doctor run
def _python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"),
                                                                       os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


class ScriptRuns:
    """Every idiom run by ``tests/idioms_script.py`` in one process, as *prefix* starts it (plain ``python``, or
    ``python -m backward_doctor run --engine E``). An idiom whose exception ends the process is recorded, and
    the script runs again from the idiom after it; so each idiom has its own outcome."""

    def __init__(self, prefix: list[str], folder: Path) -> None:
        self.states: dict[str, dict[str, Any]] = {}
        self.printed: dict[str, str] = {}
        self.crashed: dict[str, str] = {}      # idiom -> the end of stderr of the process it ended
        self.runs: list[subprocess.CompletedProcess] = []
        self.reports: list[dict[str, Any]] = []
        todo = list(NAMES)
        while todo:
            out = folder / f"run{len(self.runs)}"
            out.mkdir(parents=True)
            done = _python([*prefix, str(SCRIPT), str(out), *todo], folder)
            self.runs.append(done)
            if (out / "report.json").exists():
                self.reports.append(json.loads((out / "report.json").read_text(encoding="utf-8")))
            started = []
            for chunk in done.stdout.split("\n=== idiom ")[1:]:
                head, _, body = chunk.partition(" ===\n")
                started.append(head)
                self.printed[head] = body
            for name in started:
                if (out / f"{name}.pt").exists():
                    self.states[name] = torch.load(out / f"{name}.pt", weights_only=True)
            last = started[-1] if started else None
            if done.returncode == 0 and started == todo:
                break
            if last is None or last in self.states:   # it did not end inside an idiom: nothing more to learn
                for name in todo[len(started):]:
                    self.crashed[name] = f"not run: the script exited {done.returncode}: {done.stderr[-1500:]}"
                break
            self.crashed[last] = f"exit status {done.returncode}; stderr ends: {done.stderr[-1500:]}"
            todo = todo[todo.index(last) + 1:]

    def findings_of(self, name: str) -> list[dict[str, Any]]:
        return [f for r in self.reports for f in r.get("findings", []) if idioms.idiom_of_file(f.get("file")) == name]

    def unattributed_findings(self) -> list[dict[str, Any]]:
        return [f for r in self.reports for f in r.get("findings", []) if idioms.idiom_of_file(f.get("file")) is None]


_SCRIPT_RUNS: dict[str, ScriptRuns] = {}


@pytest.fixture(scope="module")
def script_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("idioms-script")


def script_runs(kind: str, folder: Path) -> ScriptRuns:
    """``plain`` or an engine's watched run of every idiom, once per module."""
    if kind not in _SCRIPT_RUNS:
        prefix = [] if kind == "plain" else ["-m", "backward_doctor", "run", "--engine", kind, "--timeout",
                                             str(TIMEOUT), "--output-dir", str(folder / f"{kind}-reports")]
        _SCRIPT_RUNS[kind] = ScriptRuns(prefix, folder / kind)
        if kind == "plain":
            bad = _SCRIPT_RUNS[kind].crashed
            assert not bad, f"the plain script failed: {bad}"
    return _SCRIPT_RUNS[kind]


@pytest.mark.slow
def test_cli_script_exits_0_and_prints_no_report(engine: str, script_folder: Path) -> None:
    """The whole script, watched: exit status 0, nothing from the doctor on stderr, no report written, and no
    finding outside the idioms' own files (those are counted against each idiom in :func:`test_cli`)."""
    runs = script_runs(engine, script_folder)
    first = runs.runs[0]
    problems = []
    if first.returncode != 0:
        problems.append(f"exit status {first.returncode} (the idioms that ended it: {sorted(runs.crashed)})")
    doctor_lines = [line for r in runs.runs for line in r.stderr.splitlines() if line.startswith("backward_doctor")]
    if doctor_lines:
        problems.append(f"the doctor printed: {doctor_lines[:6]}")
    written = script_folder / f"{engine}-reports"
    if written.exists() and os.listdir(written):
        problems.append(f"a report was written: {sorted(os.listdir(written))}")
    if not runs.reports:
        problems.append("no report: was the script watched?")
    for f in runs.unattributed_findings():
        problems.append(f"finding {f['kind']} ({f['severity']}): {f['title']} at {f.get('file')}:{f.get('line')}")
    for r in runs.reports:
        if r["trace"].get("engine") != engine:
            problems.append(f"engine: {r['trace'].get('engine')}")
        problems += _own_errors(r["trace"].get("notes", []))
    assert not problems, "\n  ".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_cli(name: str, engine: str, script_folder: Path) -> None:
    reference = script_runs("plain", script_folder)
    runs = script_runs(engine, script_folder)
    problems = []
    if name in runs.crashed:
        problems.append(f"exception: {runs.crashed[name]}")
    for f in runs.findings_of(name):
        problems.append(f"finding {f['kind']} ({f['severity']}): {f['title']} at "
                        f"{os.path.basename(f.get('file') or '?')}:{f.get('line')}")
    if name in runs.states:
        problems += [f"state: {d}" for d in idioms.differences(reference.states[name], runs.states[name])]
        if comparable(runs.printed.get(name, "")) != comparable(reference.printed[name]):
            problems.append(f"stdout differs: {runs.printed.get(name, '')[:300]!r}")
    elif name not in runs.crashed:
        problems.append("no state saved")
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)
