"""PyTorch's ModuleInfo database (``torch.testing._internal.common_modules.module_db``: torch.nn modules with
constructor and forward arguments nobody here wrote) trained compiled and compared with eager.

Per ModuleInfo, its first sample input in two cases (``tests/moduleinfo_check.py``): a whole training step
``tt.compile(step, thin=True)`` in train mode, and ``tt.compile(module)`` inside an eager step in eval mode; two
steps each, comparing outputs, input and parameter gradients, parameters, buffers and the random state with eager's.
Every case must match eager: none is an expected failure.  The sweep over every sample, both modes and both
variants is ``benchmarks/moduleinfo_report.py`` (docs/opinfo.md, "torch.nn modules").
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
pytest.importorskip("expecttest", reason="torch's ModuleInfo database imports expecttest (pip install expecttest)")
import moduleinfo_check as mc  # noqa: E402

INFOS = {info.name: info for info in mc.all_moduleinfos()}
CASES = [(name, training, variant) for name in INFOS for training, variant in ((True, "step"), (False, "module"))]


@pytest.mark.parametrize("name, training, variant", CASES,
                         ids=[mc.case_id(n, t, 0, v) for n, t, v in CASES])
def test_module_trains_as_eager(name, training, variant):
    c = mc.run_case(INFOS[name], training, 0, variant)
    assert c.status != "skip", f"{c.id}: eager rejected the ModuleInfo's first sample; the case tests nothing"
    assert c.status == "match", f"{c.id} ({c.desc!r}) is {c.status}: {c.reason}"
