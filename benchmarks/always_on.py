"""What ``%backward_doctor on`` costs: the "always on" column of the whole-path benchmark.

    python benchmarks/whole_path.py --always-on            # with the rest of the whole-path run
    python benchmarks/always_on.py [--quick] [--json OUT]  # this column alone

Every cell runs in one real IPython ``InteractiveShell`` through ``shell.run_cell`` (what a notebook's
kernel calls), plain and with always-on installed, interleaved round by round; each mode keeps its own
namespace built from the same seed (swapped into the shell around its run, outside the timed region).
Times are process CPU time, one torch thread, medians; ratios against the plain cell of the same rounds
(which mode runs first alternates round by round, and which namespace each mode runs in every other round; cells without autograd get 5x the rounds, the trivial one
200x: their differences are microseconds).

Cells: a cell with no autograd (the MLP evaluated under ``no_grad`` on 40 batches, a trivial ``x = 1``, which
has no call and is passed straight on, and ``n = len(x)``, which has one: guessed once, then decided by its
names' types), single training steps (the whole-path workloads), the 2,000-iteration loop, and
``trainer.train()`` of a tiny ``transformers`` BERT (``tests/library_loops.py``, 20 steps). Memory held
between cells: the bytes of tensor storage alive after a watched cell beyond what the plain run leaves,
and the size of the one thing the doctor keeps (``last_report()``, its JSON).
"""
from __future__ import annotations

import contextlib
import gc
import io
import json
import statistics
import sys
import time
from typing import Any, Callable

import torch

NO_AUTOGRAD = "with torch.no_grad():\n    for _ in range(40):\n        y = model(x)\nscore = float(y.mean())\n"
TRIVIAL = "x_ = 1\n"  # (no call: always on passes it straight on)
TRIVIAL_CALL = "n_ = len(x)\n"  # (a call: the guess runs once; run again, its names' types decide)
HF_TRAIN = "result = trainer.train()\n"
#: budgets (benchmarks/RESULTS.md): loops and single steps, and a cell with no autograd
BUDGET_STEP = (1.15, 0.010)
BUDGET_NO_AUTOGRAD = 1.02


def _hf_trainer() -> tuple[dict, str]:
    import library_loops as ll

    return ll.hf_trainer(steps=20, n=80), HF_TRAIN


def cells(workloads: dict[str, Callable[[], tuple[dict, str]]], names: list[str]) -> list[tuple[str, Callable]]:
    """(row name, builder of (namespace, cell)) for the always-on table."""
    rows: list[tuple[str, Callable]] = [
        ("no autograd: eval x40", lambda: ({**workloads["mlp"]()[0], "torch": torch}, NO_AUTOGRAD)),
        ("no autograd: x = 1", lambda: ({**workloads["mlp"]()[0], "torch": torch}, TRIVIAL)),
        ("no autograd: n = len(x)", lambda: ({**workloads["mlp"]()[0], "torch": torch}, TRIVIAL_CALL))]
    rows += [(f"step: {n}", workloads[n]) for n in names if not n.startswith("loop") and n in workloads]
    rows += [(n.replace("_", " "), workloads[n]) for n in names if n.startswith("loop") and n in workloads]
    rows.append(("trainer.train() tiny BERT", _hf_trainer))
    return rows


class _Shell:
    """One InteractiveShell; each mode's namespace swapped in around its run (not timed)."""

    def __init__(self) -> None:
        from IPython.core.interactiveshell import InteractiveShell

        from backward_doctor.frontends.always_on import AlwaysOn, Options

        self.sh = InteractiveShell.instance()
        self.sh.run_cell("%load_ext backward_doctor", store_history=False)
        self.base = dict(self.sh.user_ns)
        # Installed once, as `%backward_doctor on` installs it (the shell's run_cell wrapped: an attribute of the
        # shell instance, which stays; installing and removing it around each run changed the shell's attributes
        # before every run, and IPython's own code ran slower after each change). A plain run calls the shell's
        # own run_cell, with torch.autograd.backward put back for it.
        self.on = AlwaysOn(self.sh, Options())
        self.on.install()

    def run(self, ns: dict, cell: str, watched: bool) -> float:
        user = self.sh.user_ns
        user.clear()
        user.update(self.base)
        user.update(ns)
        run = self.sh.run_cell if watched else self.on._original
        if not watched:
            self.on._trigger.uninstall()
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # (the libraries' own prints, alike in both modes)
                t0 = time.process_time()
                result = run(cell, store_history=False)
                t = time.process_time() - t0
        finally:
            if not watched:
                self.on._trigger.install()
                self.on._trigger.arm(self.on._open)  # (armed between cells, as `on` leaves it)
        if not result.success:
            raise RuntimeError(f"the cell failed: {result.error_in_exec or result.error_before_exec}")
        ns.update({k: v for k, v in user.items() if k not in self.base or self.base[k] is not v})
        return t


