"""Host overhead per call: eager, tt.compile (full prologue), thin mode, the computation itself, torch.compile,
and thin mode with Inductor fusion (``fusion="inductor"``, docs/fusion.md).

Run: python benchmarks/overhead.py [--no-torch-compile] [--no-fusion] [--quick] [--steps-only]
Prints medians (µs per call) and ratios in one run, and the first-call (compile) time of the compiled variants.
Not a test: timings vary by machine.
Targets: thin-mode call ≤ 1.10× calling the generated computation function directly; with fusion, the
elementwise case faster than eager and than torch.compile.

Thin mode's per-call checks on whole training steps (AdamW, a 10-parameter and a 1,000-parameter model):
the thin call and the direct computation (per-call µs and the difference; timed one call at a time, the two
taking turns, so each call follows a step's computation as in a training loop), and the checks alone (the same
``thin_call`` with its computation replaced by a function that returns at once, minus calling that function
with the same inputs directly), each with the per-parameter checks in torch's C++ guards (the default,
thunder_train/compiler/bulk.py) and in Python, measured interleaved in one process; the checks alone are timed
twice: repeated back to back (everything they read stays in the CPU caches) and one call right after the real
computation (what a training loop's call finds: the step has pushed the bound objects out of the caches).
Target (issue 14): the checks of the 1,000-parameter step add under 50 µs (about 50 ns a parameter).
``--cpu-time`` times with the thread's CPU clock instead of the wall clock (steadier on a shared machine).
``--first-call`` only: the 20-op function's first call in fresh processes (what a user's script pays: nothing
imported beforehand but torch and thunder_train), with ``fusion=None`` and the default, and whether it loaded
torch._dynamo, Inductor or sympy (target, issue 30: <= 20 ms, none of them).
``--before-switch`` only: the default (background fusion) against ``fusion=None`` while the default still runs its
torch program, on the 20-op function: blocks of calls of the two taking turns, timed with the thread's CPU clock;
the median of the blocks' ratios (the per-call cost) and the ratio of the totals from the second call on (the
pay-back decision that call makes included), next to a control (two ``fusion=None`` compiles: the noise floor).
Target (issue 30): within 5 %.
"""
from __future__ import annotations

import itertools
import statistics
import sys
import time
import types

import torch
from torch import nn

import thunder_train as tt
from thunder_train.compiler import bulk

CLOCK = time.thread_time if "--cpu-time" in sys.argv else time.perf_counter


def elementwise(x, y):
    # ~20 small elementwise ops on 8-element tensors: host overhead dominates.
    a = x + y
    b = a * x
    c = b - y
    d = torch.sin(c)
    e = d * 2.0
    f = torch.cos(e)
    g = f + a
    h = g * g
    i = torch.exp(-h)
    j = i + b
    k = torch.tanh(j)
    l = k * c
    m = l - d
    n = m / 3.0
    o = torch.abs(n)
    p = o + 1.0
    q = torch.sqrt(p)
    r = q * e
    s = r + f
    t = torch.sigmoid(s)
    return t


