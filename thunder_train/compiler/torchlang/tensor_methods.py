"""Tensor properties and metadata methods, conversions, and data-dependent errors."""
from __future__ import annotations

import torch

from .. import clang, dtypes, prims
from ..errors import DataDependentError  # noqa: F401  (defined with the other user-facing errors)
from ..proxies import TensorProxy, meta_tensor
from ..symbolic_layouts import symbolic_strides
from .convert import to_dtype, to_device
from .registry import composed, torchsymbol, tensor_property, tensor_property_setter, by_torch_fn
from .shapes import permute, transpose, unbind


# ---------------------------------------------------------------------------
# Properties: answered from the proxy's metadata, recorded nowhere.
# ---------------------------------------------------------------------------
@tensor_property("shape")
def _shape(a):
    return torch.Size(a._tt_shape)


@tensor_property("dtype")
def _dtype(a):
    return a._tt_dtype.torch


@tensor_property("device")
def _device(a):
    return a._tt_device.torch


@tensor_property("requires_grad")
def _requires_grad(a):
    return a._tt_requires_grad


@tensor_property("ndim")
def _ndim(a):
    return len(a._tt_shape)


@tensor_property("is_cuda")
def _is_cuda(a):
    return a._tt_device.type == "cuda"


@tensor_property("is_cpu")
def _is_cpu(a):
    return a._tt_device.type == "cpu"


@tensor_property("is_meta")
def _is_meta(a):
    return False


@tensor_property("is_sparse")
def _is_sparse(a):
    return False


@tensor_property("is_quantized")
def _is_quantized(a):
    return False


@tensor_property("is_nested")
def _is_nested(a):
    return False


@tensor_property("layout")
def _layout(a):
    return torch.strided


@tensor_property("itemsize")
def _itemsize(a):
    return a._tt_dtype.itemsize


@tensor_property("is_leaf")
def _is_leaf(a):
    return True


@tensor_property("grad_fn")
def _grad_fn(a):
    return None


@tensor_property("names")
def _names(a):
    return (None,) * len(a._tt_shape)


@tensor_property("data")
def _data(a):
    return detach(a)


@tensor_property("T")
def _T(a):
    return permute(a, tuple(reversed(range(len(a._tt_shape)))))


@tensor_property("mT")
def _mT(a):
    return transpose(a, -2, -1)


@tensor_property("H")
def _H(a):
    return _T(a)


@tensor_property("mH")
def _mH(a):
    return _mT(a)


@tensor_property("real")
def _real(a):
    if a._tt_dtype.is_complex:
        raise NotImplementedError("complex tensors are not supported yet")
    return a


# Metadata methods that return Python values, not tensors.
def _metadata_method(*fns, methods=(), on_buffer=False):
    """``on_buffer``: the method acts on the user's tensor itself, not on its current value (flags; see
    ``set_requires_grad``)."""
    def deco(f):
        for fn in fns:
            by_torch_fn[fn] = _MetadataSymbol(f, on_buffer)
        for m in methods:
            from .registry import by_method_name

            s = _MetadataSymbol(f, on_buffer)
            by_method_name[m] = s
            for owner in (torch.Tensor, torch._C.TensorBase):
                if hasattr(owner, m):
                    by_torch_fn[getattr(owner, m)] = s
        return f

    return deco


class _MetadataSymbol:
    """Looks like a symbol to the dispatcher but records nothing."""

    tags = frozenset()

    def __init__(self, fn, on_buffer=False):
        self.fn = fn
        self.name = fn.__name__
        self.on_buffer = on_buffer

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


@_metadata_method(methods=("size",))
def size(a, dim=None):
    if dim is None:
        return torch.Size(a._tt_shape)
    return a._tt_shape[clang.canonicalize_dim(len(a._tt_shape), dim)]


@_metadata_method(methods=("dim", "ndimension"))
def dim(a):
    return len(a._tt_shape)


@_metadata_method(torch.numel, methods=("numel", "nelement"))
def numel(a):
    return a.numel_()


@_metadata_method(methods=("__len__",))
def len_(a):
    if not a._tt_shape:
        raise TypeError("len() of a 0-d tensor")
    return a._tt_shape[0]


