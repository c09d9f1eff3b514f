"""One LightningModule step method run through thunder_train.

``CompiledStep`` replaces ``module.training_step`` (or ``validation_step``, ...) by
an *instance attribute*: a plain function that Lightning calls like the method.
The class, the module's parameters and ``state_dict()`` are untouched, and removing
the attribute (``unpatch``) restores the method.

Every compiled function receives the LightningModule as its first argument, so the
compiler walks its parameters and buffers as inputs (thin mode binds them), and
calls the original bound method.  A step has one or more *programs* (one
``CompiledFunction`` each, so each binds in thin mode on its own):

``forward``
    the step (forward and loss).  With grad enabled its outputs are connected to
    PyTorch autograd through ``ThunderFunction``; Lightning's ``loss.backward()``
    runs the compiled backward.  The default for automatic optimization.
``step`` / ``step_acc`` / ``backward`` / ``backward_acc`` / ``update``
    ``fuse_optimizer=True`` (``whole_step.py`` decides which runs when): the step,
    ``loss / accumulate_grad_batches``, the backward traced into the program, and for
    ``step*`` gradient clipping and ``optimizer.step()``.  ``*_acc`` programs add to
    gradients of earlier batches of an accumulation window, the others start from
    cleared gradients.  ``update`` is clipping and ``optimizer.step()`` alone.
``manual``
    manual optimization: the user's whole ``training_step`` with
    ``self.manual_backward``, ``opt.step()``, ``opt.zero_grad()``; the real optimizers
    are arguments, so their ``param_groups`` and ``state`` are inputs.

Things a step does that a traced program cannot do by itself:

``self.log(...)``
    While tracing, the module's ``log`` is shadowed by a recorder (``log_dict`` goes
    through ``log``).  Logged tensors become extra outputs of the program; the log
    calls are stored under an integer token that the program also returns, and
    replayed with the real tensors after every call.  Each trace has its own token,
    so every cache entry replays its own calls.
Lightning's bookkeeping in a manual step
    ``opt.step()`` on a ``LightningOptimizer`` counts the step (``global_step``) in
    Python; ``sched.step()`` of ``self.lr_schedulers()`` is Python.  Both are recorded
    while tracing (the counters are not touched then) and replayed after every call.
``batch_idx``
    An ``int`` that changes every step.  Passed on, it would retrace every step;
    baked in, it would be wrong.  The callback refuses steps that read it
    (``code_checks``); for the others the compiled function receives a sentinel in
    its place, which raises if anything uses it after all.
a batch that breaks thin mode's contract
    (the last, smaller batch of an epoch): the ``ThinModeError`` (``kind ==
    "per_call_input"``, raised before anything ran) is caught, the binding dropped,
    and the call runs the full path (tracing a new entry the first time); thin mode
    binds again two calls later.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import numbers
import time
from collections.abc import Mapping

import torch

from ..compiled import compile as tt_compile
from ..compiler.acquisition.distributed import average_gradients_at_backward
from ..compiler.proxies import is_proxy
from ..compiler.pytree import tree_flatten
from ..compiler.errors import ThinModeError


class StepError(RuntimeError):
    """A compiled step does something the callback cannot replay; the message says what to do instead."""


class _BatchIdxSentinel:
    """Stands in for ``batch_idx`` inside a compiled step that (by inspection) does not read it."""

    _MESSAGE = (
        "batch_idx is not available inside a step compiled by ThunderCallback: its value changes every step, so "
        "compiling it in would either retrace every step or bake in the first value. Move code that needs it into "
        "an eager hook such as on_train_batch_start/on_train_batch_end (they receive batch_idx)."
    )

    def __repr__(self):
        return "<batch_idx: not available in a compiled step>"

    def _fail(self, *args, **kwargs):
        raise StepError(self._MESSAGE)

    __bool__ = __int__ = __index__ = __float__ = __format__ = _fail
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __mod__ = __rmod__ = _fail
    __floordiv__ = __rfloordiv__ = __truediv__ = __rtruediv__ = __pow__ = _fail
    __lt__ = __le__ = __gt__ = __ge__ = _fail


BATCH_IDX = _BatchIdxSentinel()
_ABSENT = object()
_token = itertools.count()


class _Patch:
    """An instance attribute set on ``obj`` until ``undo()`` (which leaves a value someone set since alone)."""

    def __init__(self, obj, name: str, value):
        self.obj, self.name = obj, name
        self.previous = obj.__dict__.get(name, _ABSENT)
        self.value = value
        obj.__dict__[name] = value

    def undo(self) -> None:
        d = self.obj.__dict__
        if d.get(self.name) is self.value:
            if self.previous is _ABSENT:
                del d[self.name]
            else:
                d[self.name] = self.previous


class _StepRecord:
    """What a step did in Python while it was traced, to replay after every call of that trace.

    ``self.log`` calls (``records``, with the logged proxies in ``values``) and, in a manual
    step, Lightning's bookkeeping (``events``): ``("optimizer_step", i)`` for ``opt.step()`` of
    the i-th ``LightningOptimizer``, ``("scheduler", scheduler, args, kwargs)`` for
    ``sched.step(...)`` of a scheduler from ``self.lr_schedulers()``.
    """

    def __init__(self, step_name: str):
        self.step_name = step_name
        self.records: list = []  # (name, ("out", i) | ("const", value), args, kwargs)
        self.values: list = []  # proxies returned as extra outputs
        self.constants: list = []  # names logged with a Python value computed while tracing
        self.events: list = []

    def log(self, name, value, *args, **kwargs):
        for v in tree_flatten((args, kwargs))[0]:
            if is_proxy(v):
                raise StepError(
                    f"self.log({name!r}, ...) in a compiled {self.step_name} passes a tensor computed in the step as an "
                    "option (not as the value); pass a Python value or compute it in an eager hook"
                )
        if is_proxy(value):
            ref = ("out", len(self.values))
            self.values.append(value)
        elif isinstance(value, (numbers.Number, torch.Tensor)):
            ref = ("const", value)
            if not isinstance(value, torch.Tensor):
                self.constants.append(name)
        else:
            raise StepError(
                f"self.log({name!r}, <{type(value).__name__}>) in a compiled {self.step_name}: only tensors and Python "
                "numbers can be logged from a compiled step (a torchmetrics Metric object updates Python state on every "
                "call); update and log the metric in an eager hook such as on_train_batch_end"
            )
        self.records.append((name, ref, args, kwargs))

    @contextlib.contextmanager
    def logging_into(self, module):
        patch = _Patch(module, "log", self.log)
        try:
            yield
        finally:
            patch.undo()

    def register(self, records: dict) -> int:
        token = next(_token)
        records[token] = self
        return token


def _closure_loss(out):
    """The loss Lightning back-propagates from a ``training_step`` output (``ClosureResult`` rules)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        return out.get("loss")
    return None


