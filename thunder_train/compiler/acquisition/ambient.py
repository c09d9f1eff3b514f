"""State set up around the code, which eager PyTorch consults on every op and a compiled program cannot honour.

Eager runs each op under whatever the caller (or the step itself) set up around it:

* a ``TorchFunctionMode`` or ``TorchDispatchMode`` (``FlopCounterMode``, a user's mode that rewrites or records
  ops): a program traced without the mode runs kernels that reach it only in part (a fused region never), so its
  effect would be half-applied; a dispatch mode entered inside the step sees nothing while tracing (the tracer
  records torch calls before they reach aten);
* saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``, ``save_on_cpu``): eager packs every value a
  backward needs through them; a compiled program keeps its own saved values and calls no hook, so a compression
  (values) or an offload (memory) would silently not happen;
* anomaly detection with its NaN check (``torch.autograd.set_detect_anomaly(True)``): eager checks every backward
  node's outputs; a backward inside a compiled program is one program and checks nothing;
* a torch.func transform (``vmap``, ``grad``, ``jacrev``, ``jvp``) around the call: the program's kernels see its
  wrapped tensors (batching rules refuse kept buffers' ``out=`` kernels; a fused kernel would not be batched);
* a forward-mode AD level (``torch.autograd.forward_ad.dual_level``): eager carries the tangents of dual inputs
  through every op; a fused program drops them (its output had no tangent) and kept buffers' ``out=`` kernels
  raise torch's "forward AD ... out= function".

Each is refused with what to do: at the call (``refusal``, the full path; thin mode's head compares the stacks'
lengths, ``thin_checks._head``) and while tracing (``refuse_while_tracing``, each torch call the step makes;
``refuse_anomaly_at_backward``).  Not refused, since the compiled program gives eager's values under them:
``torch.set_default_device``'s mode (the trace reads the default device), ``torch.utils.checkpoint``'s own hooks and
selective-checkpoint modes (a compiled module called inside an eager checkpoint region is one autograd node to
them; inside a compiled function they are read as regions, checkpoint_regions.py), thunder_train's own modes, a mode
that declares it only observes the kernels the program runs (``thunder_train_observes = True``: an op counter),
anomaly detection without its NaN check, and anomaly detection where the backward runs outside the program
(``tt.compile(model)``: autograd checks its node).
"""
from __future__ import annotations

import torch
import torch.autograd.forward_ad as forward_ad

from ..errors import TracingError

# torch's own modes that change no value of a compiled call (module docstring)
_HARMLESS = {("torch.utils._device", "DeviceContext"), ("torch.utils.checkpoint", "_CachingTorchDispatchMode"),
             ("torch.utils.checkpoint", "_CachedTorchDispatchMode")}


def _foreign(mode) -> bool:
    """A mode the compiled call would not honour: not torch's harmless ones, not ours, and not one that declares it
    only observes what runs (``thunder_train_observes = True`` on its class or instance: a counter of the compiled
    program's own kernels, which then reach it as they run)."""
    module = type(mode).__module__ or ""
    return ((module, type(mode).__name__) not in _HARMLESS and not module.startswith("thunder_train.")
            and not getattr(mode, "thunder_train_observes", False))


def _name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def mode_stacks() -> tuple:
    """(function modes, dispatch modes) active now: how many (thin mode compares them on each call)."""
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def _foreign_on(length, mode_at) -> list:
    return [m for m in (mode_at(i) for i in range(length())) if _foreign(m)]


def foreign_dispatch_modes() -> list:
    return _foreign_on(torch._C._len_torch_dispatch_stack, torch._C._get_dispatch_stack_at)


def foreign_modes() -> list:
    """The function and dispatch modes active now that a compiled program would not honour, innermost last."""
    return _foreign_on(torch._C._len_torch_function_stack, torch._C._get_function_stack_at) + foreign_dispatch_modes()


def top_pack_hook():
    """The pack hook of the innermost saved-tensor hooks, or None (checkpoint_regions.py reads it too)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if top is None else top[0]


def foreign_saved_hooks():
    """The pack hook of the innermost saved-tensor hooks, unless it is none or activation checkpointing's own."""
    pack = top_pack_hook()
    return None if getattr(pack, "__module__", None) == "torch.utils.checkpoint" else pack


def anomaly_checks_nan() -> bool:
    return torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()


