"""Which forward values the backward recomputes without being asked (transforms/remat.py does it).

Default (``cheap_values``): a value the backward reads is recomputed when its line is cheap (elementwise
prims, views, casts, masks, constants: no reduction, no matmul, nothing random) and every tensor it is
computed from is kept for the backward anyway (or is an input of the program).  The saved set then only
shrinks: the recomputed value's memory is freed after its last forward use, and nothing new is kept.
Matmuls, attention and reductions are kept.  In a program of torch kernels (``fusion=None``, the default's torch
program) a transcendental value (``costly_alone``), and in a fused program one no kernel takes (``costly_even_fused``),
is recomputed only as far as the peak needs (transforms/memory.py ``fewest_costly``).

``memory_budget`` (``budget_values``): the values the default keeps are also recomputed, the cheapest
first per byte saved, until the bytes kept for the backward are at most the budget; where no single value frees
anything (a chain of same-sized elementwise values, each needing the one before it), chains of up to
``_CHAIN_ROOTS`` values back to values kept anyway.
"""
from __future__ import annotations

from ..proxies import TensorProxy, is_proxy
from .remat import traced_size, nbytes, recomputable

_CHEAP_PRIM_TAGS = frozenset({"elementwise", "shape_only", "cheap_to_recompute"})


def cheap(b) -> bool:
    """Elementwise, view, cast or constant all the way down (its decomposition too), or an op that asks to be
    computed again (``Symbol.recompute_in_backward``: an FSDP2 unit's gathered parameters)."""
    again = b.sym.recompute_in_backward
    if again is not None:
        return again(b)
    if b.sym.is_prim:
        return bool(b.sym.tags & _CHEAP_PRIM_TAGS) and "random" not in b.sym.tags
    return bool(b.subsymbols) and all(cheap(s) for s in b.subsymbols)


def costly_alone(b) -> bool:
    """A line whose recomputation, run as a CPU torch kernel of its own (``fusion=None``, and the default's torch
    program: no fused kernel to join), costs the step more than a call's worth of cheap work: a transcendental prim
    in its decomposition.  Over many elements its work costs 1-4 ns an element (the GPT benchmark step's four
    recomputed tanh GELUs, 1 Mi elements each, cost its torch program 3.2 %); over few its call does, and an exact
    GELU's (oneDNN's kernel) is 10 us in a loop and 20-30 us inside a step at 1.5 Ki elements, 2 % of a zoo model's
    step each (docs/memory.md)."""
    outs = [o for o in b.flat_outputs() if type(o) is TensorProxy and o._tt_device.type == "cpu"]
    return bool(outs) and _has_transcendental(b)


def costly_even_fused(b) -> bool:
    """``costly_alone`` for a line no fused kernel takes, which a fused program runs as a torch kernel of its own too:
    one with a symbolic size (executors/inductor_fusion.py ``why_not_in_kernel``; ModernBERT's head's exact GELU over
    its unpadded tokens, 20 us a call)."""
    return costly_alone(b) and any(type(d) is not int for o in b.flat_outputs() if type(o) is TensorProxy
                                   for d in o._tt_shape)


def _has_transcendental(b) -> bool:
    if b.sym.is_prim:
        return "transcendental" in b.sym.tags
    return any(_has_transcendental(s) for s in b.subsymbols)


def is_view(b) -> bool:
    """A line whose result may share its argument's memory: recomputing it frees nothing."""
    if "view" in b.sym.tags:
        return True
    if b.sym.is_prim:
        return "shape_only" in b.sym.tags
    return bool(b.subsymbols) and all(is_view(s) for s in b.subsymbols)


def _pairs_with_forward(b) -> bool:
    """A ``<op>_vjp`` line (transforms/autograd.py ``vjp_symbol``: its ``forward_symbol`` is the op) whose backward
    kernel reuses its forward line's statistics (executors/saved_statistics.py pairs the two by their arguments): a recomputed argument would break the pair and run the op's backward
    through PyTorch's autograd, forward included, so its arguments are kept."""
    op = getattr(b.sym, "forward_symbol", None)
    rewrite = getattr(op, "torch_saved_statistics", None)
    # A pair whose backward kernel may read recomputed copies of the op's inputs (attention, layer norm) stays a pair.
    return rewrite is not None and not getattr(rewrite, "recomputed_inputs_ok", False)


class Saved:
    """The forward values a joint program's backward reads, with their producers."""

    def __init__(self, lines, is_backward, returned_ids, input_ids):
        self.producer = {}
        self.value = {}
        self.read = {}  # id -> proxy, in first backward read order
        self.inputs = set(input_ids)
        alive = set(returned_ids)  # values kept after the backward starts anyway
        seen_backward = False
        for b in lines:
            if is_backward(b):
                seen_backward = True
                if _pairs_with_forward(b):
                    alive.update(id(a) for a in b.flat_args())
                for a in b.all_reads():
                    if id(a) in self.producer and type(a) is TensorProxy:
                        self.read.setdefault(id(a), a)
                continue
            if seen_backward:
                alive.update(id(a) for a in b.all_reads())
            for o in b.flat_outputs():
                if is_proxy(o):
                    self.producer[id(o)] = b
                    self.value[id(o)] = o
        self.alive = alive
        # Storage roots: a view's is its argument's (the values sharing one stay alive while any of them is read).
        self.root = {}
        for b in lines:
            if is_backward(b):
                continue
            args = [a for a in b.flat_args() if type(a) is TensorProxy]
            for o in b.flat_outputs():
                if type(o) is TensorProxy:
                    self.root[id(o)] = self.root.get(id(args[0]), id(args[0])) if is_view(b) and args else id(o)
        self.sharing = {}  # root -> ids of the read values on it
        for k in self.read:
            self.sharing.setdefault(self.root.get(k, k), set()).add(k)

    def shares_memory(self, k) -> bool:
        """Another value the backward reads shares k's memory."""
        return len(self.sharing.get(self.root.get(k, k), ())) > 1

    def stored_bytes(self) -> int:
        """Bytes of the memory the backward reads from the forward (a value and its views counted once)."""
        return sum(nbytes(self.value[r]) for r in self.sharing if r in self.value)


