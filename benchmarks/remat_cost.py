"""What the default's cheap-value recomputation costs a zoo model's step (issue 27: at most 2 %).

Run: PYTHONPATH=. python benchmarks/remat_cost.py MODEL [FUSIONS] [STEPS]
     e.g. benchmarks/remat_cost.py vit background 300; FUSIONS: comma-separated, ``none`` for ``fusion=None``,
     ``module`` for ``tt.compile(model)`` (its forward and backward programs; eager's optimizer step); ``none`` is
     also the plan the default's torch program runs until its fused program is built.  ``--no-keep-buffers``: the
     programs built with ``keep_buffers=False`` (the recomputation's own cost, without the memory it gives the
     kept buffers or takes from them).
     MODEL ``gpt``: the GPT benchmark step (benchmarks/memory.py ``gpt_workload``; ~0.4 s a step on one thread,
     so 40 steps are plenty).

For each fusion mode, the thin whole step of ``tests/_zoo.py``'s MODEL (or, for ``module``, the same step calling
the compiled module) built twice: as the default plans it, and
with its cheap-value recomputation off (``benchmarks/memory.py`` ``without_cheap_remat``, a measuring aid); the
fused program is waited for.  The calling thread's CPU time per step (torch on one thread), the modes' steps
interleaved in a new order each step; medians.  Not a test: timings vary by machine.
"""
from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("tests", "benchmarks", "recipes"):
    sys.path.insert(0, os.path.join(ROOT, sub))
from memory import gpt_workload, without_cheap_remat, zoo_workload  # noqa: E402

import thunder_train as tt  # noqa: E402


def main(argv):
    keep_buffers = "--no-keep-buffers" not in argv
    argv = [a for a in argv if a != "--no-keep-buffers"]
    name = argv[0]
    fusions = (argv[1] if len(argv) > 1 else "none,background").split(",")
    steps = int(argv[2]) if len(argv) > 2 else 200
    torch.set_num_threads(1)
    base, make_opt, batches, train_step, _ = gpt_workload() if name == "gpt" else zoo_workload(name)
    modes = []
    # Each mode built twice, in mirrored order (on, off, off, on): the program built first ran its tiny steps
    # measurably slower (transformer_encoder's computation alone, built on-then-off +63 us, off-then-on +25 us).
    builds = [(f, r) for f in fusions for r in (True, False)]
    for fusion, remat in builds + builds[::-1]:
        model = copy.deepcopy(base)
        opt = make_opt(model.parameters())
        if fusion == "module":  # the compiled module in the zoo's step: PyTorch's autograd between its programs
            model = tt.compile(model, keep_buffers=keep_buffers)
            step, compiled = train_step, model
        else:
            step = compiled = tt.compile(train_step, thin=True, fusion=None if fusion == "none" else fusion,
                                         keep_buffers=keep_buffers)
        with contextlib.nullcontext() if remat else without_cheap_remat():
            for b in batches[:3]:
                step(model, opt, b)
            tt.wait_for_fusion(compiled)
        modes.append((f"fusion={fusion}, cheap remat {'on' if remat else 'off'}", step, model, opt, []))
    for i in range(steps):
        for label, step, model, opt, times in modes[i % len(modes):] + modes[:i % len(modes)]:
            t0 = time.thread_time()
            step(model, opt, batches[i % len(batches)])
            times.append(time.thread_time() - t0)
    pooled = {}
    for label, *_, times in modes:
        pooled.setdefault(label, []).extend(times)
    print(f"{name}; {steps} steps per mode (two builds of each), thread CPU time")
    for label, times in pooled.items():
        builds_ms = ", ".join(f"{statistics.median(t) * 1e3:.3f}" for lab, *_, t in modes if lab == label)
        print(f"  {label:<40}{statistics.median(times) * 1e3:>9.3f} ms   (each build: {builds_ms})")


if __name__ == "__main__":
    main(sys.argv[1:])
