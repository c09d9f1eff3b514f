"""What the kept-buffer arena's bound costs a zoo model's step, and what lifting it costs in memory.

Run: PYTHONPATH=. python benchmarks/arena_bound.py MODEL [STEPS] [FRACTION | own]

The plan keeps the arena plus what the call still allocates within the program's own peak without buffers, with
room towards the step as written in a default step (executors/buffers.py ``plan``, ``_room``).  Here the default
thin whole step of ``tests/_zoo.py``'s MODEL is built twice in one process: as the default plans it, and with the
arena allowed FRACTION of that peak above it (``buffers._slack`` replaced while the second is built; default: no
bound), or, with ``own``, within the program's own peak (``buffers.TRACED_SHARE`` 0: the bound before that room).  Both fused programs are waited for;
their steps interleaved in a new order each step (calling thread's CPU time, torch on one thread, medians); each
program's peak (its kept buffers included, tests/_peak.py) and eager's, as ratios.  A measuring aid, not an option:
timings vary by machine.
"""
from __future__ import annotations

import copy
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import _zoo  # noqa: E402
from _peak import peak_call_bytes_all_threads  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.compiler.executors import buffers  # noqa: E402


def main(argv):
    name = argv[0]
    steps = int(argv[1]) if len(argv) > 1 else 300
    own = len(argv) > 2 and argv[2] == "own"
    fraction = float(argv[2]) if len(argv) > 2 and not own else None
    torch.set_num_threads(1)
    base, batches = _zoo.build(name), _zoo.batches(name, 4)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for b in batches[:2]:
        _zoo.train_step(model, opt, b)
    peaks = {"eager": peak_call_bytes_all_threads(lambda: _zoo.train_step(model, opt, batches[1]))}
    bounded, share = buffers._slack, buffers.TRACED_SHARE
    wide = (lambda natural: 1 << 40) if fraction is None else (lambda natural: int(natural * fraction))
    other = ("own peak", bounded, 0) if own else ("no bound" if fraction is None else f"+{fraction:g}", wide, share)
    modes = {}
    try:
        for label, slack, traced_share in (("default bound", bounded, share), other):
            buffers._slack, buffers.TRACED_SHARE = slack, traced_share
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            _zoo.train_step(model, opt, batches[0])
            step = tt.compile(_zoo.train_step, thin=True)
            for b in batches[1:3]:
                step(model, opt, b)
            tt.wait_for_fusion(step)
            step(model, opt, batches[0])
            peaks[label] = peak_call_bytes_all_threads(lambda: step(model, opt, batches[1]), step)
            modes[label] = (step, model, opt, [])
    finally:
        buffers._slack, buffers.TRACED_SHARE = bounded, share
    for i in range(steps):
        order = list(modes.values())
        random.shuffle(order)
        for step, model, opt, times in order:
            t0 = time.thread_time()
            step(model, opt, batches[i % len(batches)])
            times.append(time.thread_time() - t0)
    first = None
    print(f"{name}; {steps} steps each, thread CPU time; peaks against eager's ({peaks['eager']} B)")
    for label, (*_, times) in modes.items():
        ms = statistics.median(times) * 1e3
        first = first or ms
        print(f"  {label:<16}{ms:>9.3f} ms  {ms / first:6.3f}x time  {peaks[label] / peaks['eager']:6.3f}x eager's peak")


if __name__ == "__main__":
    main(sys.argv[1:])
