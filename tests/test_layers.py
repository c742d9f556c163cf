"""Architecture tier: the layering contract, checked on the source (no torch run).

The package is layered capture -> trace -> analysis -> report -> render -> frontends (DEVELOPERS.md
has the map). A module may import from its own layer and the layers below it, never above; there is
no import cycle between modules; no module is over 400 lines. ``capture/`` is in rooms with an order of
their own (``CAPTURE_ROOMS``). Every import counts: those inside
functions (deferred) and those under ``TYPE_CHECKING`` too, because a cycle hidden in a function is
still a cycle a reader has to hold in their head.
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "backward_doctor"

#: Bottom to top. A module's layer is its first dotted component under the package (``capture`` for
#: ``backward_doctor.capture.recorder.memory``); the package's ``__init__`` and ``__main__`` sit above all.
LAYERS = ["util", "native", "trace", "capture", "analysis", "report", "render", "run", "fixes", "api",
          "frontends", "integrations"]
TOP = {"", "__main__"}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(module imported, line) for every import of this package in ``path``, wherever it is written."""
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if name else []
    base_pkg = here if is_pkg else here[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name.split(".", 1)[1] if "." in a.name else "" for a in node.names
                       if a.name == "backward_doctor" or a.name.startswith("backward_doctor.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = base_pkg[:len(base_pkg) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif node.module and (node.module == "backward_doctor" or node.module.startswith("backward_doctor.")):
                mod = node.module.split(".", 1)[1] if "." in node.module else ""
            else:
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}" if mod else alias.name
                targets.append(sub if sub in MODULES else mod)
        for t in targets:
            while t and t not in MODULES:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t != name:
                found.append((t, node.lineno))
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(name: str) -> int:
    head = name.split(".", 1)[0]
    if name in TOP:
        return len(LAYERS)
    assert head in LAYERS, f"backward_doctor.{name} is in no layer: add its folder to LAYERS (and DEVELOPERS.md)"
    return LAYERS.index(head)


def test_every_module_is_in_a_layer():
    for name in MODULES:
        _layer(name)


def test_imports_point_down():
    bad = []
    for name, imports in GRAPH.items():
        for target, line in imports:
            if _layer(target) > _layer(name):
                bad.append(f"backward_doctor/{MODULES[name].relative_to(PKG)}:{line} ({LAYERS[_layer(name)]}) "
                           f"imports backward_doctor.{target} ({LAYERS[_layer(target)]})")
    assert not bad, "imports that point up a layer:\n" + "\n".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in GRAPH:
        if root in index:
            continue
        work = [(root, iter(sorted({t for t, _ in GRAPH[root]})))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted({t for t, _ in GRAPH[w]}))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_import_cycles_counting_deferred_and_type_only_imports():
    cycles = _cycles()
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_400_lines(name):
    n = len(MODULES[name].read_text(encoding="utf-8").splitlines())
    assert n <= MAX_LINES, f"backward_doctor/{MODULES[name].relative_to(PKG)} has {n} lines: split it by what it owns"


def test_the_checker_sees_deferred_type_only_and_upward_imports(tmp_path):
    """The contract checker itself, on a made-up module: it must see every kind of import."""
    src = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
           "if TYPE_CHECKING:\n    from ..render.html import render_html\n"
           "def f():\n    from ..frontends import cli\n    from . import memory\n")
    fake = tmp_path / "probe.py"  # read as if it were backward_doctor/capture/recorder/probe.py
    fake.write_text(src.replace("..render", "...render").replace("..frontends", "...frontends"), encoding="utf-8")
    got = {t for t, _ in _imports("capture.recorder.probe", fake)}
    assert got == {"render.html", "frontends.cli", "capture.recorder.memory"}


def test_the_layers_match_the_folders():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    modules = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    assert folders | modules == set(LAYERS), (folders | modules) ^ set(LAYERS)
    assert os.path.isfile(PKG.parent / "DEVELOPERS.md")


#: ``capture/``'s rooms, bottom to top (DEVELOPERS.md): a room imports the rooms below it and the capture's shared
#: modules, never a room above it nor the assembly, the modules that put a capture together from the rooms.
CAPTURE_ROOMS = ["recorder", "workers", "watches", "loop", "end"]
CAPTURE_SHARED = {"guard", "frames", "history", "janitor", "namespace", "elsewhere", "state"}
CAPTURE_ASSEMBLY = {"", "context", "native_capture", "python_sampling", "runner", "open_run"}


def _capture_place(name: str) -> str | None:
    """``recorder`` for ``capture.recorder.memory``, ``.guard`` for ``capture.guard``, None outside capture."""
    parts = name.split(".")
    if parts[0] != "capture":
        return None
    if len(parts) > 2 or (len(parts) == 2 and parts[1] in CAPTURE_ROOMS):
        return parts[1]
    return "." + (parts[1] if len(parts) == 2 else "")


def test_every_capture_module_has_a_place():
    """A new capture module goes into a room; the top of ``capture/`` is the shared modules and the assembly."""
    for name in MODULES:
        place = _capture_place(name)
        if place is not None and place.startswith("."):
            assert place[1:] in CAPTURE_SHARED | CAPTURE_ASSEMBLY, (
                f"backward_doctor.{name} is at the top of capture/: put it in a room ({CAPTURE_ROOMS}) or name it "
                "shared or assembly in tests/test_layers.py and DEVELOPERS.md")
        elif place is not None:
            assert place in CAPTURE_ROOMS, f"backward_doctor.{name}: capture/{place}/ is no room: add it to CAPTURE_ROOMS"


def test_capture_rooms_import_down():
    bad = []
    for name, imports in GRAPH.items():
        here = _capture_place(name)
        if here is None or here.startswith("."):
            continue
        for target, line in imports:
            there = _capture_place(target)
            if there is None or there == here:
                continue
            if there.startswith("."):
                ok = there[1:] in CAPTURE_SHARED
            else:
                ok = CAPTURE_ROOMS.index(there) < CAPTURE_ROOMS.index(here)
            if not ok:
                bad.append(f"backward_doctor/{MODULES[name].relative_to(PKG)}:{line} (capture/{here}/) imports "
                           f"backward_doctor.{target}")
    assert not bad, "capture rooms importing up or the assembly:\n" + "\n".join(bad)


def test_one_run_orchestration():
    """Only ``run/`` (and the capture itself) assembles a run: the frontends, ``api`` and the fixes call
    ``run.step.run_step`` (or ``diagnose``/``run_fix``), never the capture's pieces."""
    pieces = {"run_source", "make_capture", "run_under_capture", "replay_in_detail", "snapshot_for", "wants_replay"}
    bad = []
    for name, path in MODULES.items():
        if name.split(".", 1)[0] in {"capture", "run"}:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                used = pieces & {a.name for a in node.names}
                if used:
                    bad.append(f"backward_doctor.{name}:{node.lineno} imports {sorted(used)}")
    assert not bad, bad
