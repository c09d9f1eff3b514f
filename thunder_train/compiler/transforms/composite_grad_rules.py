"""Direct gradient rules for torch-language composites.

Where differentiating a composite's decomposition would be slow, imprecise or wrong,
its rule is written here (``grad_rules.py`` has the registry, the prims' rules and
the helpers): ``linear``, the split-like ops, norms, softmax, attention, embedding,
cross-entropy, ...  Rules are registered with ``@register_vjp`` when this module is
imported (``grad_rules.py`` imports it at its end).
"""
from __future__ import annotations

import math

import torch

from .. import clang, dtypes, prims
from ..torchlang import nn as tnn
from ..torchlang import reductions as treductions
from ..torchlang import shapes as tshapes
from .grad_rules import _float, _square, _t, add, mul, register_vjp, sub, sum_to, zeros_like


def _up(x):
    return clang.maybe_convert(x, clang.compute_dtype(x._tt_dtype))


def _back(grad, like):
    return clang.maybe_convert(grad, like._tt_dtype) if grad is not None else None


# ---------------------------------------------------------------------------
# split-like composites: one cat of the pieces' gradients (not a padded sum per piece)
# ---------------------------------------------------------------------------
def _cat_piece_grads(g, out, dim):
    pieces = [gi if gi is not None else prims.full(o._tt_shape, 0, device=o._tt_device, dtype=o._tt_dtype) for gi, o in zip(g, out)]
    return pieces[0] if len(pieces) == 1 else prims.cat(tuple(pieces), dim)


@register_vjp(tshapes.split)
def split_vjp(g, out, /, tensor, split_size_or_sections, dim=0):
    return {"tensor": _cat_piece_grads(g, out, clang.canonicalize_dim(tensor.ndim_, dim))}


@register_vjp(tshapes.tensor_split)
def tensor_split_vjp(g, out, /, input, indices_or_sections, dim=0):
    return {"input": _cat_piece_grads(g, out, clang.canonicalize_dim(input.ndim_, dim))}


@register_vjp(tnn.linear, supports=lambda input, weight, bias=None: weight.ndim_ == 2 and input._tt_dtype is weight._tt_dtype)
def linear_vjp(g, out, /, input, weight, bias=None):
    n_out, n_in = weight._tt_shape
    g2 = clang.reshape(g, (-1, n_out))
    grads = {
        "input": clang.reshape(prims.matmul(g2, weight), input._tt_shape),
        "weight": prims.matmul(clang.transpose(g2, 0, 1), clang.reshape(input, (-1, n_in))),
    }
    if _t(bias):
        grads["bias"] = _back(prims.sum(g2, (0,)), bias)
    return grads


def _softmax_dims_ok(input, dim=None, _stacklevel=3, dtype=None):
    return dim is not None and dtype is None and input._tt_dtype.is_float


@register_vjp(treductions.softmax, supports=_softmax_dims_ok)
def softmax_vjp(g, out, /, input, dim=None, _stacklevel=3, dtype=None):
    y, gu = _up(out), _up(g)
    d = clang.canonicalize_dim(input.ndim_, dim)
    inner = clang.sum(mul(gu, y), d, keepdim=True)
    return {"input": _back(mul(y, sub(gu, clang.expand(inner, y._tt_shape))), input)}


@register_vjp(treductions.log_softmax, supports=_softmax_dims_ok)
def log_softmax_vjp(g, out, /, input, dim=None, _stacklevel=3, dtype=None):
    y, gu = _up(out), _up(g)
    d = clang.canonicalize_dim(input.ndim_, dim)
    total = clang.expand(clang.sum(gu, d, keepdim=True), y._tt_shape)
    return {"input": _back(sub(gu, mul(prims.exp(y), total)), input)}


def _norm_dims(x, normalized_shape):
    nd = len(tuple(normalized_shape))
    return tuple(range(x.ndim_ - nd, x.ndim_))


def _mean_keep(x, dims):
    return clang.expand(clang.mean(x, dims, keepdim=True), x._tt_shape)


def _affine_grads(gy, xhat, weight, bias, dims):
    """Gradients of ``y = xhat * weight + bias`` for weight and bias (summed over the batch dims)."""
    batch = tuple(d for d in range(gy.ndim_) if d not in dims)
    grads = {}
    if _t(weight):
        grads["weight"] = _back(clang.reshape(clang.sum(mul(gy, xhat), batch), weight._tt_shape), weight)
    if _t(bias):
        grads["bias"] = _back(clang.reshape(clang.sum(gy, batch), bias._tt_shape), bias)
    return grads


