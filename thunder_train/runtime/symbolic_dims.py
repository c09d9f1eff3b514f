"""Which argument sizes are symbolic: automatic dynamic shapes (``tt.compile(fn)``, ``dynamic=None``).

The first call specialises every size.  When a later call finds no entry and the nearest cached call differs
from it only in sizes (same argument structure, ranks, dtypes, devices, values), those dimensions become
symbolic for the function: ``SymbolicDims`` records them by argument path (``args[2]['input_ids']`` dim 1)
and the retrace makes exactly them ``SizeProxy``s (``acquisition/walker.py`` asks ``dims_at``).  A later
miss on another dimension widens the set.  The structural key of a call (``key``) then leaves those sizes
out (-1, as ``dynamic=True`` does for every size), so a new sequence length finds the symbolic entry with
one dict lookup; entries specialised on a size that is now symbolic can no longer be found and are freed
(``stale``).  Sizes 0 and 1 stay constants in both (they decide broadcasting and emptiness).

Only tensors the structural key sees are tracked: arguments and tensors inside tuples, lists and dicts
(depth 3).  A tensor inside another object (a dataclass, a ``BatchEncoding``) keeps its sizes specialised.

``dynamic=False`` never widens; ``dynamic=True`` makes every size of every argument tensor symbolic.
"""
from __future__ import annotations

from .cache_keys import _T, arg_key, dynamic_arg_key, struct_key

_SEQS = (tuple, list)


def _arg_root(step):
    """The key-path element of a provenance ``Step`` (``Step("arg", 2)`` -> ``("arg", 2)``); None when the
    structural key does not see through it."""
    if step.kind in ("arg", "kwarg", "item", "key"):
        return (step.kind, step.key)
    return None


def _mask(k, dims_here, sub, path):
    """``arg_key`` value ``k`` at ``path`` with the sizes at symbolic dims (≥ 2) replaced by -1."""
    if k[0] == _T:
        dims = dims_here.get(path)
        if not dims:
            return k
        shape = tuple(-1 if i in dims and s >= 2 else s for i, s in enumerate(k[1]))
        return (k[0], shape) + k[2:]
    if k[0] in _SEQS and type(k[1]) is tuple and path in sub:
        return (k[0], tuple(_mask(v, dims_here, sub, path + (("item", i),)) for i, v in enumerate(k[1])))
    if k[0] is dict and type(k[1]) is tuple and path in sub:
        return (k[0], tuple((n, _mask(v, dims_here, sub, path + (("key", n),))) for n, v in k[1]))
    return k


def _canonical(k, dims_here, path) -> bool:
    """``arg_key`` value ``k`` is one ``key`` can produce: -1 exactly at the symbolic dims' sizes ≥ 2."""
    if k[0] == _T:
        dims = dims_here.get(path, ())
        return all((s == -1) == (i in dims and s != 0 and s != 1) for i, s in enumerate(k[1]))
    if k[0] in _SEQS and type(k[1]) is tuple:
        return all(_canonical(v, dims_here, path + (("item", i),)) for i, v in enumerate(k[1]))
    if k[0] is dict and type(k[1]) is tuple:
        return all(_canonical(v, dims_here, path + (("key", n),)) for n, v in k[1])
    return True


def _size_diffs(a, b, path, out) -> bool:
    """Collect ``(path, dim)`` where two ``arg_key`` values differ in a size only; False if anything else differs."""
    if a == b:
        return True
    if a[0] == _T and b[0] == _T:
        if a[2:] != b[2:] or len(a[1]) != len(b[1]):
            return False
        for i, (x, y) in enumerate(zip(a[1], b[1])):
            if x != y:
                if min(x, y) in (0, 1):  # 0 and 1 are specialised: a new program, not a symbolic size
                    return False
                out.append((path, i))
        return True
    if a[0] != b[0] or type(a[1]) is not tuple or type(b[1]) is not tuple or len(a[1]) != len(b[1]):
        return False
    if a[0] in _SEQS:
        return all(_size_diffs(x, y, path + (("item", i),), out) for i, (x, y) in enumerate(zip(a[1], b[1])))
    if a[0] is dict:
        return all(ka == kb and _size_diffs(x, y, path + (("key", ka),), out) for (ka, x), (kb, y) in zip(a[1], b[1]))
    return False


def size_only_diffs(old: tuple, new: tuple):
    """``[(path, dim)]`` where two structural keys differ, when they differ in sizes only; else None."""
    (oa, ok, og), (na, nk, ng) = old, new
    if og != ng or len(oa) != len(na) or tuple(k for k, _ in ok) != tuple(k for k, _ in nk):
        return None
    out: list = []
    for i, (a, b) in enumerate(zip(oa, na)):
        if not _size_diffs(a, b, (("arg", i),), out):
            return None
    for (k, a), (_, b) in zip(ok, nk):
        if not _size_diffs(a, b, (("kwarg", k),), out):
            return None
    return out or None


