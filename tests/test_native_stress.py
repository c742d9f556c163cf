"""Stress: many op and tensor kinds, each step under the doctor against the same step run plainly.

Every snippet is correct code a user could write. Under either engine it must run to the end with the
same results bit for bit (its variables, gradients, the RNG state), raise nothing the plain run does not
raise, and stay silent. The native recorder sees every dispatcher op these reach (sparse, complex,
nested, batched tensors of functorch, views of views, autograd Functions, hooks, reentrant
backward, profiler ranges); whatever it cannot describe it skips.
"""
from __future__ import annotations

import pytest
import torch

import backward_doctor as bd
from backward_doctor.capture.native_capture import native_available

from compat_workloads import bits as _bits

SETUP = """
import torch, torch.nn as nn, torch.nn.functional as F
torch.manual_seed(0)
w = torch.randn(6, 6, requires_grad=True)
x = torch.randn(4, 6)
"""

SNIPPETS = {
    "views_of_views": "v = w.t()[1:, ::2].unsqueeze(0).expand(3, -1, -1).reshape(3, -1)\n"
                      "loss = (v * v.flip(0)).sum()\nloss.backward()",
    "inplace_on_fresh_views": "h = x @ w\nh[:, :2] += 1\nh.select(1, 3).mul_(2)\nloss = h.relu_().sum()\nloss.backward()",
    "complex": "z = torch.complex(x @ w, (x @ w).sin())\nloss = (z * z.conj()).real.sum() + torch.angle(z).sum()\n"
               "loss.backward()",
    "fft_and_linalg": "a = w @ w.t() + 6 * torch.eye(6)\nL = torch.linalg.cholesky(a)\n"
                      "loss = torch.fft.fft(L).abs().sum() + torch.linalg.slogdet(a)[1]\nloss.backward()",
    "sparse_coo": "s = torch.sparse_coo_tensor(torch.tensor([[0, 2, 3], [1, 0, 5]]), torch.tensor([1., 2., 3.]), (4, 6))\n"
                  "loss = torch.sparse.mm(s, w).sum() + (s.to_dense() * x).sum()\nloss.backward()",
    "sparse_csr": "s = (x * (x > 0.5)).to_sparse_csr()\nloss = (s @ w).pow(2).sum()\nloss.backward()",
    "nested_strided": "nt = torch.nested.as_nested_tensor([x[:2] @ w, x[2:] @ w])\n"
                      "loss = (nt * 2).to_padded_tensor(0.0).sum()\nloss.backward()",
    "index_scatter_gather": "h = x @ w\nidx = torch.tensor([[0, 1], [2, 3], [4, 5], [0, 0]])\n"
                            "g = h.gather(1, idx)\ns = torch.zeros(4, 6).scatter_add(1, idx, g)\n"
                            "loss = s.index_select(1, torch.tensor([0, 2])).sum() + h[h > 0].sum()\nloss.backward()",
    "custom_function_and_hooks": "class Sq(torch.autograd.Function):\n"
                                 "    @staticmethod\n    def forward(ctx, a):\n        ctx.save_for_backward(a)\n"
                                 "        return a * a\n"
                                 "    @staticmethod\n    def backward(ctx, g):\n        (a,) = ctx.saved_tensors\n"
                                 "        return 2 * a * g\n"
                                 "h = x @ w\nh.register_hook(lambda g: g * 0.5)\nloss = Sq.apply(h).sum()\nloss.backward()",
    "reentrant_backward_in_forward": "def inner(a):\n    with torch.enable_grad():\n"
                                     "        a2 = a.detach().requires_grad_()\n"
                                     "        (ga,) = torch.autograd.grad((a2 ** 3).sum(), a2)\n    return a * ga\n"
                                     "loss = inner(x @ w).sum()\nloss.backward()",
    "double_backward": "h = (x @ w).tanh()\n(g,) = torch.autograd.grad(h.sum(), w, create_graph=True)\n"
                       "loss = g.pow(2).sum()\nloss.backward()",
    "functorch_per_sample_grads": "from torch.func import functional_call, grad, vmap\n"
                                  "lin = nn.Linear(6, 1)\nparams = {k: v.detach() for k, v in lin.named_parameters()}\n"
                                  "def loss_one(p, xi):\n    return functional_call(lin, p, (xi.unsqueeze(0),)).pow(2).sum()\n"
                                  "per_sample = vmap(grad(loss_one), in_dims=(None, 0))(params, x)\n"
                                  "loss = (x @ w).sum() + sum(v.sum() for v in per_sample.values())\nloss.backward()",
    "jacobian": "jac = torch.autograd.functional.jacobian(lambda a: (a @ w).tanh(), x[:1], create_graph=True)\n"
                "loss = jac.sum()\nloss.backward()",
    "profiler_ranges": "with torch.profiler.record_function('my_block'):\n    h = x @ w\nloss = h.sum()\nloss.backward()",
    "foreach_and_fused": "ps = [w, torch.randn(3, requires_grad=True)]\nloss = sum(p.pow(2).sum() for p in ps)\nloss.backward()\n"
                         "with torch.no_grad():\n    torch._foreach_add_(ps, [p.grad for p in ps], alpha=-0.1)\n"
                         "    torch._foreach_mul_(ps, 0.9)",
    "dtypes_mixed_precision": "h = (x.double() @ w.double()).float() + (x.half().float() @ w)\n"
                              "with torch.autocast('cpu', dtype=torch.bfloat16):\n    k = x @ w\n"
                              "loss = h.sum() + k.float().sum()\nloss.backward()",
    "integer_and_bool_ops": "m = (x > 0)\nc = m.sum(1).long()\nt = torch.bincount(c, minlength=7).float()\n"
                            "loss = (x @ w)[m].sum() + t.sum() + torch.where(m, x @ w, 0.).sum()\nloss.backward()",
    "rnn_cells": "cell = nn.GRUCell(6, 6)\nh = torch.zeros(4, 6)\nfor _ in range(3):\n    h = cell(x @ w, h)\n"
                 "loss = h.sum()\nloss.backward()",
    "conv_pool_norm": "img = x.reshape(1, 1, 4, 6).expand(2, 3, 4, 6).contiguous()\nconv = nn.Conv2d(3, 4, 3, padding=1)\n"
                      "bn = nn.BatchNorm2d(4)\nh = F.max_pool2d(bn(conv(img)), 2)\n"
                      "loss = F.group_norm(h, 2).sum() + (w ** 2).sum()\nloss.backward()",
    "empty_and_zero_size": "e = torch.empty(0, 6)\nloss = (torch.cat([x, e]) @ w).sum() + (e @ w).sum()\nloss.backward()",
}


@pytest.mark.parametrize("engine", ["native", "python"])
@pytest.mark.parametrize("name", sorted(SNIPPETS))
def test_step_runs_as_plain(name: str, engine: str) -> None:
    if engine == "native" and not native_available(build=True):
        pytest.skip("native recorder unavailable")
    src = SNIPPETS[name]
    states = []
    for doctored in (False, True):
        ns: dict = {}
        exec(SETUP, ns)
        torch.manual_seed(1)
        if doctored:
            report = bd.diagnose(src, ns, engine=engine)
            assert report.exception is None, report.exception
            assert report.trace.engine == engine
            assert report.ok, [f.message for f in report.findings]
        else:
            exec(src, ns)
        states.append({k: _bits(v) for k, v in ns.items() if isinstance(v, torch.Tensor)}
                      | {"w.grad": _bits(ns["w"].grad), "rng": _bits(torch.get_rng_state())})
    plain, doctored = states
    assert plain.keys() == doctored.keys()
    different = [k for k in plain if plain[k][:2] != doctored[k][:2] or not torch.equal(plain[k][2], doctored[k][2])]
    assert not different, different
