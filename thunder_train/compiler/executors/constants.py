"""Values a program computes from constants alone, computed once (at its first call) instead of on every call.

Model code builds some tensors from sizes and numbers only: position ids (``torch.arange(T)``), causal and
sliding-window masks (``arange`` compared with ``arange``, ``torch.full(..., min)``, ``torch.where``), BLOOM's
ALiBi slopes (``torch.pow(0.25, torch.arange(1, 5))``).  With the sizes specialised, those lines compute the same
values on every call, each paying its dispatch (Mistral: 14 lines a step).  Here they become one line,

    (t7, t57) = ttex.folded_constants(3).values()  # 14 lines, computed at the first call

whose object runs the lines once, at the program's first call and in its context (grad mode, autocast off as
the program has it), and then returns the same tensors.

A line is *constant* when it is a torch-executor call whose every tensor argument is a constant line's result
(or that has none: a factory), with concrete sizes and strides, and that neither draws random numbers, reads a
generator, has a side effect, nor runs an unknown op opaquely (``Symbol.runs_opaquely``); ``empty`` and its kin
(uninitialised memory) never are.  Its result is then a function of the line's constants only, so every call
computes the same values.  A kept result is the same tensor object on every call, so it must never be written or
handed out: a constant value is not kept (nor anything computed from it) when it, or a value that may share its
memory (a view of it, the result of a torch call not known to return new memory: ``out_forms.aliased_args``), is
returned or read by a line that may write an argument (an in-place op, an optimizer update, a write-back, an
opaque op, a ttex kernel writing "into" an argument).  Nothing is kept when the kept values would take more than
``FOLD_MAX_BYTES`` (the program holds them between calls).

Values: the same torch calls on the same arguments, so the kept tensors are bitwise those each call computed.
"""
from __future__ import annotations

from .. import codegen
from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten
from ..symbols import BoundSymbol, Symbol
from . import torch_impls
from .buffers import view_call
from .out_forms import aliased_args, aliasing_results, out_form
from .regions import FusionSymbol, static_nbytes
from .torch_executor import ImplSymbol

FOLD_MAX_BYTES = 1 << 20  # the kept values of one program, at most

_NOT_CONSTANT_TAGS = frozenset({"random", "reads_generator", "side_effect", "inplace", "opaque"})


def _tags(b) -> frozenset:
    return b.sym.tags | (b.source.tags if b.source is not None else frozenset())


def _name(fn) -> str:
    return getattr(fn, "__name__", "") or ""


def _pure_call(b) -> bool:
    """A torch-executor line computing new values from its arguments only (no write, no draw, nothing opaque)."""
    if not isinstance(b.sym, ImplSymbol) or b.has_side_effect or b.draws_random or _tags(b) & _NOT_CONSTANT_TAGS:
        return False
    name = _name(b.sym.fn)
    inplace = name.endswith("_") and not name.endswith("__")  # add_, not __getitem__
    return not inplace and "empty" not in name


def _concrete(o) -> bool:
    return (type(o) is TensorProxy and all(type(n) is int for n in (*o._tt_shape, *o._tt_strides))
            and type(o._tt_storage_offset) is int)


def _constant_lines(lines, refused) -> tuple[list, set]:
    """Indices of the constant lines (those in ``refused`` aside) and the ids of their results."""
    const: set = set()
    found = []
    for i, b in enumerate(lines):
        if i in refused or not _pure_call(b):
            continue
        if any(is_proxy(a) and id(a) not in const for a in b.flat_args()):
            continue
        outs = [o for o in b.flat_outputs() if is_proxy(o)]
        if not outs or not all(_concrete(o) for o in outs):
            continue
        found.append(i)
        const.update(id(o) for o in outs)
    return found, const


def _writes_nothing(b) -> bool:
    """A pure call of a torch function (not a ttex one, which may write into an argument: the "into" kernels), with
    no ``out=`` or ``inplace=True``: it writes none of its arguments, though its results may share their memory."""
    fn = b.sym.fn
    module = getattr(fn, "__module__", None) or getattr(getattr(fn, "__objclass__", None), "__module__", "") or ""
    return (_pure_call(b) and module.startswith("torch") and module != torch_impls.__name__
            and "out" not in b.kwargs and not b.kwargs.get("inplace", False))


def _unsafe_readers(lines, found, const, output) -> set:
    """ids of constant values that must not be kept: those that may be written (a line that may write into an
    argument reads them) or handed out (returned), themselves or through a value that may share their memory
    (a view, a call whose results are not known to be new memory)."""
    constant_lines = set(found)
    roots: dict = {k: {k} for k in const}  # id(value) -> the constant values whose memory it may share
    bad: set = set()
    for i, b in enumerate(lines):
        if i in constant_lines:
            continue
        read = [a for a in b.flat_args() if is_proxy(a) and id(a) in roots]
        if not read or (isinstance(b.sym, FusionSymbol) and getattr(b.sym.fn, "aliases", ()) == ()):
            continue  # a fused kernel reads its inputs, writes new memory (unless written over an input: into_dead_grad.py)
        aliased = None
        if _pure_call(b) and not view_call(b):
            aliased = () if out_form(b) is not None else aliased_args(b)  # an out form's results are new memory
        if aliased == ():
            continue
        if aliased is None and not _writes_nothing(b):
            for a in read:
                bad |= roots[id(a)]
            continue
        # results that may share the memory of what it reads (all of it, or the declared positions)
        shared = set()
        for k, a in enumerate(b.args):
            if is_proxy(a) and id(a) in roots and (aliased is None or k in aliased):
                shared |= roots[id(a)]
        if aliased is None:
            for a in read:
                shared |= roots[id(a)]
        elif shared:  # a ttex kernel writing into a declared position ("into"): it may write them
            bad |= shared
            continue
        for o in aliasing_results(b):
            if is_proxy(o):
                roots[id(o)] = roots.get(id(o), set()) | shared
    for o in tree_flatten(output)[0]:
        if is_proxy(o) and id(o) in roots:
            bad |= roots[id(o)]
    return bad & const


