"""Dispatch of torch calls while tracing, with its special cases.

Every torch call made while tracing arrives here — through ``ProxyMode`` (a
``TorchFunctionMode``, so factories with no tensor argument come too) or
through ``TensorProxy.__torch_function__``.  It resolves to a torch-language
symbol; what has no symbol runs opaquely (``compiler/opaque.py``).  Special
cases: ``.grad`` and other tensor properties, ``backward``/``autograd.grad``,
real tensors the function captured, ``torch.no_grad()`` regions and in-place
ops the compiler does not know (refused: the update would be lost).
"""
from __future__ import annotations

import operator

import torch
from torch.overrides import TorchFunctionMode

from .. import context, proxies, symbols
from ..errors import TracingError, UnsupportedOpError
from . import ambient, called_functions, known_values
from .. import opaque
from ..opaque import call_opaque, callable_name
from ..transforms import opaque_grad  # noqa: F401 - installs the gradients of opaque ops into compiler/opaque.py
from .functional import fresh_results
from ..proxies import TensorProxy
from ..sparse_proxy import SparseProxy
from ..pytree import tree_flatten, tree_map
from . import kernel_switches, traced_autograd, traced_grad_fn
from ..torchlang import registry, value_shaped
from ..torchlang.autocast import cast_inputs
from ..torchlang.tensor_methods import requires_grad_of
from .opaque_views import record_opaque_views
from .sparse import refuse_sparse_gradient, sparse_call, touches_sparse
from .state import TracerState
from .inplace_overlap import check_partial_overlap
from .inplace import (_inplace_op, back_to_buffers, check_out_differentiable, converted_to, functionalize, generic_inplace,
                      inplace, is_view,
                      no_grad_region, opaque_out, read_current, record_views, write)


# ---------------------------------------------------------------------------
# Dispatch of torch calls while tracing
# ---------------------------------------------------------------------------
def _kernel_by_requires_grad(st, sym, args, kwargs):
    """The torch callable running the kernel eager picks for this call by its arguments' ``requires_grad``
    (``Symbol.kernel_by_requires_grad``: SDPA's math kernel for a mask requiring grad), or None."""
    choose = sym.kernel_by_requires_grad
    return None if choose is None else choose(lambda t: requires_grad_of(st, t), *args, **kwargs)


def _tracing_where():
    """``(state, trace, top)``: ``top`` for a call of the user's code, not one inside a decomposition."""
    st = context.tracer_state()
    if st is not None:
        return st, st.trace, len(st.trace._scopes) == 1
    trc = context.get_trace()
    if trc is None and context.other_threads_acquiring():
        raise TracingError(
            f"a tensor of an object that thread {context.other_threads_acquiring()[0]!r} is tracing right now was used "
            "by this thread: during a compiled function's first call (and a retrace), the parameters, buffers and "
            "optimizer state it reads stand as thunder_train proxies in their own modules and optimizers. Let that call "
            "return before using the model or optimizer in another thread (make one compiled call before starting "
            "the threads), or give each thread its own copy (copy.deepcopy).")
    if trc is None:
        raise TracingError(
            "a thunder_train proxy escaped the compiled function and was used outside tracing; "
            "do not store tensors from inside a compiled function on Python objects"
        )
    # A pass building a trace runs torch code on proxies (a custom Function's backward while the
    # joint trace is built): plain recording, no functionalization.
    return TracerState(trc, walker=None, buffers=None, grad_enabled=False), trc, False


