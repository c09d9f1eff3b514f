"""A torch call repeated on the same arguments while its first result is still alive reads that result instead.

Gradient rules recompute what another rule already computed: RMSNorm's backward (``x.pow(2)``'s rule and the
product's) multiplies the same two tensors twice, ``t301 = torch.mul(t300, t211)`` and a few lines later
``t302 = torch.mul(t300, t211)`` (Llama, Mistral, Qwen2: one line a norm).  The second line is dropped and its
readers read the first result: the same kernel on the same tensors gives the same values, and while the first
result is still read after the second line, keeping it longer frees the second's memory, so the peak does not grow
(a recomputation for the backward, whose first value is dead by then, stays: the memory plan chose it).  A view that
copies nothing goes even where the first is dead: it is its argument's memory, which the second line reads.

Only pure torch calls (``decided_layouts._pure_readers_only``: no in-place op, no ``out=``, no ttex kernel that
may write an argument) with one tensor result go, and only when neither result is returned or read by a line that
may write it; no random, generator-reading or opaque op.  Arguments are compared by identity (proxies) and value
(numbers, tuples, dtypes).
"""
from __future__ import annotations

from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_map
from .buffers import view_call
from .decided_layouts import _pure_readers_only
from .out_forms import reshape_copies
from .torch_executor import ImplSymbol

_NOT_MERGED_TAGS = frozenset({"random", "reads_generator", "side_effect", "inplace", "opaque"})


def _key(b):
    """A hashable description of the call, or None (an argument that is neither a proxy nor a plain constant)."""
    def part(x):
        if is_proxy(x):
            return ("p", id(x))
        if x is None or type(x) in (int, float, bool, str):
            return ("c", type(x).__name__, x)
        if isinstance(x, (tuple, list)):
            inner = tuple(part(e) for e in x)
            return None if any(e is None for e in inner) else (type(x).__name__, inner)
        try:
            hash(x)
        except TypeError:
            return None
        return ("o", type(x).__name__, x)

    args = part(b.args)
    kwargs = part(tuple(sorted(b.kwargs.items())))
    if args is None or kwargs is None:
        return None
    return (b.sym.fn, args, kwargs)


def _candidate(b) -> bool:
    if not isinstance(b.sym, ImplSymbol) or b.has_side_effect or b.draws_random or type(b.output) is not TensorProxy:
        return False
    tags = b.sym.tags | (b.source.tags if b.source is not None else frozenset())
    return not tags & _NOT_MERGED_TAGS


def _true_view(b) -> bool:
    """A view call that makes no copy: its result is its argument's memory, alive at this line (the line reads it), so
    reading the first view instead holds no memory longer, also where that view is dead by now (the backward's two
    ``reshape``s of a value recomputed for it: two view lines a call where the value is not kept, issue 27)."""
    return view_call(b) and not reshape_copies(b)


def merge_duplicates(trc, header=None):
    """The trace with repeated calls reading the first result (see the module docstring); ``trc`` if none."""
    lines = trc.bound_symbols
    last_read: dict = {}
    for i, b in enumerate(lines):
        for a in b.flat_args():
            if is_proxy(a):
                last_read[id(a)] = i
    unsafe = None
    first: dict = {}
    mapping: dict = {}  # id(dropped result) -> the first result
    for i, b in enumerate(lines):
        if not _candidate(b):
            continue
        try:
            key = _key(b)
            hash(key)
        except TypeError:
            continue
        if key is None:
            continue
        prev = first.get(key)
        if prev is None:
            first[key] = b.output
            continue
        if last_read.get(id(prev), -1) <= i and not _true_view(b):  # dead first result: a recomputation the plan chose
            continue
        unsafe = _pure_readers_only(trc) if unsafe is None else unsafe
        if id(prev) in unsafe or id(b.output) in unsafe:
            continue
        mapping[id(b.output)] = prev
    if not mapping:
        return trc
    sub = lambda x: mapping.get(id(x), x) if is_proxy(x) else x  # noqa: E731
    new = trc.derive(header or trc.header)
    for b in lines:
        if id(b.output) in mapping and type(b.output) is TensorProxy:
            continue
        new.bound_symbols.append(b.renamed(mapping))
    new.output = tree_map(sub, trc.output)
    return new
