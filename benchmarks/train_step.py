"""Eager, torch.compile and thunder_train on three CPU workloads, paired in one process (docs/performance.md).

Run: python benchmarks/train_step.py [--workloads tiny,mlp,gpt] [--samples N] [--no-torch-compile] [--e2e]

Workloads: ``tiny`` = 20 elementwise ops on 8-element tensors (a function, no gradients); ``mlp`` = a whole
SGD training step of a 3 x 256 MLP, batch 64; ``gpt`` = a whole AdamW training step of a 4-layer GPT
(d 256, 4 heads, T 128, batch 8, vocab 4096).  A step is ``forward, cross-entropy, loss.backward(),
opt.step(), opt.zero_grad()``, written two ways: the closure style (``step(x, y)`` reads ``model`` and
``opt`` from its closure) and the argument style (``step(model, opt, x, y)``).

Modes: eager; ``torch.compile`` (default, and with ``torch._dynamo.config.trace_autograd_ops``); and
``tt.compile(step, thin=True)`` with its default (``fusion="background"``: the torch program first, the fused
program once a worker thread built it) and each fusion option.  Each mode trains its own copy of the same
weights on the same batches; the samples of all modes interleave (the first mode rotating) so a slow phase
of a shared machine costs all alike.  Reported: the first call (trace/compile + one step), for
the default how long until the fused program ran, the median time of the later samples and
``eager median / mode median`` (> 1: faster than eager); the first call's result against eager's (same
weights, same batch: they must agree to rounding); for ``gpt`` the
peak memory of a step (what it allocates, from ``torch.profiler``'s allocator events, plus the buffers a
thunder_train program keeps between calls) against eager's; and each mode's page faults per step (the memory
a step takes from the operating system again).

``--e2e`` also runs recipes/train_gpt.py for 1,000 steps (its default model) in fresh processes: eager,
thunder_train (the recipe's default) and thin mode with cold and warm Inductor caches, torch.compile; and
the GPT step's first call in a fresh process, cold and warm.  Not a test: timings vary by machine.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from gpt import GPT, GPTConfig  # noqa: E402
from _peak import peak_call_bytes  # noqa: E402  (tests/_peak.py: one way of measuring a call's peak, shared)
from overhead import elementwise  # noqa: E402

import thunder_train as tt  # noqa: E402


# ---------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------
def train_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def closure_step(model, opt):
    def step(x, y):
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def gpt_setup(batch=8, seq=128, vocab=4096):
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=4, n_head=4, n_embd=256))
    g = torch.Generator().manual_seed(0)

    def data(n):
        out = []
        for _ in range(n):
            x = torch.randint(0, vocab, (batch, seq), generator=g)
            out.append((x, torch.roll(x, -1, 1)))
        return out

    return model, data, lambda ps: torch.optim.AdamW(ps, lr=1e-3)


def mlp_setup(batch=64, d=256, classes=10):
    model = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d), nn.ReLU(), nn.Linear(d, classes))
    g = torch.Generator().manual_seed(0)

    def data(n):
        return [(torch.randn(batch, d, generator=g), torch.randint(0, classes, (batch,), generator=g)) for _ in range(n)]

    return model, data, lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9)


STEP_WORKLOADS = {"mlp": ("MLP 3x256, batch 64, SGD step", mlp_setup, 10),
                  "gpt": ("GPT 4L d256 T128 B8 V4096, AdamW step", gpt_setup, 1)}
TT_FUSION = {"tt thin (default)": "default", "tt thin fusion=None": None, "tt thin fusion='inductor'": "inductor"}


@contextlib.contextmanager
def _trace_autograd_ops():
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(trace_autograd_ops=True):
        yield


class Mode:
    """One way of running the workload: ``call()`` runs it once (``per_sample`` calls make one sample)."""

    def __init__(self, name, fn, batches, compiled=None, context=None):
        self.name, self.fn, self.batches, self.compiled = name, fn, batches, compiled
        self.context = context or contextlib.nullcontext
        self.i, self.times, self.loss, self.fused_after, self.first_loss = 0, [], None, None, None
        self.faults = []  # page faults (minor) per step: the memory a step takes from the OS again

    def call(self):
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        with self.context():
            self.loss = self.fn(x, y)

    def first(self):
        t0 = time.perf_counter()
        self.call()
        self.first_s = time.perf_counter() - t0
        self.first_loss = self.loss.detach().clone()
        if self.compiled is not None and self.compiled._fusion_mode == "background":
            # A long run: the steps go on until the pay-back rule started the build (or said never) and it is done.
            self.call()
            job, t1 = self.compiled._last.fusion_job, time.perf_counter()
            while job is not None and job.start_at is not None and not job.done.is_set() and time.perf_counter() - t1 < 600:
                self.call()
                job = self.compiled._last.fusion_job
            self.fused_after = (time.perf_counter() - t0, self.i, tt.compile_stats(self.compiled).fusion_switches,
                                job.start_at if job is not None else None, job is not None and job.done.is_set())


def step_modes(key, with_tc):
    label, setup, _ = STEP_WORKLOADS[key]
    torch.manual_seed(0)
    base, data, make_opt = setup()
    batches = data(8)
    modes = []

    def copy_of():
        model = copy.deepcopy(base)
        return model, make_opt(model.parameters())

    m, o = copy_of()
    modes.append(Mode("eager", closure_step(m, o), batches))
    if with_tc:
        m, o = copy_of()
        modes.append(Mode("torch.compile", torch.compile(closure_step(m, o)), batches))
        m, o = copy_of()
        modes.append(Mode("torch.compile trace_autograd_ops", torch.compile(closure_step(m, o)), batches,
                          context=_trace_autograd_ops))
    for name, fusion in TT_FUSION.items():
        m, o = copy_of()
        cf = tt.compile(closure_step(m, o), thin=True, **({} if fusion == "default" else {"fusion": fusion}))
        modes.append(Mode(name, cf, batches, compiled=cf))
    m, o = copy_of()
    cf = tt.compile(train_step, thin=True)
    modes.append(Mode("tt thin (default), argument style", lambda x, y, cf=cf, m=m, o=o: cf(m, o, x, y), batches, compiled=cf))
    return label, base, modes


def tiny_modes(with_tc):
    torch.manual_seed(0)
    batches = [(torch.randn(8), torch.randn(8))]
    modes = [Mode("eager", elementwise, batches)]
    if with_tc:
        modes.append(Mode("torch.compile", torch.compile(elementwise), batches))
    for name, fusion in TT_FUSION.items():
        cf = tt.compile(elementwise, thin=True, **({} if fusion == "default" else {"fusion": fusion}))
        modes.append(Mode(name.replace("tt thin", "tt thin"), cf, batches, compiled=cf))
    return "20 elementwise ops on 8-element tensors", None, modes


# ---------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------
def measure(modes, samples, per_sample):
    for m in modes:
        m.first()
        for _ in range(3):
            m.call()
    for i in range(samples):
        order = modes[i % len(modes):] + modes[:i % len(modes)]
        for m in order:
            f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            for _ in range(per_sample):
                m.call()
            m.times.append((time.perf_counter() - t0) / per_sample)
            m.faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / per_sample)


def peak_step_bytes(mode) -> int:
    """``peak_call_bytes`` of one call of a mode."""
    return peak_call_bytes(mode.call, mode.compiled)


def report(label, base, modes, with_memory):
    eager = statistics.median(modes[0].times)
    n = f", {sum(p.numel() for p in base.parameters()) / 1e6:.2f} M parameters" if base is not None else ""
    print(f"\n{label}{n}; {len(modes[0].times)} samples per mode")
    print(f"  {'mode':<38}{'first call s':>13}{'median ms':>11}{'eager/mode':>12}{'faults/step':>12}{'1st result - eager':>20}"
          f"  fused program")
    rows = {}
    for m in modes:
        med = statistics.median(m.times)
        diff = float((m.first_loss - modes[0].first_loss).abs().max())  # same weights, same batch: ~0
        fused = ""
        if m.fused_after is not None:
            s, calls, switches, start_at, done = m.fused_after
            fused = (f"built from call {start_at}, ran from call {calls + 1} ({s:.1f} s after the first)" if switches
                     else "not built: the pay-back rule says it never pays" if start_at is None
                     else f"not built in the 600 s warm-up: the pay-back rule starts it at call {start_at}" if not done
                     else "nothing fused")
        print(f"  {m.name:<38}{m.first_s:>13.3f}{med * 1e3:>11.3f}{eager / med:>11.2f}x{statistics.median(m.faults):>12.0f}"
              f"{diff:>20.1e}  {fused}")
        rows[m.name] = {"first_s": m.first_s, "median_s": med, "ratio": eager / med}
    if with_memory:
        peaks = {m.name: peak_step_bytes(m) for m in modes if m.name in ("eager", "tt thin (default)", "tt thin fusion=None")}
        e = peaks["eager"]
        print("  peak memory of one step (allocated during it, plus kept buffers): " + ", ".join(
            f"{k} {v / 2**20:.1f} MiB ({v / e:.2f}x eager)" for k, v in peaks.items()))
    return rows


# ---------------------------------------------------------------------------
# Fresh processes: 1,000 recipe steps end to end, the GPT step's first call
# ---------------------------------------------------------------------------
def _run(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return out.stdout


def e2e(steps, rounds):
    """Each round runs every mode once, one fresh process after another; the medians over rounds are compared,
    because one process's step time varies by up to ~30 % from the next on a shared machine."""
    recipe = os.path.join(ROOT, "recipes", "train_gpt.py")
    print(f"\nrecipes/train_gpt.py, {steps} steps of its default model, fresh process each (wall time of the loop, "
          f"compilation included), {rounds} round(s) of all modes, medians")
    labels = ("eager", "thunder (recipe default), cold Inductor cache", "thunder-thin, warm Inductor cache",
              "torch.compile, cold Inductor cache")
    totals = {label: [] for label in labels}
    losses = {}
    for _ in range(rounds):
        with tempfile.TemporaryDirectory() as cold_cache, tempfile.TemporaryDirectory() as torch_cache:
            for label, mode, cache in zip(labels, ("eager", "thunder", "thunder-thin", "torch"),
                                          (None, cold_cache, cold_cache, torch_cache)):
                env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS=str(torch.get_num_threads()))
                if cache is not None:
                    env["TORCHINDUCTOR_CACHE_DIR"] = cache
                out = _run([sys.executable, recipe, "--compile", mode, "--steps", str(steps), "--no-progress", "--device", "cpu"], env)
                totals[label].append(float(re.search(r"total_s=([0-9.]+)", out).group(1)))
                losses[label] = re.search(r"final_loss=([0-9.]+)", out).group(1)
    base = statistics.median(totals["eager"])
    for label in labels:
        med = statistics.median(totals[label])
        runs = ", ".join(f"{t:.1f}" for t in totals[label])
        print(f"  {label:<48}{med:>8.1f} s  {med / base:5.2f}x eager's time   (runs: {runs})   final loss {losses[label]}")
    print("\nGPT step (4L d256), first call in a fresh process (tracing + one step)")
    with tempfile.TemporaryDirectory() as cache:
        for label in ("cold caches", "warm (second process)"):
            env = dict(os.environ, PYTHONPATH=ROOT, TORCHINDUCTOR_CACHE_DIR=cache)
            out = _run([sys.executable, os.path.abspath(__file__), "--first-call-child"], env)
            print(f"  {label:<24}{out.strip()}")


