"""C++ checks of many tensors' metadata and of dicts, from torch's guard library.

Used at call time by thin bindings (runtime/thin_checks.py) and by fused kernels before they run
(executors/layout_check.py).  Every thin call checks, for each bound parameter, its metadata (shape, strides, dtype, device,
``requires_grad``) and that the optimizer's state dicts were not modified.  Read from Python, each
tensor property costs 45-80 ns (a C getset call with a ``__torch_function__`` check per read, and a
new tuple per ``stride()``); two pieces of ``torch._C._dynamo.guards`` (what ``torch.compile``'s
guards run on; importing them does not import ``torch._dynamo``) do it in C++:

* ``TensorGuards(*params).check(*params)``: dispatch keys, dtype, device, ``requires_grad``, sizes and
  strides of every parameter in one call (it also sees ``p.data = t`` with another dtype or shape before
  the computation runs);
* ``dict_version(d)``: CPython's per-dict version tag, bumped on every insertion, deletion or replaced
  value (``clear()``, ``opt.state[p] = {}``, ``state['exp_avg'] = t``), not on reads or on assigning
  the value a key already holds.  One integer per dict replaces comparing each dict with a copy.

These are private torch APIs.  ``supported()`` runs a self-test once (each kind of change must be
caught, an unchanged object must pass); a kind that fails it, or a torch or Python that lacks it,
makes ``runtime/thin.py`` generate the same checks as bulk Python comparisons instead (and fused kernels keep
Inductor's own asserts).  ``ENABLED = False`` forces that path (the hazard tests run both).
"""
from __future__ import annotations

import torch

ENABLED = True
_support: frozenset | None = None


def _guards():
    from torch._C._dynamo import guards
    return guards


def tensor_meta_check(tensors):
    """A callable: ``check(*tensors)`` is True while every tensor keeps its metadata and ``requires_grad``."""
    tensors = list(tensors)
    tg = _guards().TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                                dynamic_dims_strides=[list(t.stride()) for t in tensors])
    return tg.check


def dict_version():
    return _guards().dict_version


def _meta_ok() -> bool:
    p = torch.nn.Parameter(torch.zeros(2, 3))
    check = tensor_meta_check([p])
    fine = check(p)
    p.requires_grad_(False)
    fine &= not check(p)
    p.requires_grad_(True)
    fine &= check(p)
    old = p.data
    for other in (torch.zeros(3, 2).t(), torch.zeros(2, 3, dtype=torch.float64), torch.zeros(3, 2), torch.zeros(2, 3, 1)):
        p.data = other
        fine &= not check(p)
    p.data = old
    return fine and check(p) and not check(torch.nn.Parameter(torch.zeros(2, 3)).t())


def _dict_ok() -> bool:
    version = dict_version()
    t = torch.zeros(1)
    fine = True
    for change in (lambda d: d.__setitem__("a", torch.zeros(1)), lambda d: d.pop("a"), lambda d: d.clear(),
                   lambda d: d.__setitem__("b", 1), lambda d: d.update(a=t, c=2)):
        d = {"a": t}
        v = version(d)
        d["a"] = t  # the value it already holds: unchanged
        _ = d.get("a"), d.get("z"), list(d.items())
        fine &= version(d) == v
        change(d)
        fine &= version(d) != v
    return fine


def supported() -> frozenset:
    """Which kinds (``meta``, ``dict``) the C++ checks handle here (empty when ``ENABLED`` is False)."""
    global _support
    if not ENABLED:
        return frozenset()
    if _support is None:
        ok = set()
        for kind, test in (("meta", _meta_ok), ("dict", _dict_ok)):
            try:
                if test():
                    ok.add(kind)
            except Exception:  # noqa: BLE001 - not on this torch/Python: the Python checks are used
                pass
        _support = frozenset(ok)
    return _support
