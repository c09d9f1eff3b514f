"""Optimizer updates as soon as their gradient is final: each parameter's gradient is freed during the backward.

A whole training step computes every parameter's gradient in the backward and updates all parameters after
it, in one multi-tensor line per param group (``adam_update(params, grads, ...)``, its step counters'
``_foreach_add``).  All gradients are then alive together at the end of the backward: for a language model the
size of the model (the GPT benchmark step: 20 MiB, more than everything else a checkpointed step keeps).

Here such a line (its op declares ``Symbol.splits_by_index``: result ``i`` depends only on the ``i``-th entry
of every list argument) is split into one line per parameter, and each line runs right after the last line it
needs: its gradient's final line (which runs last in the backward for the first layers, first for the last
ones), the last read of the parameter's and its state's old values, and the last line that may raise on
values (``compiler/symbols.py`` ``may_raise_on_values``: a call stays transactional, and the update then runs in place).
The lines that come after the backward and that an update reads (``grad_layout``, the step counters' increment,
arithmetic on hyper-parameters) move with it when they are pure.  Values are unchanged: each parameter's
update is the same function of the same values (torch's multi-tensor optimizer kernels update each tensor on its
own, and a line per parameter calls them per parameter: ``tests/test_memory.py`` checks the step bitwise
against eager's), and nothing the update overwrites is read after it.

Small gradients stay where the update was: moving an update frees its gradient earlier, but costs a kernel
call of its own (about 3-5 us on the CPU, more than a small tensor's update itself).  The updates whose
gradients are smallest, up to ``HOLD_BACK_BYTES`` of gradients in all, run together after the backward, as one
multi-tensor line as before (the zoo's tiny models: every update, one kernel call instead of 21); the peak grows
by at most that much.

On CUDA a kernel call costs more than on the CPU (a launch, and a multi-tensor kernel's own set-up: GPT-2-124M's bf16
step spent 2.5 ms of device time in 56 update kernels, where eager's 9 took 1.4 ms; H200, session 28), and a
gradient read right after it is made gains nothing from a cache.  There the moving updates of one line run in
groups of consecutive parameters (the model's order: the backward finishes them close together) holding at least
``CUDA_GROUP_BYTES`` of gradients each, one call per group, placed after the last gradient of the group; the
peak grows by at most about that much.
"""
from __future__ import annotations

from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten
from ..symbols import may_raise_on_values as _fallible
from .remat import BACKWARD
from .remat_policy import is_view, nbytes

# Gradients (intermediates an update reads) of at most this many bytes in all stay with the update after the backward.
HOLD_BACK_BYTES = 1 << 20
# On CUDA, the moving updates of one line run in groups of at least this many bytes of gradients (see above).
CUDA_GROUP_BYTES = 32 << 20


def _pure(b) -> bool:
    return not b.has_side_effect and "random" not in b.sym.tags and not b.sym.runs_opaquely


def _slice(x, i, n):
    """Entry ``i`` of a list (argument or result) as a one-entry list, an empty list as it is, a tuple of lists
    entry by entry, anything else as it is; None for a list of another length."""
    if isinstance(x, list):
        return [] if not x else [x[i]] if len(x) == n else None
    if isinstance(x, tuple) and any(isinstance(e, list) for e in x):
        parts = tuple(_slice(e, i, n) for e in x)
        return None if any(p is None for p in parts) else parts
    return x


def _lists(x) -> list:
    """The lists in an argument or result (itself a list, or a tuple of lists)."""
    if isinstance(x, list):
        return [x]
    if isinstance(x, tuple):
        return [e for e in x if isinstance(e, list)]
    return []


