"""Eager's memory layout for every traced op.

A bound symbol's output proxies get the strides and storage offset eager PyTorch
would give them, found by running what the torch executor will run for that
symbol (a prim's torch implementation, or the torch callable the user called for a
torch-language symbol) on fake tensors (``FakeTensorMode``: meta kernels that know
the device, since some layouts do — a CPU convolution keeps channels_last) laid out
like the inputs.  These are torch's own stride rules, not a second copy; the torch
executor then produces exactly these layouts at run time.

An error that eager would raise because of a layout (``view`` of a non-contiguous
tensor) is raised here, at trace time, from the user's line.
"""
from __future__ import annotations

import threading

import torch

from .. import symbols
from ..generators_kept import generators_untouched
from ..dense import dense_layout
from ..proxies import NumberProxy, TensorProxy, contiguous_strides, meta_tensor, same_shape, size_value
from ..pytree import tree_flatten, tree_map
from .torch_executor import ScalarSymbol, _prim_rules, to_torch_arg

# One fake mode per thread: a FakeTensorMode is not safe to use from two threads at once (its kernel-invocation
# flag and converter memo are its own), and a trace in one thread may run while another thread traces or the
# background fusion thread builds a program.  Shared, layout questions of concurrent traces failed (torch logged
# "failed while attempting to run meta"; the op then took plain meta tensors' layouts, which may not be the device's).
_fake_modes = threading.local()


def _mode():
    mode = getattr(_fake_modes, "mode", None)
    if mode is None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = _fake_modes.mode = FakeTensorMode(allow_non_fake_inputs=False)
    return mode


def _fake(p):
    """Inside the fake mode: a tensor with ``p``'s shape, dtype, device and layout."""
    shape = tuple(size_value(s) for s in p._tt_shape)
    strides, offset = p._tt_strides, p._tt_storage_offset
    extent = 0 if 0 in shape else 1 + sum((s - 1) * abs(st) for s, st in zip(shape, strides))
    if offset == 0:  # one factory call: ``as_strided`` in the fake mode costs ~1 ms a call on a first call
        return torch.empty_strided(shape, strides, dtype=p._tt_dtype.torch, device=p._tt_device.torch)
    base = torch.empty(offset + extent, dtype=p._tt_dtype.torch, device=p._tt_device.torch)
    return base.as_strided(shape, strides, offset)
# Meta-kernel errors that are eager's own layout errors (raised again at trace time).
_LAYOUT_ERRORS = ("view size is not compatible", "stride", "contiguous", "memory format")


def _callable(bsym):
    sym = bsym.sym
    if sym.module == "prims":
        rule = _prim_rules.get(sym)
        r = rule(bsym) if rule is not None else None
        if r is None or isinstance(r[0], ScalarSymbol):
            return None
        return r
    if sym.module == "ltorch":
        fn = bsym.torch_fn if bsym.torch_fn is not None else getattr(sym, "torch_impl", None)
        return None if fn is None else (fn, bsym.args, bsym.kwargs)
    if sym.module == "vjp" and bsym.torch_fn is not None and bsym.torch_fn[0] is not None \
            and "vjp_layout_from_kernel" in sym.forward_symbol.tags:
        # A fused backward (``<op>_vjp``) runs torch's own backward kernel, whose gradients need not be row-major
        # (the CPU flash attention backward lays them out as (batch, seq, heads, dim)): what eager's autograd gives.
        # Only for the ops that declare it: other backwards keep their row-major proxies.  A fake run is not every
        # kernel's truth: torch's meta of ``_log_softmax_backward_data`` lays the gradient out as the incoming one, the
        # CPU (and CUDA) kernel row-major; given every backward, wav2vec2's CTC head recorded (12, 24, 1) where the
        # kernel writes (468, 12, 1).  (Its kept buffer got wrong values then, since fixed in out_forms.ANY_LAYOUT.)
        from .saved_statistics import sdpa_vjp_kernels

        kernels = sdpa_vjp_kernels(bsym)  # the kernels the program runs (attention's): cheaper than TorchVJP's fake run
        return (kernels or _torch_vjp(*bsym.torch_fn), bsym.args, bsym.kwargs)
    return None


