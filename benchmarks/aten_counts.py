"""ATen calls of one steady-state thin training step of the model zoo (tests/_zoo.py), against eager's step: a count
that does not depend on the machine's load (a ``TorchDispatchMode`` sees every call the step dispatches).

Run: python benchmarks/aten_counts.py [--models gpt2,llama,...] [--top N]
Prints per model the calls of ``tt.compile(step, thin=True)`` (the default: its torch program, which runs until a
fused program pays back) and of eager's step (AdamW as eager runs it), and with ``--top`` the most frequent ops.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import _zoo  # noqa: E402

import thunder_train as tt  # noqa: E402


class Counts(TorchDispatchMode):
    thunder_train_observes = True  # counts the compiled program's aten calls (thunder_train's acquisition/ambient.py)

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def step_counts(name, fn, warmup=5):
    model = _zoo.build(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = _zoo.batches(name, 4)
    for i in range(warmup):  # the optimizer's state exists and the thin binding is in place
        fn(model, opt, batches[i % len(batches)])
    with Counts() as c:
        fn(model, opt, batches[warmup % len(batches)])
    return c.counts


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="gpt2,llama,mistral,qwen2,bloom,falcon")
    p.add_argument("--top", type=int, default=0)
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in args.models.split(","):
        tt_counts = step_counts(name, tt.compile(_zoo.train_step, thin=True))
        eager = step_counts(name, _zoo.train_step)
        print(f"{name:12s} tt thin (default) {sum(tt_counts.values()):5d}   eager {sum(eager.values()):5d}", flush=True)
        for op, n in tt_counts.most_common(args.top):
            print(f"    {n:4d} {op}")


if __name__ == "__main__":
    main()
