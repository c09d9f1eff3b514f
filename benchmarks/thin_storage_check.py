"""The cost of thin mode's per-call data-pointer check of the tensors a step updates in place (docs/thin_mode.md).

For the zoo GPT-2 and Llama steps (tests/_zoo.py) and the benchmark GPT (benchmarks/train_step.py), each an AdamW
step bound in thin mode with ``fusion=None``: the thin step's time and the check's, ``list(map(Tensor.data_ptr,
updated)) != bound`` over the parameters and their optimizer state, timed right after a step (what the thin call
finds) and repeated back to back, with the thread's CPU clock on one thread.  Not a test: timings vary by machine.

Run: python benchmarks/thin_storage_check.py
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks")]
import _zoo  # noqa: E402
import train_step as bench  # noqa: E402

import thunder_train as tt  # noqa: E402

_DATA_PTR = torch.Tensor.data_ptr


def measure(label, model, opt, step, batches, repeats=30):
    cf = tt.compile(step, thin=True, fusion=None)
    for i in range(6):
        cf(model, opt, *batches[i % len(batches)])
    assert tt.compile_stats(cf).thin_calls >= 2, "not bound"
    updated = tuple(model.parameters()) + tuple(v for st in opt.state.values() for v in st.values()
                                                if isinstance(v, torch.Tensor))
    bound = list(map(_DATA_PTR, updated))
    clock = time.thread_time_ns
    steps, cold, warm = [], [], []
    for i in range(repeats):
        t0 = clock()
        cf(model, opt, *batches[i % len(batches)])
        t1 = clock()
        _ = list(map(_DATA_PTR, updated)) != bound
        t2 = clock()
        _ = list(map(_DATA_PTR, updated)) != bound
        t3 = clock()
        steps.append(t1 - t0), cold.append(t2 - t1), warm.append(t3 - t2)
    s, c, w = (statistics.median(v) / 1e3 for v in (steps, cold, warm))
    print(f"{label}: {len(updated)} updated tensors; thin step {s:.0f} us; check right after the step {c:.1f} us "
          f"({100 * c / s:.2f} %), repeated {w:.1f} us")


def main():
    torch.set_num_threads(1)
    for name in ("gpt2", "llama"):
        m = _zoo.build(name)
        measure(f"zoo {name}", m, torch.optim.AdamW(m.parameters(), lr=1e-3), _zoo.train_step,
                [(b,) for b in _zoo.batches(name, 4)])
    model, data, make_opt = bench.gpt_setup()
    measure("benchmark GPT 4L d256", model, make_opt(model.parameters()), bench.train_step, data(4))


if __name__ == "__main__":
    main()
