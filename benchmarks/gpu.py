"""Every GPU check in one call: the CUDA tests, then whole-training-step benchmarks on CUDA.

Run: python benchmarks/gpu.py [--skip-tests] [--steps N] [--rows small,gpt2] [--budget SECONDS] [--out DIR]
     python benchmarks/gpu.py --profile gpt2:eager,tt thin   (where each mode's step spends device time)

Meant for a session that is lent a CUDA machine for a few minutes: one call of at most about 8 minutes
(``--budget``, default 450 s) does everything; each part that fails is a row with its error instead of the
end of the run, and a part that would not fit in what is left of the budget is skipped with a note.

1. ``pytest`` over the test files with CUDA cases (``CUDA_TEST_FILES``: the CUDA path, Inductor fusion on
   CUDA, CUDA graphs, nvFuser, the model zoo's CUDA subset), time-boxed, with the pass/fail summary.
2. Whole training steps (forward, cross-entropy, backward, AdamW(fused=True), zero_grad) for two models:
   the recipe's default small GPT (fp32) and a GPT-2-124M-sized GPT in bf16 autocast.  Modes, all in the
   same process from copies of the same weights on the same batches: eager; ``torch.compile`` (default and
   ``mode="reduce-overhead"``); thunder_train's default (``fusion="background"``, its fused program waited for after
   the second call); thin; thin + ``fusion="inductor"``; thin + fusion +
   ``cuda_graphs=True`` (and thin + ``fusion="nvfuser"`` where nvFuser can run).  ``fused=True``: the
   optimizer's step counters then live on the device, which a CUDA graph needs (same for every mode).
   Reported per mode: first call (compile + one step), calls 2-5 (thin binding, graph warm-up and
   capture), median step time, ratio to eager, peak memory (``torch.cuda.max_memory_allocated``) and the
   losses, which must agree with eager's within the tolerance printed; plus thunder_train's fusion and
   CUDA-graph notes.

Results: printed, and written to ``DIR/gpu.json`` and ``DIR/gpu_results.md`` (a table for docs/) when
``--out`` is given or ``$OUT`` is set.  Without a CUDA device it says so and exits 0.  Not a test.
"""
from __future__ import annotations

import argparse
import copy
import gc
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
CUDA_TEST_FILES = ["tests/test_cuda.py", "tests/test_cuda_graphs.py", "tests/test_nvfuser.py", "tests/test_cuda_zoo.py"]
T0 = time.perf_counter()


def left(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def run_cuda_tests(timeout: float) -> dict:
    files = [f for f in CUDA_TEST_FILES if os.path.exists(os.path.join(ROOT, f))]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=ROOT)
    # -v: one line per finished test, so a run cut off by the time box still says what passed.
    cmd = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", *files]
    print("\n== CUDA tests:", " ".join(files), f"(time box {timeout:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = ((e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")) + f"\nTIMED OUT after {timeout:.0f} s"
        rc = "timeout"
    lines = out.strip().splitlines()
    counts = {k: sum(f" {k}" in ln and "::" in ln for ln in lines) for k in ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL")}
    failed = [ln for ln in lines if "::" in ln and (" FAILED" in ln or " ERROR" in ln)]
    print("\n".join(failed + lines[-30:]), flush=True)
    summary = lines[-1] if lines and rc != "timeout" else f"cut off after {timeout:.0f} s: {counts}"
    return {"rc": rc, "summary": summary, "counts": counts, "failed": failed[:40], "seconds": time.perf_counter() - t0,
            "tail": lines[-80:]}


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
                  cfg=GPTConfig(vocab_size=13, block_size=32, n_layer=2, n_head=4, n_embd=64), batch=32, autocast=False,
                  tol=1e-4, cost={"torch.compile": 60, "torch.compile reduce-overhead": 60}),
    "gpt2": dict(label="GPT-2-124M-sized (12 layers, d 768, seq 1024, batch 8), bf16 autocast",
                 cfg=GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), batch=8, autocast=True,
                 tol=2e-2, cost={"torch.compile": 100, "torch.compile reduce-overhead": 100}),
}
DEFAULT_COST = 30  # seconds a mode is assumed to need when ROWS does not say (compile + steps)