def e2e_paired(steps, with_torch_compile):
    """The same 1,000-step runs in one process, the modes' steps interleaved (eager, thunder, ...: one step each,
    in turn), so that whatever the machine does slows every mode alike.  Each mode's total is the sum of its own
    step times, its first call (tracing, compilation) included; every mode trains its own copy of one model on
    the same batches, as the recipe does (``recipes/train_gpt.py``'s defaults)."""
    from gpt import ALPHABET, batches, make_corpus
    from train_gpt import parse_args, train_step as recipe_step

    a = parse_args([])  # the recipe's defaults: its model, batch, learning rate, seed
    torch.manual_seed(a.seed)
    model = GPT(GPTConfig(vocab_size=len(ALPHABET), block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd))
    fns = {"eager": recipe_step, "thunder (recipe default)": tt.compile(recipe_step),
           "thunder-thin": tt.compile(recipe_step, thin=True)}
    if with_torch_compile:
        fns["torch.compile"] = torch.compile(recipe_step)
    runs = {}
    for name, fn in fns.items():
        m = copy.deepcopy(model)
        runs[name] = (fn, m, torch.optim.AdamW(m.parameters(), lr=a.lr, weight_decay=0.01))  # as the recipe's main()
    totals = {name: 0.0 for name in fns}
    data = batches(make_corpus(seed=a.seed), a.batch_size, a.block_size, torch.device("cpu"), seed=a.seed)
    for _ in range(steps):
        x, y = next(data)
        for name, (fn, m, opt) in runs.items():
            t0 = time.perf_counter()
            fn(m, opt, x, y)
            totals[name] += time.perf_counter() - t0
    print(f"\nthe same {steps} steps in one process, modes interleaved step by step (sum of each mode's step times, "
          "first call included)")
    for name, total in totals.items():
        print(f"  {name:<48}{total:>8.2f} s  {total / totals['eager']:5.2f}x eager's time")


