"""Counts of PyTorch's OpInfo database run through thunder_train on CPU (see docs/opinfo.md).

    PYTHONPATH=. python benchmarks/opinfo_report.py            # counts
    PYTHONPATH=. python benchmarks/opinfo_report.py --details  # plus one line per failing OpInfo
    PYTHONPATH=. python benchmarks/opinfo_report.py --audit-layouts  # plus values not laid out as their trace says
    PYTHONPATH=. python benchmarks/opinfo_report.py --write-expected tests/opinfo_expected_failures.txt

The checks are those of tests/test_opinfo.py (tests/opinfo_check.py).  "native" counts the OpInfos
whose samples ran without any op run opaquely.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import opinfo_check as oc  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--details", action="store_true", help="print one line per failing OpInfo")
    ap.add_argument("--only", default=None, help="comma-separated OpInfo ids")
    ap.add_argument("--write-expected", default=None, help="write the expected-failures file")
    ap.add_argument("--samples", type=int, default=oc.SAMPLES,
                    help=f"sample inputs per OpInfo, dtype and variant (default {oc.SAMPLES}, as the test; later samples reach edge cases)")
    ap.add_argument("--audit-layouts", action="store_true",
                    help="also compare every tensor a program line makes with the shape and strides its trace recorded")
    a = ap.parse_args()
    oc.SAMPLES = a.samples
    ops = oc.all_opinfos()
    if a.only:
        wanted = set(a.only.split(","))
        ops = [o for o in ops if oc.opinfo_id(o) in wanted]
    audited = _audit_layouts() if a.audit_layouts else None
    t0 = time.perf_counter()
    results = []
    for op in ops:
        if audited is not None:
            audited["current"] = oc.opinfo_id(op)
        results.append(oc.check(op))
    seconds = time.perf_counter() - t0
    fwd = collections.Counter(r.forward for r in results)
    grad = collections.Counter(r.gradient for r in results)
    ran = [r for r in results if r.forward != "skip" or r.gradient != "skip"]
    native = sum(1 for r in ran if not r.opaque and "error" not in (r.forward, r.gradient))
    opaque = sum(1 for r in ran if r.opaque)
    fwd_total = sum(v for k, v in fwd.items() if k != "skip")
    grad_total = sum(v for k, v in grad.items() if k != "skip")
    print(f"OpInfos in op_db: {len(results)} ({len(ran)} run by eager on CPU in the tested dtypes)")
    print(f"forward pass: {fwd['pass']} / {fwd_total} ({100 * fwd['pass'] / max(fwd_total, 1):.1f}%), errors {fwd['error']}, mismatches {fwd['mismatch']}")
    print(f"gradient pass: {grad['pass']} / {grad_total} ({100 * grad['pass'] / max(grad_total, 1):.1f}%), errors {grad['error']}, mismatches {grad['mismatch']}")
    print(f"OpInfos with a silent mismatch (values, dtypes, shapes, containers, grad flags, inputs): {sum(r.mismatch for r in results)}")
    print(f"natively run (no opaque op, no error): {native}; with an opaque op: {opaque}")
    print(f"({seconds:.0f} s)")
    if a.details or a.only:
        for r in results:
            for kind, status, reason in (("forward", r.forward, r.forward_reason), ("gradient", r.gradient, r.gradient_reason)):
                if status in ("error", "mismatch"):
                    print(f"{status.upper():8} {kind:8} {r.name}: {reason}")
    if audited is not None:
        found = audited["found"]
        print(f"OpInfos with a value whose shape or strides differ from its trace's record: {len(found)}")
        for name, kinds in sorted(found.items()):
            for kind, (value, recorded, real) in kinds.items():
                print(f"{kind.upper():8} {name}: {value} recorded {recorded}, made {real}")
    if a.write_expected:
        with open(a.write_expected, "w") as f:
            f.write(HEADER)
            for r in results:
                if oc.failing_kinds(r) and not r.mismatch:
                    f.write(oc.expected_line(r) + "\n")
    return 1 if any(r.mismatch for r in results) else 0


def _audit_layouts() -> dict:
    """Programs compiled from now on report each tensor a line makes (``codegen.layout_audit``, off by default); the
    ones that differ from the trace's record (``codegen.layout_differs``) are collected by OpInfo: decisions are taken
    from the recorded layouts (docs/layout_and_outputs.md)."""
    from thunder_train.compiler import codegen

    audited = {"current": None, "found": collections.defaultdict(dict)}

    def check(name, t, shape, strides):
        kind = codegen.layout_differs(t, shape, strides) if isinstance(t, torch.Tensor) and t.layout == torch.strided else None
        if kind is None:
            return
        audited["found"][audited["current"]].setdefault(kind, (name, (tuple(shape), tuple(strides)),
                                                               (tuple(t.shape), t.stride())))

    codegen.layout_audit = check
    return audited


HEADER = """\
# OpInfos (torch.testing._internal.common_methods_invocations.op_db) that tests/test_opinfo.py expects to fail.
# One line each: <OpInfo id>  <forward|gradient|forward,gradient>  <first error seen>.
# A silent mismatch is never listed here: it is a bug to fix.  The list only shrinks: test_opinfo fails when a
# listed OpInfo passes.  Regenerate with: PYTHONPATH=. python benchmarks/opinfo_report.py --write-expected <this file>
"""

if __name__ == "__main__":
    sys.exit(main())
