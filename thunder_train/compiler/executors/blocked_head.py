"""A language model's head and its cross-entropy by blocks of rows, when the program asks for memory.

The head's logits (tokens x vocabulary) are the largest arrays of a language model's step.  The whole-step
cross-entropy kernels (``executors/saved_statistics.py``) already keep one logits-sized array instead of three;
with activation checkpointing or a ``memory_budget`` that one array is most of the step's peak.  Here the head's
``linear`` and the cross-entropy after it become two lines that never hold the logits whole:

* ``ttex.linear_cross_entropy``: for each block of rows, the block's logits (the head's matmul on those rows),
  eager's ``_log_softmax`` and ``nll_loss_forward`` (per row: it checks the targets as eager does); the loss is
  then eager's ``nll_loss_forward`` reduction over the per-row values, in eager's row order;
* ``ttex.linear_cross_entropy_backward``: for each block, the logits and log-probabilities again, eager's two
  backward kernels (``nll_loss_backward``, ``_log_softmax_backward_data``), then the block's share of the head's
  input gradient (its rows) and weight/bias gradients (summed over the blocks).

Values: each block's logits are the rows of eager's matmul (the same GEMM on fewer rows: equal in practice, not
promised by the BLAS), so the loss and the input gradient are eager's up to that; the weight and bias gradients are
sums over blocks, a different summation order than eager's one matmul (rounding-level differences,
``tests/test_memory.py::test_blocked_head_values``).  This is why the rewrite runs only where the program asks
for memory (checkpoint regions or a budget): the default keeps eager's values bitwise.

Where the incoming gradient can exist before the loss (``loss.backward()``'s constant seed, or an input), the two
lines are one, ``ttex.linear_cross_entropy_and_grads``: each block goes through the backward kernels right after
its forward ones, so the logits are computed once, as in eager.  Otherwise the backward line computes them again
(the head's matmul once more).
"""
from __future__ import annotations

import torch

from .. import dtypes
from ..prims import linalg as prims_linalg, reductions as prims_reductions, shapes as prims_shapes
from ..proxies import TensorProxy, is_proxy, size_value
from ..pytree import tree_flatten
from ..torchlang import nn as ltorch_nn, shapes as ltorch_shapes
from . import torch_impls
from .saved_statistics import cross_entropy_backward_into_logp, cross_entropy_into_logits
from .torch_executor import impl_symbol

# One block of logits: the forward holds two (logits, log-probabilities), the backward two as well.
_BLOCK_BYTES = 1 << 20


