"""Why a program's kept-buffer arena holds what it holds (executors/buffers.py ``plan``): for each program a zoo
model's whole step builds, the values a kept buffer could hold, packed together as the planner packs them, against
what the call allocates that no buffer can hold, and the program's peak without buffers; then what the plan kept.

Run: PYTHONPATH=. python benchmarks/arena_fit.py MODEL [--no-remat]
     ``--no-remat``: the default built without its cheap-value recomputation (``benchmarks/memory.py``).
Not a test: a diagnostic of the planner's inputs (bytes, deterministic).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for sub in ("tests", "benchmarks"):
    sys.path.insert(0, os.path.join(ROOT, sub))
import _zoo  # noqa: E402
from memory import without_cheap_remat  # noqa: E402

import thunder_train as tt  # noqa: E402
from thunder_train.compiler.executors import arena, buffers  # noqa: E402


def main(argv):
    name, remat = argv[0], "--no-remat" not in argv
    torch.set_num_threads(1)
    seen = {}
    overlaps, plan = buffers._overlaps, buffers.plan

    def candidates(storages, kept):  # called once a plan, with every value a kept buffer could hold
        n = 1 + max(s[1] for s in storages.values())
        every = arena.live_bytes(storages, storages.keys(), n)
        held = arena.live_bytes(storages, kept, n)
        never = [a - b for a, b in zip(every, held)]
        seen.update(candidates=len(kept), packed=arena.pack(storages, kept)[0], most_alive=max(held),
                    never_kept_peak=max(never), peak_without_buffers=max(every))
        return overlaps(storages, kept)

    def planned(trc, **kwargs):
        seen.clear()
        nbytes, assigned = plan(trc, **kwargs)
        if seen:
            print(f"{len(trc.bound_symbols):>5} lines: {seen['candidates']} candidates pack into {seen['packed']} B "
                  f"(most alive at once {seen['most_alive']} B) + never kept {seen['never_kept_peak']} B "
                  f"= {seen['packed'] + seen['never_kept_peak']} B against a peak of {seen['peak_without_buffers']} B"
                  f" without buffers; kept {len(assigned)} values in {nbytes} B")
        return nbytes, assigned

    buffers._overlaps, buffers.plan = candidates, planned
    try:
        model, batches = _zoo.build(name), _zoo.batches(name, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = tt.compile(_zoo.train_step, thin=True)
        with contextlib.nullcontext() if remat else without_cheap_remat():
            for b in batches:
                step(model, opt, b)
            tt.wait_for_fusion(step)
    finally:
        buffers._overlaps, buffers.plan = overlaps, plan


if __name__ == "__main__":
    main(sys.argv[1:])
