"""Every GPU check in one call: the CUDA tests, then whole-training-step benchmarks on CUDA.

Run: python benchmarks/gpu.py [--skip-tests] [--steps N] [--rows small,gpt2] [--json PATH]

Meant for a session that is lent a CUDA machine for a few minutes: one call of at most about
8 minutes does everything, and each part that fails is reported as a row instead of ending the run.

1. ``pytest`` over the test files with CUDA cases (``tests/test_cuda.py``; the model zoo's CUDA
   subset when it exists), with the pass/fail summary line.
2. Whole training steps (forward, cross-entropy, backward, AdamW, zero_grad) for two models:
   the recipe's default small GPT (fp32) and a GPT-2-124M-sized GPT in bf16 autocast.  Modes,
   all in the same process from copies of the same weights on the same batches:
   eager; ``torch.compile`` (default and ``mode="reduce-overhead"``); thunder_train thin;
   thin + ``fusion="inductor"``; thin + ``fusion="inductor"`` + ``cuda_graphs=True``.
   A mode that thunder_train does not support yet is printed with its error message.
   Reported per mode: first call (compile + one step), median step time, ratio to eager, peak
   memory (``torch.cuda.max_memory_allocated`` during its steps) and the final loss, which must
   agree with eager's within the tolerance printed.

Without a CUDA device it says so and exits 0.  Not a test: the numbers are recorded in docs/.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
from gpt import GPT, GPTConfig  # noqa: E402

import thunder_train as tt  # noqa: E402

# Test files that hold CUDA cases; missing ones are skipped with a note.
CUDA_TEST_FILES = ["tests/test_cuda.py", "tests/test_model_zoo.py"]


def run_cuda_tests() -> dict:
    files = [f for f in CUDA_TEST_FILES if os.path.exists(os.path.join(ROOT, f))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TT_TEST_DEVICE="cuda")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files]
    if "tests/test_model_zoo.py" in files:
        # The zoo is large; on the GPU only its CUDA cases run.
        cmd += ["-k", "cuda or not zoo"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n== CUDA tests:", " ".join(files))
    print("\n".join(tail[-25:]))
    return {"rc": proc.returncode, "summary": tail[-1] if tail else "", "seconds": time.perf_counter() - t0}


def make_step(autocast: bool):
    def train_step(model, opt, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
            loss = F.cross_entropy(logits.flatten(0, -2).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return train_step


ROWS = {
    # The recipe's default model and batch (recipes/gpt.py add_common_args), fp32.
    "small": dict(label="recipe's small GPT (2 layers, d 64, seq 32, batch 32), fp32",
                  cfg=GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=4, n_embd=64), batch=32, autocast=False),
    "gpt2": dict(label="GPT-2-124M-sized (12 layers, d 768, seq 1024, batch 8), bf16 autocast",
                 cfg=GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), batch=8, autocast=True),
}


def modes_for(step):
    return {
        "eager": lambda: step,
        "torch.compile": lambda: torch.compile(step),
        "torch.compile reduce-overhead": lambda: torch.compile(step, mode="reduce-overhead"),
        "tt thin": lambda: tt.compile(step, thin=True),
        "tt thin+fusion": lambda: tt.compile(step, thin=True, fusion="inductor"),
        "tt thin+fusion+cuda_graphs": lambda: tt.compile(step, thin=True, fusion="inductor", cuda_graphs=True),
    }


def bench_row(key: str, steps: int) -> dict:
    spec = ROWS[key]
    torch.manual_seed(0)
    base = GPT(spec["cfg"]).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    V, T, B = spec["cfg"].vocab_size, spec["cfg"].block_size, spec["batch"]
    batches = []
    for _ in range(steps):
        x = torch.randint(0, V, (B, T), device="cuda", generator=g)
        batches.append((x, torch.roll(x, -1, 1)))
    step = make_step(spec["autocast"])
    results = {}
    print(f"\n== {spec['label']}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters, {steps} steps")
    for name, build in modes_for(step).items():
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        try:
            fn = build()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            loss = fn(model, opt, *batches[0])
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            times = []
            for x, y in batches[1:]:
                t0 = time.perf_counter()
                loss = fn(model, opt, x, y)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            warm = times[3:] if len(times) > 6 else times
            results[name] = {"first_s": first, "step_ms": statistics.median(warm) * 1e3,
                             "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "loss": float(loss.detach())}
        except Exception as e:  # a mode not supported yet is a row, not the end of the run
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        del model, opt
        torch.cuda.empty_cache()
    eager = results["eager"]
    tol = 2e-2 if spec["autocast"] else 1e-4
    print(f"{'mode':<30}{'first s':>9}{'step ms':>10}{'eager/step':>12}{'peak MiB':>10}{'loss':>10}  equal eager (rtol {tol})")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:<30}  not run: {r['error']}")
            continue
        r["speedup_vs_eager"] = eager["step_ms"] / r["step_ms"]
        r["equal_eager"] = abs(r["loss"] - eager["loss"]) <= tol * max(1.0, abs(eager["loss"]))
        print(f"{name:<30}{r['first_s']:>9.2f}{r['step_ms']:>10.2f}{r['speedup_vs_eager']:>12.2f}"
              f"{r['peak_mib']:>10.0f}{r['loss']:>10.4f}  {r['equal_eager']}")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", default="small,gpt2")
    p.add_argument("--json", default=os.path.join(os.environ["OUT"], "gpu.json") if os.environ.get("OUT") else None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to run.")
        return 0
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    if not args.skip_tests:
        report["tests"] = run_cuda_tests()
    for key in args.rows.split(","):
        report[key] = bench_row(key, args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
