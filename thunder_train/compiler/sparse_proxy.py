"""The proxy of a sparse tensor while tracing: a value no native symbol takes (compiler/acquisition/sparse.py)."""
from __future__ import annotations

import torch

from . import devices, dtypes, proxies
from .context import fresh_name


class SparseProxy(torch.Tensor, proxies.Proxy):
    """A sparse tensor (COO, CSR, CSC) known by its layout, shape, dtype and device: an opaque value.

    It has no strides and its number of stored elements is data-dependent, so no native symbol, layout rule or
    gradient rule takes it: every torch call that reads or makes one runs as an opaque line, its output's metadata
    from torch's fake tensors (compiler/acquisition/sparse.py), its gradient by torch's autograd.  The gradient of a
    sparse value is a ``SparseProxy`` too, standing for whatever layout torch gives it at run time
    (compiler/transforms/sparse_grads.py).  ``type(x) is TensorProxy`` is False for it, which is what keeps it away
    from the rest of the compiler."""

    @staticmethod
    def __new__(cls, name=None, *, shape, dtype, device, layout, requires_grad=False):
        dt, dev = dtypes.from_torch(dtype), devices.from_torch(device)
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(int(s) for s in shape), dtype=dt.torch, device=dev.torch,
                                                   layout=layout, requires_grad=bool(requires_grad))
        self._tt_name = name if name is not None else fresh_name("t")
        self._tt_shape, self._tt_dtype, self._tt_device, self._tt_layout = tuple(int(s) for s in shape), dt, dev, layout
        self._tt_requires_grad = bool(requires_grad)
        return self

    def __init__(self, *args, **kwargs):
        pass

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"thunder_train internal error: {func} reached torch dispatch with a sparse proxy.")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return proxies._torch_function_handler(func, types, args, kwargs or {})

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._tt_name

    def type_string(self) -> str:
        layout = str(self._tt_layout).replace("torch.", "")
        return f"{self._tt_device} {self._tt_dtype.short}{proxies._shape_str(self._tt_shape)} {layout}"

    def __repr__(self, *args, **kwargs) -> str:
        return f'<SparseProxy {self._tt_name}: "{self.type_string()}">'

    __str__ = __repr__

    def __hash__(self):
        return id(self)

    def __reduce_ex__(self, proto):
        raise TypeError("SparseProxy objects cannot be pickled or deep-copied while tracing")

    def __deepcopy__(self, memo):
        raise TypeError("copy.deepcopy of a sparse tensor while tracing is not supported by thunder_train")
