"""Training idioms: the compatibility tier of what real training scripts do, written in our own words.

Each idiom is a small, seeded, CPU-only, offline training setup (tiny models, 3-6 optimizer steps): a *setup*
that fills a namespace (what a notebook's earlier cells hold: model, optimizer, data, the user's own functions
and classes) and a *cell* (the source that trains). :func:`build` makes a fresh namespace from the seed, the
same every time; ``tests/test_idioms.py`` runs each cell plainly and under every entry point of the doctor
(``diagnose``, ``%%backward_doctor``, ``%backward_doctor on``, ``python -m backward_doctor run``, the library
callbacks) and compares everything the step changed, bit for bit (:func:`state_of`, :func:`differences`).

Code a user writes (a model class, ``get_batch``, a ``train(epoch)`` function) is defined from source with
``library_loops.define``, in a file of its own named after the idiom (``<idiom>__<what>_<n>.py``), as a notebook
cell defines it; the cell itself runs from such a file in a script (:func:`run_in_file`), so a finding's file
says which idiom it is about.

>>> ns = build("opt_sgd_momentum")
>>> run_in_file("opt_sgd_momentum", ns)["optimizer"].state_dict()["state"][0]["momentum_buffer"].shape
torch.Size([32, 16])
"""
from __future__ import annotations

import math
import os
import textwrap
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import library_loops as ll
from compat_workloads import bits


@dataclass(frozen=True)
class Idiom:
    name: str
    setup: Callable[..., None]   # setup(ns) fills ns; a library idiom's setup(ns, callbacks) too
    cell: str                    # the source that trains
    library: str | None = None   # "hf", "lightning", "accelerate": a library runs (part of) the loop
    trains_visibly: bool = True  # calls backward() or an optimizer's step(): always on must watch it (README)


#: name -> idiom, in the order they were declared
IDIOMS: dict[str, Idiom] = {}
#: the seed every cell starts from (set after the setup, so the cell's own randomness is the same each run)
CELL_SEED = 1234


def idiom(cell: str, name: str | None = None, library: str | None = None, trains_visibly: bool = True):
    def declare(setup: Callable[..., None]) -> Callable[..., None]:
        key = name or setup.__name__
        assert key not in IDIOMS, key
        IDIOMS[key] = Idiom(key, setup, textwrap.dedent(cell), library, trains_visibly)
        return setup
    return declare


def build(name: str, ns: dict[str, Any] | None = None, callbacks: list | None = None) -> dict[str, Any]:
    """The namespace of idiom *name*, fresh from its seed, filled into *ns* (a new dict unless given: a shell's
    ``user_ns``); *callbacks* go to a library idiom's trainer."""
    it = IDIOMS[name]
    ns = {} if ns is None else ns
    if it.library in ("hf", "lightning"):
        it.setup(ns, callbacks)
    else:
        assert callbacks is None, f"{name} runs no library loop: no callbacks"
        it.setup(ns)
    torch.manual_seed(CELL_SEED)
    return ns


def run_in_file(name: str, ns: dict[str, Any]) -> dict[str, Any]:
    """Run idiom *name*'s cell in *ns* from a file of its own (``<name>__cell_<n>.py``), as a script runs it."""
    return ll.define(IDIOMS[name].cell, ns, name=f"{name}__cell")


def idiom_of_file(path: str | None) -> str | None:
    """The idiom a file written by :func:`define` / :func:`run_in_file` belongs to (None: another file)."""
    if not path:
        return None
    base = os.path.basename(path)
    name = base.split("__", 1)[0]
    return name if "__" in base and name in IDIOMS else None


def define(source: str, ns: dict[str, Any], idiom_name: str, what: str) -> dict[str, Any]:
    return ll.define(source, ns, name=f"{idiom_name}__{what}")


