"""Which values stand for an input tensor in a backward: ``requires_grad`` acts where eager's does.

Functionalization (``compiler/functional.py``) gives an input a new value proxy at every in-place update.
Eager's autograd records, at each op, whether the leaf requires grad *at that moment*, and at backward time
accumulates into the leaf's ``.grad`` what reached it along any recorded path, if it requires grad then.  So
for each input this keeps the values that stood for it while it required grad (its *stand-ins*):

* the input itself, if it required grad when the call began;
* the new value of each ``torch.no_grad()`` update made while it requires grad (cut from the values it was
  computed from, so a gradient reaches the input once, through the stand-in);
* on ``requires_grad_(True)``, its current value (a fresh alias if ops already read that value while it was
  frozen: those ops carry no gradient, as in eager).

``requires_grad_(False)`` makes the current value an alias that is no stand-in, so ops while frozen carry no
gradient; unfreezing without an update in between goes back to the stand-in.  A backward differentiates with
respect to every stand-in of every input that requires grad at that point and sums them per input
(``traced_autograd``).  Aliases are ``prims.stop_gradient`` lines, which whole-step programs drop
(``transforms/no_grad.py``); the write-back of an input resolves them (``Buffers.final_writes``).
"""
from __future__ import annotations

from .. import prims
from ..proxies import TensorProxy
from .traced_autograd import gradient_path


class LeafValues:
    def __init__(self, st):
        self.st = st  # the TracerState
        self._stand_ins: dict = {}  # id(input) -> [values]
        self._frozen_from: dict = {}  # id(input) -> (alias made at the freeze, the value it aliases)

    def _ensure(self, p) -> list:
        vals = self._stand_ins.get(id(p))
        if vals is None:
            vals = self._stand_ins[id(p)] = [p] if p._tt_requires_grad else []
        return vals

    def tracks(self, p) -> bool:
        return self._tracked(p)

    def _tracked(self, p) -> bool:
        st = self.st
        return type(p) is TensorProxy and p._tt_dtype.is_float and st.walker is not None and st.walker.is_input(p)

    def stand_ins(self, p) -> list:
        """The values a backward now differentiates for the input ``p`` (none if it does not require grad)."""
        if not p._tt_requires_grad:
            return []
        return list(self._ensure(p))

    def requires_grad(self, p) -> bool:
        """``p.requires_grad``: its leaf flag, or True after an update with a value requiring grad (no leaf then)."""
        if p._tt_requires_grad:
            return True
        cur = self.st.buffers.read(p)
        return cur is not p and id(cur) in gradient_path(self.st)

    def _alias(self, p, value):
        alias = prims.stop_gradient(value)
        self.st.buffers.alias(p, alias, value)
        return alias

    # ---- events ----
    def written(self, base):
        """``base`` (an input) got a new value from an in-place update."""
        if not self._tracked(base):
            return
        vals = self._ensure(base)
        self._frozen_from.pop(id(base), None)
        if base._tt_requires_grad:  # a no_grad update (one with grad enabled raised): the new value stands for it
            cur = self.st.buffers.read(base)
            if not _is_cut(self.st.trace, cur):
                cur = self._alias(base, cur)
            vals.append(cur)

    def set_flag(self, p, flag: bool, detach: bool = False):
        """``p.requires_grad_(flag)`` (or ``p.detach_()``) on an input, before its flag changes."""
        if not self._tracked(p):
            return
        vals = self._ensure(p)
        buffers = self.st.buffers
        cur = buffers.read(p)
        if not flag:
            if not self.requires_grad(p):
                return
            if not p._tt_requires_grad and not detach:  # updated with a value requiring grad: no leaf
                raise RuntimeError(
                    "you can only change requires_grad flags of leaf variables. If you want to use a computed variable "
                    "in a subgraph that doesn't require differentiation use var_no_grad = var.detach().")
            alias = self._alias(p, cur)  # ops from here on read a value that is no stand-in
            if p._tt_requires_grad:
                self._frozen_from[id(p)] = (alias, cur)
            return
        if p._tt_requires_grad:
            return
        frozen = self._frozen_from.pop(id(p), None)
        if frozen is not None and frozen[0] is cur and any(v is frozen[1] for v in vals):
            buffers.alias(p, frozen[1], None)  # unfrozen with no update in between: the stand-in again
            return
        if _read_by_trace(self.st.trace, cur):
            cur = self._alias(p, cur)
        vals.append(cur)


def _is_cut(trc, value) -> bool:
    """``value`` is a ``stop_gradient`` result (the producer is searched from the end: it is usually the last line)."""
    for b in reversed(trc.bound_symbols):
        if b.output is value:
            return b.sym is prims.stop_gradient
    return False


def _read_by_trace(trc, value) -> bool:
    return any(a is value for b in trc.bound_symbols for a in b.flat_args())
