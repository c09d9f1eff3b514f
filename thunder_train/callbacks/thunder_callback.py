"""``ThunderCallback``: thunder_train for the Lightning ``Trainer``.

    trainer = L.Trainer(max_steps=200, callbacks=[ThunderCallback(thin=True)], precision="bf16-mixed")
    trainer.fit(lit_module, datamodule)

See docs/callback.md for what is compiled, what stays eager and why.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from typing_extensions import override

from ..compiled import check_options
from . import code_checks
from .compiled_step import CompiledStep
from .whole_step import FusedAutomatic, overriders

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed")
EVAL_STEPS = {"validate": ("validation_step",), "test": ("test_step",), "predict": ("predict_step",)}

class ThunderCallback(Callback):
    r"""Compile a ``LightningModule``'s steps with thunder_train.

    The callback patches the module *instance*'s step methods (``training_step``;
    with ``compile_eval=True`` also ``validation_step``, ``test_step``,
    ``predict_step``) for the duration of a ``Trainer`` stage.  The module is not
    wrapped: its class, parameters and ``state_dict()`` keys are unchanged, and a
    checkpoint saved with the callback loads without it.

    Automatic optimization: ``training_step`` (forward and loss) is compiled; its
    backward is thunder_train's backward trace, which Lightning's
    ``loss.backward()`` runs; Lightning then runs gradient clipping, its hooks and
    the optimizer as usual.  Gradient accumulation, ``bf16-mixed`` autocast and
    DDP's gradient reduction work unchanged around it.

    With ``fuse_optimizer=True`` the whole step — forward, ``loss /
    accumulate_grad_batches``, backward, gradient clipping and ``optimizer.step()`` —
    is one compiled program (accumulating batches: forward and backward); Lightning's
    loop, hooks, ``zero_grad`` and LR schedulers stay in charge (``whole_step.py``).

    Manual optimization (``automatic_optimization = False``): the user's whole
    ``training_step`` is compiled, ``self.manual_backward``, ``opt.step()``,
    ``opt.zero_grad()`` and ``self.clip_gradients`` included.

    Args:
        thin: compile in thin mode (``tt.compile(..., thin=True)``): after two validated
            calls, parameters are bound and each step only checks the batch.
        check_every: thin mode only: run the full prologue every N calls and raise
            ``ThinModeError`` naming what changed.
        compile_eval: also compile ``validation_step``, ``test_step`` and ``predict_step``
            (by default they run eagerly).
        fuse_optimizer: automatic optimization: compile the backward, gradient clipping and
            ``optimizer.step()`` into the step's program (under ``DDPStrategy`` the program
            averages the gradients over the ranks itself).
        strict: make torch ops unknown to the compiler an error instead of running them
            opaquely (``tt.compile(..., strict=True)``).
        optimizer_kernels: whole steps (``fuse_optimizer=True``, manual optimization): ``"fused"``
            runs Adam/AdamW/SGD/Adagrad updates on torch's fused kernels, ``"traced"`` the
            optimizer's own per-op code (``tt.compile(..., optimizer_kernels=...)``).

    Raises:
        MisconfigurationException: for setups that are not supported (yet): FSDP/DeepSpeed
            or other non-DDP strategies, manual optimization under DDP (and, found on the first
            batch, DDP options the fused program cannot reproduce: a communication hook, buffers
            to broadcast, ...), precisions other than ``32-true``/``bf16-mixed``, a step
            that reads ``batch_idx``, ``self.global_step`` or ``self.current_epoch``, hooks a
            whole step cannot fire in their place (see docs/callback.md).

    Example::

        trainer = L.Trainer(callbacks=[ThunderCallback(thin=True)])
        trainer.fit(model, datamodule)
        cb = trainer.callbacks[0]  # or keep a reference
        tt.last_traces(cb.compiled("training_step"))[-1]   # the executed program
    """

    def __init__(self, *, thin: bool = False, check_every: int | None = None, compile_eval: bool = False,
                 fuse_optimizer: bool = False, strict: bool = False, optimizer_kernels: str = "fused") -> None:
        super().__init__()
        try:
            check_options(thin=thin, check_every=check_every, optimizer_kernels=optimizer_kernels, strict=strict,
                          compile_eval=compile_eval, fuse_optimizer=fuse_optimizer)
        except ValueError as e:  # Lightning's exception type for a misconfigured Trainer
            raise MisconfigurationException(f"ThunderCallback: {e}") from None
        self.thin = thin
        self.check_every = check_every
        self.compile_eval = compile_eval
        self.fuse_optimizer = fuse_optimizer
        self.strict = strict
        self.optimizer_kernels = optimizer_kernels
        self._steps: dict[str, CompiledStep] = {}
        self._earlier_calls: dict[str, int] = {}
        self._fused: FusedAutomatic | None = None

    # ------------------------------------------------------------------ public
    def compiled(self, name: str = "training_step", program: str | None = None):
        """The ``CompiledFunction`` of a patched step, for ``tt.last_traces`` / ``tt.compile_stats``.

        Available after the step's first call (and after the stage has finished).  A step can
        have several programs (``cb.steps[name].programs``): ``forward`` (the default path),
        with ``fuse_optimizer=True`` ``step``, ``step_acc``, ``backward``, ``backward_acc`` and
        ``update``, with manual optimization ``manual``.  Without ``program`` the main one is
        returned (``forward``, ``step`` or ``manual``).
        """
        step = self._steps.get(name)
        if step is None or step.compiled is None:
            known = ", ".join(n for n, s in self._steps.items() if s.compiled is not None) or "none yet"
            raise KeyError(f"{name} has not been compiled and called (compiled and called: {known})")
        if program is None:
            return step.compiled
        if program not in step.programs:
            raise KeyError(f"{name} has no {program!r} program (it has run: {', '.join(step.programs)})")
        return step.programs[program]

    @property
    def steps(self) -> dict:
        """The patched steps of the current (or last) stage by name: ``calls``, ``thin_rebinds``, ``summary()``,
        ``compiled`` (the main program), ``programs`` and ``program_calls`` (by program name)."""
        return dict(self._steps)

    def summary(self) -> str:
        """One line per compiled step: calls, traces, thin calls, retrace reasons."""
        return "\n".join(s.summary() for s in self._steps.values())

    # ------------------------------------------------------------------ hooks
    @override
    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        self._check_unique(trainer)
        self._check_strategy(trainer)
        self._check_precision(trainer)
        # Compiled state of an earlier stage refers to the module as it was then: start afresh.
        self._unpatch_all()
        self._earlier_calls = self._calls()
        self._steps = {}
        names = self._steps_for(trainer, pl_module, stage)
        training_mode = self._training_mode(trainer, pl_module) if "training_step" in names else None
        plan = {name: self._check_step(pl_module, name) for name in names}
        for name, (position, pname) in plan.items():
            self._steps[name] = CompiledStep(
                pl_module, name, batch_idx_position=position, batch_idx_name=pname, thin=self.thin,
                check_every=self.check_every, strict=self.strict, optimizer_kernels=self.optimizer_kernels,
                warn=rank_zero_warn,
                mode=training_mode if name == "training_step" else "forward",
            )
        if training_mode == "fused":
            self._fused = FusedAutomatic(trainer, pl_module, self._steps["training_step"])
        if names:
            mode = "thin mode" if self.thin else "full prologue on every call"
            what = {"fused": " (whole step: forward, backward, clipping and optimizer.step())",
                    "manual": " (the whole manual-optimization step)"}.get(training_mode, "")
            rank_zero_info(f"ThunderCallback: compiling {', '.join(names)}{what} with thunder_train ({mode}); "
                           "tracing happens on the first call")
            if self._fused is not None and self._fused.split:
                rank_zero_info("ThunderCallback: the stepping batch is split into two programs at "
                               f"on_before_optimizer_step, for {', '.join(self._fused.split_reasons)}")

    @override
    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        step = self._steps.get("training_step")
        if step is not None:
            rank_zero_info(f"ThunderCallback: {step.summary()}")

    @override
    def teardown(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        # The compiled functions stay available (``compiled()``, ``summary()``) until the next setup.
        self._unpatch_all()

    @override
    def on_exception(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException) -> None:
        # Lightning does not call ``teardown`` when a stage fails: leave the module as it was.
        self._unpatch_all()

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"options": self._options(), "calls": self._calls()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("options", {})
        if saved and saved != self._options():
            rank_zero_info(f"ThunderCallback: the checkpoint was trained with options {saved}; resuming with {self._options()}")
        self._earlier_calls = dict(state_dict.get("calls", {}))

    # ------------------------------------------------------------------ checks
    def _calls(self) -> dict:
        """Compiled calls per step name: this stage's plus earlier stages' (and the checkpoint's, after a resume)."""
        calls = dict(self._earlier_calls)
        for name, step in self._steps.items():
            calls[name] = calls.get(name, 0) + step.calls
        return calls

    def _options(self) -> dict:
        return {"thin": self.thin, "check_every": self.check_every, "compile_eval": self.compile_eval,
                "fuse_optimizer": self.fuse_optimizer, "strict": self.strict, "optimizer_kernels": self.optimizer_kernels}

    def _check_unique(self, trainer) -> None:
        mine = [cb for cb in trainer.callbacks if isinstance(cb, ThunderCallback)]
        if len(mine) > 1:
            raise MisconfigurationException(f"the Trainer has {len(mine)} ThunderCallbacks; use one")

    @staticmethod
    def _check_strategy(trainer) -> None:
        """Single device, DDP, or ModelParallelStrategy with fully_shard only (its whole steps: ``_training_mode``)."""
        strategy = trainer.strategy
        name = type(strategy).__name__
        if isinstance(strategy, (FSDPStrategy, DeepSpeedStrategy)):
            raise MisconfigurationException(
                f"ThunderCallback does not support {name} yet: it shards parameters and gradients, and the compiled "
                "step reads whole parameters. Use strategy='ddp' (or a single device), FSDP2 through ModelParallelStrategy "
                "(fully_shard in configure_model) with ThunderCallback(fuse_optimizer=True), or remove the callback."
            )
        if _is_model_parallel(strategy):
            if strategy._tensor_parallel_size != 1:
                raise MisconfigurationException(
                    f"ThunderCallback supports ModelParallelStrategy with data parallelism only (fully_shard, FSDP2); "
                    f"the Trainer uses tensor_parallel_size={strategy._tensor_parallel_size}. Use "
                    "ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1), or remove the callback.")
        elif not isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):
            raise MisconfigurationException(
                f"ThunderCallback supports single-device training, DDPStrategy and ModelParallelStrategy (FSDP2); the "
                f"Trainer uses {name}. Use strategy='ddp' or 'auto' on one device, or remove the callback."
            )
        device = strategy.root_device
        if device.type not in ("cpu", "cuda"):
            raise MisconfigurationException(f"ThunderCallback runs on CPU and CUDA devices; the Trainer uses {device}")

    @staticmethod
    def _check_precision(trainer) -> None:
        precision = str(trainer.precision)
        if precision not in SUPPORTED_PRECISIONS:
            raise MisconfigurationException(
                f"ThunderCallback supports precision {' and '.join(map(repr, SUPPORTED_PRECISIONS))}; the Trainer uses "
                f"{precision!r}"
            )

    def _training_mode(self, trainer, pl_module) -> str:
        """``"forward"``, ``"fused"`` or ``"manual"``; refuses whole steps where their hooks or DDP cannot work."""
        manual = not pl_module.automatic_optimization
        if _is_model_parallel(trainer.strategy) and (manual or not self.fuse_optimizer or trainer.accumulate_grad_batches != 1):
            raise MisconfigurationException(
                "ThunderCallback under ModelParallelStrategy (FSDP2) compiles whole steps only: automatic optimization "
                "with ThunderCallback(fuse_optimizer=True) and accumulate_grad_batches=1 (the gradients' "
                "reduce-scatters are lines of the step's program, so its backward and update must be in it). "
                "Set fuse_optimizer=True, or remove the callback.")
        if _is_model_parallel(trainer.strategy) and trainer.gradient_clip_val and \
                (trainer.gradient_clip_algorithm or "norm") == "norm":  # (an str enum: compared by value)
            raise MisconfigurationException(
                "ThunderCallback under ModelParallelStrategy (FSDP2): gradient clipping by norm (gradient_clip_val with "
                "gradient_clip_algorithm='norm') is not supported yet: inside the compiled step each rank holds its "
                "shard of every gradient, and the total norm would need all of them. Use "
                "gradient_clip_algorithm='value', or no clipping, or remove the callback.")
        if not manual and not self.fuse_optimizer:
            return "forward"
        what = ("manual optimization (the whole training_step is compiled)" if manual
                else "ThunderCallback(fuse_optimizer=True)")
        if manual and isinstance(trainer.strategy, DDPStrategy):
            raise MisconfigurationException(
                f"ThunderCallback: {what} is not supported with {type(trainer.strategy).__name__}: the backward inside a "
                "compiled step does not run DDP's gradient all-reduce hooks, so the ranks would drift apart. "
                "Use automatic optimization with ThunderCallback(fuse_optimizer=True) (the program averages the "
                "gradients) or fuse_optimizer=False (DDP reduces them), or remove the callback."
            )
        hooks = ("on_before_backward", "on_after_backward", "on_before_optimizer_step") if manual else ("on_before_backward",)
        found = [f"{n}.{hook}" for hook in hooks for n in overriders(trainer, pl_module, hook)]
        if found:
            raise MisconfigurationException(
                f"ThunderCallback: {what} runs the backward"
                + (" and the optimizer" if manual else "") + " inside one compiled program, so "
                f"{', '.join(found)} cannot fire at its place (it would see the state after the program). "
                + ("Compute what the hook needs inside training_step (e.g. log a gradient norm there), move it to "
                   "on_train_batch_end, or remove the callback." if manual else
                   "Use on_after_backward or on_before_optimizer_step instead (those run between the compiled backward "
                   "and the update), or ThunderCallback(fuse_optimizer=False).")
            )
        return "manual" if manual else "fused"

    def _steps_for(self, trainer, pl_module, stage: str) -> list:
        names = []
        if stage == "fit":
            names.append("training_step")
            if self.compile_eval and is_overridden("validation_step", pl_module):
                names.append("validation_step")
        elif self.compile_eval:
            names.extend(n for n in EVAL_STEPS.get(stage, ()) if is_overridden(n, pl_module))
        return names

    @staticmethod
    def _check_step(pl_module, name: str):
        """Refuse steps the compiled program would get wrong; return where ``batch_idx`` is passed."""
        method = getattr(pl_module, name)
        cls = type(pl_module).__name__
        if name == "training_step" and is_param_in_hook_signature(method, "dataloader_iter", explicit=True):
            raise MisconfigurationException(
                f"ThunderCallback cannot compile {cls}.training_step(self, dataloader_iter): a compiled step receives its "
                "batch as an argument. Take `batch` (and `batch_idx`) instead, or remove the callback."
            )
        pname, is_varargs = code_checks.step_parameter(method, 1)
        position = 1 if pname is not None else None
        # Lightning passes batch_idx only when the step can take it (two parameters after self, or *args).
        if pname is not None:
            found = code_checks.reads_parameter(method, pname)
            if found is not None:
                what = "batch_idx" + (f" (through *{pname})" if is_varargs else "")
                raise MisconfigurationException(
                    f"ThunderCallback cannot compile {cls}.{name}: it reads {what} ({found.where}). batch_idx changes "
                    "every step; a compiled step would have to retrace on every step or bake in the first value. Move "
                    f"the code that needs it into an eager hook (on_train_batch_start/on_train_batch_end receive "
                    f"batch_idx), or compile without this step (remove the callback"
                    + (", or use compile_eval=False" if name != "training_step" else "") + ")."
                )
        found = code_checks.reads_loop_state(method, type(pl_module))
        if found is not None:
            raise MisconfigurationException(
                f"ThunderCallback cannot compile {cls}.{name}: it reads {found.what} ({found.where}), which changes as "
                "training advances; the compiled step would keep the value it had when it was traced. Compute what "
                "depends on it in an eager hook (e.g. on_train_batch_start) and pass it to the step in a buffer "
                "updated in place (self.my_buffer.fill_(value)), or remove the callback."
            )
        return position, (None if is_varargs else pname)

    def _unpatch_all(self) -> None:
        if self._fused is not None:
            self._fused.unpatch()
            self._fused = None
        for step in self._steps.values():
            step.unpatch()


def _is_model_parallel(strategy) -> bool:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return isinstance(strategy, ModelParallelStrategy)
