"""Errors of tracing, in a module of their own so that every tracing helper can raise them."""
from __future__ import annotations


class TracingError(RuntimeError):
    """The function cannot be traced as written; the message says why and what to do."""
