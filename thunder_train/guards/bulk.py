"""A thin binding's per-parameter assumptions checked in one C++ pass (torch's guard trees).

Every thin call checks, for each bound parameter, its metadata (shape, strides, dtype, device,
``requires_grad``), that its ``.grad`` is the bound gradient (or ``None``), and that the optimizer's
state dicts were not modified.  Read from Python, each tensor property costs 45-80 ns on a
1,000-parameter model (a C getset call with a ``__torch_function__`` check per read); torch's own
guard trees (``torch._C._dynamo.guards.RootGuardManager``, what ``torch.compile``'s guards run on)
do all of it in one C++ loop:

* ``TENSOR_MATCH`` on each parameter: dispatch keys, dtype, device, ``requires_grad``, sizes, strides;
* the ``.grad`` accessor with ``NONE_MATCH`` or ``ID_MATCH``;
* ``DICT_VERSION`` on ``optimizer.state`` and on each per-parameter dict: CPython bumps a dict's
  version on every insertion, deletion or replaced value (``clear()``, ``opt.state[p] = {}``,
  ``state['exp_avg'] = t``), not on reads or on assigning the value a key already holds.

These are private torch APIs.  ``supported()`` runs a self-test once (each kind of change must be
caught, and an unchanged object must pass); a kind that fails it, or a torch that lacks the API, makes
``thin.py`` generate the same checks as bulk Python comparisons instead.  Below ``MIN_PARAMS`` bound
parameters the Python comparisons cost a few µs and the C++ pass is not used: its first use imports
``torch._dynamo`` (about 1.5 s, once per process).  ``ENABLED = False`` forces the Python path,
``MIN_PARAMS = 0`` the C++ one (tests run the hazards both ways).
"""
from __future__ import annotations

import torch

ENABLED = True
MIN_PARAMS = 64
_support: frozenset | None = None


def _api():
    from torch._C._dynamo import guards as g
    # The C++ side compares the manager kind with this enum (and imports the module itself otherwise).
    from torch._dynamo.guards import GuardManagerType
    return g, GuardManagerType.GUARD_MANAGER


class BulkCheck:
    """``check()`` is True while every recorded assumption holds; one C++ call however many objects."""

    __slots__ = ("_root", "_objs", "_keep", "check", "n_objects")

    def __init__(self, meta=(), grads=(), dicts=()):
        g, kind = _api()
        root = g.RootGuardManager()
        objs, managers = [], {}

        def manager(o):
            m = managers.get(id(o))
            if m is None:
                m = managers[id(o)] = root.tuple_getitem_manager(len(objs), f"bound[{len(objs)}]", o, kind)
                objs.append(o)
            return m

        for t in meta:
            i = len(objs)
            manager(t).add_tensor_match_guard(t, list(t.shape), list(t.stride()), f"bound{i}", [f"bound tensor {i}"], None,
                                              type(t), torch._C._dispatch_keys(t))
        for owner, expected in grads:
            gm = manager(owner).grad_manager(f"bound[{id(owner)}].grad", expected, kind)
            if expected is None:
                gm.add_none_match_guard([".grad is None"], None)
            else:
                gm.add_id_match_guard(id(expected), [".grad is the bound gradient"], None)
        for d in dicts:
            manager(d).add_dict_version_guard(d, ["dict unchanged"], None)
        self._root, self._objs, self.n_objects = root, tuple(objs), len(objs)
        self._keep = tuple(e for _, e in grads if e is not None)  # ID_MATCH compares ids: keep them alive
        self.check = self._bound_check()

    def _bound_check(self):
        root_check, objs = self._root.check, self._objs
        return lambda: root_check(objs)


def _self_test() -> frozenset:
    """The kinds of check (``meta``, ``grad``, ``dict``) that catch their changes on this torch and Python."""
    ok = set()
    try:
        _api()
    except Exception:  # noqa: BLE001 - no guard trees here: the Python checks are used
        return frozenset()
    try:
        p = torch.nn.Parameter(torch.zeros(2, 3))
        c = BulkCheck(meta=[p])
        fine = c.check()
        p.requires_grad_(False)
        fine &= not c.check()
        p.requires_grad_(True)
        fine &= c.check()
        old = p.data
        for other in (torch.zeros(3, 2).t(), torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, 2)):
            p.data = other
            fine &= not c.check()
        p.data = old
        fine &= c.check()
        if fine:
            ok.add("meta")
    except Exception:  # noqa: BLE001
        pass
    try:
        p = torch.nn.Parameter(torch.zeros(2))
        g0 = torch.ones(2)
        none, same = BulkCheck(grads=[(p, None)]), None
        fine = none.check()
        p.grad = g0
        same = BulkCheck(grads=[(p, g0)])
        fine &= not none.check() and same.check()
        p.grad = torch.ones(2)
        fine &= not same.check()
        p.grad = None
        fine &= none.check() and not same.check()
        if fine:
            ok.add("grad")
    except Exception:  # noqa: BLE001
        pass
    try:
        t = torch.zeros(1)
        fine = True
        for change in (lambda d: d.__setitem__("a", torch.zeros(1)), lambda d: d.pop("a"), lambda d: d.clear(),
                       lambda d: d.__setitem__("b", 1)):
            d = {"a": t}
            c = BulkCheck(dicts=[d])
            d["a"] = t  # the value it already holds: unchanged
            _ = d.get("a"), d.get("z"), list(d.items())
            fine &= c.check()
            change(d)
            fine &= not c.check()
        if fine:
            ok.add("dict")
    except Exception:  # noqa: BLE001
        pass
    return frozenset(ok)


def supported() -> frozenset:
    """Which kinds the C++ pass handles on this torch and Python (empty: it lacks the API)."""
    global _support
    if _support is None:
        _support = _self_test()
    return _support


def kinds_for(n_params: int) -> frozenset:
    """The kinds to check in C++ for a binding of ``n_params`` parameters (empty: all in Python)."""
    if not ENABLED or n_params < MIN_PARAMS:
        return frozenset()
    return supported()
