"""Whether a compiled kernel's tensors are laid out as it was compiled for, checked before every call.

A fused region's kernel is compiled for the trace's sizes, strides and dtypes of its inputs and output buffers
(executors/inductor_fusion.py).  Inductor's generated code can check them itself (``assert_size_stride``, one call
per tensor, ~0.5 us each: half a small kernel's call); instead the kernel is compiled without those asserts and
this check runs first, in one C++ call for all its tensors (``TensorGuards`` from torch's guard library, as thin
mode's parameter checks use, compiler/bulk.py: ~0.1 us a tensor).

``TensorGuards`` compares everything it saw on the tensors it was built from: dtype, device, ``requires_grad``,
dispatch keys, every size and stride.  That is stricter than what the kernel needs (the strides of size-1 dims and
of empty tensors do not matter, and two call sites sharing a kernel may pass a parameter and an activation), so it
is only the fast path: a call it refuses is compared with the compiled layouts in Python (the kernel's own rule),
and when those fit, a ``TensorGuards`` of that call's tensors joins the fast path (at most ``MAX_PATTERNS``).
Where torch's guard library is missing, kernels keep Inductor's asserts (``needs_asserts``).
"""
from __future__ import annotations

import torch

from .. import bulk

MAX_PATTERNS = 8  # TensorGuards kept per kernel: call sites whose tensors differ only in what the kernel ignores


def needs_asserts() -> bool:
    """Whether kernels must keep Inductor's own input checks (no C++ metadata check on this torch)."""
    return "meta" not in bulk.supported()


def _never(*tensors) -> bool:
    return False


class LayoutCheck:
    """``check(tensors) -> bool`` for a kernel compiled for ``layouts``: one ``(shape, strides, dtype, device
    type)`` per tensor, in the order the kernel takes them."""

    def __init__(self, layouts):
        self.layouts = [(tuple(s), tuple(st), dt, dev) for s, st, dt, dev in layouts]
        self.first = _never  # the first pattern's C++ check (the common case: one pattern)
        self.more: list = []  # the other patterns' checks

    def __call__(self, tensors) -> bool:
        if self.first(*tensors):
            return True
        for check in self.more:
            if check(*tensors):
                return True
        if len(tensors) != len(self.layouts) or not all(map(_laid_out_as, tensors, self.layouts)):
            return False
        if self.first is _never:
            self.first = bulk.tensor_meta_check(tensors)
        elif len(self.more) < MAX_PATTERNS - 1:
            self.more.append(bulk.tensor_meta_check(tensors))
        return True


def _laid_out_as(t, layout) -> bool:
    """The kernel's own rule (Inductor's ``assert_size_stride``): equal sizes, and equal strides where a dim has
    more than one element, in a non-empty tensor; plus dtype and device type, which its code assumes."""
    shape, strides, dtype, device = layout
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device.type != device or tuple(t.shape) != shape:
        return False
    if 0 in shape:
        return True
    return all(n == 1 or a == b for n, a, b in zip(shape, t.stride(), strides))