def modes_for(step):
    """thunder_train's modes first (a mode that does not fit the budget is skipped), torch.compile's last."""
    from thunder_train.compiler.executors import nvfuser_fusion

    modes = {
        "eager": lambda: step,
        # fusion is explicit in every mode, so a change of the default does not change the rows; "tt default" is
        # today's default (fusion="background"), its fused program waited for after call 2 (bench_row)
        "tt default": lambda: tt.compile(step, thin=True, fusion="background"),
        "tt thin": lambda: tt.compile(step, thin=True, fusion=None),
        "tt thin+fusion": lambda: tt.compile(step, thin=True, fusion="inductor"),
        "tt thin+fusion+cuda_graphs": lambda: tt.compile(step, thin=True, fusion="inductor", cuda_graphs=True),
        "tt thin+cuda_graphs": lambda: tt.compile(step, thin=True, fusion=None, cuda_graphs=True),
    }
    if nvfuser_fusion.availability()[0] is not None:
        modes["tt thin+nvfuser+cuda_graphs"] = lambda: tt.compile(step, thin=True, fusion="nvfuser", cuda_graphs=True)
    modes["torch.compile"] = lambda: torch.compile(step)
    modes["torch.compile reduce-overhead"] = lambda: torch.compile(step, mode="reduce-overhead")
    return modes


def _notes(fn) -> dict:
    try:
        st = tt.compile_stats(fn)
    except TypeError:
        return {}
    fused = sum("into one" in n for n in st.fusion_notes)
    return {"fusion_notes": st.fusion_notes[:8], "fused_regions_compiled": fused, "cuda_graph_notes": st.cuda_graph_notes[:6],
            "captures": st.cuda_graph_captures, "replays": st.cuda_graph_replays, "thin_calls": st.thin_calls,
            "thin_bind_failures": st.thin_bind_failures[:3]}


def _model_and_batches(spec: dict, n: int):
    """The row's model (seeded) on the device and ``n`` batches of next-token targets (the same in every mode)."""
    torch.manual_seed(0)
    base = GPT(spec["cfg"]).cuda()
    g = torch.Generator(device="cuda").manual_seed(0)
    V, T, B = spec["cfg"].vocab_size, spec["cfg"].block_size, spec["batch"]
    batches = []
    for _ in range(n):
        x = torch.randint(0, V, (B, T), device="cuda", generator=g)
        batches.append((x, torch.roll(x, -1, 1)))
    return base, batches


