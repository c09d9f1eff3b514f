"""thunder_train: compile PyTorch training steps.

Public API: ``compile``, ``last_traces``, ``last_prologue_traces``, ``last_backward_traces``,
``compile_stats``, ``wait_for_fusion``, the errors a user meets (``UnsupportedOpError``, ``DataDependentError``,
``NoGradientRuleError``, ``TracingError``, ``ThinModeError``, ``GuardFailure``, ``AutocastCacheError``) and (lazily, it
imports Lightning) ``ThunderCallback``.
"""
from .compiled import compile, last_traces, last_prologue_traces, last_backward_traces, compile_stats, CompiledFunction, ThunderModule, wait_for_fusion  # noqa: F401
from .compiler.errors import DataDependentError, GuardFailure, NoGradientRuleError, ThinModeError, TracingError, UnsupportedOpError  # noqa: F401
from .runtime.autocast_region import AutocastCacheError  # noqa: F401

__version__ = "0.1.0"

__all__ = ["compile", "last_traces", "last_prologue_traces", "last_backward_traces", "compile_stats", "wait_for_fusion", "ThunderCallback",
           "UnsupportedOpError", "DataDependentError", "NoGradientRuleError", "TracingError", "ThinModeError", "GuardFailure",
           "AutocastCacheError"]


def __getattr__(name):
    if name == "ThunderCallback":
        from .callbacks import ThunderCallback

        return ThunderCallback
    raise AttributeError(f"module 'thunder_train' has no attribute {name!r}")
