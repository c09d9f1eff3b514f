"""What the fusing executors share: which lines may join a fused region, a region's values, its structural key,
and the symbol of a fused region's call.

Inductor fusion (``inductor_fusion.py``) and nvFuser fusion (``nvfuser_fusion.py``) each form their regions
from these and compile them their own way; kept buffers (``buffers.py``) write a fused region's results
through ``FusionSymbol``'s out form, and pay-back (``payback.py``) keys its estimates by ``structure``.
"""
from __future__ import annotations

import math

from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten
from ..symbols import Symbol
from . import torch_impls
from .torch_executor import NOT_A_KERNEL

# A region of fewer ops stays as it was (unless a line has a fusion form).  Two ops (SwiGLU's ``silu(a) * b``,
# a recomputed ``x * rstd * w``) already pay: one kernel call for two dispatches (docs/fusion.md).
MIN_OPS = 2


# ---------------------------------------------------------------------------
# What is fusible: a line of the torch executor whose op (``bsym.source``, the symbol it was lowered
# from) is tagged "fusible" where it is defined (torchlang/, prims/), unless the torch executor ran it as
# a view or a wrapper for a Python number (``torch_executor.NOT_A_KERNEL``).
# ---------------------------------------------------------------------------
def fusion_form(bsym):
    """The torch function a fused kernel computes for this line in place of its torch call, when its op declares one
    for these arguments (``Symbol.fusion_form``; ``Symbol.fusion_vjp_form`` for the op's ``<name>_vjp`` line): the
    same function, faster to compile into a kernel (tanh GELU as x * sigmoid(2u), torchlang/activations.py)."""
    src = bsym.source
    if bsym.sym.module != "torch_executor" or src is None:
        return None
    owner = getattr(src, "forward_symbol", None)
    declare = owner.fusion_vjp_form if owner is not None else src.fusion_form
    return None if declare is None else declare(*bsym.args, **bsym.kwargs)


def whole_form(bsym):
    """The torch function a fused program compiles for this line as one kernel (executors/whole_lines.py), when the
    line's function declares one for these arguments (``fn.whole_form(*args, **kwargs)``), else None."""
    declare = getattr(getattr(bsym.sym, "fn", None), "whole_form", None)
    return None if declare is None else declare(*bsym.args, **bsym.kwargs)


def whole_guard(bsym):
    """What a line compiled whole asks before each call (``fn.whole_guard()``: process state its own function reads
    at run time, e.g. attention's backend switches); where it says no, the line's own function runs.  None: nothing."""
    return getattr(getattr(bsym.sym, "fn", None), "whole_guard", None)


def whole_check(bsym):
    """What a line compiled whole asks of each kernel call's results (``fn.whole_check(*results) -> bool``: whether
    the arguments were ones its own function takes, e.g. cross-entropy's targets classes); where it says no, the
    line's own function runs (and raises eager's error).  None: nothing."""
    return getattr(getattr(bsym.sym, "fn", None), "whole_check", None)


def fusible_name(bsym) -> str | None:
    """The op's short name (for comments) when a fusing executor may take the line, else None."""
    src, fn = bsym.source, getattr(bsym.sym, "fn", None)
    if fusion_form(bsym) is not None:
        return src.name
    if bsym.sym.module != "torch_executor" or src is None or "fusible" not in src.tags or fn is None:
        return None
    if src.module == "ltorch":
        name = getattr(fn, "__name__", "")
        return None if name.endswith("_") and not name.endswith("__") else src.name  # in-place method forms
    if fn in NOT_A_KERNEL or isinstance(fn, torch_impls.ScalarWrapper):
        return None
    return getattr(fn, "__name__", src.name).strip("_")


def static_nbytes(p) -> int | None:
    """A tensor proxy's bytes (its elements times its item size); None where a size is symbolic."""
    if any(type(d) is not int for d in p._tt_shape):
        return None
    return math.prod(p._tt_shape) * p._tt_dtype.torch.itemsize


