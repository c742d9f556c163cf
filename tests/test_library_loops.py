"""Library loops (`transformers.Trainer.train()`, Lightning `Trainer.fit()`, an Accelerate loop), correct:
the doctor follows them on both engines, reports nothing, and leaves the weights bit-identical.

These are the correct versions the library-loop bug tests stand beside (``tests/library_loops.py``).
"""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd

import library_loops as ll

LOOPS = {
    "hf_trainer": (lambda: ll.hf_trainer(), ll.HF_TRAIN),
    # (a causal LM: its loss takes num_items_in_batch. The BERT classifier's drops it, and the Trainer then
    # leaves its loss undivided: transformers#47688, found by the grad_accumulation rule, test_accumulation_libraries)
    "hf_trainer_accumulating": (lambda: ll.hf_trainer(steps=2, accum=2, task="lm"), ll.HF_TRAIN),
    "lightning_fit": (lambda: ll.lit_fit(), ll.LIT_FIT),
    "lightning_fit_accumulating": (lambda: ll.lit_fit(trainer_kwargs={"accumulate_grad_batches": 2}), ll.LIT_FIT),
    "accelerate_accumulate": (lambda: ll.accelerate_loop(accum=2), ll.ACCEL_LOOP),
    # (issue 26) evaluation inside the loop, clipping, manual optimization: watched, silent, bit-identical
    "hf_trainer_evaluating": (lambda: ll.hf_trainer(eval_n=8, eval_strategy="steps", eval_steps=2), ll.HF_TRAIN),
    "lightning_fit_clipping": (lambda: ll.lit_fit(trainer_kwargs={"gradient_clip_val": 0.5}), ll.LIT_FIT),
    "lightning_fit_manual": (lambda: ll.lit_fit(module_source=ll.LIT_MANUAL, module_name="LitManual"), ll.LIT_FIT),
}




def _weights(ns: dict) -> dict[str, torch.Tensor]:
    model = ns["model"]
    out = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out.update({f"{k}.grad": p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    return out


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_correct_library_loop_is_silent_and_bit_identical(loop: str, engine: str) -> None:
    build, cell = LOOPS[loop]
    ns = build()
    start = _weights(ns)
    exec(cell, ns)
    plain = _weights(ns)
    assert any(not torch.equal(start[k], plain[k]) for k in start), "the loop did not train"

    ns = build()
    report = bd.diagnose(cell, ns, engine=engine)
    assert report.exception is None
    assert report.trace.engine == engine
    assert report.findings == [], str(report)
    assert report.trace.iterations is not None and report.trace.iterations.loss, "no iteration was watched"
    doctored = _weights(ns)
    assert doctored.keys() == plain.keys()
    for k in plain:
        assert torch.equal(doctored[k], plain[k]), k


def test_define_names_the_users_file_and_line() -> None:
    ns = ll.define("""\
        class Net(torch.nn.Module):
            def forward(self, x):
                return x * 2  # <-- here
        """, {"torch": torch})
    assert ll.marked_line(ns, "Net", "# <-- here") == 3