def _torch_vjp(fn, wanted):
    """One ``TorchVJP`` per (function, wanted): the layout cache's key names the callable."""
    from .torch_impls import TorchVJP

    vjp = _vjps.get((fn, wanted))
    if vjp is None:
        vjp = _vjps[(fn, wanted)] = TorchVJP(fn, wanted)
    return vjp


_vjps: dict = {}


def _to_meta(x):
    if type(x) is TensorProxy:
        return meta_tensor(x)
    x = _to_fake(x)
    return _META if isinstance(x, torch.device) else x


_META = torch.device("meta")


def _to_fake(x):
    if type(x) is TensorProxy:
        return _fake(x)
    if isinstance(x, NumberProxy):
        return x.python_type(1) if x.value is None else x.python_type(x.value)  # an item(): a stand-in value
    return to_torch_arg(x)


def _on_meta(fn, args, kwargs):
    """The op on plain meta tensors (C++ meta kernels raise eager's own messages); None if it cannot run."""
    try:
        with torch._C.DisableTorchFunction(), torch.no_grad():
            margs, mkwargs = tree_map(_to_meta, (tuple(args), dict(kwargs)))
            return fn(*margs, **mkwargs)
    except Exception as e:  # noqa: BLE001 - a meta kernel may be missing; only layout errors are eager's
        msg = str(e)
        if isinstance(e, RuntimeError) and not isinstance(e, NotImplementedError) and any(s in msg for s in _LAYOUT_ERRORS) \
                and "meta" not in msg.lower():
            raise RuntimeError(msg) from None
        return None


def _like(p, src) -> None:
    """``p`` laid out as ``clone(src)`` (torch's preserve_format: ``src``'s strides when dense, else row-major)."""
    from ..dense import is_non_overlapping_and_dense

    if src._tt_rowmajor or not is_non_overlapping_and_dense(meta_tensor(src)):
        p._tt_strides, p._tt_storage_offset, p._tt_rowmajor = contiguous_strides(p._tt_shape), 0, True
    else:
        p._tt_strides, p._tt_storage_offset, p._tt_rowmajor = src._tt_strides, 0, False


# ---------------------------------------------------------------------------
# Layout rules (``Symbol.layout_rule``, keyed by the op): eager's layout known without the fake run that costs
# 0.1-14 ms a call on the first call (the GPT benchmark step's linear, matmul, cross-entropy, zeros_like and
# _foreach_add lines: ~70 ms of its 0.5 s).  ``rule(bsym, tensors, outs)`` returns True when it knows the layout:
# it set it, or the outputs are row-major as the proxies were created.  Mixed dtypes or devices are left to the
# fake run, which raises eager's error.
# ---------------------------------------------------------------------------
def _returns_destination(bsym, tensors, outs) -> bool:
    """copy_(src, dst) returns ``dst``."""
    dst = bsym.args[1]
    bsym.output._tt_strides, bsym.output._tt_rowmajor, bsym.output._tt_storage_offset = dst._tt_strides, dst._tt_rowmajor, dst._tt_storage_offset
    return True


def _like_parameter(bsym, tensors, outs) -> bool:
    """The parameter's layout when dense, else row-major (torch_impls.grad_layout)."""
    _like(bsym.output, bsym.args[1])
    return True


def _like_overwritten_lists(bsym, tensors, outs) -> bool:
    """Multi-tensor updates of clones: output list i mirrors argument list j (the kernel's ``overwrites``)."""
    overwrites = getattr(bsym.sym.torch_impl, "overwrites", None)
    if overwrites is None:
        return False
    for i, j in overwrites:
        for o, a in zip(bsym.output[i], bsym.args[j]):
            _like(o, a)
    return True


def _same_dtype_and_device(tensors) -> bool:
    return len({(t._tt_dtype, t._tt_device) for t in tensors}) == 1


def _matmul_of_matrices(bsym, tensors, outs) -> bool:
    """mm, mv, dot: a new row-major result whatever the operands' strides."""
    return _same_dtype_and_device(tensors) and len(tensors) == 2 and all(len(t._tt_shape) <= 2 for t in tensors)