def result(bsym):
    """The line's one tensor result (a ``<name>_vjp`` line returns it in a 1-tuple), or None."""
    out = bsym.output
    if isinstance(out, (tuple, list)) and len(out) == 1:
        out = out[0]
    return out if type(out) is TensorProxy else None


def results(bsym) -> list:
    """``(proxy, position)`` for each tensor the line makes: position None for a line returning one tensor, its
    index in the line's tuple otherwise (a ``<name>_vjp`` line's 1-tuple; a line compiled whole,
    executors/whole_lines.py, returns several)."""
    out = bsym.output
    if type(out) is TensorProxy:
        return [(out, None)]
    if isinstance(out, (tuple, list)) and all(type(o) is TensorProxy for o in out):
        return [(o, k) for k, o in enumerate(out)]
    return []


# ---------------------------------------------------------------------------
# A region's values
# ---------------------------------------------------------------------------
def uses(trc):
    """id(proxy) -> indices of the lines that read it; ids of the returned proxies."""
    readers: dict = {}
    for i, b in enumerate(trc.bound_symbols):
        for a in b.flat_args():
            if is_proxy(a):
                readers.setdefault(id(a), set()).add(i)
    return readers, {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}


def region_outputs(region, readers, returned) -> list:
    """The values of ``region`` ((index, bsym) pairs) read after it or returned."""
    inside = {i for i, _ in region}
    results = [result(b) for _, b in region]
    return [r for r in results if id(r) in returned or readers.get(id(r), set()) - inside]


def op_names(bsyms, limit: int = 8) -> str:
    """The region's op names, for comments and notes."""
    names = []
    for b in bsyms:
        n = fusible_name(b) or b.source.name  # a view inside a region (inductor_fusion._view_in_region)
        if n not in names:
            names.append(n)
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _const_key(x):
    if type(x) is slice:  # an index of a view in a region; not hashable before Python 3.12
        return (slice, (x.start, x.stop, x.step))
    return (type(x), repr(x)) if type(x) is float else (type(x), x)


def structure(bsyms, outputs):
    """The region's structural key (compiled kernels and definitions are cached by it) and its input proxies (in
    order of first use)."""
    index: dict = {}
    inputs: list = []

    def norm(x):
        if not is_proxy(x):
            return _const_key(x)
        k = index.get(id(x))
        if k is None:
            k = index[id(x)] = ("in", len(inputs))
            inputs.append(x)
        return k

    ops = []
    for j, b in enumerate(bsyms):
        ops.append((b.sym.fn, tuple(norm(a) for a in b.flat_args()), tree_flatten((b.args, b.kwargs))[1].__repr__()))
        made = results(b)
        for o, k in made:
            index[id(o)] = ("op", j) if len(made) == 1 else ("op", j, k)
    metas = tuple((p._tt_shape, p._tt_strides, p._tt_dtype.torch, p._tt_device.torch) for p in inputs)
    return (tuple(ops), metas, tuple((index[id(o)], o._tt_strides) for o in outputs)), inputs


# ---------------------------------------------------------------------------
# A fused region's call
# ---------------------------------------------------------------------------
class FusionSymbol(Symbol):
    """The call of one compiled region; its subsymbols are the region's original lines.  ``into``: the call of
    the region's out form, printed ``inductor_fusion_3.out(x, out=_b[2])`` (executors/buffers.py).  ``owner``:
    what the kernel's cache holds weakly (inductor_fusion.py), kept alive by the programs that call it."""

    def __init__(self, name, runner, *, into: bool = False, owner=None):
        super().__init__(name, runner.out if into else runner, module="inductor", is_prim=True)
        self.runner, self.into, self.owner = runner, into, owner

    @property
    def print_name(self) -> str:
        return f"{self.name}.out" if self.into else self.name

    def codegen_globals(self) -> dict:
        return {self.name: self.runner}

    def out_symbol(self) -> "FusionSymbol | None":
        """The symbol of the region's out form, when the kernel has one."""
        return FusionSymbol(self.name, self.runner, into=True, owner=self.owner) if getattr(self.runner, "out", None) else None