def cheap_values(saved: Saved, chosen: dict | None = None) -> dict:
    """id -> proxy of the values recomputed by default (see the module docstring)."""
    chosen = dict(chosen or {})
    available = lambda a: id(a) in saved.inputs or id(a) in saved.read or id(a) in chosen  # noqa: E731
    changed = True
    while changed:
        changed = False
        for k, p in saved.read.items():
            b = saved.producer[k]
            if k in chosen or k in saved.alive or not cheap(b) or not recomputable(b) or is_view(b) or saved.shares_memory(k):
                continue
            if all(available(a) for a in b.flat_args() if type(a) is TensorProxy):
                chosen[k] = p
                changed = True
    return chosen


def cost(b) -> int:
    """Rough work of recomputing a line: 2·M·N·K for a matmul, one per output element for any other prim."""
    if b.sym.is_prim or not b.subsymbols:
        outs = [o for o in b.flat_outputs() if type(o) is TensorProxy]
        n = sum(nbytes(o) // max(1, o._tt_dtype.torch.itemsize) for o in outs)
        if b.sym.name == "matmul":
            a = next((x for x in b.flat_args() if type(x) is TensorProxy), None)
            return 2 * n * (traced_size(a._tt_shape[-1]) if a is not None and a._tt_shape else 1)
        return max(1, n)
    return sum(cost(s) for s in b.subsymbols)


def budget_values(saved: Saved, target_bytes: float) -> dict:
    """id -> proxy of the values to recompute so that the bytes kept for the backward are at most ``target_bytes``:
    greedily the memory (a value with its views) that frees the most bytes per unit of recompute work, counting
    what its recomputation must keep instead; stops when the target is met or nothing more frees bytes."""
    members: dict = {}  # root -> ids of the forward values on it
    for k, r in saved.root.items():
        members.setdefault(r, set()).add(k)
    kept = {r for r in saved.sharing if r in saved.producer}  # roots kept for the backward (not program inputs)
    chosen: set = set()
    current = sum(nbytes(saved.value[r]) for r in kept)
    while current > target_bytes:
        best = None
        # One value at a time first; chains (``_chain_option``) only where no single value frees anything.
        for options in (_option, _chain_option):
            for r in kept:
                option = options(saved, members, r, kept, chosen)
                if option is not None and option[0] > 0 and (best is None or option[0] / option[1] > best[0] / best[1]):
                    best = option + (r,)
            if best is not None:
                break
        if best is None:
            break
        freed, _, new_kept, group, r = best
        chosen |= group
        kept.discard(r)
        kept |= new_kept
        current -= freed
    return {k: saved.value[k] for r in chosen for k in members[r]}


def _reads_to_keep(saved, members, x, done):
    """(work, roots read) of recomputing root ``x``'s values: the roots their lines read that must be kept or
    recomputed too (not program inputs, not ``x`` itself, not ``done(root)``); None if they cannot be recomputed."""
    if any(k in saved.alive for k in members.get(x, ())):
        return None
    work, reads = 0, set()
    for k in members.get(x, ()):
        b = saved.producer.get(k)
        if b is None or not recomputable(b):
            return None
        work += cost(b)
        for a in b.flat_args():
            if type(a) is not TensorProxy or id(a) in saved.inputs:
                continue
            ra = saved.root.get(id(a))
            # (a view of a program input, such as an expert's weight ``w[e]``, lives on the input's memory: free)
            if ra is None or ra == x or ra not in saved.producer or done(ra):
                continue
            reads.add(ra)
    return work, reads


def _option(saved, members, r, kept, chosen):
    """(bytes freed, work, roots newly kept, roots recomputed) of recomputing root ``r``'s values, or None."""
    found = _reads_to_keep(saved, members, r, lambda ra: ra in chosen or ra in kept)
    if found is None:
        return None
    work, new_kept = found
    freed = nbytes(saved.value[r]) - sum(nbytes(saved.value[x]) for x in new_kept)
    return freed, max(1, work), new_kept, {r}


_CHAIN_ROOTS = 8  # the most values one chain option recomputes


def _chain_option(saved, members, r, kept, chosen):
    """Like ``_option``, but the values ``r``'s recomputation reads that nothing keeps are recomputed as well (up to
    ``_CHAIN_ROOTS`` values), back to values kept anyway or the program's inputs: (bytes freed, work, no roots newly
    kept, the roots recomputed).  A chain of same-sized elementwise values (GELU's ``tanh`` and ``mul`` read by its
    backward) frees nothing one value at a time, since each needs the one before it kept; as a chain from the
    matmul's input, which the linear's gradient keeps anyway, it frees all of them."""
    group, work, todo = set(), 0, [r]
    while todo:
        x = todo.pop()
        if x in group:
            continue
        found = None if len(group) >= _CHAIN_ROOTS else \
            _reads_to_keep(saved, members, x, lambda ra: ra in group or ra in chosen or ra in kept)
        if found is None:
            return None
        group.add(x)
        work += found[0]
        todo.extend(found[1])
    if len(group) == 1:
        return None  # the same as ``_option``
    return nbytes(saved.value[r]), max(1, work), set(), group