@register_vjp(tnn.layer_norm)
def layer_norm_vjp(g, out, /, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    # Mean and rstd are recomputed from the input (cheap reductions) instead of being saved.
    x, gy = _up(input), _up(g)
    dims = _norm_dims(x, normalized_shape)
    mean = _mean_keep(x, dims)
    centred = sub(x, mean)
    rstd = clang.expand(prims.rsqrt(add(clang.mean(_square(centred), dims, keepdim=True), eps)), x._tt_shape)
    xhat = mul(centred, rstd)
    gxhat = clang.mul(gy, weight) if _t(weight) else gy
    gx = mul(rstd, sub(sub(gxhat, _mean_keep(gxhat, dims)), mul(xhat, _mean_keep(mul(gxhat, xhat), dims))))
    return {"input": _back(gx, input), **_affine_grads(gy, xhat, weight, bias, dims)}


@register_vjp(tnn.rms_norm)
def rms_norm_vjp(g, out, /, input, normalized_shape, weight=None, eps=None):
    x, gy = _up(input), _up(g)
    dims = _norm_dims(x, normalized_shape)
    if eps is None:
        eps = torch.finfo(input._tt_dtype.torch).eps
    rrms = clang.expand(prims.rsqrt(add(clang.mean(_square(x), dims, keepdim=True), eps)), x._tt_shape)
    xhat = mul(x, rrms)
    gxhat = clang.mul(gy, weight) if _t(weight) else gy
    gx = mul(rrms, sub(gxhat, mul(xhat, _mean_keep(mul(gxhat, xhat), dims))))
    return {"input": _back(gx, input), **_affine_grads(gy, xhat, weight, None, dims)}


@register_vjp(tnn.embedding, supports=lambda input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False: not scale_grad_by_freq and not sparse)
def embedding_vjp(g, out, /, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False, sparse=False):
    # Rows are accumulated with index_put; the padding row gets no gradient (torch semantics).
    idx = clang.reshape(input, (-1,))
    rows = clang.reshape(g, (-1, weight._tt_shape[1]))
    if padding_idx is not None:
        pad = padding_idx % weight._tt_shape[0]
        is_pad = prims.broadcast_in_dim(prims.eq(idx, pad), rows._tt_shape, (0,))
        rows = prims.where(is_pad, 0.0, rows)
    return {"weight": prims.index_put(zeros_like(weight), (idx,), rows, True)}


def _cross_entropy_supported(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    if size_average is not None or reduce is not None or reduction not in ("none", "sum", "mean"):
        return False
    if target._tt_dtype.is_float:
        return target._tt_shape == input._tt_shape
    # A weight that is an input requiring grad: the decomposition differentiates it everywhere (the torch
    # executor runs this rule's backward with eager's kernels, which refuse weight gradients for class indices).
    return not (_t(weight) and weight._tt_requires_grad)


@register_vjp(tnn.cross_entropy, supports=_cross_entropy_supported)
def cross_entropy_vjp(g, out, /, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean", label_smoothing=0.0):
    """Gradients from ``softmax(x)`` recomputed from the logits (class indices or probabilities, label smoothing).

    With class indices, per sample ``i`` (``w_t`` its target's weight, 0 if ignored)::

        dloss_i/dx = (1 - ε) · w_t · (p - onehot(t)) + ε/C · (p · Σ_c w_c - w)   (second term 0 if ignored)

    scaled by the cotangent, and for ``mean`` divided by ``Σ_i w_t`` (eager's
    normaliser for both terms).  Probability targets: see ``_cross_entropy_probs_vjp``.
    """
    x, gu = _up(input), _up(g)
    c_dim = 0 if x.ndim_ == 1 else 1
    C = x._tt_shape[c_dim]
    eps = float(label_smoothing)
    classes_shape = tuple(C if i == c_dim else 1 for i in range(x.ndim_))
    wc = clang.reshape(clang.maybe_convert(weight, x._tt_dtype), classes_shape) if _t(weight) else None
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
    if _t(weight):
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
    grads = {"input": _back(clang.mul(gx, clang.unsqueeze(s, c_dim)), input)}
    if _t(weight):
        # d/dw_c: the -log p terms that w_c multiplies; "mean" also moves the normaliser Σ w_t.
        neg_logp = clang.neg(clang.log_softmax(x, c_dim))
        sv = clang.unsqueeze(clang.mul(s, vf), c_dim)
        per_class = clang.mul(clang.mul(onehot, neg_logp), 1.0 - eps)
        if eps:
            per_class = clang.add(per_class, clang.mul(neg_logp, eps / C))
        gw = clang.sum(clang.mul(per_class, sv), batch_dims) if batch_dims else clang.mul(per_class, sv)
        if reduction == "mean":
            count = clang.sum(clang.mul(onehot, clang.unsqueeze(vf, c_dim)), batch_dims) if batch_dims else clang.mul(onehot, vf)
            gw = clang.sub(gw, clang.mul(clang.mul(count, clang.true_divide(gu, total)), _up(out)))
        grads["weight"] = _back(clang.reshape(gw, weight._tt_shape), weight)
    return grads


def _cross_entropy_probs_vjp(gu, x, p, target, weight, wc, c_dim, C, eps, reduction, input):
    """Probability targets: ``loss_i = -Σ_c w_c t_ic log p_ic`` with ``t = t (1 - ε) + ε / C``."""
    t = clang.maybe_convert(target, x._tt_dtype)
    if eps:
        t = clang.add(clang.mul(t, 1.0 - eps), eps / C)
    wt = clang.mul(t, wc) if wc is not None else t
    sample_shape = tuple(n for i, n in enumerate(x._tt_shape) if i != c_dim)
    if reduction == "mean":
        gu = clang.true_divide(gu, float(math.prod(x._tt_shape) // C))
    s = clang.unsqueeze(clang.expand(gu, sample_shape), c_dim)
    gx = clang.mul(clang.sub(clang.mul(p, clang.sum(wt, c_dim, keepdim=True)), wt), s)
    grads = {"input": _back(gx, input)}
    if _float(target) or _t(weight):
        neg_logp_s = clang.mul(clang.neg(clang.log_softmax(x, c_dim)), s)
        if _float(target):
            gt = clang.mul(neg_logp_s, clang.mul(wc, 1.0 - eps) if wc is not None else 1.0 - eps)
            grads["target"] = _back(gt, target)
        if _t(weight):
            batch_dims = tuple(d for d in range(x.ndim_) if d != c_dim)
            gw = clang.mul(neg_logp_s, t)
            gw = clang.sum(gw, batch_dims) if batch_dims else gw
            grads["weight"] = _back(clang.reshape(gw, weight._tt_shape), weight)
    return grads


def _sdpa_supported(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """No dropout (its mask exists only inside the forward: the decomposition, which keeps it, is used then)."""
    if dropout_p != 0.0 or not query.ndim_ == key.ndim_ == value.ndim_:
        return False
    hq, hk, hv = (t._tt_shape[-3:-2] for t in (query, key, value))
    if hq == hk == hv:
        return True
    return bool(enable_gqa) and hk == hv and hq[0] % hk[0] == 0


@register_vjp(tnn.scaled_dot_product_attention, supports=_sdpa_supported)
def sdpa_vjp(g, out, /, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """Attention probabilities are recomputed from q and k; nothing of size L×S is saved.

    Grouped-query attention (``enable_gqa``, fewer key/value heads): each kv
    head serves ``Hq / Hkv`` consecutive query heads, so it is repeated for the
    computation and its gradient is the sum over its group.
    """
    q, k, v, gu = _up(query), _up(key), _up(value), _up(g)
    rep = 1
    if q.ndim_ >= 3 and k._tt_shape[-3] != q._tt_shape[-3]:
        rep = q._tt_shape[-3] // k._tt_shape[-3]
        k, v = tnn._repeat_heads(k, rep), tnn._repeat_heads(v, rep)
    L, S = q._tt_shape[-2], k._tt_shape[-2]
    scale = 1.0 / math.sqrt(q._tt_shape[-1]) if scale is None else scale
    scores = mul(prims.matmul(q, clang.transpose(k, -2, -1)), scale)
    if is_causal:
        r = prims.broadcast_in_dim(prims.iota(L, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (0,))
        c = prims.broadcast_in_dim(prims.iota(S, start=0, step=1, device=q._tt_device, dtype=dtypes.int64), (L, S), (1,))
        scores = clang.where(clang.expand(prims.ge(r, c), scores._tt_shape), scores, -math.inf)
    elif _t(attn_mask):
        if attn_mask._tt_dtype.is_bool:
            scores = clang.where(clang.expand(attn_mask, scores._tt_shape), scores, -math.inf)
        else:
            scores = clang.add(scores, clang.maybe_convert(attn_mask, scores._tt_dtype))
    p = clang.softmax(scores, -1)
    gv = prims.matmul(clang.transpose(p, -2, -1), gu)
    gp = prims.matmul(gu, clang.transpose(v, -2, -1))
    gs = mul(p, sub(gp, clang.expand(clang.sum(mul(gp, p), -1, keepdim=True), p._tt_shape)))
    gk = mul(prims.matmul(clang.transpose(gs, -2, -1), q), scale)
    if rep > 1:
        gk, gv = _sum_head_groups(gk, rep), _sum_head_groups(gv, rep)
    grads = {
        "query": _back(sum_to(mul(prims.matmul(gs, k), scale), query._tt_shape), query),
        "key": _back(sum_to(gk, key._tt_shape), key),
        "value": _back(sum_to(gv, value._tt_shape), value),
    }
    if _float(attn_mask) and not is_causal:
        grads["attn_mask"] = _back(sum_to(gs, attn_mask._tt_shape), attn_mask)
    return grads


def _sum_head_groups(x, rep):
    """(..., H·rep, S, E) -> (..., H, S, E): the sum over each group of ``rep`` consecutive heads."""
    shape = x._tt_shape
    grouped = clang.reshape(x, shape[:-3] + (shape[-3] // rep, rep) + shape[-2:])
    return prims.sum(grouped, (len(shape) - 2,))
