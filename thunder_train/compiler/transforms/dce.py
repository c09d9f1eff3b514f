"""Dead code elimination: drop bound symbols whose outputs nobody reads, and narrow a kept line to the results
someone reads where its op can skip the others (``Symbol.narrowed``)."""
from __future__ import annotations

from ..proxies import is_proxy
from ..pytree import tree_flatten



def has_side_effect(bsym) -> bool:
    """``bsym.has_side_effect`` (a property of its symbol; symbols.py, opaque.py)."""
    return bsym.has_side_effect


def dce(trc, header="Dead code elimination", *, keep_sizes=False):
    """Drop what nobody reads.  ``keep_sizes``: symbolic sizes in the shapes of live tensors count as read
    (before autograd, whose rules may need them); otherwise an unused shape query disappears."""
    needed = {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}
    kept = []
    for bsym in reversed(trc.bound_symbols):
        outs = [o for o in bsym.flat_outputs() if is_proxy(o)]
        # A random op runs although nobody reads it: eager's draw advances the generator all the same.
        if bsym.has_side_effect or bsym.draws_random or any(id(o) in needed for o in outs):
            if bsym.sym.narrowed is not None and not all(id(o) in needed for o in outs):
                bsym = bsym.sym.narrowed(bsym, lambda o: id(o) in needed)  # its kernel skips the unread results
            kept.append(bsym)
            for a in bsym.flat_args():
                if is_proxy(a):
                    needed.add(id(a))
            _sizes_read_inside(bsym, needed, keep_sizes)
            for o in outs if keep_sizes else ():  # a tensor's symbolic sizes, for a backward that reads them
                for d in getattr(o, "_tt_shape", ()):
                    if type(d) is not int:
                        needed.add(id(d))
    new = trc.derive(header)
    new.bound_symbols = list(reversed(kept))
    return new


def _sizes_read_inside(bsym, needed, keep_sizes=False):
    """Symbolic sizes and hyper-parameter arithmetic a decomposition reads: computed at the top of the
    program (symbols.py), not passed as arguments.  ``keep_sizes``: also the symbolic sizes in the shapes of
    the decomposition's own values (``x[:, 0]`` is a slice of symbolic length, then a squeeze): once autograd
    splits the line into its parts, the backward reads them (a ``reshape`` to the slice's shape)."""
    reads, dims = bsym.sizes_inside()
    needed.update(map(id, reads))
    if keep_sizes:
        needed.update(map(id, dims))
