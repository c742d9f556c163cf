"""The trace: what one run recorded, as inert typed dataclasses (strings, shapes, sizes, small
statistics; never a tensor). It round-trips through JSON, so every layer above it (analysis, report,
render) works on a saved trace as on a live one.

>>> t = Trace(source="x = 1")
>>> Trace.from_dict(t.to_dict()) == t
True
"""
from __future__ import annotations

from .accumulation import Accumulation, AccumulationCheck, BackwardCall, StepWindow, ZeroGradCall
from .precision import (ClipCall, LowPrecisionUpdate, ParamUpdate, Precision, ScalerStep, ScalerSteps, UnpairedStep,
                        WeightsCast)
from .parts import (Carrier, Compilation, GraphHolder, LossInfo, NonFiniteScalar, OomInfo, OptimizerStep,
                    OptimizerSummary, ParameterTotals, RunHistory, SourceExcerpt, StaleStep)
from .records import (CATEGORIES, PHASES, ExceptionInfo, FailedOp, IndexCheck, InplaceEvent, MemoryTimeline,
                      NonFiniteEvent, OpRecord, ParamInfo, TensorMeta, TensorStats, Trace, Where)
from .stacks import FrameInfo, LoaderRecord, ThreadStack, WorkerRecord

__all__ = ["Accumulation", "AccumulationCheck", "BackwardCall", "ClipCall", "LowPrecisionUpdate", "ParamUpdate",
           "Precision", "ScalerStep", "ScalerSteps", "UnpairedStep", "WeightsCast", "StepWindow", "ZeroGradCall", "CATEGORIES", "PHASES", "Carrier", "Compilation", "ExceptionInfo", "FailedOp", "FrameInfo", "GraphHolder",
           "InplaceEvent", "LossInfo", "MemoryTimeline", "NonFiniteEvent", "NonFiniteScalar", "OomInfo", "OpRecord",
           "OptimizerStep", "OptimizerSummary", "ParamInfo", "ParameterTotals", "RunHistory", "SourceExcerpt", "StaleStep",
           "TensorMeta", "ThreadStack", "Trace", "Where", "LoaderRecord", "WorkerRecord"]
