"""The versioned JSON report (issue 29, item 3): ``format`` and ``version`` keys, ``backward_doctor/report/
schema.json`` describing every field ``to_dict()`` writes (a field or finding kind added without a line there
fails here, naming it), real reports valid under the package's validator and under the real ``jsonschema``,
the two validators agreeing, and reports of the first, unversioned format still loading.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import types
import typing

import jsonschema
import pytest

import backward_doctor as bd
from backward_doctor.report.combined import CombinedReport, load_report
from backward_doctor.report.schema import FORMAT, VERSION, ReportError, check_report, schema, validate
from backward_doctor.trace.distributed import RankRecord

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
SCHEMA = "backward_doctor/report/schema.json"


def _dataclasses(root: type) -> dict[str, type]:
    out, todo = {}, [root]
    while todo:
        cls = todo.pop()
        if cls.__name__ in out:
            continue
        out[cls.__name__] = cls
        for hint in typing.get_type_hints(cls).values():
            todo += [a for a in _flatten(hint) if dataclasses.is_dataclass(a)]
    return out


def _flatten(tp) -> list:
    return [tp] + [x for a in typing.get_args(tp) for x in _flatten(a)]


def _json_types(tp) -> set[str]:
    """The JSON types ``to_dict`` can write for a field of type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_json_types(a) for a in typing.get_args(tp)))
    if tp is type(None):
        return {"null"}
    if tp is str:
        return {"string"}
    if tp is bool:
        return {"boolean"}
    if tp is int:
        return {"integer"}
    if tp is float:
        return {"number", "string"}  # (NaN/Inf are written as "nan"/"inf")
    if tp is typing.Any:
        return {"object", "array", "string", "number", "integer", "boolean", "null"}
    if dataclasses.is_dataclass(tp) or origin is dict:
        return {"object"}
    if origin is list:
        return {"array"}
    raise TypeError(tp)


def _schema_types(node: dict) -> set[str]:
    """The JSON types a schema node accepts (``$ref`` and ``anyOf`` followed)."""
    defs = schema()["$defs"]
    if "$ref" in node:
        return _schema_types(defs[node["$ref"].rsplit("/", 1)[-1]])
    if "anyOf" in node:
        return set().union(*(_schema_types(n) for n in node["anyOf"]))
    if "enum" in node or "const" in node:
        values = node.get("enum", [node.get("const")])
        return {{str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}[type(v)]
                for v in values}
    t = node.get("type")
    names = {t} if isinstance(t, str) else set(t or ())
    return names | ({"integer"} if "number" in names else set())


ROOTS = {"Report": bd.Report, "CombinedReport": CombinedReport}