@_metadata_method(torch.is_floating_point, methods=("is_floating_point",))
def is_floating_point(a):
    return a._tt_dtype.is_float


@_metadata_method(torch.is_complex, methods=("is_complex",))
def is_complex(a):
    return a._tt_dtype.is_complex


@_metadata_method(methods=("element_size",))
def element_size(a):
    return a._tt_dtype.itemsize


@_metadata_method(methods=("is_contiguous",))
def is_contiguous(a, memory_format=torch.contiguous_format):
    """Eager's answer for the proxy's layout (torch._prims_common's rules)."""
    return _is_contiguous_for(a, memory_format)


def _is_contiguous_for(a, memory_format) -> bool:
    from torch._prims_common import is_channels_last_contiguous_2d, is_channels_last_contiguous_3d

    m = meta_tensor(a)
    if memory_format is torch.channels_last:
        return is_channels_last_contiguous_2d(m)
    if memory_format is torch.channels_last_3d:
        return is_channels_last_contiguous_3d(m)
    if memory_format is torch.preserve_format:
        raise RuntimeError("preserve memory format is unsupported by the contiguous operator")
    return m.is_contiguous()


@_metadata_method(methods=("storage_offset",))
def storage_offset(a):
    # Inputs are not specialised on their storage offset (a batch sliced from a bigger tensor moves
    # every step), so an answer would be baked in silently.
    raise NotImplementedError(
        "Tensor.storage_offset() inside a compiled function is not supported: the program is not specialised "
        "on its inputs' storage offsets. Compute it outside and pass it in, or use as_strided without an offset."
    )


@_metadata_method(methods=("is_non_overlapping_and_dense",))
def _is_non_overlapping_and_dense(a):
    from ..dense import is_non_overlapping_and_dense

    return is_non_overlapping_and_dense(meta_tensor(a))


@_metadata_method(methods=("get_device",))
def get_device(a):
    return -1 if a._tt_device.type == "cpu" else a._tt_device.index


@_metadata_method(methods=("stride",))
def stride(a, dim=None):
    st = a._tt_strides
    st = symbolic_strides(a)  # the example strides hold for the traced sizes only (constant where they are)
    return st if dim is None else st[clang.canonicalize_dim(len(a._tt_shape), dim)]


@_metadata_method(methods=("type",))
def type_(a, dtype=None, non_blocking=False):
    if dtype is None:
        return f"torch.{'cuda.' if a._tt_device.type == 'cuda' else ''}{_TYPE_NAMES.get(a._tt_dtype.name, 'FloatTensor')}"
    return to(a, dtype)


_TYPE_NAMES = {"float32": "FloatTensor", "float64": "DoubleTensor", "float16": "HalfTensor", "bfloat16": "BFloat16Tensor", "int64": "LongTensor", "int32": "IntTensor", "bool8": "BoolTensor", "uint8": "ByteTensor", "int8": "CharTensor", "int16": "ShortTensor"}


def _data_dependent(what):
    def f(a, *args, **kwargs):
        raise DataDependentError(
            f"{what} needs the value of a tensor, which does not exist while thunder_train traces the function. "
            "Python control flow on tensor values (e.g. `if x.sum() > 0:`) cannot be compiled: "
            "use torch.where, or move the branch outside the compiled function."
        )

    f.__name__ = what
    return f


def _decided(convert, what):
    """A Python value of a tensor: computed from the inputs and specialised on when it is a function of them
    alone (``compiler/acquisition/decisions.py`` installs the handler), else the error above."""
    refuse = _data_dependent(what)

    def f(a, *args, **kwargs):
        from .. import proxies

        if proxies._decision_handler is None or args or kwargs:
            return refuse(a)
        return proxies._decision_handler(a, convert, what)

    f.__name__ = what
    return f


_metadata_method(methods=("__bool__",))(_decided("bool", "bool(tensor)"))
@_metadata_method(methods=("item",))
def item(a):
    """A runtime number (``prims.item``); arithmetic on it is recorded, branching on it is an error."""
    return prims.item(a)


@_metadata_method(methods=("requires_grad_",), on_buffer=True)
def requires_grad_(a, requires_grad=True):
    set_requires_grad(a, requires_grad)
    return a


