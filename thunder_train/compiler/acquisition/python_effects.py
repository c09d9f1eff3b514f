"""Python-level behaviour a compiled program would not repeat, found while tracing.

Tracing runs the user's Python once; the program then replays only tensor work.  What
would silently go missing — an optimizer the walker never saw, backward hooks our
backward does not call — is an error here that says what to do instead.
"""
from __future__ import annotations

import contextlib

import torch

from .. import context
from ..errors import TracingError
from .traced_autograd import gradient_path
from .provenance import path_str


def needs_grad(st, tensors) -> list:
    """For each of ``tensors`` (current values): whether it requires grad or depends on an input that does."""
    tensors = [st.buffers.read(t) for t in tensors]
    on_path = None if all(t._tt_requires_grad for t in tensors) else gradient_path(st)
    return [t._tt_requires_grad or id(t) in on_path for t in tensors]


def refuse_backward_hooks(st):
    """Python hooks PyTorch's autograd engine would call in the backward: our backward calls none of them.

    Module backward hooks (``register_full_backward_hook``/``_pre_hook``) matter for any gradient of the
    program (a backward inside, or outputs that require grad); gradient hooks on inputs
    (``register_hook``, ``register_post_accumulate_grad_hook``) only for a backward inside the function —
    around ``tt.compile(model)`` PyTorch's engine still runs them when it accumulates ``.grad``.
    """
    inside, walker = st.has_backward, st.walker
    # The autograd path (compiler/pipeline.py, step 9): grad enabled and an input requiring grad.
    outside = torch.is_grad_enabled() and any(
        leaf.kind == "tensor" and leaf.proxy._tt_requires_grad for leaf in walker.leaves)
    if not (inside or outside):
        return
    from torch.nn.modules import module as module_mod

    hooked = [path_str(leaf.path) for leaf in walker.leaves
              if leaf.kind == "module" and (leaf.value._backward_hooks or leaf.value._backward_pre_hooks)]
    if hooked or module_mod._global_backward_hooks or module_mod._global_backward_pre_hooks:
        where = f"on {', '.join(hooked[:3])}" if hooked else "registered globally"
        raise TracingError(
            f"module backward hooks (register_full_backward_hook / register_full_backward_pre_hook) {where} would not "
            "run: thunder_train computes the gradients of a compiled function with its own backward. Remove the hooks "
            "from the compiled part (compile the modules without hooks), or do the hook's work in the training step."
        )
    if not inside:
        return
    hooked = [path_str(leaf.path) for leaf in walker.leaves
              if leaf.kind == "tensor" and leaf.alias_of is None
              and (getattr(leaf.value, "_backward_hooks", None) or getattr(leaf.value, "_post_accumulate_grad_hooks", None))]
    if hooked:
        raise TracingError(
            f"gradient hooks (register_hook / register_post_accumulate_grad_hook) on {', '.join(hooked[:3])} would not run "
            "in a backward inside the compiled function. Compile the forward only (tt.compile(model)) and call backward() "
            "outside — PyTorch's autograd then runs the hooks — or apply the hook's change to .grad inside the step."
        )


@contextlib.contextmanager
def only_walked_optimizers_step(walker):
    """An optimizer the walker never saw (reached through an object it does not walk): its parameters are
    the real tensors, whose ``.grad`` the traced backward does not set, so its step would silently
    update nothing.  Stepping it is an error that says what to do."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    st = context.tracer_state()

    def check(opt, args, kwargs):
        # The hook is global: an optimizer stepping in another thread meanwhile is none of our business.
        if context.tracer_state() is st and id(opt) not in walker.by_id:
            raise TracingError(
                f"{type(opt).__name__}.step() inside a compiled function: the optimizer is not an input of the "
                "function — neither an argument nor a global or closure value the function reads, but reached through "
                "an object thunder_train does not walk (an attribute of a plain object, code in another module) — so its "
                "parameters and state cannot be captured. Pass it as an argument (step(model, opt, x, y)) or read it "
                "from a global or closure of the step."
            )

    handle = register_optimizer_step_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


def refuse_new_leaves_returned(st, trc):
    """A tensor made inside the function and set to require grad (``torch.zeros(3).requires_grad_()``,
    ``x.detach().requires_grad_()``) returned, or a returned value that requires grad through it alone: eager
    returns a tensor requiring grad through a leaf only the function saw; the compiled program's outputs get
    gradients through its inputs only.  Refused where a returned value would silently not require grad.  With a
    backward inside the function (an adversarial example's ``.grad``, a gradient penalty) its outputs carry no graph
    anyway (documented), and such leaves work as in eager."""
    if st.has_backward:
        return
    from .traced_autograd import Forward, grad_leaves, new_leaves

    made = new_leaves(st)
    if not made:
        return
    made_ids = {id(v) for _, vals in made for v in vals}
    bsyms = list(trc.bound_symbols)
    from_made = Forward(bsyms, [v for _, vals in made for v in vals]).needs_grad
    from_inputs = Forward(bsyms, [v for p, vals in grad_leaves(st) if id(vals[0]) not in made_ids for v in vals]).needs_grad
    from ..pytree import tree_flatten

    grad_mode = st.grad_enabled or torch.is_grad_enabled()  # under no_grad nothing computed requires grad
    for o in tree_flatten(trc.output)[0]:
        if id(o) in made_ids or (grad_mode and id(o) in from_made and id(o) not in from_inputs):
            raise TracingError(
                "a value the compiled function returns requires grad through a tensor made inside it "
                "(requires_grad=True, requires_grad_() or .requires_grad = True on a new tensor): eager would return a tensor that requires "
                "grad through a leaf only the function sees, which a compiled program cannot hand out. Create that "
                "tensor outside and pass it in (or register it as a parameter of the module), or return a detached "
                "value.")
