"""PyTorch's OpInfo database (``op_db``) run through ``tt.compile`` on CPU and compared with eager.

One test per OpInfo (xdist shards them); the checks are in ``opinfo_check.py``.  A silent mismatch
always fails.  An error fails unless ``opinfo_expected_failures.txt`` lists the OpInfo with that kind
(forward / gradient); a listed kind that now passes fails too, so the list only shrinks.
Counts: ``python benchmarks/opinfo_report.py`` (docs/opinfo.md).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import opinfo_check as oc  # noqa: E402

pytest.importorskip("expecttest", reason="torch's OpInfo database imports expecttest (pip install expecttest)")

EXPECTED_FILE = os.path.join(os.path.dirname(__file__), "opinfo_expected_failures.txt")
EXPECTED = oc.read_expected(EXPECTED_FILE)
OPS = oc.all_opinfos()
IDS = [oc.opinfo_id(o) for o in OPS]


def test_expected_failures_name_real_opinfos():
    unknown = sorted(set(EXPECTED) - set(IDS))
    assert not unknown, f"{EXPECTED_FILE} lists OpInfos that op_db does not have: {unknown}"


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_opinfo(op):
    r = oc.check(op)
    assert not r.mismatch, (
        f"{r.name} gives a silently different result from eager: forward {r.forward} {r.forward_reason!r}; "
        f"gradient {r.gradient} {r.gradient_reason!r}. A mismatch is a bug, never an expected failure."
    )
    failing = oc.failing_kinds(r)
    listed = EXPECTED.get(r.name, set())
    unexpected = failing - listed
    assert not unexpected, (
        f"{r.name} now fails ({', '.join(sorted(unexpected))}): "
        + "; ".join(x for x in (r.forward_reason, r.gradient_reason) if x)
    )
    fixed = listed - failing
    assert not fixed, f"{r.name} now passes {', '.join(sorted(fixed))}: remove it from {os.path.basename(EXPECTED_FILE)}"
