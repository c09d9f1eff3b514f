"""Sparse tensors (COO, CSR, CSC, BSR, BSC) are refused inside a compiled function, with what to do instead.

A proxy carries a strided tensor's metadata (shape, strides, storage offset: compiler/proxies.py) and every
rule downstream — guards, layout rules, gradients, ``.grad`` accumulation, the optimizers' kernels — assumes
one.  A sparse tensor has no strides, its number of stored elements is data-dependent, and torch has no meta
kernels for most sparse ops, so the compiler cannot follow it; running the ops on a sparse runtime value behind
a strided proxy would be right only by luck.  So a sparse input, or a call that makes a sparse tensor, stops
the trace with this module's error (the call is transactional: nothing the function changed stays changed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import TracingError

_MAKER_METHODS = ("to_sparse", "to_sparse_coo", "to_sparse_csr", "to_sparse_csc", "to_sparse_bsr", "to_sparse_bsc")
_MAKER_FUNCTIONS = ("sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor",
                    "sparse_bsc_tensor", "sparse_compressed_tensor", "_sparse_coo_tensor_unsafe",
                    "_sparse_csr_tensor_unsafe", "_sparse_compressed_tensor_unsafe")
# torch callables whose result is sparse whatever their (strided) arguments
SPARSE_MAKERS = frozenset([getattr(torch.Tensor, n) for n in _MAKER_METHODS if hasattr(torch.Tensor, n)]
                          + [getattr(torch, n) for n in _MAKER_FUNCTIONS if hasattr(torch, n)])

_WHAT_TO_DO = ("thunder_train compiles strided (dense) tensors only: a sparse tensor has no strides for a proxy to "
               "carry and torch has no meta kernels for most sparse ops. Do the sparse part outside the compiled "
               "function (pass its dense result in, e.g. torch.sparse.mm(s, x) computed before the call) or use the "
               "dense form (s.to_dense()).")


def refuse_sparse_input(t: torch.Tensor, where: str) -> None:
    if t.layout != torch.strided:
        raise TracingError(f"{where} is a sparse tensor ({t.layout}). {_WHAT_TO_DO}")


# Ops that run opaquely (their gradient from torch's autograd) and give a sparse gradient when a flag says so:
# op -> (position of the weight, position and keyword of the flag).  Behind a strided proxy that gradient would
# reach .grad and the optimizer's kernels (which refuse it, or treat it as dense only by luck).
_SPARSE_GRAD_FLAGS = {F.embedding_bag: (1, 7, "sparse"), torch.embedding_bag: (0, 5, "sparse")}


def refuse_sparse_call(func, name: str, args: tuple, kwargs: dict) -> None:
    """A call whose result would be sparse (a sparse maker, or a ``layout=`` other than strided), or whose gradient
    would be (``embedding_bag(sparse=True)`` on a weight that requires grad)."""
    layout = kwargs.get("layout")
    if func in SPARSE_MAKERS or (isinstance(layout, torch.layout) and layout != torch.strided):
        raise TracingError(f"{name} makes a sparse tensor inside the compiled function. {_WHAT_TO_DO}")
    flag = _SPARSE_GRAD_FLAGS.get(func)
    if flag is not None:
        w, pos, key = flag
        weight = args[w] if len(args) > w else kwargs.get("weight")
        sparse = args[pos] if len(args) > pos else kwargs.get(key, False)
        if sparse and getattr(weight, "_tt_requires_grad", False) and torch.is_grad_enabled():
            raise TracingError(
                f"{name}(sparse=True) on a weight that requires grad: its gradient is a sparse tensor, which "
                "thunder_train does not support (.grad, the optimizers' kernels and the backward program are strided); "
                "use sparse=False (a dense gradient, the same values), or run this embedding outside the compiled "
                "function. Nothing was changed.")
