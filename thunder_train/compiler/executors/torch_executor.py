"""The torch executor: runs every prim, and claims torch-language symbols whole.

Claiming a torch-language symbol whole (``torch.nn.functional.gelu`` rather
than its decomposition) keeps results bitwise equal to eager and the host
overhead low.  With ``decompose=True`` it claims only prims, which is how the
tests check that every decomposition matches eager.
"""
from __future__ import annotations

import torch

from .. import dtypes, devices, prims, symbols
from ..opaque import printable_reference
from ..proxies import TensorProxy, is_int, same_shape
from ..pytree import tree_map
from ..symbols import Symbol, BoundSymbol
from . import torch_impls

_impl_symbols: dict = {}
# Calls the prim rules below emit for a "fusible" prim that are not kernels Inductor fusion may take: views.
NOT_A_KERNEL = frozenset({torch.Tensor.expand, torch.reshape})
_vjp_impls: dict = {}  # (torch function, wanted positions) -> ImplSymbol of a TorchVJP


class ImplSymbol(Symbol):
    """A symbol that is a concrete callable; printed by its import path."""

    def __init__(self, fn, name: str | None = None):
        if name is not None:
            pname, g = name, {name.split(".")[0]: _globals_root(name)}
        elif getattr(fn, "__module__", None) == torch_impls.__name__:
            pname, g = f"ttex.{fn.__name__}", {"ttex": torch_impls}
        else:
            from ..opaque import callable_name

            pname, g = printable_reference(fn, callable_name(fn))
        super().__init__(pname, fn, module="torch_executor", is_prim=True)
        self._print_name = pname
        self._globals = g

    @property
    def print_name(self) -> str:
        return self._print_name

    def codegen_globals(self) -> dict:
        return self._globals


def _globals_root(name):
    return {"torch": torch, "ttex": torch_impls}[name.split(".")[0]]


def impl_symbol(fn, side_effect: bool = False, random: bool = False) -> ImplSymbol:
    """The (cached) symbol for a torch callable; ``side_effect`` keeps DCE away from mutations, ``random`` from
    draws nobody reads (they advance the generator) and keeps the fact for passes on executed traces."""
    key = (fn, side_effect, random)
    s = _impl_symbols.get(key)
    if s is None:
        s = _impl_symbols[key] = ImplSymbol(fn)
        s.tags = frozenset({"side_effect"} if side_effect else ()) | frozenset({"random"} if random else ())
    return s


def to_torch_arg(x):
    if isinstance(x, dtypes.DType):
        return x.torch
    if isinstance(x, devices.Device):
        return x.torch
    return x


def _conv_args(args, kwargs):
    return tree_map(to_torch_arg, args), tree_map(to_torch_arg, kwargs)


def _t(x):
    return type(x) is TensorProxy


# ---------------------------------------------------------------------------
# Prim implementations.  Each entry maps a prim to a function
# (bsym) -> (callable, args, kwargs) chosen at claim time, so that per-call
# work is only the torch call itself.
# ---------------------------------------------------------------------------
_prim_rules: dict = {}


def _rule(*syms):
    def deco(f):
        for s in syms:
            _prim_rules[s] = f
        return f

    return deco


class ScalarSymbol(Symbol):
    """Python arithmetic on runtime numbers, printed as an expression: ``n1 = 1 - n0``."""

    def __init__(self, prim):
        super().__init__(f"scalar_{prim.name}", prim.python_op, module="torch_executor", is_prim=True)
        self.op = prim.name
        self.infix = prim.infix

    def format_lines(self, bsym, fmt):
        args = [fmt(a) for a in bsym.args]
        op = self.infix
        expr = f"{args[0]} {op} {args[1]}" if op and len(args) == 2 else f"_scalar_{self.op}({', '.join(args)})"
        out = bsym.output
        return [f"{fmt(out)} = {expr}  # {out.name}: {out.python_type.__name__}"]

    def codegen_globals(self) -> dict:
        return {} if self.infix else {f"_scalar_{self.op}": self.fn}


# The prim's own Python-number form (``Symbol.python_op``, declared with the prim), keyed by the prim.
_scalar_symbols = {p: ScalarSymbol(p) for p in prims.all_prims().values() if p.python_op is not None}