# ============================================================================ state, compared bit for bit
def state_of(ns: dict[str, Any], names: list[str] | None = None) -> dict[str, Any]:
    """Everything a training cell may change, flattened to ``key -> exact value``: parameters, their gradients
    and buffers (and each module's train/eval mode) of every module; every entry of every optimizer's
    ``state_dict()`` (state and param groups: lr, betas, ...); schedulers' last lr and state; a ``GradScaler``'s
    state and scale; a library trainer's optimizer, scheduler and step count; tensors, numbers and strings held
    by name, in lists and dicts (losses logged, an EMA's tensors, a ``torch.func`` parameter dict); the global
    RNG. Tensors as ``compat_workloads.bits`` (dtype, shape, raw bytes). *names*: only those names (a missing
    one is ``"<missing>"``)."""
    out: dict[str, Any] = {}
    for name in sorted(ns if names is None else names):
        if name.startswith("_"):
            continue
        if name not in ns:
            out[name] = "<missing>"
            continue
        _walk(name, ns[name], out, 0)
    out["<torch RNG>"] = bits(torch.get_rng_state())
    return out


def _walk(key: str, v: Any, out: dict[str, Any], depth: int) -> None:
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

    if depth > 8 or isinstance(v, type):
        return
    if isinstance(v, torch.Tensor):
        out[key] = bits(v)
        if v.is_leaf and v.grad is not None:
            out[key + ".grad"] = bits(v.grad)
    elif v is None or isinstance(v, (bool, int, float, str)):
        out[key] = v
    elif isinstance(v, nn.Module):
        for n, p in v.named_parameters(remove_duplicate=False):
            out[f"{key}.{n}"] = bits(p)
            out[f"{key}.{n}.grad"] = None if p.grad is None else bits(p.grad)
        for n, b in v.named_buffers(remove_duplicate=False):
            out[f"{key}.{n}"] = bits(b)
        out[f"{key}.training"] = v.training
    elif isinstance(v, torch.optim.Optimizer):
        sd = v.state_dict()
        _walk(f"{key}.state", sd["state"], out, depth + 1)
        for i, group in enumerate(sd["param_groups"]):
            for k, x in group.items():
                _walk(f"{key}.param_groups[{i}].{k}", x, out, depth + 1)
    elif isinstance(v, (LRScheduler, ReduceLROnPlateau)):
        _walk(f"{key}.last_lr", list(v.get_last_lr()), out, depth + 1)
        _walk(f"{key}.state_dict", {k: x for k, x in v.state_dict().items() if k != "optimizer"}, out, depth + 1)
    elif isinstance(v, torch.amp.GradScaler):
        out[f"{key}.enabled"] = v.is_enabled()
        out[f"{key}.scale"] = v.get_scale()
        _walk(f"{key}.state_dict", v.state_dict(), out, depth + 1)
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _walk(f"{key}[{i}]", x, out, depth + 1)
    elif isinstance(v, dict):
        for k, x in v.items():
            if isinstance(k, (str, int)):
                _walk(f"{key}[{k!r}]", x, out, depth + 1)
    elif hasattr(v, "create_optimizer_and_scheduler"):          # a transformers Trainer
        _walk(f"{key}.optimizer", v.optimizer, out, depth + 1)
        _walk(f"{key}.lr_scheduler", v.lr_scheduler, out, depth + 1)
        out[f"{key}.global_step"] = v.state.global_step
    elif hasattr(v, "lr_scheduler_configs") and hasattr(v, "optimizers"):   # a Lightning Trainer
        _walk(f"{key}.optimizers", list(v.optimizers), out, depth + 1)
        _walk(f"{key}.lr_schedulers", [c.scheduler for c in v.lr_scheduler_configs], out, depth + 1)
        out[f"{key}.global_step"] = v.global_step


def differences(plain: dict[str, Any], other: dict[str, Any], limit: int = 12) -> list[str]:
    """What differs between two :func:`state_of` results, in words (empty: bit-identical)."""
    diffs = [f"{k}: only in the plain run" for k in plain if k not in other]
    diffs += [f"{k}: not in the plain run" for k in other if k not in plain]
    for k, a in plain.items():
        if k not in other:
            continue
        b = other[k]
        if isinstance(a, tuple) and isinstance(b, tuple):
            if a[:2] != b[:2]:
                diffs.append(f"{k}: {a[0]}{list(a[1])} (plain) vs {b[0]}{list(b[1])}")
            elif not torch.equal(a[2], b[2]):
                diffs.append(f"{k}: {a[0]}{list(a[1])} values differ")
        elif type(a) is not type(b) or a != b:
            diffs.append(f"{k}: {a!r} (plain) vs {b!r}")
    return diffs[:limit] + ([f"... {len(diffs) - limit} more"] if len(diffs) > limit else [])


