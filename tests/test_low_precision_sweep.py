"""Half and bfloat16 OpInfo samples compared bitwise with eager: forward values and gradients (CPU).

A bounded list of the elementwise and reduction ops whose low-precision results are eager's bit for bit (their
gradient formulas round where eager's do: compiler/torchlang/low_precision_grads.py).  The whole sweep, with the ops
that still differ by an ulp, is ``benchmarks/low_precision_sweep.py``; docs/autograd.md lists what remains.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import low_precision_check as lpc  # noqa: E402

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (pip install expecttest)")

BITWISE = [
    "abs", "acos", "acosh", "add", "asin", "asinh", "atan", "atan2", "atanh", "cos", "cosh", "div.no_rounding_mode",
    "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "hypot", "lgamma", "log", "log10", "log1p", "log2", "logaddexp",
    "logaddexp2", "mul", "neg", "pow", "prod", "reciprocal", "rsqrt", "sigmoid", "sin", "sinh", "sqrt", "square", "sub",
    "tan", "tanh", "true_divide", "__rdiv__", "__rpow__", "linalg.vector_norm", "norm", "norm.fro", "sum", "mean",
    "nn.functional.logsigmoid", "nn.functional.softsign", "nn.functional.elu", "nn.functional.softplus",
]


def _opinfos():
    from opinfo_check import all_opinfos, opinfo_id

    by_id = {opinfo_id(o): o for o in all_opinfos()}
    return [pytest.param(by_id[n], id=n) for n in BITWISE]


@pytest.mark.parametrize("op", _opinfos())
def test_low_precision_samples_are_eager_bitwise(op):
    status, detail = lpc.check(op)
    assert status == "pass", f"{status}: {detail}"
