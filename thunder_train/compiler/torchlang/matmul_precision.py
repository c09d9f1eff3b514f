"""The process-wide switches that choose a float32 matmul or convolution kernel's precision, declared on the ops
that read them (``Symbol.kernel_switches``; replayed by ``acquisition/kernel_switches.py``).

``torch.set_float32_matmul_precision("high")`` or ``torch.backends.cuda.matmul.allow_tf32 = True`` set by the traced
function itself, around some of its matmuls (and restored before it returns), were in force only while tracing:
later calls would run those matmuls under the caller's precision (TF32 or not on CUDA). So such an op is recorded
as a call that sets the switches it was traced under, runs the op and puts the caller's back, as eager's run of
that code does on every call.  Switches set outside the function apply as in eager (nothing is baked in).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _precision():
    """The legacy float32 matmul precision, or None where torch refuses to name one (its per-backend settings were
    set apart, through the newer ``fp32_precision`` attributes or the TF32 flags)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        return None


def _read() -> tuple:
    return _precision(), torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32


def _write(switches) -> None:
    precision, matmul_tf32, cudnn_tf32 = switches
    # Each switch is set only where it differs, through the setters torch's own ``flags()`` context uses: torch's
    # test utilities lock the ``torch.backends.cudnn`` attributes (``disable_global_flags``).
    if torch.backends.cuda.matmul.allow_tf32 != matmul_tf32:
        torch._C._set_cublas_allow_tf32(matmul_tf32)  # sets the precision to "high" or "highest" ...
    if precision is not None and _precision() != precision:
        torch.set_float32_matmul_precision(precision)  # ... which this then refines ("medium")
    if torch.backends.cudnn.allow_tf32 != cudnn_tf32:
        torch._C._set_cudnn_allow_tf32(cudnn_tf32)


_runners: dict = {}


def _under(torch_fn):
    """``switches -> torch_fn`` run under them (one function per op and setting, named after the precision)."""

    def runner_for(switches):
        key = (torch_fn, switches)
        run = _runners.get(key)
        if run is not None:
            return run

        def run(*args, **kwargs):
            before = _read()
            _write(switches)
            try:
                return torch_fn(*args, **kwargs)
            finally:
                _write(before)

        precision, matmul_tf32, cudnn_tf32 = switches
        name = getattr(torch_fn, "__name__", "op")
        run.__name__ = run.__qualname__ = (f"{name}_with_precision_{precision}"
                                           f"{'_tf32' if matmul_tf32 else ''}{'_cudnn_tf32' if cudnn_tf32 else ''}")
        run.__doc__ = (f"{name} under float32 matmul precision {precision!r}, cuda.matmul.allow_tf32={matmul_tf32}, "
                       f"cudnn.allow_tf32={cudnn_tf32} (set by the compiled function around it)")
        run.__module__ = __name__
        _runners[key] = run
        return run

    return runner_for


def precision_switches(torch_fn):
    """The ``Symbol.kernel_switches`` fact of an op that reads the precision switches and calls ``torch_fn``:
    declared with the op (``linalg.matmul.kernel_switches = precision_switches(torch.matmul)``)."""
    runner_for = _under(torch_fn)
    return lambda: (_read, runner_for)