def _linear_of_row_major(bsym, tensors, outs) -> bool:
    """addmm/mm on the row-major input flattened to 2-d."""
    return _same_dtype_and_device(tensors) and tensors[0] is bsym.args[0] and tensors[0]._tt_rowmajor


_ROW_MAJOR_FORMATS = (None, torch.preserve_format, torch.contiguous_format)


def _like_of_row_major(bsym, tensors, outs) -> bool:
    """preserve_format of a row-major tensor."""
    return len(tensors) == 1 and tensors[0]._tt_rowmajor and bsym.kwargs.get("memory_format") in _ROW_MAJOR_FORMATS


def _foreach_of_row_major(bsym, tensors, outs) -> bool:
    """Elementwise per list element: each result has its first-list tensor's shape, row-major like it."""
    if not all(t._tt_rowmajor for t in tensors):
        return False
    first = bsym.args[0] if isinstance(bsym.args[0], (list, tuple)) else ()
    return len(first) == len(outs) and all(type(a) is TensorProxy and same_shape(a._tt_shape, o._tt_shape) for a, o in zip(first, outs))


def _like_input(bsym, tensors, outs) -> bool:
    """``wait`` returns the tensor the collective made; ``unseen_write`` the values written."""
    _like(bsym.output, bsym.args[0])
    return True


def _as_created(bsym, tensors, outs) -> bool:
    """Row-major, as created, without a fake run: a collective's result (a fake run would need a process group) and
    results whose sizes the values decide (no fake run can make them)."""
    return True


def _as_clone_of_input(bsym, tensors, outs) -> bool:
    """Out-of-place ``index_put`` writes into aten's ``clone(a)`` (preserve format): ``a``'s strides where ``a`` is
    dense (row-major included), offset 0.  Not dense, or symbolic: the fake run (clone then picks a suggested
    format)."""
    a, o = bsym.args[0], bsym.output
    shape, strides = a._tt_shape, a._tt_strides
    if type(o) is not TensorProxy or not all(type(n) is int for n in (*shape, *strides)) or not dense_layout(shape, strides):
        return False
    o._tt_strides, o._tt_storage_offset, o._tt_rowmajor = tuple(strides), 0, tuple(strides) == contiguous_strides(shape)
    return True


def _column_major(bsym, tensors, outs) -> bool:
    """``nonzero``'s ``(n, ndim)`` positions are column-major in eager."""
    o = bsym.output
    o._tt_strides, o._tt_rowmajor, o._tt_storage_offset = (1, o._tt_shape[0]), False, 0
    return True


def _dim_outermost(bsym, tensors, outs) -> bool:
    """``unique(dim=d)``'s values: ``d`` outermost in memory (eager moves ``d`` first, then back), the others
    row-major."""
    values, dim = bsym.output[0], bsym.args[1]
    shape = values._tt_shape
    strides, step = [0] * len(shape), 1
    for i in reversed([i for i in range(len(shape)) if i != dim]):
        strides[i], step = step, step * shape[i]
    strides[dim] = step
    values._tt_strides, values._tt_rowmajor, values._tt_storage_offset = tuple(strides), dim == 0, 0
    return True


def _as_gradient_times_input(bsym, tensors, outs) -> bool:
    """``softplus_backward``, ``elu_backward``, ``logit_backward``, and GELU's gradient line (its kernel
    ``gelu_backward``, torch_impls.gelu_vjp, eager's too): the kernel lays its result out as TensorIterator
    does for (grad_output, input), as ``mul(grad_output, input)``; the first three's meta kernels take the operands the other
    way round (a channels_last input with a row-major gradient: meta says channels_last, the kernel and so eager's
    ``.grad`` are row-major)."""
    if len(tensors) != 2 or not _same_dtype_and_device(tensors):
        return False
    return _tensor_iterator_layout(torch.mul, (bsym.args[0], tensors[1] if tensors[0] is bsym.args[0] else tensors[0]), outs)


