"""Shape, movement and indexing prims.  Each prim's meta and gradient rule are declared together.

``broadcast_in_dim`` and ``sum`` (reductions.py) are each other's gradient."""
from __future__ import annotations

import math

from .. import dtypes
from ..errors import NoGradientRuleError
from ..grad_rules import register_vjp
from ..proxies import TensorProxy, is_int, same_size, size_value
from .core import check, common_device, is_tensor, prim, prims, reshape as reshape_to, slice_in_dim, sum_to, unsqueeze, zeros_like

# "cheap_to_recompute": views and metadata changes the backward recomputes from their input rather than
# saving their output, when that saves no extra value (transforms/autograd.py).
_CHEAP = ("cheap_to_recompute",)
# "shape_only": views and reshapes, whose output layout is the same on every device (found on meta tensors).
_VIEWLIKE = _CHEAP + ("shape_only",)


@prim(tags=("fusible",) + _VIEWLIKE)  # fusible when the torch executor runs it as ttex.broadcast_in_dim (a view otherwise)
def broadcast_in_dim(a, shape, broadcast_dimensions):
    """Broadcast ``a`` to ``shape``; dim i of ``a`` maps to ``broadcast_dimensions[i]``."""
    shape = tuple(shape)
    check(len(broadcast_dimensions) == len(a._tt_shape), "broadcast_in_dim: one target dim per input dim")
    for i, d in enumerate(broadcast_dimensions):
        s = a._tt_shape[i]
        check(0 <= d < len(shape) and (same_size(s, shape[d]) or s == 1 or s == shape[d]), lambda: f"broadcast_in_dim: cannot map size {s} onto {shape} at dim {d}")
    check(list(broadcast_dimensions) == sorted(broadcast_dimensions), "broadcast_in_dim: dims must increase")
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(broadcast_in_dim)
def broadcast_in_dim_vjp(g, out, /, a, shape, broadcast_dimensions):
    bdims = tuple(broadcast_dimensions)
    # A new dim of size 1 (an unsqueeze) needs no sum, only the reshape below: eager's gradient of unsqueeze is a
    # view, and a sum over one element is a kernel call that also turns -0.0 into 0.0.
    reduce = [d for d in range(len(shape)) if d not in bdims and not (type(shape[d]) is int and shape[d] == 1)]
    reduce += [d for i, d in enumerate(bdims) if not same_size(a._tt_shape[i], shape[d]) and a._tt_shape[i] == 1 and shape[d] != 1]
    if reduce:
        g = prims.sum(g, tuple(sorted(reduce)))
    return {"a": reshape_to(g, a._tt_shape)}


