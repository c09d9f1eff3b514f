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

import math
import operator

import torch

from . import dtypes, devices
from .context import fresh_name, get_trace

# Hooks the layers above install when they are imported (proxies sit below both):
# the tracer's torch-function handler, and the prims module, whose scalar prims
# record arithmetic on runtime numbers.
_torch_function_handler = None
# (proxy, name) -> the value of a Python attribute the user set on the tensor a proxy stands for, or
# ``NO_ATTRIBUTE`` (installed by acquisition/tensor_attributes.py)
_attribute_handler = None
NO_ATTRIBUTE = object()
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
            cls, tuple(size_value(s) for s in shape), dtype=dt.torch, device=dev.torch,
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

    def __getattr__(self, name):
        # Only names the proxy lacks arrive here: a Python attribute of the input tensor it stands for
        # (``weight.skip = True`` read by a forward) is that tensor's, read as an input where the function reads it.
        if name[:4] != "_tt_" and name[:2] != "__" and _attribute_handler is not None:
            found = _attribute_handler(self, name)
            if found is not NO_ATTRIBUTE:
                return found
        raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}")

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
    """Row-major strides of ``shape`` (of its example values where sizes are symbolic): torch's rule
    (``contiguous_strides`` in c10/util/strides.h: a size of 0 counts as 1).  Not torch._prims_common's
    ``make_contiguous_strides_for``: its shape check imports torch.fx.experimental.symbolic_shapes and sympy
    (about 0.5 s), which a compiled function's first call must not pay (tests/test_first_call.py)."""
    strides, step = [], 1
    for n in reversed([size_value(s) for s in shape]):
        if n < 0:
            raise ValueError(f"a tensor size must not be negative, got the shape {tuple(shape)}")
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def meta_tensor(p, shape=None) -> torch.Tensor:
    """A meta tensor with ``p``'s shape (or ``shape``, sizes a caller decided), dtype, strides and storage offset."""
    shape = tuple(size_value(s) for s in p._tt_shape) if shape is None else shape
    strides, offset = p._tt_strides, p._tt_storage_offset
    extent = 0 if 0 in shape else 1 + sum((s - 1) * abs(st) for s, st in zip(shape, strides))
    base = torch.empty(offset + extent, dtype=p._tt_dtype.torch, device="meta")
    return base.as_strided(shape, strides, offset)


def is_tensor_proxy(x) -> bool:
    return type(x) is TensorProxy


