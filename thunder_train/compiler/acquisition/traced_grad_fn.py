"""``t.is_leaf`` and ``t.grad_fn`` while tracing: eager's answers, or a clear error where there is none.

User and library code branches on ``t.grad_fn is None`` (is this a leaf? was it computed with grad?) and logs or
compares the node's kind (``type(t.grad_fn).__name__``, ``t.grad_fn.name()``: torch's own tensor repr, its
``BackwardHook`` looking for ``"BackwardHookFunctionBackward"``).  A value computed inside the function that eager's
autograd would record (``computed_requires_grad``) answers a ``TracedGradFn``: not None, like eager's node, named as
eager's node is (``AddmmBackward0``: the op that made the value, asked of torch on meta tensors of the same sizes,
strides, dtypes and ``requires_grad``, cached per op and signature: ``eager_node_name``), but the program records no
PyTorch node, so reading anything else from it (``next_functions``, ``register_hook``) raises an error saying so.
Where the name cannot be asked (an op without a torch form or meta kernel), ``name()`` and ``type(...).__name__``
raise that error too.  An input answers with the real tensor's own ``grad_fn`` (a non-leaf passed in) while the
function has not written it; a value that does not require grad, or a leaf, answers None.  An input whose
``is_leaf`` or ``grad_fn`` the function read is guarded on it: its ``is_leaf`` (``leaf.snapshot = "is_leaf"``), or,
where the function was handed the real node of a non-leaf input, the node's type (``"grad_fn"``), by the full
prologue (compiler/prologue.py, ``leafness_spec``) and by thin mode's per-call checks (runtime/thin_checks.py).
"""
from __future__ import annotations

from ..errors import TracingError
from ..proxies import TensorProxy
from ..pytree import tree_flatten
from ..generators_kept import generators_untouched
from . import saved_versions


def _message(what, value):
    return (f"{what} of the grad_fn of {value}, a value computed inside the compiled function: thunder_train "
            "records no PyTorch autograd node while tracing (its own backward computes the gradients), so only "
            "`grad_fn is None` / `is not None` and the node's name where torch tells it for the op are answered (as "
            "eager). Read the node outside the compiled function.")


class TracedGradFn:
    """Stands for the autograd node eager would attach to a value computed inside the compiled function; an
    instance of a subclass named as eager's node (``named``)."""

    __slots__ = ("_value",)

    def __init__(self, value_name: str):
        self._value = value_name

    def _refuse(self, what):
        raise TracingError(_message(what, self._value))

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse(f".{attr}")

    def __call__(self, *args, **kwargs):
        self._refuse("calling")

    def __repr__(self):
        return f"<{type(self).__qualname__} of {self._value} (traced: thunder_train records no PyTorch node)>"


class _Unnamed(type):
    """The class of a stand-in whose eager name is not known: asking it (``type(t.grad_fn).__name__``) raises."""

    @property
    def __name__(cls):
        raise TracingError(_message("the name", "this value (torch could not be asked which node the op that made it "
                                                 "makes, or it is a view of memory written since it was made, whose "
                                                 "node eager makes again from its base's)"))


class _UnknownGradFn(TracedGradFn, metaclass=_Unnamed):
    __slots__ = ()

    def name(self):
        self._refuse("name()")


_named: dict = {None: _UnknownGradFn}


def named(names: tuple | None) -> type:
    """The stand-in class for eager's node ``(class name, name())`` (None: not known), made once per name."""
    cls = _named.get(names)
    if cls is None:
        torch_name = names[1]
        cls = _named[names] = type(names[0], (TracedGradFn,), {"__slots__": (), "name": lambda self: torch_name})
    return cls


_name_cache: dict = {}


