"""Flatten and unflatten nested Python containers of values.

A tiny, dependency-free tree utility: tuples, lists, dicts (insertion order),
``torch.Size`` and ``slice`` objects are containers; everything else is a leaf.
"""
from __future__ import annotations

import torch

from .proxies import is_number


def tree_flatten(x):
    leaves: list = []
    spec = _flatten(x, leaves)
    return leaves, spec


def _flatten(x, leaves):
    t = type(x)
    if t is tuple or t is list or t is torch.Size or (isinstance(x, tuple) and _is_tuple_like(t)):
        # Named tuples and torch.return_types structseqs (values, indices) are containers too.
        return (t, [_flatten(v, leaves) for v in x])
    if t is dict:
        return (dict, [(k, _flatten(v, leaves)) for k, v in x.items()])
    if t is slice:
        return (slice, [_flatten(x.start, leaves), _flatten(x.stop, leaves), _flatten(x.step, leaves)])
    leaves.append(x)
    return None


def tree_leaves(x) -> list:
    """``tree_flatten(x)[0]`` without building the spec: what the passes ask of every line many times."""
    leaves: list = []
    _leaves(x, leaves)
    return leaves


def _leaves(x, leaves) -> None:
    t = type(x)
    if t is tuple or t is list or t is torch.Size or (isinstance(x, tuple) and _is_tuple_like(t)):
        for v in x:
            tv = type(v)
            if tv is tuple or tv is list or tv is dict or tv is slice or tv is torch.Size or isinstance(v, tuple):
                _leaves(v, leaves)
            else:
                leaves.append(v)
        return
    if t is dict:
        for v in x.values():
            _leaves(v, leaves)
        return
    if t is slice:
        _leaves(x.start, leaves)
        _leaves(x.stop, leaves)
        _leaves(x.step, leaves)
        return
    leaves.append(x)


def tree_unflatten(leaves, spec):
    it = iter(leaves)
    return _unflatten(it, spec)


def _unflatten(it, spec):
    if spec is None:
        return next(it)
    t, children = spec
    if t is dict:
        return {k: _unflatten(it, c) for k, c in children}
    if t is slice:
        return slice(*[_unflatten(it, c) for c in children])
    vals = [_unflatten(it, c) for c in children]
    if hasattr(t, "_fields"):  # collections.namedtuple
        return t(*vals)
    return t(vals)


def _is_tuple_like(t) -> bool:
    return hasattr(t, "_fields") or t.__module__ == "torch.return_types"


def tree_map(fn, x):
    """``x`` with ``fn`` applied to every leaf, in ``tree_flatten``'s order: one walk, no spec (the tracer maps
    every call's arguments, some several times)."""
    t = type(x)
    if t is tuple or t is list:
        return t([tree_map(fn, v) for v in x])
    if t is dict:
        return {k: tree_map(fn, v) for k, v in x.items()}
    if t is torch.Size or (isinstance(x, tuple) and _is_tuple_like(t)):
        vals = [tree_map(fn, v) for v in x]
        return t(*vals) if hasattr(t, "_fields") else t(vals)
    if t is slice:
        return slice(tree_map(fn, x.start), tree_map(fn, x.stop), tree_map(fn, x.step))
    return fn(x)


# ---------------------------------------------------------------------------
# Outputs: any structure a compiled function returns is rebuilt with real tensors.
#
# The trace returns plain containers only (it is printed as Python); a user type in
# the output (HF ModelOutput, a dataclass, an OrderedDict subclass, a type registered
# with torch.utils._pytree) is flattened at trace time into a tuple of leaves and an
# ``OutputSpec``, which rebuilds it around the real tensors after every call.

def _plain(x, contains_proxy) -> bool:
    """Whether our own tree handles ``x`` (and everything inside it) without a user type."""
    t = type(x)
    if t is tuple or t is list or t is torch.Size or (isinstance(x, tuple) and _is_tuple_like(t)):
        return all(_plain(v, contains_proxy) for v in x)
    if t is dict:
        return all(_plain(v, contains_proxy) for v in x.values())
    if t is slice or x is None or is_number(x) or isinstance(x, (str, torch.Tensor)):
        return True  # (runtime numbers, NumberProxy, are leaves of the trace's output)
    return (_torch_pytree().tree_is_leaf(x) and not _is_dataclass_instance(x) and not isinstance(x, (dict, list, tuple))
            and not contains_proxy(x))


