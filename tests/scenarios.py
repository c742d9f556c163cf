"""Training-step scenarios for backward_doctor, as plain data (no pytest here).

A :class:`Scenario` is one notebook cell (``source``) plus a ``setup()`` that
builds the namespace the cell runs in (seeded model, optimizer, data), and
what ``bd.diagnose`` must say about the *last* of ``runs`` executions of the
cell in that namespace: ``findings[0]`` has ``kind``, ``line``, ``file``,
``module`` and, when set, ``op``.

Conventions
-----------
* Cell lines are 1-based lines of ``source``.  The expected line carries the
  trailing comment ``# <-- root cause``; :func:`cell_line` finds it.  Sources
  are written as ``dedent('''\\ ...''')`` so line 1 is the first statement.
* File-side scenarios (the bug lives in ``tests/buggy_models.py``) have
  ``file`` = the absolute path of that file and ``line`` = the line of its
  ``# BUG:<name>`` marker (:func:`bug_line`).
* ``raises`` = ``(ExceptionType, "message fragment")`` the cell raises when
  run *plainly* (``exec``, no backward_doctor).  ``None`` for scenarios that
  raise nothing (nonfinite, a silently-broken no_grad_path, oom -- which only
  raises under a ``memory_limit`` -- and hang, which never returns); such
  scenarios may provide ``check(namespace) -> bool`` proving the bug is real.
* ``evidence_mentions``: a namespace variable name that must appear somewhere
  in ``findings[0].evidence`` (used for non-finite *input data*).
* On the CPU-only test machine the ``meta`` device stands in for "cuda" in
  device-mismatch scenarios.
* Every setup seeds ``torch.manual_seed(0)`` first, so two calls give
  bit-identical namespaces.

Module paths (``module``) follow the contract: the dotted path from the
namespace variable to the innermost ``nn.Module`` whose ``forward`` was
running when the op ran, e.g. ``"model.0"`` for the first layer of an
``nn.Sequential`` named ``model``; ``None`` when the op ran outside any module
call (loss functions from ``torch.nn.functional`` in the cell, ``.backward()``).
"""

from __future__ import annotations

import math
import textwrap
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # imported as tests.scenarios (repo root on sys.path) ...
    from . import buggy_models as bm
except ImportError:  # ... or as a top-level module (tests/ on sys.path)
    import buggy_models as bm

KINDS = (
    "nonfinite",
    "inplace",
    "device_mismatch",
    "dtype_mismatch",
    "shape_mismatch",
    "index_out_of_range",
    "backward_twice",
    "no_grad_path",
    "oom",
    "hang",
)

ROOT_MARKER = "# <-- root cause"
BUGGY_MODELS_FILE = bm.PATH
bug_line = bm.bug_line


def cell_line(source: str, marker: str = ROOT_MARKER) -> int:
    """1-based line of ``source`` carrying ``marker`` (exactly one must)."""
    hits = [i for i, text in enumerate(source.splitlines(), start=1) if marker in text]
    if len(hits) != 1:
        raise LookupError(f"{marker!r} found {len(hits)} times in cell source")
    return hits[0]


@dataclass
class Scenario:
    name: str
    kind: Optional[str]  # None for CORRECT scenarios
    source: str
    setup: Callable[[], dict]
    line: Optional[int]
    module: Optional[str]
    op: Optional[str] = None
    file: Optional[str] = None
    runs: int = 1
    kwargs: dict = field(default_factory=dict)
    raises: Optional[tuple] = None  # (ExceptionType, "fragment") of a plain run
    check: Optional[Callable[[dict], bool]] = None  # extra proof on the namespace after a plain run
    evidence_mentions: Optional[str] = None
    doc: str = ""  # why this is a realistic situation

    def __repr__(self) -> str:  # short ids in pytest output
        return f"Scenario({self.name})"


def _cell(name, kind, source, setup, module, **kw) -> Scenario:
    """Scenario whose root-cause line is in the cell (marked ``# <-- root cause``)."""
    source = textwrap.dedent(source)
    return Scenario(name, kind, source, setup, cell_line(source), module, **kw)


def _in_file(name, kind, source, setup, module, bug, **kw) -> Scenario:
    """Scenario whose root-cause line is the ``# BUG:<bug>`` line of buggy_models.py."""
    source = textwrap.dedent(source)
    return Scenario(name, kind, source, setup, bug_line(bug), module, file=BUGGY_MODELS_FILE, **kw)


def _ns(**values) -> dict:
    """A notebook-like global namespace: the usual imports plus ``values``."""
    ns = {"torch": torch, "nn": nn, "F": F, "np": np, "math": math, "threading": threading, "time": time}
    ns.update(values)
    return ns


# ---------------------------------------------------------------------------
# helpers for ``check`` callables
# ---------------------------------------------------------------------------


def module_params(ns: dict, leaves: bool = True):
    """(qualified name, parameter) for every nn.Module in the namespace, plus
    (if ``leaves``) leaf tensors that require grad (raw-tensor models)."""
    seen = set()
    for var, value in ns.items():
        if isinstance(value, nn.Module):
            for pname, p in value.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield f"{var}.{pname}", p
        elif leaves and isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad:
            if id(value) not in seen:
                seen.add(id(value))
                yield var, value


def any_nonfinite_grad(ns: dict) -> bool:
    return any(p.grad is not None and not torch.isfinite(p.grad).all() for _, p in module_params(ns))


def nonfinite_loss_or_grad(ns: dict) -> bool:
    loss = ns.get("loss")
    bad_loss = isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all()
    return bad_loss or any_nonfinite_grad(ns)


def no_param_got_grad(ns: dict) -> bool:
    """True when no nn.Module parameter received a gradient (the loss itself may be a leaf)."""
    return all(p.grad is None for _, p in module_params(ns, leaves=False))