@contextlib.contextmanager
def _autocast_off():
    """Lightning runs backward, clipping and the optimizer outside the autocast region of ``training_step``."""
    with contextlib.ExitStack() as stack:
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                stack.enter_context(torch.autocast(device, enabled=False))
        yield


def _forward_program(method, step_name: str, records: dict):
    """``step(self, *args, **kwargs) -> (output, (token, *logged))``: forward and loss."""

    def step(self, *args, **kwargs):
        rec = _StepRecord(step_name)
        with rec.logging_into(self):
            out = method(*args, **kwargs)
        return out, (rec.register(records), *rec.values)

    step.__name__ = step.__qualname__ = step_name
    return step


def _fused_program(method, step_name: str, records: dict, stepping: bool, average=None):
    """Forward, loss, backward (and for a stepping batch clipping and ``optimizer.step()``), one program.

    What Lightning's automatic optimization computes for one batch, ``zero_grad`` and the
    hooks aside (``whole_step.py`` runs those): the step, ``closure_loss = loss /
    accumulate_grad_batches``, ``LightningModule.backward(closure_loss)`` and, stepping,
    ``configure_gradient_clipping(...)`` with the Trainer's values and ``optimizer.step()``;
    all but the step outside autocast, where Lightning runs them.  ``average``: under
    ``DDPStrategy`` on a synchronising batch, the names of parameters DDP ignores; the
    backward then averages the gradients over the ranks (``compiler/acquisition/distributed.py``).
    """

    def step(self, optimizer, normalize, clip_val, clip_algorithm, *args, **kwargs):
        rec = _StepRecord(step_name)
        with rec.logging_into(self):
            out = method(*args, **kwargs)
        loss = _closure_loss(out)
        with _autocast_off():
            if loss is not None:
                if average is not None:
                    average_gradients_at_backward(self, average)
                self.backward(loss / normalize)
            if stepping:
                self.configure_gradient_clipping(optimizer, gradient_clip_val=clip_val,
                                                 gradient_clip_algorithm=clip_algorithm)
                optimizer.step()
        return out, (rec.register(records), *rec.values)

    step.__name__ = step.__qualname__ = step_name
    return step


