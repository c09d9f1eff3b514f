"""Optimizer updates as single symbols, run by torch's fused optimizer kernels.

Eager ``torch.optim.AdamW`` on CPU runs its default for-loop implementation: about ten
kernels per parameter (``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, ``div``, ``add_``,
``addcdiv_`` ...), each a full pass over the tensor.  For a 5 M-parameter GPT that is
18 ms a step; torch's fused kernel (``torch._fused_adamw_``) does the same arithmetic in
one pass for all parameters in about 3 ms.  So, while tracing, the update of a known
optimizer becomes one symbol per parameter group:

* ``torch._fused_adam_``/``_fused_adamw_``/``_fused_sgd_``/``_fused_adagrad_`` (what
  ``fused=True`` optimizers call) are in-place torch symbols; the tracer records their
  functional forms ``adam_update``/``sgd_update``/``adagrad_update``, whose decompositions below are the update formulas
  (``decompose=True`` and fusion executors use them).  The torch executor runs the fused
  kernel on copies, and re-inplacing (``executors/reinplace.py``) runs it directly on the
  parameters and state when nothing else reads their old values, dropping the copies.
* ``optimizers_while_tracing()`` routes the default and ``foreach`` implementations of
  Adam, AdamW, SGD and (on CPU) Adagrad to torch's own fused path (``torch.optim.adam._fused_adam``) while
  tracing, when that path computes the same thing for these tensors (float32/float64,
  no GradScaler, no capturable or differentiable mode, state on the parameters' device).
  ``tt.compile(..., optimizer_kernels="traced")`` keeps the optimizer's own per-op code.

The fused kernels compute the same formulas as the per-op code; results agree to float32
rounding (bitwise on the tests' tensors).
"""
from __future__ import annotations

import contextlib
import sys
import threading

import torch

from .. import clang, dtypes, prims, symbols
from ..proxies import NumberProxy, TensorProxy
from . import elementwise as ew
from .registry import torchsymbol


def _alike(i, lists) -> bool:
    p = lists[0][i]
    if p.is_contiguous():
        return all(ts[i].is_contiguous() for ts in lists[1:] if i < len(ts))
    from ..dense import is_non_overlapping_and_dense

    st = p.stride()
    return is_non_overlapping_and_dense(p) and all(ts[i].stride() == st for ts in lists[1:] if i < len(ts))


def unlike_layouts(lists) -> tuple:
    """Indices of the parameters whose tensors in ``lists`` (parameters first, then gradients and state) do not
    share one dense layout.  Torch's fused kernels walk each parameter's tensors as flat arrays of memory."""
    return tuple(i for i in range(len(lists[0])) if not _alike(i, lists))


# Set while a per-op optimizer implementation is routed to torch's fused path (``_routed``): its tensors of unlike
# layouts are then ours to lay out (``torch_impls._fused`` runs them on row-major copies).  Per thread: two threads
# may trace at once.
_ROUTING = threading.local()


def _refuse_unlike_layouts(kernel, lists, names):
    """A user's ``fused=True`` kernel on a parameter whose gradient or state is laid out differently (``p.data``
    replaced by a transposed or sliced tensor after the state was made): eager's kernel pairs their elements by
    memory order, an update no formula describes.  Refuse it rather than compute something else than eager."""
    if getattr(_ROUTING, "on", False) or not lists[0]:
        return
    if not all(type(t) is TensorProxy and all(type(n) is int for n in (*t._tt_shape, *t._tt_strides))
               for ts in lists for t in ts):
        return
    odd = unlike_layouts(lists)
    if odd:
        i = odd[0]
        layouts = ", ".join(f"{n} {tuple(ts[i].stride())}" for n, ts in zip(names, lists) if i < len(ts))
        raise NotImplementedError(
            f"{kernel.__name__} (an optimizer with fused=True): parameter {i} of its group (shape "
            f"{tuple(lists[0][i].shape)}) and its gradient and state do not share one dense layout (strides: "
            f"{layouts}). Torch's fused kernel walks them as flat arrays of memory, so eager would pair unrelated "
            "elements and compute a wrong update. Give the parameter its state's layout (e.g. assign "
            "`p.data = new.contiguous()` instead of a transposed or sliced tensor), or use fused=False.")


def _lists(*lists):
    return [list(x) for x in lists]


def _writes(targets, new_values) -> list:
    """``(destination, new value)`` pairs: each list of targets with its list of new values."""
    return [(dst, value) for dsts, values in zip(targets, new_values) for dst, value in zip(dsts, values)]