class NumberProxy(Proxy):
    """A Python number of the program that is not a baked-in constant: an input (an optimizer's ``lr``),
    a symbolic size, a ``Tensor.item()`` result, or arithmetic on those.

    ``value`` is the example value seen while tracing, or None where none exists yet (``item()``:
    the tensor has no data while tracing); ``python_type`` is int, float or bool.

    The concrete classes subclass ``torch.SymInt`` / ``SymFloat`` / ``SymBool`` (without their
    symbolic node: their ``__init__`` is never called), *not* ``int``/``float``.  torch's argument
    parser accepts a Sym* object wherever an int, a Scalar or a size goes (``p.add_(g, alpha=-lr)``,
    ``x.view(n, -1)``, ``torch.full((3,), v)``) and hands the proxy itself to the tracer.  An
    ``int``/``float`` subclass would also be accepted, but CPython reads its stored number directly in
    ``range(n)``, ``lst[:n]``, ``math.sqrt(v)``, format specs, ``struct``, ... with no hook to notice,
    silently using a placeholder.  Here each of those calls ``__index__``/``__float__``/...: arithmetic
    and comparisons record scalar prims (``n1 = n0 + 1``), and every other use of the number needs its
    plain value, which ``_concrete`` gives as a *decision* checked on every call (``item()`` results,
    acquisition/decisions.py: by the prologue, or by the program where it computes the value) or as a
    recorded check (``_Checked``).
    """

    def __new__(cls, name=None, *, value, python_type=None):
        pt = python_type or type(value)
        if cls is NumberProxy:
            cls = _BoolProxy if pt is bool else _IntProxy if pt is int else _FloatProxy  # complex too
        self = object.__new__(cls)
        self.name = name if name is not None else fresh_name("n")
        self.value = value
        self.python_type = pt
        return self

    def __init__(self, *args, **kwargs):  # torch.Sym*.__init__ wants a symbolic node: there is none
        pass

    @property
    def __class__(self):
        # ``isinstance(n, int)`` / ``isinstance(lr, float)`` answer as for eager's number (the class is the
        # Python type); CPython's own reads of a stored number look at the real type, which has none.
        return self.python_type

    def __hash__(self):
        # A dict key or set member (``n in {2, 4}``) is found by the plain value, as in eager; an identity
        # hash would silently miss.  (The compiler keys its own tables by ``id()``.)
        return hash(self._concrete("hash() (a dict key, a set member)"))

    @property
    def node(self):
        # torch.compile's symbolic-shape helpers (torch.fx.experimental.symbolic_shapes) read this.
        raise TypeError(
            f"the thunder_train runtime number {self.name} reached torch code written for torch.compile's symbolic "
            "values (it asked for a SymNode). Convert it first where that code is called (int(n) / float(n)), "
            "or report the call that needs it."
        )

    def type_string(self) -> str:
        if self.value is None:  # item() of a tensor: no example value while tracing
            return self.python_type.__name__
        return f"{self.python_type.__name__} {self.value}"

    def __repr__(self) -> str:
        return f"<NumberProxy {self.name}: {self.type_string()}>"

    # ---- the plain Python value, for every use that is not recorded arithmetic ----
    def _concrete(self, what: str, convert: str | None = None):
        """``convert(value)`` as a plain Python number (``convert`` defaults to the proxy's own type):
        while tracing, a decision checked on every call (acquisition/decisions.py; the value does not
        exist yet, and another call's would differ)."""
        from .context import tracer_state

        convert = convert or self.python_type.__name__
        if convert == "complex":
            raise TypeError(f"{what} of the complex runtime number {self.name} cannot be traced: "
                            "use it in tensor arithmetic, or move that code outside the compiled function")
        if _decision_handler is not None and tracer_state() is not None:
            return _decision_handler(self, convert, f"{what} of the runtime number {self.name}")
        if self.value is None:
            raise RuntimeError(
                f"thunder_train internal error: {what} of the runtime number {self.name} outside tracing; "
                "it has no value. Please report this with the function being compiled."
            )
        return {"int": int, "float": float, "bool": bool}[convert](self.value)

    def __bool__(self):
        v = self._concrete("bool()", "bool")
        same = getattr(self, "equates", None)  # ``u0 == u1`` of two data-dependent sizes, decided equal
        if same is not None and v == same[2] and _root(same[0]) is not _root(same[1]):
            _root(same[1]).same_as = _root(same[0])  # later shape questions know it (the program checks it first)
        return v

    def __int__(self):
        return self._concrete("int()", "int")

    def __float__(self):
        return self._concrete("float()", "float")

    def __index__(self):
        if self.python_type is float:
            raise TypeError("'float' object cannot be interpreted as an integer")
        return operator.index(self._concrete("an integer index (range(), a slice, a list index, ...)"))

    def __complex__(self):
        return complex(self._concrete("complex()"))

    def __str__(self):
        return str(self._concrete("str()"))

    def __format__(self, spec):
        return format(self._concrete(f"format spec {spec!r}" if spec else "formatting"), spec)

    def __round__(self, ndigits=None):
        v = self._concrete("round()")
        return round(v) if ndigits is None else round(v, ndigits)

    def __trunc__(self):
        return math.trunc(self._concrete("math.trunc()"))

    def __floor__(self):
        return math.floor(self._concrete("math.floor()"))

    def __ceil__(self):
        return math.ceil(self._concrete("math.ceil()"))

    def __array__(self, dtype=None, copy=None):  # numpy (np.sqrt(v), np.asarray(v)) reads the plain value
        import numpy

        return numpy.asarray(self._concrete("numpy"), dtype=dtype)

    def __reduce__(self):
        raise TypeError("NumberProxy objects cannot be pickled")

    # ---- arithmetic on runtime numbers records scalar prims (``prims.add(n0, 1)``, printed ``n1 = n0 + 1``) ----
    def _binop(self, other, opname, reverse=False):
        if not is_number(other):
            return NotImplemented
        # Integer identities (``1 * n``, ``n + 0``, ``x // 1``, ``(x + k) - k``, ``(n * k) // k``): the simpler form,
        # recorded as nothing, so that a data-dependent size stays the same symbol through shape arithmetic.
        # Only on ints: on floats ``-0.0 + 0`` is ``0.0``, ``x // 1`` floors.
        if self.python_type is not int or type(other) is not int:
            if not reverse and opname == "floor_divide" and self.python_type is int and number_type(other) is int:
                q = _quotient_of_products(self, other)
                if q is not None:
                    return q
        elif (opname == "mul" and other == 1) or (opname in ("add", "sub") and other == 0 and not (reverse and opname == "sub")):
            return self
        elif not reverse and _int_identity(self, opname, other) is not None:
            return _int_identity(self, opname, other)
        elif not reverse and opname in ("floor_divide", "remainder") and other > 0:
            o = getattr(self, "origin", None)
            if o is not None and o[0] == "op" and o[1] == "mul" and other in [a for a in o[2:] if type(a) is int]:
                # ``(n * k) // k`` is ``n``, ``(n * k) % k`` is 0: a reshape back keeps the symbol
                i = next(j for j, a in enumerate(o[2:]) if type(a) is int and a == other)
                return o[2:][1 - i] if opname == "floor_divide" else 0
        a, b = (other, self) if reverse else (self, other)
        if get_trace() is None:  # (the prim would run its eager form on the proxy, which calls this again, forever)
            raise RuntimeError(f"thunder_train internal error: {opname} of the runtime value {self._tt_name} outside a "
                               "trace, where no line can record it; a pass must ask whether a size is concrete first")
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

    def __pow__(self, o, mod=None):
        return self._binop(o, "pow") if mod is None else pow(self._concrete("pow() with a modulus"), o, mod)

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

    # torch.sym_max / sym_min / sym_float / sym_sqrt (torch's own Python code calls them on sizes).
    def __sym_max__(self, o):
        return _prims.maximum(self, o)

    def __sym_min__(self, o):
        return _prims.minimum(self, o)

    def __sym_float__(self):
        return self if self.python_type is float else self * 1.0

    def __sym_sqrt__(self):
        return _prims.sqrt(self)


