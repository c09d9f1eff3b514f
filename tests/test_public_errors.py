"""The errors a user meets are exported from ``thunder_train`` and are the classes the code raises."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import thunder_train as tt


def _raised(fn, *args):
    with pytest.raises(Exception) as info:
        fn(*args)
    return info.value


def test_unsupported_op_error_is_exported():
    e = _raised(tt.compile(lambda x: torch.special.erfcx(x), strict=True), torch.randn(3))
    assert type(e) is tt.UnsupportedOpError and "erfcx" in str(e)


def test_data_dependent_error_is_exported():
    w = torch.nn.Linear(3, 3)

    def f(x):  # a decision on a random value (one on a value computed from the inputs is specialised)
        return x if torch.nn.functional.dropout(w(x), 0.5).sum() > 0 else -x

    e = _raised(tt.compile(f), torch.randn(3))
    assert type(e) is tt.DataDependentError and "torch.where" in str(e)


def test_no_gradient_rule_error_is_exported():
    # Ops without a native rule now differentiate through torch's autograd (test_opaque_grad.py), so no public
    # call is known to raise it; the exported class is the one the autograd transform raises.
    from thunder_train.compiler.grad_rules import NoGradientRuleError

    assert tt.NoGradientRuleError is NoGradientRuleError


def test_tracing_error_is_exported():
    inner = tt.compile(lambda x: x + 1)
    e = _raised(tt.compile(lambda x: inner(x) * 2), torch.randn(3))
    assert isinstance(e, tt.TracingError) and "nested" in str(e)


def test_thin_mode_error_and_guard_failure_are_exported():
    # check_every=N finds a parameter replaced behind the module's back (issue 26: a new input never raises).
    m = torch.nn.Linear(3, 4)
    cf = tt.compile(lambda mod, x: mod(x), thin=True, check_every=1)
    x = torch.randn(2, 3)
    for _ in range(3):
        cf(m, x)
    m._parameters["weight"] = torch.nn.Parameter(torch.randn(4, 3))
    e = _raised(cf, m, x)
    assert type(e) is tt.ThinModeError and isinstance(e, tt.GuardFailure) and e.path.startswith("args[0]")


def test_the_exported_classes_are_the_defining_modules_classes():
    from thunder_train.compiler import errors, opaque
    from thunder_train.compiler.torchlang import tensor_methods
    from thunder_train.compiler import grad_rules
    from thunder_train.compiler import errors as guard_errors

    assert tt.UnsupportedOpError is errors.UnsupportedOpError is opaque.UnsupportedOpError
    assert tt.DataDependentError is errors.DataDependentError is tensor_methods.DataDependentError
    assert tt.NoGradientRuleError is errors.NoGradientRuleError is grad_rules.NoGradientRuleError
    assert tt.TracingError is errors.TracingError
    assert tt.GuardFailure is guard_errors.GuardFailure and tt.ThinModeError is guard_errors.ThinModeError
    for name in ("UnsupportedOpError", "DataDependentError", "NoGradientRuleError", "TracingError", "ThinModeError", "GuardFailure"):
        assert name in tt.__all__


def test_importing_thunder_train_does_not_import_lightning():
    code = "import sys, thunder_train; print('lightning' in sys.modules or 'lightning.pytorch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