class SymbolicDims:
    """The symbolic dimensions of one compiled function's arguments, and its structural key under them."""

    def __init__(self, dynamic):
        if dynamic is not None and type(dynamic) is not bool:
            raise ValueError(f"dynamic must be None (automatic), True or False, got {dynamic!r}")
        self.mode = dynamic  # None: automatic; True: every size; False: none
        self.dims: dict = {}  # key path -> frozenset of dims
        self._sub: set = set()  # every proper prefix of a path in dims (where _mask must descend)
        self.gave_up = None  # why automatic dynamic was turned off for this function (a symbolic trace failed)

    # ---- the structural key ----
    def key(self, args, kwargs) -> tuple:
        if self.mode is True:
            return struct_key(args, kwargs, dynamic_arg_key)
        k = struct_key(args, kwargs, arg_key)
        return self.mask(k) if self.dims else k

    def mask(self, skey: tuple) -> tuple:
        a, kw, g = skey
        d, sub = self.dims, self._sub
        return (tuple(_mask(v, d, sub, (("arg", i),)) for i, v in enumerate(a)),
                tuple((n, _mask(v, d, sub, (("kwarg", n),))) for n, v in kw), g)

    # ---- widening ----
    def widen(self, known_keys, skey) -> list:
        """A miss on ``skey``: when a cached key differs from it in sizes only, make those dims symbolic.
        Returns the ``(path, dim)`` pairs added (empty: nothing to widen)."""
        if self.mode is not None or self.gave_up is not None:
            return []
        best = None
        for old in known_keys:
            diffs = size_only_diffs(old, skey)
            if diffs is not None:
                new = [pd for pd in diffs if pd[1] not in self.dims.get(pd[0], ())]
                if new and (best is None or len(new) < len(best)):
                    best = new
        for path, dim in best or ():
            self.dims[path] = self.dims.get(path, frozenset()) | {dim}
            for j in range(1, len(path)):
                self._sub.add(path[:j])
        return best or []

    def stale(self, skey: tuple) -> bool:
        """No call's key can be ``skey`` any more: it is specialised on a size that is now symbolic, or symbolic
        where sizes are specialised (again)."""
        if self.mode is not None:
            return False
        a, kw, _ = skey
        return not (all(_canonical(v, self.dims, (("arg", i),)) for i, v in enumerate(a))
                    and all(_canonical(v, self.dims, (("kwarg", n),)) for n, v in kw))

    def give_up(self, why: str) -> None:
        """A trace with symbolic sizes failed (an op that needs concrete sizes): specialise from now on."""
        self.gave_up = why
        self.dims = {}
        self._sub = set()

    # ---- what the tracer reads ----
    def for_trace(self):
        """``Options.dynamic``: False, True (every size), or this object (``dims_at``) while some dims are symbolic."""
        if self.mode is not None:
            return self.mode
        return self if self.dims else False

    def dims_at(self, steps) -> frozenset:
        """The symbolic dims of the argument tensor at provenance path ``steps`` (empty: none)."""
        path = []
        for s in steps:
            p = _arg_root(s)
            if p is None:
                return frozenset()
            path.append(p)
        return self.dims.get(tuple(path), frozenset())

    def describe(self, arg_names=()) -> list:
        """``"args[2] (batch)['input_ids'] dim 1"`` for each symbolic dim, for messages."""
        out = []
        for path, dims in self.dims.items():
            out += [f"{path_text(path, arg_names)} dim {d}" for d in sorted(dims)]
        return out


def path_text(path, arg_names=()) -> str:
    text = ""
    for kind, k in path:
        if kind == "arg":
            text += f"args[{k}]" + (f" ({arg_names[k]})" if k < len(arg_names) else "")
        elif kind == "kwarg":
            text += f"kwargs[{k!r}]"
        else:
            text += f"[{k!r}]"
    return text


def is_symbolic_trace(dynamic) -> bool:
    return dynamic is True or isinstance(dynamic, SymbolicDims)




def symbolic_fusion_decision(dynamic, arg_names=()) -> str:
    """The ``fusion_decisions`` line of an entry traced with symbolic sizes: the default's background build is not
    started, because the fusion executors compile regions for static sizes only (a region with a symbolic size is
    not fusible, ``executors/inductor_fusion.py``), so a build would fuse nothing."""
    which = "every argument size (dynamic=True)" if dynamic is True else ", ".join(dynamic.describe(arg_names))
    return (f"background fusion: not started: the program has symbolic sizes ({which}); fused regions are compiled for "
            "static sizes only, so the torch program runs. To get fused programs, pad to a few bucket lengths and "
            "pass dynamic=False (one fused program per length, within cache_limit)")