def split_by_index(b) -> list | None:
    """``b`` as one line per list index, each with the part of ``b``'s decomposition that computes it; None when it
    does not split that way (lists of different lengths, a list in a keyword argument, a line of the decomposition
    reading the values of two indices or of none)."""
    lengths = {len(x) for a in (*b.args, b.output) for x in _lists(a) if x}
    if len(lengths) != 1 or any(_lists(v) for v in b.kwargs.values()):
        return None
    (n,) = lengths
    if n < 2:
        return None
    owner: dict = {}
    for a in b.args:
        for x in _lists(a):
            for i, v in enumerate(x):
                if is_proxy(v):
                    if owner.setdefault(id(v), i) != i:
                        return None
    parts: list = [[] for _ in range(n)]
    for s in b.subsymbols:
        mine = {owner[id(a)] for a in s.all_reads() if id(a) in owner}
        if len(mine) != 1:
            return None
        (i,) = mine
        parts[i].append(s)
        for o in s.flat_outputs():
            if is_proxy(o):
                owner[id(o)] = i
    # A line recorded without its decomposition (``Symbol.results_without_decomposition``) splits by the op's
    # declaration alone (``splits_by_index``: result i depends only on entry i of every list).
    for x in _lists(b.output) if b.subsymbols else ():
        if x and any(owner.get(id(v)) != i for i, v in enumerate(x)):
            return None
    pieces = []
    for i in range(n):
        args = tuple(_slice(a, i, n) for a in b.args)
        out = _slice(b.output, i, n)
        if out is None or any(a is None for a in args):
            return None
        pieces.append(b.replace(args=args, output=out, subsymbols=tuple(parts[i])))
    return pieces


