"""Proxies: the values a trace is made of.

``TensorProxy`` subclasses ``torch.Tensor`` (as a data-less wrapper subclass)
so that model code testing ``isinstance(x, torch.Tensor)`` keeps working and so
that every torch call on it arrives at ``__torch_function__``, where the
tracer maps it to a torch-language symbol.  No tensor data ever exists: the
wrapper has no storage, and ``__torch_dispatch__`` raising guarantees nothing
slips through to a real kernel.

``NumberProxy`` stands for a Python number that is an input of the program
(a runtime scalar, or a symbolic size).  ``AnyProxy`` names an arbitrary
Python object (used by the prologue, which unpacks modules and containers).
"""
from __future__ import annotations

import torch

from . import dtypes, devices
from .context import fresh_name

# Hooks the layers above install when they are imported (proxies sit below both):
# the tracer's torch-function handler, and the prims module, whose scalar prims
# record arithmetic on runtime numbers.
_torch_function_handler = None
# Installed by compiler/acquisition/decisions.py: (value, conversion, description) -> the specialised Python value.
_decision_handler = None
_prims = None


class Proxy:
    """Marker base for non-tensor proxies."""

    name: str


def _shape_str(shape) -> str:
    return "[" + ", ".join(s.name if isinstance(s, Proxy) else str(s) for s in shape) + "]"


class TensorProxy(torch.Tensor):
    """A tensor known only by its metadata: shape, dtype, device, requires_grad and memory layout.

    The layout (``_tt_strides``, ``_tt_storage_offset``) is what eager PyTorch would give the
    tensor: row-major when created, then set by ``layout_hook`` (installed by the torch
    executor, ``executors/layout_rules.py``) from running each op on meta tensors.
    """

    @staticmethod
    def __new__(cls, name=None, *, shape, dtype, device, requires_grad=False, strides=None, storage_offset=0):
        dt = dtypes.from_torch(dtype)
        dev = devices.from_torch(device)
        # Symbolic sizes (SizeProxy, dynamic=True) stay symbolic; torch gets their example values.
        shape = tuple(s if type(s) is SizeProxy else int(s) for s in shape)
        self = torch.Tensor._make_wrapper_subclass(
            cls, tuple(int.__int__(s) for s in shape), dtype=dt.torch, device=dev.torch,
            requires_grad=bool(requires_grad) and dt.category >= dtypes.FLOAT,
        )
        self._tt_name = name if name is not None else fresh_name("t")
        self._tt_shape = shape
        self._tt_dtype = dt
        self._tt_device = dev
        self._tt_requires_grad = bool(requires_grad) and dt.category >= dtypes.FLOAT
        self._tt_strides = tuple(strides) if strides is not None else contiguous_strides(shape)
        self._tt_storage_offset = storage_offset
        # Freshly laid out row-major: lets the layout hook skip elementwise ops on such inputs.
        self._tt_rowmajor = strides is None or (storage_offset == 0 and self._tt_strides == contiguous_strides(shape))
        return self

    def __init__(self, *args, **kwargs):  # everything happens in __new__
        pass

    # Proxies never reach a kernel: all calls are intercepted at torch-function level.
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"thunder_train internal error: {func} reached torch dispatch with a proxy. "
            "Please report this with the function being compiled."
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function_handler(func, types, args, kwargs or {})

    # ---- compiler-side accessors (never go through torch) ----
    @property
    def name(self) -> str:  # type: ignore[override]
        return self._tt_name

    @property
    def ndim_(self) -> int:
        return len(self._tt_shape)

    def numel_(self) -> int:
        n = 1
        for s in self._tt_shape:
            n = s if type(n) is int and n == 1 else n * s  # no "1 * size" lines for symbolic sizes
        return n

    def type_string(self) -> str:
        """Short description used in trace comments, e.g. 'cpu f32[8, 4]'."""
        return f"{self._tt_device} {self._tt_dtype.short}{_shape_str(self._tt_shape)}"

    def __repr__(self, *args, **kwargs) -> str:
        return f'<TensorProxy {self._tt_name}: "{self.type_string()}">'

    __str__ = __repr__

    def __hash__(self):
        return id(self)

    def __reduce_ex__(self, proto):
        raise TypeError("TensorProxy objects cannot be pickled or deep-copied while tracing")

    def __deepcopy__(self, memo):
        raise TypeError(
            "copy.deepcopy of a tensor while tracing is not supported by thunder_train; "
            "create the copy outside the compiled function"
        )


