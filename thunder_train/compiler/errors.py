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


class DecisionMismatch(Exception):
    """A program's check of a Python decision on an intermediate value found the other value.

    Raised by ``prims.check_decision`` (``acquisition/decisions.py``) before the program wrote anything;
    ``compiled.py`` catches it and runs (or traces) the program for the value observed.  ``index`` is the
    decision's position among the program's checked decisions, ``value`` what this call decided.
    """

    def __init__(self, index: int, value, text: str = ""):
        super().__init__(
            f"{text or 'a decision on an intermediate value'} went the other way ({value!r}); the program was "
            "abandoned before writing anything. Called through tt.compile, the call re-dispatches to the program "
            "for this value; called directly (direct_call_parts), call the compiled function instead.")
        self.index = index
        self.value = value
