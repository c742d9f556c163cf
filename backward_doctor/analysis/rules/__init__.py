"""Rules: pure functions ``fn(trace) -> list[Finding]``, most specific first.

>>> from backward_doctor.trace import Trace
>>> analyze(Trace())
[]
"""
from __future__ import annotations

from typing import Callable

from ..consequences import cause_first
from ..findings import Finding
from ..loops import place_in_loops
from .accumulation import grad_accumulation
from .amp import amp_crossing, amp_misuse
from .amp_steps import direct_step, scaled_step
from .amp_updates import skipped_update, update_left_out
from ...trace.records import Trace
from .autograd import backward_twice, inplace, no_grad_path
from .compile import compile_divergence, compile_failure, compiled_first
from .dataloader import dataloader_worker
from .evaluation import eval_without_no_grad
from .failures import generic_exception, index_out_of_range, mismatch
from .frozen import frozen_params_updated
from .functions import invalid_gradient
from .hang import hang
from .labels import label_misalignment
from .loader_duplicates import duplicated_stream
from .loop_memory import loop_leak
from .loss_inputs import loss_on_probabilities
from .loss_spike import loss_spike
from .memory import oom
from .nonfinite import nonfinite
from .params import left_frozen, orphan_params
from .saved_writes import unseen_write
from .schedules import scheduler_misuse
from .ties import untied_weights
from .train_eval import train_eval_mode
from .unoptimized import unoptimized_params
from .unshifted import unshifted_targets
from .silent import amp_skipped, broadcast, detached, graph_leak, nonleaf_param, stale_grad

Rule = Callable[[Trace], list[Finding]]

#: Rules that explain the cell's exception; the first that answers wins.
EXCEPTION_RULES: list[Rule] = [dataloader_worker, compile_failure, hang, eval_without_no_grad, oom, inplace,
                               backward_twice, left_frozen, no_grad_path, invalid_gradient, index_out_of_range,
                               scaled_step, skipped_update, amp_crossing, mismatch]
#: Rules that look at the whole run, whether or not it raised.
RUN_RULES: list[Rule] = [compile_divergence, direct_step, nonfinite, stale_grad, graph_leak, loop_leak, amp_skipped,
                         nonleaf_param, grad_accumulation, amp_misuse, update_left_out]
#: Rules for a run that completed without an exception.
SILENT_RULES: list[Rule] = [no_grad_path, unseen_write, orphan_params, unoptimized_params, detached, broadcast, loss_on_probabilities,
                            train_eval_mode, scheduler_misuse, frozen_params_updated, label_misalignment,
                            unshifted_targets, untied_weights, duplicated_stream, loss_spike]


def analyze(trace: Trace) -> list[Finding]:
    """All findings for ``trace``, the root cause first."""
    findings: list[Finding] = []
    if trace.exception is not None or trace.timed_out:
        for rule in EXCEPTION_RULES:
            findings = rule(trace)
            if findings:
                break
        else:
            findings = generic_exception(trace)
    else:
        for rule in SILENT_RULES:
            findings.extend(rule(trace))
    run: list[Finding] = []
    for rule in RUN_RULES:
        run.extend(rule(trace))
    # A run that went wrong (NaN/Inf, a stale step) leads with that: a silent mistake found beside it (a frozen
    # layer drifting, a scheduler out of step) is a warning after it, not the headline of a run that went NaN.
    if findings and trace.exception is None and any(f.severity == "error" for f in run) \
            and not any(f.severity == "error" for f in findings):
        findings = run + findings
    else:
        findings.extend(run)
    # Memory that ran out because a loop kept its graphs: the line that keeps them is the root cause.
    leak = next((f for f in findings if f.kind == "graph_leak" and f.severity == "error"), None)
    if leak is not None and findings[0].kind == "oom":
        oom_f = findings[0]
        findings.remove(leak)
        findings.insert(0, leak)
        oom_f.message = (f"A consequence of the graphs `{leak.evidence['variable']}` keeps (above): "
                         + oom_f.message.split(" Activations saved for backward")[0]
                         + " Smaller batches or accumulation would only delay it: stop keeping the graphs.")
        oom_f.fixes = []
        oom_f.severity = "warning"
        oom_f.iteration = trace.iterations.steps  # the iteration that was running when it ran out
    # (placed in the loop first: the cell's exception is placed at the op that raised while it is still first)
    return cause_first(trace, place_in_loops(trace, compiled_first(findings)))