def _leaf_values(st, a):
    """The tracer's record of an input's values while it requires grad (``acquisition/leaf_values.py``), if ``a`` is
    an input it tracks: an in-place update makes a new value proxy, but eager's flags belong to the user's tensor."""
    lv = getattr(st, "leaf_values", None)
    return lv if lv is not None and lv.tracks(a) else None


# ``(st, a) -> bool``: whether a value computed inside the function depends on one that requires grad (eager's
# flag of an op's output), installed by ``acquisition/traced_autograd.py``: the gradient path is found there.
computed_requires_grad = None


def requires_grad_of(st, a):
    """``a.requires_grad`` while tracing (``a``: the user's tensor, not its current value)."""
    lv = _leaf_values(st, a)
    if lv is not None:
        return lv.requires_grad(a)
    if (st.buffers.read(a) if st is not None and st.buffers is not None else a)._tt_requires_grad:
        return True
    return st is not None and computed_requires_grad is not None and computed_requires_grad(st, a)


def set_requires_grad(a, requires_grad):
    """``t.requires_grad = flag`` while tracing: later ops and backwards see it; an input's flag is set by the epilogue.

    ``a`` is the user's tensor (the dispatcher passes it, not its current value), so the flag acts on an input
    also after it was updated in place, from this point of the function on, as in eager.
    """
    from ..context import tracer_state

    if requires_grad and not a._tt_dtype.is_float:
        raise RuntimeError("only Tensors of floating point dtype can require gradients")
    st = tracer_state()
    lv = _leaf_values(st, a)
    if lv is not None:
        lv.set_flag(a, requires_grad)  # raises where eager does (a non-leaf)
    elif st is not None and computed_requires_grad is not None and computed_requires_grad(st, a):
        if requires_grad:
            return  # a computed value that requires grad already: eager's no-op
        raise RuntimeError(
            "you can only change requires_grad flags of leaf variables. If you want to use a computed variable in a "
            "subgraph that doesn't require differentiation use var_no_grad = var.detach().")
    changes = st.requires_grad_changes if st is not None else None
    if changes is not None and id(a) not in changes:
        changes[id(a)] = (a, a._tt_requires_grad)
    a._tt_requires_grad = bool(requires_grad)
    if lv is None and st is not None and st.buffers is not None and type(a) is TensorProxy:
        cur = st.buffers.read(a)  # a tensor made inside the function and updated in place: its value of the moment
        if cur is not a:
            cur._tt_requires_grad = bool(requires_grad)


@tensor_property_setter("requires_grad")
def _set_requires_grad(a, value):
    set_requires_grad(a, value)


@_metadata_method(methods=("detach_",), on_buffer=True)
def detach_(a):
    from ..context import tracer_state

    st = tracer_state()
    lv = _leaf_values(st, a)
    if lv is not None:
        lv.set_flag(a, False, detach=True)
    changes = st.requires_grad_changes if st is not None else None
    if changes is not None and type(a) is TensorProxy and id(a) not in changes:
        changes[id(a)] = (a, a._tt_requires_grad)
    a._tt_requires_grad = False
    if st is not None and st.buffers is not None and type(a) is TensorProxy:
        st.buffers.read(a)._tt_requires_grad = False
    return a
_metadata_method(methods=("tolist",))(_decided("list", "Tensor.tolist()"))
_metadata_method(methods=("__int__",))(_decided("int", "int(tensor)"))
_metadata_method(methods=("__float__",))(_decided("float", "float(tensor)"))
_metadata_method(methods=("__index__",))(_decided("index", "using a tensor as an index"))
_metadata_method(methods=("numpy",))(_data_dependent("Tensor.numpy()"))
_metadata_method(methods=("data_ptr",))(_data_dependent("Tensor.data_ptr()"))
_metadata_method(methods=("__array__",))(_data_dependent("numpy conversion"))


@_metadata_method(methods=("__iter__",))
def iter_(a):
    if not a._tt_shape:
        raise TypeError("iteration over a 0-d tensor")
    return iter(unbind(a, 0))


@_metadata_method(methods=("__format__",))
def format_(a, spec):
    return repr(a)