def _update_program(records: dict):
    """Gradient clipping (when the module does not override ``configure_gradient_clipping``) and ``optimizer.step()``."""

    def optimizer_update(self, optimizer, clip, clip_val, clip_algorithm):
        with _autocast_off():
            if clip:
                self.configure_gradient_clipping(optimizer, gradient_clip_val=clip_val,
                                                 gradient_clip_algorithm=clip_algorithm)
            optimizer.step()
        return None, (_StepRecord("optimizer_update").register(records),)

    return optimizer_update


class _RecordedScheduler:
    """Stands in for an LR scheduler returned by ``self.lr_schedulers()`` while a manual step is traced."""

    def __init__(self, scheduler, rec: _StepRecord):
        self._scheduler = scheduler
        self._rec = rec

    def step(self, *args, **kwargs):
        if any(is_proxy(v) for v in tree_flatten((args, kwargs))[0]):
            raise StepError(
                f"{type(self._scheduler).__name__}.step(...) in a compiled training_step receives a tensor computed in "
                "the step (e.g. ReduceLROnPlateau with a loss); step it in an eager hook such as on_train_batch_end"
            )
        self._rec.events.append(("scheduler", self._scheduler, args, kwargs))

    def __getattr__(self, name):
        return getattr(self._scheduler, name)


def _manual_program(method, step_name: str, records: dict):
    """``step(self, optimizers, *args, **kwargs)``: a manual-optimization ``training_step``, whole.

    ``optimizers`` are the Trainer's real optimizers (their ``param_groups`` and state
    become inputs; the ``LightningOptimizer`` wrappers ``self.optimizers()`` returns reach
    them).  ``self.manual_backward`` runs Lightning's own code (hooks, the precision
    plugin, ``LightningModule.backward``) and traces ``loss.backward()``; ``opt.step()``
    runs Lightning's ``LightningOptimizer.step`` down to the optimizer's own ``step``.
    Lightning's step counting and ``sched.step()`` are recorded instead of run.
    """

    def step(self, optimizers, *args, **kwargs):
        rec = _StepRecord(step_name)
        wrappers = list(self.trainer.strategy._lightning_optimizers)
        if [w.optimizer for w in wrappers] != list(optimizers):
            raise StepError("the Trainer's optimizers changed while the step was traced")
        saved = [(w._on_before_step, w._on_after_step) for w in wrappers]
        for i, w in enumerate(wrappers):
            w._on_before_step = functools.partial(rec.events.append, ("optimizer_step", i))
            w._on_after_step = _nothing
        shadows = {"lr_schedulers": functools.partial(_recorded_schedulers, self, rec),
                   "toggle_optimizer": _no_toggle, "untoggle_optimizer": _no_toggle}
        schedulers = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        epochs = [getattr(sch, "last_epoch", None) for sch in schedulers]
        patches = [_Patch(self, k, v) for k, v in shadows.items()]
        try:
            with rec.logging_into(self):
                out = method(*args, **kwargs)
            for sch, epoch in zip(schedulers, epochs):
                if getattr(sch, "last_epoch", None) != epoch:
                    raise StepError(
                        f"{step_name} steps a {type(sch).__name__} it did not get from self.lr_schedulers(); inside a "
                        "compiled step that would happen only while tracing. Step schedulers through "
                        "self.lr_schedulers() (the callback replays those steps after every call) or in an eager hook."
                    )
        finally:
            for w, (before, after) in zip(wrappers, saved):
                w._on_before_step, w._on_after_step = before, after
            for patch in reversed(patches):
                patch.undo()
        stepped = {e[1] for e in rec.events if e[0] == "optimizer_step"}
        seen_scheduler = False
        for e in rec.events:
            if e[0] == "scheduler":
                seen_scheduler = True
            elif seen_scheduler and e[1] in stepped:
                raise StepError(
                    f"{step_name} calls sched.step() before opt.step(); a compiled step replays scheduler steps after "
                    "the program, so the optimizer would use the old learning rate. Call sched.step() after the last "
                    "opt.step() of the step (or in on_train_batch_end)."
                )
        return out, (rec.register(records), *rec.values)

    step.__name__ = step.__qualname__ = step_name
    return step