class MLP(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def mlp_forward(model, x):
    return model(x)


def bench_all(variants: dict, *, number, repeat) -> dict:
    """Median µs per call of each variant; repeats are interleaved so machine noise hits all alike.

    ``number=1`` times one call at a time in turn (call 1 of each, call 2 of each, ...): for whole steps, every
    call then follows another step's computation, as in a training loop."""
    clock = time.thread_time_ns if CLOCK is time.thread_time else time.perf_counter_ns
    for fn, args in variants.values():
        for _ in range(20):
            fn(*args)
    times = {k: [] for k in variants}
    for _ in range(repeat):
        for k, (fn, args) in variants.items():
            t0 = clock()
            for _ in range(number):
                fn(*args)
            times[k].append((clock() - t0) / number / 1000)
    return {k: statistics.median(v) for k, v in times.items()}


def first_call(fn, args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def run_case(name, fn, args, *, number, repeat, with_torch_compile, with_fusion):
    # fusion=None: the default background fusion would replace the thin call's program part-way through the
    # timing (its Inductor kernel vs the torch program called directly); "tt thin + inductor" times that.
    full = tt.compile(fn, fusion=None)
    thin = tt.compile(fn, thin=True, fusion=None)
    first = {"tt thin": first_call(thin, args)}
    for _ in range(3):
        full(*args)
        thin(*args)
    assert thin.is_thin_bound
    comp, inputs = full.direct_call_parts(*args)
    torch.testing.assert_close(thin(*args), fn(*args))
    variants = {
        "eager": (fn, args),
        "tt full prologue": (full, args),
        "tt thin": (thin, args),
        "computation direct": (comp, inputs),
    }
    unavailable = {}
    if with_torch_compile:
        try:  # compiled before timing starts, so its compile workers do not disturb the others
            tc = torch.compile(fn)
            first["torch.compile"] = first_call(tc, args)
            variants["torch.compile"] = (tc, args)
        except Exception as e:  # noqa: BLE001 - report, don't fail the benchmark
            unavailable["torch.compile"] = f"unavailable ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
    if with_fusion:
        try:
            fused = tt.compile(fn, thin=True, fusion="inductor")
            first["tt thin + inductor"] = first_call(fused, args)
            for _ in range(3):
                fused(*args)
            torch.testing.assert_close(fused(*args), fn(*args))
            variants["tt thin + inductor"] = (fused, args)
            notes = tt.compile_stats(fused).fusion_notes
        except Exception as e:  # noqa: BLE001
            unavailable["tt thin + inductor"] = f"unavailable ({type(e).__name__}: {str(e).splitlines()[0][:80]})"
            notes = []
    rows = bench_all(variants, number=number, repeat=repeat)
    rows.update(unavailable)
    direct = rows["computation direct"]
    print(f"\n{name}")
    for k, v in rows.items():
        if isinstance(v, str):
            print(f"  {k:20s} {v}")
        else:
            print(f"  {k:20s} {v:9.2f} µs   {v / direct:5.2f}× direct")
    print(f"  thin / direct = {rows['tt thin'] / direct:.3f}  (target ≤ 1.10)")
    print("  first call (trace + compile): " + ", ".join(f"{k} {v:.2f} s" for k, v in first.items()))
    for note in notes if with_fusion else ():
        print(f"  fusion: {note}")
    return rows


def deep_linear(n_layers):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(n_layers)])


def train_step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _bound_step(args, python_checks):
    """A thin-bound AdamW step; ``python_checks``: its per-parameter checks generated in Python (bulk.ENABLED off)."""
    saved, bulk.ENABLED = bulk.ENABLED, not python_checks
    try:
        # fusion=None: no fused program replaces the computation part-way (the checks do not depend on it).
        thin = tt.compile(train_step, thin=True, fusion=None)
        for _ in range(3):
            thin(*args)
    finally:
        bulk.ENABLED = saved
    assert thin.is_thin_bound
    return thin


def _bound_defaults(thin):
    """The bound inputs a thin call's computation takes as defaults (runtime/thin_args.py), also through the
    wrapper that passes its inputs on unchanged to it (``inner``: an epilogue, an output rebuild), or None."""
    while thin is not None and getattr(thin, "__defaults__", None) is None:
        thin = getattr(thin, "inner", None)
    return None if thin is None else thin.__defaults__