# ============================================================================ shared pieces
def _data(ns: dict[str, Any], n: int = 48, d_in: int = 16, classes: int = 5, seed: int = 7) -> None:
    g = torch.Generator().manual_seed(seed)
    ns.update(X=torch.randn(n, d_in, generator=g), Y=torch.randint(0, classes, (n,), generator=g), losses=[])


def _common(ns: dict[str, Any]) -> None:
    ns.update(torch=torch, nn=nn, F=F, math=math)


def _mlp(seed: int = 0, hidden: int = 32, bn: bool = False, dropout: float = 0.0, depth: int = 2) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, hidden)]
    if bn:
        layers.append(nn.BatchNorm1d(hidden))
    layers.append(nn.ReLU())
    for _ in range(depth - 2):
        layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(hidden, 5))
    return nn.Sequential(*layers)


#: The plain loop every optimizer idiom runs: four mini-batches, zero_grad / backward / step, the loss logged.
STEP_LOOP = """\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
"""


# ============================================================================ every optimizer in torch.optim
#: name -> (class in torch.optim, keyword arguments); each also with foreach=True where it takes it, and
#: with fused=True where the CPU has a fused kernel (_FUSED)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd_momentum": ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=5e-4)),
    "sgd_nesterov": ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True)),
    "adam": ("Adam", dict(lr=1e-3)),
    "adam_amsgrad": ("Adam", dict(lr=1e-3, amsgrad=True)),
    "adamw": ("AdamW", dict(lr=1e-3, weight_decay=0.01)),
    "adamax": ("Adamax", dict(lr=2e-3)),
    "nadam": ("NAdam", dict(lr=2e-3)),
    "radam": ("RAdam", dict(lr=1e-3)),
    "adagrad": ("Adagrad", dict(lr=0.01)),
    "adadelta": ("Adadelta", dict(lr=1.0)),
    "rmsprop": ("RMSprop", dict(lr=1e-3, momentum=0.9, centered=True)),
    "rprop": ("Rprop", dict(lr=0.01)),
    "asgd": ("ASGD", dict(lr=0.01)),
    "adafactor": ("Adafactor", dict(lr=0.01)),
}
_FOREACH = ["sgd_momentum", "adam", "adamw", "adamax", "nadam", "radam", "adagrad", "adadelta", "rmsprop", "rprop",
            "asgd", "adafactor"]
_FUSED = ["sgd_momentum", "adam", "adamw", "adagrad"]


def _optimizer_setup(cls: str, kwargs: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def setup(ns: dict[str, Any]) -> None:
        _common(ns)
        _data(ns)
        ns["model"] = _mlp()
        ns["optimizer"] = getattr(torch.optim, cls)(ns["model"].parameters(), **kwargs)
    return setup


def _declare_optimizers() -> None:
    for key, (cls, kw) in OPTIMIZERS.items():
        if not hasattr(torch.optim, cls):   # (Adafactor: torch >= 2.5)
            continue
        idiom(STEP_LOOP, name=f"opt_{key}")(_optimizer_setup(cls, kw))
        if key in _FOREACH:
            idiom(STEP_LOOP, name=f"opt_{key}_foreach")(_optimizer_setup(cls, {**kw, "foreach": True}))
        if key in _FUSED:
            idiom(STEP_LOOP, name=f"opt_{key}_fused")(_optimizer_setup(cls, {**kw, "fused": True}))


_declare_optimizers()


@idiom("""\
def closure():
    optimizer.zero_grad()
    loss = F.cross_entropy(model(X), Y)
    loss.backward()
    return loss

for step in range(3):
    loss = optimizer.step(closure)
    losses.append(loss.item())
""")
def opt_lbfgs(ns):
    _common(ns)
    _data(ns, n=32)
    ns["model"] = _mlp()
    ns["optimizer"] = torch.optim.LBFGS(ns["model"].parameters(), lr=0.5, max_iter=4, history_size=5)


BAG = """\
class BagOfWords(nn.Module):
    def __init__(self, vocab=50, dim=8, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, sparse=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(dim=1))
"""


@idiom("""\
for step in range(4):
    ids, yb = IDS[4 * step:4 * step + 4], Y[4 * step:4 * step + 4]
    sparse_opt.zero_grad()
    dense_opt.zero_grad()
    loss = F.cross_entropy(model(ids), yb)
    loss.backward()
    sparse_opt.step()
    dense_opt.step()
    losses.append(loss.item())
""")
def opt_sparse_adam(ns):
    _common(ns)
    _data(ns, n=16)
    define(BAG, ns, "opt_sparse_adam", "model")
    torch.manual_seed(0)
    model = ns["model"] = ns["BagOfWords"]()
    ns["IDS"] = torch.randint(0, 50, (16, 6), generator=torch.Generator().manual_seed(3))
    ns["sparse_opt"] = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.01)
    ns["dense_opt"] = torch.optim.Adam(model.head.parameters(), lr=0.01)