def first_call_child():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model, data, make_opt = gpt_setup()
    (x, y), = data(1)
    cf = tt.compile(closure_step(model, make_opt(model.parameters())), thin=True)
    t0 = time.perf_counter()
    cf(x, y)
    print(f"first call {time.perf_counter() - t0:.2f} s")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="tiny,mlp,gpt")
    p.add_argument("--samples", type=int, default=30, help="timed samples per mode (interleaved)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-torch-compile", action="store_true")
    p.add_argument("--e2e", action="store_true", help="also the 1,000-step recipe runs and first calls in fresh processes")
    p.add_argument("--e2e-steps", type=int, default=1000)
    p.add_argument("--e2e-rounds", type=int, default=3, help="fresh-process runs of each mode (medians are compared)")
    p.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.first_call_child:
        return first_call_child()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, {os.cpu_count()} CPUs; "
          f"ratio = eager median / mode median")
    results = {}
    for key in filter(None, args.workloads.split(",")):  # --workloads "" --e2e: only the fresh-process runs
        if key == "tiny":
            with torch.no_grad():
                label, base, modes = tiny_modes(not args.no_torch_compile)
                measure(modes, args.samples, 200)
                results[key] = report(label, base, modes, False)
        else:
            label, base, modes = step_modes(key, not args.no_torch_compile)
            measure(modes, args.samples, STEP_WORKLOADS[key][2])
            results[key] = report(label, base, modes, key == "gpt")
    if args.e2e:
        if args.e2e_rounds > 0:
            e2e(args.e2e_steps, args.e2e_rounds)
        e2e_paired(args.e2e_steps, not args.no_torch_compile)
    return results


if __name__ == "__main__":
    main()