def _recorded_schedulers(module, rec):
    real = type(module).lr_schedulers(module)
    if real is None:
        return None
    if isinstance(real, list):
        return [_RecordedScheduler(s, rec) for s in real]
    return _RecordedScheduler(real, rec)


def _nothing():
    return None


def _no_toggle(*args, **kwargs):
    raise StepError(
        "self.toggle_optimizer()/untoggle_optimizer() (and LightningOptimizer.toggle_model) in a compiled training_step: "
        "they set requires_grad of parameters, which a compiled program cannot change while it runs. Leave them out "
        "(when each optimizer's zero_grad() comes right before its backward, every opt.step() sees the same "
        "gradients), or remove the callback."
    )


def _refuse_step_hooks(optimizers) -> None:
    """Optimizer step hooks are Python: inside a compiled step they would run only while tracing."""
    from torch.optim import optimizer as optim_module

    found = []
    if getattr(optim_module, "_global_optimizer_pre_hooks", None) or getattr(optim_module, "_global_optimizer_post_hooks", None):
        found.append("torch.optim.optimizer.register_optimizer_step_pre_hook/post_hook (global)")
    for opt in optimizers:
        if getattr(opt, "_optimizer_step_pre_hooks", None) or getattr(opt, "_optimizer_step_post_hooks", None):
            found.append(f"{type(opt).__name__}.register_step_pre_hook/post_hook")
    if found:
        raise StepError(
            f"ThunderCallback: optimizer step hooks are registered ({'; '.join(found)}); a compiled step runs "
            "optimizer.step() inside its program, where Python hooks would run only while tracing. Remove the hooks, "
            "or use ThunderCallback(fuse_optimizer=False) (automatic optimization; the optimizer runs eagerly)."
        )


@dataclasses.dataclass
class FusedCall:
    """Which fused program the next call of the patched step runs, and its extra arguments."""

    program: str  # "step", "step_acc", "backward", "backward_acc"
    optimizer: object
    normalize: int
    clip_val: object = None
    clip_algorithm: object = None
    consumed: bool = False


# (method, step name, records, names of parameters DDP ignores or None without DDP) -> the program's function
_BUILDERS = {
    "forward": lambda m, n, r, a: _forward_program(m, n, r),
    "step": lambda m, n, r, a: _fused_program(m, n, r, stepping=True, average=a),
    "step_acc": lambda m, n, r, a: _fused_program(m, n, r, stepping=True, average=a),
    "backward": lambda m, n, r, a: _fused_program(m, n, r, stepping=False),
    "backward_acc": lambda m, n, r, a: _fused_program(m, n, r, stepping=False),
    # DDP: the backward of a split stepping batch (not inside no_sync) averages the gradients.
    "backward_sync": lambda m, n, r, a: _fused_program(m, n, r, stepping=False, average=a),
    "backward_acc_sync": lambda m, n, r, a: _fused_program(m, n, r, stepping=False, average=a),
    "update": lambda m, n, r, a: _update_program(r),
    "manual": lambda m, n, r, a: _manual_program(m, n, r),
}
# The program ``compiled()`` returns by default, by mode (the first one that has run).
_MAIN = {
    "forward": ("forward",),
    "fused": ("step", "step_acc", "backward", "backward_acc", "backward_sync", "backward_acc_sync", "forward"),
    "manual": ("manual",),
}



