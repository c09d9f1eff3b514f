"""Flatten and unflatten nested Python containers of values.

A tiny, dependency-free tree utility: tuples, lists, dicts (insertion order),
``torch.Size`` and ``slice`` objects are containers; everything else is a leaf.
"""
from __future__ import annotations

import torch


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
    leaves, spec = tree_flatten(x)
    return tree_unflatten([fn(v) for v in leaves], spec)
