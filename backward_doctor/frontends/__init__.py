"""Frontends: where a person meets the doctor. ``magic`` (``%%backward_doctor``), ``panel`` (the only
module that imports ipywidgets), ``cli`` (``python -m backward_doctor``), ``demo`` (``make demo``).
They call ``backward_doctor.api`` and the renderers; nothing below imports them."""