class CompiledStep:
    """Patches ``module.<name>`` with a compiled version until ``unpatch()``.

    ``batch_idx_position`` is the positional index (0 = the batch) at which Lightning
    passes ``batch_idx`` (``None`` when the step does not take it) and
    ``batch_idx_name`` its keyword name.  ``mode``: ``"forward"`` (compile forward and
    loss), ``"fused"`` (the program named by ``pending``, set by ``whole_step``, or
    ``forward`` when none is pending), ``"manual"`` (the whole manual step).
    """

    #: warn once when a program has retraced this often (a Python value in the batch, an attribute the step changes, ...)
    RETRACE_WARNING = 8

    def __init__(self, module, name: str, *, batch_idx_position, batch_idx_name, thin: bool, check_every, strict: bool,
                 warn, mode: str = "forward", optimizer_kernels: str = "fused"):
        if mode not in _MAIN:
            raise ValueError(f"unknown mode {mode!r}")
        self.module = module
        self.name = name
        self.mode = mode
        self.batch_idx_position = batch_idx_position
        self.batch_idx_name = batch_idx_name
        self._options = dict(thin=thin, check_every=check_every, strict=strict, optimizer_kernels=optimizer_kernels)
        self._warn = warn
        leftover = getattr(module.__dict__.get(name), "_tt_step", None)
        if leftover is not None:  # patched by a ThunderCallback whose stage never tore down
            leftover.unpatch()
        self._method = getattr(module, name)
        self._records: dict = {}
        self.programs: dict = {}  # program name -> CompiledFunction, created on first use
        self.pending: FusedCall | None = None  # set by whole_step for the next call
        self.ddp_ignore = None  # under DDPStrategy (fused): names of parameters DDP does not reduce
        self.calls = 0
        self.program_calls: dict = {}
        self.thin_rebinds = 0  # calls whose batch broke thin mode's contract and ran the full path
        self.first_call_seconds = 0.0
        self._warned_constants: set = set()
        self._warned_retraces: set = set()

        @functools.wraps(self._method)  # Lightning reads the signature through __wrapped__
        def patched(*args, **kwargs):
            return self(*args, **kwargs)

        patched._tt_step = self
        self._patch = _Patch(module, name, patched)

    @property
    def compiled(self):
        """The main ``CompiledFunction`` (``None`` before the first call): ``forward``, ``step`` or ``manual``."""
        for n in _MAIN[self.mode]:
            if n in self.programs:
                return self.programs[n]
        return next(iter(self.programs.values()), None)

    def program(self, name: str):
        """The ``CompiledFunction`` of one program (created on first use)."""
        cf = self.programs.get(name)
        if cf is None:
            fn = _BUILDERS[name](self._method, self.name, self._records, self.ddp_ignore)
            cf = self.programs[name] = tt_compile(fn, **self._options)
        return cf

    def unpatch(self) -> None:
        self._patch.undo()

    # ---- calling ----
    def __call__(self, *args, **kwargs):
        pos = self.batch_idx_position
        if pos is not None and len(args) > pos:
            args = args[:pos] + (BATCH_IDX,) + args[pos + 1:]
        elif self.batch_idx_name is not None and self.batch_idx_name in kwargs:
            kwargs = {**kwargs, self.batch_idx_name: BATCH_IDX}
        call, self.pending = self.pending, None
        if self.mode == "manual":
            optimizers = tuple(self.module.trainer.optimizers)
            _refuse_step_hooks(optimizers)
            name, extra = "manual", (optimizers,)
        elif call is not None:
            if call.optimizer is not None:
                _refuse_step_hooks((call.optimizer,))
            call.consumed = True
            name, extra = call.program, (call.optimizer, call.normalize, call.clip_val, call.clip_algorithm)
        else:
            name, extra = "forward", ()
        out = self._call_program(name, (*extra, *args), kwargs)
        self.calls += 1
        return out

    def update(self, optimizer, *, clip: bool, clip_val, clip_algorithm) -> None:
        """Run the ``update`` program: clipping (when ``clip``) and ``optimizer.step()``."""
        _refuse_step_hooks((optimizer,))
        self._call_program("update", (optimizer, clip, clip_val, clip_algorithm), {})

    def _call_program(self, name, args, kwargs):
        first = not self.programs
        cf = self.program(name)
        if first:
            t0 = time.perf_counter()
            result = self._run(cf, args, kwargs)
            self.first_call_seconds = time.perf_counter() - t0
        else:
            result = self._run(cf, args, kwargs)
        self.program_calls[name] = self.program_calls.get(name, 0) + 1
        out, (token, *values) = result
        rec = self._records[token]
        if rec.records:
            self._replay(rec, values)
        if rec.events:
            self._replay_events(rec.events)
        if name not in self._warned_retraces and cf.stats.cache_misses > self.RETRACE_WARNING:
            self._warned_retraces.add(name)
            reasons = "; ".join(cf.stats.retrace_reasons[-3:])
            what = self.name if name in ("forward", "manual") else f"{self.name} ({name} program)"
            self._warn(
                f"ThunderCallback: {what} was traced {cf.stats.cache_misses} times (last reasons: {reasons}). "
                "Each trace costs far more than a step; keep the batch's shapes and Python values, and the module's "
                "public attributes, the same from step to step."
            )
        return out

    def _run(self, cf, args, kwargs):
        try:
            return cf(self.module, *args, **kwargs)
        except ThinModeError as err:
            if err.kind != "per_call_input":  # check_every found a change of what thin mode bound: the user asked to know
                raise
            # A per-call input broke the binding's contract (e.g. the last, smaller batch); nothing ran yet: run the
            # full path.
            self.thin_rebinds += 1
            cf.revalidate()
            return cf(self.module, *args, **kwargs)

    def _replay(self, recorder, values):
        log = self.module.log
        for name, (kind, v), args, kwargs in recorder.records:
            log(name, values[v] if kind == "out" else v, *args, **kwargs)
        new = [n for n in recorder.constants if n not in self._warned_constants]
        if new:
            self._warned_constants.update(new)
            self._warn(
                f"ThunderCallback: {self.name} logs {', '.join(map(repr, new))} with a Python value computed while "
                "tracing; the compiled step replays that same value on every step. Log values that change from step "
                "to step (a learning rate, a counter) in an eager hook such as on_train_batch_end."
            )

    def _replay_events(self, events):
        wrappers = self.module.trainer.strategy._lightning_optimizers
        for event in events:
            if event[0] == "optimizer_step":  # what LightningOptimizer.step does around the update, in Python
                w = wrappers[event[1]]
                w._on_before_step()
                w._on_after_step()
            else:
                _, scheduler, args, kwargs = event
                scheduler.step(*args, **kwargs)

    def summary(self) -> str:
        """``name: calls, traces, thin calls, retrace reasons``; one indented line per program when there are several."""
        if not self.programs:
            return f"{self.name}: not called"

        def describe(cf):
            st = cf.stats
            text = f"{st.entries} trace(s) ({st.total_trace_seconds:.2f}s)"
            if self._options["thin"]:
                text += f", {st.thin_calls} thin calls"
            if st.retrace_reasons:
                text += f"; retrace reasons: {'; '.join(st.retrace_reasons[-3:])}"
            if st.opaque_ops:
                text += f"; run opaquely by torch: {', '.join(st.opaque_ops)}"
            return text

        head = f"{self.name}: {self.calls} calls"
        rebinds = f", {self.thin_rebinds} batch(es) off the bound shape ran the full path" if self.thin_rebinds else ""
        if len(self.programs) == 1:
            (pname, cf), = self.programs.items()
            where = "" if pname in ("forward", "manual") else f" [{pname} program]"
            st = describe(cf)
            first, _, rest = st.partition(";")
            return f"{head}{where}, {first}, first call {self.first_call_seconds:.2f}s{rebinds}" + (f";{rest}" if rest else "")
        lines = [f"{head}, first call {self.first_call_seconds:.2f}s{rebinds}"]
        for pname, cf in self.programs.items():
            lines.append(f"  {pname} program: {cf.stats.calls} calls, {describe(cf)}")
        return "\n".join(lines)