def handle_torch_function(func, types, args, kwargs):
    st, trc, top = _tracing_where()
    if top:
        called_functions.note_caller(st)
    fname = getattr(func, "__name__", "")
    if top and torch._C._functorch.peek_interpreter_stack() is not None:
        raise TracingError(
            f"a torch.func transform (grad, vmap, jacrev, jvp, functional autograd) around {callable_name(func)} inside a "
            "compiled function is not supported: the compiled program would hold the transform's traced tensors. "
            "Compute gradients with torch.autograd.grad or loss.backward() inside the function, or apply the transform "
            "outside the compiled function.")
    if top:  # a dispatch mode or saved-tensor hooks the step entered (acquisition/ambient.py)
        ambient.refuse_while_tracing(lambda: any(type(a) is TensorProxy and requires_grad_of(st, a) for a in _flat(args, kwargs)))
    refuse_sparse_gradient(func, args, kwargs)
    sym = registry.lookup(func)
    if known_values.runs_known(st, func, sym, args, kwargs):  # torch.div(seq_len, 4) - 1
        return known_values.run_known(st, func, args, kwargs)
    special = _AUTOGRAD_CALLS.get(func)
    if touches_sparse(func, args, kwargs) and (special is None or _reads_sparse(args[:1])):
        return _sparse(st, func, args, kwargs, top)  # a sparse value: an opaque line (acquisition/sparse.py)
    if fname in ("__get__", "__set__") and type(func).__name__ == "method-wrapper":
        return _property(st, getattr(func.__self__, "__name__", "?"), fname == "__get__", args, top)
    if special is not None:
        if any(isinstance(a, torch.Tensor) and not proxies.is_proxy(a) for a in _flat(args, kwargs)):
            args, kwargs = _capture_real_tensors(st, args, kwargs)
        return special(st, *args, **kwargs)
    args, kwargs = registry.torch_arguments(sym, func, args, kwargs)  # what eager's parser takes (axis=, size=)
    flat = _flat(args, kwargs)
    complex_in = any(type(a) is TensorProxy and a._tt_dtype.is_complex for a in flat)
    if any(isinstance(a, torch.Generator) for a in flat):
        _refuse_generator(func)
    if any(isinstance(a, torch.Tensor) and type(a) is not TensorProxy for a in flat):
        args, kwargs = _capture_real_tensors(st, args, kwargs)
    if top and st.walker is not None:
        rewritten = _data_dependent_form(func, args, kwargs)
        if rewritten is not None:
            return rewritten(func, args, kwargs)
    # Functionalization (compiler/acquisition/functional.py): read the current value of every buffer.
    orig_args, orig_kwargs = args, kwargs
    if top:
        args, kwargs = read_current(st, args, kwargs)
    if sym is not None:
        if top and getattr(sym, "on_buffer", False):  # flags act on the user's tensor (tensor_methods.set_requires_grad)
            return sym(*orig_args, **orig_kwargs)
        out_arg = kwargs.get("out")
        if out_arg is not None:
            if not top or type(out_arg) is not TensorProxy:
                raise TracingError(f"{sym.name}(..., out=...) is not supported inside a compiled function; use the returned value")
            # out=: the result becomes the destination's new value (functionalized like an in-place op).
            dst = orig_kwargs["out"]
            check_out_differentiable(st, fname, tree_flatten((args, kwargs))[0], dst)
            check_partial_overlap(st, func, orig_args, orig_kwargs, dst)  # eager refuses before computing
            kwargs = {k: v for k, v in kwargs.items() if k != "out"}
            write(st, sym, dst, converted_to(sym(*args, **kwargs), dst))
            return dst
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        flagged = _inplace_flag(sym, args, kwargs) if top and orig_args and type(orig_args[0]) is TensorProxy else None
        if flagged is not None:
            # ``F.relu(x, inplace=True)``: eager writes the result into ``x`` and returns ``x``.  The op computes
            # out of place and the result becomes ``x``'s new value (functionalized like ``x.relu_()``); a call
            # whose result was dropped (``F.relu(b, inplace=True)`` alone on its line) still changes ``b``.
            dst = orig_args[0]
            with _inplace_op(st, func, dst, args, kwargs, orig_args):  # eager's checks of an in-place op
                write(st, sym, dst, converted_to(_flagged_value(st, trc, sym, func, *flagged), dst))
            return dst
        if top and getattr(sym, "functional", None) is not None:
            if complex_in and _complex_gradient(st, args, kwargs):  # the out-of-place form dispatched: through torch's autograd
                return generic_inplace(st, func, orig_args, args, kwargs, _dispatch_top, _run_opaque(st))
            return inplace(st, sym, orig_args, args, kwargs)
        if top and getattr(sym, "functionalize", None) is not None:
            return functionalize(st, sym, orig_args, args, kwargs)
        scope = trc._scopes[-1]
        n = len(scope)
        entry = getattr(sym, "traces_torch_calls", False)
        if top and not entry:  # the conversions eager autocast would do, as explicit trace lines (torchlang/autocast.py)
            args, kwargs = cast_inputs(sym, func, args, kwargs)
        runner = kernel_switches.runner_if_switched(st, sym) if top else None
        if runner is not None:  # called under kernel switches the function set itself: replayed on every call
            return no_grad_region(st, call_opaque(runner, args, kwargs, strict=False))
        try:
            if entry:
                # An op written with torch calls (``composed`` in torchlang/registry.py) runs like the user's code:
                # on the user's objects (its in-place calls update them; each torch call reads current values and
                # applies autocast itself), and under the mode, which torch switches off while it handles this call
                # (without it a factory inside would run eagerly, as a constant).
                with ProxyMode():
                    out = sym(*orig_args, **{k: v for k, v in orig_kwargs.items() if k != "out"})
            else:
                out = sym(*args, **kwargs)
        except NotImplementedError as e:
            # The torch language does not cover these arguments (F.pad(mode='reflect'), ceil_mode=True, ...):
            # run the call opaquely, as torch, rather than fail (strict=True still refuses it).
            if isinstance(e, UnsupportedOpError) or st.walker is None:
                raise
            del scope[n:]
            try:
                out = call_opaque(func, args, kwargs, strict=st.strict)
            except UnsupportedOpError:
                if st.strict:
                    raise UnsupportedOpError(f"{e} (and strict=True forbids running it through torch)") from None
                raise e from None  # torch cannot run it on proxies either (t[mask]): the torch language's reason
            if top and orig_args and type(orig_args[0]) is TensorProxy and st.buffers is not None:
                # a view eager returns (torch.real of a complex tensor): updates through it reach its base
                record_opaque_views(st, func, orig_args, args, kwargs, out, _run_opaque(st))
            return no_grad_region(st, out)
        if not entry and (complex_in or _has_complex(out)) and _complex_gradient(st, args, kwargs):
            # The torch language's gradient rules are written for real tensors (no conjugates): a call that reads or
            # makes a complex tensor on the gradient path runs through torch, whose autograd differentiates it.
            # (A composed entry's own torch calls came through here one by one.)
            del scope[n:]
            out = call_opaque(func, args, kwargs, strict=st.strict)
            if top and orig_args and type(orig_args[0]) is TensorProxy and st.buffers is not None:
                record_opaque_views(st, func, orig_args, args, kwargs, out, _run_opaque(st))
            return no_grad_region(st, out)
        if len(scope) > n and scope[-1].sym is sym:
            eager_kernel = _kernel_by_requires_grad(st, sym, args, kwargs) if top and st.walker is not None else None
            scope[-1].torch_fn = eager_kernel or func
            if scope[-1].torch_fn is not getattr(sym, "torch_impl", None) and symbols.layout_hook is not None:
                symbols.layout_hook(scope[-1])  # the layout of what the torch executor will call
        if top:
            out = fresh_results(func, args, kwargs, out)
            out = back_to_buffers(orig_args, args, out)
            if is_view(sym) and orig_args and type(orig_args[0]) is TensorProxy:
                record_views(st, sym, orig_args[0], args[1:], kwargs, out, func)
        return no_grad_region(st, out, sym)
    _refuse_unsupported_calls(func, fname, args, kwargs, top)
    if top and _is_inplace(func) and not orig_args:
        # torch.nn.init.uniform_(tensor=w): the destination as the first positional argument
        key = next((k for k in ("tensor", "input", "self") if type(kwargs.get(k)) is TensorProxy), None)
        if key is not None:
            orig_args, args = (orig_kwargs[key],), (kwargs[key],)
            orig_kwargs = {k: v for k, v in orig_kwargs.items() if k != key}
            kwargs = {k: v for k, v in kwargs.items() if k != key}
    if top and _is_inplace(func) and any(type(a) is TensorProxy for a in _flat(orig_args[:1], {})):
        # Functionalized: the out-of-place form (native where known, else the op on a copy), one write-back.
        return generic_inplace(st, func, orig_args, args, kwargs, _dispatch_top, _run_opaque(st))
    if top and isinstance(orig_kwargs.get("out"), (TensorProxy, list, tuple)):
        if type(orig_kwargs["out"]) is TensorProxy:
            check_out_differentiable(st, fname, tree_flatten((args, kwargs))[0], orig_kwargs["out"])
            check_partial_overlap(st, func, orig_args, orig_kwargs, orig_kwargs["out"])
        return opaque_out(st, func, orig_kwargs, args, kwargs, _run_opaque(st))
    out = call_opaque(func, args, kwargs, strict=st.strict)
    if top and orig_args and type(orig_args[0]) is TensorProxy and st.buffers is not None:
        record_opaque_views(st, func, orig_args, args, kwargs, out, _run_opaque(st))
    return no_grad_region(st, out)