class FoldedConstants:
    """The constant lines of one program as a function, run at its first call; then the same tensors."""

    def __init__(self, fn, n_lines):
        self.fn = fn
        self.n_lines = n_lines
        self._values = None
        self.key = _register(self)

    def values(self) -> tuple:
        v = self._values
        if v is None:
            v = self._values = tuple(self.fn())
        return v


# Printed programs name their block by key: ``ttex.folded_constants(3)``.
_register, folded_constants = torch_impls.numbered_objects("folded_constants")


class _ConstantsLine(Symbol):
    """``(a, b) = ttex.folded_constants(k).values()``, the folded lines printed above it as comments."""

    def __init__(self, block, shown):
        super().__init__("folded_constants", None, module="torch_executor", is_prim=True)
        self.block, self.shown = block, shown

    def format_lines(self, bsym, fmt):
        names = ", ".join(fmt(o) for o in bsym.output)
        lhs = f"({names},)" if len(bsym.output) == 1 else f"({names})"
        head = (f"# {self.block.n_lines} lines computing constants, run at the first call only "
                f"(executors/constants.py):")
        return [head, *(f"#   {line}" for line in self.shown),
                f"{lhs} = ttex.folded_constants({self.block.key}).values()"]

    def codegen_globals(self) -> dict:
        return {"ttex": torch_impls, f"_folded_constants_{self.block.key}": self.block}


def _folded(trc, readers_checked: bool = True):
    """``(found, const, kept, first_reader)``: the indices of the lines ``fold_constants`` computes once, the ids of
    their results, the constant values later lines read (id -> proxy, in order) and the first such reader; None when
    nothing is folded.  ``readers_checked=False``: without refusing the values a line may write or that are
    returned (a guess made before the later passes, for fusion)."""
    lines = trc.bound_symbols
    refused: set = set()
    while True:
        found, const = _constant_lines(lines, refused)
        if not found:
            return None
        bad = _unsafe_readers(lines, found, const, trc.output) if readers_checked else set()
        if not bad:
            break
        refused.update(i for i in found if any(id(o) in bad for o in lines[i].flat_outputs()))
    constant_lines = set(found)
    kept, first_reader = {}, None  # the constant values later lines read, in order
    for i, b in enumerate(lines):
        if i in constant_lines:
            continue
        for a in b.flat_args():
            if is_proxy(a) and id(a) in const and id(a) not in kept:
                kept[id(a)] = a
                first_reader = i if first_reader is None else first_reader
    if not kept or sum(static_nbytes(o) for o in kept.values()) > FOLD_MAX_BYTES:  # (``_concrete`` values)
        return None
    return found, const, kept, first_reader


def constant_line_ids(trc) -> set:
    """ids of the lines of ``trc`` that ``fold_constants`` will likely compute once, once later passes made the final
    program.  Fusion (inductor_fusion.py) leaves them out of its regions: a kernel mixing a mask built from sizes with
    values computed from inputs ran the mask's ops on every call (Falcon's first region), and a region of constants
    alone was no constant line.  Their readers are not checked: before the backward kernels are chosen
    (saved_statistics.py) an attention's mask is read by its ``<op>_vjp`` line, which this pass cannot vouch for;
    a value the final pass refuses after all runs on torch (values unchanged)."""
    folded = _folded(trc, readers_checked=False)
    return set() if folded is None else {id(trc.bound_symbols[i]) for i in folded[0]}


def fold_constants(trc, header=None):
    """The trace with its constant lines computed once (see the module docstring); ``trc`` when there are none."""
    lines = trc.bound_symbols
    folded = _folded(trc)
    if folded is None:
        return trc
    found, const, kept, first_reader = folded
    constant_lines = set(found)
    sub = trc.derive("Constants of the program, computed at its first call (executors/constants.py)")
    sub.fn_name = "constants"
    sub.args = []
    sub.bound_symbols = [lines[i] for i in found]
    sub.output = tuple(kept.values())
    block = FoldedConstants(sub.python_callable(), len(found))
    shown = [s for i in found for s in codegen.format_bsym(lines[i], None, with_subsymbols=False)]
    line = BoundSymbol(_ConstantsLine(block, shown), (), {}, tuple(kept.values()))
    new = trc.derive(header or trc.header)
    for i, b in enumerate(lines):
        if i == first_reader:
            new.bound_symbols.append(line)
        if i not in constant_lines:
            new.bound_symbols.append(b)
    return new
