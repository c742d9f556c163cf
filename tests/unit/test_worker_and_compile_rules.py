"""The ``dataloader_worker`` and ``compile_divergence`` rules on traces built by hand (no step run): the
cases a CPU cannot produce (CUDA in a forked worker, autograd's threads after fork), and the records'
JSON round trip."""
from __future__ import annotations

from backward_doctor.analysis import analyze
from backward_doctor.report import Report
from backward_doctor.trace.parts import CompileCheck
from backward_doctor.trace.records import ExceptionInfo, Trace, Where
from backward_doctor.trace.stacks import FrameInfo, LoaderRecord, WorkerRecord

FOR = "for x, y in loader:\n    loss = model(x).sum()\n"


def _worker_error(error: str, frames: list[FrameInfo]) -> Trace:
    kind = error.split(":", 1)[0]
    exc = ExceptionInfo(type=kind, message=f"Caught {kind} in DataLoader worker process 0.\nOriginal Traceback ...",
                        where=Where(line=1, cell_line=1))
    worker = WorkerRecord(worker=0, pid=11, state="raised", task="dataset[4]", error=error, frames=frames)
    return Trace(source=FOR, exception=exc, loaders=[LoaderRecord("DataLoader(Images, num_workers=2)", "Images", 2,
                                                                  "fork", [worker])])


def _frame(line: int, code: str) -> FrameInfo:
    return FrameInfo(file="/home/me/data.py", line=line, function="Images.__getitem__", user=True, code=code)


def test_cuda_in_a_forked_worker_is_named_at_its_line():
    trace = _worker_error("RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with "
                          "multiprocessing, you must use the 'spawn' start method", [_frame(31, "x = x.cuda()")])
    f = analyze(trace)[0]
    assert f.kind == "dataloader_worker" and (f.line, f.file, f.cell_line) == (31, "/home/me/data.py", 1)
    assert "spawn" in f.message and "non_blocking=True" in f.message and "dataset[4]" in f.message


def test_autograd_after_fork_names_the_workers_backward():
    trace = _worker_error("RuntimeError: Unable to handle autograd's threading in combination with fork-based "
                          "multiprocessing.", [_frame(40, "loss.backward()")])
    f = analyze(trace)[0]
    assert f.kind == "dataloader_worker" and f.line == 40 and "multiprocessing_context='spawn'" in f.message


def test_a_worker_error_without_a_record_is_still_placed_by_the_message():
    trace = _worker_error("KeyError: 'label'", [_frame(12, "return self.rows[i]['label']")])
    trace.loaders[0].loader = "a DataLoader whose workers were started before this run"
    f = analyze(trace)[0]
    assert f.kind == "dataloader_worker" and f.line == 12 and "`dataset[4]` raises the same error" in f.message


def test_compile_divergence_where_eager_agrees_says_nothing():
    trace = Trace(compile_check=CompileCheck(trigger="nonfinite", eager_agrees=True))
    assert [f.kind for f in analyze(trace)] == []


def test_report_with_workers_and_compile_check_round_trips():
    trace = _worker_error("ValueError: bad", [_frame(3, "raise ValueError('bad')")])
    trace.compile_check = CompileCheck(trigger="exception", eager_agrees=False, op="aten.addmm.default", line=4)
    report = Report(findings=analyze(trace), trace=trace)
    again = Report.from_dict(report.to_dict())
    assert again.trace.loaders == trace.loaders and again.trace.compile_check == trace.compile_check
    assert "DataLoader workers: DataLoader(Images, num_workers=2)" in str(again)


def test_waiting_on_a_worker_started_before_the_run_is_said_so():
    from backward_doctor.trace.stacks import ThreadStack

    main = ThreadStack("MainThread", 1, True, [FrameInfo("<cell>", 1, "<module>", in_cell=True, user=True),
                                                FrameInfo("/x/torch/utils/data/dataloader.py", 1505, "_next_data"),
                                                FrameInfo("/x/torch/utils/data/dataloader.py", 1464, "_get_data"),
                                                FrameInfo("/x/selectors.py", 415, "select")])
    trace = Trace(source=FOR, timed_out=True, timeout_s=2, threads=[main],
                  exception=ExceptionInfo("KeyboardInterrupt", "", where=Where(line=1, cell_line=1)))
    f = analyze(trace)[0]
    assert f.kind == "dataloader_worker" and f.line == 1 and "started before this run" in f.message
