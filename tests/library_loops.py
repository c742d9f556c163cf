"""Training loops run by a library: tiny, offline setups for `transformers.Trainer`, Lightning and Accelerate.

Most notebooks train through a library, so the doctor's loop rules are tested inside real library loops
too, not only in loops written in a cell. Each builder here returns the namespace a notebook would hold
(seeded, CPU-only, nothing downloaded: models from tiny random configs, data made in code), and each
library has one cell that runs it (:data:`HF_TRAIN`, :data:`LIT_FIT`, :data:`ACCEL_LOOP`).

Code a user writes (a ``Trainer`` subclass with its own ``compute_loss``, a ``LightningModule``) is
passed as *source* and defined with :func:`define`, so its lines are the user's lines in a file of its
own (as a notebook cell is), where a test can put a bug and find its line with :func:`marked_line`:

>>> ns = define('''
... def double(x):
...     return 2 * x  # <-- here
... ''', {})
>>> ns["double"](3), marked_line(ns, "double", "# <-- here")
(6, 3)

Builders skip the test (``pytest.importorskip``) when their library is not installed.
"""
from __future__ import annotations

import itertools
import linecache
import os
import tempfile
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

#: The one-line cells that run each library's loop.
HF_TRAIN = "trainer.train()\n"
LIT_FIT = "trainer.fit(model, loader)\n"
ACCEL_LOOP = """\
for step, (x, y) in enumerate(loader):
    with accelerator.accumulate(model):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
"""

_counter = itertools.count()
_DIR = tempfile.mkdtemp(prefix="bd-library-loops-")