def _tensor_bytes() -> int:
    """Bytes of distinct tensor storages alive (the gc's view)."""
    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if issubclass(type(o), torch.Tensor) and o.layout == torch.strided and not o.is_meta:
            try:
                st = o.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
            except Exception:  # noqa: BLE001
                continue
    return sum(seen.values())


def measure(name: str, build: Callable[[], tuple[dict, str]], rounds: int, shell: _Shell) -> dict[str, Any]:
    import backward_doctor as bd

    (plain_ns, cell), (on_ns, _) = build(), build()
    times: dict[str, list[float]] = {"plain": [], "on": []}
    watched = not name.startswith("no autograd")
    n = rounds if watched else max(15, 5 * rounds)  # (cheap cells: more rounds, the differences are small)
    if cell in (TRIVIAL, TRIVIAL_CALL):
        n *= 40
    for r in range(n + 1):
        order = (False, True) if r % 2 else (True, False)  # which mode runs first alternates (no order bias)
        # and which of the two namespaces each mode runs in, every other round: two builds of the same model
        # differ by ~1% in speed (where their buffers landed), which would otherwise count as the doctor's.
        # (Both namespaces take one step a round, and a watched step computes what a plain one does: they
        # stay equal.)
        swap = (r // 2) % 2 == 1
        for on in order:
            t = shell.run(on_ns if on != swap else plain_ns, cell, watched=on)
            if r:
                times["on" if on else "plain"].append(t)
    p, o = statistics.median(times["plain"]), statistics.median(times["on"])
    report = bd.last_report()
    # memory held after the cell: tensors alive with always-on's namespace in the shell, minus the plain one's
    held = 0
    if watched:
        shell.run(plain_ns, "pass\n", watched=False)
        plain_bytes = _tensor_bytes()
        shell.run(on_ns, "pass\n", watched=False)
        held = _tensor_bytes() - plain_bytes
    row = {"cell": name, "rounds": n, "plain_ms": p * 1e3, "on_ms": o * 1e3, "on_x": o / p, "extra_ms": (o - p) * 1e3,
           "held_tensor_bytes": held,
           "report_json_bytes": len(json.dumps(report.to_dict())) if (watched and report is not None) else 0}
    if watched:
        row["budget_ms"] = (BUDGET_STEP[0] * p + BUDGET_STEP[1]) * 1e3
        row["within_budget"] = o <= BUDGET_STEP[0] * p + BUDGET_STEP[1]
    else:
        row["budget_ms"] = BUDGET_NO_AUTOGRAD * p * 1e3
        row["within_budget"] = o <= BUDGET_NO_AUTOGRAD * p
    return row


def run(workloads: dict[str, Callable[[], tuple[dict, str]]], names: list[str], rounds: int) -> list[dict[str, Any]]:
    shell = _Shell()
    print(f"\n# always on (%backward_doctor on) vs the plain cell, both through IPython's run_cell; {rounds} rounds",
          flush=True)
    print(f"{'cell':<28}{'plain ms':>10}{'on ms':>10}{'x':>7}{'extra ms':>10}{'budget ms':>11}"
          f"{'held':>8}{'report':>9}", flush=True)
    rows = []
    for name, build in cells(workloads, names):
        try:
            row = measure(name, build, rounds, shell)
        except Exception as exc:  # noqa: BLE001 - one missing library must not end the table
            print(f"{name:<28} skipped ({type(exc).__name__}: {exc})", flush=True)
            continue
        rows.append(row)
        mark = "" if row["within_budget"] else "  over budget"
        print(f"{name:<28}{row['plain_ms']:>10.2f}{row['on_ms']:>10.2f}{row['on_x']:>7.3f}{row['extra_ms']:>10.2f}"
              f"{row['budget_ms']:>11.2f}{row['held_tensor_bytes']:>8}{row['report_json_bytes']:>9}{mark}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [os.path.dirname(here), here, os.path.join(os.path.dirname(here), "tests")]
    import whole_path as W

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from backward_doctor.capture.native_capture import native_available

    native_available(build=True)
    rounds = 1 if args.smoke else 3 if args.quick else 7
    names = ["mlp", "loop_200"] if args.smoke else ["mlp", "cnn", "transformer", "hf_gpt2", "hf_t5", "loop_2000"]
    rows = run(W.WORKLOADS, names, rounds)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"torch": torch.__version__, "rounds": rounds, "always_on": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