def _refuse_unsupported_calls(func, fname, args, kwargs, top) -> None:
    """Calls on proxies that thunder_train cannot run as eager does, refused with what to do instead."""
    if fname in ("register_hook", "register_post_accumulate_grad_hook") and any(type(a) is TensorProxy for a in _flat(args, kwargs)):
        raise TracingError(
            f"Tensor.{fname} inside a compiled function: thunder_train computes gradients with its own backward and "
            "would not call the hook. Apply its change to the gradient explicitly (torch.autograd.grad, then modify), "
            "or register it outside on a parameter and call backward() outside the compiled function."
        )
    if top and getattr(func, "__name__", "").endswith("_") and not getattr(func, "__name__", "").endswith("__"):
        if any(type(a) is TensorProxy for a in _flat(args, kwargs)):
            if getattr(func, "__name__", "").startswith("_fused_"):
                raise TracingError(
                    f"{callable_name(func)}: this fused=True optimizer is not supported inside a compiled step yet "
                    "(Adam, AdamW, SGD and Adagrad are); use foreach=True or the default implementation"
                )
            if getattr(func, "__name__", "").startswith("_amp_"):
                raise TracingError(
                    f"{callable_name(func)}: a GradScaler inside a compiled step is not supported yet (its step is "
                    "skipped when gradients overflow, a decision on tensor values). Train with bf16 autocast, which "
                    "needs no scaler, or keep the scaler's unscale_/step/update outside the compiled function."
                )


