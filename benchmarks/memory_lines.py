"""Where a compiled step's peak memory comes from: live bytes after every line of the program that runs.

Run: python benchmarks/memory_lines.py [--workload gpt|<zoo name>] [--ckpt] [--budget F] [--fusion none|default]
[--top N] [--all]

Runs the GPT step of benchmarks/memory.py (or a zoo model's, tests/_zoo.py) compiled by thunder_train and, while its computation executes, stops
after every line (``sys.settrace`` on the generated function) to sum the bytes of the distinct tensor storages
its local variables hold, less those of its inputs (parameters, optimizer state, the batch).  Prints the line
where that sum is largest, the values alive there (largest first), and, with ``--all``, the sum after every line.
Kernel temporaries inside one line are not seen (benchmarks/memory.py measures them with the allocator).
Not a test: a tool for finding what to free sooner.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, ROOT)
import memory as bench  # noqa: E402

import thunder_train as tt  # noqa: E402


def _storages(values):
    """{storage key: (bytes, name)} of the tensors among ``values`` (name, value) pairs."""
    out = {}
    for name, v in values:
        if isinstance(v, torch.Tensor) and v.device.type != "meta":
            s = v.untyped_storage()
            out.setdefault((s.data_ptr(), s.nbytes()), (s.nbytes(), name))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                if isinstance(x, torch.Tensor):
                    s = x.untyped_storage()
                    out.setdefault((s.data_ptr(), s.nbytes()), (s.nbytes(), f"{name}[{i}]"))
    return out


def live_by_line(call):
    """[(line number, source line, live bytes, {key: (bytes, name)})] of the thunder_train computation run by
    ``call()``; inputs excluded."""
    rows, state = [], {}

    def local_trace(frame, event, arg):
        if event in ("line", "return"):
            live = _storages(frame.f_locals.items())
            for k in state["inputs"]:
                live.pop(k, None)
            rows.append((state["prev"], sum(n for n, _ in live.values()), live))
            state["prev"] = frame.f_lineno
        return local_trace

    def global_trace(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith("<thunder_train computation"):
            state["inputs"] = set(_storages(frame.f_locals.items()))
            state["prev"] = frame.f_lineno
            state["file"] = name
            return local_trace
        return None

    sys.settrace(global_trace)
    try:
        call()
    finally:
        sys.settrace(None)
    import linecache

    lines = linecache.getlines(state["file"])
    return [(ln, lines[ln - 1].rstrip() if 0 < ln <= len(lines) else "", n, live) for ln, n, live in rows]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="gpt", help="gpt, or a model of tests/_zoo.py (bytes printed in KiB)")
    p.add_argument("--ckpt", action="store_true", help="every block under checkpoint(use_reentrant=False)")
    p.add_argument("--budget", type=float, default=None)
    p.add_argument("--fusion", default="none", choices=["none", "default"])
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--all", action="store_true")
    p.add_argument("--at", type=int, default=None, help="list what is alive after this line instead of at the peak")
    p.add_argument("--no-keep-buffers", action="store_true", help="keep_buffers=False: every value its own storage")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    workload = bench.gpt_workload if args.workload == "gpt" else (lambda: bench.zoo_workload(args.workload))
    base, make_opt, batches, step, checkpointed = workload()
    model = copy.deepcopy(base)
    opt = make_opt(model.parameters())
    if args.ckpt:
        model = checkpointed(model)
    options = {} if args.fusion == "default" else {"fusion": None}
    if args.no_keep_buffers:
        options["keep_buffers"] = False
    if args.budget is not None:
        options["memory_budget"] = args.budget
    cf = tt.compile(step, thin=True, **options)
    for b in batches[:3]:
        cf(model, opt, b)
    if args.fusion == "default":  # the fused program, once background fusion's build replaced the torch program
        tt.wait_for_fusion(cf)
        cf(model, opt, batches[0])
    rows = live_by_line(lambda: cf(model, opt, batches[3]))
    unit, scale = ("MiB", 2**20) if args.workload == "gpt" else ("KiB", 2**10)
    mib = lambda n: f"{n / scale:8.1f}"  # noqa: E731
    if args.all:
        for ln, src, n, _ in rows:
            print(f"{mib(n)} {unit}  {ln:5d}  {src.strip()[:110]}")
    ln, src, n, live = max(rows, key=lambda r: r[2])
    if args.at is not None:
        ln, src, n, live = next(r for r in rows if r[0] == args.at)
    print(f"\n{'peak' if args.at is None else 'live'} between lines: {mib(n)} MiB after line {ln}: {src.strip()[:120]}")
    for nbytes, name in sorted(live.values(), reverse=True)[: args.top]:
        print(f"  {mib(nbytes)} {unit}  {name}")
    plan = tt.compile_stats(cf).memory
    if plan is not None:
        print(f"\nplan: {plan.summary()}")


if __name__ == "__main__":
    main()
