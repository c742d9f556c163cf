"""One run of a cell, orchestrated: the engine chosen (``engine``), the capture run, the NaN replay
from a rollback snapshot where one is needed (``snapshot``), the rules applied and the report kept as
the last one (``step``). ``diagnose()``, the magic, the CLI and the fixes all go through
:func:`~backward_doctor.run.step.run_step`."""