@prim(tags=_VIEWLIKE)
def reshape(a, shape):
    """Reshape to ``shape`` (no -1; clang resolves it)."""
    shape = tuple(shape)
    n = 1
    for s in shape:
        check(is_int(s) and size_value(s) >= 0, lambda: f"reshape: invalid size {s}")
        n *= s
    check(n == a.numel_(), lambda: f"reshape: shape {shape} is invalid for input of size {a.numel_()}")
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@prim(tags=_VIEWLIKE)
def squeeze(a, dims):
    """Remove the size-1 dims ``dims``."""
    for d in dims:
        check(a._tt_shape[d] == 1, lambda: f"squeeze: dim {d} has size {a._tt_shape[d]}, not 1")
    return TensorProxy(shape=[s for i, s in enumerate(a._tt_shape) if i not in dims], dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(reshape, squeeze)
def reshape_vjp(g, out, /, a, *_, **__):
    return {"a": reshape_to(g, a._tt_shape)}


@prim(tags=_VIEWLIKE)
def transpose(a, permutation):
    """Permute dimensions."""
    nd = len(a._tt_shape)
    check(sorted(permutation) == list(range(nd)), lambda: f"transpose: {permutation} is not a permutation of {nd} dims")
    return TensorProxy(shape=tuple(a._tt_shape[p] for p in permutation), dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(transpose)
def transpose_vjp(g, out, /, a, permutation):
    inverse = [0] * len(permutation)
    for i, p in enumerate(permutation):
        inverse[p] = i
    return {"a": prims.transpose(g, tuple(inverse))}


@prim(tags=_VIEWLIKE)
def slice(a, start_indices, end_indices, strides=None):
    """Take ``a[start:end:stride]`` in every dim; all indices are in range."""
    nd = len(a._tt_shape)
    strides = strides if strides is not None else (1,) * nd
    check(len(start_indices) == nd and len(end_indices) == nd and len(strides) == nd, "slice: one index per dim")
    shape = []
    for s, lo, hi, st in zip(a._tt_shape, start_indices, end_indices, strides):
        check(0 <= lo <= hi <= s and st >= 1, lambda: f"slice: invalid range {lo}:{hi}:{st} for size {s}")
        shape.append((hi - lo + st - 1) // st)
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(slice)
def slice_vjp(g, out, /, a, start_indices, end_indices, strides):
    strides = strides if strides is not None else (1,) * a.ndim_
    if 0 in g._tt_shape:
        return {"a": zeros_like(a)}
    config = []
    for size, lo, n, st in zip(a._tt_shape, start_indices, g._tt_shape, strides):
        last = lo + st * (n - 1)
        config.append((lo, size - last - 1, st - 1))
    return {"a": prims.pad(g, 0.0, tuple(config))}


@prim(tags=("layout_on_meta",))
def cat(tensors, dim):
    """Concatenate along ``dim``; tensors share dtype and other sizes."""
    check(len(tensors) > 0, "cat: expected at least one tensor")
    t0 = tensors[0]
    shape = list(t0._tt_shape)
    for t in tensors[1:]:
        check(len(t._tt_shape) == len(shape), "cat: tensors must have equal rank")
        check(t._tt_dtype is t0._tt_dtype, "cat: tensors must have equal dtypes at prim level")
        for i, (x, y) in enumerate(zip(shape, t._tt_shape)):
            check(i == dim or x == y, lambda: f"cat: sizes differ at dim {i}: {x} vs {y}")
        shape[dim] += t._tt_shape[dim]
    return TensorProxy(shape=shape, dtype=t0._tt_dtype, device=common_device(list(tensors), "cat"))


@register_vjp(cat)
def cat_vjp(g, out, /, tensors, dim):
    grads, offset = [], 0
    for t in tensors:
        n = t._tt_shape[dim]
        grads.append(slice_in_dim(g, offset, offset + n, dim))
        offset += n
    return {"tensors": grads}


# "fusible": a constant pad is a kernel that writes the value around its input (the gradient of a slice: rotary
# embedding's halves in the backward), which a fused kernel writes with its neighbours.
@prim(tags=("layout_on_meta", "fusible"))
def pad(a, padding_value, padding_config):
    """Pad with ``(lo, hi, interior)`` per dim (negative lo/hi crop)."""
    check(len(padding_config) == len(a._tt_shape), "pad: one (lo, hi, interior) per dim")
    shape = []
    for s, (lo, hi, interior) in zip(a._tt_shape, padding_config):
        check(interior >= 0, "pad: interior padding must be >= 0")
        shape.append(lo + hi + s + max(s - 1, 0) * interior)
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(pad)
def pad_vjp(g, out, /, a, padding_value, padding_config):
    # Undo the outer padding (a negative pad crops), then step over the interior padding.
    cropped = prims.pad(g, 0.0, tuple((-lo, -hi, 0) for lo, hi, _ in padding_config))
    if all(it == 0 for _, _, it in padding_config):
        return {"a": cropped}
    return {"a": prims.slice(cropped, (0,) * a.ndim_, cropped._tt_shape, tuple(it + 1 for _, _, it in padding_config))}


@prim
def flip(a, dims):
    """Reverse the order of elements along ``dims``."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(flip)
def flip_vjp(g, out, /, a, dims):
    return {"a": prims.flip(g, dims)}


# ---------------------------------------------------------------------------
# Indexing
# ---------------------------------------------------------------------------
# "fallible": an index out of range makes the call raise at run time (re-inplacing keeps calls transactional).
@prim(tags=("fallible",))
def take(a, index, dim):
    """``index_select``: pick entries of ``a`` along ``dim`` by a 1-D integer ``index``."""
    check(index._tt_dtype.is_int and len(index._tt_shape) <= 1, "take: index must be a 1-D integer tensor")
    shape = list(a._tt_shape)
    shape[dim] = index._tt_shape[0] if index._tt_shape else 1
    if not index._tt_shape:
        del shape[dim]
    return TensorProxy(shape=shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(take)
def take_vjp(g, out, /, a, index, dim):
    if index.ndim_ == 0:
        g = unsqueeze(g, dim)
        index = prims.reshape(index, (1,))
    full_index = prims.broadcast_in_dim(index, g._tt_shape, (dim,))
    return {"a": prims.scatter_add(zeros_like(a), full_index, g, dim)}


@prim(tags=("fallible",))
def gather(a, index, dim):
    """``torch.gather`` semantics: output has ``index``'s shape."""
    check(index._tt_dtype.is_int and len(index._tt_shape) == len(a._tt_shape), "gather: index must be integer with a's rank")
    return TensorProxy(shape=index._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(gather)
def gather_vjp(g, out, /, a, index, dim):
    return {"a": prims.scatter_add(zeros_like(a), index, g, dim)}


@prim(tags=("fallible",))
def scatter_add(a, index, src, dim):
    """Out-of-place ``a.scatter_add(dim, index, src)``."""
    check(index._tt_dtype.is_int, "scatter_add: index must be an integer tensor")
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(scatter_add)
def scatter_add_vjp(g, out, /, a, index, src, dim):
    return {"a": g, "src": prims.gather(g, index, dim)}


@prim(tags=("fallible",))
def scatter(a, index, src, dim):
    """Out-of-place ``a.scatter(dim, index, src)``: ``src`` a tensor of ``index``'s shape and ``a``'s dtype, or a
    number (written as ``a``'s dtype)."""
    check(index._tt_dtype.is_int, "scatter: index must be an integer tensor")
    check(not is_tensor(src) or (src._tt_dtype is a._tt_dtype and tuple(src._tt_shape) == tuple(index._tt_shape)),
          "scatter: src must be a number or a tensor of index's shape and a's dtype")
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(scatter)
def scatter_vjp(g, out, /, a, index, src, dim):
    # eager's formula: the positions written take no gradient from ``a``; ``src`` gets the gradient where it went
    grads = {"a": prims.scatter(g, index, 0, dim)}
    if is_tensor(src):
        grads["src"] = prims.gather(g, index, dim)
    return grads


@prim(tags=("fallible",))
def index_put(a, indices, values, accumulate):
    """Out-of-place ``a.index_put(indices, values, accumulate)``."""
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


def _broadcast_shapes(s, t):
    n = max(len(s), len(t))
    s, t = (1,) * (n - len(s)) + tuple(s), (1,) * (n - len(t)) + tuple(t)
    check(all(x == y or 1 in (x, y) for x, y in zip(s, t)), lambda: f"index_put: index shapes {s} and {t} do not broadcast")
    return tuple(y if x == 1 else x for x, y in zip(s, t))


def _index(x, indices):
    """``x[indices]`` for a tuple of integer index tensors over x's leading dims (advanced indexing)."""
    k = len(indices)
    lead, rest = x._tt_shape[:k], tuple(x._tt_shape[k:])
    idx_shape = ()
    for i in indices:
        if not is_tensor(i) or not i._tt_dtype.is_int:
            raise NoGradientRuleError("index_put: the gradient of values supports integer index tensors only")
        idx_shape = _broadcast_shapes(idx_shape, i._tt_shape)
    flat, stride = None, 1
    for i, size in reversed(list(zip(indices, lead))):
        if i._tt_dtype is not dtypes.int64:
            i = prims.convert_element_type(i, dtypes.int64)
        if tuple(i._tt_shape) != idx_shape:
            i = prims.broadcast_in_dim(i, idx_shape, tuple(range(len(idx_shape) - i.ndim_, len(idx_shape))))
        i = prims.where(prims.lt(i, 0), prims.add(i, size), i)  # negative indices count from the end
        term = prims.mul(i, stride) if stride != 1 else i
        flat = term if flat is None else prims.add(flat, term)
        stride *= size
    rows = reshape_to(x, (math.prod(lead),) + rest)
    taken = prims.take(rows, reshape_to(flat, (math.prod(idx_shape),)), 0)
    return reshape_to(taken, idx_shape + rest)


@register_vjp(index_put)
def index_put_vjp(g, out, /, a, indices, values, accumulate):
    """``a``: ``g``, minus the overwritten positions unless accumulating; ``values``: ``g[indices]`` (as eager)."""
    grads = {}
    if is_tensor(a):
        if accumulate:
            grads["a"] = g
        else:
            written = _index(g, indices)
            grads["a"] = prims.index_put(g, tuple(indices), zeros_like(written), False)
    if is_tensor(values):
        grads["values"] = sum_to(_index(g, indices), values._tt_shape)
    return grads
