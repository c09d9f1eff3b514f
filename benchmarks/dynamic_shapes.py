"""Fine-tuning with dynamic padding: a new sequence length nearly every step (issue 26).

Run: python benchmarks/dynamic_shapes.py [--steps 300] [--models gpt2,llama] [--modes eager,tt,tt_dynamic,torch_compile]
                                         [--threads 1] [--interleave] [--arena] [--bucket 16]

The zoo's tiny GPT-2 and Llama (tests/_zoo.py sizes: 2 layers, hidden 32; positions raised to 128), batch 4,
each row's length drawn from 16-96 and the batch padded to its longest row (attention mask, labels -100 on
padding), as transformers' padding collators do.  The whole step (forward, loss, backward, AdamW, zero_grad)
runs eager, under ``tt.compile(step, thin=True)`` (default: automatic dynamic shapes), ``tt.compile(step,
thin=True, dynamic=True)`` and ``torch.compile(step)`` (default), each in a fresh process on the same batches
(``--interleave``: all but torch.compile in this process, step by step in turn, for ratios on a loaded machine).
Reported per mode: total time of all steps with compiles, compiled programs (thunder_train: cache misses;
torch.compile: the compiles its counters record), steady step time (median of the second half), and for
thunder_train the share of thin calls; losses are compared with eager's.  ``--bucket 16`` pads each batch to a
multiple of 16 instead (transformers' ``pad_to_multiple_of=16``: 6 lengths, the longest ones most often), and the
mode ``tt_symbolic`` is the default without programs for recurring sizes (runtime/recurring_sizes.py): every call
of the symbolic entry runs the symbolic program.  Not a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("eager", "tt", "tt_dynamic", "torch_compile")  # also tt_symbolic (see above)
PAD = 0
BUCKET = None  # --bucket: pad every batch to a multiple of this


def build(name):
    import torch
    import transformers

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import _zoo

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=_zoo.VOCAB, n_positions=128, n_embd=_zoo.HIDDEN, n_layer=_zoo.LAYERS,
                                      n_head=_zoo.HEADS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg).train()
    if name == "llama":
        cfg = transformers.LlamaConfig(**{**_zoo._LLAMA_LIKE, "max_position_embeddings": 128}, num_key_value_heads=2,
                                       tie_word_embeddings=False)
        return transformers.LlamaForCausalLM(cfg).train()
    raise ValueError(name)


def batches(n, seed=0, batch=4, low=16, high=96, vocab=64):
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(low, high + 1, (batch,), generator=g)
        T = int(lengths.max())
        if BUCKET:
            T = -(-T // BUCKET) * BUCKET
        ids = torch.randint(1, vocab, (batch, T), generator=g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        ids[mask == 0] = PAD
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def step(model, opt, batch):
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _setup(model_name, mode):
    import torch

    torch.manual_seed(0)
    model = build(model_name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    fn = step
    if mode in ("tt", "tt_dynamic", "tt_symbolic"):
        import thunder_train as tt

        fn = tt.compile(step, thin=True, **({"dynamic": True} if mode == "tt_dynamic" else {}))
        if mode == "tt_symbolic":
            fn._specialises_sizes = False  # no programs for recurring sizes (runtime/recurring_sizes.py)
    elif mode == "torch_compile":
        fn = torch.compile(step)
    return model, opt, fn


def _row(model_name, mode, fn, times, losses):
    row = {"model": model_name, "mode": mode, "steps": len(times), "total_s": sum(times), "first_s": times[0],
           "steady_ms": 1e3 * statistics.median(times[len(times) // 2:]), "losses": losses}
    if mode in ("tt", "tt_dynamic", "tt_symbolic"):
        import thunder_train as tt

        stats = tt.compile_stats(fn)
        row.update(programs=stats.cache_misses, recurring_sizes=stats.recurring_sizes, fusion_switches=stats.fusion_switches, thin_share=stats.thin_calls / stats.calls, evictions=stats.evictions,
                   thin_fallbacks=stats.thin_fallbacks, retraces=stats.retrace_reasons[:4])
    elif mode == "torch_compile":
        import torch._dynamo.utils as dutils

        row["programs"] = int(dutils.counters["stats"]["unique_graphs"])
    return row


def run_one(model_name, mode, steps, threads):
    import torch

    torch.set_num_threads(threads)
    model, opt, fn = _setup(model_name, mode)
    times, losses = [], []
    for b in batches(steps):
        t0 = time.perf_counter()
        losses.append(float(fn(model, opt, b)))
        times.append(time.perf_counter() - t0)
    return _row(model_name, mode, fn, times, losses)


def run_interleaved(model_name, modes, steps, threads):
    """Every mode in this one process, step by step in turn on the same batch: a shared machine's load then
    weighs on all modes alike, so their ratios hold even where the absolute times do not."""
    import torch

    torch.set_num_threads(threads)
    runs = {mode: _setup(model_name, mode) for mode in modes}
    times = {mode: [] for mode in modes}
    losses = {mode: [] for mode in modes}
    for b in batches(steps):
        for mode, (model, opt, fn) in runs.items():
            t0 = time.perf_counter()
            losses[mode].append(float(fn(model, opt, b)))
            times[mode].append(time.perf_counter() - t0)
    return [_row(model_name, mode, runs[mode][2], times[mode], losses[mode]) for mode in modes]


def run_arena(model_name, steps, threads, length=96):
    """What kept buffers for symbolic sizes could save (docs/dynamic_shapes.md): every batch padded to ``length``, the
    step specialised with its whole arena, specialised without kept buffers, and symbolic (``dynamic=True``: kept
    buffers only for values of constant size), in turn in this process."""
    import torch
    import torch.nn.functional as F
    import thunder_train as tt

    torch.set_num_threads(threads)
    configs = {"specialised, kept buffers": dict(dynamic=False, fusion=None),
               "specialised, no kept buffers": dict(dynamic=False, fusion=None, keep_buffers=False),
               "symbolic (dynamic=True)": dict(dynamic=True)}
    runs = {}
    for label, options in configs.items():
        torch.manual_seed(0)
        model = build(model_name)
        runs[label] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), tt.compile(step, thin=True, **options))
    times = {label: [] for label in runs}
    for b in batches(steps):
        pad = length - b["input_ids"].shape[1]
        b = {k: F.pad(v, (0, pad), value=-100 if k == "labels" else PAD) for k, v in b.items()}
        for label, (model, opt, fn) in runs.items():
            t0 = time.perf_counter()
            fn(model, opt, b)
            times[label].append(time.perf_counter() - t0)
    for label, t in times.items():
        print(f"{model_name} length {length}: {label}: median step {1e3 * statistics.median(t[steps // 2:]):.2f} ms", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--models", default="gpt2,llama")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (1: steadier on a shared machine)")
    ap.add_argument("--interleave", action="store_true",
                    help="run the modes (torch.compile excepted) in one process, step by step in turn: ratios on a shared machine")
    ap.add_argument("--arena", action="store_true",
                    help="instead: every batch padded to 96, specialised with and without kept buffers against symbolic")
    ap.add_argument("--bucket", type=int, default=None,
                    help="pad every batch to a multiple of this (pad_to_multiple_of): a few lengths that recur")
    ap.add_argument("--assumed-gain", type=float, default=None,
                    help="recurring_sizes.ASSUMED_GAIN (1e9: trace a size's program at its 4th call; --interleave only)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    global BUCKET
    BUCKET = a.bucket
    if a.arena:
        sys.path.insert(0, ROOT)
        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        for model in a.models.split(","):
            run_arena(model, a.steps, a.threads)
        return
    if a.one:
        print("RESULT " + json.dumps(run_one(a.one[0], a.one[1], a.steps, a.threads)), flush=True)
        return
    env = dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    rows = []
    if a.interleave:
        os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        sys.path.insert(0, ROOT)
        if a.assumed_gain is not None:
            from thunder_train.runtime import recurring_sizes

            recurring_sizes.ASSUMED_GAIN = a.assumed_gain
        modes = [m for m in a.modes.split(",") if m != "torch_compile"]
        for model in a.models.split(","):
            got = run_interleaved(model, modes, a.steps, a.threads)
            eager = next((r for r in got if r["mode"] == "eager"), None)
            for row in got:
                if eager is not None and row is not eager:
                    row["max_loss_diff"] = max(abs(x - y) for x, y in zip(row["losses"], eager["losses"]))
                    row["total_vs_eager"] = round(row["total_s"] / eager["total_s"], 3)
                    row["steady_vs_eager"] = round(row["steady_ms"] / eager["steady_ms"], 3)
                rows.append(row)
                print({k: v for k, v in row.items() if k != "losses"}, flush=True)
    for model in a.models.split(",") if not a.interleave else ():
        eager = None
        for mode in a.modes.split(","):
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--steps", str(a.steps),
                                *(["--bucket", str(a.bucket)] if a.bucket else []),
                                "--threads", str(a.threads), "--one", model, mode],
                               capture_output=True, text=True, env=env)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            if p.returncode != 0 or not line:
                rows.append({"model": model, "mode": mode, "error": (p.stderr.strip().splitlines() or ["?"])[-1]})
                print(rows[-1], flush=True)
                continue
            row = json.loads(line[0][7:])
            if mode == "eager":
                eager = row
            if eager is not None and mode != "eager":
                row["max_loss_diff"] = max(abs(x - y) for x, y in zip(row["losses"], eager["losses"]))
            rows.append(row)
            print({k: v for k, v in row.items() if k != "losses"}, flush=True)
    print()
    print("| model | mode | total (compiles included) | compiled programs | steady step | thin calls | max loss diff vs eager |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['mode']} | error: {r['error'][:80]} | | | | |")
            continue
        thin = f"{100 * r['thin_share']:.0f} %" if "thin_share" in r else "—"
        diff = f"{r['max_loss_diff']:.1e}" if "max_loss_diff" in r else "—"
        print(f"| {r['model']} | {r['mode']} | {r['total_s']:.2f} s (first step {r['first_s']:.2f} s) | "
              f"{r.get('programs', '—')} | {r['steady_ms']:.1f} ms | {thin} | {diff} |")


if __name__ == "__main__":
    main()
