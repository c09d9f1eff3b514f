"""Compare float16 / bfloat16 forward values and gradients of one PyTorch OpInfo bitwise with eager (CPU).

Used by ``tests/test_low_precision_sweep.py`` (a bounded list of ops) and ``benchmarks/low_precision_sweep.py``
(every elementwise and reduction OpInfo).  Eager computes a half or bfloat16 op in float32 and rounds the
result, once per op; a compiled gradient rule must round where eager's formula does, or its gradients differ
from eager's by an ulp in part of the elements.  ``check`` returns ``(status, detail)`` with status ``pass``,
``mismatch`` (values differ: the detail names the dtype, sample and count), ``error`` (the compiled call raised)
or ``skip`` (no low-precision sample eager runs).
"""
from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

import thunder_train as tt

DTYPES = (torch.float16, torch.bfloat16)


def _clone(args, kwargs):
    def c(t):
        if isinstance(t, torch.Tensor):
            return t.detach().clone().requires_grad_(t.requires_grad)
        return t

    flat, spec = tree_flatten((args, kwargs))
    return tree_unflatten([c(t) for t in flat], spec)


def _differs(a, e):
    """How many elements differ (NaN equals NaN), or None where a and e are not comparable tensors."""
    if not isinstance(e, torch.Tensor):
        return 0 if a == e or (e != e and a != a) else 1
    if not isinstance(a, torch.Tensor) or a.shape != e.shape or a.dtype != e.dtype:
        return -1
    a, e = a.detach(), e.detach()
    same = (a == e) | (torch.isnan(a) & torch.isnan(e)) if e.is_floating_point() else a == e
    return int((~same).sum())


def _run(fn, s, args, kwargs, want_grads):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn(*args, **kwargs)
        out = s.output_process_fn_grad(out) if want_grads else out
        if not want_grads:
            return tree_flatten(out)[0], []
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point()]
        if not outs or not ins:
            return tree_flatten(out)[0], []
        g = torch.Generator().manual_seed(7)
        cots = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
        gs = torch.autograd.grad(outs, ins, cots, allow_unused=True)
        return tree_flatten(out)[0], [torch.zeros_like(t) if d is None else d for t, d in zip(ins, gs)]


def check(op, samples=2, fusion=None):
    """Bitwise comparison of ``op``'s float16 and bfloat16 samples (forward, then gradients) with eager."""
    ran, first_error = False, None
    supported = op.supported_dtypes("cpu")
    backward = op.supported_backward_dtypes("cpu") if op.supports_autograd else ()
    for dtype in DTYPES:
        if dtype not in supported:
            continue
        want_grads = dtype in backward
        try:
            sample_list = list(op.sample_inputs("cpu", dtype, requires_grad=want_grads))[:samples]
        except Exception:  # noqa: BLE001 - the OpInfo makes no samples for this dtype
            continue
        for i, s in enumerate(sample_list):
            args, kwargs = (s.input,) + tuple(s.args), dict(s.kwargs)
            try:
                torch.manual_seed(0)
                e_out, e_grads = _run(op.op, s, *_clone(args, kwargs), want_grads)
                torch.manual_seed(1)
                if any(_differs(a, e) for a, e in zip(_run(op.op, s, *_clone(args, kwargs), False)[0], e_out)):
                    continue  # a random op: values are not comparable
            except Exception:  # noqa: BLE001 - eager rejects the sample
                continue
            cf = tt.compile(lambda *a, **k: op.op(*a, **k), fusion=fusion)
            torch.manual_seed(0)
            try:
                c_out, c_grads = _run(cf, s, *_clone(args, kwargs), want_grads)
            except Exception as err:  # noqa: BLE001 - a loud failure, reported
                first_error = first_error or f"{dtype} sample {i}: {type(err).__name__}: {str(err)[:120]}"
                continue
            ran = True
            for what, got, want in (("forward", c_out, e_out), ("gradient", c_grads, e_grads)):
                counts = [_differs(a, e) for a, e in zip(got, want)]
                if len(got) != len(want) or any(counts):
                    total = [getattr(e, "numel", lambda: 1)() for e in want]
                    return "mismatch", f"{what} {str(dtype).removeprefix('torch.')} sample {i}: {counts} of {total}"
    if first_error:
        return "error", first_error
    return ("pass" if ran else "skip"), ""
