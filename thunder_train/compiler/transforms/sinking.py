"""Backward lines run as late as their first reader allows, when that frees memory.

A traced backward computes each op's gradients together, in the order autograd visits the ops: a linear's input
gradient (``g @ w``, often the largest array of its layer's backward, e.g. the MLP's ``(tokens, 4 d)``) is made
before its weight gradient, and long before the op that reads it.  With activation checkpointing the lines
recomputing the block's forward land in between (``transforms/remat.py`` puts them right before their first
reader), so that gradient, the recomputed activations and the weight gradient's operands are alive together.

``sink`` moves a pure backward line down to right before the first line that reads one of its results, when
what that keeps alive longer is at most the bytes of the results it defers (so no line in between holds more):
a tensor it reads that is not an input of the program, does not share memory with what it returns and is not read
again at or after the new place lives on to there.  Values do not change (the same lines in another order of
independent lines); a line never moves past a line with a side effect, and lines that draw random numbers or may
raise on values stay where they are.  Runs where the backward recomputes anything (checkpoint regions, a budget;
cheap values where it lowers the planned peak: transforms/memory.py): recomputed lines land right before their first reader, next to gradients
made earlier that nothing reads yet (a dropout MLP's step: 1.00x -> 0.84x eager's peak).
"""
from __future__ import annotations

from ..proxies import TensorProxy
from ..symbols import may_raise_on_values
from .remat import BACKWARD, nbytes
from .remat_policy import is_view


def _movable(b) -> bool:
    outs = b.flat_outputs()
    return (b.region is BACKWARD and bool(outs) and all(type(o) is TensorProxy for o in outs)
            and not b.has_side_effect and not b.draws_random and "reads_generator" not in b.sym.tags
            and not may_raise_on_values(b))


def sink(trc, header="Backward lines moved down to their first reader (transforms/sinking.py)"):
    bsyms = list(trc.bound_symbols)
    n = len(bsyms)
    inputs = {id(a) for a in trc.args}
    root, readers, root_readers, value = {}, {}, {}, {}
    for i, b in enumerate(bsyms):
        args = [a for a in b.flat_args() if type(a) is TensorProxy]
        for a in b.all_reads():  # its decomposition's reads too: lowering may run those lines instead
            if type(a) is TensorProxy:
                readers.setdefault(id(a), []).append(i)
                root_readers.setdefault(root.get(id(a), id(a)), []).append(i)
        for o in b.flat_outputs():
            if type(o) is TensorProxy:
                value.setdefault(id(o), o)
            if type(o) is TensorProxy and id(o) not in root:
                root[id(o)] = root.get(id(args[0]), id(args[0])) if is_view(b) and args else id(o)
    next_effect, nxt = [n] * (n + 1), n
    for i in range(n - 1, -1, -1):
        next_effect[i] = nxt
        if bsyms[i].has_side_effect:
            nxt = i
    key = list(range(n))  # the new order: sorted by (key, original index)
    moved = 0
    for i in range(n - 1, -1, -1):
        b = bsyms[i]
        if not _movable(b):
            continue
        first = [key[r] for o in b.flat_outputs() for r in readers.get(id(o), ())]
        if not first:
            continue
        target = min(first)
        if target <= i + 1 or target > next_effect[i]:
            continue
        mine = {root.get(id(o), id(o)) for o in b.flat_outputs()}
        # Memory read here for the last time lives on to the new place: at most the bytes the move defers, so no
        # line between holds more than before (the input gradient of a linear, made before the weight gradient
        # whose recomputed operand it would sit beside, is worth its incoming gradient's few bytes).
        deferred = sum(nbytes(o) for o in b.flat_outputs() if root.get(id(o), id(o)) == id(o))
        longer = {}
        for a in b.all_reads():
            if type(a) is not TensorProxy:
                continue
            r = root.get(id(a), id(a))
            if r in inputs or r in mine or id(a) in inputs:
                continue
            if not any(j != i and j > i and key[j] >= target for j in root_readers.get(r, ())):
                longer[r] = nbytes(value.get(r, a))
        if sum(longer.values()) <= deferred:
            key[i] = target - 0.5
            moved += 1
    if not moved:
        return trc
    new = trc.derive(header)
    new.bound_symbols = [bsyms[i] for i in sorted(range(n), key=lambda i: (key[i], i))]
    return new
