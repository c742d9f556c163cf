"""The training idioms of ``tests/idioms.py`` as one script: ``python idioms_script.py OUT_DIR NAME...`` runs each
named idiom, one after the other, each cell from a file of its own, and saves what it changed to
``OUT_DIR/NAME.pt`` (``idioms.state_of``); ``python -m backward_doctor run ... idioms_script.py OUT_DIR NAME...``
runs it watched (``tests/test_idioms.py`` compares the two). Each idiom's output follows a line
``=== idiom NAME ===``. When the doctor was imported (a watched run), its report of the whole run is saved as
``OUT_DIR/report.json`` at exit, so that its findings can be told apart by idiom (their files are named after it).
"""
from __future__ import annotations

import atexit
import json
import os
import sys


def _save_report(out_dir: str) -> None:
    doctor = sys.modules.get("backward_doctor")
    report = doctor.last_report() if doctor is not None else None
    if report is not None:
        with open(os.path.join(out_dir, "report.json"), "w", encoding="utf-8") as fh:
            json.dump(report.to_dict(), fh)


def main(out_dir: str, names: list[str]) -> None:
    import torch

    torch.set_num_threads(1)
    import idioms

    atexit.register(_save_report, out_dir)
    for name in names:
        print(f"\n=== idiom {name} ===", flush=True)
        ns = idioms.build(name)
        idioms.run_in_file(name, ns)
        state = idioms.state_of(ns, sorted(k for k in ns if not k.startswith("_")))
        torch.save(state, os.path.join(out_dir, f"{name}.pt"))
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
