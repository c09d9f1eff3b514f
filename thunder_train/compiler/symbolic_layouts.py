"""The layout of a tensor whose sizes are symbolic: what its program relies on, and ``stride()`` as a function of
its sizes (the key of such an input, compiler/prologue.py and runtime/thin_checks.py; ``Tensor.stride()`` while
tracing, torchlang/tensor_methods.py)."""
from __future__ import annotations

import torch

from .proxies import SizeProxy, size_value


def stride_order(sizes, strides) -> tuple:
    """The dimensions from outermost to innermost: by stride, largest first (ties: the earlier dimension first)."""
    return tuple(sorted(range(len(sizes)), key=lambda d: (-strides[d], d)))


_ROWMAJOR_KEYS: dict = {}


def layout_key(t) -> tuple:
    """The layout of an input with symbolic sizes, as its program relies on it (prologue.py, thin_checks.py).

    The trace of such an input records its example strides, but a later call with other sizes has other
    strides; what must match is the layout's *form*, which does not change with the sizes:
    ``("dense", order)`` when the strides are the running products of the sizes in that dimension order
    (contiguous, transposed, permuted: ``Tensor.stride()`` is then a function of the sizes, tensor_methods.py);
    else ``("strided", order, innermost stride, gaps)``, ``gaps[k]`` saying whether the k-th dimension (in
    order) is laid out with room after it (a slice such as ``ids[:, :-1]`` of a padded batch, or of a fixed
    max-length buffer).  Which reshapes are views and the layout of every result follow from the form; the
    strides' values are not used (``stride()`` of such a tensor refuses).  A contiguous tensor (torch's
    ``is_contiguous``) is ``("dense", (0, 1, ...))``, found without computing anything else."""
    if t.is_contiguous():
        n = t.dim()
        k = _ROWMAJOR_KEYS.get(n)
        if k is None:
            k = _ROWMAJOR_KEYS[n] = ("dense", tuple(range(n)))
        return k
    sizes, strides = tuple(t.shape), t.stride()
    order = stride_order(sizes, strides)
    gaps, expected = [], None
    for d in reversed(order):
        if expected is not None:
            gaps.append(strides[d] != expected)
        expected = strides[d] * max(sizes[d], 1)
    gaps.reverse()
    inner = strides[order[-1]] if order else 1
    if inner == 1 and not any(gaps):
        return ("dense", order)
    return ("strided", order, inner, tuple(gaps))


def _tracing_symbolic_inputs() -> bool:
    from .context import tracer_state

    walker = getattr(tracer_state(), "walker", None)
    return bool(getattr(walker, "symbolic_inputs", None))


def symbolic_strides(p) -> tuple:
    """``Tensor.stride()`` of a proxy with symbolic sizes: the running products of its sizes (symbolic where they
    are) in its dimension order, the same for every call its program accepts (its inputs' ``layout_key``).  A
    tensor not dense in any order (a slice) has strides that its sizes do not give: refused, also with constant
    sizes while the trace has symbolic inputs (``x[:, 0]`` of an ``[2, T, 4]`` input has the stride ``4 * T``)."""
    example = tuple(size_value(s) for s in p._tt_shape)
    order = stride_order(example, p._tt_strides)
    if not any(type(s) is SizeProxy for s in p._tt_shape):
        dense = layout_key(torch.empty_strided(example, p._tt_strides, device="meta"))[0] == "dense"
        if dense or not _tracing_symbolic_inputs():
            return tuple(p._tt_strides)  # dense with constant sizes, or nothing symbolic: the strides are constants
    out, step = [0] * len(example), 1
    for d in reversed(order):
        out[d] = step
        n = p._tt_shape[d]
        step = n if type(step) is int and step == 1 and type(n) is SizeProxy else step * (n if type(n) is SizeProxy else max(n, 1))
    if tuple(size_value(s) for s in out) != tuple(p._tt_strides):
        from .errors import TracingError

        raise TracingError(
            "Tensor.stride() of a tensor with symbolic sizes that is not laid out densely (a slice or a strided view): its "
            "strides are not a function of its sizes, so the program cannot answer them for other sizes. Compute what "
            "needs the strides outside the compiled function, make the tensor .contiguous() first, or pass dynamic=False.")
    return tuple(out)