def _on_the_value(name):
    """A method every other Python use of a number reaches (``n & 1``, ``n.bit_length()``, ``torch.sym_not(b)``):
    the same method of the plain value, which ``_concrete`` provides."""
    math_fn = getattr(math, name[6:-2], None) if name.startswith("__sym_") else None

    def method(self, *args):
        v = self._concrete(f"{name}()")
        if math_fn is not None:
            return math_fn(v, *args)
        if name == "__sym_not__":
            return not v
        if name == "__sym_ite__":
            return args[0] if v else args[1]
        if name == "__sym_int__":
            return int(v)
        fn = getattr(v, name, None)
        if fn is None:
            raise TypeError(f"{name} of the runtime number {self.name} is not supported while tracing (torch-internal)")
        return fn(*args)

    method.__name__ = name
    return method


class _IntProxy(NumberProxy, torch.SymInt):
    pass


class _FloatProxy(NumberProxy, torch.SymFloat):
    pass


class _BoolProxy(NumberProxy, torch.SymBool):
    pass


# Everything torch.Sym* defines and NumberProxy does not (each would read the missing symbolic node)
# goes through the plain value; ``_sympy_`` and torch's internal operator names are refused.
for _cls in (_IntProxy, _FloatProxy, _BoolProxy):
    for _name, _attr in vars(_cls.__mro__[-2]).items():
        if callable(_attr) and _name not in ("__init__", "__new__") and _name not in vars(NumberProxy):
            setattr(NumberProxy, _name, _on_the_value(_name))