def _scalar_rule(bsym):
    """Arithmetic on runtime numbers (an lr, ``step.item()``): Python's own operators, as eager computes it."""
    sym = _scalar_symbols.get(bsym.sym)
    return None if sym is None else (sym, bsym.args, {})


# The torch function of each elementwise prim: inputs of one shape and dtype, or a tensor and a number.
_ELEMENTWISE_TORCH = {
    prims.abs: torch.abs, prims.neg: torch.neg, prims.exp: torch.exp, prims.exp2: torch.exp2,
    prims.expm1: torch.expm1, prims.log: torch.log, prims.log1p: torch.log1p, prims.log2: torch.log2,
    prims.log10: torch.log10, prims.sqrt: torch.sqrt, prims.rsqrt: torch.rsqrt, prims.sin: torch.sin,
    prims.cos: torch.cos, prims.tan: torch.tan, prims.asin: torch.asin, prims.acos: torch.acos,
    prims.atan: torch.atan, prims.sinh: torch.sinh, prims.cosh: torch.cosh, prims.tanh: torch.tanh,
    prims.asinh: torch.asinh, prims.acosh: torch.acosh, prims.atanh: torch.atanh, prims.erf: torch.erf,
    prims.erfc: torch.erfc, prims.erfinv: torch.erfinv, prims.floor: torch.floor, prims.ceil: torch.ceil,
    prims.round: torch.round, prims.trunc: torch.trunc, prims.sign: torch.sign, prims.reciprocal: torch.reciprocal,
    prims.bitwise_not: torch.bitwise_not, prims.lgamma: torch.lgamma, prims.digamma: torch.digamma,
    prims.sigmoid: torch.sigmoid, prims.isfinite: torch.isfinite, prims.isnan: torch.isnan, prims.isinf: torch.isinf,
    prims.signbit: torch.signbit,
    prims.add: torch.add, prims.sub: torch.sub, prims.mul: torch.mul, prims.floor_divide: torch.floor_divide,
    prims.pow: torch.pow, prims.maximum: torch.maximum, prims.minimum: torch.minimum, prims.atan2: torch.atan2,
    prims.fmod: torch.fmod, prims.remainder: torch.remainder, prims.bitwise_and: torch.bitwise_and,
    prims.bitwise_or: torch.bitwise_or, prims.bitwise_xor: torch.bitwise_xor, prims.copysign: torch.copysign,
    prims.hypot: torch.hypot, prims.nextafter: torch.nextafter, prims.bitwise_left_shift: torch.bitwise_left_shift,
    prims.bitwise_right_shift: torch.bitwise_right_shift,
    prims.eq: torch.eq, prims.ne: torch.ne, prims.lt: torch.lt, prims.le: torch.le, prims.gt: torch.gt, prims.ge: torch.ge,
}
# Binary prims with a tensor second operand only in torch (``torch.atan2(t, 2.0)`` is refused): the number goes last.
_SCALAR_SECOND = {prims.atan2, prims.hypot, prims.nextafter}
# A number first and a tensor second: the torch form with the operands in that order.
_SCALAR_FIRST = {prims.sub: torch_impls.rsub, prims.pow: torch.pow}


def _elementwise(torch_fn):
    def rule(bsym):
        args = bsym.args
        if not any(_t(a) for a in args):
            return _scalar_rule(bsym)
        if len(args) == 1:
            return torch_fn, args, {}
        a, b = args
        sym = bsym.sym
        if not _t(a):
            if "commutative" in sym.tags:
                return torch_fn, (b, a), {}
            if sym.mirrored is not None:
                return _ELEMENTWISE_TORCH[sym.mirrored], (b, a), {}
            if sym in _SCALAR_FIRST:
                return _SCALAR_FIRST[sym], (a, b), {}
            return torch_impls.scalar_first(torch_fn), (a, b), {}
        if not _t(b) and sym in _SCALAR_SECOND:
            return torch_impls.scalar_second(torch_fn), (a, b), {}
        return torch_fn, (a, b), {}

    return rule


for _p, _f in _ELEMENTWISE_TORCH.items():
    _prim_rules[_p] = _elementwise(_f)


