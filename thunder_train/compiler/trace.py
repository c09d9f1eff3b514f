"""Traces: a program as a list of bound symbols, printable as Python."""
from __future__ import annotations

import keyword
import re

from . import context
from .codegen import namespaces
from .proxies import is_proxy, proxy_name


class Trace:
    """A program: input proxies, a list of bound symbols and an output structure.

    ``header`` names the pass that produced the trace; it is printed on top.
    Names are unique within a trace and deterministic (``t0``, ``t1``, ...).
    """

    def __init__(self, fn_name: str = "computation", header: str = ""):
        self.fn_name = fn_name
        self.header = header
        self.args: list = []  # input proxies, in signature order
        self.varargs = False  # prologue-style ``def f(*args, **kwargs)``
        self.output = None
        self.bound_symbols: list = []
        self.names: set = set()
        self._counters: dict = {}
        self._scopes: list = [self.bound_symbols]
        # Composites being decomposed that the torch executor runs whole: the layouts of the values
        # inside them are never seen, so Symbol.__call__ does not compute them (it is the costly part).
        self.claimed_depth = 0
        # False: an op declaring ``Symbol.results_without_decomposition`` is recorded without its decomposition
        # (acquisition: only ``decompose=True`` lowers the lines of one the torch executor runs whole).
        self.keep_decompositions = True
        self.decorators: list = []  # source lines like "@torch.no_grad()"
        self._callable = None

    # ---- naming ----
    def make_name(self, prefix: str) -> str:
        n = self._counters.get(prefix, 0)
        while True:
            name = f"{prefix}{n}"
            n += 1
            if name not in self.names:
                break
        self._counters[prefix] = n
        self.names.add(name)
        return name

    def unique_name(self, base: str) -> str:
        """``base`` itself if free, else ``base_1``, ``base_2``, ..."""
        if base not in self.names and base.isidentifier() and not _is_reserved(base):
            self.names.add(base)
            return base
        i = 1
        while f"{base}_{i}" in self.names:
            i += 1
        self.names.add(f"{base}_{i}")
        return f"{base}_{i}"

    # ---- recording ----
    def add(self, bsym) -> None:
        self._scopes[-1].append(bsym)

    def push_scope(self) -> None:
        self._scopes.append([])

    def pop_scope(self) -> list:
        return self._scopes.pop()

    # ---- derived traces ----
    def derive(self, header: str) -> "Trace":
        """A new empty trace sharing names and signature; passes fill in bound_symbols."""
        t = Trace(self.fn_name, header)
        t.args = list(self.args)
        t.varargs = self.varargs
        t.output = self.output
        t.names = set(self.names)
        t._counters = dict(self._counters)
        t.decorators = list(self.decorators)
        return t

    def with_lines(self, lines) -> "Trace":
        """A new trace with this one's header, names and signature, holding ``lines`` (a pass that rewrites lines)."""
        t = self.derive(self.header)
        t.bound_symbols = list(lines)
        return t

    # ---- printing and execution ----
    def python_source(self) -> str:
        from .codegen import trace_source

        return trace_source(self)[0]

    def python_callable(self):
        if self._callable is None:
            from .codegen import compile_trace

            self._callable = compile_trace(self)
        return self._callable

    def __repr__(self) -> str:
        return self.python_source()

    __str__ = __repr__


_RESERVED = {"torch", "prims", "ltorch", "ttex", "numbers", "dtypes", "devices", "F", "None", "True", "False", "args",
             "kwargs", "inf", "nan"}


_FUSED_REGION_NAME = re.compile(r"\w*fusion_\d+")  # a fused region's name (inductor_fusion_3)


def _is_reserved(name: str) -> bool:
    """Names generated code refers to besides the trace's values: the namespaces, ``inf``/``nan``, and every name
    starting with ``_`` (kept buffers ``_b``/``_pool``, constants ``_c0``, opaque ops ``_op_...``) or naming a fused
    region (``inductor_fusion_3``).  A user's argument so named would shadow it inside the program (a parameter
    called ``_b`` or ``ttex`` broke the call); it is renamed (``_b_1``)."""
    return (keyword.iskeyword(name) or name in _RESERVED or name in namespaces or name.startswith("_")
            or _FUSED_REGION_NAME.fullmatch(name) is not None)


def new_trace(fn_name="computation", header="") -> Trace:
    return Trace(fn_name, header)


__all__ = ["Trace", "new_trace", "is_proxy", "proxy_name", "context"]