def _blocks(n, v, itemsize):
    rows = max(1, _BLOCK_BYTES // max(1, v * itemsize))
    return [(a, min(n, a + rows)) for a in range(0, n, rows)]


def _logits(x2, w, b, a, e, out):
    """The head's output for rows ``a:e``: eager's ``linear`` on 2-D rows is ``mm`` (no bias) or ``addmm``."""
    if b is None:
        return torch.mm(x2[a:e], w.t(), out=out)
    return torch.addmm(b, x2[a:e], w.t(), out=out)


def _target2(target, ignore_index):
    """The targets of the two-column input ``_reduce`` builds: each kept row's target names the column that holds
    its value (1 where ignore_index is 0, so that no kept row reads as ignored); ignored rows stay ignored."""
    col = 1 if ignore_index == 0 else 0
    return torch.where(target == ignore_index, target, torch.full_like(target, col))


def _reduce(per_row, target2, reduction, ignore_index):
    """(loss, total weight): eager's ``nll_loss_forward`` reduction over the per-row values, in eager's row order."""
    n = per_row.shape[0]
    picked = per_row.neg().unsqueeze(1).expand(n, 2).contiguous()
    return torch.ops.aten.nll_loss_forward(picked, target2, None, reduction, ignore_index)


def _block_forward(x2, w, b, target, ignore_index, a, e, logits, logp, per_row):
    """The block's logits and log-probabilities (into ``logits``, ``logp``) and its rows' losses (into ``per_row``;
    raises on a bad target as eager does)."""
    _logits(x2, w, b, a, e, logits)
    torch.ops.aten._log_softmax.out(logits, 1, False, out=logp)
    # reduction none: -logp at each row's target (0 where ignored)
    loss_rows, _ = torch.ops.aten.nll_loss_forward(logp, target[a:e], None, 0, ignore_index)
    per_row[a:e] = loss_rows


def _block_backward(g, x2, w, target, total_weight, ignore_index, reduction, a, e, logits, logp, dx, dw, db):
    """Eager's two backward kernels on the block's log-probabilities ``logp`` (over ``logits`` and ``logp``), then
    the block's rows of the input gradient and its share of the weight and bias gradients."""
    gb = g[a:e] if g.dim() else g  # reduction="none": one incoming gradient per row
    g_nll = torch.ops.aten.nll_loss_backward.grad_input(gb, logp, target[a:e], None, reduction, ignore_index,
                                                        total_weight, grad_input=logits)
    grad = torch.ops.aten._log_softmax_backward_data.out(g_nll, logp, 1, logp.dtype, out=logp)
    if dx is not None:
        torch.mm(grad, w, out=dx[a:e])
    if dw is not None:
        dw.addmm_(grad.t(), x2[a:e])
    if db is not None:
        db.add_(grad.sum(0))


def _buffers(x2, w, which):
    n, v = x2.shape[0], w.shape[0]
    blocks = _blocks(n, v, x2.element_size())
    rows = blocks[0][1] - blocks[0][0] if blocks else 0
    dx = x2.new_empty(x2.shape) if 0 in which else None
    dw = torch.zeros_like(w, memory_format=torch.contiguous_format) if 1 in which else None
    db = torch.zeros((v,), dtype=x2.dtype, device=x2.device) if 2 in which else None
    return blocks, x2.new_empty((rows, v)), x2.new_empty((rows, v)), dx, dw, db


def linear_cross_entropy(x, w, b, target, ignore_index, reduction):
    """``cross_entropy(linear(x, w, b).flatten(0, -2), target)``: (loss, total weight), the logits one block of rows
    at a time."""
    x2 = x.reshape(-1, x.shape[-1])
    blocks, logits, logp, _, _, _ = _buffers(x2, w, ())
    per_row = x2.new_empty((x2.shape[0],))
    for a, e in blocks:
        _block_forward(x2, w, b, target, ignore_index, a, e, logits[:e - a], logp[:e - a], per_row)
    del logits, logp
    loss, total_weight = _reduce(per_row, _target2(target, ignore_index), reduction, ignore_index)
    return (per_row if reduction == 0 else loss), total_weight


def linear_cross_entropy_backward(g, x, w, b, target, total_weight, ignore_index, reduction, which):
    """The gradients ``which`` names (0 input rows as ``(tokens, features)``, 1 weight, 2 bias) of
    ``linear_cross_entropy``, block of rows by block."""
    x2 = x.reshape(-1, x.shape[-1])
    blocks, logits, logp, dx, dw, db = _buffers(x2, w, which)
    for a, e in blocks:
        k = e - a
        _logits(x2, w, b, a, e, logits[:k])
        torch.ops.aten._log_softmax.out(logits[:k], 1, False, out=logp[:k])
        _block_backward(g, x2, w, target, total_weight, ignore_index, reduction, a, e, logits[:k], logp[:k], dx, dw, db)
    return tuple(t for t in (dx, dw, db) if t is not None)


def linear_cross_entropy_and_grads(g, x, w, b, target, ignore_index, reduction, which):
    """``linear_cross_entropy`` and, where the incoming gradient ``g`` is known before the loss (a whole step's
    ``loss.backward()``: a constant), ``linear_cross_entropy_backward``'s gradients in the same pass: each block's
    log-probabilities go through the backward kernels while they are there, so the logits are never computed again.
    The same kernels on the same values as the two lines: the same results.  (loss, total weight, *gradients)."""
    x2 = x.reshape(-1, x.shape[-1])
    n = x2.shape[0]
    target2 = _target2(target, ignore_index)
    # The total weight the backward kernels divide by: the reduction's, which reads only the targets.
    _, total_weight = _reduce(x2.new_zeros((n,)), target2, reduction, ignore_index)
    blocks, logits, logp, dx, dw, db = _buffers(x2, w, which)
    per_row = x2.new_empty((n,))
    for a, e in blocks:
        k = e - a
        _block_forward(x2, w, b, target, ignore_index, a, e, logits[:k], logp[:k], per_row)
        _block_backward(g, x2, w, target, total_weight, ignore_index, reduction, a, e, logits[:k], logp[:k], dx, dw, db)
    del logits, logp
    loss, total_weight = _reduce(per_row, target2, reduction, ignore_index)
    return ((per_row if reduction == 0 else loss), total_weight) + tuple(t for t in (dx, dw, db) if t is not None)


def _scratch_bytes(x, w) -> int:
    """What the functions above allocate and free inside their call, beyond their results: two blocks of logits and
    the per-row values, the reduction's two columns, its targets (int64) and total-weight zeros."""
    n, v = 1, w._tt_shape[0]
    for d in x._tt_shape[:-1]:
        n *= d
    item = x._tt_dtype.torch.itemsize
    rows = min(n, max(1, _BLOCK_BYTES // max(1, v * item)))
    return 2 * rows * v * item + 4 * n * item + 8 * n


for _f in (linear_cross_entropy, linear_cross_entropy_backward, linear_cross_entropy_and_grads):
    _f.__module__ = torch_impls.__name__  # printed as ttex.<name>
    setattr(torch_impls, _f.__name__, _f)
    _f.aliases = ()
# Kept buffers count it as memory alive at the line (executors/buffers.py): with the arena full there, the tiny GPT's
# checkpointed step peaked inside the head, its fused program 1.46x the torch program's.
linear_cross_entropy.scratch_bytes = lambda x, w, *rest, **kw: _scratch_bytes(x, w)
linear_cross_entropy_backward.scratch_bytes = linear_cross_entropy_and_grads.scratch_bytes = (
    lambda g, x, w, *rest, **kw: _scratch_bytes(x, w))


# ---------------------------------------------------------------------------
# The pass
# ---------------------------------------------------------------------------
_RESHAPES = (prims_shapes.reshape, ltorch_shapes.reshape, ltorch_shapes.view, ltorch_shapes.flatten)


def _src(b):
    return b.source if b.source is not None else b.sym


def _fn(b):
    return getattr(b.sym, "fn", None)


class _Lines:
    """Where each value is made and read in a list of lines."""

    def __init__(self, bsyms):
        self.made, self.readers = {}, {}
        for i, b in enumerate(bsyms):
            for a in b.flat_args():
                if type(a) is TensorProxy:
                    self.readers.setdefault(id(a), []).append(i)
            for o in b.flat_outputs():
                if type(o) is TensorProxy:
                    self.made[id(o)] = i

    def only_reader(self, value, i) -> bool:
        return self.readers.get(id(value), []) == [i]


def _forward_match(bsyms, lines, i):
    """``(linear line, reshape line or None, x, w, b)`` for the ``cross_entropy_into_logits`` line ``i``, or None."""
    ce = bsyms[i]
    logits2 = ce.args[0]
    j = lines.made.get(id(logits2))
    if j is None or not lines.only_reader(logits2, i):
        return None
    shaping = None
    if _src(bsyms[j]) in _RESHAPES:
        shaping, logits = j, bsyms[j].args[0]
        j = lines.made.get(id(logits))
        if j is None or type(logits) is not TensorProxy or not lines.only_reader(logits, shaping):
            return None
    lin = bsyms[j]
    if _src(lin) is not ltorch_nn.linear or lin.kwargs.keys() - {"bias"}:
        return None
    x, w = lin.args[0], lin.args[1]
    b = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
    if not all(type(t) is TensorProxy for t in (x, w)) or not (b is None or type(b) is TensorProxy):
        return None
    if w.ndim_ != 2 or x.ndim_ < 2 or (b is not None and b.ndim_ != 1):
        return None
    if any(t._tt_device.type != "cpu" or t._tt_dtype not in (dtypes.float32, dtypes.float64) or t._tt_dtype is not x._tt_dtype
           for t in (x, w) + ((b,) if b is not None else ())):
        return None
    shape = tuple(x._tt_shape)
    if not all(type(s) is int for s in shape) or not all(type(s) is int for s in logits2._tt_shape):
        return None
    n = 1
    for s in shape[:-1]:
        n *= s
    if tuple(logits2._tt_shape) != (n, w._tt_shape[0]) or n == 0:
        return None
    return j, shaping, x, w, b


def _backward_match(bsyms, lines, cb_index, x, w, n, v):
    """The lines that read the logits' gradient (``cross_entropy_backward_into_logp``'s result): reshapes of it,
    one transpose of its ``(n, v)`` form and the head's gradient products, each ``(role, line index)`` with role
    0 input (``g @ w``), 1 weight (``g.T @ x``), 2 bias (``g.sum(0)``); None if anything else reads it."""
    g = bsyms[cb_index].output[0]
    flat, transposed = {id(g)}, set()  # the gradient's values with shape (n, v) / (v, n) (and any reshape of it)
    family, found = {id(g)}, {}
    done, x2, x_used = set(), None, x
    for i in range(cb_index + 1, len(bsyms)):
        b = bsyms[i]
        reads = [a for a in b.flat_args() if type(a) is TensorProxy and id(a) in family]
        if not reads:
            continue
        src, out = _src(b), b.output
        if src in _RESHAPES and b.args[0] is reads[0] and len(reads) == 1 and id(reads[0]) not in transposed:
            family.add(id(out))
            if tuple(out._tt_shape) == (n, v):
                flat.add(id(out))
        elif (src is prims_shapes.transpose and len(reads) == 1 and id(reads[0]) in flat
              and tuple(b.args[1]) == (1, 0)):
            family.add(id(out))
            transposed.add(id(out))
        elif src is prims_linalg.matmul and len(b.args) == 2 and len(reads) == 1:
            a0, a1 = b.args
            if id(a0) in flat and a1 is w and 0 not in found:
                found[0] = i
            elif id(a0) in transposed and 1 not in found and _x_rows(bsyms, lines, a1, x, n) is not None:
                found[1], x2, x_used = i, (None if _is_x(a1, x) else a1), _x_rows(bsyms, lines, a1, x, n)
            else:
                return None
        elif (src is prims_reductions.sum and len(reads) == 1 and id(b.args[0]) in flat and tuple(b.args[1]) == (0,)
              and 2 not in found and not b.kwargs):
            found[2] = i
        else:
            return None
        done.add(i)
    return (found, done, x2, x_used) if found else None


def _is_x(value, x) -> bool:
    """``x``, or a copy of it the backward recomputes (transforms/remat.py, a memory budget)."""
    return value is x or getattr(value, "_tt_recomputed_of", None) is x


def _x_rows(bsyms, lines, value, x, n):
    """The ``x`` (or recomputed copy) whose ``(n, d)`` rows ``value`` is, or None."""
    if _is_x(value, x):
        return value
    j = lines.made.get(id(value))
    if j is not None and _src(bsyms[j]) in _RESHAPES and _is_x(bsyms[j].args[0], x) and tuple(value._tt_shape) == (n, x._tt_shape[-1]):
        return bsyms[j].args[0]
    return None


def _known_before(bsyms, lines, g, i):
    """Where the incoming gradient ``g`` is made (-1: an input) when it is, or can be, made before line ``i``: made
    before it, or by a pure line that reads only what exists there (the constant ``loss.backward()`` seeds); else
    None."""
    if type(g) is not TensorProxy:
        return None
    r = lines.made.get(id(g), -1)
    if r < i:
        return r
    rb = bsyms[r]
    if rb.has_side_effect or rb.draws_random or any(lines.made.get(id(a), -1) >= i for a in rb.flat_args() if is_proxy(a)):
        return None
    return r


def whole_logits_bytes(trc) -> int:
    """Bytes of the logits the trace's blocked heads never hold whole (``MemoryPlan.head_by_blocks``)."""
    total = 0
    for b in trc.bound_symbols:
        fn = _fn(b)
        if fn in (linear_cross_entropy, linear_cross_entropy_and_grads):
            x, w = b.args[:2] if fn is linear_cross_entropy else b.args[1:3]  # (the second takes g first)
            n = 1
            for d in (*x._tt_shape[:-1], w._tt_shape[0]):
                n *= size_value(d)
            total += n * x._tt_dtype.torch.itemsize
    return total


def block_the_head(trc, header="Final computation (the head's matmul and cross-entropy by blocks of rows)"):
    """The trace with each head ``linear`` + ``cross_entropy`` pair (``cross_entropy_into_logits`` /
    ``cross_entropy_backward_into_logp`` lines of ``saved_statistics.py``, whose logits nothing else reads and whose
    gradient only the head's own gradient products read) run as ``linear_cross_entropy`` lines."""
    bsyms = list(trc.bound_symbols)
    returned = {id(p) for p in tree_flatten(trc.output)[0] if type(p) is TensorProxy}
    changed = False
    for i in range(len(bsyms)):
        if _fn(bsyms[i]) is not cross_entropy_into_logits:
            continue
        new = _rewrite(bsyms, i, returned)
        if new is not None:
            bsyms, changed = new, True
            break  # one head per program (a language model's); positions changed
    if not changed:
        return trc
    out = trc.derive(header)
    out.bound_symbols = bsyms
    return out


def _rewrite(bsyms, i, returned):
    lines = _Lines(bsyms)
    m = _forward_match(bsyms, lines, i)
    if m is None:
        return None
    lin_i, shaping_i, x, w, b = m
    ce = bsyms[i]
    loss, logp, total = ce.output
    readers = lines.readers.get(id(logp), [])
    if len(readers) != 1 or _fn(bsyms[readers[0]]) is not cross_entropy_backward_into_logp:
        return None
    cb_i = readers[0]
    cb = bsyms[cb_i]
    g, _, target, _, ignore_index, reduction = cb.args
    n, v = ce.args[0]._tt_shape
    bm = _backward_match(bsyms, lines, cb_i, x, w, n, v)
    if bm is None:
        return None
    found, done, x2, xb = bm
    # The backward line reads the x the weight gradient read: the forward's, or the copy a budget recomputes, whose
    # line then moves up to it (when what it reads exists there).
    moved = None
    if xb is not x and lines.made[id(xb)] > cb_i:
        r = lines.made[id(xb)]
        rb = bsyms[r]
        if rb.has_side_effect or rb.draws_random or any(lines.made.get(id(a), -1) >= cb_i for a in rb.flat_args() if type(a) is TensorProxy):
            return None
        moved = r
    if any(lines.made.get(id(t), -1) >= cb_i for t in (w, b, g) if type(t) is TensorProxy):
        return None
    which = tuple(sorted(found))
    grads = tuple(bsyms[found[k]].output for k in which)
    if 0 in found and tuple(grads[0]._tt_shape) != (n, x._tt_shape[-1]):
        return None
    fwd = ce.replace(sym=impl_symbol(linear_cross_entropy), args=(x, w, b, target, ignore_index, reduction), kwargs={},
                     output=(loss, total), comment="the head's matmul and cross-entropy, by blocks of rows: no logits-sized array")
    bwd = cb.replace(sym=impl_symbol(linear_cross_entropy_backward),
                     args=(g, xb, w, b, target, total, ignore_index, reduction, which), kwargs={}, output=grads,
                     comment="the head's gradients, by blocks of rows (logits recomputed per block; weight gradient summed over blocks)")
    drop = {lin_i, cb_i} | done
    if shaping_i is not None:
        drop.add(shaping_i)
    if x2 is not None and lines.readers.get(id(x2)) == [found[1]] and id(x2) not in returned:
        drop.add(lines.made[id(x2)])  # the weight gradient's x.reshape(n, d): nothing else reads it
    if any(id(o) in returned for k in drop for o in bsyms[k].flat_outputs()) or id(logp) in returned:
        return None
    g_line = _known_before(bsyms, lines, g, i)
    if g_line is not None:
        # The incoming gradient can exist when the forward runs (a whole step's loss.backward(): a constant): one
        # line computes the gradients with the loss, from each block's log-probabilities; the logits are not
        # computed again in the backward, and the backward's x (a copy a budget recomputes) is not needed.
        both = ce.replace(sym=impl_symbol(linear_cross_entropy_and_grads),
                          args=(g, x, w, b, target, ignore_index, reduction, which), kwargs={}, output=(loss, total) + grads,
                          comment="the head's matmul, cross-entropy and their gradients, by blocks of rows: no logits-sized "
                                  "array, no second matmul")
        first = [bsyms[g_line], both] if g_line > i else [both]
        return [y for k, line in enumerate(bsyms) if k not in drop and k != g_line
                for y in (first if k == i else (line,))]
    new = []
    for k, line in enumerate(bsyms):
        if k == i:
            new.append(fwd)
        elif k == cb_i:
            new.extend((bsyms[moved], bwd) if moved is not None else (bwd,))
        elif k not in drop and k != moved:
            new.append(line)
    return new
