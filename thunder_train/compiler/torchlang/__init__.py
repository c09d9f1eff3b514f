"""The torch language: torch functions, Tensor methods and operators mapped onto clang.

Symbols are printed in traces as ``ltorch.<name>``.  Importing this package
registers every symbol with the tracer (see ``registry``).
"""
import sys

from .. import codegen
from .registry import all_symbols, by_torch_fn, lookup  # noqa: F401
from . import (  # noqa: F401  (each registers its ops; a later binding of the same torch callable wins)
    tensor_methods, elementwise, elementwise_composed, reductions, shapes, factories, linalg, nn, losses, inplace, foreach, optim, decided,
    statistics, value_shaped, activations, normalization, attention, dropout, padding, pooling, distances, indexing,
    sorting, distributed, spectral, opaque_rules, grouped_mm,
)

codegen.register_namespace("ltorch", sys.modules[__name__])  # printed traces call ``ltorch.<name>``


def __getattr__(name):
    try:
        return all_symbols[name]
    except KeyError:
        raise AttributeError(f"ltorch has no symbol {name!r}") from None