if hasattr(torch.optim, "Muon"):
    @idiom("""\
    for step in range(4):
        xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    """)
    def opt_muon(ns):
        # Muon for the hidden matrices, AdamW for the rest (biases, the output layer), as Muon is used
        _common(ns)
        _data(ns)
        model = ns["model"] = _mlp(depth=3)
        hidden = [model[0].weight, model[2].weight]
        rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
        ns["optimizers"] = [torch.optim.Muon(hidden, lr=0.02), torch.optim.AdamW(rest, lr=3e-4, weight_decay=0.01)]


# ============================================================================ learning-rate schedulers
SCHED_LOOP = """\
for step in range(6):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    scheduler.step()
    lrs.append(scheduler.get_last_lr()[0])
    losses.append(loss.item())
"""


@idiom(SCHED_LOOP)
def sched_one_cycle(ns):
    _common(ns)
    _data(ns)
    model = ns["model"] = _mlp()
    opt = ns["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    ns["scheduler"] = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=6)
    ns["lrs"] = []


@idiom("""\
for epoch in range(4):
    model.train()
    for b in range(2):
        xb, yb = X[16 * b:16 * b + 16], Y[16 * b:16 * b + 16]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        val_loss = F.cross_entropy(model(X_val), Y_val).item()
    scheduler.step(val_loss)
    lrs.append(optimizer.param_groups[0]["lr"])
    losses.append(val_loss)
""")
def sched_reduce_on_plateau(ns):
    _common(ns)
    _data(ns, n=32)
    g = torch.Generator().manual_seed(11)
    ns.update(X_val=torch.randn(16, 16, generator=g), Y_val=torch.randint(0, 5, (16,), generator=g), lrs=[])
    model = ns["model"] = _mlp()
    opt = ns["optimizer"] = torch.optim.Adam(model.parameters(), lr=0.05)
    ns["scheduler"] = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, mode="min", factor=0.5, patience=0)


WARMUP_COSINE = """\
def warmup_cosine(step, warmup=2, total=6):
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
"""


@idiom(SCHED_LOOP)
def sched_warmup_cosine_lambda(ns):
    _common(ns)
    _data(ns)
    define(WARMUP_COSINE, ns, "sched_warmup_cosine_lambda", "schedule")
    model = ns["model"] = _mlp()
    opt = ns["optimizer"] = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    ns["scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda=ns["warmup_cosine"])
    ns["lrs"] = []


@idiom(SCHED_LOOP)
def sched_warmup_cosine_sequential(ns):
    _common(ns)
    _data(ns)
    model = ns["model"] = _mlp()
    opt = ns["optimizer"] = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    S = torch.optim.lr_scheduler
    ns["scheduler"] = S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=2),
                                           S.CosineAnnealingLR(opt, T_max=4, eta_min=1e-4)], milestones=[2])
    ns["lrs"] = []


# ============================================================================ mixed precision
SCALER_LOOP = """\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(xb), yb)
    scaler.scale(loss).backward()
{clip}    scaler.step(optimizer)
    scaler.update()
    scales.append(scaler.get_scale())
    losses.append(loss.item())
"""
CLIP = "    scaler.unscale_(optimizer)\n    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"