def define(source: str, ns: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """Run *source* (dedented) into *ns* from a real file of its own, as a notebook cell defines code.

    The file is written under a temporary folder (not site-packages, not torch), so the doctor counts
    its frames as the user's, and its lines are in ``linecache``. Returns *ns*.
    """
    source = textwrap.dedent(source)
    path = os.path.join(_DIR, f"{name or 'user_code'}_{next(_counter)}.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    # As IPython registers a cell's code: in linecache for good (no modification time to check).
    linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
    exec(compile(source, path, "exec"), ns)
    return ns


def numbered_cell(shell: Any, source: str) -> int:
    """Run *source* as the next numbered cell of a real IPython *shell* (its output captured, the cell stored in
    its history as a notebook's is); returns its ``In[N]``, the number the doctor names its lines by."""
    from IPython.utils.capture import capture_output

    number = shell.execution_count
    with capture_output():
        result = shell.run_cell(source, store_history=True)
    assert result.error_before_exec is None
    return number


def defined_in(ns: dict[str, Any], name: str) -> str:
    """The file :func:`define` wrote the code of *name* (a class or function of *ns*) into."""
    obj = ns[name]
    # A class defined in a cell has no module file (``inspect.getsourcefile`` fails, as in IPython):
    # its methods' code objects still name the file.
    functions = [obj] if callable(obj) and hasattr(obj, "__code__") else [
        v for v in vars(obj).values() if hasattr(getattr(v, "__func__", v), "__code__")]
    return getattr(functions[0], "__func__", functions[0]).__code__.co_filename


def marked_line(ns: dict[str, Any], name: str, marker: str) -> int:
    """The 1-based line, in the file :func:`define` wrote, of the first line containing *marker*, for the
    code object *name* was defined from (a class or function of *ns*)."""
    path = defined_in(ns, name)
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if marker in line:
                return i
    raise ValueError(f"{marker!r} not in {path}")


# ----------------------------------------------------------------------------- transformers.Trainer
def _transformers() -> Any:
    return pytest.importorskip("transformers", reason="transformers is a test dependency (pyproject [test])")


class TokenDataset(torch.utils.data.Dataset):
    """``n`` random token sequences with a class label each (what a tokenized dataset yields)."""

    def __init__(self, n: int = 32, seq: int = 8, vocab: int = 99, classes: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq), generator=g)
        self.labels = torch.randint(0, classes, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


class LMDataset(TokenDataset):
    """``n`` random token sequences, each its own label (causal language modelling; the model shifts them)."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def tiny_gpt2_lm(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 language model (~50k parameters, no dropout) from a random config: its loss takes the
    Trainer's ``num_items_in_batch`` (a sum over the accumulated batch's tokens divided by their count)."""
    tf = _transformers()
    torch.manual_seed(seed)
    cfg = tf.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return tf.GPT2LMHeadModel(cfg)


def tiny_bert_classifier(seed: int = 0) -> nn.Module:
    """A 2-layer BERT for 3-class sequence classification (~60k parameters), from a random config."""
    tf = _transformers()
    torch.manual_seed(seed)
    cfg = tf.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, num_labels=3)
    return tf.BertForSequenceClassification(cfg)


def hf_args(steps: int = 4, batch: int = 4, accum: int = 1, lr: float = 5e-5, **extra: Any) -> Any:
    """`TrainingArguments` for a quiet CPU run: no logging, saving, tqdm or reporting; *extra* overrides."""
    return _transformers().TrainingArguments(**hf_args_kwargs(steps, batch, accum, lr, **extra))


def hf_args_kwargs(steps: int = 4, batch: int = 4, accum: int = 1, lr: float = 5e-5, **extra: Any) -> dict[str, Any]:
    """The keyword arguments :func:`hf_args` passes to `TrainingArguments`."""
    kw: dict[str, Any] = dict(output_dir=tempfile.mkdtemp(prefix="bd-hf-", dir=_DIR), max_steps=steps,
                              per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
                              learning_rate=lr, use_cpu=True, report_to="none", save_strategy="no",
                              logging_strategy="no", eval_strategy="no", disable_tqdm=True,
                              dataloader_num_workers=0, seed=0)
    kw.update(extra)
    return kw


def hf_trainer(trainer_source: str | None = None, trainer_name: str = "MyTrainer", n: int = 32,
               callbacks: list | None = None, args_source: str | None = None, eval_n: int = 0,
               task: str = "classify", train_ds: Any = None, model: nn.Module | None = None,
               **args: Any) -> dict[str, Any]:
    """A namespace holding ``trainer`` (a `transformers.Trainer` on a tiny BERT classifier, or with
    ``task="lm"`` a tiny GPT-2 language model), ``model``, ``args``, ``train_ds``; run it with
    :data:`HF_TRAIN`. *trainer_source* defines a `Trainer` subclass named *trainer_name* (e.g. with its own
    ``compute_loss``) via :func:`define`; its namespace has ``Trainer``, ``torch`` and ``F``. *callbacks* go
    to the ``Trainer``; *args* to :func:`hf_args`; *args_source*, when given, is the user's code that binds
    ``args`` (defined like a cell), from ``base_args``: those keyword arguments without the learning rate
    (``args = TrainingArguments(**base_args, learning_rate=5e5)``). *eval_n*: an ``eval_ds`` of that many
    examples for the trainer to evaluate on (with ``eval_strategy`` in *args*). *train_ds*: a dataset of your
    own (``dataloader_num_workers=2`` in *args* for worker processes); *model*: a model of your own instead."""
    tf = _transformers()
    ns: dict[str, Any] = {"torch": torch, "F": torch.nn.functional, "Trainer": tf.Trainer,
                          "TrainingArguments": tf.TrainingArguments}
    cls = tf.Trainer
    if trainer_source is not None:
        cls = define(trainer_source, ns, name=trainer_name)[trainer_name]
    ns["model"] = model if model is not None else tiny_gpt2_lm() if task == "lm" else tiny_bert_classifier()
    if args_source is not None:
        ns["base_args"] = {k: v for k, v in hf_args_kwargs(**args).items() if k != "learning_rate"}
        define(args_source, ns, name="training_args")
    else:
        ns["args"] = hf_args(**args)
    if train_ds is not None:
        ns["train_ds"] = train_ds
    else:
        ns["train_ds"] = LMDataset(n=n) if task == "lm" else TokenDataset(n=n)
    ns["eval_ds"] = TokenDataset(n=eval_n, seed=1) if eval_n else None
    ns["trainer"] = cls(model=ns["model"], args=ns["args"], train_dataset=ns["train_ds"],
                       eval_dataset=ns["eval_ds"], callbacks=callbacks)
    return ns


#: compute_loss with a log of zero for batches holding token 98 (a rare token: data-dependent NaN/Inf)
HF_NAN = '''
class MyTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(**inputs)
        rare = (inputs["input_ids"] == 98).float().mean(dim=1)
        loss = out.loss + torch.log(1 - rare.max() * 8).clamp(max=0)   # <-- here
        return (loss, out) if return_outputs else loss
'''
#: The same sample makes the gradients NaN/Inf from a finite loss: ``sqrt`` at 0 (its gradient is infinite there);
#: the Trainer clips (``_foreach_mul_``) and steps (fused AdamW) them into the weights.
HF_NAN_GRADIENTS = HF_NAN.replace(
    "        loss = out.loss + torch.log(1 - rare.max() * 8).clamp(max=0)   # <-- here\n",
    "        z = (out.logits * 0).sum() + (1 - rare.max() * 8).clamp(min=0)\n"
    "        loss = out.loss + torch.sqrt(z)   # <-- here\n")
#: the sample the shuffled loader (seed 0) puts in optimizer step 6, an iteration the sampled recorders leave out
POISONED_SAMPLE, POISONED_STEP = 36, 6


def hf_rare_token_trainer(trainer_source: str | None, callbacks: list | None = None, poison: bool = False,
                          **args: Any) -> dict[str, Any]:
    """:func:`hf_trainer` for 10 steps over 40 samples in which token 98 (what :data:`HF_NAN` takes the log of
    zero for) appears nowhere, or with ``poison`` in :data:`POISONED_SAMPLE` only; *args* to :func:`hf_args`."""
    ns = hf_trainer(trainer_source=trainer_source, steps=10, n=40, callbacks=callbacks, **args)
    ds = ns["train_ds"]
    ds.ids[ds.ids == 98] = 97
    if poison:
        ds.ids[POISONED_SAMPLE, 3] = 98
    return ns


# ----------------------------------------------------------------------------- Lightning
def _lightning() -> Any:
    return pytest.importorskip("pytorch_lightning", reason="pytorch-lightning is a test dependency (pyproject [test])")


#: A correct LightningModule: a small MLP classifier with automatic optimization.
LIT_MODULE = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class LitClassifier(pl.LightningModule):
    def __init__(self, d_in=16, classes=5, lr=0.1):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d_in, 32), torch.nn.ReLU(), torch.nn.Linear(32, classes))
        self.lr = lr

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)
"""


#: A correct LightningModule with manual optimization (``self.optimizers()``, ``manual_backward``).
LIT_MANUAL = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class LitManual(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


#: A LightningModule whose sixth batch (``batch_idx == 5``) makes the loss Inf: ``log(0)`` at the marked line.
LIT_LATE_NAN = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class LitLate(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        scale = torch.zeros(()) if batch_idx == 5 else torch.ones(())
        return loss * torch.log(scale).neg().add(1)  # <-- here

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
"""


