"""Python attributes set on input tensors (``weight.skip = True``, ``batch.is_padded = True``), read while tracing.

A proxy stands for an input tensor with its metadata only: before, ``getattr(self.weight, "skip", False)`` in a
forward found nothing on the proxy and traced the default branch, whatever the tensor held (silently otherwise than
eager from the first call). An attribute the proxy lacks is looked up on the tensor it stands for
(``TensorProxy.__getattr__``); one the tensor has is walked as an input under ``<tensor's path>.<name>`` where the
function reads it, so its value is guarded like any other input's (a number or string by value, an object by
identity, a tensor by its metadata), and read on every thin call (``provenance.per_call_mask``: no module epoch sees
a tensor's attributes).  Not seen: an attribute set on a tensor after the first call where that call read none of
that name (the trace took the default branch; nothing guards the absence).
"""
from __future__ import annotations

from .. import context, proxies
from .provenance import Step

_NO = proxies.NO_ATTRIBUTE


def _attribute(proxy, name):
    st = context.tracer_state()
    walker = getattr(st, "walker", None) if st is not None else None
    if walker is None:
        return _NO
    leaf = walker.leaf_of(proxy)
    if leaf is None or leaf.kind != "tensor":
        return _NO
    own = getattr(leaf.value, "__dict__", None)
    if not own or name not in own:
        return _NO
    key = (id(leaf), name)
    if key not in walker.tensor_attributes:
        walker.tensor_attributes[key] = walker.walk(own[name], leaf.path + (Step("attr", name),))
    return walker.tensor_attributes[key]


proxies._attribute_handler = _attribute