for _name in ("__and__", "__or__", "__xor__", "__lshift__", "__rshift__", "__invert__", "__divmod__", "is_integer",
              "hex", "as_integer_ratio", "bit_length", "bit_count", "conjugate", "to_bytes"):
    if _name not in vars(NumberProxy):
        setattr(NumberProxy, _name, _on_the_value(_name))


def _on_the_value_reflected(name, op):
    def method(self, o):
        return op(o, self._concrete(f"{name}()"))

    return method


# Reflected operators have no same-named method on the plain value's side: apply the operator itself.
for _name, _op in (("__rand__", operator.and_), ("__ror__", operator.or_), ("__rxor__", operator.xor),
                   ("__rlshift__", operator.lshift), ("__rrshift__", operator.rshift), ("__rdivmod__", divmod)):
    setattr(NumberProxy, _name, _on_the_value_reflected(_name, _op))


class _Checked:
    """Runtime numbers whose Python decisions are checked instead of recomputed.

    A comparison, ``bool()`` or any use of the plain number is answered from the example value and
    recorded as a check (the tracer state's ``size_checks``) that the prologue and thin mode evaluate
    on every later input; a call that decides differently gets its own program.  ``origin`` says how
    the number is computed from the inputs: ``("dim", tensor proxy, i)``, ``("input",)`` (an input
    leaf itself) or ``("op", prim name, *args)``.
    """

    # A size computed by an op from tensor values (``nonzero``, boolean masks, ``unique``): the program knows it
    # only when the op has run, so no prologue can check a decision on it (acquisition/decisions.py checks it in
    # the program instead) and its ``value`` is only a stand-in for layout rules and estimates, never decided on.
    unbacked = False

    def _check(self, op, other, result):
        from .context import tracer_state

        st = tracer_state()
        if st is not None:
            st.size_checks.append((op, self, other, result))
        return result

    def _concrete(self, what, convert=None):
        from .context import tracer_state

        if self.unbacked:
            if tracer_state() is None:
                raise RuntimeError(f"thunder_train internal error: {what} of the data-dependent size {self.name} "
                                   "after tracing. Please report this with the function being compiled.")
            v = NumberProxy._concrete(self, what, convert)  # a decision the program checks where it runs the op
            if convert in (None, "int"):
                self.decided = v  # every later line runs with this value: later questions need no check
            return v
        if tracer_state() is None:
            # A pass after tracing (autograd, fusion) needs the plain value: no check could be recorded, so the
            # traced call's value would be baked into every later call's program.
            raise RuntimeError(
                f"thunder_train internal error: {what} of the symbolic number {self.name} after tracing would bake "
                "in its traced value. Please report this with the function being compiled; compiling without "
                "dynamic=True avoids it."
            )
        self._check("==", self.value, True)  # specialised on the value: later calls must have it too
        return self.value if convert is None else {"int": int, "float": float, "bool": bool}[convert](self.value)

    @staticmethod
    def _v(x):
        return x.value if isinstance(x, NumberProxy) else x

    def _cmp(self, other, op, fn, prim):
        if other is self:
            return fn(0, 0)
        if self.unbacked or getattr(other, "unbacked", False):
            if _same_expr(self, other):
                return fn(0, 0)
            a, b = _decided(self), _decided(other)
            if a is not None and b is not None:
                return fn(a, b)
            known = _known_for_size(self, op, other)
            if known is None and _no_tracer():
                # A compiler pass after tracing compares shapes structurally: another symbol or a number is
                # "not known equal"; an ordering it cannot know.
                if op in ("==", "!="):
                    return op == "!="
                raise RuntimeError(f"thunder_train internal error: {self.name} {op} {other} on a data-dependent size "
                                   "after tracing. Please report this with the function being compiled.")
            # recorded (``n1 = u0 == 1``): deciding on it is a check of the program
            return known if known is not None else NumberProxy._binop(self, other, prim)
        if isinstance(other, NumberProxy) and not isinstance(other, _Checked):
            return NumberProxy._binop(self, other, prim)  # against an item(): recorded, decided from the inputs
        if not is_number(other):
            return NotImplemented
        if other is self:
            return fn(0, 0)
        return self._check(op, other, fn(self.value, self._v(other)))

    def __eq__(self, o):
        return self._cmp(o, "==", operator.eq, "eq")

    def __ne__(self, o):
        return self._cmp(o, "!=", operator.ne, "ne")

    def __lt__(self, o):
        return self._cmp(o, "<", operator.lt, "lt")

    def __le__(self, o):
        return self._cmp(o, "<=", operator.le, "le")

    def __gt__(self, o):
        return self._cmp(o, ">", operator.gt, "gt")

    def __ge__(self, o):
        return self._cmp(o, ">=", operator.ge, "ge")

    __hash__ = NumberProxy.__hash__

    def __bool__(self):
        if self.unbacked:
            return NumberProxy.__bool__(self)
        return self._check("!=", 0, self.value != 0)


