"""Leaf helpers every layer may use: sizes and durations (``units``), dataclass <-> JSON (``serde``),
and the text/``ast`` model of a cell's source (``cell``). They import nothing else from the package."""
