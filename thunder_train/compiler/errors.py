"""The errors users meet, in one low module so that every layer can raise them.

``thunder_train`` exports them (with ``GuardFailure`` and ``ThinModeError`` from ``guards/errors.py``).
"""
from __future__ import annotations


class TracingError(RuntimeError):
    """The function cannot be traced as written; the message says why and what to do."""


class UnsupportedOpError(NotImplementedError):
    """A torch op the compiler cannot trace (strict mode, or no meta implementation)."""


class DataDependentError(RuntimeError):
    """Python code needs a tensor's value, which does not exist while tracing."""


class NoGradientRuleError(NotImplementedError):
    """Backward through an operation that has no gradient rule."""
