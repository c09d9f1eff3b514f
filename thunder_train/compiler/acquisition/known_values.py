"""Tensors whose values are known while tracing: made from Python numbers alone.

``torch.div(seq_len, w, rounding_mode="trunc") - 1`` (transformers' Longformer and LED) is a 0-d tensor computed
from sizes, which the model then uses as a size (``new_zeros((b, chunks + 1, w, 2 * w + 1))``).  Its value depends
on nothing but numbers the program is specialised to, so the call runs for real while tracing (eager's value), as do
further ops on such tensors alone.  Where one meets a traced value it enters the program as a constant (the value it
has when it is used: eager makes it again on every call), and as a size it is that value.  A known tensor written
in place with a traced value is refused (later reads would need the written value, and it is not a program
value)."""
from __future__ import annotations

import torch

from ..errors import TracingError
from ..proxies import NumberProxy, TensorProxy
from ..pytree import tree_flatten
from ..torchlang import registry

_CONSTANT_LIMIT = 64  # elements: a larger known tensor enters the program as a captured tensor, by reference
_READS = {"__int__", "__index__", "__bool__", "__float__", "__complex__", "item", "tolist", "__format__", "__repr__",
          "__str__", "__len__", "__iter__", "__hash__", "size", "dim", "numel", "__get__", "stride", "storage_offset"}


def runs_known(st, func, sym, args, kwargs) -> bool:
    """Whether the call runs for real: add/sub/mul/div of Python numbers alone, or any op but a random one whose
    tensors are all known tensors.  Raises for an in-place write of a traced value into a known tensor."""
    if st.walker is None or (not st.known_tensors and func not in registry.NUMBER_AS_TENSOR):
        return False
    flat = [a for a in tree_flatten((args, kwargs))[0] if not isinstance(a, (str, torch.dtype, torch.device))]
    if not any(isinstance(a, torch.Tensor) for a in flat):  # add/sub/mul/div of plain Python numbers alone
        return func in registry.NUMBER_AS_TENSOR and all(type(a) in (bool, int, float) for a in flat)
    known = [a for a in flat if isinstance(a, torch.Tensor) and id(a) in st.known_tensors]
    if not known:
        return False
    traced = any(isinstance(a, (TensorProxy, NumberProxy)) for a in flat)
    if not traced and len(known) == sum(isinstance(a, torch.Tensor) for a in flat):
        if sym is None:  # an op the torch language does not know may draw: only reads of the value run for real
            return getattr(func, "__name__", "") in _READS
        return "random" not in sym.tags
    name = getattr(func, "__name__", "")
    target = kwargs.get("out", args[0] if args else None)
    if traced and id(target) in st.known_tensors and (name.endswith("_") and not name.endswith("__") or "out" in kwargs
                                                      or name in ("__setitem__", "__iadd__", "__isub__", "__imul__")):
        raise TracingError(
            f"{name} writes a traced value into a tensor made from Python numbers while tracing (such as "
            "torch.div(n, k) of sizes), whose value the compiled program takes as a constant. Make it from the "
            "traced value out of place instead (t = t + x).")
    return False


def run_known(st, func, args, kwargs):
    """The call run by torch on the real values; tensor results are known tensors."""
    out = func(*args, **kwargs)
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and not isinstance(t, TensorProxy):
            st.known_tensors[id(t)] = t  # kept alive while tracing: the id is not reused
    return out


def as_program_value(st, t):
    """A known tensor meeting traced values: a constant of its current value (small), remembered as a size."""
    from ..torchlang import factories

    if t.requires_grad:
        raise TracingError(
            "a tensor made from Python numbers while tracing (torch.mul(2.0, 3.0) and ops on it alone) was made to "
            "require grad: the compiled program takes its value as a constant. Make it with torch.tensor(value, "
            "requires_grad=True) inside the function, a new leaf on every call as in eager.")
    if t.numel() > _CONSTANT_LIMIT or t.layout is not torch.strided:
        return st.walker.captured_tensor(t)
    proxy = factories.tensor(t.tolist(), dtype=t.dtype, device=t.device)
    if t.ndim == 0 and not t.dtype.is_floating_point and not t.dtype.is_complex:
        st.known_sizes[id(proxy)] = (proxy, int(t))
    return proxy


def sizes_as_ints(st, args, kwargs):
    """A list or tuple argument of ints and known 0-d integer tensors is a size (``x.as_strided(size=[b, n - 1,
    ...])``): the tensors are given as their ints, as torch reads them (``__index__``)."""
    def size(v):
        if type(v) not in (list, tuple) or not any(id(e) in st.known_tensors for e in v):
            return v
        if not all(type(e) is int or (id(e) in st.known_tensors and e.ndim == 0 and not e.is_floating_point()
                                      and not e.is_complex()) for e in v):
            return v
        return type(v)(e if type(e) is int else int(e) for e in v)

    return tuple(size(a) for a in args), {k: size(v) for k, v in kwargs.items()}
