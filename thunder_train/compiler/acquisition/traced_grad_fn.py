"""``t.is_leaf`` and ``t.grad_fn`` while tracing: eager's answers, or a clear error where there is none.

User and library code branches on ``t.grad_fn is None`` (is this a leaf? was it computed with grad?).  A value
computed inside the function that eager's autograd would record (``computed_requires_grad``) answers a
``TracedGradFn``: not None, like eager's node, but the program records no PyTorch node, so reading anything from it
(``name()``, ``next_functions``, ``register_hook``) raises an error saying so.  An input answers with the real
tensor's own ``grad_fn`` (a non-leaf passed in) while the function has not written it; a value that does not require
grad, or a leaf, answers None.  An input whose ``is_leaf`` or ``grad_fn`` the function read is guarded on it: its
``is_leaf`` (``leaf.snapshot = "is_leaf"``), or, where the function was handed the real node of a non-leaf input, the
node's type (``"grad_fn"``: ``type(x.grad_fn).__name__`` and ``x.grad_fn.name()`` answer from it), by the full
prologue (compiler/prologue.py, ``leafness_spec``) and by thin mode's per-call checks (runtime/thin_checks.py).
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
        real = leaf.value
        node = None if getattr(real, "is_leaf", True) or prop == "is_leaf" else (
            real.grad_fn if st.buffers.read(a) is a else TracedGradFn(a._tt_name))
        if leaf.alias_of is None and leaf.snapshot != "grad_fn":
            # Guarded from now on (prologue.leafness_spec, thin_checks): a real node handed out, by its type.
            leaf.snapshot = "grad_fn" if node is not None and not isinstance(node, TracedGradFn) else "is_leaf"
        if prop == "is_leaf":
            return bool(getattr(real, "is_leaf", True))
        return node
    if walker.is_input(a):
        return getter(a)
    is_leaf = not computed_requires_grad(st, a) or any(t is a for t, _ in new_leaves(st))
    if prop == "is_leaf":
        return is_leaf
    return None if is_leaf else TracedGradFn(a._tt_name)