def _tensor_iterator_layout(fn, operands, outs) -> bool:
    """The single output laid out as ``fn`` (an elementwise op whose meta kernel is TensorIterator's rule) lays out its
    result for ``operands``, on meta tensors; False where that is not known."""
    if len(outs) != 1:
        return False
    o = outs[0]
    m = _on_meta(fn, operands, {})
    if m is None or tuple(m.shape) != tuple(size_value(s) for s in o._tt_shape):
        return False
    o._tt_strides, o._tt_storage_offset = tuple(m.stride()), 0
    o._tt_rowmajor = o._tt_strides == contiguous_strides(o._tt_shape)
    return True


def _binary_tensor_iterator(bsym, tensors, outs) -> bool:
    """``copysign``, ``floor_divide`` and ``xlogy``: one TensorIterator kernel over the operands on every device, whose
    meta kernels are torch's Python decompositions into several ops (``where`` of a sign, ...) that lay the result
    out otherwise for operands of different orders (a transposed tensor with a broadcast one: recorded (120, 24, 6,
    1), the CPU kernel's (120, 6, 30, 1)): the layout ``add`` gives the same operands (its meta kernel is
    TensorIterator's rule); a number operand takes no part in it."""
    if not 1 <= len(tensors) <= 2 or len({t._tt_device for t in tensors}) != 1:
        return False
    return _tensor_iterator_layout(torch.add, tuple(tensors) if len(tensors) == 2 else (tensors[0], 0), outs)


def _backward_of_row_major(bsym, tensors, outs) -> bool:
    """Group norm's (and off the CPU batch norm's) backward kernels on row-major operands (incoming gradient, input, weight,
    statistics): row-major gradients, as the kernels allocate the input's gradient in the input's memory format.
    The fake run it saves (autograd under the fake mode) costs 20-75 ms a call on a first call: with GELU's,
    ~0.15 s of wav2vec2's first call."""
    return _same_dtype_and_device(tensors) and all(t._tt_rowmajor for t in tensors)


def _batch_norm_format(bsym, tensors, outs) -> bool:
    """CPU batch norm and its backward line: the kernels lay the output and the input's gradient out in the input's
    suggested memory format, channels_last (channels_last_3d) for a 4-d (5-d) input laid out so, else row-major,
    whatever the input's strides; the meta kernel follows the input (BatchNorm1d after a transpose was recorded
    column-major where the kernel's output is row-major).  Decided for dense inputs without dimensions of size 1
    unless row-major (torch's choice for those follows a heuristic over sizes and strides: the fake run, as before);
    the weight's and bias's gradients are 1-d."""
    x = bsym.args[2] if bsym.sym.module == "vjp" else bsym.args[0]
    if not all(t._tt_device.type == "cpu" for t in tensors):
        return bsym.sym.module == "vjp" and _backward_of_row_major(bsym, tensors, outs)
    shape = tuple(x._tt_shape) if type(x) is TensorProxy else None
    if shape is None or not all(type(n) is int for n in shape) or not all(t._tt_dtype.is_float for t in tensors):
        return False  # (a wrong dtype: the fake run raises eager's error)
    strides = contiguous_strides(shape)
    if not x._tt_rowmajor:
        if 1 in shape or not all(type(st) is int for st in x._tt_strides) or not dense_layout(shape, x._tt_strides):
            return False
        fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(len(shape))
        laid = torch.empty(shape, memory_format=fmt, device="meta").stride() if fmt is not None else None
        if laid == tuple(x._tt_strides):  # (dense, no dimension of size 1: the channels_last strides themselves)
            strides = laid
    for o in outs:
        if same_shape(o._tt_shape, shape):
            o._tt_strides, o._tt_storage_offset = tuple(strides), 0
            o._tt_rowmajor = o._tt_strides == contiguous_strides(shape)
    return True