#: A LightningModule whose sixth batch makes the loss Inf only in low precision: ``1 + 2**-10`` is 1 in bfloat16,
#: so under ``precision="bf16-mixed"`` (autocast) ``log(d - 1)`` is ``log(0)`` at the marked line; in float32 it is
#: finite.
LIT_BF16_NAN = """\
import torch
import pytorch_lightning as pl
import torch.nn.functional as F


class LitBf16(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
        self.probe = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.probe.weight.fill_(1 + 2 ** -10)
        self.probe.weight.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        d = self.probe(torch.ones(1, 1)) if batch_idx == 5 else torch.full((1, 1), 2.0)
        return loss * torch.log(d - 1).neg().add(1).mean()  # <-- here

    def configure_optimizers(self):
        return torch.optim.SGD(self.net.parameters(), lr=0.1)
"""


def lit_trainer(steps: int = 4, **extra: Any) -> Any:
    """A quiet CPU `pytorch_lightning.Trainer`: no logger, checkpoints, progress bar or summary."""
    pl = _lightning()
    kw: dict[str, Any] = dict(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                              num_sanity_val_steps=0, default_root_dir=tempfile.mkdtemp(prefix="bd-pl-", dir=_DIR))
    kw.update(extra)
    return pl.Trainer(**kw)


def xy_loader(n: int = 64, d_in: int = 16, classes: int = 5, batch: int = 8, dataset: Any = None,
              **extra: Any) -> Any:
    """A DataLoader of ``n`` random (x, y) pairs, seeded, not shuffled unless *extra* says so (``num_workers=2``:
    worker processes); *dataset*: one of your own instead."""
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(n, d_in, generator=g), torch.randint(0, classes, (n,), generator=g))
    return torch.utils.data.DataLoader(ds if dataset is None else dataset, batch_size=batch, **extra)


def lit_fit(module_source: str = LIT_MODULE, module_name: str = "LitClassifier", steps: int = 4,
            module_kwargs: dict[str, Any] | None = None, trainer_kwargs: dict[str, Any] | None = None,
            loader_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A namespace holding ``model`` (the LightningModule *module_name* defined from *module_source* via
    :func:`define`), ``loader`` and ``trainer``; run it with :data:`LIT_FIT`."""
    _lightning()
    ns: dict[str, Any] = {}
    define(module_source, ns, name=module_name)
    torch.manual_seed(0)
    ns["model"] = ns[module_name](**(module_kwargs or {}))
    ns["loader"] = xy_loader(**(loader_kwargs or {}))
    ns["trainer"] = lit_trainer(steps, **(trainer_kwargs or {}))
    return ns


# ----------------------------------------------------------------------------- Accelerate
def accelerate_loop(accum: int = 2, n: int = 32, batch: int = 8, prepare_optimizer: bool = True,
                    dtype: torch.dtype | None = None, lr: float = 0.1, model: nn.Module | None = None,
                    loader_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """A namespace with an ``accelerator`` (CPU, *accum* accumulation steps) and the ``model`` (16 features in,
    5 classes out; a small MLP unless given), ``optimizer`` (SGD, *lr*) and ``loader`` it prepared; run it with
    :data:`ACCEL_LOOP` (or a cell of your own). ``prepare_optimizer=False`` leaves the optimizer out of
    ``accelerator.prepare`` (a plain torch one); ``dtype`` casts the model (and the loader's inputs) first;
    *loader_kwargs* go to :func:`xy_loader`."""
    acc = pytest.importorskip("accelerate", reason="accelerate is a test dependency (pyproject [test])")
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps process-wide singletons: a fresh accelerator per namespace, not the last test's.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))
    loader = xy_loader(n=n, batch=batch, **(loader_kwargs or {}))
    if dtype is not None:
        model = model.to(dtype)
        x, y = loader.dataset.tensors
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x.to(dtype), y), batch_size=batch)
    accelerator = acc.Accelerator(cpu=True, gradient_accumulation_steps=accum)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    if prepare_optimizer:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        model, loader = accelerator.prepare(model, loader)
    return {"torch": torch, "accelerator": accelerator, "model": model, "optimizer": optimizer, "loader": loader}
