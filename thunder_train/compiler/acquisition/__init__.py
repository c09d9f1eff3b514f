"""Acquisition: run the user's function on proxies and record a trace.

One idea per module:

* ``provenance`` — access paths (``Step``, ``Leaf``): how the prologue finds an input again;
* ``walker`` — input walking: tensors, containers, modules, optimizers become proxied inputs;
* ``captured`` — the globals and closure cells the function reads: inputs like arguments;
* ``dispatch`` — every torch call while tracing, routed to the torch language, with its special cases;
* ``inplace`` — functionalization glue: in-place ops, ``out=`` and views;
* ``python_effects`` — Python behaviour a program would not repeat, refused with a clear error;
* ``state`` — ``TracerState``, the tracer's state for one acquisition;
* ``acquire`` — the entry point.
"""
from .acquire import Acquired, acquire, arg_names, check_call_signature
from .provenance import Leaf, Step, name_from_path, path_expr, path_str

__all__ = ["Acquired", "acquire", "arg_names", "check_call_signature", "Leaf", "Step", "name_from_path", "path_expr", "path_str"]