def _cpu_attention_on_meta(bsym, tensors, outs) -> bool:
    """A CPU attention's layouts from plain meta tensors, where eager's selector says which kernel runs:
    - its math kernel (DeepSeek-V3's value heads narrower than its query heads, a strided last dimension), and its
      backward line: a composite of batched matmuls and a softmax, laid out alike on every device, which the meta
      device's selector picks too;
    - its flash kernel (the forward line; the backward's kernels already run on meta, ``sdpa_vjp_kernels``): that
      kernel's own meta function (``_flash_output``), which lays the output out as the CPU kernel does.
    On a process's first such call ~1-3 ms a line against ~4-30 ms for the fake run (its cache misses run torch's
    Python decompositions).  Dropout, other kernels and other devices: the fake run."""
    from torch.nn.attention import SDPBackend

    from ..torchlang.attention import eager_backend
    from .saved_statistics import _SDPA_ARGS, _SDPA_DEFAULTS, _bind

    b = _bind(_SDPA_ARGS, _SDPA_DEFAULTS, bsym.args[2:] if bsym.sym.module == "vjp" else bsym.args, bsym.kwargs)
    if b is None or b["dropout_p"] != 0.0 or type(b["is_causal"]) is not bool or type(b["enable_gqa"]) is not bool \
            or not (b["scale"] is None or type(b["scale"]) is float):
        return False
    q, k, v, mask = b["query"], b["key"], b["value"], b["attn_mask"]
    if not all(type(t) is TensorProxy and t._tt_device.type == "cpu" for t in (q, k, v, *([mask] if mask is not None else []))):
        return False
    call = (q, k, v, mask, b["is_causal"], b["scale"], b["enable_gqa"])
    backend = eager_backend(*call)
    if backend == SDPBackend.MATH.value and eager_backend(*call, device="meta") == SDPBackend.MATH.value:
        _layout_by_run(bsym, on_meta=True)
        return True
    if backend == SDPBackend.FLASH_ATTENTION.value and bsym.sym.module == "ltorch" \
            and all(t._tt_dtype is q._tt_dtype for t in (k, v)):
        _layout_by_run(bsym, kernel=_flash_output)
        return True
    return False


