"""Render: a :class:`~backward_doctor.report.Report` turned into text, HTML or plots.

Importing this package registers the renderers (``report/renderers.py``): ``text``, ``json``
(``text.py``), ``html`` and ``page`` (``html.py``), and the exporters ``memory_viz`` (``memory_viz.py``: a
memory snapshot pickle, bytes), ``perfetto`` (``perfetto.py``: Chrome/Perfetto trace JSON) and ``tensorboard``
(``tensorboard.py``: an event file, where tensorboard is installed). ``view.py`` is the view model every renderer
and the panel read (verdict, offending op, memory by module, op rows, applicable fixes), ``style.py``
the look, ``sections.py`` the HTML pieces, ``graph.py`` the autograd graph by module, ``svg_plots.py`` the
memory plots (inline SVG), ``plots.py`` a fix's before/after bars (matplotlib, imported lazily).

>>> from backward_doctor.report import Report
>>> from backward_doctor.report.renderers import renderer
>>> renderer("text").render(Report()).startswith("backward_doctor: OK")
True
"""
from __future__ import annotations

from . import html, memory_viz, perfetto, tensorboard, text  # noqa: F401  (registers the renderers)
from ..report.renderers import names, renderer

__all__ = ["names", "renderer"]
