"""Tensor subclasses among a compiled function's inputs (compiler/acquisition/walker.py ``overrides_torch``): one
with its own ``__torch_function__`` or ``__torch_dispatch__`` had its override applied only where a torch call of the
program reached it (the torch program's first calls), not in kept buffers' ``out=`` forms or fused kernels: the
third call of ``x.sin().sum()`` on a subclass scaling ``sin`` by 10 returned eager's value divided by 10, silently.
Now refused with what to do; a subclass that only marks its tensors (``nn.Parameter``'s own subclasses) runs."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import thunder_train as tt
from _steps import squared_output_step


class _ScaledSin(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        return out * 10 if func in (torch.Tensor.sin, torch.sin) else out


class _Doubled(torch.Tensor):
    """A wrapper subclass: its data is ``inner``, read doubled by every op."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   strides=inner.stride())

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.inner * 2 if isinstance(t, _Doubled) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


class _MarkedParameter(nn.Parameter):
    """A parameter subclass that only marks (no override): runs as a parameter."""


def _sin_sum(x):
    return x.sin().sum()


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("make", [lambda x: x.as_subclass(_ScaledSin), _Doubled], ids=["torch_function", "torch_dispatch"])
def test_a_subclass_that_overrides_ops_is_refused(make, thin):
    cf = tt.compile(_sin_sum, thin=thin)
    x = torch.randn(4)
    for _ in range(3):
        assert torch.equal(cf(x), _sin_sum(x))
    special = make(x)
    assert not torch.allclose(_sin_sum(special), _sin_sum(x))  # eager applies the subclass
    with pytest.raises(tt.TracingError, match="torch.Tensor subclass with its own __torch_function__ or __torch_dispatch__"):
        cf(special)
    with pytest.raises(tt.TracingError, match="args\\[0\\] is a"):
        tt.compile(_sin_sum, thin=thin)(special)  # also on a first call
    assert torch.equal(cf(x), _sin_sum(x))


@pytest.mark.parametrize("how", ["thin", "full", "module"])
def test_a_parameter_subclass_that_overrides_ops_is_refused(how):
    class _ScaledParameter(nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    model = nn.Linear(3, 2)
    model.weight = _ScaledParameter(model.weight.detach())
    x = torch.randn(4, 3)
    call = tt.compile(model) if how == "module" else (lambda x: tt.compile(lambda m, x: m(x), thin=how == "thin")(model, x))
    with pytest.raises(tt.TracingError, match="weight is a .*_ScaledParameter"):
        call(x)


@pytest.mark.parametrize("thin", [False, True])
def test_a_parameter_subclass_that_only_marks_trains_as_eager(thin):
    torch.manual_seed(0)
    eager, compiled = nn.Linear(3, 2), nn.Linear(3, 2)
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        m.weight = _MarkedParameter(m.weight.detach())
    eopt, copt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled))
    step = squared_output_step
    cf = tt.compile(step, thin=thin)
    x = torch.randn(4, 3)
    for _ in range(3):
        assert torch.equal(cf(compiled, copt, x), step(eager, eopt, x))
    assert type(compiled.weight) is _MarkedParameter and torch.equal(compiled.weight, eager.weight)
