"""Run one user training scenario eagerly and compiled, step by step, and compare everything a user can see.

A scenario is ``setup(wrap) -> dict`` where ``wrap`` is applied to the model the step calls (the identity, or
``tt.compile`` for the ``model`` mode).  The dict holds ``step`` (the function the user would compile), ``calls``
(a list of argument tuples, one per step), ``modules`` and ``opts`` (compared after each step: parameters,
``.grad``, buffers, optimizer state and hyper-parameters), optionally ``extra`` (a callable returning Python-side
state: logs, counters) and ``between`` (called with the step index after each step: schedulers, pruning).
After every step the returned value, that state and ``torch.get_rng_state()`` must equal eager's.
"""
from __future__ import annotations

import dataclasses
import numbers

import torch

import thunder_train as tt

MODES = {
    "full": dict(),
    "thin": dict(thin=True),
    "nofuse": dict(fusion=None),
    "thin_nofuse": dict(thin=True, fusion=None),
    "model": "model",
}


def _copy(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, dict):
        return {k: _copy(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(_copy(x) for x in v) if not hasattr(v, "_fields") else type(v)(*(_copy(x) for x in v))
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _copy(getattr(v, f.name)) for f in dataclasses.fields(v)}
    return v


def snapshot(out, s):
    snap = {"out": _copy(out), "rng": torch.get_rng_state()}
    for i, m in enumerate(s.get("modules", [])):
        snap[f"m{i}.params"] = {n: _copy(p) for n, p in m.named_parameters()}
        snap[f"m{i}.grads"] = {n: _copy(p.grad) for n, p in m.named_parameters()}
        snap[f"m{i}.requires_grad"] = {n: p.requires_grad for n, p in m.named_parameters()}
        snap[f"m{i}.buffers"] = {n: _copy(b) for n, b in m.named_buffers()}
    for i, o in enumerate(s.get("opts", [])):
        ids = {id(p): j for j, p in enumerate(p for g in o.param_groups for p in g["params"])}
        snap[f"opt{i}.state"] = {ids[id(p)]: _copy(st) for p, st in o.state.items()}
        snap[f"opt{i}.groups"] = [{k: _copy(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
    if "extra" in s:
        snap["extra"] = _copy(s["extra"]())
    return snap


def run(setup, mode, seed=0):
    """Snapshots after each step, or ``(index, exception)`` where a call raised."""
    torch.manual_seed(seed)
    wrap = tt.compile if mode == "model" else (lambda m: m)
    s = setup(wrap)
    step = s["step"]
    if mode not in ("eager", "model"):
        step = tt.compile(step, **MODES[mode])
    snaps = []
    for i, args in enumerate(s["calls"]):
        try:
            out = step(*args)
        except Exception as e:  # noqa: BLE001 - reported to the caller
            return snaps, (i, e)
        snaps.append(snapshot(out, s))
        if "between" in s:
            s["between"](i)
    return snaps, None


def diff(a, b, path="", rtol=1.3e-6, atol=1e-5):
    """The first difference between two snapshots (eager ``a``, compiled ``b``), or None."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path}: {type(a).__name__} vs {type(b).__name__}"
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        if a.dtype in (torch.uint8, torch.bool) or not (a.is_floating_point() or a.is_complex()):
            return None if torch.equal(a, b) else f"{path}: {a} vs {b}"
        if not torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
            return f"{path}: max abs diff {(a - b).abs().max().item():.3g}"
        return None
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            d = diff(a[k], b[k], f"{path}.{k}", rtol, atol)
            if d:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b) or type(a) is not type(b):
            return f"{path}: {type(a).__name__}[{len(a)}] vs {type(b).__name__}[{len(b)}]"
        for i, (x, y) in enumerate(zip(a, b)):
            d = diff(x, y, f"{path}[{i}]", rtol, atol)
            if d:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float):
        if a == b or (a != a and b != b) or abs(a - b) <= atol + rtol * abs(a):
            return None
        return f"{path}: {a!r} vs {b!r}"
    if isinstance(a, numbers.Number) and isinstance(b, numbers.Number) and type(a) is not type(b):
        return f"{path}: {type(a).__name__} {a!r} vs {type(b).__name__} {b!r}"
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def compare(setup, mode, **tol):
    """None when ``mode`` gives eager's snapshots (or eager's error at the same step), else the first difference."""
    ref, ref_err = run(setup, "eager")
    got, err = run(setup, mode)
    for i, (a, b) in enumerate(zip(ref, got)):
        d = diff(a, b, f"step {i}", **tol)
        if d:
            return d
    if err is not None and ref_err is None:
        return f"raised at step {err[0]}: {type(err[1]).__name__}: {err[1]}"
    if ref_err is not None and (err is None or err[0] != ref_err[0]):
        return f"eager raised at step {ref_err[0]} ({ref_err[1]!r}), compiled {err!r}"
    return None


def assert_matches_eager(setup, mode, **tol):
    d = compare(setup, mode, **tol)
    assert d is None, d