def _inplace_kernel(kernel, new_values):
    """``torch._fused_*_`` as an in-place torch symbol.  While tracing only ``new_values`` runs
    (``functionalize``: the result and the writes); run on real tensors (a printed trace), its
    decomposition writes the new values back with ``prims.copy_``."""

    def inplace(*args, **kwargs):
        _, writes = new_values(*args, **kwargs)
        for dst, value in writes:
            prims.copy_(value, dst)

    inplace.__name__ = kernel.__name__
    sym = torchsymbol(kernel, name=kernel.__name__, tags=("inplace",))(inplace)
    sym.functionalize = new_values
    return sym


# ---------------------------------------------------------------------------
# Adam / AdamW
# ---------------------------------------------------------------------------
# The update symbols are recorded only for optimizer steps under no_grad (differentiable and capturable optimizers are
# not routed here; torch refuses fused=True with differentiable=True): they carry no gradient.  Tagged so, the
# gradient path (asked at each write into the optimizer's state) does not expand their per-parameter decomposition.
@torchsymbol(name="adam_update", tags=("non_differentiable",))  # torch kernel: executors/torch_executor.py
def adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                weight_decay, eps, amsgrad, maximize, decoupled_weight_decay):
    """New (params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs) after one Adam (or AdamW) step.

    ``state_steps`` are the already incremented step counts, as torch's fused kernels take them.
    """
    new_p, new_m, new_v, new_vmax = [], [], [], []
    for i, (p, g, m, v, step) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, state_steps)):
        dtype = p._tt_dtype
        if maximize:
            g = ew.neg(g)
        if decoupled_weight_decay:
            p = ew.mul(p, 1 - lr * weight_decay)
        else:
            g = ew.add(g, p, alpha=weight_decay)
        m = ew.lerp(m, g, 1 - beta1)
        v = ew.addcmul(ew.mul(v, beta2), g, g, value=1 - beta2)
        step = clang.maybe_convert(step, dtypes.float64)  # bias corrections in double, as the kernels compute them
        bias_correction1 = ew.rsub(ew.rpow(step, beta1), 1)
        bias_correction2_sqrt = ew.sqrt(ew.rsub(ew.rpow(step, beta2), 1))
        second = v
        if amsgrad:
            second = ew.maximum(max_exp_avg_sqs[i], v)
            new_vmax.append(second)
        denom = ew.add(ew.div(ew.sqrt(second), bias_correction2_sqrt), eps)
        step_size = ew.rtruediv(bias_correction1, lr)  # lr / bias_correction1
        # In the parameter's dtype, as the kernel writes it: a 0-d parameter (a CLIP temperature) would otherwise
        # promote with the double bias corrections and read back as float64 for the rest of the step.
        new_p.append(clang.maybe_convert(ew.sub(p, ew.mul(step_size, ew.div(m, denom))), dtype))
        new_m.append(m)
        new_v.append(v)
    return new_p, new_m, new_v, new_vmax


def _updated_like(lists, read=()):
    """New values laid out like each tensor of ``lists`` (a multi-tensor update's results), made without tracing the
    update (``Symbol.results_without_decomposition``); None where a list holds something else or the lists mix
    dtypes, devices or lengths (the decomposition's type promotion decides then).  ``read``: lists only checked."""
    every = [*lists, *read]
    flat = [t for ts in every for t in ts]
    if not flat or any(type(t) is not TensorProxy for t in flat) or len({len(ts) for ts in every}) != 1:
        return None
    dtype, device = flat[0]._tt_dtype, flat[0]._tt_device
    if any(t._tt_dtype is not dtype or t._tt_device != device for t in flat):
        return None
    return [[TensorProxy(shape=t._tt_shape, dtype=dtype, device=device) for t in ts] for ts in lists]


def _adam_results(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, amsgrad, **_):
    made = _updated_like([params, exp_avgs, exp_avg_sqs] + ([max_exp_avg_sqs] if amsgrad else []), [grads])
    return None if made is None else tuple(made) if amsgrad else (*made, [])


adam_update.results_without_decomposition = _adam_results


