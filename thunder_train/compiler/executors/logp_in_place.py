"""Cross-entropy's log-probabilities written over its logits when nothing reads the logits afterwards.

``transforms/saved_statistics.py`` makes a whole step's cross-entropy keep its log-probabilities ``logp`` for the
backward (``cross_entropy_with_stats``).  In a language model the logits are the step's largest value
(batch x sequence x vocabulary) and nothing but the loss reads them: computing ``logp`` into a new array held
two arrays of that size at once.  When the logits' memory is read by no later line (no alias of it either),
is not an input of the program and is not returned, ``log_softmax`` writes into it instead (the kernel
reads each row before it writes it; the values are bitwise the same).  One logits-sized array less at the
step's peak: the GPT benchmark's peak falls by its logits' 16 MiB (docs/performance.md).
"""
from __future__ import annotations

import torch

from . import torch_impls
from .buffers import _aliased_args, _keeps_no_reference, out_form
from .torch_executor import ImplSymbol, impl_symbol
from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten


def cross_entropy_with_stats_into_input(input, target, ignore_index, reduction):
    """``cross_entropy_with_stats`` with the log-probabilities written into ``input`` (which it returns as them)."""
    logp = torch.ops.aten._log_softmax.out(input, 1, False, out=input)
    loss, total_weight = torch.ops.aten.nll_loss_forward(logp, target, None, reduction, ignore_index)
    return loss, logp, total_weight




def cross_entropy_backward_into_logp(g, logp, target, total_weight, ignore_index, reduction):
    """Eager's two cross-entropy backward kernels (``nll_loss_backward``, then ``_log_softmax_backward_data``) in
    one pass over ``logp``, written into it, without the logits-sized gradient of ``logp`` between them.

    That gradient is ``c_i`` at row i's target and 0 elsewhere (``c = -g / total_weight`` for the mean, ``-g``
    otherwise; 0 on ignored rows), so the log-softmax backward ``g_logp - exp(logp) * rowsum(g_logp)`` is
    ``-(exp(logp) * c_i)`` plus ``c_i`` at the target: the same products and sums as eager's kernel."""
    n = logp.shape[0]
    c = -(g / total_weight) if reduction == 1 else -g
    valid = target != ignore_index
    c = torch.where(valid, c.expand(n) if c.dim() == 0 else c, torch.zeros((), dtype=c.dtype))
    logp.exp_().mul_(c.unsqueeze(1)).neg_()
    logp.scatter_add_(1, torch.where(valid, target, 0).unsqueeze(1), c.unsqueeze(1).to(logp.dtype))
    return (logp,)


for _f, _alias in ((cross_entropy_with_stats_into_input, (0,)), (cross_entropy_backward_into_logp, (1,))):
    _f.__module__ = torch_impls.__name__  # printed as ttex.<name>
    _f.aliases = _alias  # the result is that argument's memory (executors/buffers.py)
    setattr(torch_impls, _f.__name__, _f)


def _storages(trc):
    """(may_alias: id(value) -> storage ids, last line reading each storage, storages that must not change)."""
    may_alias: dict = {}
    last: dict = {}
    fixed: set = set()
    for a in trc.args:
        if type(a) is TensorProxy:
            may_alias[id(a)] = {id(a)}
            fixed.add(id(a))
    for i, b in enumerate(trc.bound_symbols):
        reached = set()
        for a in b.flat_args():
            if type(a) is TensorProxy:
                reached |= may_alias.get(id(a), set())
        for s in reached:
            last[s] = i
        if not _keeps_no_reference(b):
            fixed |= reached
        aliased = () if out_form(b) is not None else _aliased_args(b)  # as executors/buffers.py ``plan``
        shared = reached if aliased is None else set().union(
            *(may_alias.get(id(x), set()) for x in tree_flatten([b.args[k] for k in aliased])[0] if type(x) is TensorProxy))
        for o in b.flat_outputs():
            if type(o) is TensorProxy:
                may_alias[id(o)] = set(shared) if aliased != () and shared else {id(o)}
    for p in tree_flatten(trc.output)[0]:
        if is_proxy(p):
            fixed |= may_alias.get(id(p), set())
    return may_alias, last, fixed


def logp_into_dead_logits(trc, header=None):
    lines = trc.bound_symbols
    targets = [i for i, b in enumerate(lines)
               if isinstance(b.sym, ImplSymbol) and b.sym.fn is torch_impls.cross_entropy_with_stats and not b.kwargs]
    if not targets:
        return trc
    may_alias, last, fixed = _storages(trc)
    new_lines = list(lines)
    for i in targets:
        b = lines[i]
        x, logp = b.args[0], b.output[1]
        stores = may_alias.get(id(x), set())
        if (type(x) is not TensorProxy or not stores or stores & fixed or any(last.get(s) != i for s in stores)
                or x._tt_strides != logp._tt_strides or x._tt_storage_offset != 0 or x._tt_dtype is not logp._tt_dtype):
            continue
        new_lines[i] = b.replace(sym=impl_symbol(cross_entropy_with_stats_into_input),
                                 comment="log-probabilities written over the logits (nothing reads them later)")
    new_lines = _one_backward_pass(new_lines)
    if new_lines == list(lines):
        return trc
    new = trc.derive(header or trc.header)
    new.bound_symbols = new_lines
    return new


def _one_backward_pass(lines):
    """``g_nll = nll_loss_backward(g, logp, ...)`` read only by ``log_softmax_backward_into_logp(g_nll, logp)``:
    one ``cross_entropy_backward_into_logp`` line instead."""
    reads: dict = {}
    for b in lines:
        for a in b.flat_args():
            if type(a) is TensorProxy:
                reads[id(a)] = reads.get(id(a), 0) + 1
    out, drop = list(lines), set()
    for j, b in enumerate(lines):
        if not (isinstance(b.sym, ImplSymbol) and b.sym.fn is torch_impls.log_softmax_backward_into_logp) or b.kwargs:
            continue
        g_nll, logp = b.args
        i = next((i for i in range(j - 1, -1, -1) if any(o is g_nll for o in lines[i].flat_outputs())), None)
        if i is None or reads.get(id(g_nll)) != 1:
            continue
        nb = lines[i]
        if not (isinstance(nb.sym, ImplSymbol) and nb.sym.fn is torch_impls.nll_loss_backward) or nb.kwargs or nb.args[1] is not logp:
            continue
        g, _, target, total, ignore_index, reduction = nb.args
        if reduction not in (0, 1, 2) or type(ignore_index) is not int:
            continue
        drop.add(i)
        out[j] = b.replace(sym=impl_symbol(cross_entropy_backward_into_logp),
                           args=(g, logp, target, total, ignore_index, reduction),
                           comment="cross-entropy's backward in one pass over the log-probabilities")
    return [b for k, b in enumerate(out) if k not in drop]
