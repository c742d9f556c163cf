"""The training watches: the ordered registry and its members (accumulation, precision, schedules, frozen parameters, orphan modules)."""
