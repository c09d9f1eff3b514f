"""``fuse_optimizer=True``: Lightning's automatic optimization with the whole step compiled.

Lightning runs one batch of automatic optimization as (``_AutomaticOptimization``)::

    closure = Closure(step_fn, backward_fn, zero_grad_fn)    # zero_grad_fn only on a window's first batch
    accumulating batch:  closure()
    stepping batch:      module.optimizer_step(..., closure)  ->  LightningOptimizer.step(closure)
                         -> strategy.optimizer_step -> precision.optimizer_step(optimizer, model, closure)
                         -> optimizer.step(closure=...):  closure(); on_before_optimizer_step; clipping; update

    closure():  training_step (under autocast)  ->  loss / accumulate_grad_batches
                zero_grad_fn:  on_before_zero_grad hooks, module.optimizer_zero_grad -> optimizer.zero_grad()
                backward_fn:   on_before_backward hooks, precision.backward -> module.backward(loss), on_after_backward hooks

``FusedAutomatic`` keeps that loop, its progress counters, hooks and the user's
``optimizer_step``/``optimizer_zero_grad`` overrides, and replaces three pieces for
the duration of ``fit`` (instance attributes, removed again by ``unpatch``):

* ``_AutomaticOptimization._make_closure`` returns a ``_FusedClosure``: the same three
  functions, run as ``zero_grad_fn`` (eager, first), ``step_fn`` (the patched
  ``training_step`` runs a fused program: forward, loss, backward and, when stepping,
  clipping and ``optimizer.step()``), then ``backward_fn`` with the precision plugin's
  ``backward`` skipped (the gradients exist already; ``on_before_backward`` and
  ``on_after_backward`` fire with the real loss).
* ``precision_plugin.optimizer_step``: when it receives the pending ``_FusedClosure``
  (Lightning's stepping batch, also through a user's ``optimizer_step``) it runs the
  closure as the *stepping* program and fires ``on_before_optimizer_step``;
  anything else (another closure, extra ``step`` arguments) goes to Lightning's own.
* ``precision_plugin.backward``: skipped once after a program ran the backward.

Split at ``on_before_optimizer_step``: when the module or a callback overrides
``on_after_backward`` or ``on_before_optimizer_step``, or the module overrides
``configure_gradient_clipping``, those must see the gradients before clipping and the
update.  The stepping batch then runs the ``backward`` program, the hooks (and a
custom ``configure_gradient_clipping``) eagerly, and the ``update`` program (clipping
by the Trainer's settings and ``optimizer.step()``).

``DDPStrategy``: the backward inside a program runs none of DDP's reducer hooks, so on a
synchronising batch (``require_backward_grad_sync``; Lightning's ``no_sync()`` clears it on
accumulating batches) the program averages the gradients itself (the ``step`` programs,
``backward_sync`` of a split step), and DDP's own forward around it runs with the flag
cleared, its reducer idle.  DDP options the averaging does not reproduce are refused on
the first batch.

Refused (``MisconfigurationException``, from ``ThunderCallback.setup``): a module or
callback overriding ``on_before_backward`` (it would fire after the backward already ran).
"""
from __future__ import annotations

import contextlib

import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden

from ..compiler.acquisition.distributed import is_ddp, unsupported
from .compiled_step import CompiledStep, FusedCall, _Patch


def overriders(trainer, pl_module, hook: str, *, module: bool = True) -> list:
    """Names of the module (when ``module``) and the callbacks that override ``hook``."""
    names = []
    if module and is_overridden(hook, pl_module):
        names.append(type(pl_module).__name__)
    for cb in trainer.callbacks:
        if is_overridden(hook, cb, parent=Callback):
            names.append(type(cb).__name__)
    return names


@contextlib.contextmanager
def _no_reducer(ddp):
    before = ddp.require_backward_grad_sync
    ddp.require_backward_grad_sync = False
    try:
        yield
    finally:
        ddp.require_backward_grad_sync = before


class _FusedClosure(Closure):
    """Lightning's closure for one batch, run with the backward (and the update) inside a compiled program."""

    def __init__(self, base: Closure, driver: "FusedAutomatic", optimizer):
        super().__init__(base._step_fn, base._backward_fn, base._zero_grad_fn)
        self._driver = driver
        self.optimizer = optimizer
        self.stepping = False  # set by the patched precision.optimizer_step: run the stepping program
        self.started = False
        self.in_program = False  # the backward ran inside a program
        self.updated = False  # ... and optimizer.step() too

    @torch.enable_grad()
    def closure(self, *args, **kwargs):
        self.started = True
        if self._backward_fn is None:  # Lightning skips the backward: nothing to fuse
            return super().closure(*args, **kwargs)
        driver = self._driver
        fresh = self._zero_grad_fn is not None
        if fresh:
            # Before the step rather than between it and the backward: the forward neither reads nor writes
            # gradients, so every hook and the program see the state Lightning's order gives.
            self._zero_grad_fn()
        trainer = driver.trainer
        stepping = self.stepping
        ddp = driver.ddp()
        # DDP: Lightning's no_sync() on accumulating batches clears the flag; a synchronising batch
        # averages its gradients inside the program (a stepping program always does, when under DDP).
        sync = ddp is not None and ddp.require_backward_grad_sync
        pending = FusedCall(
            ("step" if stepping else "backward") + ("" if fresh else "_acc") + ("_sync" if sync and not stepping else ""),
            self.optimizer if stepping else None,
            trainer.accumulate_grad_batches,
            trainer.gradient_clip_val if stepping else None,
            trainer.gradient_clip_algorithm if stepping else None,
        )
        driver.step.pending = pending
        try:
            if ddp is None:
                step_output = self._step_fn()
            else:
                # DDP's own forward runs around the program: with the flag cleared its reducer stays idle
                # (no autograd hooks will fire for it to wait on); the program averages instead.
                with _no_reducer(ddp):
                    step_output = self._step_fn()
        finally:
            driver.step.pending = None
        self.in_program = pending.consumed
        self.updated = pending.consumed and stepping
        if step_output.closure_loss is None:
            self.warning_cache.warn("`training_step` returned `None`. If this was on purpose, ignore this warning...")
        elif self.in_program:
            driver.skip_backward = True  # the hooks fire, the backward ran in the program
            try:
                self._backward_fn(step_output.closure_loss)
            finally:
                driver.skip_backward = False
        else:
            self._backward_fn(step_output.closure_loss)
        return step_output