def _scaler_setup(make: Callable[[], Any]) -> Callable[[dict[str, Any]], None]:
    def setup(ns: dict[str, Any]) -> None:
        _common(ns)
        _data(ns)
        model = ns["model"] = _mlp()
        ns["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ns["scaler"] = make()
        ns["scales"] = []
    return setup


def _old_cuda_scaler() -> Any:
    import warnings

    with warnings.catch_warnings():   # (deprecated, and CUDA is not available: it warns twice)
        warnings.simplefilter("ignore")
        return torch.cuda.amp.GradScaler(enabled=False)


for _key, _make in {"amp_scaler_cpu": lambda: torch.amp.GradScaler("cpu", enabled=True),
                    "amp_scaler_disabled": lambda: torch.amp.GradScaler("cpu", enabled=False),
                    "amp_cuda_scaler_disabled": _old_cuda_scaler}.items():
    idiom(SCALER_LOOP.format(clip=""), name=_key)(_scaler_setup(_make))
    idiom(SCALER_LOOP.format(clip=CLIP), name=_key + "_clip")(_scaler_setup(_make))


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad()
    with torch.autocast("cpu", enabled=False):
        loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
""")
def amp_autocast_disabled(ns):
    _optimizer_setup("SGD", dict(lr=0.1, momentum=0.9))(ns)


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(xb)
        loss = F.cross_entropy(logits, yb)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    losses.append(loss.item())
""")
def amp_autocast_bf16(ns):
    _optimizer_setup("AdamW", dict(lr=1e-3))(ns)


# ============================================================================ weight averaging
@idiom("""\
for epoch in range(3):
    for xb, yb in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    if epoch >= swa_start:
        swa_model.update_parameters(model)
        swa_scheduler.step()
    else:
        scheduler.step()
torch.optim.swa_utils.update_bn(loader, swa_model)
""")
def swa(ns):
    from torch.optim.swa_utils import SWALR, AveragedModel

    _common(ns)
    _data(ns, n=16)
    model = ns["model"] = _mlp(bn=True)
    opt = ns["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ns.update(loader=torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ns["X"], ns["Y"]), batch_size=8),
              swa_model=AveragedModel(model), swa_start=1,
              scheduler=torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3),
              swa_scheduler=SWALR(opt, swa_lr=0.02, anneal_epochs=1))


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    ema_model.update_parameters(model)
    losses.append(loss.item())