@_rule(prims.div)
def _(bsym):
    a, b = bsym.args
    if not _t(a) and not _t(b):
        return _scalar_rule(bsym)
    floating = (a if _t(a) else b)._tt_dtype.category >= dtypes.FLOAT
    if not _t(a):
        return (torch_impls.rdiv if floating else torch_impls.scalar_first(torch_impls.trunc_div)), (a, b), {}
    return (torch.true_divide if floating else torch_impls.trunc_div), (a, b), {}


def _clamp_with_number(torch_fn, clamp):
    """maximum/minimum of a tensor and a number: torch.clamp_min/clamp_max (no tensor made for the number)."""
    elementwise = _elementwise(torch_fn)

    def rule(bsym):
        a, b = bsym.args
        if _t(a) != _t(b):
            t, s = (a, b) if _t(a) else (b, a)
            return clamp, (t, s), {}
        return elementwise(bsym)

    return rule


_prim_rules[prims.maximum] = _clamp_with_number(torch.maximum, torch.clamp_min)
_prim_rules[prims.minimum] = _clamp_with_number(torch.minimum, torch.clamp_max)

# In-place forms of the torch functions chosen above, per prim: (torch function, the in-place method
# computing the same with the same arguments).  Re-inplacing (reinplace.py) reads them.
_T = torch.Tensor
_PRIM_INPLACE = {
    prims.add: (torch.add, _T.add_), prims.sub: (torch.sub, _T.sub_), prims.mul: (torch.mul, _T.mul_),
    prims.div: (torch.true_divide, _T.div_), prims.sqrt: (torch.sqrt, _T.sqrt_), prims.neg: (torch.neg, _T.neg_),
    prims.maximum: (torch.clamp_min, _T.clamp_min_), prims.minimum: (torch.clamp_max, _T.clamp_max_),
}


def prim_inplace_form(prim, fn):
    """The in-place form of ``fn`` when the torch executor runs ``prim`` with it, or None."""
    entry = _PRIM_INPLACE.get(prim)
    return entry[1] if entry is not None and entry[0] is fn else None


@_rule(prims.where)
def _(bsym):
    return torch.where, bsym.args, {}


@_rule(prims.convert_element_type)
def _(bsym):
    a, dt = bsym.args
    return torch.Tensor.to, (a, dt.torch), {}


@_rule(prims.clone)
def _(bsym):
    a, *fmt = bsym.args
    return torch.clone, (a,), ({"memory_format": fmt[0]} if fmt and fmt[0] is not None else {})


@_rule(prims.grad_layout)
def _(bsym):
    return torch_impls.grad_layout, bsym.args, {}


@_rule(prims.unseen_write)
def _(bsym):
    return torch_impls.unseen_write, bsym.args, {}


@_rule(prims.stop_gradient)
def _(bsym):
    return torch.Tensor.detach, bsym.args, {}


def _reduction(op):
    def rule(bsym):
        a, dims = bsym.args[0], bsym.args[1]
        if len(dims) == 0:
            return torch_impls.sum_none, (a,), {}
        return op, (a, tuple(dims)) + tuple(bsym.args[2:]), {}

    return rule


_prim_rules[prims.sum] = _reduction(torch.sum)
_prim_rules[prims.amax] = _reduction(torch.amax)
_prim_rules[prims.amin] = _reduction(torch.amin)
_prim_rules[prims.prod] = _reduction(torch_impls.prod)


@_rule(prims.var)
def _(bsym):
    a, dims, correction = bsym.args
    if not dims:
        return torch_impls.sum_none, (a,), {}
    return torch.var, (a, tuple(dims)), {"correction": correction}


@_rule(prims.argmax)
def _(bsym):
    return torch.argmax, bsym.args, {}


@_rule(prims.argmin)
def _(bsym):
    return torch.argmin, bsym.args, {}


@_rule(prims.cumsum)
def _(bsym):
    return torch.cumsum, bsym.args, {}


@_rule(prims.topk)
def _(bsym):
    a, k, dim, largest, sorted_ = bsym.args
    return torch.topk, (a, k, dim, largest, sorted_), {}


