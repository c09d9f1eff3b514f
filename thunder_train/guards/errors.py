"""The structured errors a failed check raises."""
from __future__ import annotations


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
