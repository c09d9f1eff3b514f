"""Prologues: find every input the computation reads and check what it was specialised on."""
from .errors import GuardFailure  # noqa: F401