def _int_identity(x, opname, k):
    """``x // 1``, ``x % 1``, ``(x + k) - k``, ``(x - k) + k`` on an integer number: the simpler form, so that size
    arithmetic (a slice's length) keeps a data-dependent size the same symbol; None otherwise."""
    if k == 1 and opname in ("floor_divide", "remainder"):
        return x if opname == "floor_divide" else 0
    o = getattr(x, "origin", None)
    if o is None or o[0] != "op" or len(o) != 4 or type(o[3]) is not int or o[3] != k:
        return None
    if (opname, o[1]) in (("sub", "add"), ("add", "sub")):
        return o[2]
    return None


def _positive_product(x):
    """``(c, factors)`` with ``x == c * prod(factors)``, every factor a symbolic size of an input (≥ 2 on every call:
    the prologue and the thin check refuse 0 and 1 there), read through products only; None otherwise."""
    if type(x) is int:
        return x, []
    x = _root(x)
    if type(x) is not SizeProxy or x.unbacked:
        return None
    o = getattr(x, "origin", None)
    if o is not None and o[0] == "dim":
        return 1, [x]
    if o is None or o[0] != "op" or o[1] != "mul" or len(o) != 4:
        return None
    a, b = _positive_product(o[2]), _positive_product(o[3])
    if a is None or b is None:
        return None
    return a[0] * b[0], a[1] + b[1]


def _quotient_of_products(x, y):
    """``(c1 * F) // (c2 * F)`` is ``c1 // c2`` whatever the sizes in ``F`` are (they are positive): a reshape's
    ``-1`` (``numel // product of the other sizes``) that comes out a constant (the heads of ``view(B, T, -1, D)``)
    stays a constant, as in a trace with static sizes.  None when it does not simplify so."""
    a, b = _positive_product(x), _positive_product(y)
    if a is None or b is None or a[0] < 0 or b[0] <= 0 or len(a[1]) != len(b[1]) or not a[1]:
        return None
    rest = list(b[1])
    for f in a[1]:
        j = next((j for j, g in enumerate(rest) if _same_expr(f, g)), None)
        if j is None:
            return None
        rest.pop(j)
    return a[0] // b[0]


def _root(x):
    while getattr(x, "same_as", None) is not None:
        x = x.same_as
    return x


def _same_expr(x, y) -> bool:
    """The same size whatever the values: one symbol, equal ints, or the same arithmetic on the same sizes."""
    x, y = _root(x), _root(y)
    if x is y:
        return True
    if type(x) is int or type(y) is int:
        return type(x) is type(y) and x == y
    ox, oy = getattr(x, "origin", None), getattr(y, "origin", None)
    if ox is None or oy is None or ox[0] != "op" or oy[0] != "op" or ox[1] != oy[1] or len(ox) != len(oy):
        return False
    if all(_same_expr(a, b) for a, b in zip(ox[2:], oy[2:])):
        return True
    return ox[1] in ("mul", "add") and len(ox) == 4 and _same_expr(ox[2], oy[3]) and _same_expr(ox[3], oy[2])


def _decided(x):
    """The value of a size the trace has decided on (a check of the program makes every later line run with
    it), of arithmetic on such sizes, or of a plain int; None otherwise."""
    if type(x) is int:
        return x
    v = getattr(x, "decided", None)
    if v is not None:
        return v
    o = getattr(x, "origin", None)
    if o is None or o[0] != "op" or not isinstance(x, NumberProxy):
        return None
    args = [_decided(a) for a in o[2:]]
    if any(a is None for a in args):
        return None
    return getattr(_prims, o[1]).python_op(*args)


