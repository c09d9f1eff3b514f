"""``torch.compile``'d modules and functions reached while tracing run as their Python code.

A model wrapped by ``torch.compile`` (an ``OptimizedModule``) or a ``@torch.compile`` loss function called by the
step would hand Dynamo frames whose tensors are proxies: it failed deep inside Inductor ("BackendCompilerFailed",
with pages of graph-break logs). ``torch.compile`` does not change what the code computes, so while a thread traces,
Dynamo's frame conversion is off (``torch._dynamo.config.disable``, which it reads for every frame it would compile)
and the wrapped code is traced like any other: its ops become the compiled program's.  Frames Dynamo compiled
before keep their code: their guards fail on proxies, and the frame runs as Python.  Process-wide while the trace
runs (a trace holds ``TRACING_LOCK``): another thread's first ``torch.compile`` call in that moment runs eagerly.
Nothing is imported where the process never imported ``torch._dynamo``.
"""
from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def traced_as_python():
    dynamo = sys.modules.get("torch._dynamo")
    config = getattr(dynamo, "config", None) if dynamo is not None else None
    if config is None:
        yield
        return
    before = config.disable
    config.disable = True
    try:
        yield
    finally:
        config.disable = before