def update_when_final(trc, header="Optimizer updates run as soon as their gradients are final (transforms/early_updates.py)",
                      hold_back_bytes=None, group_bytes=None):
    """The whole step ``trc`` (backward lines marked ``BACKWARD``) with each per-index line after the backward split
    and moved up to the last line it needs; ``trc`` itself when nothing moves.  ``hold_back_bytes`` (None:
    ``HOLD_BACK_BYTES``): how much of the smallest gradients stay for one update call after the backward (0 where the
    program asks for memory: checkpoint regions or a budget).  ``group_bytes`` (None: by the gradients' device,
    ``CUDA_GROUP_BYTES`` on CUDA, 0 elsewhere): the least bytes of gradients one moving update call holds."""
    lines = list(trc.bound_symbols)
    last_bw = max((i for i, b in enumerate(lines) if b.region is BACKWARD), default=None)
    if last_bw is None:
        return trc
    # Nothing moves above the backward's first line: the forward reads every parameter, and when a call's inputs
    # are not what the program was traced for (thin mode's Python checks see layouts and flags, not dtypes), the
    # forward is where it raises, before anything is updated.
    first_bw = min(i for i, b in enumerate(lines) if b.region is BACKWARD)
    targets = {}
    for i in range(last_bw + 1, len(lines)):
        b = lines[i]
        if getattr(b.sym, "splits_by_index", False) and _pure(b):
            pieces = split_by_index(b)
            if pieces is not None:
                targets[i] = pieces
    if not targets:
        return trc
    inputs = {id(a) for a in trc.args if type(a) is TensorProxy}
    producer = {}
    for i, b in enumerate(lines):
        for o in b.flat_outputs():
            if is_proxy(o):
                producer[id(o)] = i
    readers: dict = {}  # id(input) -> lines reading its old value, through a view of it too (write-backs aside)
    writers: dict = {}  # id(input) -> write-backs into it
    barriers = []  # lines that may raise on values, or act on something else than their results
    views: dict = {i: {i} for i in inputs}  # id(value) -> the inputs whose memory it may share
    for i, b in enumerate(lines):
        dst = b.args[1] if b.sym.name == "copy_" and len(b.args) == 2 and type(b.args[1]) is TensorProxy else None
        if dst is not None and id(dst) in inputs:
            writers.setdefault(id(dst), []).append(i)
        elif _fallible(b) or not _pure(b):
            barriers.append(i)
        shared = set()
        for a in b.all_reads():
            if a is not dst:
                for k in views.get(id(a), ()):
                    readers.setdefault(k, []).append(i)
            shared |= views.get(id(a), set())
        if shared and is_view(b):
            for o in b.flat_outputs():
                if type(o) is TensorProxy:
                    views[id(o)] = shared

    anchor: dict = {}  # moved original line -> the fixed line it now follows
    made_by: dict = {}  # id(result of a placed piece) -> the fixed line that piece follows
    moved_after: dict = {}  # fixed line index (-1: the start) -> lines moved after it, in order
    moved: set = set(targets)

    def movable(k) -> bool:
        return k > last_bw and k not in targets and _pure(lines[k]) and not _fallible(lines[k])

    def after(k) -> int:
        return anchor[k] if k in anchor else k

    def place(line, origin) -> int:
        """Emit ``line`` (at ``origin`` in the program) right after the latest earlier line it must follow: where
        its inputs are computed (producers after the backward move first), the write-backs into and the reads
        of the inputs it may overwrite, the lines that may raise or act on something else than their results."""
        at = -1
        for a in line.all_reads():
            if id(a) in made_by:
                at = max(at, made_by[id(a)])
                continue
            p = producer.get(id(a))
            if p is None or p >= origin:
                continue
            if p not in moved and movable(p):
                moved.add(p)
                anchor[p] = place(lines[p], p)
            at = max(at, after(p))
        for a in line.flat_args():
            if type(a) is TensorProxy and id(a) in inputs:
                at = max([at] + [after(r) for r in readers.get(id(a), ()) if r < origin and r not in targets])
                at = max([at] + [w for w in writers.get(id(a), ()) if w < origin])
        at = max([at, first_bw] + [f for f in barriers if f < origin and f not in anchor])
        moved_after.setdefault(at, []).append(line)
        return at

    held = _held_back(targets, inputs, HOLD_BACK_BYTES if hold_back_bytes is None else hold_back_bytes)
    held |= _unneeded_early(targets, held, inputs, lines, last_bw)
    origin: dict = {}
    for i, pieces in targets.items():
        for piece in _grouped(pieces, held, inputs, group_bytes):
            if id(piece) in held:  # stays after the backward, where the line was
                at = i
                moved_after.setdefault(at, []).append(piece)
            else:
                at = place(piece, i)
            origin[id(piece)] = i
            made_by.update((id(o), at) for o in piece.flat_outputs() if is_proxy(o))
    if all(at >= last_bw for at in moved_after):
        return trc
    for merge in (True, False):
        out = []
        for i in range(-1, len(lines)):
            if i >= 0 and i not in moved:
                out.append(lines[i])
            seq = moved_after.get(i, [])
            out.extend(_merged(seq, origin) if merge else seq)
        new = trc.derive(header)
        new.bound_symbols = out
        if _in_order(new):
            return new
    raise AssertionError("thunder_train internal error: early optimizer updates reordered a line before a value it reads")


def _gradients(piece, inputs) -> list:
    """The intermediates (gradients) a piece reads, each once."""
    return list({id(a): a for a in piece.flat_args() if type(a) is TensorProxy and id(a) not in inputs}.values())


def _held_back(targets, inputs, limit) -> set:
    """ids of the pieces that stay after the backward: those reading intermediates (gradients), smallest first,
    while their intermediates add up to at most ``HOLD_BACK_BYTES``.  A piece reading only inputs (a step
    counter's increment) moves, as the updates reading its result may."""
    sized = []
    for pieces in targets.values():
        for piece in pieces:
            own = _gradients(piece, inputs)
            if own:
                sized.append((sum(nbytes(a) for a in own), id(piece)))
    held, total = set(), 0
    for size, key in sorted(sized, key=lambda x: x[0]):
        if total + size > limit:
            break
        total += size
        held.add(key)
    return held


