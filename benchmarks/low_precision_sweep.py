"""Sweep: float16 / bfloat16 forward values and gradients of every elementwise and reduction OpInfo (and the
activations and norms among the other OpInfos), compared bitwise with eager on the CPU.

    PYTHONPATH=$PWD python benchmarks/low_precision_sweep.py [NAME_SUBSTRING ...]

Prints one line per OpInfo that does not pass (mismatch / error) and a count per status.  The mismatches that
remain are listed in docs/autograd.md; tests/test_low_precision_sweep.py runs a bounded list of ops.
"""
import collections
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import low_precision_check as lpc  # noqa: E402
import opinfo_check as oc  # noqa: E402


def selected(op):
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, ReductionOpInfo, UnaryUfuncInfo

    extra = ("nn.functional.", "linalg.vector_norm", "norm", "logaddexp", "prod", "cumprod", "cumsum", "logcumsumexp",
             "softmax", "log_softmax", "var", "std", "mean", "sum", "amax", "amin", "clamp", "lerp", "addcmul", "addcdiv")
    return isinstance(op, (UnaryUfuncInfo, BinaryUfuncInfo, ReductionOpInfo)) or op.name.startswith(extra)


def main(filters):
    counts = collections.Counter()
    for op in oc.all_opinfos():
        name = oc.opinfo_id(op)
        if not selected(op) or (filters and not any(f in name for f in filters)):
            continue
        status, detail = lpc.check(op)
        counts[status] += 1
        if status in ("mismatch", "error"):
            print(f"{status:8s} {name:40s} {detail}", flush=True)
    print(dict(counts))


if __name__ == "__main__":
    main(sys.argv[1:])