""")
def ema_averaged_model(ns):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    _optimizer_setup("AdamW", dict(lr=1e-3))(ns)
    ns["ema_model"] = AveragedModel(ns["model"], multi_avg_fn=get_ema_multi_avg_fn(0.9))


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        for ema_p, p in zip(ema_model.parameters(), model.parameters()):
            ema_p.mul_(decay).add_(p, alpha=1 - decay)
        for ema_b, b in zip(ema_model.buffers(), model.buffers()):
            ema_b.copy_(b)
    losses.append(loss.item())
""")
def ema_by_hand(ns):
    import copy

    _common(ns)
    _data(ns)
    model = ns["model"] = _mlp(bn=True)
    ns["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = ns["ema_model"] = copy.deepcopy(model)
    ema.requires_grad_(False)
    ns["decay"] = 0.9


# ============================================================================ torch.func
@idiom("""\
from torch.func import functional_call, grad

def compute_loss(params, xb, yb):
    return F.cross_entropy(functional_call(model, params, (xb,)), yb)

for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    grads = grad(compute_loss)(params, xb, yb)
    params = {k: p - lr * grads[k] for k, p in params.items()}
    losses.append(compute_loss(params, xb, yb).item())
""", trains_visibly=False)
def func_grad_manual_sgd(ns):
    _common(ns)
    _data(ns)
    model = ns["model"] = _mlp()
    ns["params"] = {k: v.detach() for k, v in model.named_parameters()}
    ns["lr"] = 0.1


# ============================================================================ what the model and the step do
@idiom("""\
for step in range(6):
    if step == unfreeze_at:
        backbone.requires_grad_(True)
        optimizer.add_param_group({"params": backbone.parameters(), "lr": 1e-4})
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
""")
def add_param_group_mid_run(ns):
    _common(ns)
    _data(ns)
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    head = nn.Linear(32, 5)
    backbone.requires_grad_(False)    # fine-tuning: the head first, the backbone unfrozen later
    ns.update(backbone=backbone, head=head, model=nn.Sequential(backbone, head), unfreeze_at=3,
              optimizer=torch.optim.Adam(head.parameters(), lr=1e-3))


TINY_LM = """\
class TinyLM(nn.Module):
    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight        # tied: the output projection is the embedding

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.emb(ids))))
"""


@idiom("""\
for step in range(4):
    ids = tokens[4 * step:4 * step + 4]
    optimizer.zero_grad()
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
""")
def tied_weights(ns):
    _common(ns)
    ns["losses"] = []
    define(TINY_LM, ns, "tied_weights", "model")
    torch.manual_seed(0)
    model = ns["model"] = ns["TinyLM"]()
    ns["tokens"] = torch.randint(0, 40, (16, 9), generator=torch.Generator().manual_seed(5))
    ns["optimizer"] = torch.optim.AdamW(model.parameters(), lr=1e-2)


@idiom(STEP_LOOP)
def parametrizations_spectral_weight_norm(ns):
    from torch.nn.utils import parametrizations as P

    _common(ns)
    _data(ns)
    model = ns["model"] = _mlp(depth=3)
    P.spectral_norm(model[2])
    P.weight_norm(model[4])
    ns["optimizer"] = torch.optim.Adam(model.parameters(), lr=1e-3)


@idiom("""\
for step in range(4):
    real = real_data[8 * step:8 * step + 8]
    ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
    noise = torch.randn(8, latent)
    fake = netG(noise)
    # (1) the discriminator: real as real, fake as fake (the generator's graph detached)
    netD.zero_grad()
    loss_D = criterion(netD(real), ones) + criterion(netD(fake.detach()), zeros)
    loss_D.backward()
    optimizerD.step()
    # (2) the generator: make the discriminator call the fake real
    netG.zero_grad()
    loss_G = criterion(netD(fake), ones)
    loss_G.backward()
    optimizerG.step()
    losses.append((loss_D.item(), loss_G.item()))
""")
def gan_two_optimizers(ns):
    _common(ns)
    torch.manual_seed(0)
    netG = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    netD = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    g = torch.Generator().manual_seed(9)
    ns.update(netG=netG, netD=netD, latent=4, criterion=nn.BCEWithLogitsLoss(), losses=[],
              real_data=torch.randn(32, 8, generator=g) * 0.5 + 1.0,
              optimizerD=torch.optim.Adam(netD.parameters(), lr=2e-4, betas=(0.5, 0.999)),
              optimizerG=torch.optim.Adam(netG.parameters(), lr=2e-4, betas=(0.5, 0.999)))


@idiom("""\
model.train()
for step in range(6):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
    if (step + 1) % eval_every == 0:
        model.eval()
        with torch.no_grad():
            val_losses.append(F.cross_entropy(model(X_val), Y_val).item())
        model.train()
""")
def eval_blocks(ns):
    _common(ns)
    _data(ns)
    g = torch.Generator().manual_seed(11)
    ns.update(X_val=torch.randn(16, 16, generator=g), Y_val=torch.randint(0, 5, (16,), generator=g),
              val_losses=[], eval_every=2, model=_mlp(bn=True, dropout=0.2))
    ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.05, momentum=0.9)


@idiom(STEP_LOOP.replace("optimizer.zero_grad()", "optimizer.zero_grad(set_to_none=False)"))
def zero_grad_set_to_none_false(ns):
    _optimizer_setup("SGD", dict(lr=0.1, momentum=0.9))(ns)


@idiom(STEP_LOOP.replace("optimizer.zero_grad()", "model.zero_grad()"))
def zero_grad_of_the_model(ns):
    _optimizer_setup("SGD", dict(lr=0.1, momentum=0.9))(ns)


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    for p in model.parameters():
        p.grad.zero_()
    losses.append(loss.item())