def test_the_schema_describes_every_field_of_every_record():
    """A field added to a dataclass of the report must get its line in schema.json (and of the right type)."""
    defs = schema()["$defs"]
    missing, wrong = [], []
    classes = {**_dataclasses(bd.Report), **_dataclasses(CombinedReport)}
    for name, cls in sorted(classes.items()):
        if name not in defs:
            missing.append(f"{name} (add \"{name}\" to $defs)")
            continue
        props = defs[name].get("properties", {})
        for field, hint in typing.get_type_hints(cls).items():
            if field not in {f.name for f in dataclasses.fields(cls)}:
                continue
            if field not in props:
                missing.append(f"{name}.{field} (add a line to $defs.{name}.properties)")
            elif not _json_types(hint) <= _schema_types(props[field]):
                wrong.append(f"{name}.{field}: the schema takes {sorted(_schema_types(props[field]))}, "
                             f"to_dict writes {sorted(_json_types(hint))}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if sorted(defs[name].get("required", [])) != sorted(required) and name not in ROOTS:
            wrong.append(f"{name}: required {defs[name].get('required', [])} in the schema, {required} in the class")
    assert not missing, f"fields {SCHEMA} does not describe: " + "; ".join(missing)
    assert not wrong, "; ".join(wrong)


def test_every_finding_kind_the_rules_name_is_in_the_schema():
    import ast
    import pathlib

    kinds = set()
    for path in pathlib.Path(bd.__file__).parent.joinpath("analysis").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("at", "Finding") and node.args \
                    and isinstance(node.args[0], ast.Constant):
                kinds.add(node.args[0].value)
            for kw in getattr(node, "keywords", []) or []:
                if kw.arg == "kind" and isinstance(kw.value, ast.Constant) and isinstance(node, ast.Call):
                    kinds.add(kw.value.value)
    known = set(schema()["$defs"]["kind"]["enum"])
    assert kinds <= known, f"finding kinds {SCHEMA} does not list (add them to $defs.kind.enum): {sorted(kinds - known)}"


def _rich_reports() -> list[dict]:
    import torch
    from torch import nn

    from backward_doctor.analysis.distributed import analyze_ranks
    from backward_doctor.trace.distributed import Collective, UnusedParams

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ns = {"torch": torch, "m": m, "opt": torch.optim.SGD(m.parameters(), lr=0.1), "x": torch.randn(3, 4),
          "kept": []}
    src = ("for i in range(3):\n    opt.zero_grad()\n    loss = m(x).sum()\n    loss.backward()\n    opt.step()\n"
           "    kept.append(loss)\ny = torch.log(m(x) - 10).sum()\ny.backward()\n")
    out = []
    for engine in ("native", "python"):
        out.append(bd.diagnose(src, dict(ns), engine=engine).to_dict())
        out.append(bd.diagnose("import time\nwhile True:\n    time.sleep(0.01)\n", {}, engine=engine, timeout=1).to_dict())
    fixed = bd.diagnose("loss = m(x).sum()\nloss.backward()\nopt.step()\n", dict(ns), fix="amp", engine="python")
    out.append(fixed.to_dict())
    trace = bd.Report.from_dict(out[0]).trace
    ranks = [RankRecord(k, 2, stopped="timeout", script="/x/t.py", progress_s=0.5, steps=3, run="r/0",
                        collectives=[Collective(0, "all_reduce", seq=4, sizes=[[3]], line=9, loop={"i": 1})],
                        unused=[UnusedParams(names=["b"], forward_line=3)], trace=trace if k == 0 else None)
             for k in range(2)]
    out.append(CombinedReport(findings=analyze_ranks(ranks, timeout=5), ranks=ranks, script="/x/t.py", nproc=2,
                              notes=["n"]).to_dict())
    return [json.loads(json.dumps(d)) for d in out]


@pytest.fixture(scope="module")
def rich():
    return _rich_reports()


def test_real_reports_carry_format_and_version_and_fit_the_schema_exactly(rich):
    for data in rich:
        assert data["format"] == FORMAT and data["version"] == VERSION
        check_report(data, strict=True)          # the package's validator, no field undescribed
        jsonschema.validate(data, schema())      # the real one agrees
        again = load_report(data).to_dict()
        assert json.loads(json.dumps(again)) == data  # and it round-trips


def test_an_undescribed_field_is_named():
    data = bd.Report().to_dict()
    data["trace"]["iterations"]["grad_accumulation"] = 4
    with pytest.raises(ReportError, match=r"trace\.iterations: a field 'grad_accumulation' that .*schema\.json does "
                                          r"not describe \(add it to \$defs\.Iterations\.properties\)"):
        check_report(data, strict=True)
    check_report(data)  # (loading is lenient: a newer report that only adds fields loads)
    data["findings"] = [{"kind": "weight_decay_twice", "message": "x"}]
    with pytest.raises(ReportError, match=r"findings\[0\]\.kind: \"weight_decay_twice\" is not one of"):
        check_report(data)


def test_the_package_validator_agrees_with_jsonschema():
    """Each field of real (small) reports set to values of every type: both validators give the same verdict."""
    from backward_doctor.trace.distributed import Collective

    values = ["x", -1, 2 ** 70, 1.5, None, True, [], {}, [1], {"a": 1}]
    small = bd.diagnose("import torch\nw = torch.ones(2, requires_grad=True)\n(w * 2).sum().backward()\nw += 1\n", {})
    ranks = CombinedReport(ranks=[RankRecord(0, 2, collectives=[Collective(0, "barrier", seq=1, sizes=[[2]])])],
                           nproc=2, findings=small.findings)
    real = jsonschema.Draft202012Validator(schema())
    tried = disagree = 0
    for doc in (json.loads(json.dumps(small.to_dict())), json.loads(json.dumps(ranks.to_dict()))):
        for path in _paths(doc):
            for value in values:
                data = copy.deepcopy(doc)
                _set(data, path, value)
                ours = _ok(lambda: check_report(data))
                theirs = real.is_valid(data)
                tried += 1
                if ours != theirs:
                    disagree += 1
                    assert ours == theirs, (path, value, ours, theirs)
    assert tried > 1000 and not disagree


def _ok(fn) -> bool:
    try:
        fn()
        return True
    except (ReportError, jsonschema.ValidationError):
        return False


def _paths(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + (k,)
            yield from _paths(v, path + (k,))
    elif isinstance(obj, list) and obj:
        yield path + (0,)
        yield from _paths(obj[0], path + (0,))


def _set(data, path, value):
    for key in path[:-1]:
        data = data[key]
    data[path[-1]] = value


@pytest.mark.parametrize("name", ["report_v1.json", "combined_v1.json"])
def test_reports_of_the_first_unversioned_format_still_load_and_render(name, capsys):
    """Saved by the code before this format was versioned (no format/version keys, no stored source)."""
    from backward_doctor.frontends.cli import main

    path = os.path.join(DATA, name)
    data = json.load(open(path, encoding="utf-8"))
    assert "format" not in data and "version" not in data
    report = load_report(data)
    assert report.findings and str(report) and report.to_html()
    assert main(["render", path]) == 0  # (rendered; the report says PROBLEM)
    assert capsys.readouterr().out.startswith("backward_doctor: PROBLEM")


def test_the_docs_page_names_every_top_level_field():
    page = open(os.path.join(os.path.dirname(DATA), "..", "docs", "report-format.md"), encoding="utf-8").read()
    for definition in ("Report", "CombinedReport", "Finding", "Trace", "RankRecord"):
        for field in schema()["$defs"][definition]["properties"]:
            assert f"`{field}`" in page, f"docs/report-format.md does not say what {definition}.{field} means"


def test_validate_names_the_definition():
    validate({"rank": 0, "world_size": 2}, "RankRecord")
    with pytest.raises(ReportError, match=r"^world_size: "):
        validate({"rank": 0, "world_size": None}, "RankRecord")
    with pytest.raises(ReportError, match=r"^name: 3 is not a string$"):
        validate({"name": 3}, "FixResult")


def test_the_storage_history_fits_its_cap():
    """The ledger's history may hold its whole cap (5 ints per event): a report at the cap still loads."""
    from backward_doctor.trace.parts import STORAGE_EVENTS_CAP

    assert schema()["$defs"]["StorageEvents"]["properties"]["flat"]["maxItems"] == STORAGE_EVENTS_CAP * 5
