"""Eager's refusal of an in-place op whose input partly overlaps the tensor it writes (``y.mul_(y[0])``,
``y[1:].add_(y[:-1])``): "unsupported operation: some elements of the input tensor and the written-to tensor refer
to a single memory location", and of one whose destination overlaps itself (an expanded tensor: "more than one
element of the written-to tensor refers to a single memory location").

Eager raises at the op itself, before it writes anything.  The functional trace would compute a value (every read
sees the old memory), so the op is checked where it is traced, before its lines: torch's rule
(``at::get_overlap_status``) on the proxies' layouts (sizes, strides, storage offsets, all eager's) says whether an
argument sharing the destination's memory overlaps it partly; only then is the op asked on small real CPU tensors
laid out the same in one storage (not every in-place kernel checks; copy_ does not), and eager's error is raised
where torch raises it.  No error where eager has none; a case the layouts cannot tell (symbolic sizes, tensors
that overlap themselves) is not checked.
"""
from __future__ import annotations

import math

import torch

from ..dense import dense_layout
from ..proxies import TensorProxy
from ..pytree import tree_flatten, tree_unflatten
from ..generators_kept import generators_untouched

_MESSAGE = "refer to a single memory location"
_SELF_MESSAGE = "written-to tensor refers to a single memory location"  # (the destination overlapping itself)
_PROBE_LIMIT = 1 << 20  # elements of the probe's storage


def _layout(p):
    """``(sizes, strides, offset)`` of a proxy with concrete sizes, else None."""
    shape, strides, offset = p._tt_shape, p._tt_strides, p._tt_storage_offset
    if not all(type(x) is int for x in (*shape, *strides, offset)):
        return None
    return shape, strides, offset


def _partial(a, b) -> bool:
    """torch's ``get_overlap_status(a, b) == PARTIAL`` for two tensors of one memory, from their layouts."""
    la, lb = _layout(a), _layout(b)
    if la is None or lb is None or not math.prod(la[0]) or not math.prod(lb[0]):
        return False
    if not (dense_layout(*la[:2]) and dense_layout(*lb[:2])):
        return False  # TOO_HARD: torch does not refuse
    ia, ib = a._tt_dtype.torch.itemsize, b._tt_dtype.torch.itemsize
    a0, b0 = la[2] * ia, lb[2] * ib
    a1, b1 = a0 + math.prod(la[0]) * ia, b0 + math.prod(lb[0]) * ib
    if (a0, a1) == (b0, b1):
        return la[1] != lb[1] or ia != ib
    return a0 < b1 and b0 < a1


def _overlaps_itself(p) -> bool:
    """torch's ``has_internal_overlap(p) == YES``: a dimension of size above 1 with stride 0 (an ``expand``ed tensor),
    where most in-place kernels refuse to write (``x.expand(3, 4).add_(1)``; ``fill_``, ``zero_`` and indexed writes
    do not)."""
    layout = _layout(p)
    return layout is not None and any(n > 1 and s == 0 for n, s in zip(layout[0], layout[1]))


def check_partial_overlap(st, fn, orig_args, kwargs, dst=None) -> None:
    """Before the in-place op ``fn(*orig_args, **kwargs)`` (the user's tensors) is traced: eager's error where an
    argument partly overlaps the destination, ``orig_args[0]`` (or ``dst``: the ``out=`` tensor)."""
    if dst is None:
        dst = orig_args[0] if orig_args else None
    if fn is None or type(dst) is not TensorProxy:
        return
    buffers = st.buffers

    def memory(t):
        base = buffers.base_of(t)
        return t if base is None else base

    flat, spec = tree_flatten((tuple(orig_args), dict(kwargs)))
    sharing = [a for a in flat if type(a) is TensorProxy and a is not dst and memory(a) is memory(dst)]
    if not any(_partial(dst, a) for a in sharing) and not _overlaps_itself(dst):
        return
    if dst._tt_device.type not in ("cpu", "cuda") or any(a._tt_dtype is not dst._tt_dtype for a in sharing):
        return
    try:
        probe = _probe(fn, flat, spec, [dst] + sharing)
    except Exception:  # noqa: BLE001 - not askable: not checked
        return
    if probe is not None:
        raise RuntimeError(probe)


def _probe(fn, flat, spec, shared):
    """Eager's error message of ``fn`` on real CPU tensors, ``shared`` (the destination first) laid out in one storage
    as the proxies are; or, where torch runs it, ours when its result differs from the one computed from every
    argument's old values (what the compiled program computes): a kernel that reads what it already wrote."""
    layouts = [_layout(p) for p in shared]
    if any(x is None for x in layouts):
        return None
    extent = max(off + 1 + sum((n - 1) * s for n, s in zip(shape, strides)) for shape, strides, off in layouts)
    if extent > _PROBE_LIMIT:
        return None
    initial = _distinct_values(extent, shared[0]._tt_dtype.torch)
    storage = initial.clone()
    real = {id(p): storage.as_strided(shape, strides, off) for p, (shape, strides, off) in zip(shared, layouts)}
    # the compiled program's reading: each shared argument its own memory, holding the old values
    apart = {id(p): initial.clone().as_strided(shape, strides, off) for p, (shape, strides, off) in zip(shared, layouts)}
    args, separate = [], []
    for a in flat:
        if type(a) is TensorProxy:
            if id(a) not in real:
                if _layout(a) is None:
                    return None
                shape = _layout(a)[0]
                real[id(a)] = torch.ones(shape, dtype=a._tt_dtype.torch) if math.prod(shape) <= _PROBE_LIMIT else None
                if real[id(a)] is None:
                    return None
            args.append(real[id(a)])
            separate.append(apart.get(id(a), real[id(a)]))
        else:
            args.append(a)
            separate.append(a)
    with torch.no_grad(), torch._C.DisableTorchFunction(), generators_untouched() as private:
        try:
            a, k = tree_unflatten(args, spec)
            fn(*a, **k)
        except RuntimeError as e:
            return str(e) if _MESSAGE in str(e) or _SELF_MESSAGE in str(e) else None
        private.reseed()  # the same draws for the second run (bernoulli_)
        a, k = tree_unflatten(separate, spec)
        fn(*a, **k)
    if torch.equal(real[id(shared[0])], apart[id(shared[0])]):
        return None
    return (f"thunder_train: {getattr(fn, '__name__', 'an in-place op')} writes a tensor while reading an argument "
            "that partly overlaps it; torch runs it without an error, but its result depends on the order in which "
            "its kernel writes, and differs from the one computed from the argument's old values (what a compiled "
            "program computes). Clone the argument first (y.bernoulli_(y[0].clone())).")


def _distinct_values(n, dtype):
    """``n`` values that differ from their neighbours, so that a kernel reading what it wrote shows in its result."""
    if dtype == torch.bool:
        return torch.arange(n) % 2 == 0
    if dtype.is_floating_point or dtype.is_complex:
        return torch.linspace(0.05, 0.95, n).to(dtype)
    return (torch.arange(n) % 5 + 1).to(dtype)