def contiguous_strides(shape) -> tuple:
    """Row-major strides of ``shape`` (of its example values where sizes are symbolic)."""
    from torch._prims_common import make_contiguous_strides_for

    return tuple(make_contiguous_strides_for(tuple(int.__int__(s) for s in shape)))


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """torch._prims_common's rule (its name changed across torch versions)."""
    import torch._prims_common as pc

    rule = getattr(pc, "is_non_overlapping_and_dense", None) or pc.is_non_overlapping_and_dense_or_false
    return bool(rule(t))


def meta_tensor(p) -> torch.Tensor:
    """A meta tensor with ``p``'s shape, dtype and layout (strides and storage offset)."""
    shape = tuple(int.__int__(s) for s in p._tt_shape)
    strides, offset = p._tt_strides, p._tt_storage_offset
    extent = 0 if 0 in shape else 1 + sum((s - 1) * abs(st) for s, st in zip(shape, strides))
    base = torch.empty(offset + extent, dtype=p._tt_dtype.torch, device="meta")
    return base.as_strided(shape, strides, offset)


def is_tensor_proxy(x) -> bool:
    return type(x) is TensorProxy


class NumberProxy(Proxy):
    """A Python number that is an input of the program (not a baked-in constant).

    ``value`` is the example value seen while tracing (NaN for ``Tensor.item()``
    results, whose value does not exist yet); ``python_type`` is int, float or
    bool.  Instances are ``float``/``int`` subclasses so that torch's argument
    parsing accepts them where a Scalar goes (``p.mul_(1 - lr * wd)``) and hands
    the proxy itself to the tracer.  Arithmetic and comparisons record scalar
    prims; using one in Python control flow is an error.
    """

    def __new__(cls, name=None, *, value, python_type=None):
        pt = python_type or type(value)
        if cls is NumberProxy:
            cls = _FloatProxy if pt is float else _IntProxy
        if issubclass(cls, float):
            self = float.__new__(cls, value)
        else:
            self = int.__new__(cls, value if value == value else 0)
        self.name = name if name is not None else fresh_name("n")
        self.value = value
        self.python_type = pt
        return self

    __hash__ = object.__hash__

    def type_string(self) -> str:
        if self.value != self.value:  # item() of a tensor: no example value while tracing
            return self.python_type.__name__
        return f"{self.python_type.__name__} {self.value}"

    def __repr__(self) -> str:
        return f"<NumberProxy {self.name}: {self.type_string()}>"

    __str__ = __repr__

    # Arithmetic on runtime scalars records scalar prims (``prims.add(n0, 1)``, printed ``n1 = n0 + 1``).
    def _binop(self, other, opname, reverse=False):
        if not isinstance(other, (int, float)):
            return NotImplemented
        a, b = (other, self) if reverse else (self, other)
        return getattr(_prims, opname)(a, b)

    def __add__(self, o):
        return self._binop(o, "add")

    def __radd__(self, o):
        return self._binop(o, "add", True)

    def __sub__(self, o):
        return self._binop(o, "sub")

    def __rsub__(self, o):
        return self._binop(o, "sub", True)

    def __mul__(self, o):
        return self._binop(o, "mul")

    def __rmul__(self, o):
        return self._binop(o, "mul", True)

    def __floordiv__(self, o):
        return self._binop(o, "floor_divide")

    def __rfloordiv__(self, o):
        return self._binop(o, "floor_divide", True)

    def __mod__(self, o):
        return self._binop(o, "remainder")

    def __rmod__(self, o):
        return self._binop(o, "remainder", True)

    def __truediv__(self, o):
        return self._binop(o, "div")

    def __rtruediv__(self, o):
        return self._binop(o, "div", True)

    def __pow__(self, o):
        return self._binop(o, "pow")

    def __rpow__(self, o):
        return self._binop(o, "pow", True)

    def __neg__(self):
        return self._binop(-1, "mul")

    def __pos__(self):
        return self

    def __abs__(self):
        return _prims.abs(self)

    def __eq__(self, o):
        return self._binop(o, "eq") if o is not self else True

    def __ne__(self, o):
        return self._binop(o, "ne") if o is not self else False

    def __lt__(self, o):
        return self._binop(o, "lt")

    def __le__(self, o):
        return self._binop(o, "le")

    def __gt__(self, o):
        return self._binop(o, "gt")

    def __ge__(self, o):
        return self._binop(o, "ge")

    def __bool__(self):
        if _decision_handler is not None and not isinstance(self, _Checked):
            # acquisition/decisions.py: computed from the inputs and specialised on, if it is a function of them alone.
            return _decision_handler(self, "bool", f"bool() of the runtime number {self.name}")
        raise RuntimeError(
            f"Python control flow on the runtime scalar {self.name} cannot be traced; "
            "the value changes between calls. Use torch.where or move the branch outside the compiled function."
        )

    def __float__(self):
        return self._plain("float", float)

    def __int__(self):
        return self._plain("int", int)

    def _plain(self, convert, fn):
        """A plain Python number is needed (``float(loss.item())``, ``math.sqrt(n)``): while a function is
        traced, a decision the prologue recomputes (acquisition/decisions.py) — the example value of an
        ``item()`` does not exist (NaN) and another's would be baked in."""
        from .context import tracer_state

        if _decision_handler is not None and not isinstance(self, _Checked) and tracer_state() is not None:
            return _decision_handler(self, convert, f"{convert}() of the runtime number {self.name}")
        return fn(self.value)

    def __reduce__(self):
        raise TypeError("NumberProxy objects cannot be pickled")


