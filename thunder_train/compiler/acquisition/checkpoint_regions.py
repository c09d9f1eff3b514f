"""Activation-checkpoint regions while tracing: which lines ``torch.utils.checkpoint`` ran.

The tracer runs the user's code on proxies, so torch's checkpoint machinery runs but never acts: its
saved-tensor hooks see no autograd graph, and its dispatch modes see no aten op.  Its *presence* is what
counts.  Every top-level line recorded while a checkpoint region is open gets a ``Mark`` (``bsym.region``,
transforms/remat.py), and the memory planner recomputes the marked values in the backward instead of
keeping them.  How each form is seen:

* non-reentrant ``checkpoint(fn, ..., use_reentrant=False)`` (also ``checkpoint_sequential`` and
  transformers' ``gradient_checkpointing_enable()``): the top of autograd's saved-tensor hooks stack is
  the region's ``_checkpoint_hook`` (one per call, so one region per call); a random op inside one with
  ``preserve_rng_state=False`` is refused (eager's backward draws other numbers than its forward);
* reentrant ``checkpoint(fn, ..., use_reentrant=True)``: ``CheckpointFunction.apply`` is traced as a call
  of ``fn`` with grad enabled inside an explicit region (``reentrant``, opened by checkpoint.py), which is what
  eager's values are: eager runs ``fn`` without grad, then again with grad in the backward;
* selective checkpointing (``context_fn=partial(create_selective_checkpoint_contexts, policy)``): the
  policy's ``_CachingTorchDispatchMode`` is on the dispatch-mode stack; each line asks the policy about the
  aten ops its torch function runs (on meta tensors), and a line with an op the policy saves is saved.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import weakref

from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from .. import context, symbols
from ..errors import TracingError
from ..proxies import TensorProxy, meta_tensor
from ..pytree import tree_map
from ..transforms.remat import Mark
from .ambient import top_pack_hook

_numbers = itertools.count()
_regions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # a checkpoint call's pack hook -> its number
_explicit: list = []  # regions opened by ``reentrant`` (innermost last)


def _torch_checkpoint_hook():
    """The pack hook of the innermost non-reentrant checkpoint region, or None."""
    pack = top_pack_hook()
    if getattr(pack, "__module__", None) == "torch.utils.checkpoint" and pack.__qualname__.startswith("_checkpoint_hook."):
        return pack
    return None


def _selective_policy():
    for mode in reversed(_get_current_dispatch_mode_stack()):
        if type(mode).__name__ == "_CachingTorchDispatchMode" and type(mode).__module__ == "torch.utils.checkpoint":
            return mode.policy_fn
    return None


def _region_number():
    pack = _torch_checkpoint_hook()
    if pack is not None:
        n = _regions.get(pack)
        if n is None:
            n = _regions[pack] = next(_numbers)
        return n
    return _explicit[-1] if _explicit else None


def _preserves_rng_state(pack):
    """The ``preserve_rng_state`` of the non-reentrant checkpoint call whose pack hook is ``pack`` (its frame's
    recomputation closes over it), or None where torch's closures do not say."""
    recompute = getattr(_closed_over(pack, "frame"), "recompute_fn", None)
    return _closed_over(recompute, "preserve_rng_state") if inspect.isfunction(recompute) else None


def _closed_over(fn, name):
    """The value of the variable ``name`` that the function ``fn`` closes over, or None."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None or name not in code.co_freevars:
        return None
    try:
        return cells[code.co_freevars.index(name)].cell_contents
    except (IndexError, ValueError):  # an empty cell
        return None


def _refuse_new_draws_in_backward(bsym) -> None:
    """A draw inside ``checkpoint(..., use_reentrant=False, preserve_rng_state=False)``: eager's backward draws
    other numbers than its forward did (its gradients are not those of its outputs) and how many depends on where
    its recomputation stops; refused as the reentrant form is (acquisition/checkpoint.py)."""
    pack = _torch_checkpoint_hook()
    if pack is None or not bsym.draws_random:
        return
    preserves = _preserves_rng_state(pack)
    if preserves is True:
        return
    raise TracingError(
        f"torch.utils.checkpoint.checkpoint(use_reentrant=False, preserve_rng_state="
        f"{'False' if preserves is False else '<unknown>'}) around a random op ({bsym.sym.name}): eager recomputes "
        "it in the backward with other random numbers than its forward drew, so its gradients belong to other values "
        "than its outputs; thunder_train does not reproduce that. Use preserve_rng_state=True (the default).")


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, args, kwargs))
        return func(*args, **kwargs)


def _policy_saves(policy, bsym) -> bool:
    """Whether ``policy`` saves one of the aten ops the line's torch function runs (on meta tensors)."""
    from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext

    fn = bsym.torch_fn or getattr(bsym.sym, "torch_impl", None)
    if fn is None:
        return False
    to_meta = lambda x: meta_tensor(x) if type(x) is TensorProxy else x  # noqa: E731
    args, kwargs = tree_map(to_meta, bsym.args), tree_map(to_meta, bsym.kwargs)
    rec = _Recorder()
    try:
        with rec:
            fn(*args, **kwargs)
    except Exception:  # a function that does not run on meta tensors: the policy cannot be asked; recompute
        return False
    ctx = SelectiveCheckpointContext(is_recompute=False)
    for func, a, k in rec.calls:
        choice = policy(ctx, func, *a, **k)
        if choice is True or choice in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            return True
    return False


def _mark_all(bsym, mark) -> None:
    bsym.region = mark
    for sub in bsym.subsymbols:
        _mark_all(sub, mark)


def _hook(trc, bsym) -> None:
    if len(trc._scopes) != 1 or context.tracer_state() is None:
        return
    n = _region_number()
    if n is None:
        return
    _refuse_new_draws_in_backward(bsym)
    policy = _selective_policy() if _explicit == [] or _torch_checkpoint_hook() is not None else None
    save = policy is not None and _policy_saves(policy, bsym)
    _mark_all(bsym, Mark(n, save=save))


@contextlib.contextmanager
def reentrant():
    """An explicit checkpoint region (reentrant checkpoint's ``CheckpointFunction.apply``)."""
    _explicit.append(next(_numbers))
    try:
        yield
    finally:
        _explicit.pop()


symbols.region_hook = _hook