def _has_complex(out) -> bool:
    if type(out) is TensorProxy:
        return out._tt_dtype.is_complex
    if isinstance(out, (tuple, list)):
        return any(_has_complex(o) for o in out)
    return False


def _complex_gradient(st, args, kwargs) -> bool:
    """Can a gradient flow through a call that reads or makes a complex tensor?"""
    if st.walker is None or not torch.is_grad_enabled():
        return False
    return bool(opaque_grad.gradient_positions(_flat(args, kwargs)))


_ITEM_ACCESS = {getattr(owner, m) for owner in (torch.Tensor, torch._C.TensorBase) for m in ("__getitem__", "__setitem__")}


def _data_dependent_form(func, args, kwargs):
    """Calls whose result sizes the values decide, written with ``nonzero`` (torchlang/value_shaped.py): a boolean
    mask in an indexing key becomes the positions it selects, ``torch.where(cond)`` is ``nonzero(as_tuple=True)``.
    Returns how to run the call, or None for every other call."""
    if func in _ITEM_ACCESS and len(args) >= 2 and type(args[0]) is TensorProxy:
        if value_shaped.mask_keys(args[0], args[1], probe=True) is None:
            return None

        def run(func, args, kwargs):
            return func(args[0], value_shaped.mask_keys(args[0], args[1]), *args[2:], **kwargs)
        return run
    if func is torch.where and len(args) == 1 and not kwargs:
        return lambda func, args, kwargs: value_shaped.where_positions(args[0])
    return None


def _refuse_generator(func):
    """A ``torch.Generator`` argument: the compiled program would keep using the generator object of the
    traced call (one made inside the function would not be remade and reseeded on later calls)."""
    raise TracingError(
        f"{callable_name(func)}(..., generator=...) inside a compiled function is not supported: the generator's "
        "state lives outside the traced program, so later calls would not draw what eager draws. Draw the random "
        "tensor outside the compiled function and pass it in, or use the default generator (seeded outside)."
    )