class FusedAutomatic:
    """Patches one Trainer's automatic optimization for ``fuse_optimizer=True`` (see the module docstring)."""

    def __init__(self, trainer, pl_module, step: CompiledStep):
        self.trainer = trainer
        self.module = pl_module
        self.step = step
        self.skip_backward = False
        # Hooks that must see the gradients before clipping and the update: split the stepping batch there.
        self.split_reasons = (
            [f"{n}.on_after_backward" for n in overriders(trainer, pl_module, "on_after_backward")]
            + [f"{n}.on_before_optimizer_step" for n in overriders(trainer, pl_module, "on_before_optimizer_step")]
        )
        self.custom_clipping = is_overridden("configure_gradient_clipping", pl_module)
        if self.custom_clipping:
            self.split_reasons.append(f"{type(pl_module).__name__}.configure_gradient_clipping")
        self.split = bool(self.split_reasons)
        loop = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "automatic_optimization", None)
        precision = trainer.strategy.precision_plugin
        if not (callable(getattr(loop, "_make_closure", None)) and callable(getattr(precision, "_after_closure", None))
                and all(hasattr(Closure, a) for a in ("closure", "consume_result"))):
            raise MisconfigurationException(
                "ThunderCallback(fuse_optimizer=True) drives Lightning's automatic optimization through "
                "_AutomaticOptimization._make_closure and Precision._after_closure (Lightning 2.x); this Lightning "
                "version does not have them. Use ThunderCallback(fuse_optimizer=False)."
            )
        self._loop_make_closure = loop._make_closure
        self._precision = precision
        self._precision_optimizer_step = precision.optimizer_step
        self._precision_backward = precision.backward
        self._patches = [
            _Patch(loop, "_make_closure", self._make_closure),
            _Patch(precision, "optimizer_step", self._optimizer_step),
            _Patch(precision, "backward", self._backward),
        ]

    def ddp(self):
        """The ``DistributedDataParallel`` around the module under ``DDPStrategy`` (checked on first use), else None."""
        model = self.trainer.strategy.model
        if not is_ddp(model):
            return None
        if self.step.ddp_ignore is None:
            problems = unsupported(model)
            if problems:
                raise MisconfigurationException(
                    f"ThunderCallback(fuse_optimizer=True) under DDPStrategy: {'; '.join(problems)} is not supported. "
                    "Use ThunderCallback(fuse_optimizer=False) (the forward and backward are compiled, DDP reduces)."
                )
            ignored = {id(p) for n, p in model.module.named_parameters() if n in model.parameters_to_ignore}
            self.step.ddp_ignore = frozenset(n for n, p in self.module.named_parameters() if id(p) in ignored)
        return model

    def unpatch(self) -> None:
        for p in reversed(self._patches):
            p.undo()
        self._patches = []

    # ---- the patched pieces ----
    def _make_closure(self, kwargs, optimizer, batch_idx):
        return _FusedClosure(self._loop_make_closure(kwargs, optimizer, batch_idx), self, optimizer)

    def _backward(self, tensor, model, optimizer, *args, **kwargs):
        if self.skip_backward:
            return None
        return self._precision_backward(tensor, model, optimizer, *args, **kwargs)

    def _optimizer_step(self, optimizer, model=None, closure=None, **kwargs):
        if not isinstance(closure, _FusedClosure) or closure.started or kwargs or closure._driver is not self:
            return self._precision_optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        model = model if model is not None else self.module
        closure.optimizer = optimizer
        closure.stepping = not self.split
        loss = closure()
        if closure.updated:  # the whole step ran as one program; nothing overrides the hook (else: split)
            self._fire_before_optimizer_step(optimizer)
            return loss
        if closure.in_program:
            if self.custom_clipping:  # Lightning's own: the hooks, then the module's configure_gradient_clipping
                self._precision._after_closure(model, optimizer)
            else:
                self._fire_before_optimizer_step(optimizer)
            trainer = self.trainer
            self.step.update(optimizer, clip=not self.custom_clipping, clip_val=trainer.gradient_clip_val,
                             clip_algorithm=trainer.gradient_clip_algorithm)
            return loss
        # The step did not run through a program (Lightning skipped the backward): Lightning's order.
        self._precision._after_closure(model, optimizer)
        optimizer.step()
        return loss

    def _fire_before_optimizer_step(self, optimizer) -> None:
        call._call_callback_hooks(self.trainer, "on_before_optimizer_step", optimizer)
        call._call_lightning_module_hook(self.trainer, "on_before_optimizer_step", optimizer)