""")
def zero_grad_by_hand(ns):
    _optimizer_setup("Adam", dict(lr=1e-3))(ns)


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8].clone().requires_grad_(True), Y[8 * step:8 * step + 8]
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()                                   # the input's gradient, for the attack
    x_adv = (xb + 0.05 * xb.grad.sign()).detach()
    optimizer.zero_grad()                             # what that backward left in the parameters
    loss = F.cross_entropy(model(x_adv), yb)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
""")
def adversarial_fgsm(ns):
    # FGSM adversarial training: two backward() calls from two lines feed one step; they are not micro-batches
    _optimizer_setup("SGD", dict(lr=0.1, momentum=0.9))(ns)


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    F.cross_entropy(model(xb), yb).backward()
    with torch.no_grad():                             # SAM: climb to the worst point nearby
        norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
        eps = [0.05 * p.grad / (norm + 1e-12) for p in model.parameters()]
        for p, e in zip(model.parameters(), eps):
            p.add_(e)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()                                   # the gradient there
    with torch.no_grad():
        for p, e in zip(model.parameters(), eps):
            p.sub_(e)                                 # back, then step with it
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss.item())
""")
def sam_two_passes(ns):
    _optimizer_setup("SGD", dict(lr=0.1, momentum=0.9))(ns)


@idiom("""\
for step in range(4):
    real, fake = X[8 * step:8 * step + 8], torch.randn(8, 16)
    a = torch.rand(8, 1)
    mix = (a * real + (1 - a) * fake).requires_grad_(True)
    g, = torch.autograd.grad(critic(mix).sum(), mix, create_graph=True)
    penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
    loss = critic(fake).mean() - critic(real).mean() + 10 * penalty
    opt_c.zero_grad()
    loss.backward()
    opt_c.step()
    losses.append(loss.item())
""")
def wgan_gp_critic(ns):
    # WGAN-GP: a gradient penalty through torch.autograd.grad(create_graph=True), then backward() through it
    _common(ns)
    _data(ns)
    torch.manual_seed(0)
    ns["critic"] = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ns["opt_c"] = torch.optim.Adam(ns["critic"].parameters(), lr=1e-4, betas=(0.0, 0.9))


@idiom("""\
for step in range(4):
    xb, yb = X[8 * step:8 * step + 8], Y[8 * step:8 * step + 8]
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad * lr
        model.zero_grad()
    losses.append(loss.item())
""")
def manual_sgd_no_optimizer(ns):
    # the "what is torch.nn really?" tutorial's loop: no optimizer, the update by hand under no_grad
    _common(ns)
    _data(ns)
    ns.update(model=_mlp(), lr=0.1)


@idiom("""\
optimizer.zero_grad()
for i in range(8):
    xb, yb = X[4 * i:4 * i + 4], Y[4 * i:4 * i + 4]
    loss = F.cross_entropy(model(xb), yb) / accum_steps
    loss.backward()
    if (i + 1) % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
""")
def grad_accumulation(ns):
    _optimizer_setup("AdamW", dict(lr=1e-3))(ns)
    ns["accum_steps"] = 2


# ============================================================================ nanoGPT's train.py, in miniature
NANO_MODEL = '''\
import math
import inspect
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 65
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.1
    bias: bool = True


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        fused_available = "fused" in inspect.signature(torch.optim.AdamW).parameters
        use_fused = fused_available and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
'''

NANO_TRAIN_SETUP = '''\
# train.py's configuration, for a CPU
eval_interval = 2
log_interval = 1
eval_iters = 2
gradient_accumulation_steps = 2
batch_size = 4
block_size = 16
learning_rate = 6e-4
max_iters = 4
weight_decay = 1e-1
beta1, beta2 = 0.9, 0.95
grad_clip = 1.0
decay_lr = True
warmup_iters = 2
lr_decay_iters = 4
min_lr = 6e-5
device = "cpu"
device_type = "cuda" if "cuda" in device else "cpu"
dtype = "float32"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

torch.manual_seed(1337)
data = torch.randint(0, 65, (400,), generator=torch.Generator().manual_seed(1337))
train_data, val_data = data[:360], data[360:]


def get_batch(split):
    data = train_data if split == "train" else val_data
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x.to(device), y.to(device)


iter_num = 0
best_val_loss = 1e9
model_args = dict(n_layer=2, n_head=2, n_embd=32, block_size=block_size, bias=True, vocab_size=65, dropout=0.1)
gptconf = GPTConfig(**model_args)
model = GPT(gptconf)
model.to(device)
scaler = torch.cuda.amp.GradScaler(enabled=(dtype == "float16"))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)
'''


@idiom("""\
X, Y = get_batch("train")
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps
        print(f"iter {iter_num}: loss {lossf:.4f}")
    iter_num += 1
    if iter_num > max_iters:
        break