@_rule(prims.sort)
def _(bsym):
    a, dim, descending, stable = bsym.args
    return torch.sort, (a,), {"dim": dim, "descending": descending, "stable": stable}


@_rule(prims.broadcast_in_dim)
def _(bsym):
    a, shape, bdims = bsym.args
    view = [1] * len(shape)
    for i, d in enumerate(bdims):
        view[d] = a._tt_shape[i]
    # same_shape: a data-dependent size (a boolean mask's count) compares without asking for its value
    if same_shape(view, a._tt_shape):
        return torch.Tensor.expand, (a, tuple(shape)), {}
    k = len(shape) - len(a._tt_shape)
    if tuple(bdims) == tuple(range(k, len(shape))) and all(type(n) is int and n != 1 for n in shape):
        # New leading dims only: ``expand`` adds them itself, one call instead of reshape + expand (a layer norm's
        # weight over the batch's rows, ~2 us a line); without a dim of size 1 the strides are the same
        return torch.Tensor.expand, (a, tuple(shape)), {}
    if same_shape(view, shape):
        return torch.reshape, (a, tuple(shape)), {}
    return torch_impls.broadcast_in_dim, (a, tuple(view), tuple(shape)), {}


@_rule(prims.reshape)
def _(bsym):
    a, shape = bsym.args
    return torch.reshape, (a, tuple(shape)), {}


@_rule(prims.transpose)
def _(bsym):
    a, perm = bsym.args
    return torch.permute, (a, tuple(perm)), {}


@_rule(prims.slice)
def _(bsym):
    a, lo, hi = bsym.args[:3]
    st = bsym.args[3] if len(bsym.args) > 3 and bsym.args[3] is not None else (1,) * len(lo)
    key = tuple(slice(l, h, s) for l, h, s in zip(lo, hi, st))
    return torch.Tensor.__getitem__, (a, _short_key(key, a._tt_shape)), {}


def _short_key(key, shape):
    """A slicing key without the slices that keep a whole dimension: trailing ones dropped, leading ones an Ellipsis
    where one dimension is sliced, the last (``x[..., 0:8:1]``: half the call's time of a slice per dimension).  Only
    with every size and bound a number (a symbolic size may differ from its traced value at run time)."""
    if not all(type(n) is int for n in shape) or not all(type(v) is int for k in key for v in (k.start, k.stop, k.step)):
        return key
    whole = [k.start == 0 and k.stop >= n and k.step == 1 for k, n in zip(key, shape)]
    last = max((i for i, w in enumerate(whole) if not w), default=-1)
    if last == -1:
        return key  # nothing sliced: kept as traced (drop_identity_views drops the line)
    if last == len(shape) - 1 and all(whole[:last]) and last > 0:
        return (Ellipsis, key[last])
    return key[:last + 1]


@_rule(prims.squeeze)
def _(bsym):
    a, dims = bsym.args
    return torch.squeeze, (a, tuple(dims)), {}


@_rule(prims.cat)
def _(bsym):
    return torch.cat, (list(bsym.args[0]), bsym.args[1]), {}


@_rule(prims.pad)
def _(bsym):
    return torch_impls.pad, bsym.args, {}


@_rule(prims.flip)
def _(bsym):
    a, dims = bsym.args
    return torch.flip, (a, tuple(dims)), {}


@_rule(prims.take)
def _(bsym):
    a, index, dim = bsym.args
    if index.ndim_ == 0:
        return torch.select, (a, dim, index), {}
    return torch.index_select, (a, dim, index), {}


@_rule(prims.gather)
def _(bsym):
    a, index, dim = bsym.args
    return torch.gather, (a, dim, index), {}


@_rule(prims.scatter_add)
def _(bsym):
    a, index, src, dim = bsym.args
    return torch.scatter_add, (a, dim, index, src), {}


@_rule(prims.scatter)
def _(bsym):
    a, index, src, dim = bsym.args
    return torch.scatter, (a, dim, index, src), {}


@_rule(prims.index_put)
def _(bsym):
    return torch_impls.index_put, bsym.args, {}


@_rule(prims.matmul)
def _(bsym):
    return torch.matmul, bsym.args, {}