def _fused_adam(decoupled):
    kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_

    def new_values(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
                   weight_decay, eps, amsgrad, maximize, grad_scale=None, found_inf=None):
        _no_grad_scaler(kernel, grad_scale, found_inf)
        params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = _lists(
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
        _refuse_unlike_layouts(kernel, (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs),
                               ("param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))
        new = adam_update(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr=lr, beta1=beta1,
                          beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad, maximize=maximize,
                          decoupled_weight_decay=decoupled)
        return None, _writes((params, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else []), new)

    return _inplace_kernel(kernel, new_values)


fused_adam_ = _fused_adam(decoupled=False)
fused_adamw_ = _fused_adam(decoupled=True)


# ---------------------------------------------------------------------------
# SGD
# ---------------------------------------------------------------------------
@torchsymbol(name="sgd_update", tags=("non_differentiable",))  # torch kernel: executors/torch_executor.py
def sgd_update(params, grads, momentum_buffers, *, weight_decay, momentum, lr, dampening, nesterov, maximize, is_first_step):
    """New (params, momentum_buffers) after one SGD step; no momentum when ``momentum_buffers`` is empty."""
    new_p, new_buf = [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        if maximize:
            g = ew.neg(g)
        g = ew.add(g, p, alpha=weight_decay)
        if momentum_buffers:
            # The first buffer is a copy of the gradient (which may live on as ``.grad``), as in eager.
            buf = prims.clone(g) if is_first_step else ew.add(ew.mul(momentum_buffers[i], momentum), g, alpha=1 - dampening)
            new_buf.append(buf)
            g = ew.add(g, buf, alpha=momentum) if nesterov else buf
        new_p.append(ew.add(p, g, alpha=-lr))
    return new_p, new_buf


def _sgd_results(params, grads, momentum_buffers, **_):
    made = _updated_like([params] + ([momentum_buffers] if momentum_buffers else []), [grads])
    return None if made is None else tuple(made) if momentum_buffers else (*made, [])


sgd_update.results_without_decomposition = _sgd_results


def _sgd_new_values(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr, dampening, nesterov, maximize,
                    is_first_step, grad_scale=None, found_inf=None):
    _no_grad_scaler(torch._fused_sgd_, grad_scale, found_inf)
    params, grads, bufs = _lists(params, grads, momentum_buffer_list)
    _refuse_unlike_layouts(torch._fused_sgd_, (params, grads, bufs), ("param", "grad", "momentum_buffer"))
    new = sgd_update(params, grads, bufs, weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                     nesterov=nesterov, maximize=maximize, is_first_step=is_first_step)
    return None, _writes((params, bufs), new)


fused_sgd_ = _inplace_kernel(torch._fused_sgd_, _sgd_new_values)


# ---------------------------------------------------------------------------
# Adagrad (torch has the fused kernel on CPU)
# ---------------------------------------------------------------------------
@torchsymbol(name="adagrad_update", tags=("non_differentiable",))  # torch kernel: executors/torch_executor.py
def adagrad_update(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize):
    """New (params, state_sums) after one Adagrad step; ``state_steps`` already incremented."""
    new_p, new_sum = [], []
    for p, g, acc, step in zip(params, grads, state_sums, state_steps):
        dtype = p._tt_dtype
        if maximize:
            g = ew.neg(g)
        g = ew.add(g, p, alpha=weight_decay)
        step = clang.maybe_convert(step, dtypes.float64)
        clr = ew.rtruediv(ew.add(ew.mul(ew.sub(step, 1), lr_decay), 1), lr)  # lr / (1 + (step - 1) * lr_decay)
        acc = ew.addcmul(acc, g, g)
        new_p.append(clang.maybe_convert(ew.sub(p, ew.mul(clr, ew.div(g, ew.add(ew.sqrt(acc), eps)))), dtype))  # as adam's
        new_sum.append(acc)
    return new_p, new_sum


def _adagrad_results(params, grads, state_sums, state_steps, **_):
    made = _updated_like([params, state_sums], [grads])
    return None if made is None else tuple(made)


adagrad_update.results_without_decomposition = _adagrad_results


def _adagrad_new_values(params, grads, state_sums, state_steps, *, lr, lr_decay, weight_decay, eps, maximize,
                        grad_scale=None, found_inf=None):
    _no_grad_scaler(torch._fused_adagrad_, grad_scale, found_inf)
    params, grads, sums, steps = _lists(params, grads, state_sums, state_steps)
    _refuse_unlike_layouts(torch._fused_adagrad_, (params, grads, sums), ("param", "grad", "sum"))
    new = adagrad_update(params, grads, sums, steps, lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                         maximize=maximize)
    return None, _writes((params, sums), new)


fused_adagrad_ = _inplace_kernel(torch._fused_adagrad_, _adagrad_new_values)


def _no_grad_scaler(kernel, grad_scale, found_inf):
    if grad_scale is not None or found_inf is not None:
        raise NotImplementedError(
            f"{kernel.__name__} with a GradScaler (grad_scale/found_inf) is not supported inside a compiled step; "
            "unscale outside the compiled function, or use an optimizer without fused=True"
        )


# ---------------------------------------------------------------------------
# Routing the optimizers' default implementations to the fused path while tracing
# ---------------------------------------------------------------------------
_FLOATS = (dtypes.float32, dtypes.float64)


def _same_device_floats(tensors, devices_of) -> bool:
    """Every tensor a proxy of one float32/float64 dtype on one cpu or cuda device, ``devices_of`` (step counts)
    there too.  (State left in float32 by ``model.to(torch.float64)`` runs the per-op path, as eager's foreach.)"""
    if not tensors or not all(type(t) is TensorProxy for t in tensors):
        return False
    device, dtype = tensors[0]._tt_device, tensors[0]._tt_dtype
    if device.type not in ("cpu", "cuda") or dtype not in _FLOATS:
        return False
    if not all(t._tt_device == device and t._tt_dtype is dtype for t in tensors):
        return False
    return all(type(s) is TensorProxy and s._tt_device == device and s._tt_dtype in _FLOATS for s in devices_of)


def _adam_fits(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, grad_scale, found_inf, *,
               lr, beta1, beta2, capturable=False, differentiable=False, has_complex=False, **_):
    if grad_scale is not None or found_inf is not None or capturable or differentiable or has_complex:
        return False
    if any(isinstance(h, torch.Tensor) for h in (lr, beta1, beta2)):
        return False
    return _same_device_floats([*params, *grads, *exp_avgs, *exp_avg_sqs, *max_exp_avg_sqs], state_steps)


def _sgd_fits(params, grads, momentum_buffer_list, grad_scale, found_inf, *, lr, has_sparse_grad=False, **_):
    if grad_scale is not None or found_inf is not None or has_sparse_grad or isinstance(lr, torch.Tensor):
        return False
    bufs = list(momentum_buffer_list)
    if any(b is None for b in bufs) and not all(b is None for b in bufs):
        return False  # the fused path creates buffers for all parameters or none
    return _same_device_floats([*params, *grads, *(b for b in bufs if b is not None)], ())


def _adagrad_fits(params, grads, state_sums, state_steps, grad_scale, found_inf, *, lr, has_sparse_grad=False,
                  differentiable=False, has_complex=False, **_):
    if grad_scale is not None or found_inf is not None or has_sparse_grad or differentiable or has_complex:
        return False
    if isinstance(lr, torch.Tensor) or not params or type(params[0]) is not TensorProxy or params[0]._tt_device.type != "cpu":
        return False  # torch's fused Adagrad runs on the CPU only
    return _same_device_floats([*params, *grads, *state_sums], state_steps)


# Each parameter's update reads that parameter's gradient and state alone (torch's multi-tensor kernels update
# each tensor on its own): a whole step may update a parameter as soon as its gradient is final
# (transforms/early_updates.py).
adam_update.splits_by_index = sgd_update.splits_by_index = adagrad_update.splits_by_index = True


def _routes():
    """(module, names of its per-op implementations, its fused implementation, fits) for each optimizer."""
    from torch.optim import adagrad, adam, sgd

    routes = []
    for module, names, fused, fits in ((adam, ("_single_tensor_adam", "_multi_tensor_adam"), "_fused_adam", _adam_fits),
                                       (sgd, ("_single_tensor_sgd", "_multi_tensor_sgd"), "_fused_sgd", _sgd_fits),
                                       (adagrad, ("_single_tensor_adagrad", "_multi_tensor_adagrad"), "_fused_adagrad",
                                        _adagrad_fits)):
        if hasattr(module, fused) and all(hasattr(module, n) for n in names):
            routes.append((module, names, getattr(module, fused), fits))
    return routes


def _routed(original, fused, fits):
    def route(*args, **kwargs):
        if fits(*args, **kwargs):
            outer, _ROUTING.on = getattr(_ROUTING, "on", False), True
            try:
                return fused(*args, **kwargs)
            finally:
                _ROUTING.on = outer
        return original(*args, **kwargs)

    route.__wrapped__ = original
    return route


_CHECKED_WHEN_THE_PROGRAM_RUNS = (
    ". (thunder_train: checked when the compiled program runs, after the step's Python code was traced, so a "
    "try/except around clip_grad_norm_ inside the compiled function does not catch it; the call changed nothing. "
    "To skip such a step inside, pass error_if_nonfinite=False and test torch.isfinite(total_norm); or catch the "
    "error around the compiled call.)")


def _total_norm_checked_at_run_time(original):
    """``clip_grad_norm_(..., error_if_nonfinite=True)`` decides on the norm's value: compute the norm
    without the decision and record it as a check the program runs (``prims.check_finite``)."""

    def total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        norm = original(tensors, norm_type, False, foreach)
        if error_if_nonfinite:
            message = (f"The total norm of order {float(norm_type)} for gradients from `parameters` is non-finite, so it "
                       "cannot be clipped. To disable this error and scale the gradients by the non-finite norm anyway, "
                       "set `error_if_nonfinite=False`")
            # On proxies a line of the program; on real tensors (read from a global) checked right away.
            if type(norm) is TensorProxy:
                # Eager raises inside the user's code; the program raises when it runs, after the traced code.
                prims.check_finite(norm, message + _CHECKED_WHEN_THE_PROGRAM_RUNS)
            else:
                symbols.run_eagerly(prims.check_finite, norm, message)
        return norm

    total_norm.__wrapped__ = original
    return total_norm


def _on_runtime_numbers(builtin, method):
    """``max``/``min`` for an optimizer's module while tracing: on a runtime number (``step_t.item()``, a norm's
    ``.item()``) the program's own maximum/minimum line (``NumberProxy.__sym_max__``), where the builtin would ask
    which is larger, a value no trace has; anything else goes to the builtin."""

    def pick(*args, **kwargs):
        if len(args) == 2 and not kwargs and any(isinstance(a, NumberProxy) for a in args):
            a, b = args if isinstance(args[0], NumberProxy) else args[::-1]
            return getattr(a, method)(b)
        return builtin(*args, **kwargs)

    pick.__wrapped__ = builtin
    return pick


# Optimizers whose step computes its scalars in Python from ``.item()`` values, choosing with ``max``/``min``
# (``torch.optim.Adafactor``: its step size and update clipping): the program computes them on every call.
_NUMBER_CHOOSING = ("torch.optim._adafactor",)
_ABSENT = object()


@contextlib.contextmanager
def optimizers_while_tracing(fused_kernels: bool = True):
    """How ``torch.optim`` (and ``clip_grad_norm_``) run on proxies.

    * Its default implementation is chosen as in eager: ``foreach`` for CUDA tensors (torch asks
      ``type(p) in _foreach_supported_types``, which a proxy would fail), the for-loop on CPU.
    * ``fused_kernels``: Adam/AdamW/SGD/Adagrad updates take torch's fused path where it computes the same thing.
    * ``clip_grad_norm_(error_if_nonfinite=True)`` checks the norm when the program runs.
    * ``max``/``min`` in ``_NUMBER_CHOOSING``'s modules work on runtime numbers (Adafactor).
    """
    from torch.nn.utils import clip_grad
    from torch.optim import optimizer

    saved = []
    supported = getattr(optimizer, "_foreach_supported_types", None)
    added = isinstance(supported, list) and TensorProxy not in supported
    try:
        if added:
            supported.append(TensorProxy)
        for module, names, fused, fits in _routes() if fused_kernels else ():
            for name in names:
                original = getattr(module, name)
                saved.append((module, name, original))
                setattr(module, name, _routed(original, fused, fits))
        for name in _NUMBER_CHOOSING:
            module = sys.modules.get(name)
            if module is not None:
                for fn, method in ((max, "__sym_max__"), (min, "__sym_min__")):
                    saved.append((module, fn.__name__, module.__dict__.get(fn.__name__, _ABSENT)))
                    setattr(module, fn.__name__, _on_runtime_numbers(fn, method))
        if hasattr(clip_grad, "_get_total_norm"):
            saved.append((clip_grad, "_get_total_norm", clip_grad._get_total_norm))
            clip_grad._get_total_norm = _total_norm_checked_at_run_time(clip_grad._get_total_norm)
        yield
    finally:
        for module, name, original in reversed(saved):
            if original is _ABSENT:  # (a builtin the module did not shadow)
                delattr(module, name)
            else:
                setattr(module, name, original)
        if added:
            supported.remove(TensorProxy)
