"""The errors users meet, in one low module so that every layer can raise them.

Every error class of the package is here, those of compile time (``TracingError``, ...) and those of call time
(``GuardFailure``, ``ThinModeError``, raised by ``runtime/``); ``thunder_train`` exports them.
"""
from __future__ import annotations


class TracingError(RuntimeError):
    """The function cannot be traced as written; the message says why and what to do."""


class UninitializedLazyModule(TracingError):
    """The function reaches a lazy module (``nn.LazyLinear``, ...) whose first forward has not chosen its parameters'
    sizes yet.  ``runtime/`` runs such a call eagerly, as eager runs it (the forward initialises the parameters), and
    traces a later call."""


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

class GuardFailure(Exception):
    """An input differs from what a compiled program was specialised on.

    ``path`` names the input (``args[0].fc1.weight``), ``what`` the property
    (shape, dtype, ...), and ``expected``/``actual`` the two values.
    """

    def __init__(self, path: str, what: str, expected, actual, message: str | None = None):
        self.path = path
        self.what = what
        self.expected = expected
        self.actual = actual
        super().__init__(message or f"{path}: {what} expected {expected!r}, got {actual!r}")

    @property
    def reason(self) -> str:
        return f"{self.path}.{self.what}: {self.expected!r} → {self.actual!r}" if self.what not in ("value", "type", "object") else f"{self.path} ({self.what}): {self.expected!r} → {self.actual!r}"


class ThinModeError(GuardFailure):
    """A thin-mode call broke the contract thin mode relies on.

    Raised when a per-call input (the batch) differs from the bound program's
    input — a wrong shape, dtype, device, a different Python constant — and by
    ``check_every=N`` when the full prologue finds that something thin mode
    bound has changed.  The message names the input, the expected and the
    actual value, and what to do.

    ``kind`` tells the two apart: ``"per_call_input"`` (the binding stays; a
    call with matching inputs continues thin) or ``"check_every"`` (the binding
    was dropped; the next call runs the full path and binds again).
    """

    def __init__(self, path, what, expected, actual, message=None, kind="per_call_input"):
        super().__init__(path, what, expected, actual, message)
        self.kind = kind


# PyTorch's message for a backward through a graph an earlier backward freed (compiler/autograd_function.py,
# acquisition/returned_graph.py raise it where eager does).
SECOND_BACKWARD_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved tensors after they have "
    "already been freed). Saved intermediate values of the graph are freed when you call .backward() or "
    "autograd.grad(). Specify retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward."
)
