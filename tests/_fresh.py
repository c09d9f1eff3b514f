"""Run a test's body in a fresh interpreter (tests/test_identity_views.py, tests/test_model_zoo.py).

For checks of which kernels a zoo model's compiled step takes, which must not depend on what earlier tests in the
same worker process did: twice in CI (never in a single-process run of the whole suite, nor alone) Falcon's
attention reached ``scaled_dot_product_attention`` by another path in transformers (an explicit scale, its one
key/value head repeated over the query heads), so the flash pair for one key/value head did not apply.  What
changed transformers' choice is not known yet (docs/state_audit.md); the values matched eager's either way."""
from __future__ import annotations

import os
import subprocess
import sys


def run_fresh(module: str, function: str, timeout: int = 600) -> None:
    """``module.function()`` in a new Python process; its failure (with its output) fails the caller."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests, os.environ.get("PYTHONPATH", "")]))
    code = f"import {module}; {module}.{function}()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tests, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{module}.{function} failed in a fresh interpreter:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
