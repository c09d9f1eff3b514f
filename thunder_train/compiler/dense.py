"""c10's non-overlapping-and-dense rule on plain sizes and strides: whether some order of a tensor's dimensions makes
it row-major (what ``is_contiguous``-like decisions, ``.grad`` layouts and the fused optimizer kernels ask)."""
from __future__ import annotations

import math

import torch


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether some order of ``t``'s dimensions makes it row-major (torch's rule: torch._prims_common's
    ``is_non_overlapping_and_dense``, c10's ``compute_non_overlapping_and_dense``): fewer than 2 elements, a
    1-d tensor of stride 1, or, dimensions of size 1 aside, strides that are the running products of the sizes
    taken in order of stride.  Written here because torch._prims_common's version imports
    torch.fx.experimental.symbolic_shapes and sympy (about 0.5 s) on its first call, at a compiled function's
    first call or, through ``ttex.grad_layout``, in the middle of a step (tests/test_first_call.py)."""
    if t.is_sparse:
        return False
    return dense_layout(tuple(t.shape), t.stride())


def dense_layout(sizes, strides) -> bool:
    """``is_non_overlapping_and_dense`` of a strided tensor with these int sizes and strides (no tensor made)."""
    if math.prod(sizes) < 2:
        return True
    if len(sizes) == 1:
        return strides[0] == 1
    expected = 1
    for size, stride in sorted(((n, s) for n, s in zip(sizes, strides) if n != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True