def _inplace_flag(sym, args, kwargs):
    """``(args, kwargs)`` without the flag when the call passes ``inplace=True`` (by keyword or position) to an op
    whose signature has that flag (the ``torch.nn.functional`` activations, dropout), else None."""
    if kwargs.get("inplace") is not True and not any(a is True for a in args):
        return None  # (most calls: no signature read)
    try:
        params = list(_signature(sym.fn).parameters)
    except (TypeError, ValueError):
        return None
    if "inplace" not in params:
        return None
    if kwargs.get("inplace") is True:
        return args, {k: v for k, v in kwargs.items() if k != "inplace"}
    k = params.index("inplace")
    if k < len(args) and args[k] is True:
        return args[:k], {**dict(zip(params[k + 1:], args[k + 1:])), **kwargs}
    return None


def _flagged_value(st, trc, sym, func, args, kwargs):
    """The value of an ``inplace=True`` call computed out of place: by the torch language, or by torch where the
    torch language does not cover it (rrelu, alpha dropout in training)."""
    scope = trc._scopes[-1]
    n = len(scope)
    try:
        return getattr(sym, "written_in_place", sym)(*args, **kwargs)
    except NotImplementedError as e:
        if isinstance(e, UnsupportedOpError) or st.walker is None:
            raise
        del scope[n:]
        return call_opaque(func, args, kwargs, strict=st.strict)


_signatures: dict = {}


def _signature(fn):
    sig = _signatures.get(fn)
    if sig is None:
        import inspect

        sig = _signatures[fn] = inspect.signature(fn)
    return sig


