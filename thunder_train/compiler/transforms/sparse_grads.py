"""Gradients of sparse values (COO, CSR, CSC) in the backward program.

A sparse value is opaque (acquisition/sparse.py): every line that reads or makes one runs through torch, with
torch's autograd when a gradient flows (opaque_grad.py), so its gradient is made and read by opaque lines only.
That gradient is a ``SparseProxy`` of the value's layout, but its layout at run time is the one torch's autograd
gives, as in eager: sparse for ``torch.sparse.mm``'s sparse operand, strided where the cotangent was strided
(``sampled_addmm``'s input).  Two gradients of one sparse value add as eager's engine adds them (``accumulate``).
"""
from __future__ import annotations

import torch

from .. import context
from ..opaque import opaque_symbol
from ..sparse_proxy import SparseProxy
from ..symbols import BoundSymbol


def gradient_of(p: SparseProxy, name=None) -> SparseProxy:
    """The gradient value of the sparse value ``p`` (nominally its layout: torch decides at run time)."""
    g = SparseProxy(name, shape=p._tt_shape, dtype=p._tt_dtype.torch, device=p._tt_device.torch, layout=p._tt_layout)
    g._tt_dims = getattr(p, "_tt_dims", (len(p._tt_shape), 0))
    return g


def accumulate_sparse_grads(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two gradients of one value summed as the autograd engine sums them: a strided one takes the other in."""
    if b.layout == torch.strided and a.layout != torch.strided:
        a, b = b, a
    return a + b


accumulate_sparse_grads.__module__ = "thunder_train"


def accumulate(a, b) -> SparseProxy:
    """Records ``accumulate_sparse_grads(a, b)``: the sum of two gradients of a sparse value."""
    out = gradient_of(a)
    context.get_trace().add(BoundSymbol(opaque_symbol(accumulate_sparse_grads), (a, b), {}, out, ()))
    return out


def sparse_leaf_grad(g: torch.Tensor) -> torch.Tensor:
    """A new ``.grad`` of a sparse leaf as eager's AccumulateGrad makes it (torch/csrc/autograd/functions/
    accumulate_grad.h), for a gradient only the backward holds: a COO one with contiguous indices and values is
    shallow-copied (which drops its coalesced flag, as eager's does), another sparse one cloned, a strided one
    row-major."""
    if g.layout == torch.sparse_coo and g._indices().is_contiguous() and g._values().is_contiguous():
        return torch.sparse_coo_tensor(g._indices(), g._values(), g.shape, check_invariants=False)
    if g.layout != torch.strided:
        return g.clone()
    return g.clone(memory_format=torch.contiguous_format)


sparse_leaf_grad.__module__ = "thunder_train"


def new_grad(g: SparseProxy) -> SparseProxy:
    """Records ``sparse_leaf_grad(g)``: the gradient of a sparse leaf that becomes its new ``.grad``."""
    out = gradient_of(g)
    context.get_trace().add(BoundSymbol(opaque_symbol(sparse_leaf_grad), (g,), {}, out, ()))
    return out
