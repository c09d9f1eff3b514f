"""Layout questions a program asked on every call, answered once from the traced layouts (and dtypes).

Three kinds of torch-executor lines looked at their tensors every call:

* ``ttex.grad_layout(g, param)`` (a new ``.grad`` laid out as eager's AccumulateGrad lays it out) is the
  identity when ``g`` already obeys the parameter's layout, as nearly every gradient does: such a line is
  dropped and its readers read ``g``; where it copies ``g`` into a dense parameter's strides (a weight used as
  ``W.T``: Falcon's eight matrices), it becomes that copy (``ttex.grad_copy``);
* the fused optimizer updates (``ttex.adam_update_`` and the others, ``torch_impls._fused``) compare every
  parameter's layout with its gradient's and state's (the fused kernels walk them as flat arrays): the indices
  that differ are passed as ``odd=(...)`` and the comparison is gone from the call;
* ``ttex.foreach_add_(steps, 1)`` (optimizers' step counters) on CPU tensors of one floating dtype becomes
  ``ttex.foreach_add_same_``, which adds one 0-d tensor instead of wrapping the number for each tensor;
* ``torch.mul(x, 1.0)`` (rotary embeddings' ``cos() * attention_scaling``) and ``torch.add(i, 0)`` of an integer
  tensor (position ids) give ``x``'s own values, dtype and layout: such a line is dropped and its readers read
  ``x``, unless its result is returned or read by a line that may write into it (only pure torch calls read it).
  ``x * 1.0`` is exact in IEEE arithmetic (``-0.0`` and infinities included); ``x + 0`` is not for floats
  (``-0.0 + 0 == +0.0``), so only integer additions go.

Why the traced layouts are the ones the program meets: every tensor proxy carries eager's strides (layout
rules, ``tests/test_layout.py``); the prologue checks the strides of every input tensor, and thin mode's per-call
checks hold the strides of every bound tensor (runtime/thin_checks.py, ``_parameters``: parameters, optimizer
state, buffers), so inputs keep the traced layouts; intermediates get theirs from the same kernels the rules
describe.  A line with a symbolic size or stride is left to decide at run time.

``torch_impls.VERIFY_DECIDED_LAYOUTS`` (tests): a decided line is kept as a checking one
(``ttex.grad_layout_decided``, ``odd=`` compared with the run-time answer) that raises ``LayoutDecisionError``
when a decision was wrong.
"""
from __future__ import annotations

import torch

from ..dense import is_non_overlapping_and_dense
from ..proxies import TensorProxy, is_proxy, meta_tensor
from ..pytree import tree_map
from . import torch_impls
from .torch_executor import ImplSymbol, impl_symbol


def _laid_out(p) -> bool:
    """A tensor proxy whose sizes, strides and offset are numbers (a symbolic one is decided at run time)."""
    return (type(p) is TensorProxy and all(type(n) is int for n in p._tt_shape)
            and all(type(s) is int for s in p._tt_strides) and type(p._tt_storage_offset) is int)


def _fn(b):
    return b.sym.fn if isinstance(b.sym, ImplSymbol) else None


def _identity_grad_layout(b) -> bool:
    g, param = b.args
    return _laid_out(g) and _laid_out(param) and torch_impls.obeys_layout(meta_tensor(g), meta_tensor(param))


def _dense_copy(b):
    """``(shape, strides)`` of the copy ``grad_layout(g, param)`` makes, when the traced layouts decide that it makes
    one into the dense parameter's strides (``torch_impls.grad_layout``), else None."""
    g, param = b.args
    if not (_laid_out(g) and _laid_out(param)):
        return None
    mg, mp = meta_tensor(g), meta_tensor(param)
    if torch_impls.obeys_layout(mg, mp) or not (mp.is_contiguous() or is_non_overlapping_and_dense(mp)):
        return None
    return tuple(param._tt_shape), tuple(param._tt_strides)


def _decided_odd(b):
    """``odd`` of a fused optimizer line from its lists' traced layouts, or None (not decidable)."""
    lists = b.args[:_fn(b).layout_lists]
    if not all(isinstance(ts, (list, tuple)) and all(_laid_out(t) for t in ts) for ts in lists):
        return None
    return torch_impls.unlike_layouts([[meta_tensor(t) for t in ts] for ts in lists])


_EXACT = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def _same_cpu_float(b) -> bool:
    """``foreach_add_(tensors, n)`` on CPU tensors of one floating dtype that holds the integral constant ``n``
    exactly (``torch_impls.foreach_add_same_``)."""
    tensors, other = b.args
    if type(other) not in (int, float) or other != int(other) or abs(other) > 256 or not tensors:
        return False
    dtype = tensors[0]._tt_dtype.torch if type(tensors[0]) is TensorProxy else None
    return dtype in _EXACT and all(type(t) is TensorProxy and t._tt_dtype.torch is dtype and t._tt_device.type == "cpu"
                                   for t in tensors)