def eager_node_name(st, value, requires_grad_ids) -> tuple | None:
    """``(class name, name())`` of the ``grad_fn`` eager's call of the op that made ``value`` gives it (they differ for
    torch's hand-written nodes: ``CopySlices``, ``torch::autograd::CopySlices``): the line's torch callable
    run once on meta tensors like its arguments (``saved_versions.probe_args``), cached per op and signature; None
    when it cannot be asked.  A write autograd does not see (``prims.unseen_write``: under ``no_grad``, through
    ``.data``) leaves the node of the value written; a write through a view makes eager's ``CopySlices``."""
    call = None
    while True:
        if st.buffers.written_through_view(value):
            return "CopySlices", "torch::autograd::CopySlices"
        line = next((b for b in reversed(st.trace.bound_symbols) if any(o is value for o in b.flat_outputs())), None)
        if line is None or line.sym.name != "unseen_write":
            call = st.buffers.call_of(value)
            break
        value = line.args[1]
    if call is not None:  # written directly by an in-place call: its node (eager's setitem: CopySlices)
        fn, args, kwargs, k = *call, 0
    elif line is not None:
        fn, args, kwargs = saved_versions.torch_form(line), line.args, line.kwargs
        k = next(i for i, o in enumerate(o for o in line.flat_outputs() if type(o) is TensorProxy) if o is value)
    else:
        return None
    if fn is None:
        return None
    try:
        flat, spec = tree_flatten((args, kwargs))
    except Exception:  # noqa: BLE001 - arguments the pytree does not take
        return None
    sig = saved_versions.probe_signature(flat, requires_grad_ids)
    if sig is None:
        return None
    key = (fn, repr(spec), sig, call is not None, k)
    if key not in _name_cache:
        _name_cache[key] = _ask_name(fn, spec, sig, call is not None, k)
    return _name_cache[key]


def _ask_name(fn, spec, sig, inplace, k):
    import torch

    try:
        metas, args, kwargs = saved_versions.probe_args(spec, sig, inplace, "meta")
        with torch.enable_grad(), generators_untouched():
            out = fn(*args, **kwargs)
        outs = metas[:1] if inplace else [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        node = outs[k].grad_fn
    except Exception:  # noqa: BLE001 - not runnable on meta tensors: not known
        return None
    return None if node is None else (type(node).__name__, node.name())


def _stand_in(st, a, gradient_path):
    if not st.buffers.node_made_again(a):
        names = eager_node_name(st, st.buffers.read(a), gradient_path(st))
    else:  # eager makes a strided view's node again from its base's after a write: as_strided's
        base = st.buffers.base_of(a)
        plain = st.buffers.layout_is_traced(a) and base is not None and base._tt_dtype is a._tt_dtype
        names = ("AsStridedBackward0", "AsStridedBackward0") if plain else None
    return named(names)(a._tt_name)


def answer(st, a, prop, getter, computed_requires_grad, new_leaves, gradient_path=None):
    """``a.is_leaf`` or ``a.grad_fn`` (``a``: the user's tensor proxy)."""
    walker = st.walker
    if walker is None or computed_requires_grad is None:
        return getter(a)
    leaf = walker.leaf_of(a) if walker.is_input(a) else None
    if leaf is not None and leaf.kind == "tensor":
        real = leaf.value
        node = None if getattr(real, "is_leaf", True) or prop == "is_leaf" else (
            real.grad_fn if st.buffers.read(a) is a else _stand_in(st, a, gradient_path))
        if leaf.alias_of is None and leaf.snapshot != "grad_fn":
            # Guarded from now on (prologue.leafness_spec, thin_checks): a real node handed out, by its type.
            leaf.snapshot = "grad_fn" if node is not None and not isinstance(node, TracedGradFn) else "is_leaf"
        if prop == "is_leaf":
            return bool(getattr(real, "is_leaf", True))
        return node
    if walker.is_input(a):
        return getter(a)
    is_leaf = not computed_requires_grad(st, a) or any(t is a for t, _ in new_leaves(st))
    if prop == "is_leaf":
        return is_leaf
    return None if is_leaf else _stand_in(st, a, gradient_path)
