"""Primitive operations.

A prim has a meta function only: given proxies it validates its inputs and returns output proxies.
No tensor data exists at trace time.  Prims are strict (elementwise inputs have one shape and one
dtype, reductions take explicit dims) so that executors implement a small, simple set; clang builds
the conveniences (broadcasting, type promotion, -1 in reshape) on top.

Every fact about a prim hangs off its symbol and is declared where the prim is defined, in one
module per family:

- ``elementwise.py``: unary/binary ops, ``where``, conversions, copies, ``polygamma``; what each is
  on Python numbers (runtime scalars);
- ``reductions.py``: sum, prod, amax/amin, var, argmax/argmin, cumsum, topk, sort;
- ``shapes.py``: broadcast, reshape, permute, slice, cat, pad, flip and the indexing prims;
- ``linalg.py``: matmul, convolution (and its backward);
- ``factories.py``: full, empty, iota, random values;
- ``memory.py``: ``copy_``, ``item``, ``shape``, runtime checks, collectives;
- ``generators.py``: the random generators' state as values (``get_rng_state``, ``set_rng_state``, ``manual_seed``);
- ``value_shaped.py``: ops whose output sizes the values decide (``nonzero``, ``unique``, ``bincount``, ``repeat_index``).

Each declares a prim's meta, its tags (``Symbol`` documents them) and its gradient rule
(``@register_vjp``, ``compiler/grad_rules.py``) together; ``core.py`` has the decorator, the checks
and the helpers rules share.  Executors register their implementations from their side, keyed by
the symbol (``executors/torch_executor.py``).  ``prims.add`` etc. are the symbols, and printed
traces call them so.
"""
from __future__ import annotations

import sys

from .. import codegen, proxies
from . import core, elementwise, factories, generators, linalg, memory, reductions, shapes, value_shaped  # noqa: F401  (each defines its prims)
from .core import PrimError, all_prims  # noqa: F401
from .elementwise import BINARY_BOOL_OPS, BINARY_OPS, SCALAR_INFIX, UNARY_BOOL_OPS, UNARY_OPS  # noqa: F401

# Every prim by name: ``prims.add``, ``prims.sum``, ...
globals().update(all_prims())

# Printed traces call prims as ``prims.<name>``; arithmetic on runtime numbers records scalar prims.
codegen.register_namespace("prims", sys.modules[__name__])
proxies._prims = sys.modules[__name__]