_MUL = frozenset({torch.mul, torch.Tensor.mul})
_ADD = frozenset({torch.add, torch.Tensor.add})


def _identity_arith(b) -> bool:
    """``mul(x, 1)`` or ``add(i, 0)`` (integer ``i``) whose result has ``x``'s dtype, sizes and strides."""
    if b.kwargs or len(b.args) != 2 or not _laid_out(b.args[0]) or not _laid_out(b.output):
        return False
    x, n, out = b.args[0], b.args[1], b.output
    try:
        fn_mul, fn_add = _fn(b) in _MUL, _fn(b) in _ADD
    except TypeError:  # an unhashable callable
        return False
    if type(n) not in (int, float) or out._tt_dtype is not x._tt_dtype:
        return False
    if not ((fn_mul and n == 1) or (fn_add and n == 0 and not x._tt_dtype.torch.is_floating_point
                                    and not x._tt_dtype.torch.is_complex)):
        return False
    return (tuple(out._tt_shape) == tuple(x._tt_shape) and tuple(out._tt_strides) == tuple(x._tt_strides)
            and out._tt_storage_offset == x._tt_storage_offset)


def _pure_readers_only(trc) -> set:
    """ids of values every reader of which is a torch call that writes nothing (no in-place op, no ``out=``, no
    ttex kernel that may write into an argument) and that are not returned."""
    from ..pytree import tree_flatten

    unsafe = {id(o) for o in tree_flatten(trc.output)[0] if is_proxy(o)}
    for b in trc.bound_symbols:
        fn = _fn(b)
        name = getattr(fn, "__name__", "") or ""
        module = getattr(fn, "__module__", None) or getattr(getattr(fn, "__objclass__", None), "__module__", "") or ""
        pure = (fn is not None and not b.has_side_effect and not (name.endswith("_") and not name.endswith("__"))
                and module.startswith("torch") and module != torch_impls.__name__ and "out" not in b.kwargs
                and not b.kwargs.get("inplace", False))
        if not pure:
            unsafe.update(id(a) for a in b.flat_args() if is_proxy(a))
    return unsafe


def decide_layouts(trc, header=None):
    """The trace with its layout questions answered from the traced layouts (see the module docstring)."""
    verify = torch_impls.VERIFY_DECIDED_LAYOUTS
    # Lines other than the torch executor's calls (a fused region compiled for its inputs) keep what they read.
    kept = {id(a) for b in trc.bound_symbols if not isinstance(b.sym, ImplSymbol) for a in b.flat_args()}
    mapping: dict = {}  # id(dropped grad_layout output) -> its gradient
    unsafe = None  # ids of values a line may write or that are returned (_pure_readers_only), when first needed
    new = trc.derive(header or trc.header)
    changed = False
    for b in trc.bound_symbols:
        if mapping:
            b = b.renamed(mapping)
        fn = _fn(b)
        if fn is torch_impls.grad_layout and id(b.output) not in kept and _identity_grad_layout(b):
            changed = True
            if verify:
                b = b.replace(sym=impl_symbol(torch_impls.grad_layout_decided))
            else:
                mapping[id(b.output)] = b.args[0]
                continue
        elif fn is torch_impls.grad_layout and (copy := _dense_copy(b)) is not None:
            changed = True
            b = b.replace(sym=impl_symbol(torch_impls.grad_copy), args=(b.args[0], *copy))
        elif fn is not None and not verify and id(b.output) not in kept and _identity_arith(b):
            unsafe = _pure_readers_only(trc) if unsafe is None else unsafe
            if id(b.output) not in unsafe and id(b.args[0]) not in unsafe:
                changed = True
                mapping[id(b.output)] = b.args[0]
                continue
        elif fn is torch_impls.foreach_add_ and _same_cpu_float(b):
            changed = True
            b = b.replace(sym=impl_symbol(torch_impls.foreach_add_same_, side_effect="side_effect" in b.sym.tags),
                          args=(*b.args, b.args[0][0]._tt_dtype.torch))
        elif getattr(fn, "layout_lists", None) and "odd" not in b.kwargs:
            odd = _decided_odd(b)
            if odd is not None:
                changed = True
                b = b.replace(kwargs={**b.kwargs, "odd": odd})
        new.bound_symbols.append(b)
    if not changed:
        return trc
    new.output = tree_map(lambda x: mapping.get(id(x), x) if is_proxy(x) else x, trc.output)
    return new

