"""torch.nn.functional losses: mse, l1, smooth L1, Huber, binary cross-entropy (with logits), KL divergence,
NLL and cross-entropy; the margin, ranking, embedding, Poisson and triplet losses written as torch calls
(sharing ``reduce_loss``).  Cross-entropy's direct gradient rule follows its definition."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import clang, prims
from ..proxies import TensorProxy, as_divisor
from ..clang import downcast_like, is_tensor, upcast
from ..grad_rules import register_vjp
from ..prims.core import is_float as _float, sum_to
from .autocast import BANNED, FP32  # autocast policies: see autocast.py
from .activations import _softplus
from .distances import pairwise_distance
from .elementwise import xlogy
from .helpers import upcast_and_dtype
from ..opaque import meta_rule
from .registry import composed, torchsymbol


def _reduce(loss, reduction, weight_sum=None):
    if reduction == "none":
        return loss
    if reduction == "sum":
        return clang.sum(loss)
    if reduction == "mean":
        if weight_sum is not None:
            return clang.true_divide(clang.sum(loss), weight_sum)
        return clang.mean(loss)
    raise ValueError(f"{reduction} is not a valid value for reduction")


@torchsymbol(F.mse_loss, autocast={"cpu": FP32, "cuda": FP32})
def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    d = clang.sub(input, target)
    return _reduce(clang.mul(d, d), reduction)


@torchsymbol(F.l1_loss, autocast={"cpu": FP32, "cuda": FP32})
def l1_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return _reduce(clang.elementwise_unary(prims.abs, clang.sub(input, target)), reduction)


@torchsymbol(F.smooth_l1_loss, autocast={"cpu": FP32, "cuda": FP32})
def smooth_l1_loss(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0):
    d = clang.elementwise_unary(prims.abs, clang.sub(input, target))
    if beta == 0:
        return _reduce(d, reduction)
    quad = clang.true_divide(clang.mul(clang.mul(d, d), 0.5), beta)
    return _reduce(clang.where(clang.lt(d, beta), quad, clang.sub(d, 0.5 * beta)), reduction)


def _piecewise_loss_vjp(slope):
    """The rule of a loss that is piecewise in ``x = input - target``, with eager's backward kernel's cases:
    ``slope(x, g)`` is the gradient of ``input`` per element (``target`` gets its negative), so an infinite
    difference on a linear piece gets a finite gradient (differentiating the decomposition's ``where`` gives NaN)."""

    def rule(g, out, /, input, target, *args, reduction="mean", **kwargs):
        x = clang.sub(upcast(input), upcast(target))
        gu = upcast(g)
        if reduction != "none":
            gu = prims.broadcast_in_dim(gu, x._tt_shape, ())
            if reduction == "mean":
                gu = prims.div(gu, as_divisor(max(x.numel_(), 1)))
        gi = slope(x, gu, *args, **kwargs)
        grads = {}
        if _float(input):
            grads["input"] = downcast_like(sum_to(gi, input._tt_shape), input)
        if _float(target):
            grads["target"] = downcast_like(sum_to(prims.neg(gi), target._tt_shape), target)
        return grads

    return rule


def _smooth_l1_slope(x, g, size_average=None, reduce=None, beta=1.0):
    # smooth_l1_backward: -g where x <= -beta, g where x >= beta, else g * x / beta
    inner = prims.div(prims.mul(x, g), beta)
    return prims.where(prims.le(x, -beta), prims.neg(g), prims.where(prims.ge(x, beta), g, inner))


def _huber_slope(x, g, delta=1.0, weight=None):
    # huber_backward: -g * delta where x <= -delta, g * delta where x >= delta, else x * g
    return prims.where(prims.le(x, -delta), prims.neg(prims.mul(g, delta)),
                       prims.where(prims.ge(x, delta), prims.mul(g, delta), prims.mul(x, g)))


def _no_legacy_reduction(input, target, size_average=None, reduce=None, reduction="mean", beta=1.0, **_):
    return size_average is None and reduce is None and beta != 0 and reduction in ("none", "mean", "sum")


def _unweighted(input, target, reduction="mean", delta=1.0, weight=None):
    return weight is None and reduction in ("none", "mean", "sum")


register_vjp(smooth_l1_loss, supports=_no_legacy_reduction)(_piecewise_loss_vjp(_smooth_l1_slope))


@torchsymbol(F.binary_cross_entropy_with_logits, tags=("fallible",), autocast={"cpu": FP32, "cuda": FP32})
def binary_cross_entropy_with_logits(input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None):
    x, dt = upcast_and_dtype(input)
    t = clang.maybe_convert(target, x._tt_dtype)
    # loss = (1 - t) * x + (1 + (pw - 1) * t) * softplus(-x), in a stable form.
    log_sig_neg = _softplus(prims.neg(x), 1.0, 20.0)
    if pos_weight is not None:
        lw = clang.add(clang.mul(clang.sub(clang.maybe_convert(pos_weight, x._tt_dtype), 1), t), 1)
        loss = clang.add(clang.mul(clang.sub(1, t), x), clang.mul(lw, log_sig_neg))
    else:
        loss = clang.add(clang.mul(clang.sub(1, t), x), log_sig_neg)
    if weight is not None:
        loss = clang.mul(loss, weight)
    return clang.maybe_convert(_reduce(loss, reduction), dt)


def _plain_reduction(input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None):
    return size_average is None and reduce is None and reduction in ("none", "mean", "sum")


@register_vjp(binary_cross_entropy_with_logits, supports=_plain_reduction)
def _bce_with_logits_vjp(g, out, /, input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None):
    """As eager (``binary_cross_entropy_with_logits_backward``): ``input`` gets ``g (sigmoid(x) - t)`` (with
    ``pos_weight``: ``g ((pw t + 1 - t) sigmoid(x) - pw t)``), finite at ±inf where the decomposition's is NaN;
    ``target`` gets ``-g x`` (``g (log_sigmoid(-x) - pw log_sigmoid(x))``)."""
    x = upcast(input)
    t = clang.maybe_convert(target, x._tt_dtype)
    gu = upcast(g)
    shape = clang.broadcast_shapes(x._tt_shape, t._tt_shape if type(t) is TensorProxy else ())
    if reduction != "none":
        gu = prims.broadcast_in_dim(gu, shape, ())
    s = prims.sigmoid(x)
    if pos_weight is not None:
        pt = clang.mul(clang.maybe_convert(pos_weight, x._tt_dtype), t)
        d_input = clang.sub(clang.mul(clang.sub(clang.add(pt, 1.0), t), s), pt)
        log_sig = lambda v: prims.neg(_softplus(prims.neg(v), 1.0, 20.0))  # noqa: E731
        d_target = clang.sub(log_sig(prims.neg(x)), clang.mul(log_sig(x), clang.maybe_convert(pos_weight, x._tt_dtype)))
    else:
        d_input, d_target = clang.sub(s, t), prims.neg(x)
    def scaled(d):  # in eager's order: d * g, times weight, divided by the element count for "mean"
        d = clang.mul(d, gu)
        if weight is not None:
            d = clang.mul(d, clang.maybe_convert(weight, x._tt_dtype))
        return prims.div(d, as_divisor(max(math.prod(shape), 1))) if reduction == "mean" else d

    grads = {}
    if _float(input):
        grads["input"] = downcast_like(sum_to(scaled(d_input), input._tt_shape), input)
    if _float(target):
        grads["target"] = downcast_like(sum_to(scaled(d_target), target._tt_shape), target)
    return grads


@torchsymbol(F.binary_cross_entropy, tags=("fallible",), autocast={"cpu": FP32, "cuda": BANNED})
def binary_cross_entropy(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """-(t log p + (1 - t) log(1 - p)), with logs clamped at -100 like eager."""
    x, dt = upcast_and_dtype(input)
    t = clang.maybe_convert(target, x._tt_dtype)
    log_p = clang.maximum(clang.log(x), -100.0)
    log_1mp = clang.maximum(clang.log(clang.sub(1, x)), -100.0)
    loss = clang.neg(clang.add(clang.mul(t, log_p), clang.mul(clang.sub(1, t), log_1mp)))
    if weight is not None:
        loss = clang.mul(loss, weight)
    return clang.maybe_convert(_reduce(loss, reduction), dt)


def _bce_plain_reduction(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    return size_average is None and reduce is None and reduction in ("none", "mean", "sum")


@register_vjp(binary_cross_entropy, supports=_bce_plain_reduction)
def _binary_cross_entropy_vjp(g, out, /, input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    """As eager's kernels: ``input`` gets ``g (x - t) / max(x (1 - x), 1e-12)`` (finite at 0 and 1, where the clamped
    logs' gradient is NaN), ``target`` gets ``-g logit(x)`` (infinite at 0 and 1, not the clamp's ±100)."""
    x = upcast(input)
    t = clang.maybe_convert(target, x._tt_dtype)
    gu = upcast(g)
    if reduction != "none":
        gu = prims.broadcast_in_dim(gu, x._tt_shape, ())
        if reduction == "mean":
            gu = prims.div(gu, as_divisor(max(x.numel_(), 1)))
    if weight is not None:
        gu = clang.mul(gu, clang.maybe_convert(weight, x._tt_dtype))
    grads = {}
    if _float(input):
        denom = prims.maximum(prims.mul(prims.sub(1.0, x), x), 1e-12)
        grads["input"] = downcast_like(prims.mul(prims.div(prims.sub(x, t), denom), gu), input)
    if _float(target):
        logit = prims.log(prims.div(x, prims.sub(1.0, x)))
        grads["target"] = downcast_like(sum_to(prims.mul(prims.neg(logit), gu), target._tt_shape), target)
    return grads


@torchsymbol(F.huber_loss, autocast={"cpu": FP32, "cuda": FP32})
def huber_loss(input, target, reduction="mean", delta=1.0, weight=None):
    """0.5 d² where |d| < delta, else delta (|d| - delta / 2)."""
    d = clang.elementwise_unary(prims.abs, clang.sub(input, target))
    quad = clang.mul(clang.mul(d, d), 0.5)
    lin = clang.mul(clang.sub(d, 0.5 * delta), delta)
    return _reduce(clang.where(clang.lt(d, delta), quad, lin), reduction)


register_vjp(huber_loss, supports=_unweighted)(_piecewise_loss_vjp(_huber_slope))


@torchsymbol(F.kl_div, autocast={"cpu": FP32, "cuda": FP32})
def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """target (log target - input), with 0 where target is 0 (xlogy)."""
    if log_target:
        loss = clang.mul(clang.exp(target), clang.sub(target, input))
    else:
        loss = clang.sub(xlogy(target, target), clang.mul(target, input))
    if reduction == "batchmean":
        return clang.true_divide(clang.sum(loss), as_divisor(input._tt_shape[0]) if input.ndim_ else 1.0)
    return _reduce(loss, reduction)


@torchsymbol(F.nll_loss, tags=("fallible",), autocast={"cpu": FP32, "cuda": FP32})
def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean"):
    return _nll(input, target, weight, ignore_index, reduction)


_SCALAR_TYPE = {torch.float32: "Float", torch.float64: "Double", torch.float16: "Half", torch.bfloat16: "BFloat16",
                torch.int32: "Int", torch.int16: "Short", torch.int8: "Char", torch.bool: "Bool"}


def _check_class_indices(target):
    """Eager's check of a class-index target (a float one there means class probabilities of the input's shape)."""
    if target._tt_dtype.torch not in (torch.int64, torch.uint8):
        name = _SCALAR_TYPE.get(target._tt_dtype.torch, str(target._tt_dtype.torch))
        raise RuntimeError(f"expected target dtype to be Long or Byte, but got {name}")


def _nll(logp, target, weight, ignore_index, reduction):
    # logp: (N, C, ...) or (C,); target: (N, ...) or ()
    _check_class_indices(target)
    out_shape = target._tt_shape  # "none": the target's shape, () for one unbatched sample
    if logp.ndim_ == 1:
        logp = clang.unsqueeze(logp, 0)
        target = clang.unsqueeze(target, 0)
    c_dim = 1
    lp = clang.permute(logp, [0] + list(range(2, logp.ndim_)) + [1]) if logp.ndim_ > 2 else logp
    C = logp._tt_shape[c_dim]
    lp = clang.reshape(lp, (-1, C))
    t = clang.reshape(target, (-1,))
    valid = clang.ne(t, ignore_index)
    safe_t = clang.where(valid, t, 0)
    picked = prims.gather(lp, clang.unsqueeze(safe_t, 1), 1)
    picked = clang.reshape(picked, (-1,))
    w = None
    if weight is not None:
        w = prims.take(clang.maybe_convert(weight, lp._tt_dtype), safe_t, 0)
        w = clang.where(valid, w, 0.0)
    else:
        w = clang.maybe_convert(valid, lp._tt_dtype)
    loss = clang.neg(clang.mul(picked, w))
    if reduction == "none":
        return clang.reshape(loss, out_shape)
    if reduction == "sum":
        return clang.sum(loss)
    return clang.true_divide(clang.sum(loss), clang.sum(w))


@torchsymbol(F.cross_entropy, tags=("fused_backward", "fallible"), not_differentiated_by_torch=("weight",),
             autocast={"cpu": FP32, "cuda": FP32})
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    """Cross entropy over class indices or class probabilities, with label smoothing."""
    x, dt = upcast_and_dtype(input)
    c_dim = 0 if x.ndim_ == 1 else 1
    C = x._tt_shape[c_dim]
    logp = clang.log_softmax(x, c_dim)
    if target._tt_dtype.is_float and tuple(target._tt_shape) == tuple(input._tt_shape):  # class probabilities
        t = clang.maybe_convert(target, x._tt_dtype)
        if label_smoothing > 0:
            t = clang.add(clang.mul(t, 1 - label_smoothing), label_smoothing / C)
        prod = clang.mul(logp, t)
        if weight is not None:
            shape = [1] * x.ndim_
            shape[c_dim] = C
            prod = clang.mul(prod, clang.reshape(clang.maybe_convert(weight, x._tt_dtype), tuple(shape)))
        loss = clang.neg(clang.sum(prod, c_dim))
        if reduction == "mean":
            n = math.prod(x._tt_shape) // C
            return clang.maybe_convert(clang.true_divide(clang.sum(loss), as_divisor(n)), dt)
        return clang.maybe_convert(_reduce(loss, reduction), dt)
    nll = _nll(logp, target, weight, ignore_index, reduction)
    if label_smoothing <= 0:
        return clang.maybe_convert(nll, dt)
    # Smoothing term: mean over classes of -logp (weighted), masked by ignore_index.
    lp = logp if x.ndim_ > 1 else clang.unsqueeze(logp, 0)
    t = target if x.ndim_ > 1 else clang.unsqueeze(target, 0)
    if weight is not None:
        shape = [1] * lp.ndim_
        shape[1] = C
        lpw = clang.mul(lp, clang.reshape(clang.maybe_convert(weight, lp._tt_dtype), tuple(shape)))
    else:
        lpw = lp
    smooth = clang.neg(clang.sum(lpw, 1))
    valid = clang.ne(t, ignore_index)
    smooth = clang.where(valid, smooth, 0.0)
    if reduction == "none":
        smooth = smooth if x.ndim_ > 1 else clang.reshape(smooth, ())
    elif reduction == "sum":
        smooth = clang.sum(smooth)
    else:
        if weight is not None:
            flat_valid = clang.reshape(valid, (-1,))
            w_per = prims.take(clang.maybe_convert(weight, lp._tt_dtype), clang.reshape(clang.where(valid, t, 0), (-1,)), 0)
            wsum = clang.sum(clang.where(flat_valid, w_per, 0.0))
        else:
            wsum = clang.sum(clang.maybe_convert(valid, lp._tt_dtype))
        smooth = clang.true_divide(clang.sum(smooth), wsum)
    out = clang.add(clang.mul(nll, 1 - label_smoothing), clang.mul(smooth, label_smoothing / C))
    return clang.maybe_convert(out, dt)


def _cross_entropy_supported(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None or reduction not in ("none", "sum", "mean"):
        return False
    if target._tt_dtype.is_float:
        return target._tt_shape == input._tt_shape
    # A weight that is an input requiring grad: the decomposition differentiates it everywhere (the torch
    # executor runs this rule's backward with eager's kernels, which refuse weight gradients for class indices).
    return not (is_tensor(weight) and weight._tt_requires_grad)


@register_vjp(cross_entropy, supports=_cross_entropy_supported)
def _cross_entropy_vjp(g, out, /, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    """Gradients from ``softmax(x)`` recomputed from the logits (class indices or probabilities, label smoothing).

    With class indices, per sample ``i`` (``w_t`` its target's weight, 0 if ignored)::

        dloss_i/dx = (1 - ε) · w_t · (p - onehot(t)) + ε/C · (p · Σ_c w_c - w)   (second term 0 if ignored)

    scaled by the cotangent, and for ``mean`` divided by ``Σ_i w_t`` (eager's
    normaliser for both terms).  Probability targets: see ``_cross_entropy_probs_vjp``.
    """
    x, gu = upcast(input), upcast(g)
    c_dim = 0 if x.ndim_ == 1 else 1
    C = x._tt_shape[c_dim]
    eps = float(label_smoothing)
    classes_shape = tuple(C if i == c_dim else 1 for i in range(x.ndim_))
    wc = clang.reshape(clang.maybe_convert(weight, x._tt_dtype), classes_shape) if is_tensor(weight) else None
    p = clang.softmax(x, c_dim)
    if target._tt_dtype.is_float:
        return _cross_entropy_probs_vjp(gu, x, p, target, weight, wc, c_dim, C, eps, reduction, input)
    batch_dims = tuple(d for d in range(x.ndim_) if d != c_dim)
    t = clang.unsqueeze(target, c_dim)
    classes = clang.reshape(prims.iota(C, start=0, step=1, device=x._tt_device, dtype=target._tt_dtype), classes_shape)
    onehot = clang.maybe_convert(clang.eq(classes, t), x._tt_dtype)
    valid = clang.ne(target, ignore_index)
    vf = clang.maybe_convert(valid, x._tt_dtype)
    w_t = vf
    if is_tensor(weight):
        safe = clang.where(valid, target, 0)
        w_per = clang.reshape(prims.take(clang.maybe_convert(weight, x._tt_dtype), clang.reshape(safe, (-1,)), 0), target._tt_shape)
        w_t = clang.mul(vf, w_per)
    if reduction == "mean":
        total = clang.sum(w_t)
        s = clang.expand(clang.true_divide(gu, total), target._tt_shape)
    else:
        s = clang.expand(gu, target._tt_shape)  # "sum": one scalar for every sample
    gx = clang.mul(clang.sub(p, onehot), clang.unsqueeze(w_t, c_dim))
    if eps:
        w_sum = clang.sum(wc) if wc is not None else float(C)
        smooth = clang.sub(clang.mul(p, w_sum), wc if wc is not None else 1.0)
        gx = clang.add(clang.mul(gx, 1.0 - eps), clang.mul(clang.mul(smooth, clang.unsqueeze(vf, c_dim)), eps / C))
    grads = {"input": downcast_like(clang.mul(gx, clang.unsqueeze(s, c_dim)), input)}
    if is_tensor(weight):
        # d/dw_c: the -log p terms that w_c multiplies; "mean" also moves the normaliser Σ w_t.
        neg_logp = clang.neg(clang.log_softmax(x, c_dim))
        sv = clang.unsqueeze(clang.mul(s, vf), c_dim)
        per_class = clang.mul(clang.mul(onehot, neg_logp), 1.0 - eps)
        if eps:
            per_class = clang.add(per_class, clang.mul(neg_logp, eps / C))
        gw = clang.sum(clang.mul(per_class, sv), batch_dims) if batch_dims else clang.mul(per_class, sv)
        if reduction == "mean":
            count = clang.sum(clang.mul(onehot, clang.unsqueeze(vf, c_dim)), batch_dims) if batch_dims else clang.mul(onehot, vf)
            gw = clang.sub(gw, clang.mul(clang.mul(count, clang.true_divide(gu, total)), upcast(out)))
        grads["weight"] = downcast_like(clang.reshape(gw, weight._tt_shape), weight)
    return grads


def _cross_entropy_probs_vjp(gu, x, p, target, weight, wc, c_dim, C, eps, reduction, input):
    """Probability targets: ``loss_i = -Σ_c w_c t_ic log p_ic`` with ``t = t (1 - ε) + ε / C``."""
    t = clang.maybe_convert(target, x._tt_dtype)
    if eps:
        t = clang.add(clang.mul(t, 1.0 - eps), eps / C)
    wt = clang.mul(t, wc) if wc is not None else t
    sample_shape = tuple(n for i, n in enumerate(x._tt_shape) if i != c_dim)
    if reduction == "mean":
        gu = clang.true_divide(gu, as_divisor(math.prod(x._tt_shape) // C))
    s = clang.unsqueeze(clang.expand(gu, sample_shape), c_dim)
    gx = clang.mul(clang.sub(clang.mul(p, clang.sum(wt, c_dim, keepdim=True)), wt), s)
    grads = {"input": downcast_like(gx, input)}
    if _float(target) or is_tensor(weight):
        neg_logp_s = clang.mul(clang.neg(clang.log_softmax(x, c_dim)), s)
        if _float(target):
            gt = clang.mul(neg_logp_s, clang.mul(wc, 1.0 - eps) if wc is not None else 1.0 - eps)
            grads["target"] = downcast_like(gt, target)
        if is_tensor(weight):
            batch_dims = tuple(d for d in range(x.ndim_) if d != c_dim)
            gw = clang.mul(neg_logp_s, t)
            gw = clang.sum(gw, batch_dims) if batch_dims else gw
            grads["weight"] = downcast_like(clang.reshape(gw, weight._tt_shape), weight)
    return grads


def _value_check(bad, message):
    """Raise ``RuntimeError(message)`` at run time where ``bad`` (bool tensor) is true anywhere: eager's
    argument check on values, which a trace cannot decide (prims.check_finite of a NaN where bad)."""
    prims.check_finite(clang.sum(clang.where(bad, float("nan"), 0.0)), message)


@torchsymbol(F.gaussian_nll_loss, tags=("fallible",), autocast={"cpu": FP32, "cuda": FP32})
def gaussian_nll_loss(input, target, var, full=False, eps=1e-6, reduction="mean"):
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(reduction + " is not valid")
    if not is_tensor(var):
        if var < 0:
            raise ValueError("var has negative entry/entries")
        var = clang.full_like(input, var)
    else:
        _value_check(clang.lt(var, 0), "gaussian_nll_loss: var has negative entry/entries")
        vs, xs = tuple(var._tt_shape), tuple(input._tt_shape)
        if vs != xs:
            if xs[:-1] == vs:
                var = clang.unsqueeze(var, -1)
            elif not (len(xs) == len(vs) and sum(v for x, v in zip(xs, vs) if x != v) == 1):
                raise ValueError("var is of incorrect size")
    # eager clamps a clone under no_grad: the value is clamped, the gradient is var's
    clamped = clang.maximum(var, eps)
    var = clang.add(var, prims.stop_gradient(clang.sub(clamped, var)))
    d = clang.sub(input, target)
    loss = clang.mul(clang.add(clang.log(var), clang.true_divide(clang.mul(d, d), var)), 0.5)
    if full:
        loss = clang.add(loss, 0.5 * math.log(2 * math.pi))
    return _reduce(loss, reduction)


# ---------------------------------------------------------------------------
# Written as torch calls the torch language knows (registry.composed: traced as the user's own calls)
# ---------------------------------------------------------------------------
def reduce_loss(loss, reduction):
    """A loss's ``reduction=`` argument, in torch calls (the composed losses share it)."""
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    if reduction == "none":
        return loss
    raise ValueError(f"{reduction} is not a valid value for reduction")


def _reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:
        raise NotImplementedError("the deprecated size_average/reduce arguments are run by torch")
    return reduction


def margin_ranking_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    return reduce_loss(torch.clamp_min(-target * (input1 - input2) + margin, 0), _reduction(size_average, reduce, reduction))


composed("margin_ranking_loss", margin_ranking_loss, (F.margin_ranking_loss,))


def soft_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    return reduce_loss(torch.log1p(torch.exp(-target * input)), _reduction(size_average, reduce, reduction))


composed("soft_margin_loss", soft_margin_loss, (F.soft_margin_loss,))


def hinge_embedding_loss(input, target, margin=1.0, size_average=None, reduce=None, reduction="mean"):
    zeros = torch.zeros_like(input)
    loss = torch.where(target != 1, torch.clamp_min(margin - input, 0), zeros) + torch.where(target != -1, input, zeros)
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


composed("hinge_embedding_loss", hinge_embedding_loss, (F.hinge_embedding_loss,))


def poisson_nll_loss(input, target, log_input=True, full=False, size_average=None, eps=1e-8, reduce=None, reduction="mean"):
    loss = torch.exp(input) - target * input if log_input else input - target * torch.log(input + eps)
    if full:
        stirling = target * torch.log(target) - target + 0.5 * torch.log(2 * math.pi * target)
        loss = loss + torch.where(target > 1, stirling, torch.zeros_like(stirling))
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


composed("poisson_nll_loss", poisson_nll_loss, (F.poisson_nll_loss,))


def multilabel_soft_margin_loss(input, target, weight=None, size_average=None, reduce=None, reduction="mean"):
    loss = -(target * F.logsigmoid(input) + (1 - target) * F.logsigmoid(-input))
    if weight is not None:
        loss = loss * weight
    loss = loss.sum(dim=input.ndim - 1) / input.shape[-1] if input.ndim else loss
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


composed("multilabel_soft_margin_loss", multilabel_soft_margin_loss, (F.multilabel_soft_margin_loss,))


def cosine_embedding_loss(input1, input2, target, margin=0.0, size_average=None, reduce=None, reduction="mean"):
    eps = 1e-12
    d = input1.ndim - 1
    prod = (input1 * input2).sum(d)
    mag = torch.sqrt(((input1 * input1).sum(d) + eps) * ((input2 * input2).sum(d) + eps))
    cos = prod / mag
    zeros = torch.zeros_like(cos)
    loss = torch.where(target == 1, 1 - cos, zeros) + torch.where(target == -1, torch.clamp_min(cos - margin, 0), zeros)
    return reduce_loss(loss, _reduction(size_average, reduce, reduction))


composed("cosine_embedding_loss", cosine_embedding_loss, (F.cosine_embedding_loss,))


def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2, eps=1e-6, swap=False, size_average=None,
                        reduce=None, reduction="mean"):
    reduction = _reduction(size_average, reduce, reduction)
    if not (anchor.ndim == positive.ndim == negative.ndim) or anchor.ndim not in (1, 2):
        raise NotImplementedError("triplet_margin_loss of these shapes is run by torch (eager checks them)")
    dp = pairwise_distance(anchor, positive, p, eps)
    dn = pairwise_distance(anchor, negative, p, eps)
    if swap:
        dn = torch.minimum(dn, pairwise_distance(positive, negative, p, eps))
    return reduce_loss(torch.clamp_min(margin + dp - dn, 0), reduction)


composed("triplet_margin_loss", triplet_margin_loss, (F.triplet_margin_loss,))


def triplet_margin_with_distance_loss(anchor, positive, negative, *, distance_function=None, margin=1.0, swap=False,
                                      reduction="mean"):
    if not (anchor.ndim == positive.ndim == negative.ndim) or anchor.ndim not in (1, 2):
        raise NotImplementedError("triplet_margin_with_distance_loss of these shapes is run by torch (eager checks them)")
    dist = distance_function if distance_function is not None else pairwise_distance
    dp, dn = dist(anchor, positive), dist(anchor, negative)
    if swap:
        dn = torch.minimum(dn, dist(positive, negative))
    return reduce_loss(torch.clamp_min(margin + dp - dn, 0), reduction)


composed("triplet_margin_with_distance_loss", triplet_margin_with_distance_loss, (F.triplet_margin_with_distance_loss,))


def multi_margin_loss(input, target, p=1, margin=1.0, weight=None, size_average=None, reduce=None, reduction="mean"):
    if size_average is not None or reduce is not None or p not in (1, 2):
        raise NotImplementedError("this multi_margin_loss form is run by torch")
    x = input if input.ndim == 2 else input.reshape(1, -1)
    t = target.reshape(-1, 1)
    xt = x.gather(1, t)
    z = torch.clamp_min(margin - xt + x, 0)
    if p == 2:
        z = z * z
    if weight is not None:
        z = z * weight[t]
    z = torch.where(torch.arange(x.shape[1]) == t, torch.zeros_like(z), z)
    loss = z.sum(1) / x.shape[1]
    if input.ndim < 2:
        loss = loss.reshape(())
    return reduce_loss(loss, reduction)


composed("multi_margin_loss", multi_margin_loss, (F.multi_margin_loss,))


def multilabel_margin_loss(input, target, size_average=None, reduce=None, reduction="mean"):
    reduction = _reduction(size_average, reduce, reduction)
    x = input.reshape(1, -1) if input.ndim < 2 else input
    t = target.reshape(1, -1) if target.ndim < 2 else target
    c = x.shape[1]
    valid = torch.cumsum((t == -1).to(torch.int64), 1) == 0  # the targets before the first -1
    count = ((t.unsqueeze(-1) == torch.arange(c)) & valid.unsqueeze(-1)).sum(1)  # (B, C): times j is listed
    m = torch.clamp_min(1 - (x.unsqueeze(-1) - x.unsqueeze(-2)), 0)  # [b, j, i]: 1 - (x_j - x_i)
    # each listed target j (duplicates counted, as eager does) against every class i that is not a target
    m = torch.where((count == 0).unsqueeze(-2), m, torch.zeros_like(m)) * count.unsqueeze(-1).to(m.dtype)
    loss = m.sum((1, 2)) / c
    if input.ndim < 2:
        loss = loss.reshape(())
    return reduce_loss(loss, reduction)


composed("multilabel_margin_loss", multilabel_margin_loss, (F.multilabel_margin_loss,))


# ``F.ctc_loss`` runs through torch (opaquely, gradient by torch's autograd: eager's own backward); eager has no
# meta kernel for it, so its output's metadata comes from this rule.
@meta_rule(F.ctc_loss)
def _ctc_loss_meta(log_probs, targets, input_lengths, target_lengths, blank=0, reduction="mean", zero_infinity=False):
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    if log_probs.ndim not in (2, 3):
        raise RuntimeError(f"ctc_loss: log_probs must be 2-d (unbatched) or 3-d (T, N, C), got {log_probs.ndim}-d")
    shape = (log_probs.shape[1],) if reduction == "none" and log_probs.ndim == 3 else ()
    out = torch.empty(shape, dtype=log_probs.dtype, device="meta")
    return out.requires_grad_() if log_probs.requires_grad else out


# A fused CUDA program computes cross-entropy over class indices as a log-sum-exp and its gradient in one pass
# (torchlang/cross_entropy_fusion_form.py).
from .cross_entropy_fusion_form import fusion_form as _ce_fusion_form, fusion_vjp_form as _ce_fusion_vjp_form  # noqa: E402

cross_entropy.fusion_form, cross_entropy.fusion_vjp_form = _ce_fusion_form, _ce_fusion_vjp_form