@_rule(prims.convolution)
def _(bsym):
    return torch_impls.convolution, bsym.args, {}


@_rule(prims.convolution_backward)
def _(bsym):
    return torch_impls.convolution_backward, bsym.args, {}


@_rule(prims.full)
def _(bsym):
    shape, value = bsym.args
    return torch.full, (tuple(shape), value), {"device": bsym.kwargs["device"].torch, "dtype": bsym.kwargs["dtype"].torch}


@_rule(prims.empty)
def _(bsym):
    return torch.empty, (tuple(bsym.args[0]),), {"device": bsym.kwargs["device"].torch, "dtype": bsym.kwargs["dtype"].torch}


@_rule(prims.iota)
def _(bsym):
    kw = bsym.kwargs
    ints = all(is_int(v) for v in (kw["start"], kw["step"])) and not kw["dtype"].is_float
    fn = torch_impls.iota_int if ints else torch_impls.iota_float
    return fn, (bsym.args[0], kw["start"], kw["step"], kw["device"].torch, kw["dtype"].torch), {}


@_rule(prims.uniform)
def _(bsym):
    shape, lo, hi = bsym.args
    return torch_impls.uniform, (tuple(shape), lo, hi, bsym.kwargs["device"].torch, bsym.kwargs["dtype"].torch), {}


@_rule(prims.randn)
def _(bsym):
    return torch.randn, (tuple(bsym.args[0]),), {"device": bsym.kwargs["device"].torch, "dtype": bsym.kwargs["dtype"].torch}


@_rule(prims.bernoulli)
def _(bsym):
    return torch_impls.bernoulli, bsym.args, {}


@_rule(prims.get_rng_state)
def _(bsym):
    return torch_impls.get_rng_state, (bsym.args[0].torch,), {}


@_rule(prims.set_rng_state)
def _(bsym):
    return torch_impls.set_rng_state, (bsym.args[0], bsym.args[1].torch), {}


@_rule(prims.manual_seed)
def _(bsym):
    return torch_impls.manual_seed, bsym.args, {}


@_rule(prims.copy_)
def _(bsym):
    return torch_impls.copy_, bsym.args, {}


@_rule(prims.shape)
def _(bsym):
    return torch_impls.shape, bsym.args, {}


@_rule(prims.nonzero)
def _(bsym):
    return torch.nonzero, bsym.args, {}


@_rule(prims.unique)
def _(bsym):
    return torch_impls.unique, bsym.args, {}


@_rule(prims.unique_consecutive)
def _(bsym):
    return torch_impls.unique_consecutive, bsym.args, {}


@_rule(prims.unique_dim)
def _(bsym):
    return torch_impls.unique_dim, bsym.args, {}


@_rule(prims.bincount)
def _(bsym):
    return torch.bincount, bsym.args, {}


@_rule(prims.repeat_index)
def _(bsym):
    return torch.repeat_interleave, bsym.args, {}


@_rule(prims.item)
def _(bsym):
    return torch.Tensor.item, bsym.args, {}


@_rule(prims.polygamma)
def _(bsym):
    return torch.polygamma, bsym.args, {}


@_rule(prims.all_reduce_mean)
def _(bsym):
    return torch_impls.all_reduce_mean, bsym.args, {}


# The sharded step's collectives are torch's functional collectives, printed under their own names.
_C10D = torch.ops._c10d_functional
for _name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
    _fn = getattr(_C10D, _name)
    _impl_symbols[(_fn, False, False)] = ImplSymbol(_fn, name=f"torch.ops._c10d_functional.{_name}")


@_rule(prims.all_gather)
def _(bsym):
    return _C10D.all_gather_into_tensor, bsym.args, {}


@_rule(prims.reduce_scatter)
def _(bsym):
    return _C10D.reduce_scatter_tensor, bsym.args, {}


@_rule(prims.wait)
def _(bsym):
    return torch_impls.wait_collective, bsym.args, {}


@_rule(prims.check_finite)
def _(bsym):
    return torch_impls.check_finite, bsym.args, {}


@_rule(prims.check_decision)
def _(bsym):
    return torch_impls.check_decision, bsym.args, {}


