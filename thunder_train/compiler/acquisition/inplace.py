"""Functionalization glue of the dispatcher: in-place ops, ``out=`` and views.

An in-place op records its out-of-place form and the result becomes the
destination's current value (``compiler/functional.py``'s ``Buffers``); a
view remembers how it was made from its base so writes through it reach the
base.
"""
from __future__ import annotations

import torch

from ..clang import maybe_convert
from ..errors import TracingError
from ..proxies import TensorProxy
from ..pytree import tree_flatten, tree_map
from ..transforms.autograd import detach_float_tensors


# Symbols whose result shares storage with their first argument in eager PyTorch: writing into
# the result writes into the argument, and the result follows later writes to the argument.
VIEW_SYMBOLS = {
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "permute",
    "transpose", "t", "movedim", "expand", "expand_as", "broadcast_to", "split", "chunk", "tensor_split",
    "unbind", "narrow", "select", "getitem", "detach", "diagonal", "view_as_real", "alias",
}


def read_current(st, args, kwargs):
    read = st.buffers.read
    return tree_map(lambda x: read(x) if type(x) is TensorProxy else x, (args, kwargs))


def back_to_buffers(orig_args, args, out):
    """A symbol that returned its (current-valued) input returns the user's object, as eager does (``x.contiguous() is x``)."""
    if type(out) is TensorProxy:
        for o, a in zip(orig_args, args):
            if out is a and o is not a:
                return o
    return out


def record_views(st, sym, source, rest, kwargs, out):
    if sym.name == "getitem" and any(isinstance(k, torch.Tensor) for k in tree_flatten(rest)[0]):
        return  # advanced indexing copies
    if type(out) is TensorProxy:
        st.buffers.add_view(out, source, lambda v: sym(v, *rest, **kwargs))
    elif isinstance(out, (tuple, list)):
        for i, o in enumerate(out):
            st.buffers.add_view(o, source, lambda v, i=i: sym(v, *rest, **kwargs)[i])


def inplace(st, sym, orig_args, args, kwargs):
    """An in-place op: record its out-of-place form; the result becomes the destination's value."""
    dst = orig_args[0]
    new = sym.functional(*args, **kwargs)
    if isinstance(dst, (list, tuple)):
        for d, v in zip(dst, new):
            write(st, sym, d, v)
    else:
        write(st, sym, dst, new)
    return dst


def write(st, sym, dst, value):
    if torch.is_grad_enabled() and dst._tt_requires_grad and st.walker.is_input(dst):
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    bsyms = st.trace.bound_symbols
    last = bsyms[-1] if bsyms else None
    if last is not None and any(o is value for o in last.flat_outputs()) and last.comment is None:
        last.comment = f"{sym.name}: the new value of {dst._tt_name}"
    if not torch.is_grad_enabled() and st.grad_enabled:
        value = no_grad_region(st, value)
    st.buffers.write(dst, value)


def converted_to(value, dst):
    if type(value) is not TensorProxy or value._tt_shape != dst._tt_shape:
        raise TracingError(f"out=: the result ({getattr(value, 'type_string', lambda: value)()}) does not match the out tensor ({dst.type_string()})")
    return maybe_convert(value, dst._tt_dtype)


def functionalize(st, sym, orig_args, args, kwargs):
    """A symbol that returns a result and also updates some arguments (``batch_norm``'s running stats)."""
    out, writes = sym.functionalize(*args, **kwargs)
    # Writes name the current values they were given; write to the user's objects (also inside lists).
    back = {id(a): o for o, a in zip(tree_flatten(orig_args)[0], tree_flatten(args)[0]) if type(o) is TensorProxy}
    bsyms = st.trace.bound_symbols
    last = bsyms[-1] if bsyms else None
    if len(writes) > 1 and last is not None and last.comment is None and any(o is writes[0][1] for o in last.flat_outputs()):
        last.comment = f"{sym.name}: the new values of {len(writes)} tensors"
    for dst, value in writes:
        write(st, sym, back.get(id(dst), dst), value)
    return no_grad_region(st, out, sym)



def no_grad_region(st, out, sym=None):
    """Results computed under ``torch.no_grad()`` inside the function carry no gradient (``prims.stop_gradient``)."""
    if torch.is_grad_enabled() or not st.grad_enabled or len(st.trace._scopes) != 1:
        return out
    if sym is not None and "inplace" in sym.tags:
        return out
    return detach_float_tensors(out)
