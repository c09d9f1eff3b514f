"""What checking a fused kernel's tensors costs a zoo model's step: Inductor's per-input asserts against one C++ check.

Run: PYTHONPATH=. python benchmarks/kernel_checks.py MODEL [STEPS]

Fused regions' kernels are compiled without Inductor's ``assert_size_stride`` calls and checked by
``executors/layout_check.py`` (one ``TensorGuards`` call for all their tensors) before they run.  Here the default
thin whole step of ``tests/_zoo.py``'s MODEL is built twice in one process, each with kernels of its own: with
Inductor's asserts in the generated code (what a torch without the guard library gets: ``layout_check.needs_asserts``
replaced while it is built) and as the default builds it.  Both fused programs are waited for; their steps
interleaved in a new order each step (calling thread's CPU time, torch on one thread, medians).  Prints each
program's median, the ratio default / asserts, and each program's fallback calls (both should be 0).  A measuring
aid: timings vary by machine.
"""
from __future__ import annotations

import copy
import os
import random
import statistics
import sys
import time
import weakref

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import _zoo  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.compiler.executors import inductor_fusion, layout_check  # noqa: E402


def build(base, batches, asserts: bool):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    needs = layout_check.needs_asserts
    layout_check.needs_asserts = (lambda: True) if asserts else needs
    inductor_fusion._kernels = weakref.WeakValueDictionary()  # kernels of its own, not the other program's
    try:
        cf = tt.compile(lambda b: _zoo.train_step(model, opt, b), thin=True)
        cf(batches[0])
        cf(batches[1])
        tt.wait_for_fusion(cf)  # the second call's entry is the one every later step runs
        cf(batches[2])
    finally:
        layout_check.needs_asserts = needs
    return cf


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    name, steps = argv[0], int(argv[1]) if len(argv) > 1 else 300
    torch.set_num_threads(1)
    base, batches = _zoo.build(name), _zoo.batches(name, 4)
    progs = {"asserts": build(base, batches, True), "default": build(base, batches, False)}
    times = {k: [] for k in progs}
    for i in range(steps):
        for k in random.sample(list(progs), len(progs)):
            t0 = time.thread_time()
            progs[k](batches[i % 4])
            times[k].append(time.thread_time() - t0)
    med = {k: statistics.median(v[20:]) for k, v in times.items()}
    falls = {k: tt.compile_stats(c).fusion_fallback_calls for k, c in progs.items()}
    print(f"{name}: asserts {med['asserts'] * 1e3:.3f} ms, default {med['default'] * 1e3:.3f} ms, "
          f"default/asserts {med['default'] / med['asserts']:.3f}; fallback calls {falls}")


if __name__ == "__main__":
    main()