class TorchExecutor:
    """Claims prims always, and torch-language and opaque symbols whole unless ``decompose``."""

    name = "torch"

    def __init__(self, decompose: bool = False):
        self.decompose = decompose

    def claim(self, bsym) -> BoundSymbol | None:
        claimed = self._claim(bsym)
        if claimed is not None:
            claimed.source = bsym.sym
        return claimed

    def _claim(self, bsym) -> BoundSymbol | None:
        sym = bsym.sym
        if sym.module == "prims":
            rule = _prim_rules.get(sym)
            if rule is None:
                return None
            r = rule(bsym)
            if r is None:
                return None
            fn, args, kwargs = r
            args, kwargs = _conv_args(args, kwargs)
            impl = fn if isinstance(fn, ScalarSymbol) else impl_symbol(fn, bsym.has_side_effect, bsym.draws_random)
            return BoundSymbol(impl, args, kwargs, bsym.output, (), bsym.comment)
        if sym.runs_opaquely:
            return BoundSymbol(impl_symbol(sym.torch_impl, bsym.has_side_effect, bsym.draws_random), bsym.args, bsym.kwargs, bsym.output, (), bsym.comment)
        if sym.module == "vjp" and not self.decompose and bsym.torch_fn is not None and bsym.torch_fn[0] is not None:
            fn, wanted = bsym.torch_fn
            direct = sym.forward_symbol.torch_direct_vjp
            applies = getattr(direct, "applies", None)  # (its arguments) -> whether it is eager's kernel for them
            if (direct is not None and wanted == getattr(direct, "wanted", ((0,),))  # the gradients it computes
                    and (applies is None or applies(*bsym.args[1:], **bsym.kwargs))):
                # ``arguments``: the line's arguments -> the ones the rule is given (fewer values held to it)
                arguments = getattr(direct, "arguments", None)
                args, kwargs = (bsym.args, bsym.kwargs) if arguments is None else arguments(*bsym.args, **bsym.kwargs)
                return BoundSymbol(impl_symbol(direct), args, kwargs, bsym.output, (), bsym.comment)
            impl = _vjp_impls.get((fn, wanted))
            if impl is None:
                impl = _vjp_impls[(fn, wanted)] = ImplSymbol(torch_impls.TorchVJP(fn, wanted))
            return BoundSymbol(impl, bsym.args, bsym.kwargs, bsym.output, (), bsym.comment)
        if sym.module == "ltorch" and not self.decompose:
            impl = bsym.torch_fn if bsym.torch_fn is not None else getattr(sym, "torch_impl", None)
            if impl is None:
                return None
            return BoundSymbol(impl_symbol(impl, bsym.has_side_effect, bsym.draws_random), bsym.args, bsym.kwargs, bsym.output, (), bsym.comment)
        return None

    def eager_impl(self, sym, args, kwargs):
        """Run ``sym`` on real tensors (used when a printed trace is executed as Python)."""
        if sym.module == "ltorch" or sym.runs_opaquely:
            return sym.torch_impl(*args, **kwargs)
        rule = _prim_rules.get(sym)
        if rule is None:
            raise NotImplementedError(f"the torch executor has no implementation of {sym.id}")
        fake = BoundSymbol(sym, tuple(_as_meta_proxy(a) for a in args), kwargs, None)
        fn, fargs, fkwargs = rule(fake)
        if isinstance(fn, ScalarSymbol):
            fn = fn.fn
        # Substitute the real tensors back for the stand-ins.
        back = {id(p): real for p, real in zip(fake.args, args)}
        fargs = tree_map(lambda x: back.get(id(x), x), fargs)
        fargs, fkwargs = _conv_args(fargs, fkwargs)
        return fn(*fargs, **fkwargs)


def _as_meta_proxy(x):
    if isinstance(x, torch.Tensor) and type(x) is not TensorProxy:
        return TensorProxy("_eager", shape=tuple(x.shape), dtype=x.dtype, device=x.device)
    return x


torch_executor = TorchExecutor()
decomposing_torch_executor = TorchExecutor(decompose=True)


# Symbols run outside tracing (printed traces executed as Python) run here.
symbols.eager_executor = torch_executor.eager_impl
