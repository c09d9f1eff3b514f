"""Whole training steps of the model zoo (tests/_zoo.py: tiny random-init transformers and torch.nn models):
eager, ``tt.compile(step, thin=True)`` with its defaults, with ``--inductor`` also with ``fusion="inductor"``, and
with ``--torch-compile`` ``torch.compile``, in one
process, their calls interleaved (one step of each in turn), each mode training its own copy of the model.

Run: python benchmarks/zoo_steps.py [--models gpt2,resnet,...] [--steps 150] [--torch-compile] [--inductor]
[--torch-program] [--cpu-time] [--steady]
Prints per model the median step time of each mode, ratio = eager median / mode median (> 1: faster than
eager), the first call's time and whether the compiled run matched eager's losses.  One step of each mode in turn, in a
new order each step.  ``--torch-program`` also times ``fusion=None`` (the torch program the default runs until its fused
program takes over); ``--cpu-time`` times each step with the thread's CPU clock (steadier on a shared machine;
meaningful with ``--threads 1``).  The zoo's models are tiny
(hidden 32, 2 layers, batch 2): these steps measure per-step host overhead more than kernels.  Not a test:
timings vary by machine (docs/performance.md has the latest run).
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import _zoo  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.compiler.pipeline import _fused_regions  # noqa: E402


def run(name, steps, with_torch_compile, with_inductor, with_torch_program=False, clock=time.perf_counter, steady=False):
    models = {"eager": _zoo.build(name)}
    fns = {"eager": _zoo.train_step, "tt thin (default)": tt.compile(_zoo.train_step, thin=True)}
    if with_torch_program:
        fns["tt thin fusion=None"] = tt.compile(_zoo.train_step, thin=True, fusion=None)
    if with_inductor:
        fns["tt thin fusion='inductor'"] = tt.compile(_zoo.train_step, thin=True, fusion="inductor")
    if with_torch_compile:
        torch._dynamo.reset()  # one step function for every model: without a reset, dynamo's recompile limit makes it eager
        fns["torch.compile"] = torch.compile(_zoo.train_step)
    for k in fns:
        models.setdefault(k, copy.deepcopy(models["eager"]))
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    batches = _zoo.batches(name, 4)
    first, losses, times = {}, {k: [] for k in fns}, {k: [] for k in fns}
    keys, shuffle = list(fns), random.Random(0).shuffle
    for i in range(steps + 10):
        b = batches[i % len(batches)]
        # the modes in a new order each step (the first step in the order above): a step right after eager's runs on
        # caches eager's step filled (Falcon's thin step about 10 % slower, single thread), and rotating the order
        # would keep each mode's predecessor
        order = list(keys)
        if i:
            shuffle(order)
        for k in order:
            fn = fns[k]
            t0 = clock()
            loss = fn(models[k], opts[k], b)
            dt = clock() - t0
            if i == 0:
                first[k] = dt
            if i == 1 and steady and k == "tt thin (default)":
                # The steady entry's fused program built now and switched to (not timed).  Not after the first call:
                # the optimizer's state made there is an input of the second, whose entry is the one every later
                # step runs (the first call's entry runs once).
                tt.wait_for_fusion(fn)
            elif i >= 10:
                times[k].append(dt)
            if i < 5:
                losses[k].append(loss.detach())
    med = {k: statistics.median(v) for k, v in times.items()}
    same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(losses["tt thin (default)"], losses["eager"]))
    if steady:  # the program the last call ran: the fused one (else the torch program was timed)
        fused = _fused_regions(tt.last_traces(fns["tt thin (default)"])[-1])
        print(f"{name}: the default's last call ran {'its fused program' if fused else 'its torch program'} "
              f"({fused} fused regions)", flush=True)
    cells = "  ".join(f"{k} {med[k] * 1e3:6.2f} ms ({med['eager'] / med[k]:4.2f}x, first {first[k]:5.2f} s)" for k in fns)
    print(f"{name:20s} {cells}  losses match eager: {same}", flush=True)
    return {k: med["eager"] / med[k] for k in fns}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(_zoo.CASES))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--inductor", action="store_true", help="also tt thin with fusion='inductor' (fused from the first call)")
    p.add_argument("--torch-program", action="store_true", help="also tt thin with fusion=None")
    p.add_argument("--cpu-time", action="store_true", help="time with the thread's CPU clock")
    p.add_argument("--steady", action="store_true",
                   help="the default's fused program built and switched to after its second call (tt.wait_for_fusion): "
                        "its steady state, which a run of few steps does not reach (the build starts at the call where "
                        "it pays for itself, thousands of calls on these models)")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ratio = eager median / mode median")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    ratios = {name: run(name, args.steps, args.torch_compile, args.inductor, args.torch_program, clock, args.steady)
              for name in args.models.split(",")}
    slower = [n for n, r in ratios.items() if r["tt thin (default)"] < 1.0]
    print(f"tt thin (default) slower than eager on: {', '.join(slower) if slower else 'none'}")
    return ratios


if __name__ == "__main__":
    main()