def bench_row(key: str, steps: int, budget: float) -> dict:
    spec = ROWS[key]
    base, batches = _model_and_batches(spec, steps)
    step = make_step(spec["autocast"])
    results = {}
    print(f"\n== {spec['label']}: {sum(p.numel() for p in base.parameters()) / 1e6:.1f} M parameters, {steps} steps", flush=True)
    for name, build in modes_for(step).items():
        need = spec["cost"].get(name, DEFAULT_COST)
        if left(budget) < need:
            results[name] = {"skipped": f"{left(budget):.0f} s of the budget left, this mode needs about {need} s"}
            print(f"  {name}: skipped ({results[name]['skipped']})", flush=True)
            continue
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        fn = None
        try:
            if name.startswith("torch.compile"):
                torch._dynamo.reset()
            fn = build()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            out = fn(model, opt, *batches[0])
            torch.cuda.synchronize()
            first = time.perf_counter() - t0
            # Read each loss right away: reduce-overhead's graph outputs are overwritten by its next replay.
            losses, times = [float(out.detach())], []
            box = time.perf_counter() + min(60.0, max(5.0, left(budget) - 5))  # this mode's steps stop here
            for x, y in batches[1:]:
                t0 = time.perf_counter()
                out = fn(model, opt, x, y)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                losses.append(float(out.detach()))
                if name == "tt default" and len(times) == 1:
                    tt.wait_for_fusion(fn)  # the steady entry's fused program built now (not timed), as users reach it
                if time.perf_counter() > box:
                    break
            warm = times[5:] if len(times) > 8 else times[len(times) // 2:]
            results[name] = {"first_s": first, "calls_2_5_s": sum(times[:4]), "step_ms": statistics.median(warm) * 1e3,
                             "steps_timed": len(warm), "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
                             "losses": losses, **_notes(fn)}
        except Exception as e:  # a mode not supported yet is a row, not the end of the run
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", **_notes(fn)}
        print(f"  {name}: " + (f"{results[name]['step_ms']:.2f} ms/step" if "step_ms" in results[name]
                                 else results[name].get("error", "")), flush=True)
        del model, opt, fn
        out = None
        # Compiled steps hold reference cycles: collected now, or the next modes' peaks include this mode's model and
        # optimizer (session 28's first rows: every mode after the default ~1.9 GB higher).
        gc.collect()
        torch.cuda.empty_cache()
    eager = results.get("eager", {})
    tol = spec["tol"]
    print(f"{'mode':<32}{'first s':>9}{'2-5 s':>8}{'step ms':>10}{'eager/step':>12}{'peak MiB':>10}{'loss':>10}  equal eager (rtol {tol})")
    for name, r in results.items():
        if "step_ms" not in r:
            print(f"{name:<32}  not run: {r.get('error') or r.get('skipped')}")
            continue
        if "step_ms" in eager:
            r["speedup_vs_eager"] = eager["step_ms"] / r["step_ms"]
            n = min(len(r["losses"]), len(eager["losses"]))
            r["max_loss_diff"] = max(abs(a - b) for a, b in zip(r["losses"][:n], eager["losses"][:n]))
            r["equal_eager"] = all(abs(a - b) <= tol * max(1.0, abs(b)) for a, b in zip(r["losses"][:n], eager["losses"][:n]))
        print(f"{name:<32}{r['first_s']:>9.2f}{r['calls_2_5_s']:>8.2f}{r['step_ms']:>10.2f}{r.get('speedup_vs_eager', 0):>12.2f}"
              f"{r['peak_mib']:>10.0f}{r['losses'][-1]:>10.4f}  {r.get('equal_eager')}")
        for line in r.get("cuda_graph_notes", [])[:2]:
            print(f"{'':<34}{line}")
    return results


def _program_summary(fn) -> dict:
    """Lines of the program a compiled step runs, by symbol (the fused regions and what is left around them)."""
    try:
        trc = tt.last_traces(fn)[-1]
    except (TypeError, AttributeError, IndexError):
        return {}
    counts: dict = {}
    for b in trc.bound_symbols:
        counts[b.sym.name] = counts.get(b.sym.name, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:25]
    return {"lines": len(trc.bound_symbols), "by_symbol": top, "program": str(trc)}


def profile_row(key: str, modes: list, steps: int = 8, shown: int = 3) -> dict:
    """Where each mode's step spends device time: ``torch.profiler`` over the last ``shown`` of ``steps`` steps;
    per step the kernel launches, the device time summed over kernels and the wall time, and the kernels that take
    the most time.  For a compiled step also the lines of its program by symbol."""
    from torch.profiler import ProfilerActivity, profile

    spec = ROWS[key]
    base, ((x, y),) = _model_and_batches(spec, 1)
    builds = modes_for(make_step(spec["autocast"]))
    out = {}
    for name in modes:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        try:
            if name.startswith("torch.compile"):
                torch._dynamo.reset()
            fn = builds[name]()
            for i in range(steps - shown):
                fn(model, opt, x, y)
                if name == "tt default" and i == 1:  # its fused program, as bench_row times it
                    tt.wait_for_fusion(fn)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for _ in range(shown):
                    fn(model, opt, x, y)
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / shown
            kernels: dict = {}
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    n, t = kernels.get(ev.name, (0, 0.0))
                    kernels[ev.name] = (n + 1, t + ev.device_time_total)
            total = sum(t for _, t in kernels.values()) / shown
            top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:22]
            out[name] = {"wall_ms": wall * 1e3, "device_ms": total / 1e3,
                         "launches": sum(n for n, _ in kernels.values()) / shown,
                         "top": [(k[:90], n / shown, t / shown / 1e3) for k, (n, t) in top], **_program_summary(fn)}
        except Exception as e:  # noqa: BLE001
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r = out[name]
        print(f"\n== profile {key} / {name}", flush=True)
        if "error" in r:
            print("  ", r["error"])
        else:
            print(f"  wall {r['wall_ms']:.2f} ms/step, device {r['device_ms']:.2f} ms/step, {r['launches']:.0f} launches/step")
            for k, n, t in r["top"]:
                print(f"  {t:8.3f} ms {n:6.1f}x  {k}")
            if "lines" in r:
                print(f"  program: {r['lines']} lines; by symbol: {r['by_symbol']}")
        fn = model = opt = None
        gc.collect()
        torch.cuda.empty_cache()
    return out