""")
def nanogpt_train_loop(ns):
    import warnings

    define(NANO_MODEL, ns, "nanogpt_train_loop", "model")
    with warnings.catch_warnings():   # (torch.cuda.amp.GradScaler: deprecated, and no CUDA here)
        warnings.simplefilter("ignore")
        define(NANO_TRAIN_SETUP, ns, "nanogpt_train_loop", "train")


# ============================================================================ pytorch/examples' mnist, in miniature
EXAMPLES_MNIST = '''\
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.optim.lr_scheduler import StepLR


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.conv2 = nn.Conv2d(4, 8, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(32, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def train(args, model, device, train_loader, optimizer, epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(train_loader):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            print("Train Epoch: {} [{}/{} ({:.0f}%)]\\tLoss: {:.6f}".format(
                epoch, batch_idx * len(data), len(train_loader.dataset),
                100. * batch_idx / len(train_loader), loss.item()))
            if args.dry_run:
                break


def test(model, device, test_loader):
    model.eval()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in test_loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            correct += pred.eq(target.view_as(pred)).sum().item()
    test_loss /= len(test_loader.dataset)
    print("\\nTest set: Average loss: {:.4f}, Accuracy: {}/{} ({:.0f}%)\\n".format(
        test_loss, correct, len(test_loader.dataset), 100. * correct / len(test_loader.dataset)))


args = argparse.Namespace(batch_size=8, test_batch_size=16, epochs=2, lr=1.0, gamma=0.7, log_interval=1,
                          dry_run=False, seed=1)
torch.manual_seed(args.seed)
device = torch.device("cpu")
g = torch.Generator().manual_seed(2)
train_set = torch.utils.data.TensorDataset(torch.randn(16, 1, 8, 8, generator=g),
                                           torch.randint(0, 10, (16,), generator=g))
test_set = torch.utils.data.TensorDataset(torch.randn(16, 1, 8, 8, generator=g),
                                          torch.randint(0, 10, (16,), generator=g))
train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size)
model = Net().to(device)
optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
'''


@idiom("""\
for epoch in range(1, args.epochs + 1):
    train(args, model, device, train_loader, optimizer, epoch)
    test(model, device, test_loader)
    scheduler.step()
""")
def pytorch_examples_mnist(ns):
    define(EXAMPLES_MNIST, ns, "pytorch_examples_mnist", "main")


# ============================================================================ library loops
@idiom(ll.HF_TRAIN, library="hf")
def hf_trainer_accumulating_checkpointing(ns, callbacks=None):
    # a causal LM (its loss takes num_items_in_batch: the Trainer's accumulation is then exact)
    ns.update(ll.hf_trainer(task="lm", steps=3, accum=2, callbacks=callbacks, gradient_checkpointing=True,
                            max_grad_norm=1.0, fp16=False, bf16=False))


def _lit(module: str = ll.LIT_MODULE, module_name: str = "LitClassifier", steps: int = 4, **trainer_kwargs):
    def setup(ns: dict[str, Any], callbacks: list | None = None) -> None:
        ns.update(ll.lit_fit(module_source=module, module_name=module_name, steps=steps,
                             trainer_kwargs={**trainer_kwargs, "callbacks": list(callbacks or [])}))
    return setup


idiom(ll.LIT_FIT, name="lightning_automatic", library="lightning")(_lit())
idiom(ll.LIT_FIT, name="lightning_manual", library="lightning")(_lit(ll.LIT_MANUAL, "LitManual"))
idiom(ll.LIT_FIT, name="lightning_bf16_mixed", library="lightning")(_lit(precision="bf16-mixed"))
idiom(ll.LIT_FIT, name="lightning_accumulate_grad_batches", library="lightning")(
    _lit(steps=3, accumulate_grad_batches=2))


@idiom("""\
for step, (x, y) in enumerate(loader):
    with accelerator.accumulate(model):
        loss = F.cross_entropy(model(x), y)
        accelerator.backward(loss)
        if accelerator.sync_gradients:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    losses.append(loss.item())
""", library="accelerate")
def accelerate_accumulate(ns):
    ns.update(ll.accelerate_loop(accum=2), F=F, losses=[])
