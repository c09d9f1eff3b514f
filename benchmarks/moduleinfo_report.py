"""PyTorch's ModuleInfo database (torch.nn modules) through compiled training on CPU, compared with eager
(see docs/opinfo.md, "torch.nn modules").

    PYTHONPATH=. python benchmarks/moduleinfo_report.py --out /tmp/moduleinfo_table.txt
    PYTHONPATH=. python benchmarks/moduleinfo_report.py --only nn.Linear,nn.BatchNorm2d --samples 4

One line per case (ModuleInfo, train/eval, sample, variant) with its class: match / refusal / crash / wrong;
the checks are tests/moduleinfo_check.py's.  Exits 1 when any case is silently wrong.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("THUNDER_TRAIN_FUSION", "off")  # as the test suite: no background C++ compiles
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import moduleinfo_check as mc  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default=None, help="comma-separated ModuleInfo names (nn.Linear,...)")
    ap.add_argument("--samples", type=int, default=mc.SAMPLES, help=f"sample inputs per ModuleInfo and mode (default {mc.SAMPLES})")
    ap.add_argument("--variants", default=",".join(mc.VARIANTS), help="step,module")
    ap.add_argument("--out", default=None, help="write the table here")
    a = ap.parse_args()
    infos = mc.all_moduleinfos()
    if a.only:
        wanted = set(a.only.split(","))
        infos = [i for i in infos if i.name in wanted]
    out = open(a.out, "w") if a.out else None

    def progress(c):
        line = mc.table_line(c)
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    t0 = time.perf_counter()
    cases = mc.run_all(infos, n=a.samples, variants=tuple(a.variants.split(",")), progress=progress)
    seconds = time.perf_counter() - t0
    ran = [c for c in cases if c.status != "skip"]
    lines = [f"ModuleInfos: {len(infos)}; cases run: {len(ran)} (skipped, eager rejects: {len(cases) - len(ran)}); {seconds:.0f} s"]
    for variant in tuple(a.variants.split(",")):
        counts = collections.Counter(c.status for c in ran if c.variant == variant)
        bitwise = sum(1 for c in ran if c.variant == variant and c.bitwise)
        lines.append(f"{variant:7} " + ", ".join(f"{k} {counts[k]}" for k in ("match", "refusal", "crash", "wrong"))
                     + f" (bitwise {bitwise})")
    for line in lines:
        print(line)
        if out:
            out.write(line + "\n")
    return 1 if any(c.status == "wrong" for c in cases) else 0


if __name__ == "__main__":
    sys.exit(main())