def same_size(x, y) -> bool:
    """Whether two sizes are equal, for a pass that only asks "can I skip this?": with a data-dependent size a
    "no" when equality is not certain, never a decision; other sizes compare as usual (checked symbols)."""
    if x is y:
        return True
    if is_unbacked(x) or is_unbacked(y):
        return _same_expr(x, y)
    return x == y


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same_size(x, y) for x, y in zip(a, b))


def _no_tracer() -> bool:
    from .context import tracer_state

    return tracer_state() is None


def _known_for_size(size, op, other):
    """What a comparison of a size with a plain int says whatever the size is (a size is never negative)."""
    if not isinstance(size, SizeProxy) or type(other) is not int or other > 0:
        return None
    if other == 0:
        return {">=": True, "<": False}.get(op)
    return {"==": False, "!=": True, ">": True, ">=": True, "<": False, "<=": False}[op]


class SizeProxy(_Checked, _IntProxy):
    """A symbolic size (``tt.compile(fn, dynamic=True)``): a dimension of a per-call input.

    Arithmetic records scalar prims whose results are SizeProxies too (shape arithmetic like
    ``t.reshape(t.size(0), -1)`` stays symbolic).  Decisions on sizes (comparisons, ``bool()``,
    ``int()``, ``range()``, slicing, ...) become checks (``_Checked``).
    """

    __hash__ = NumberProxy.__hash__

    def __format__(self, spec):
        if self.unbacked and _no_tracer():
            return format(self.name, spec)  # an error message written after tracing names the symbol
        return NumberProxy.__format__(self, spec)

    def __str__(self):
        return self.__format__("")


def unbacked_size(hint: int) -> SizeProxy:
    """A new size known only when the op computing it runs (``u0``); ``hint`` stands in for layout rules."""
    s = SizeProxy(fresh_name("u"), value=hint, python_type=int)
    s.unbacked = True
    s.origin = ("unbacked",)
    return s


def is_unbacked(x) -> bool:
    return type(x) is not TensorProxy and getattr(x, "unbacked", False) is True  # (numbers only: asked of every arg)


class CheckedFloat(_Checked, _FloatProxy):
    """A float hyper-parameter read from an optimizer's ``param_groups`` (``lr``, ``betas``, ``weight_decay``).

    A runtime input, so a scheduler changing it never retraces; code that decides on it
    (``if weight_decay != 0``, ``math.sqrt(lr)``) records a check instead of failing.
    """

    __hash__ = NumberProxy.__hash__


def is_checked(x) -> bool:
    return isinstance(x, _Checked)


def number_type(x):
    """int, float, bool or complex for a Python number or a number proxy (its ``python_type``); None otherwise.

    The package's one test of "is this a number": number proxies are not ``int``/``float`` instances.
    """
    if isinstance(x, NumberProxy):
        return x.python_type
    for t in (bool, int, float, complex):
        if isinstance(x, t):
            return t
    return None


def is_number(x) -> bool:
    """A Python number (bool, int, float, complex) or a number proxy."""
    return number_type(x) is not None


def is_int(x) -> bool:
    """An int (bools included, as in Python) or an int/bool number proxy: what ``isinstance(x, int)`` was."""
    return number_type(x) in (int, bool)


def size_arg(s):
    """A size as the trace keeps it: a symbolic size (dynamic=True) stays symbolic; any other number
    becomes a plain int (an ``item()`` result through a decision, as eager uses its value)."""
    return s if type(s) is SizeProxy else operator.index(s)


def as_divisor(n):
    """``float(n)`` for a plain count (a mean's element count); a runtime count (symbolic sizes) stays a runtime
    number, so dividing by it is recorded for every call instead of the traced call's count being baked in."""
    return n if isinstance(n, NumberProxy) else float(n)


def size_value(s):
    """The example value of a size or number (a plain number or a proxy) without recording a check."""
    return s.value if isinstance(s, NumberProxy) else s


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
