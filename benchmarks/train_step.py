"""Whole training step: forward, cross-entropy, backward, AdamW, zero_grad — compiled as one program.

Run: python benchmarks/train_step.py [--no-torch-compile] [--fusion] [--steps N] [--models gpt,mlp]

For each model, copies of the same weights train on the same batches:
eager PyTorch, ``torch.compile`` of the whole step, and
``thunder_train.compile(step, thin=True)`` (plus, for reference, eager with
``AdamW(fused=True)``).  Reported per mode: the first call (tracing/compiling
plus one step) and the median time of the later steps, with ratios to eager and
to torch.compile, all in one run; the later steps of all modes interleave so
machine noise hits them alike.  The final losses are printed too: they must
agree (same computation).

Targets on the 2-core CPU of the CI machines: thunder_train's first call ≤ 1/5
of torch.compile's, and its step time ≤ eager's.  Not a test: timings vary.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes"))
from gpt import GPT, GPTConfig  # noqa: E402

import thunder_train as tt  # noqa: E402


def train_step(model, opt, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits.flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def gpt_setup(batch=8, seq=128, vocab=4096):
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=4, n_head=4, n_embd=256))
    g = torch.Generator().manual_seed(0)

    def data(n):
        out = []
        for _ in range(n):
            x = torch.randint(0, vocab, (batch, seq), generator=g)
            out.append((x, torch.roll(x, -1, 1)))
        return out

    return model, data


def mlp_setup(batch=64, d=256, classes=10):
    model = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, classes))
    g = torch.Generator().manual_seed(0)

    def data(n):
        return [(torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]

    return model, data


def bench(model_name, setup, steps, with_torch_compile, with_fusion=False):
    torch.manual_seed(0)
    base, data = setup()
    batches = data(steps)
    modes = {"eager": (train_step, {})}
    # Reference only: eager with torch's fused AdamW kernel (not the default on CPU).  thunder_train
    # runs that kernel for the optimizer it captures (optimizer_kernels="fused"), so this row shows
    # how much of its lead is the optimizer kernel and how much the rest of the step.
    modes["eager, AdamW(fused=True)"] = (train_step, {"fused": True})
    if with_torch_compile:
        modes["torch.compile"] = (torch.compile(train_step), {})
    modes["thunder_train thin"] = (tt.compile(train_step, thin=True), {})
    if with_fusion:
        modes["thunder_train thin+inductor"] = (tt.compile(train_step, thin=True, fusion="inductor"), {})
    runs = {}
    for name, (fn, opt_kwargs) in modes.items():
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **opt_kwargs)
        t0 = time.perf_counter()
        loss = fn(model, opt, *batches[0])
        runs[name] = {"fn": fn, "model": model, "opt": opt, "first": time.perf_counter() - t0, "times": [], "loss": loss}
    # The steps of all modes interleave (the first mode rotating), so a slow phase of the machine
    # costs every mode alike: on a shared 2-core CPU, runs one after the other drift by ±10 %.
    names = list(runs)
    for i, (x, y) in enumerate(batches[1:]):
        for name in names[i % len(names):] + names[:i % len(names)]:
            r = runs[name]
            t0 = time.perf_counter()
            r["loss"] = r["fn"](r["model"], r["opt"], x, y)
            r["times"].append(time.perf_counter() - t0)
    results = {}
    for name, r in runs.items():
        # Skip the warm-up steps (lazy optimizer state, thin-mode binding) in the median.
        times = r["times"][3:] if len(r["times"]) > 6 else r["times"]
        results[name] = {"first": r["first"], "step": statistics.median(times), "loss": float(r["loss"].detach())}
    e = results["eager"]
    print(f"\n{model_name}: {sum(p.numel() for p in base.parameters()) / 1e6:.2f} M parameters, {steps} steps")
    print(f"{'mode':<28}{'first call s':>14}{'step ms':>10}{'step / eager':>14}{'final loss':>12}")
    for name, r in results.items():
        print(f"{name:<28}{r['first']:>14.2f}{r['step'] * 1e3:>10.1f}{r['step'] / e['step']:>14.2f}{r['loss']:>12.4f}")
    tt_r = results["thunder_train thin"]
    if "torch.compile" in results:
        tc = results["torch.compile"]
        print(f"thunder_train first call / torch.compile first call: {tt_r['first'] / tc['first']:.3f} (target ≤ 0.2)")
        print(f"thunder_train step / torch.compile step: {tt_r['step'] / tc['step']:.2f}")
    print(f"thunder_train step / eager step: {tt_r['step'] / e['step']:.2f} (target ≤ 1.0)")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--models", default="gpt,mlp")
    p.add_argument("--no-torch-compile", action="store_true")
    p.add_argument("--fusion", action="store_true", help="also tt.compile(..., fusion='inductor') (C++ compiles: slow first call)")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, min(torch.get_num_threads(), os.cpu_count() or 1)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    setups = {"gpt": ("GPT (4 layers, d 256, 4 heads, seq 128, batch 8, vocab 4096)", gpt_setup),
              "mlp": ("MLP (3 layers, d 256, batch 64)", mlp_setup)}
    for key in args.models.split(","):
        label, setup = setups[key]
        bench(label, setup, args.steps, not args.no_torch_compile, args.fusion)


if __name__ == "__main__":
    main()