def _is_inplace(func) -> bool:
    name = getattr(func, "__name__", "") or ""
    return (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__") and name not in _NOT_INPLACE_DUNDERS)


_NOT_INPLACE_DUNDERS = {"__init__", "__index__", "__int__", "__iter__", "__invert__"}


def _dispatch_top(fn, args, kwargs):
    return handle_torch_function(fn, (), args, kwargs)


def _run_opaque(st):
    return lambda fn, args, kwargs: call_opaque(fn, args, kwargs, strict=st.strict)


def _property(st, prop, get, args, top):
    a = args[0]
    if get and isinstance(a, torch.Tensor) and not proxies.is_proxy(a):
        # A real tensor the function reads (a library object's own tensor, e.g. a GradScaler's scale): its
        # metadata is eager's, read without this mode.
        with torch._C.DisableTorchFunction():
            return getattr(a, prop)
    if prop == "grad":
        if get:
            return st.grads.get(a)
        return st.grads.set(a, args[1])
    if prop == "data" and not get:
        return traced_autograd.assign_data(st, a, args[1])
    if not get:
        setter = registry.property_setters.get(prop)
        if setter is None:
            raise TracingError(f"setting Tensor.{prop} is not supported while tracing with thunder_train")
        return setter(a, args[1])
    if type(a) is TensorProxy and a._tt_dtype.is_complex and prop in _COMPLEX_PROPERTIES:
        # Of a complex tensor these are views with conjugates or halves: the torch call, dispatched as one.
        fn = _COMPLEX_PROPERTIES[prop]
        return handle_torch_function(fn if len(a._tt_shape) == 2 or prop != "H" else torch.conj, (), (a,), {})
    getter = registry.property_getters.get(prop)
    if getter is None:
        raise TracingError(f"Tensor.{prop} is not supported while tracing with thunder_train")
    if not top or type(a) is not TensorProxy:
        return getter(a)
    if prop == "requires_grad":
        return requires_grad_of(st, a)
    if prop in ("is_leaf", "grad_fn"):  # eager's answers (traced_grad_fn.py)
        from ..torchlang import tensor_methods

        return traced_grad_fn.answer(st, a, prop, getter, tensor_methods.computed_requires_grad, traced_autograd.new_leaves,
                                    traced_autograd.gradient_path)
    out = getter(st.buffers.read(a))
    if prop in ("data", "T", "mT", "H", "mH"):
        st.buffers.add_view(out, a, getter, steps=((operator.attrgetter(prop), (), {}),))
        if prop == "data":  # eager: .data has a version counter of its own (saved_versions.py)
            st.buffers.own_counter(out)
    return out


_COMPLEX_PROPERTIES = {"real": torch.real, "imag": torch.imag, "mH": torch.adjoint, "H": torch.adjoint}


def _autograd_backward(st, tensors, grad_tensors=None, retain_graph=None, create_graph=False, grad_variables=None, inputs=None):
    return traced_autograd.backward(st, tensors, grad_tensors, retain_graph, create_graph, inputs)


def _tensor_backward(st, self, gradient=None, retain_graph=None, create_graph=False, inputs=None):
    return traced_autograd.backward(st, self, gradient, retain_graph, create_graph, inputs)


def _autograd_grad(st, *args, **kwargs):
    return traced_autograd.grad(st, *args, **kwargs)


def _retain_grad(st, self):
    """``t.retain_grad()``: eager's error without grad, a no-op on a leaf; refused on a computed value (its ``.grad``
    would stay None: the program keeps no gradient of intermediate values)."""
    if type(self) is not TensorProxy:
        return torch.Tensor.retain_grad(self)
    if not requires_grad_of(st, self):
        raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
    if st.walker is not None and st.walker.is_input(self):
        return None
    from ..torchlang import tensor_methods

    if tensor_methods.computed_requires_grad is not None and tensor_methods.computed_requires_grad(st, self):
        raise TracingError(
            "Tensor.retain_grad() on a value computed inside the compiled function is not supported: its .grad would "
            "stay None (the compiled backward keeps no gradient of intermediate values). Return the value and call "
            "retain_grad() on it outside, with backward() outside the compiled function, or compute its gradient "
            "with torch.autograd.grad(loss, value, retain_graph=True) inside.")
    return None


_AUTOGRAD_CALLS = {
    torch.Tensor.backward: _tensor_backward,
    torch.autograd.backward: _autograd_backward,
    torch.autograd.grad: _autograd_grad,
    torch.Tensor.retain_grad: _retain_grad,
}


def _flat(args, kwargs):
    return tree_flatten((args, kwargs))[0]


def _reads_sparse(args) -> bool:
    return any(type(a) is SparseProxy for a in _flat(args, {}))


def _sparse(st, func, args, kwargs, top):
    """A call that reads or makes a sparse tensor: real tensors captured, dense inputs read at their current value.
    (A backward of dense outputs may differentiate sparse leaves, ``autograd.grad(loss, [s, w])``: not routed here;
    one of a sparse output is refused here.)"""
    fname = getattr(func, "__name__", "")
    if (fname in ("__get__", "__set__") and type(func).__name__ == "method-wrapper"
            and getattr(func.__self__, "__name__", "") == "grad"):
        return _property(st, "grad", fname == "__get__", args, top)  # a sparse leaf's .grad (GradState)
    if st.walker is not None and any(isinstance(a, torch.Tensor) and not proxies.is_proxy(a) for a in _flat(args, kwargs)):
        args, kwargs = _capture_real_tensors(st, args, kwargs)
    if top and st.buffers is not None:
        args, kwargs = read_current(st, args, kwargs)
    grad_flows = opaque.gradient_positions or (lambda flat: ())
    return sparse_call(func, callable_name(func), args, kwargs, strict=st.strict,
                       grad_flows=grad_flows)


def _capture_real_tensors(st, args, kwargs):
    walker = st.walker
    if st.known_tensors:
        args, kwargs = known_values.sizes_as_ints(st, args, kwargs)

    def swap(a):
        if isinstance(a, torch.Tensor) and not proxies.is_proxy(a):
            if id(a) in st.known_tensors:  # made from Python numbers while tracing: a constant
                return known_values.as_program_value(st, a)
            return walker.captured_tensor(a)
        return a

    return tree_map(swap, (args, kwargs))


proxies._torch_function_handler = handle_torch_function


class ProxyMode(TorchFunctionMode):
    """Routes every torch call made while tracing to the torch language."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return handle_torch_function(func, types, args, kwargs or {})

