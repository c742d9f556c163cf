"""What the tie watch (``capture/end/ties.py``) leaves in a trace: weights a model means to share (an embedding
and the output layer it is tied to) that were two separate tensors when the step ended (``Trace.untied_weights``).

>>> from backward_doctor.util.serde import from_dict, to_dict
>>> u = UntiedWeights(model="model", cls="GPT2LMHeadModel", target="model.lm_head.weight",
...                   source="model.transformer.wte.weight", target_key=7, source_key=9,
...                   declared="config.tie_word_embeddings=True", tie_weights=True)
>>> from_dict(UntiedWeights, to_dict(u)) == u
True
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class UntiedWeights:
    """Two parameters a model declares tied (``target`` is to be ``source``) that are two parameter objects at
    the end of the step (equal keys: two parameters over one memory). Recorded whether or not they trained: the
    rule reads their part in the step from ``Trace.params``, by name."""

    model: str                 # the module that declares the tie, by the variable that holds it (``model``)
    cls: str                   # its class (``GPT2LMHeadModel``, the user's ``TinyLM``)
    target: str                # the parameter that should be the other one, by name (``model.lm_head.weight``)
    source: str                # the one it should be (``model.transformer.wte.weight``)
    target_key: int = 0        # their storage keys (``ParamInfo.key``)
    source_key: int = 0
    #: where the tie is declared, in the user's terms: ``config.tie_word_embeddings=True`` (Hugging Face), or the
    #: ``__init__`` statement that ties them (``self.head.weight = self.embed.weight``)
    declared: str = ""
    file: str | None = None    # that statement's file and line (a plain module's ``__init__``; None for a config)
    line: int | None = None
    tie_weights: bool = False  # the module has ``tie_weights()`` (Hugging Face): the fix calls it


__all__ = ["UntiedWeights"]
