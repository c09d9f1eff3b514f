"""Where a zoo model's steady step goes, line by line of the program that runs (the default's fused program).

Run: PYTHONPATH=. python benchmarks/line_times.py MODEL [KINDS] [LINES]    (MODEL ``gpt``: benchmarks/train_step.py's GPT step)

The default thin whole step of ``tests/_zoo.py``'s MODEL is built and its fused program waited for.  The generated
computation it calls (found with ``sys.setprofile`` at one call) is copied with a clock read after each statement,
run 150 times with that call's arguments (torch on one thread), and each line's median time, less the clock read's
own, is printed summed by what the line calls (KINDS rows), then the slowest LINES lines.  A measuring aid: the copy
runs the same statements with the same globals, but its clock reads cost ~0.15 us a line and timings vary by machine.
"""
from __future__ import annotations

import collections
import linecache
import os
import re
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import _zoo  # noqa: E402

import thunder_train as tt  # noqa: E402


def _computation_call(cf, batch):
    """(code, globals, arguments) of the generated computation one call of ``cf`` runs."""
    got = {}

    def hook(frame, event, arg):
        if event == "call" and "code" not in got and frame.f_code.co_filename.startswith("<thunder_train computation"):
            got["code"], got["globals"] = frame.f_code, frame.f_globals
            got["args"] = [frame.f_locals[n] for n in frame.f_code.co_varnames[:frame.f_code.co_argcount]]

    sys.setprofile(hook)
    try:
        cf(batch)
    finally:
        sys.setprofile(None)
    return got["code"], got["globals"], got["args"]


def _instrumented(code, globs):
    """The computation with ``_T_()`` after each statement of its body; the statements' texts."""
    lines = "".join(linecache.getlines(code.co_filename)).split("\n")
    start = next(j for j, line in enumerate(lines) if line.startswith("def "))
    body = next((j for j, line in enumerate(lines) if line == "  try:"), None)  # the body runs inside try/finally
    indent, start = ("    ", body) if body is not None else ("  ", start)
    out, labels = [], []
    for j, line in enumerate(lines):
        out.append(line)
        if j == start:
            out.append(indent + "_T_()")
        text = line.strip()
        if j <= start or not text or text.startswith(("#", "return")) or not line.startswith(indent) \
                or line.startswith(indent + " ") or text.endswith(":"):
            continue
        following = next((x for x in lines[j + 1:] if x.strip() and not x.strip().startswith("#")), "")
        if following.startswith(indent + " "):
            continue
        labels.append(text.split("#")[0].strip())
        out.append(indent + "_T_()")
    stamps = []
    g = dict(globs, _T_=lambda: stamps.append(time.perf_counter_ns()))
    scope = {}
    exec(compile("\n".join(out), "<instrumented computation>", "exec"), g, scope)
    return scope[code.co_name], labels, stamps, g["_T_"]


def _kind(text):
    if text.startswith("del "):
        return "del"
    if re.match(r"\w+ = (_b\[\d+\]|\w+)$", text):
        return "a kept buffer's value or a name"
    m = re.search(r"= ([\w.]+)\(", text)
    return m.group(1) if m else text[:30]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0]
    kinds, slowest = (int(argv[1]) if len(argv) > 1 else 25), (int(argv[2]) if len(argv) > 2 else 20)
    if name == "gpt":  # benchmarks/train_step.py's GPT step, on its two threads
        torch.set_num_threads(2)
        from train_step import closure_step, gpt_setup

        model, data, make_opt = gpt_setup()
        step, batches = closure_step(model, make_opt(model.parameters())), data(4)
        cf = tt.compile(lambda b: step(*b), thin=True)
    else:
        torch.set_num_threads(1)
        model, batches = _zoo.build(name), _zoo.batches(name, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cf = tt.compile(lambda b: _zoo.train_step(model, opt, b), thin=True)
    cf(batches[0])
    cf(batches[1])
    tt.wait_for_fusion(cf)  # the second call's entry is the one every later step runs
    for i in range(5):
        cf(batches[i % 4])
    code, globs, args = _computation_call(cf, batches[0])
    fn, labels, stamps, stamp = _instrumented(code, globs)
    per = collections.defaultdict(list)
    for it in range(150):
        stamps.clear()
        fn(*args)
        if it >= 20:
            for k in range(len(labels)):
                per[k].append(stamps[k + 1] - stamps[k])
    stamps.clear()
    for _ in range(1000):
        stamp()
    own = statistics.median(b - a for a, b in zip(stamps, stamps[1:]))
    med = {k: max(statistics.median(v) - own, 0) for k, v in per.items()}
    print(f"{name}: {len(labels)} lines, {sum(med.values()) / 1e3:.1f} us in all (medians; clock read {own} ns)")
    by_kind = collections.defaultdict(lambda: [0, 0])
    for k, text in enumerate(labels):
        by_kind[_kind(text)][0] += med[k]
        by_kind[_kind(text)][1] += 1
    for kind, (t, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])[:kinds]:
        print(f"{t / 1e3:8.1f} us {n:4d} lines {t / n / 1e3:7.2f} us a line  {kind}")
    for k in sorted(med, key=lambda k: -med[k])[:slowest]:
        print(f"{med[k] / 1e3:8.1f} us  {labels[k][:150]}")


if __name__ == "__main__":
    main()