LEAF_INPLACE = (RuntimeError, "a leaf Variable that requires grad is being used in an in-place operation")
SAVED_INPLACE = (RuntimeError, "modified by an inplace operation")
DEVICE_ERR = (RuntimeError, "is not on the expected device")  # meta-vs-cpu wording
BACKWARD_TWICE = (RuntimeError, "Trying to backward through the graph a second time")
NO_GRAD_FN = (RuntimeError, "does not require grad and does not have a grad_fn")


# ===========================================================================
# nonfinite
# ===========================================================================


def _setup_count_features():
    torch.manual_seed(0)
    counts = torch.poisson(torch.full((64, 8), 1.5))  # ~22% zeros
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        counts=counts,
        y=torch.randn(64, 1),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_constant_column():
    torch.manual_seed(0)
    X = torch.randn(64, 6)
    X[:, 5] = 1.0  # an "is_active" flag that happens to be 1 for every row of this batch
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 2))
    return _ns(
        X=X,
        y=torch.randint(0, 2, (64,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_naive_softmax():
    torch.manual_seed(0)
    model = bm.NaiveSoftmaxClassifier(784, 10)
    return _ns(
        images=torch.randint(0, 256, (32, 784)).float(),  # raw pixels, never divided by 255
        labels=torch.randint(0, 10, (32,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
    )


def _setup_contrastive():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    return _ns(
        x=torch.randn(16, 16),
        labels=torch.randint(0, 4, (16,)),
        margin=1.0,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_protonet():
    torch.manual_seed(0)
    model = bm.ProtoNet(16, 8, 4)
    x = torch.randn(32, 16)
    model.init_prototypes(x)
    return _ns(
        x=x,
        y=torch.randint(0, 4, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_nan_features():
    torch.manual_seed(0)
    X_train = torch.randn(128, 6)
    X_train[5, 2] = float("nan")  # missing values read from a CSV
    X_train[40, 0] = float("nan")
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        X_train=X_train,
        y_train=torch.randn(128, 1),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_log_price_targets():
    torch.manual_seed(0)
    prices = torch.rand(64, 1) * 100
    prices[7] = 0.0  # a free item in the catalogue
    y_log = torch.log(prices)  # preprocessing done in an earlier cell: contains -inf
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        x=torch.randn(64, 10),
        y_log=y_log,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


NONFINITE = [
    _cell(
        "log_of_zero_count_features",
        "nonfinite",
        """\
        optimizer.zero_grad()
        feats = torch.log(counts)  # <-- root cause
        pred = model(feats)
        loss = F.mse_loss(pred, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_count_features,
        module=None,
        op="aten::log",
        check=nonfinite_loss_or_grad,
        doc="log-transforming count features that contain zeros (should be log1p).",
    ),
    _cell(
        "div_by_zero_standardize_constant_column",
        "nonfinite",
        """\
        optimizer.zero_grad()
        xb = (X - X.mean(0)) / X.std(0)  # <-- root cause
        loss = F.cross_entropy(model(xb), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_constant_column,
        module=None,
        op="aten::div",
        check=nonfinite_loss_or_grad,
        doc="per-batch standardisation without eps; a constant column has std 0 -> 0/0 = NaN.",
    ),
    _in_file(
        "exp_overflow_naive_softmax",
        "nonfinite",
        """\
        optimizer.zero_grad()
        probs = model(images)
        loss = F.nll_loss(torch.log(probs), labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_naive_softmax,
        module="model",
        op="aten::exp",
        bug="exp_overflow",
        check=nonfinite_loss_or_grad,
        doc="hand-written softmax without max-subtraction on unnormalised pixels: exp overflows.",
    ),
    _cell(
        "sqrt_at_zero_pairwise_distance_backward_only",
        "nonfinite",
        """\
        optimizer.zero_grad()
        emb = model(x)
        dist = (emb[:, None, :] - emb[None, :, :]).pow(2).sum(-1).sqrt()  # <-- root cause
        same = labels[:, None] == labels[None, :]
        loss = torch.where(same, dist, F.relu(margin - dist)).mean()
        loss.backward()
        optimizer.step()
        """,
        _setup_contrastive,
        module=None,
        op="aten::sqrt",
        check=lambda ns: torch.isfinite(ns["loss"]).all() and any_nonfinite_grad(ns),
        doc="contrastive loss with a manual pairwise distance: the diagonal is 0, forward is "
        "finite, d sqrt/dx at 0 is inf and the backward produces NaN grads.",
    ),
    _in_file(
        "sqrt_at_zero_prototype_distance_backward_only",
        "nonfinite",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_protonet,
        module="model",
        op="aten::sqrt",
        bug="sqrt_at_zero",
        check=lambda ns: torch.isfinite(ns["loss"]).all() and any_nonfinite_grad(ns),
        doc="prototypes initialised from the batch's own embeddings: distance exactly 0, "
        "NaN only in backward.",
    ),
    _cell(
        "nan_in_input_features",
        "nonfinite",
        """\
        optimizer.zero_grad()
        pred = model(X_train)  # <-- root cause
        loss = F.mse_loss(pred, y_train)
        loss.backward()
        optimizer.step()
        """,
        _setup_nan_features,
        module="model.0",  # the first op that consumes X_train is model.0's linear
        check=nonfinite_loss_or_grad,
        evidence_mentions="X_train",
        doc="tabular data with missing values (NaN) fed straight to the model.",
    ),
    _cell(
        "inf_in_log_targets",
        "nonfinite",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y_log)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_log_price_targets,
        module=None,
        check=nonfinite_loss_or_grad,
        evidence_mentions="y_log",
        doc="regression on log(price) where one price is 0: the targets hold -inf.",
    ),
]


# ===========================================================================
# inplace
# ===========================================================================


def _setup_raw_linear_regression():
    torch.manual_seed(0)
    X = torch.randn(64, 5)
    return _ns(
        X=X,
        y=X @ torch.randn(5, 1) + 0.1 * torch.randn(64, 1),
        w=torch.randn(5, 1, requires_grad=True),
        b=torch.zeros(1, requires_grad=True),
        lr=0.1,
    )


def _setup_mlp_classifier(in_features=10, hidden=32, classes=3, n=32, opt="adam"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    optimizer = (
        torch.optim.Adam(model.parameters(), lr=1e-3)
        if opt == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    return _ns(
        x=torch.randn(n, in_features),
        y=torch.randint(0, classes, (n,)),
        model=model,
        optimizer=optimizer,
        noise_std=0.01,
    )


def _setup_residual_autoencoder():
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(16, 16), nn.Linear(16, 16)
    params = list(encoder.parameters()) + list(decoder.parameters())
    return _ns(x=torch.randn(32, 16), encoder=encoder, decoder=decoder, optimizer=torch.optim.Adam(params, lr=1e-3))


def _setup_sigmoid_relu_sequential():
    torch.manual_seed(0)
    # Built from a config like activations=["sigmoid", "relu"] with inplace=True to "save memory".
    model = nn.Sequential(nn.Linear(10, 32), nn.Sigmoid(), nn.ReLU(inplace=True), nn.Linear(32, 2))
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 2, (16,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_residual_mlp():
    torch.manual_seed(0)
    model = bm.ResidualMLP(16, 32, 4, depth=1)
    return _ns(
        x=torch.randn(32, 16),
        y=torch.randint(0, 4, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_temperature():
    torch.manual_seed(0)
    model = bm.TemperatureScaledClassifier(16, 4)
    return _ns(
        x=torch.randn(32, 16),
        y=torch.randint(0, 4, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


_STD_STEP = """\
optimizer.zero_grad()
logits = model(x)
loss = F.cross_entropy(logits, y)
loss.backward()
optimizer.step()
"""

INPLACE = [
    _cell(
        "leaf_manual_sgd_update_without_no_grad",
        "inplace",
        """\
        pred = X @ w + b
        loss = ((pred - y) ** 2).mean()
        loss.backward()
        w -= lr * w.grad  # <-- root cause
        b -= lr * b.grad
        w.grad.zero_()
        b.grad.zero_()
        """,
        _setup_raw_linear_regression,
        module=None,
        op="aten::sub_",
        raises=LEAF_INPLACE,
        doc="from-scratch linear regression; the manual update is not wrapped in torch.no_grad().",
    ),
    _cell(
        "leaf_weight_noise_injection",
        "inplace",
        """\
        optimizer.zero_grad()
        for p in model.parameters():
            p += noise_std * torch.randn_like(p)  # <-- root cause
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_mlp_classifier,
        module=None,
        op="aten::add_",
        raises=LEAF_INPLACE,
        doc="weight-noise regularisation written as `p += ...` on parameters outside no_grad.",
    ),
    _cell(
        "residual_iadd_on_saved_tanh_output",
        "inplace",
        """\
        optimizer.zero_grad()
        h = torch.tanh(encoder(x))
        h += x  # <-- root cause
        loss = F.mse_loss(decoder(h), x)
        loss.backward()
        optimizer.step()
        """,
        _setup_residual_autoencoder,
        module=None,
        op="aten::add_",
        raises=SAVED_INPLACE,
        doc="residual connection written with `+=`; tanh saved its output for backward.",
    ),
    _cell(
        "inplace_relu_after_sigmoid_in_sequential",
        "inplace",
        """\
        optimizer.zero_grad()
        logits = model(x)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_sigmoid_relu_sequential,
        module="model.2",
        op="aten::relu_",
        raises=SAVED_INPLACE,
        doc="nn.ReLU(inplace=True) directly after nn.Sigmoid overwrites sigmoid's saved output.",
    ),
    _in_file(
        "residual_block_add_after_relu",
        "inplace",
        _STD_STEP,
        _setup_residual_mlp,
        module="model.blocks.0",
        op="aten::add_",
        bug="residual_add_",
        raises=SAVED_INPLACE,
        doc="custom residual block: relu, then `out.add_(identity)` on relu's saved output.",
    ),
    _in_file(
        "leaf_clamp_temperature_in_forward",
        "inplace",
        _STD_STEP,
        _setup_temperature,
        module="model",
        op="aten::clamp_",
        bug="clamp_temperature",
        raises=LEAF_INPLACE,
        doc="learnable temperature kept positive by clamping the Parameter in place in forward.",
    ),
]


# ===========================================================================
# device_mismatch (meta stands in for cuda), dtype_mismatch, shape_mismatch
# ===========================================================================


def _setup_model_on_device():
    torch.manual_seed(0)
    device = torch.device("meta")  # stand-in for torch.device("cuda") on a CPU-only box
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3)).to(device)
    return _ns(
        device=device,
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_noise_layer_on_device():
    torch.manual_seed(0)
    device = torch.device("meta")  # stand-in for "cuda"
    model = nn.Sequential(nn.Linear(10, 32), bm.GaussianNoise(0.1), nn.ReLU(), nn.Linear(32, 3)).to(device)
    return _ns(
        device=device,
        x=torch.randn(16, 10),
        y=torch.randint(0, 3, (16,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_numpy_features():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    return _ns(
        X_np=rng.normal(size=(64, 10)),  # float64, as numpy / pandas give it
        y=torch.randint(0, 3, (64,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_fourier():
    torch.manual_seed(0)
    model = bm.FourierFeatureNet(32, 64)
    return _ns(
        coords=torch.rand(256, 2),
        rgb=torch.rand(256, 3),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_int32_labels():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    return _ns(
        x=torch.randn(64, 10),
        y=torch.from_numpy(rng.integers(0, 3, size=64).astype(np.int32)),  # labels saved as int32
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_mnist_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    return _ns(
        images=torch.rand(32, 1, 28, 28),
        labels=torch.randint(0, 10, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_mnist_cnn():
    torch.manual_seed(0)
    model = bm.SmallCNN(1, 10)
    return _ns(
        images=torch.rand(8, 1, 28, 28),
        labels=torch.randint(0, 10, (8,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
    )


def _setup_cell_attention():
    torch.manual_seed(0)
    d = 16
    wq, wk, wv = nn.Linear(32, d), nn.Linear(32, d), nn.Linear(32, d)
    out_proj = nn.Linear(d, 32)
    params = [p for m in (wq, wk, wv, out_proj) for p in m.parameters()]
    return _ns(
        d=d,
        x=torch.randn(4, 8, 32),
        target=torch.randn(4, 8, 32),
        wq=wq,
        wk=wk,
        wv=wv,
        out_proj=out_proj,
        optimizer=torch.optim.Adam(params, lr=1e-3),
    )


DEVICE = [
    _cell(
        "model_on_device_batch_left_on_cpu",
        "device_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(x)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_model_on_device,
        module="model.0",
        raises=DEVICE_ERR,
        doc="model.to(device) but the batch was never moved.",
    ),
    _cell(
        "targets_left_on_cpu",
        "device_mismatch",
        """\
        optimizer.zero_grad()
        xb = x.to(device)
        logits = model(xb)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_model_on_device,
        module=None,
        raises=DEVICE_ERR,
        doc="inputs moved to the device, labels forgotten.",
    ),
    _in_file(
        "noise_layer_creates_tensor_on_cpu",
        "device_mismatch",
        """\
        optimizer.zero_grad()
        xb, yb = x.to(device), y.to(device)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        """,
        _setup_noise_layer_on_device,
        module="model.1",
        bug="noise_device",
        raises=DEVICE_ERR,
        doc="custom GaussianNoise layer uses torch.randn(x.shape) instead of randn_like(x).",
    ),
]

DTYPE = [
    _cell(
        "float64_numpy_features_into_float32_model",
        "dtype_mismatch",
        """\
        optimizer.zero_grad()
        xb = torch.from_numpy(X_np)
        logits = model(xb)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_numpy_features,
        module="model.0",
        raises=(RuntimeError, "must have the same dtype"),
        doc="numpy arrays default to float64; torch.from_numpy keeps it.",
    ),
    _in_file(
        "float64_buffer_in_fourier_features",
        "dtype_mismatch",
        """\
        optimizer.zero_grad()
        pred = model(coords)
        loss = F.mse_loss(pred, rgb)
        loss.backward()
        optimizer.step()
        """,
        _setup_fourier,
        module="model.encoding",
        bug="float64_buffer",
        raises=(RuntimeError, "same dtype"),
        doc="random Fourier projection drawn with numpy and registered as a float64 buffer.",
    ),
    _cell(
        "int32_class_labels",
        "dtype_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_int32_labels,
        module=None,
        raises=(RuntimeError, "expected target dtype to be Long"),
        doc="class labels stored as int32 (np.int32); cross_entropy wants int64.",
    ),
]

SHAPE = [
    _cell(
        "forgot_flatten_images_into_mlp",
        "shape_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(images)  # <-- root cause
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_mnist_mlp,
        module="model.0",
        raises=(RuntimeError, "shapes cannot be multiplied"),
        doc="(B, 1, 28, 28) images given to an MLP expecting (B, 784): forgot .flatten(1).",
    ),
    _in_file(
        "cnn_head_sized_for_32x32",
        "shape_mismatch",
        """\
        optimizer.zero_grad()
        logits = model(images)
        loss = F.cross_entropy(logits, labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_mnist_cnn,
        module="model.fc",
        bug="fc_in_features",
        raises=(RuntimeError, "shapes cannot be multiplied (8x784 and 1024x10)"),
        doc="CNN copied from a CIFAR example (32x32) and trained on MNIST (28x28).",
    ),
    _cell(
        "attention_scores_missing_transpose",
        "shape_mismatch",
        """\
        optimizer.zero_grad()
        q, k, v = wq(x), wk(x), wv(x)
        scores = q @ k / math.sqrt(d)  # <-- root cause
        out = out_proj(scores.softmax(-1) @ v)
        loss = F.mse_loss(out, target)
        loss.backward()
        optimizer.step()
        """,
        _setup_cell_attention,
        module=None,
        raises=(RuntimeError, "Expected size for first two dimensions of batch2 tensor"),
        doc="attention written in the cell: q @ k instead of q @ k.transpose(-2, -1).",
    ),
]


# ===========================================================================
# index_out_of_range
# ===========================================================================


def _setup_matrix_factorization():
    torch.manual_seed(0)
    n_users, n_items = 50, 40
    users = torch.randint(1, n_users + 1, (64,))  # ids are 1-based in the ratings file
    users[0] = n_users  # make sure the last user is in this batch
    user_emb, item_emb = nn.Embedding(n_users, 8), nn.Embedding(n_items, 8)
    params = list(user_emb.parameters()) + list(item_emb.parameters())
    return _ns(
        users=users,
        items=torch.randint(0, n_items, (64,)),
        ratings=torch.rand(64) * 5,
        user_emb=user_emb,
        item_emb=item_emb,
        optimizer=torch.optim.Adam(params, lr=1e-2),
    )


def _setup_tiny_lm_with_eos():
    torch.manual_seed(0)
    vocab_size = 32
    tokens = torch.randint(0, vocab_size, (4, 13))
    eos_id = vocab_size  # the tokenizer's "<eos>" was added after the embedding was sized
    tokens[:, 6] = eos_id  # packed sequences: two documents per row, separated by <eos>
    model = bm.TinyLM(vocab_size, 16)
    return _ns(
        tokens=tokens,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_one_based_labels():
    torch.manual_seed(0)
    labels = torch.randint(1, 11, (32,))  # 1..10 straight from the CSV
    labels[3] = 10
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))
    return _ns(
        x=torch.randn(32, 20),
        y=labels,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_semi_supervised():
    torch.manual_seed(0)
    y = torch.randint(0, 5, (32,))
    y[::4] = -1  # unlabeled examples marked with -1
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    return _ns(
        x=torch.randn(32, 20),
        y=y,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_dqn():
    torch.manual_seed(0)
    n_actions = 4  # the q-network was built for 4 actions ...
    q_net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, n_actions))
    target_net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, n_actions))
    target_net.load_state_dict(q_net.state_dict())
    actions = torch.randint(0, 5, (32,))  # ... but the env's action space has 5
    actions[0] = 4
    return _ns(
        states=torch.randn(32, 8),
        actions=actions,
        rewards=torch.randn(32),
        next_states=torch.randn(32, 8),
        dones=torch.zeros(32),
        gamma=0.99,
        q_net=q_net,
        target_net=target_net,
        optimizer=torch.optim.Adam(q_net.parameters(), lr=1e-3),
    )


def _setup_label_smoothing():
    torch.manual_seed(0)
    y = torch.randint(0, 6, (32,))  # a 6th class was added to the data, not to the model
    y[0] = 5
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    return _ns(
        x=torch.randn(32, 20),
        y=y,
        model=model,
        criterion=bm.LabelSmoothingLoss(0.1),
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


INDEX = [
    _cell(
        "embedding_user_ids_one_based",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        u = user_emb(users)  # <-- root cause
        v = item_emb(items)
        pred = (u * v).sum(-1)
        loss = F.mse_loss(pred, ratings)
        loss.backward()
        optimizer.step()
        """,
        _setup_matrix_factorization,
        module="user_emb",
        raises=(IndexError, "index out of range in self"),
        doc="matrix factorisation with 1-based user ids: id == num_embeddings.",
    ),
    _in_file(
        "embedding_eos_token_id_equals_vocab_size",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_tiny_lm_with_eos,
        module="model.tok_emb",
        bug="token_embedding",
        raises=(IndexError, "index out of range in self"),
        doc="an <eos> separator id added to the tokenizer is one past the embedding table.",
    ),
    _cell(
        "cross_entropy_target_one_based",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_one_based_labels,
        module=None,
        raises=(IndexError, "Target 10 is out of bounds"),
        doc="labels 1..10 for 10 classes.",
    ),
    _cell(
        "cross_entropy_negative_target_for_unlabeled",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = F.cross_entropy(logits, y)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_semi_supervised,
        module=None,
        raises=(IndexError, "Target -1 is out of bounds"),
        doc="unlabeled rows marked -1 but cross_entropy's ignore_index is -100.",
    ),
    _cell(
        "dqn_gather_action_out_of_range",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            target = rewards + gamma * (1 - dones) * target_net(next_states).max(1).values
        q_sa = q_net(states).gather(1, actions[:, None]).squeeze(1)  # <-- root cause
        loss = F.smooth_l1_loss(q_sa, target)
        loss.backward()
        optimizer.step()
        """,
        _setup_dqn,
        module=None,
        op="aten::gather",
        raises=(RuntimeError, "index 4 is out of bounds for dimension 1 with size 4"),
        doc="DQN update; the replay buffer holds actions of a 5-action env, the net has 4 outputs.",
    ),
    _in_file(
        "label_smoothing_loss_gather_out_of_range",
        "index_out_of_range",
        """\
        optimizer.zero_grad()
        logits = model(x)
        loss = criterion(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_label_smoothing,
        module="criterion",
        op="aten::gather",
        bug="label_gather",
        raises=(RuntimeError, "index 5 is out of bounds for dimension 1 with size 5"),
        doc="custom label-smoothing loss (an nn.Module) gathers a class id the model lacks.",
    ),
]


# ===========================================================================
# backward_twice
# ===========================================================================


def _setup_vae():
    torch.manual_seed(0)
    encoder, to_mu, to_logvar, decoder = nn.Linear(20, 32), nn.Linear(32, 4), nn.Linear(32, 4), nn.Linear(4, 20)
    params = [p for m in (encoder, to_mu, to_logvar, decoder) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 20),
        encoder=encoder,
        to_mu=to_mu,
        to_logvar=to_logvar,
        decoder=decoder,
        optimizer=torch.optim.Adam(params, lr=1e-3),
    )


def _setup_gru_stream():
    torch.manual_seed(0)
    rnn, head = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 8)
    return _ns(
        x=torch.randn(4, 5, 8),
        y=torch.randn(4, 5, 8),
        hidden=torch.zeros(1, 4, 16),  # initial state, carried from call to call
        rnn=rnn,
        head=head,
        optimizer=torch.optim.SGD(list(rnn.parameters()) + list(head.parameters()), lr=0.1),
    )


def _setup_stateful_lstm():
    torch.manual_seed(0)
    model = bm.StatefulLSTM(8, 16)
    return _ns(
        x=torch.randn(4, 5, 8),
        y=torch.randn(4, 5, 8),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_precomputed_features():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
    head = nn.Linear(32, 5)
    x = torch.randn(64, 20)
    feats = backbone(x)  # "cache the features once" -- but outside torch.no_grad()
    return _ns(
        x=x,
        y=torch.randint(0, 5, (64,)),
        backbone=backbone,
        head=head,
        feats=feats,
        optimizer=torch.optim.Adam(head.parameters(), lr=1e-3),
    )


BACKWARD_TWICE = [
    _cell(
        "vae_separate_backward_for_each_loss_term",
        "backward_twice",
        """\
        optimizer.zero_grad()
        h = F.relu(encoder(x))
        mu, logvar = to_mu(h), to_logvar(h)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        recon_loss = F.mse_loss(decoder(z), x)
        kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).mean()
        recon_loss.backward()
        kl.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_vae,
        module=None,
        raises=BACKWARD_TWICE,
        doc="VAE: backward() called per loss term; the shared encoder graph is freed by the first.",
    ),
    _cell(
        "rnn_hidden_state_carried_across_cell_runs",
        "backward_twice",
        """\
        optimizer.zero_grad()
        out, hidden = rnn(x, hidden)
        loss = F.mse_loss(head(out), y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_gru_stream,
        module=None,
        runs=2,
        raises=BACKWARD_TWICE,
        doc="truncated BPTT without hidden.detach(): the 2nd run of the cell backprops into the 1st.",
    ),
    _cell(
        "stateful_lstm_module_keeps_graph",
        "backward_twice",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = F.mse_loss(pred, y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_stateful_lstm,
        module=None,
        runs=2,
        raises=BACKWARD_TWICE,
        doc="the LSTM module in buggy_models.py stores its state without detaching it.",
    ),
    _cell(
        "features_cached_with_graph_in_earlier_cell",
        "backward_twice",
        """\
        optimizer.zero_grad()
        logits = head(feats)
        loss = F.cross_entropy(logits, y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_precomputed_features,
        module=None,
        runs=2,
        raises=BACKWARD_TWICE,
        doc="backbone features cached once (with grad) and reused by every step.",
    ),
]


# ===========================================================================
# no_grad_path
# ===========================================================================


def _setup_distillation():
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    teacher.eval().requires_grad_(False)  # "pretrained" teacher, frozen as usual
    student = nn.Linear(20, 5)
    return _ns(
        x=torch.randn(32, 20),
        T=2.0,
        teacher=teacher,
        student=student,
        optimizer=torch.optim.Adam(student.parameters(), lr=1e-3),
    )


def _setup_numpy_metric():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    return _ns(
        x=torch.randn(32, 10),
        y_np=np.random.default_rng(0).normal(size=(32, 1)).astype(np.float32),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_two_heads():
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    cls_head, box_head = nn.Linear(32, 3), nn.Linear(32, 4)
    params = [p for m in (backbone, cls_head, box_head) for p in m.parameters()]
    return _ns(
        x=torch.randn(16, 16),
        y=torch.randint(0, 3, (16,)),
        boxes=torch.rand(16, 4),
        backbone=backbone,
        cls_head=cls_head,
        box_head=box_head,
        optimizer=torch.optim.SGD(params, lr=0.1),
    )


def _setup_finetune_all_frozen():
    torch.manual_seed(0)
    model = bm.FineTuneNet(20, 32, 5)
    model.freeze_backbone()
    return _ns(
        x=torch.randn(32, 20),
        y=torch.randint(0, 5, (32,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_linear_probe():
    torch.manual_seed(0)
    model = bm.LinearProbe(10, 3)
    return _ns(
        x=torch.randn(32, 10),
        y=torch.randint(0, 3, (32,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


NO_GRAD = [
    _cell(
        "distillation_student_inside_no_grad_block",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            teacher_logits = teacher(x)
            student_logits = student(x)  # <-- root cause
        loss = F.kl_div(
            F.log_softmax(student_logits / T, dim=-1),
            F.softmax(teacher_logits / T, dim=-1),
            reduction="batchmean",
        ) * T * T
        loss.backward()
        optimizer.step()
        """,
        _setup_distillation,
        module="student",
        raises=NO_GRAD_FN,
        doc="knowledge distillation: the student forward slipped into the teacher's no_grad block. "
        "The (frozen) teacher's no_grad is legitimate: only the student's op consumes "
        "parameters that require grad, so the graph is cut at the student line.",
    ),
    _cell(
        "detach_for_logging_reused_for_loss",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        logits = model(x).detach()  # <-- root cause
        acc = (logits.argmax(1) == y).float().mean()
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        lambda: _setup_mlp_classifier(opt="sgd"),
        module=None,
        raises=NO_GRAD_FN,
        doc="logits detached for an accuracy metric, then reused for the loss.",
    ),
    _cell(
        "numpy_metric_used_as_loss",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        pred = model(x)
        loss = torch.tensor(np.mean((pred.detach().numpy() - y_np) ** 2))  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_numpy_metric,
        module=None,
        raises=NO_GRAD_FN,
        doc="loss computed in numpy (after the detach() numpy() demands) and wrapped back.",
    ),
    _cell(
        "loss_rebuilt_from_item_with_requires_grad",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        h = backbone(x)
        loss_cls = F.cross_entropy(cls_head(h), y)
        loss_box = F.l1_loss(box_head(h).sigmoid(), boxes)
        loss = torch.tensor(loss_cls.item() + 0.5 * loss_box.item(), requires_grad=True)  # <-- root cause
        loss.backward()
        optimizer.step()
        """,
        _setup_two_heads,
        module=None,
        check=no_param_got_grad,
        doc="multi-task loss summed via .item(); requires_grad=True silences the error, "
        "so nothing raises and no parameter ever gets a gradient.",
    ),
    _cell(
        "all_parameters_frozen",
        "no_grad_path",
        """\
        optimizer.zero_grad()
        logits = model(x)  # <-- root cause
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        _setup_finetune_all_frozen,
        module="model",
        raises=NO_GRAD_FN,
        doc="fine-tuning where freeze_backbone() (buggy_models.py) froze the head as well.",
    ),
    _in_file(
        "no_grad_decorator_on_forward",
        "no_grad_path",
        _STD_STEP,
        _setup_linear_probe,
        module="model.fc",
        bug="no_grad_forward",
        raises=NO_GRAD_FN,
        doc="@torch.no_grad() on forward (copied from a predict helper).",
    ),
]


# ===========================================================================
# oom  (simulated device memory via memory_limit)
# ===========================================================================


def _setup_wide_batch_mlp():
    torch.manual_seed(0)
    # 397k params = 1.6 MB.  With a batch of 256 a full Adam step (params, grads,
    # 2 moments, activations) needs ~9 MB and fits in 12 MB; the user raised the
    # batch to 4096 and the first hidden activation alone is 4096*1024*4 = 16.8 MB.
    model = nn.Sequential(nn.Linear(128, 1024), nn.ReLU(), nn.Linear(1024, 256), nn.ReLU(), nn.Linear(256, 10))
    return _ns(
        xb=torch.randn(4096, 128),  # 2.1 MB
        yb=torch.randint(0, 10, (4096,)),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_long_context_lm():
    torch.manual_seed(0)
    # ~0.4 MB of params.  At T=128 the (4, 4, T, T) score matrix is 1 MB; the
    # user raised the context to T=512: 4*4*512*512*4 = 16.8 MB > 8 MB.
    model = bm.LongContextLM(vocab_size=100, dim=64, n_head=4, max_len=1024)
    return _ns(
        tokens=torch.randint(0, 100, (4, 513)),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
    )


def _setup_big_vocab_bag_of_words():
    torch.manual_seed(0)
    # A 32768 x 32 EmbeddingBag is 4.2 MB and fits the 6 MB device, and the
    # forward pass is tiny (64 documents x 20 tokens).  But backward makes a
    # *dense* gradient as big as the table: another 4.2 MB (sparse=True, or a
    # bigger device, would fix it).
    model = nn.Sequential(nn.EmbeddingBag(32768, 32, mode="mean"), nn.Linear(32, 2))
    return _ns(
        docs=torch.randint(0, 32768, (64, 20)),
        y=torch.randint(0, 2, (64,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


OOM = [
    _cell(
        "batch_size_raised_to_4096",
        "oom",
        """\
        optimizer.zero_grad()
        logits = model(xb)  # <-- root cause
        loss = F.cross_entropy(logits, yb)
        loss.backward()
        optimizer.step()
        """,
        _setup_wide_batch_mlp,
        module="model.0",
        kwargs={"memory_limit": "12MB"},
        doc="MLP that trains fine at batch 256 on a 12 MB device; batch 4096 does not fit.",
    ),
    _in_file(
        "attention_scores_at_long_context",
        "oom",
        """\
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_long_context_lm,
        module="model.attn",
        bug="attn_scores",
        kwargs={"memory_limit": 8 * 1024 * 1024},
        doc="naive attention materialises a (B, H, T, T) matrix; context raised from 128 to 512.",
    ),
    _cell(
        "dense_embedding_gradient_in_backward",
        "oom",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(docs), y)
        loss.backward()  # <-- root cause
        optimizer.step()
        """,
        _setup_big_vocab_bag_of_words,
        # The allocation that crosses the limit is the backward of model.0 (its
        # dense weight gradient); backward ops are attributed to the module of
        # the forward op they differentiate (backward() itself is in no module).
        module="model.0",
        kwargs={"memory_limit": "6MB"},
        doc="large-vocabulary bag-of-words model: the weights fit, their dense gradient does not.",
    ),
]


# ===========================================================================
# hang  (small timeouts; the plain tests interrupt them with SIGALRM)
# ===========================================================================


def _setup_prefetch_never_started():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    ns = _ns(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    batch_ready = threading.Event()
    batch = {}

    def prefetch():
        batch["x"], batch["y"] = torch.randn(16, 10), torch.randint(0, 2, (16,))
        batch_ready.set()

    # The prefetch thread is created but never .start()ed.
    ns.update(batch_ready=batch_ready, batch=batch, loader_thread=threading.Thread(target=prefetch, daemon=True))
    return ns


def _setup_one_class_labels():
    torch.manual_seed(0)
    all_labels = torch.randint(0, 2, (200,))
    keep = all_labels == 0  # a filtering bug dropped every positive example
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1))
    return _ns(
        X_all=torch.randn(200, 10)[keep],
        labels=all_labels[keep].float(),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_metrics_logger():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    metrics_lock = threading.Lock()
    flush_requested = threading.Event()
    holding = threading.Event()

    def metrics_logger():
        # Holds the lock while waiting for the training loop's flush request; the
        # training loop only sends it after taking the same lock -> deadlock.
        # (The 60 s cap only keeps leaked test threads from living forever.)
        with metrics_lock:
            holding.set()
            flush_requested.wait(timeout=60)

    threading.Thread(target=metrics_logger, daemon=True, name="metrics-logger").start()
    holding.wait()
    return _ns(
        x=torch.randn(16, 10),
        y=torch.randint(0, 2, (16,)),
        history=[],
        metrics_lock=metrics_lock,
        flush_requested=flush_requested,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
    )


def _setup_normalized_mlp():
    torch.manual_seed(0)
    model = bm.NormalizedMLP(8, 16, 1)
    return _ns(
        x=torch.randn(32, 8),
        y=torch.randn(32, 1),
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


HANG = [
    _cell(
        "wait_for_prefetch_thread_never_started",
        "hang",
        """\
        batch_ready.wait()  # <-- root cause
        optimizer.zero_grad()
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        loss.backward()
        optimizer.step()
        """,
        _setup_prefetch_never_started,
        module=None,
        kwargs={"timeout": 1.0},
        doc="hand-rolled prefetcher: the main thread waits on an Event a never-started thread sets.",
    ),
    _cell(
        "resample_until_batch_has_both_classes",
        "hang",
        """\
        idx = torch.randint(0, len(labels), (32,))
        while labels[idx].unique().numel() < 2: idx = torch.randint(0, len(labels), (32,))  # <-- root cause
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(model(X_all[idx]).squeeze(1), labels[idx])
        loss.backward()
        optimizer.step()
        """,
        _setup_one_class_labels,
        module=None,
        kwargs={"timeout": 1.0},
        doc="rejection-sampling a batch with both classes (for AUC) from data with only one class: "
        "an endless loop (written on one line so the stuck line is unambiguous).",
    ),
    _cell(
        "deadlock_with_metrics_logger_thread",
        "hang",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        with metrics_lock:  # <-- root cause
            history.append(loss.item())
            flush_requested.set()
        """,
        _setup_metrics_logger,
        module=None,
        kwargs={"timeout": 1.5},
        doc="lock-order deadlock with a background logging thread.",
    ),
    _in_file(
        "normalizer_relocks_its_own_lock",
        "hang",
        """\
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_normalized_mlp,
        module="model.norm",
        bug="stats_lock_deadlock",
        kwargs={"timeout": 1.0},
        doc="module re-acquires its own non-reentrant threading.Lock (should be an RLock).",
    ),
]


FAILING: list[Scenario] = NONFINITE + INPLACE + DEVICE + DTYPE + SHAPE + INDEX + BACKWARD_TWICE + NO_GRAD + OOM + HANG


# ===========================================================================
# CORRECT steps: no findings, 3 runs in the same namespace
# ===========================================================================


def _setup_cnn_bn():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )
    return _ns(
        images=torch.randn(8, 3, 16, 16),
        labels=torch.randint(0, 10, (8,)),
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4),
    )


def _setup_tiny_gpt():
    torch.manual_seed(0)
    model = bm.TinyGPT(vocab_size=50, dim=32, n_head=2, max_len=16, p=0.1)
    return _ns(
        tokens=torch.randint(0, 50, (4, 17)),
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1),
    )


def _setup_legal_inplace():
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(inplace=True))
    fc, head = nn.Linear(32, 32), nn.Linear(32, 4)
    return _ns(
        x=torch.randn(32, 16),
        y=torch.randint(0, 4, (32,)),
        stem=stem,
        fc=fc,
        head=head,
        params=[p for m in (stem, fc, head) for p in m.parameters()],
        lr=0.05,
        wd=1e-4,
    )


def _setup_eval_after_step():
    ns = _setup_mlp_classifier(in_features=10, hidden=32, classes=3, n=32)
    ns.update(x_val=torch.randn(64, 10), y_val=torch.randint(0, 3, (64,)), val_history=[])
    return ns


def _setup_padded_lm():
    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (4, 17))
    targets = tokens[:, 1:].clone()
    targets[0, 10:] = -100  # padding positions, ignored by cross_entropy's default ignore_index
    targets[2, 5:] = -100
    model = bm.TinyGPT(vocab_size=50, dim=32, n_head=2, max_len=16, p=0.0)
    return _ns(
        inputs=tokens[:, :-1],
        targets=targets,
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-3),
    )


def _setup_partial_freeze():
    torch.manual_seed(0)
    model = bm.FineTuneNet(20, 32, 5)
    for p in model.backbone.parameters():
        p.requires_grad_(False)
    return _ns(
        x=torch.randn(32, 20),
        y=torch.randint(0, 5, (32,)),
        model=model,
        optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
    )


def _correct(name, source, setup, doc=""):
    return Scenario(name, None, textwrap.dedent(source), setup, None, None, doc=doc)


CORRECT: list[Scenario] = [
    _correct(
        "mlp_adam",
        _STD_STEP,
        _setup_mlp_classifier,
        doc="the canonical step.",
    ),
    _correct(
        "cnn_batchnorm_sgd_momentum",
        """\
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        """,
        _setup_cnn_bn,
        doc="BatchNorm2d updates running stats in place (buffers) -- legal.",
    ),
    _correct(
        "gpt_block_dropout_causal_mask",
        """\
        model.train()
        optimizer.zero_grad()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_tiny_gpt,
        doc="-inf from masked_fill is intentional; softmax turns it into exact zeros.",
    ),
    _correct(
        "autocast_bf16_step",
        """\
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        """,
        lambda: _setup_mlp_classifier(in_features=16, hidden=64, classes=4, n=32),
        doc="mixed precision on CPU: bf16 activations, fp32 params/grads; not a dtype mismatch.",
    ),
    _correct(
        "legal_inplace_ops_and_manual_sgd",
        """\
        for p in params:
            p.grad = None
        h = stem(x)  # Linear -> BatchNorm1d -> ReLU(inplace=True): BN does not save its output
        h = fc(h)
        h = h.relu_()  # fc's output is not saved by addmm's backward
        loss = F.cross_entropy(head(h), y)
        loss.backward()
        with torch.no_grad():
            for p in params:
                p.mul_(1 - lr * wd).add_(p.grad, alpha=-lr)
        """,
        _setup_legal_inplace,
        doc="in-place ops that autograd allows, and a hand-written SGD update under no_grad.",
    ),
    _correct(
        "loss_item_appended_to_history",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        """,
        lambda: {**_setup_mlp_classifier(), "losses": []},
        doc=".item() for logging, after backward: no graph cut.",
    ),
    _correct(
        "eval_under_no_grad_after_step",
        """\
        model.train()
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        model.eval()
        with torch.no_grad():
            val_loss = F.cross_entropy(model(x_val), y_val)
            val_acc = (model(x_val).argmax(1) == y_val).float().mean()
        val_history.append((val_loss.item(), val_acc.item()))
        """,
        _setup_eval_after_step,
        doc="no_grad only around evaluation, which no backward depends on.",
    ),
    _correct(
        "gradient_clipping",
        """\
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
        optimizer.step()
        """,
        _setup_mlp_classifier,
        doc="clip_grad_norm_ scales .grad in place under no_grad: legal.",
    ),
    _correct(
        "tbptt_hidden_detached",
        """\
        optimizer.zero_grad()
        out, hidden = rnn(x, hidden.detach())
        loss = F.mse_loss(head(out), y)
        loss.backward()
        optimizer.step()
        """,
        _setup_gru_stream,
        doc="the fixed version of rnn_hidden_state_carried_across_cell_runs.",
    ),
    _correct(
        "lm_padding_with_ignore_index",
        """\
        optimizer.zero_grad()
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        """,
        _setup_padded_lm,
        doc="negative targets equal to ignore_index (-100) are legal.",
    ),
    _correct(
        "partially_frozen_backbone",
        _STD_STEP,
        _setup_partial_freeze,
        doc="only the backbone is frozen; the head still trains.",
    ),
    _correct(
        "distillation_teacher_under_no_grad",
        """\
        optimizer.zero_grad()
        with torch.no_grad():
            teacher_logits = teacher(x)
        student_logits = student(x)
        loss = F.kl_div(
            F.log_softmax(student_logits / T, dim=-1),
            F.softmax(teacher_logits / T, dim=-1),
            reduction="batchmean",
        ) * T * T
        loss.backward()
        optimizer.step()
        """,
        _setup_distillation,
        doc="the fixed version of distillation_student_inside_no_grad_block.",
    ),
]

ALL: list[Scenario] = FAILING + CORRECT
BY_NAME: dict[str, Scenario] = {s.name: s for s in ALL}
