"""What recomputation costs, counted: ATen calls, matmul calls and matmul/attention GFLOP of one steady-state GPT
step (benchmarks/memory.py's workload) for eager and thunder_train, with and without per-block checkpointing and
with memory budgets.  Counts do not depend on the machine's load (a ``TorchDispatchMode`` sees every call the step
dispatches; FLOPs by ``torch.utils.flop_counter``'s formulas on each call's shapes).

Run: python benchmarks/memory_ops.py [--budgets 0.25] [--fusion none|default]
(``--fusion none``, the default here: the torch program, whose calls the mode sees one by one.)
"""
from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory as bench  # noqa: E402

import thunder_train as tt  # noqa: E402

_MATMULS = ("mm", "addmm", "addmm_", "bmm", "baddbmm")


class Counts(TorchDispatchMode):
    thunder_train_observes = True  # counts the compiled program's aten calls (thunder_train's acquisition/ambient.py)

    def __init__(self):
        super().__init__()
        self.counts, self.flops = collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.counts[func.overloadpacket.__name__] += 1
        rule = flop_registry.get(func.overloadpacket)
        if rule is not None:
            shape = lambda t: t.shape if isinstance(t, torch.Tensor) else t  # noqa: E731
            self.flops += rule(*tree_map(shape, args), **tree_map(shape, kwargs or {}), out_val=tree_map(shape, out))
        elif func.overloadpacket.__name__ == "addmm_":  # not in the registry: 2·M·N·K as addmm
            a, b = args[1], args[2]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budgets", default="0.25")
    p.add_argument("--fusion", default="none")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    fusion = None if args.fusion == "none" else args.fusion
    base, make_opt, batches, step, checkpointed = bench.gpt_workload()
    modes = [("eager", False, None, {}), ("eager, checkpointing", True, None, {}), ("tt", False, "tt", {}),
             ("tt, checkpointing", True, "tt", {})]
    modes += [(f"tt memory_budget={f}", False, "tt", {"memory_budget": float(f)}) for f in args.budgets.split(",") if f]
    print(f"{'mode':<28}{'ATen calls':>12}{'matmuls':>10}{'GFLOP':>9}")
    for name, ckpt, wrap, options in modes:
        model = copy.deepcopy(base)
        opt = make_opt(model.parameters())
        if ckpt:
            model = checkpointed(model)
        fn = tt.compile(step, thin=True, fusion=fusion, **options) if wrap else step
        for i in range(3):  # optimizer state, thin binding
            fn(model, opt, batches[i])
        with Counts() as c:
            fn(model, opt, batches[3])
        mm = sum(v for k, v in c.counts.items() if k in _MATMULS)
        print(f"{name:<28}{sum(c.counts.values()):>12}{mm:>10}{c.flops / 1e9:>9.2f}")


if __name__ == "__main__":
    main()