def _flash_output(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The output of the CPU flash kernel eager's attention calls (a boolean mask converted as eager converts it):
    run on meta tensors for its layout only."""
    from .saved_statistics import _additive_mask

    return torch._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=_additive_mask(attn_mask, query.dtype), scale=scale)[0]


_flash_output.layout_on_meta = True


def _declare_layout_rules() -> None:
    from .. import prims
    from ..torchlang import activations, attention, elementwise, factories, foreach, linalg, nn, normalization, optim

    rules = {
        prims.copy_: _returns_destination, prims.grad_layout: _like_parameter,
        optim.adam_update: _like_overwritten_lists, optim.sgd_update: _like_overwritten_lists,
        optim.adagrad_update: _like_overwritten_lists,
        prims.all_gather: _as_created, prims.reduce_scatter: _as_created, prims.wait: _like_input,
        prims.unseen_write: _like_input,
        prims.matmul: _matmul_of_matrices, linalg.matmul: _matmul_of_matrices, nn.linear: _linear_of_row_major,
        **{like: _like_of_row_major for like in (factories.zeros_like, factories.ones_like, factories.empty_like,
                                                  factories.full_like, factories.rand_like, factories.randn_like)},
        **{op: _foreach_of_row_major for op in foreach.OUT_OF_PLACE},
        # sizes the values decide: no fake run can make them; the layouts are set by the prims (nonzero column-major)
        prims.nonzero: _column_major, prims.unique: _as_created, prims.unique_consecutive: _as_created, prims.unique_dim: _dim_outermost,
        prims.bincount: _as_created,
        activations.softplus_backward: _as_gradient_times_input, activations.elu_backward: _as_gradient_times_input,
        elementwise.logit_backward: _as_gradient_times_input,
        prims.repeat_index: _as_created,
        # a new tensor of the given sizes (the input gives only dtype and device): row-major, as created
        **{new: _as_created for new in (factories.new_zeros, factories.new_ones, factories.new_empty, factories.new_full)},
        prims.index_put: _as_clone_of_input,
        elementwise.copysign: _binary_tensor_iterator, prims.copysign: _binary_tensor_iterator,
        elementwise.floor_divide: _binary_tensor_iterator, prims.floor_divide: _binary_tensor_iterator,
        elementwise.xlogy: _binary_tensor_iterator,
    }
    for sym, rule in rules.items():
        sym.layout_rule = rule
    # the rules of ``<name>_vjp`` lines, declared on the op (``Symbol.vjp_layout_rule``)
    activations.gelu.vjp_layout_rule = _as_gradient_times_input
    normalization.group_norm.vjp_layout_rule = _backward_of_row_major
    normalization.batch_norm.layout_rule = _batch_norm_format
    normalization.batch_norm.vjp_layout_rule = _batch_norm_format
    attention.scaled_dot_product_attention.layout_rule = _cpu_attention_on_meta
    attention.scaled_dot_product_attention.vjp_layout_rule = _cpu_attention_on_meta


_declare_layout_rules()


def set_layout(bsym) -> None:
    outs = [o for o in bsym.flat_outputs() if type(o) is TensorProxy]
    if not outs:
        return
    flat_in = bsym.flat_args()
    tensors = [x for x in flat_in if type(x) is TensorProxy]
    rule = bsym.sym.layout_rule
    if rule is None and bsym.sym.module == "vjp":
        rule = bsym.sym.forward_symbol.vjp_layout_rule
    if rule is not None and getattr(bsym.torch_fn, "kernel_of", None) is bsym.sym:
        # The call runs another of the op's kernels, the one eager picks by its arguments' requires_grad
        # (``Symbol.kernel_by_requires_grad``: attention's math kernel for a mask requiring grad, which its selector
        # asked without grad would not pick): the op's rule is not that kernel's; its run gives the layout.
        rule = None
    if rule is not None and tensors and rule(bsym, tensors, outs):
        return
    if not tensors:
        return  # factories: row-major, as created
    if all(len(o._tt_shape) == 0 for o in outs):
        return  # 0-d results have no strides
    if "elementwise" in bsym.sym.tags and all(t._tt_rowmajor and same_shape(t._tt_shape, outs[0]._tt_shape) for t in tensors) \
            and all(same_shape(o._tt_shape, outs[0]._tt_shape) for o in outs):
        return  # elementwise on row-major inputs of the output's shape: row-major, as created
    ins = {id(x) for x in flat_in}
    if all(id(o) in ins for o in outs):
        return
    _layout_by_run(bsym)


def _layout_by_run(bsym, on_meta=False, kernel=None) -> None:
    """The layouts of running what the torch executor runs for ``bsym`` (or ``kernel``, given its arguments, where a
    rule knows the kernel eager picks): on plain meta tensors where its layout is the same on every device (the op's
    tags, its callable's ``layout_on_meta``, or ``on_meta``), else on fake tensors of the inputs' devices; cached by
    the call's layout-relevant arguments."""
    flat_in = bsym.flat_args()
    ins, tensors = {id(x) for x in flat_in}, [x for x in flat_in if type(x) is TensorProxy]
    c = _callable(bsym) if kernel is None else (kernel, bsym.args, bsym.kwargs)
    if c is None:
        return
    fn, args, kwargs = c
    if bsym.sym.name == "getitem" and len(args) > 1:
        args = (args[0], *tree_map(_as_int_index, tuple(args[1:])))
    key = _key(fn, args, kwargs)
    layouts = _layouts.get(key) if key is not None else None
    if layouts is None:
        # A view's or reshape's strides do not depend on the device (one kernel computes them for all): plain
        # meta tensors, ~1 µs a call against ~80 µs in the fake mode, which the other ops need (a CPU
        # convolution keeps channels_last).
        tags = bsym.sym.tags
        # Elementwise ops and reductions take their layout from TensorIterator, whose rule is the same for every
        # device (the meta kernel runs it): plain meta tensors too when the inputs share one device (mixing devices
        # is an error or a CPU scalar the fake run must judge).  A retrace with symbolic sizes (issue 26) misses
        # the cache on every line, and its many broadcasting ``mul``s cost ~0.5 ms each in the fake mode.
        meta = on_meta or getattr(fn, "layout_on_meta", False) or "view" in tags or "shape_only" in tags or (
            ("elementwise" in tags or "reduction" in tags or "layout_on_meta" in tags)
            and len({t._tt_device for t in tensors}) == 1)
        mout = _on_meta(fn, args, kwargs) if meta else None
        if mout is None:
            try:
                with torch._C.DisableTorchFunction(), torch.no_grad(), _mode(), generators_untouched():
                    margs, mkwargs = tree_map(_to_fake, (tuple(args), dict(kwargs)))
                    mout = fn(*margs, **mkwargs)
            except Exception:  # noqa: BLE001 - fake tensors lack some kernels, and word errors differently
                mout = _on_meta(fn, args, kwargs)
                if mout is None:
                    return
        with torch._C.DisableTorchFunction():  # fake results must not reach the tracer (it would capture them)
            layouts = [(tuple(m.shape), tuple(m.stride()), m.storage_offset()) if isinstance(m, torch.Tensor) else None
                       for m in tree_flatten(mout)[0]]
        if key is not None:
            _layouts[key] = layouts
    for p, (shape, strides, offset) in _paired(bsym.flat_outputs(), layouts):
        if type(p) is TensorProxy and id(p) not in ins and shape == tuple(size_value(s) for s in p._tt_shape):
            p._tt_strides = strides
            p._tt_storage_offset = offset
            p._tt_rowmajor = offset == 0 and strides == contiguous_strides(p._tt_shape)


def _paired(outs, layouts) -> list:
    """(output proxy, layout of the run's result) pairs: by position where the line's outputs and the run's results
    have the same leaves (a result that is an input is None in the line, ``broadcast_tensors(x, b)``'s ``_``: the
    others keep their places), else the tensors in order where they are as many; else none."""
    if len(outs) == len(layouts):
        return [(p, lay) for p, lay in zip(outs, layouts) if isinstance(p, torch.Tensor) and lay is not None]
    tensors, found = [o for o in outs if isinstance(o, torch.Tensor)], [lay for lay in layouts if lay is not None]
    return list(zip(tensors, found)) if len(tensors) == len(found) else []


def _as_int_index(x):
    """An index of ``getitem`` for the layout question: a 0-d integer tensor indexes as an int does (eager's ``w[e]``
    is a view of ``w``: Mixtral's ``expert_mask[e]`` of a permuted mask keeps its strides), where a meta or fake run
    would take it as advanced indexing (a copy, row-major); its position is a value of the call, so the offset is
    the first element's."""
    if type(x) is TensorProxy and len(x._tt_shape) == 0 and x._tt_dtype.is_int:
        return 0
    return x


# The layouts found for a call, by what the fake run saw: the callable, every tensor's shape, strides, offset,
# dtype and device, every other argument (by type and value).  The same op on inputs laid out alike (every
# layer of a model, a retrace) is not run again.  A call whose arguments are not all hashable is not cached.
_layouts: dict = {}
_MAX_LAYOUTS = 100_000


_PLAIN = (int, float, bool, complex, str, type(None), type(Ellipsis), torch.dtype, torch.device, torch.memory_format,
          torch.layout)  # values, not objects the cache would keep alive


class _Uncached(Exception):
    pass


def _leaf_key(x):
    if type(x) is TensorProxy:
        # Plain ints: hashing a symbolic size would record a check and specialise a dynamic=True program.
        return (tuple(size_value(s) for s in x._tt_shape), tuple(size_value(s) for s in x._tt_strides),
                size_value(x._tt_storage_offset), x._tt_dtype, x._tt_device)
    if isinstance(x, NumberProxy):
        return (NumberProxy, x.python_type, repr(x.value))
    if type(x) in _PLAIN:
        return (type(x), x)
    raise _Uncached


def _key(fn, args, kwargs):
    if len(_layouts) >= _MAX_LAYOUTS:
        return None
    leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
    try:
        key = (fn, repr(spec), tuple(_leaf_key(x) for x in leaves))
        hash(key)
    except (_Uncached, TypeError):
        return None
    return key


symbols.layout_hook = set_layout