def markdown(report: dict) -> str:
    lines = [f"GPU results: torch {report['torch']}, {report['device']}, `python benchmarks/gpu.py` "
             f"({report['seconds']:.0f} s in all).", ""]
    if "tests" in report:
        lines += [f"CUDA tests ({', '.join(CUDA_TEST_FILES)}): `{report['tests']['summary']}`", ""]
    for key in ROWS:
        if key not in report:
            continue
        lines += [f"**{ROWS[key]['label']}**", "",
                  "| mode | first call (s) | calls 2-5 (s) | step (ms) | eager / step | peak MiB | equal eager |",
                  "|---|---|---|---|---|---|---|"]
        for name, r in report[key].items():
            if "step_ms" in r:
                lines.append(f"| {name} | {r['first_s']:.2f} | {r['calls_2_5_s']:.2f} | {r['step_ms']:.2f} | "
                             f"{r.get('speedup_vs_eager', 0):.2f} | {r['peak_mib']:.0f} | {r.get('equal_eager')} |")
            else:
                lines.append(f"| {name} | not run: {r.get('error') or r.get('skipped')} | | | | | |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rows", default="small,gpt2")
    p.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (tests + rows)")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for gpu.json and gpu_results.md")
    p.add_argument("--profile", default="", help="ROW:MODE,MODE,...: only profile these modes of one row (no tests)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device on this machine (torch.cuda.is_available() is False); nothing to run.")
        return 0
    from thunder_train.compiler.executors import nvfuser_fusion

    try:
        import triton
        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_version = f"not importable ({type(e).__name__})"
    nvf_why = nvfuser_fusion.availability()[1]
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, triton {triton_version}, {torch.cuda.get_device_name()}; "
          f"nvFuser: {'available' if nvf_why is None else nvf_why}", flush=True)
    report = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
              "device": torch.cuda.get_device_name(), "nvfuser": nvf_why or "available"}
    if args.profile:
        row, modes = args.profile.split(":")
        report["profile"] = profile_row(row, modes.split(","))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "gpu_profile.json"), "w") as f:
                json.dump(report, f, indent=1)
        return 0
    if not args.skip_tests:
        report["tests"] = run_cuda_tests(timeout=max(30.0, min(150.0, left(args.budget) - 250)))  # the rows get the rest
    for key in args.rows.split(","):
        try:
            report[key] = bench_row(key, args.steps, args.budget)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory building the model: the other rows still run
            report[key] = {"row": {"error": f"{type(e).__name__}: {str(e)[:200]}"}}
            print(f"{key}: {report[key]['row']['error']}")
    report["seconds"] = time.perf_counter() - T0
    md = markdown(report)
    print("\n" + md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "gpu_results.md"), "w") as f:
            f.write(md + "\n")
        print(f"\nwritten: {os.path.join(args.out, 'gpu.json')}, {os.path.join(args.out, 'gpu_results.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
