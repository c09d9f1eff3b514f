"""Shared by the tests of what a compiled function reads from modules (test_module_reads.py, test_held_objects.py):
a function of a module compiled three ways, and its calls checked against eager around changes of the module."""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt

MODES = ("thin", "full", "module")


def _forward(mod, x):
    return mod(x)


def compiled(mode, model, fwd=_forward):
    """``(compiled, call)``: ``call(*args)`` runs ``fwd(model, *args)`` compiled in thin mode (``"thin"``), on the
    full path (``"full"``) or with the module compiled (``"module"``: ``fwd(tt.compile(model), *args)``)."""
    if mode == "module":
        cm = tt.compile(model, fusion=None)
        return cm, (lambda *args: fwd(cm, *args))
    cf = tt.compile(fwd, thin=mode == "thin", fusion=None)
    return cf, (lambda *args: cf(model, *args))


def each_change_matches_eager(call, eager, changes) -> None:
    """For each ``(what, change)``: three calls equal to eager's, bitwise (the entry validated twice: thin mode bound
    to it), the change, then calls equal to eager's again."""
    for what, change in changes:
        for _ in range(3):
            torch.testing.assert_close(call(), eager(), rtol=0, atol=0)
        change()
        torch.testing.assert_close(call(), eager(), rtol=0, atol=0, msg=what)
    for _ in range(2):
        torch.testing.assert_close(call(), eager(), rtol=0, atol=0)


def classes_left_as_they_were(m, x, classes) -> None:
    """A trace of ``m(x)`` that succeeds and one that fails (the user's error) leave ``classes`` as they were."""
    before = {c: dict(vars(c)) for c in classes}
    tt.compile(_forward, fusion=None)(m, x)

    def fails(mod, x):
        mod(x)
        raise ValueError("the user's error")

    with pytest.raises(ValueError, match="the user's error"):
        tt.compile(fails, fusion=None)(m, x)
    assert {c: dict(vars(c)) for c in classes} == before


def retraced_for(cf, labels) -> None:
    """Each of ``labels`` is named by one of ``cf``'s retrace reasons (what changed, where)."""
    reasons = " ".join(tt.compile_stats(cf).retrace_reasons)
    for label in labels:
        assert label in reasons, (label, reasons)