def _hook_name(pack) -> str:
    return getattr(pack, "__qualname__", None) or repr(pack)


def _modes_message(modes, where: str) -> str:
    names = ", ".join(_name(m) for m in modes)
    if where == "call":
        return (f"{names} is active around the call of a compiled function: the program was traced without it, and "
                "its kernels would reach the mode only in part (fused ones never), so the mode's effect (a changed op, "
                "a count) would be half-applied. Call the compiled function outside the mode, or call the uncompiled "
                "function under it (to count FLOPs, count the uncompiled step). A mode that only observes the kernels "
                "the compiled program runs may say so: thunder_train_observes = True on its class or instance.")
    return (f"{names} was entered inside a compiled function: the tracer records torch calls before they reach aten, "
            "so the mode sees none of them and the program would run without it. Enter it outside and call the "
            "uncompiled function there, or remove it from the function.")


def _hooks_message(pack, where: str) -> str:
    place = "are active around the call of" if where == "call" else "were entered inside"
    return (f"saved-tensor hooks ({_hook_name(pack)}) {place} a compiled function: eager packs every value its "
            "backward needs through them, while the compiled program keeps its own saved values and calls no hook, "
            "so an offload or a compression would silently not happen. To lower memory, use "
            "tt.compile(..., memory_budget=f) or activation checkpointing inside the function; or call the "
            "uncompiled function under the hooks.")


ANOMALY_MESSAGE = (
    "anomaly detection with its NaN check is on (torch.autograd.set_detect_anomaly(True)): eager checks every "
    "backward node's outputs for NaN, but the backward inside a compiled function runs as one program and checks "
    "nothing, so a NaN would pass unreported. Debug with the uncompiled function, turn the check off "
    "(torch.autograd.set_detect_anomaly(False), or check_nan=False), or compile the model only (tt.compile(model): "
    "autograd checks its backward as one node).")


FORWARD_AD_MESSAGE = (
    "a forward-mode AD level is active around the call of a compiled function (torch.autograd.forward_ad.dual_level): "
    "eager carries dual inputs' tangents through every op, the compiled program computes no tangents. Call the "
    "uncompiled function inside the dual level, or compute the directional derivative outside it "
    "(torch.autograd.grad of the compiled function's output).")


def forward_ad_level() -> bool:
    return forward_ad._current_level >= 0


TRANSFORM_MESSAGE = (
    "a torch.func transform (vmap, grad, jacrev, jvp, functional_call's autograd) is active around the call of a "
    "compiled function: the compiled program's kernels would run on the transform's wrapped tensors, which they do "
    "not support. Apply the transform to the uncompiled function.")


def refusal(runs_backward: bool) -> str | None:
    """Why a call made now cannot run compiled (``runs_backward``: its program holds a backward), or None."""
    if forward_ad_level():
        return FORWARD_AD_MESSAGE
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return TRANSFORM_MESSAGE
    modes = foreign_modes()
    if modes:
        return _modes_message(modes, "call")
    pack = foreign_saved_hooks()
    if pack is not None:
        return _hooks_message(pack, "call")
    if runs_backward and anomaly_checks_nan():
        return ANOMALY_MESSAGE
    return None


def refuse_at_call(runs_backward: bool) -> None:
    why = refusal(runs_backward)
    if why is not None:
        raise TracingError(why)


def refuse_while_tracing(needs_grad) -> None:
    """A torch call of the traced step: refused under a dispatch mode or saved-tensor hooks the step entered
    (``needs_grad()``: whether the call has an argument that requires grad, where hooks would pack something)."""
    if forward_ad_level():
        raise TracingError(
            "forward-mode AD (torch.autograd.forward_ad.dual_level) inside a compiled function is not supported: the "
            "compiled program computes no tangents. Compute the directional derivative with torch.autograd.grad, or "
            "call the function uncompiled.")
    if torch._C._len_torch_dispatch_stack():
        modes = foreign_dispatch_modes()
        if modes:
            raise TracingError(_modes_message(modes, "inside"))
    pack = foreign_saved_hooks()
    if pack is not None and torch.is_grad_enabled() and needs_grad():
        raise TracingError(_hooks_message(pack, "inside"))


def refuse_anomaly_at_backward() -> None:
    if anomaly_checks_nan():
        raise TracingError(ANOMALY_MESSAGE)