@_metadata_method(methods=("__repr__", "__str__"))
def repr_(a, *args, **kwargs):
    return repr(a)


# ---------------------------------------------------------------------------
# Conversions
# ---------------------------------------------------------------------------
def _parse_to(a, args, kwargs):
    dtype = kwargs.get("dtype")
    device = kwargs.get("device")
    for x in args:
        if isinstance(x, torch.dtype):
            dtype = x
        elif isinstance(x, (torch.device, str)):
            device = x
        elif isinstance(x, torch.Tensor):
            dtype = x.dtype if type(x) is not TensorProxy else x._tt_dtype
            device = x.device if type(x) is not TensorProxy else x._tt_device
    return to_dtype(dtype), to_device(device)


@torchsymbol(methods=("to",), tags=("fusible", "layout_on_meta"))
def to(a, *args, **kwargs):
    """Tensor.to(dtype | device | tensor, ...): a cast; devices must not change inside the program."""
    dtype, device = _parse_to(a, args, kwargs)
    if kwargs.get("copy"):
        a = prims.clone(a)
    if device is not None and device != a._tt_device:
        raise NotImplementedError(
            f"moving a tensor from {a._tt_device} to {device} inside a compiled function is not supported yet; "
            "move inputs before calling it"
        )
    fmt = kwargs.get("memory_format", torch.preserve_format)
    if fmt is not torch.preserve_format and not _is_contiguous_for(a, fmt):
        a = prims.clone(a, fmt)  # to(memory_format=torch.channels_last): a copy laid out so, as in eager
    if dtype is None or dtype is a._tt_dtype:
        return a
    return prims.convert_element_type(a, dtype)


def _cast_method(name, dt, tags=()):
    def fn(a, memory_format=None):
        return clang.maybe_convert(a, dt)

    fn.__name__ = name
    fn.__doc__ = f"Tensor.{name}()"
    return torchsymbol(methods=(name,), name=name, tags=(*tags, "layout_on_meta"))(fn)


# Float conversions are fusible (Inductor fusion takes them into kernels); integer ones are not.
float_ = _cast_method("float", dtypes.float32, ("fusible",))
double = _cast_method("double", dtypes.float64, ("fusible",))
half = _cast_method("half", dtypes.float16, ("fusible",))
bfloat16 = _cast_method("bfloat16", dtypes.bfloat16, ("fusible",))
long = _cast_method("long", dtypes.int64)
int_ = _cast_method("int", dtypes.int32)
bool_ = _cast_method("bool", dtypes.bool8)
byte = _cast_method("byte", dtypes.uint8)
short = _cast_method("short", dtypes.int16)


@torchsymbol(methods=("type_as",), tags=("fusible",))
def type_as(a, other):
    return clang.maybe_convert(a, other._tt_dtype)


@torchsymbol(methods=("cpu",))
def cpu(a, memory_format=None):
    return to(a, "cpu")


@torchsymbol(methods=("cuda",))
def cuda(a, device=None, non_blocking=False, memory_format=None):
    return to(a, device if device is not None else "cuda")


@torchsymbol(torch.clone, methods=("clone",), tags=("layout_on_meta", "fusible"))  # fusible: as prims.clone
def clone(a, *, memory_format=torch.preserve_format):
    return prims.clone(a) if memory_format is torch.preserve_format else prims.clone(a, memory_format)


@torchsymbol(methods=("contiguous",), tags=("layout_on_meta",))
def contiguous(a, memory_format=torch.contiguous_format):
    """``a`` itself when already laid out so (as in eager: ``x.contiguous() is x``), else a copy that is."""
    if _is_contiguous_for(a, memory_format):
        return a
    return prims.clone(a, memory_format)


@torchsymbol(torch.detach, methods=("detach",), tags=("view",))
def detach(a):
    """Same values, no gradient."""
    return prims.stop_gradient(a)



# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def char(input, memory_format=torch.preserve_format):
    if memory_format not in (torch.preserve_format, torch.contiguous_format):
        raise NotImplementedError("char(memory_format=...) is run by torch")
    out = input.to(torch.int8)
    return out.contiguous() if memory_format is torch.contiguous_format else out


composed("char", char, (), ("char",))