def run_step_case(n_params, *, number, repeat):
    """Thin mode on a whole AdamW step of ``n_params`` parameters: the step, and the checks alone."""
    model = deep_linear(n_params // 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    args = (model, opt, torch.randn(8, 4), torch.randn(8, 4))
    paths = {"c++ guards": _bound_step(args, False), "python": _bound_step(args, True)}
    comp, inputs = paths["c++ guards"].direct_call_parts(*args)
    variants = {f"tt thin ({k})": (f, args) for k, f in paths.items()}
    variants["computation direct"] = (comp, inputs)
    steps = bench_all(variants, number=1, repeat=max(number * repeat // (10 if n_params < 100 else 40), 20))

    # The stub takes the computation's parameters, so both sides pass the same arguments the way they do for
    # the real one (the thin call may pass the bound ones as defaults: runtime/thin_args.py).
    ns = {}
    exec(f"def nothing({', '.join(f'a{i}' for i in range(len(inputs)))}):\n  return None\n", ns)
    nothing = ns["nothing"]
    # What thin_call runs is its entry's slot's ``thin`` (runtime/slot.py); only this benchmark sets it by hand.
    stubbed = {k: f._binding.entry.slot for k, f in paths.items()}
    real = {k: s.thin for k, s in stubbed.items()}
    for k, s in stubbed.items():
        defaults = _bound_defaults(real[k])
        s.thin = types.FunctionType(nothing.__code__, ns, "nothing", defaults) if defaults else nothing
    try:
        variants = {f"checks ({k})": (f, args) for k, f in paths.items()}
        variants["stub direct"] = (nothing, inputs)
        checks = bench_all(variants, number=number, repeat=repeat)
        cold = after_computation(variants, comp, inputs, repeat=max(repeat, 15))
        for k, f in paths.items():
            assert f.is_thin_bound and not tt.compile_stats(f).thin_invalidations, f"{k}: the stubbed thin call left thin mode"
    finally:
        for k, s in stubbed.items():
            s.thin = real[k]
    direct = steps["computation direct"]
    print(f"\nAdamW training step, {n_params} parameters ({n_params // 2} x Linear(4, 4)), batch 8")
    print(f"  computation direct          {direct:10.2f} µs")
    added = {}
    for k in paths:
        t = steps[f"tt thin ({k})"]
        added[k] = checks[f"checks ({k})"] - checks["stub direct"]
        print(f"  tt thin, {k:11s}        {t:10.2f} µs   {t / direct:5.3f}× direct   {t - direct:+9.2f} µs")
    for k in paths:
        print(f"  checks alone, {k:11s}   {added[k]:10.2f} µs   ({added[k] * 1000 / n_params:.0f} ns per parameter; "
              f"target for 1000: < 50 µs)")
    for k in paths:
        c = cold[f"checks ({k})"] - cold["stub direct"]
        print(f"  checks alone, {k:11s}   {c:10.2f} µs   right after the computation (the caches a real call finds)")
    return added


def after_computation(variants: dict, comp, inputs, *, repeat) -> dict:
    """Median µs of one call of each variant made right after the real computation ran (untimed).

    The repeated calls of ``bench_all`` find everything they read in the CPU caches; a real thin call runs
    after the previous step's computation, which has pushed the parameters' and optimizer state's objects
    out of them.  These timings are single calls, read in ns."""
    clock = time.thread_time_ns if CLOCK is time.thread_time else time.perf_counter_ns
    times = {k: [] for k in variants}
    for _ in range(repeat):
        for k, (fn, args) in variants.items():
            comp(*inputs)
            t0 = clock()
            fn(*args)
            times[k].append((clock() - t0) / 1000)
    return {k: statistics.median(v) for k, v in times.items()}


FIRST_CALL_CHILD = """
import sys, time
import torch
import thunder_train as tt
from benchmarks.overhead import elementwise
kw = {} if sys.argv[1] == "default" else {"fusion": None}
f = tt.compile(elementwise, thin=True, **kw)
x, y = torch.randn(8), torch.randn(8)
with torch.no_grad():
    t0, c0 = time.perf_counter(), time.process_time()
    f(x, y)
    t, c = time.perf_counter() - t0, time.process_time() - c0
heavy = [m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules]
print(t * 1000, c * 1000, ",".join(heavy) or "-")
"""


def first_call_fresh(rounds=5):
    """The 20-op function's first call in ``rounds`` fresh processes per mode, the modes taking turns."""
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    times, cpu, loaded = {"fusion=None": [], "default": []}, {"fusion=None": [], "default": []}, {}
    for _ in range(rounds):
        for label, arg in (("fusion=None", "none"), ("default", "default")):
            out = subprocess.run([sys.executable, "-c", FIRST_CALL_CHILD, arg], env=env, cwd=root, capture_output=True,
                                 text=True, check=True).stdout.split()
            times[label].append(float(out[0]))
            cpu[label].append(float(out[1]))
            loaded[label] = out[2]
    print("\n20 elementwise ops, first call (trace + compile + run) in a fresh process, "
          f"{rounds} processes each (target <= 20 ms)")
    for label, ts in times.items():
        print(f"  {label:12s} median {statistics.median(ts):7.1f} ms wall, {statistics.median(cpu[label]):7.1f} ms CPU "
              f"(process; wall runs: {', '.join(f'{t:.1f}' for t in ts)})"
              f"   loaded: {loaded[label] if loaded[label] != '-' else 'no torch._dynamo, Inductor or sympy'}")


def before_switch(rounds=5, blocks=48, block=50):
    """Paired CPU time of the default and ``fusion=None`` before the default's fused program takes over, with a
    control: a second ``fusion=None`` compile against the first (what two identical programs differ by here)."""
    x, y = torch.randn(8), torch.randn(8)
    per_call = {"default": [], "control": []}
    totals = {"default": [], "control": []}
    decisions = set()
    with torch.no_grad():
        for _ in range(rounds):
            fns = {"none": tt.compile(elementwise, thin=True, fusion=None),
                   "default": tt.compile(elementwise, thin=True),
                   "control": tt.compile(elementwise, thin=True, fusion=None)}
            for f in fns.values():
                f(x, y)  # first calls: tracing, not timed
            sums = dict.fromkeys(fns, 0)
            orders = list(itertools.permutations(fns))
            for i in range(blocks):
                t = {}
                for label in orders[i % len(orders)]:  # every order in turn
                    f = fns[label]
                    t0 = time.thread_time_ns()
                    for _ in range(block):
                        f(x, y)
                    t[label] = time.thread_time_ns() - t0
                    sums[label] += t[label]
                for k in per_call:
                    per_call[k].append(t[k] / t["none"])
            for k in totals:
                totals[k].append(sums[k] / sums["none"])
            stats = tt.compile_stats(fns["default"])
            assert stats.fusion_switches == 0, "the fused program took over during the timing"
            decisions.update(stats.fusion_decisions)
    print(f"\n20 elementwise ops, the default before its switch against fusion=None ({rounds} rounds of {blocks} blocks "
          f"of {block} calls, taking turns, thread CPU time; target <= 1.05)")
    for k, label in (("default", "default / fusion=None"), ("control", "control: fusion=None / fusion=None")):
        print(f"  {label:36s} per call (median of blocks) {statistics.median(per_call[k]):.3f}; from the second call "
              f"on (decision included) {statistics.median(totals[k]):.3f} (rounds: {', '.join(f'{r:.3f}' for r in totals[k])})")
    for line in sorted(decisions):
        print(f"  {line}")


def main():
    if "--before-switch" in sys.argv:
        before_switch()
        return
    if "--first-call" in sys.argv:
        first_call_fresh()
        return
    quick = "--quick" in sys.argv
    with_tc = "--no-torch-compile" not in sys.argv
    with_fusion = "--no-fusion" not in sys.argv
    number, repeat = (200, 5) if quick else (1000, 15)
    for n in (10, 1000):
        run_step_case(n, number=number, repeat=repeat)
    if "--steps-only" in sys.argv:
        return
    torch.manual_seed(0)
    with torch.no_grad():
        x, y = torch.randn(8), torch.randn(8)
        run_case("20 elementwise ops on 8-element tensors", elementwise, (x, y), number=number, repeat=repeat, with_torch_compile=with_tc,
                 with_fusion=with_fusion)
        model = MLP()
        run_case("3-layer MLP forward (batch 8, width 32)", mlp_forward, (model, torch.randn(8, 32)), number=number, repeat=repeat, with_torch_compile=with_tc,
                 with_fusion=with_fusion)


if __name__ == "__main__":
    main()