def _torch_pytree():
    import torch.utils._pytree as pytree

    return pytree


def _is_dataclass_instance(x) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(x) and not isinstance(x, type)


class OutputSpec:
    """How to rebuild a returned structure from its flat leaves (``rebuild(leaves)``)."""

    def __init__(self, node):
        self._node = node

    def rebuild(self, leaves):
        it = iter(leaves)
        return _build(self._node, it)


def flatten_output(out, contains_proxy):
    """``(out, None)`` when ``out`` is plain containers; else ``(tuple of leaves, OutputSpec)``.

    A leaf of a type nothing knows how to rebuild that holds a proxy (found by
    ``contains_proxy``) is refused: returning it would hand the caller a proxy.
    """
    if _plain(out, contains_proxy):
        return out, None
    leaves: list = []
    node = _flatten_out(out, leaves, contains_proxy)
    return tuple(leaves), OutputSpec(node)


def _flatten_out(x, leaves, contains_proxy):
    import dataclasses

    pytree = _torch_pytree()
    t = type(x)
    if t is slice or t is torch.Size:
        leaves.append(x)
        return None
    if not pytree.tree_is_leaf(x):
        # One level through torch's registry (tuples, lists, dicts, named tuples, OrderedDict,
        # HF ModelOutput, user registrations), then recurse into the children.
        children, spec = pytree.tree_flatten(x, is_leaf=lambda y: y is not x)
        return ("pytree", spec, [_flatten_out(c, leaves, contains_proxy) for c in children])
    if _is_dataclass_instance(x):
        names = [f.name for f in dataclasses.fields(x)]
        return ("fields", x, names, [_flatten_out(getattr(x, n), leaves, contains_proxy) for n in names])
    if isinstance(x, dict):  # an unregistered dict subclass (e.g. an OrderedDict subclass)
        keys = list(x.keys())
        return ("items", x, keys, [_flatten_out(x[k], leaves, contains_proxy) for k in keys])
    if not (is_number(x) or isinstance(x, (torch.Tensor, str))) and contains_proxy(x):
        if _register_known(t):
            return _flatten_out(x, leaves, contains_proxy)
        hint = " (for a transformers cache, pass use_cache=False)" if t.__module__.startswith("transformers.") else ""
        raise TypeError(
            f"the compiled function returned a {t.__module__}.{t.__qualname__} holding tensors computed by the "
            "function, and thunder_train cannot rebuild that type with the real tensors. Register it with "
            f"torch.utils._pytree.register_pytree_node (or make it a dataclass), or return a tuple or dict{hint}."
        )
    leaves.append(x)
    return None


# Third-party types whose library ships a torch.utils._pytree registration that it does not install
# by default: transformers registers its caches (DynamicCache, EncoderDecoderCache, ...) only for
# torch.export. Installed on first use, with the library's own functions.
def _register_known(t) -> bool:
    import importlib

    if not t.__module__.startswith("transformers."):
        return False
    try:
        exporter = importlib.import_module("transformers.exporters.exporter_dynamo")
        if exporter.is_cache_class(t):
            exporter.register_pytree_node(t)
    except (ImportError, AttributeError):  # older transformers: only DynamicCache has a registration
        if t.__qualname__ == "DynamicCache":
            importlib.import_module("transformers.integrations.executorch").register_dynamic_cache_export_support()
    return t in _torch_pytree().SUPPORTED_NODES


def _build(node, it):
    import copy

    if node is None:
        return next(it)
    kind = node[0]
    if kind == "pytree":
        _, spec, children = node
        return _torch_pytree().tree_unflatten([_build(c, it) for c in children], spec)
    _, template, names, children = node
    values = [_build(c, it) for c in children]
    new = copy.copy(template)  # keeps fields without __init__ arguments and frozen dataclasses
    if kind == "fields":
        for n, v in zip(names, values):
            object.__setattr__(new, n, v)
    else:
        for k, v in zip(names, values):
            new[k] = v
    return new


def holds(x, pred, limit: int = 10_000) -> bool:
    """Whether an object graph reachable from ``x`` contains a value satisfying ``pred`` (bounded walk)."""
    import gc

    seen, stack = set(), [x]
    while stack and len(seen) < limit:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        if pred(v):
            return True
        if is_number(v) or isinstance(v, (torch.Tensor, type, str, bytes, type(None))):
            continue
        stack.extend(gc.get_referents(v))
    return False