def _grouped(pieces, held, inputs, group_bytes) -> list:
    """``pieces`` (one line's, in index order) with its moving pieces that read gradients joined into groups of
    consecutive ones holding at least ``group_bytes`` of them (the last group may hold less); the others as they are.
    ``group_bytes`` None: ``CUDA_GROUP_BYTES`` for gradients on CUDA, else no groups."""
    grads = {id(p): _gradients(p, inputs) for p in pieces}
    if group_bytes is None:
        devices = {a._tt_device.type for g in grads.values() for a in g}
        group_bytes = CUDA_GROUP_BYTES if devices == {"cuda"} else 0
    if group_bytes <= 0:
        return pieces
    out, group, size = [], [], 0
    for p in pieces:
        if id(p) in held or not grads[id(p)]:
            out.append(p)
            continue
        group.append(p)
        size += sum(nbytes(a) for a in grads[id(p)])
        if size >= group_bytes:
            out.append(_join(group))
            group, size = [], 0
    if group:
        out.append(_join(group))
    return out


def _unneeded_early(targets, held, inputs, lines, last_bw) -> set:
    """ids of the pieces reading only inputs (a step counter's increment) that no moving update needs: no piece that
    moves reads their results, directly or through the lines after the backward that it reads.  They stay after the
    backward with the updates that read them: moved up for nothing, a step counter's increment sat before lines that
    a later pass moves down (executors/sums_in_place.py), among them one that may raise, after which re-inplacing
    no longer ran it in place (a copy back into every counter, each step: the zoo's Falcon step)."""
    producer = {}
    for k in range(last_bw + 1, len(lines)):
        if k not in targets:
            for o in lines[k].flat_outputs():
                if is_proxy(o):
                    producer[id(o)] = k
    needed, todo, seen = set(), [], set()
    for pieces in targets.values():
        for piece in pieces:
            if id(piece) not in held and _gradients(piece, inputs):
                todo.extend(piece.all_reads())
    while todo:
        a = todo.pop()
        if id(a) in needed:
            continue
        needed.add(id(a))
        k = producer.get(id(a))
        if k is not None and k not in seen:
            seen.add(k)
            todo.extend(lines[k].all_reads())
    return {id(piece) for pieces in targets.values() for piece in pieces
            if not _gradients(piece, inputs)
            and not any(is_proxy(o) and id(o) in needed for o in piece.flat_outputs())}


def _merged(seq, origin) -> list:
    """The pieces of one line that follow the same line as one line again (one multi-tensor kernel call), where
    the last of them was."""
    last = {origin[id(b)]: j for j, b in enumerate(seq) if id(b) in origin}
    groups: dict = {}
    out = []
    for j, b in enumerate(seq):
        o = origin.get(id(b))
        if o is None:
            out.append(b)
            continue
        groups.setdefault(o, []).append(b)
        if j == last[o]:
            out.append(_join(groups[o]))
    return out


def _join(pieces):
    """One line computing what ``pieces`` (one-index lines of one line, in index order) compute."""
    if len(pieces) == 1:
        return pieces[0]

    def cat(xs):
        if isinstance(xs[0], list):
            return [v for x in xs for v in x]
        if isinstance(xs[0], tuple) and any(isinstance(e, list) for e in xs[0]):
            return tuple(cat([x[k] for x in xs]) for k in range(len(xs[0])))
        return xs[0]

    first = pieces[0]
    return first.replace(args=tuple(cat([p.args[k] for p in pieces]) for k in range(len(first.args))),
                         output=cat([p.output for p in pieces]),
                         subsymbols=tuple(s for p in pieces for s in p.subsymbols))


def _in_order(trc) -> bool:
    """Every value a line reads is an input or computed by an earlier line (or by itself)."""
    position = {}
    for j, b in enumerate(trc.bound_symbols):
        for o in b.flat_outputs():
            if is_proxy(o):
                position[id(o)] = j
    return all(position.get(id(a), -1) <= j for j, b in enumerate(trc.bound_symbols) for a in b.all_reads())