class _FloatProxy(NumberProxy, float):
    pass


class _IntProxy(NumberProxy, int):
    pass


class _Checked:
    """Runtime numbers whose Python decisions are checked instead of refused.

    A comparison, ``bool()`` or conversion to a plain number is answered from the
    example value and recorded as a check (the tracer state's ``size_checks``) that the prologue
    and thin mode evaluate on every later input; a call that decides differently
    gets its own program.  ``origin`` says how the number is computed from the
    inputs: ``("dim", tensor proxy, i)``, ``("input",)`` (an input leaf itself) or
    ``("op", prim name, *args)``.
    """

    def _check(self, op, other, result):
        from .context import tracer_state

        st = tracer_state()
        if st is not None:
            st.size_checks.append((op, self, other, result))
        return result

    @staticmethod
    def _v(x):
        return x.value if isinstance(x, NumberProxy) else x

    def _cmp(self, other, op, fn):
        if not isinstance(other, (int, float)):
            return NotImplemented
        if other is self:
            return fn(0, 0)
        return self._check(op, other, fn(self.value, self._v(other)))

    def __eq__(self, o):
        return self._cmp(o, "==", lambda a, b: a == b)

    def __ne__(self, o):
        return self._cmp(o, "!=", lambda a, b: a != b)

    def __lt__(self, o):
        return self._cmp(o, "<", lambda a, b: a < b)

    def __le__(self, o):
        return self._cmp(o, "<=", lambda a, b: a <= b)

    def __gt__(self, o):
        return self._cmp(o, ">", lambda a, b: a > b)

    def __ge__(self, o):
        return self._cmp(o, ">=", lambda a, b: a >= b)

    __hash__ = object.__hash__

    def __bool__(self):
        return self._check("!=", 0, self.value != 0)


class SizeProxy(_Checked, _IntProxy):
    """A symbolic size (``tt.compile(fn, dynamic=True)``): a dimension of a per-call input.

    Arithmetic records scalar prims whose results are SizeProxies too (shape
    arithmetic like ``t.reshape(t.size(0), -1)`` stays symbolic).  Decisions on
    sizes (comparisons, ``bool()``, ``int()``/``range()``) become checks (``_Checked``).
    """

    __hash__ = object.__hash__

    def __index__(self):
        # A plain int is needed (range(), a slice bound, ...): specialise on the value, checked later.
        return self._check("==", self.value, int.__int__(self))

    __int__ = __index__


class CheckedFloat(_Checked, _FloatProxy):
    """A float hyper-parameter read from an optimizer's ``param_groups`` (``lr``, ``betas``, ``weight_decay``).

    A runtime input, so a scheduler changing it never retraces; code that decides on
    it (``if weight_decay != 0``) records a check instead of failing.
    """

    __hash__ = object.__hash__

    def __float__(self):
        return self._check("==", self.value, float.__float__(self))


def is_checked(x) -> bool:
    return isinstance(x, _Checked)


def size_value(s) -> int:
    """The example value of a size (an int or a SizeProxy) without recording a check."""
    return int.__int__(s) if isinstance(s, int) else s


class AnyProxy(Proxy):
    """Names an arbitrary Python object in the prologue (a module, a list, ...)."""

    __slots__ = ("name", "python_type")

    def __init__(self, name=None, *, python_type=object):
        self.name = name if name is not None else fresh_name("obj")
        self.python_type = python_type

    def type_string(self) -> str:
        return self.python_type.__name__

    def __repr__(self) -> str:
        return f"<AnyProxy {self.name}: {self.type_string()}>"


def proxy_name(x) -> str:
    if type(x) is TensorProxy:
        return x._tt_name
    return x.name


def is_proxy(x) -> bool:
    return type(x) is TensorProxy or isinstance(x, Proxy)
