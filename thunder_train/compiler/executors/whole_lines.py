"""Lines a fused program compiles whole: one Inductor kernel for a torch-executor function made of many torch calls.

Some lines the torch executor runs are functions of ten or more torch calls on small tensors: eager's math attention
and its backward (``attention_math.py``: two batched matmuls around a masked softmax; four around its gradient).
Run op by op, each call costs its dispatch (about 95 us a line for T5's tiny attention, of which a few us are
arithmetic).  Such a function declares ``whole_form``: for a line's arguments, the torch function a kernel computes
for it (itself, or another with the same arguments and results: small narrow-value attention as products,
``attention_products.py``), or None.  In a program fused by Inductor the line becomes one compiled call: Inductor's
generated code runs the matmuls as its extern calls and fuses the elementwise ops and the softmax into its own loops
(about 25 us for the same line).  The line's results are the kernel's outputs, written into buffers laid out as the
trace recorded (so kept buffers write them in place, executors/buffers.py); the layout check and the fallback (the
line's own function, for a call whose tensors are laid out otherwise) are a fused region's (inductor_fusion.py: the
kernel is compiled as a region of one line).  A function whose own code reads process state at run time declares
``whole_guard``, asked before each kernel call (eager's math attention: whether the math kernel is switched on; where
not, the line's function raises eager's error); one whose function refuses some argument values declares
``whole_check``, asked of each kernel call's results: where it says no, the line's function runs and raises
(cross-entropy's targets out of range, small_cross_entropy.py).

Values round as Inductor's loops round (a softmax summed in another order): within the fused programs' tolerances,
no longer bitwise eager's; the torch program keeps the op-by-op line.  The pass runs after the forward/backward pairs
are chosen (saved_statistics.py), since the lines it compiles are those pairs; the pay-back estimate that starts a
background build (payback.py) counts fused regions only, so these kernels' saving is not in it.
"""
from __future__ import annotations

from ..proxies import is_proxy
from ..symbols import BoundSymbol
from . import inductor_fusion, small_cross_entropy  # noqa: F401  (small_cross_entropy declares its lines' forms)
from .fusion import choose
from .regions import FusionSymbol, results, whole_form


def _fits(line) -> bool:
    """Whether Inductor may take the line: tensor results, its tensors of static sizes on one fused device."""
    made = [o for o, _ in results(line)]
    tensors = [a for a in line.flat_args() if is_proxy(a)] + made
    return bool(made) and all(inductor_fusion.why_not_in_kernel(t) is None for t in tensors) \
        and inductor_fusion.device_of(line) is not None


def compile_whole_lines(trc, fusion: str, notes: list, *, prefix: str = "inductor_line"):
    """``trc`` with each line whose function declares a ``whole_form`` for its arguments replaced by one Inductor
    kernel's call, when ``fusion`` means Inductor for this trace (nvFuser takes no matmuls); a line Inductor cannot
    compile stays, with a note in ``notes`` (``compile_stats(cf).fusion_notes``)."""
    if not any(hasattr(getattr(b.sym, "fn", None), "whole_form") for b in trc.bound_symbols) \
            or choose(trc, fusion, notes) != "inductor":
        return trc
    out, count, failed = [], 0, 0
    for b in trc.bound_symbols:
        fn = getattr(b.sym, "fn", None)
        if whole_form(b) is None or not _fits(b):
            out.append(b)
            continue
        outputs = [o for o, _ in results(b)]
        kernel, inputs = inductor_fusion.kernel_for([b], outputs)
        name = f"{prefix}_{count + failed}"
        if isinstance(kernel, str):
            failed += 1
            notes.append(f"{name}: {fn.__name__} left to torch: Inductor failed: {kernel}")
            out.append(b)
            continue
        count += 1
        if kernel.uses == 0:
            notes.append(f"{name}: {fn.__name__} compiled whole into one Inductor kernel in {kernel.seconds:.2f} s")
        kernel.uses += 1
        sym = FusionSymbol(name, kernel.runner, owner=kernel)
        result = outputs[0] if len(outputs) == 1 else tuple(outputs)  # the runner returns one output bare
        out.append(BoundSymbol(sym, tuple(inputs), {}, result, (b,), f"{name}: {fn.__name__} compiled whole by Inductor"))
    if not count:
        return trc
    new = trc.derive(f"{trc.header}; {count} line(s) compiled whole by Inductor")
    new.bound_symbols = out
    return new
