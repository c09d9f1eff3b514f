"""A slice of a constant pad that selects only the padded tensor's own elements reads that tensor instead; a pad of
a pad is one pad (none where they cancel).

Autograd makes this pattern: the gradient of a slice is a zero pad, and the gradient of a ``cat`` slices it again.
DeepSeek-V3's attention pads its key gradient's first 8 columns to 16 and cuts them back to 8 (one pad kernel, ~20 us,
a layer, for values it already had).  Such a line becomes the same slice of the unpadded tensor: the same elements,
a view of that tensor instead of a view of the pad's new one, with the layout the meta replay gives (a new result
proxy: readers see the layout they get).  The pad, where nothing else reads it, is then dead code.  The gradient
of a slice of a padded tensor (``F.pad(q, ...)[..., :n]``) pads, pads again and crops back: one pad, or the
incoming gradient itself.

Only constant pads without interior padding, of known sizes; slices: basic ones (``...``, slices of step 1) within a
pad that only pads; pads of pads: row-major ones, not a crop followed by a pad (cropped elements would come back as
the pad's value).  Not where a line writes one of the values in place (a write into the slice would reach the unpadded
tensor), nor for a returned result (its aliasing is the user's).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, contiguous_strides, is_proxy, meta_tensor
from ..pytree import tree_flatten
from . import torch_impls
from .torch_executor import ImplSymbol, impl_symbol

_PAD = impl_symbol(torch_impls.pad)


def _fn(b):
    return b.sym.fn if isinstance(b.sym, ImplSymbol) else None


def _as_pad(b):
    """``(input, value, ((lo, hi, interior), ...))`` of a pad line (``ttex.pad``, or ``F.pad`` in constant mode),
    else None."""
    fn = _fn(b)
    if fn is torch_impls.pad and len(b.args) == 3 and not b.kwargs:
        return b.args
    if fn is torch.nn.functional.pad and not b.kwargs and 2 <= len(b.args) <= 4 and type(b.args[0]) is TensorProxy:
        x, flat = b.args[0], b.args[1]
        mode = b.args[2] if len(b.args) > 2 else "constant"
        value = b.args[3] if len(b.args) > 3 else None
        if mode != "constant" or not isinstance(flat, (tuple, list)) or len(flat) % 2 or len(flat) > 2 * len(x._tt_shape):
            return None
        pairs = [(flat[k], flat[k + 1]) for k in range(0, len(flat), 2)]  # last dimension first
        config = [(0, 0, 0)] * (len(x._tt_shape) - len(pairs)) + [(lo, hi, 0) for lo, hi in reversed(pairs)]
        return x, 0.0 if value is None else value, tuple(config)
    return None


def _known_pad(b) -> bool:
    """A constant pad (or crop) of known sizes without interior padding."""
    x, value, config = _as_pad(b)
    return (type(x) is TensorProxy and type(b.output) is TensorProxy and all(type(s) is int for s in x._tt_shape)
            and type(value) in (int, float, bool) and all(type(n) is int for lo_hi_in in config for n in lo_hi_in)
            and all(interior == 0 for _, _, interior in config))


def _plain_pad(b) -> bool:
    return _known_pad(b) and all(lo >= 0 and hi >= 0 for lo, hi, _ in _as_pad(b)[2])


def _row_major(p) -> bool:
    return tuple(p._tt_strides) == tuple(contiguous_strides(p._tt_shape)) and p._tt_storage_offset == 0


def _pad_of_pad(line, first):
    """``line`` (a pad of ``first``'s result) as one pad of ``first``'s input, that input itself (no net padding), or
    None.  Padding then cropping removes padding first, then the input's own elements; the one order that does not
    compose is cropping then padding (cropped elements would come back as the pad value)."""
    x, value, inner = _as_pad(first)
    _, value2, outer = _as_pad(line)
    if not (_row_major(x) and _row_major(first.output) and _row_major(line.output)):
        return None  # (a pad's result follows its input's memory format: only row-major ones compose as traced)
    if value2 != value and any(lo > 0 or hi > 0 for lo, hi, _ in outer):
        return None
    if any((a < 0 < b) or (c < 0 < d) for (a, c, _), (b, d, _) in zip(inner, outer)):
        return None
    config = tuple((a + b, c + d, 0) for (a, c, _), (b, d, _) in zip(inner, outer))
    if all(lo == 0 and hi == 0 for lo, hi, _ in config):
        return x if tuple(x._tt_shape) == tuple(line.output._tt_shape) else None
    return line.replace(sym=_PAD, args=(x, value, config), kwargs={})


def _ranges(index, shape):
    """``[(start, stop)]`` per dimension of ``shape`` for a basic slicing index (``...`` and slices of step 1), else None."""
    index = index if isinstance(index, tuple) else (index,)
    if sum(i is Ellipsis for i in index) > 1 or not all(i is Ellipsis or type(i) is slice for i in index):
        return None
    slices = [i for i in index if i is not Ellipsis]
    if len(slices) > len(shape):
        return None
    at = index.index(Ellipsis) if Ellipsis in index else len(index)
    full = [slice(None)] * (len(shape) - len(slices))
    slices = slices[:at] + full + slices[at:]
    out = []
    for s, n in zip(slices, shape):
        if s.step not in (None, 1) or not all(v is None or type(v) is int for v in (s.start, s.stop)):
            return None
        out.append(s.indices(n)[:2])
    return out


def _through(line, pad, make_name):
    """The slicing ``line`` of ``pad``'s result as a slice of the pad's input, the pad's input itself (the slice is
    all of it), or None."""
    x, _, config = _as_pad(pad)
    z = line.output
    y = pad.output
    ranges = _ranges(line.args[1], tuple(y._tt_shape)) if len(line.args) == 2 and not line.kwargs else None
    if ranges is None or type(z) is not TensorProxy:
        return None
    inner = []
    for (a, b), (lo, _, _), n in zip(ranges, config, x._tt_shape):
        if b <= a or a < lo or b > lo + n:
            return None  # an empty slice, or one that reaches into the padding
        inner.append(slice(None) if (a - lo, b - lo) == (0, n) else slice(a - lo, b - lo))
    if all(s == slice(None) for s in inner):
        return x if tuple(x._tt_shape) == tuple(z._tt_shape) else None  # the pad's whole input
    while inner[-1] == slice(None):
        inner.pop()
    try:
        with torch.no_grad():
            m = meta_tensor(x)[tuple(inner)]
    except Exception:  # noqa: BLE001 - not a layout this rule can replay: the line stays
        return None
    if tuple(m.shape) != tuple(z._tt_shape):
        return None
    out = TensorProxy(make_name("t"), shape=tuple(m.shape), dtype=z._tt_dtype, device=z._tt_device,
                      requires_grad=z._tt_requires_grad, strides=tuple(m.stride()), storage_offset=m.storage_offset())
    return line.replace(args=(x, tuple(inner)), output=out)


def _written(trc) -> set:
    """ids of values some line may write in place (its function's name ends in ``_``, or it writes ``out=``).  Not
    ``constants.writes_nothing``, which counts every ttex kernel as a writer: right after lowering only in-place
    kernels and ``out=`` write (``ttex.grad_layout`` reading a gradient does not); the kernels that write into a
    dead argument come from later passes, which read the views this rule makes from their alias facts
    (``buffers.overwritable``)."""
    written = set()
    for b in trc.bound_symbols:
        name = getattr(_fn(b), "__name__", "") or ""
        if name.endswith("_") and not name.endswith("__") or "out" in b.kwargs:
            written.update(id(a) for a in b.flat_args() if is_proxy(a))
    return written


def slices_of_pads(trc, header=None):
    """The trace with each slice of a pad that reads only the padded tensor's elements reading that tensor (see the
    module docstring); ``trc`` if there is none.  Dead pads stay for the caller's dead-code pass."""
    pads: dict = {}  # id(pad result) -> its line
    mapping: dict = {}  # id(old slice result) -> the new one
    lines, written = [], None
    returned = {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}  # (the user's object: its aliasing stays)
    for b in trc.bound_symbols:
        if mapping:
            b = b.renamed(mapping)
        fn = _fn(b)
        if _as_pad(b) is not None and _known_pad(b):
            first = pads.get(id(b.args[0]))
            if first is not None:
                written = _written(trc) if written is None else written
                keep = any(id(v) in written for v in (b.output, first.output, first.args[0])) or id(b.output) in returned
                new = None if keep else _pad_of_pad(b, first)
                if type(new) is TensorProxy:  # the pads cancel: their readers read the first one's input
                    mapping[id(b.output)] = new
                    continue
                b = new or b
            pads[id(b.output)] = b
        elif fn is torch.Tensor.__getitem__ and b.args and id(b.args[0]) in pads and _plain_pad(pads[id(b.args[0])]):
            written = _written(trc) if written is None else written
            pad = pads[id(b.args[0])]
            keep = any(id(v) in written for v in (b.output, pad.output, pad.args[0])) or id(b.output) in returned
            new = None if keep else _through(b, pad, trc.make_name)
            if type(new) is TensorProxy:  # the slice is the pad's whole input: its readers read that
                mapping[id(b.output)] = new
                continue
            if new is not None:
                mapping[id(b.output)] = new.output
                b = new
        lines.append(b)
    if not mapping:
        return trc
    new = trc.derive(header or trc.header)
    new.bound_symbols = lines
    return new
