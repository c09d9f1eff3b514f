"""``t.is_leaf`` and ``t.grad_fn`` while tracing: eager's answers, or a clear error where there is none.

User and library code branches on ``t.grad_fn is None`` (is this a leaf? was it computed with grad?).  A value
computed inside the function that eager's autograd would record (``computed_requires_grad``) answers a
``TracedGradFn``: not None, like eager's node, but the program records no PyTorch node, so reading anything from it
(``name()``, ``next_functions``, ``register_hook``) raises an error saying so.  An input answers with the real
tensor's own ``grad_fn`` (a non-leaf passed in) while the function has not written it; a value that does not require
grad, or a leaf, answers None.  The full prologue then guards the input's ``is_leaf``; thin mode's per-call checks
do not (a non-leaf tensor passed where the traced call passed a leaf, or the reverse, keeps the traced answer).
"""
from __future__ import annotations

from ..errors import TracingError


class TracedGradFn:
    """Stands for the autograd node eager would attach to a value computed inside the compiled function."""

    __slots__ = ("_value",)

    def __init__(self, value_name: str):
        self._value = value_name

    def _refuse(self, what):
        raise TracingError(
            f"{what} of the grad_fn of {self._value}, a value computed inside the compiled function: thunder_train "
            "records no PyTorch autograd node while tracing (its own backward computes the gradients), so only "
            "`grad_fn is None` / `is not None` is answered (as eager). Read the node outside the compiled function.")

    def name(self):
        self._refuse("name()")

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse(f".{attr}")

    def __call__(self, *args, **kwargs):
        self._refuse("calling")

    def __repr__(self):
        return f"<grad_fn of {self._value} (traced: thunder_train records no PyTorch node)>"


def answer(st, a, prop, getter, computed_requires_grad, new_leaves):
    """``a.is_leaf`` or ``a.grad_fn`` (``a``: the user's tensor proxy)."""
    walker = st.walker
    if walker is None or computed_requires_grad is None:
        return getter(a)
    leaf = walker.leaf_of(a) if walker.is_input(a) else None
    if leaf is not None and leaf.kind == "tensor":
        if leaf.alias_of is None:
            leaf.snapshot = "is_leaf"  # the prologue guards it (compiler/prologue.py); thin mode does not check it
        real = leaf.value
        if getattr(real, "is_leaf", True):
            return True if prop == "is_leaf" else None
        if prop == "is_leaf":
            return False
        return real.grad_fn if st.buffers.read(a) is a else TracedGradFn(a._tt_name)
    if walker.is_input(a):
        return getter(a)
    is_leaf = not computed_requires_grad(st, a) or any(t is a for t, _ in new_leaves(st))
    if prop == "is_leaf":
        return is_leaf
    return None if is_leaf else TracedGradFn(a._tt_name)
