"""Hand-written parameter updates inside a compiled step, as tutorials and older code write them.

``m.weight -= lr * m.weight.grad`` (an augmented assignment on a module attribute: Python assigns the in-place
result back, and nn.Module accepts it because it is the same Parameter), ``p.data -= lr * p.grad`` (``p.data`` is
assigned its own updated memory) and a forward that branches on ``isinstance(self.weight, nn.Parameter)``.  Each
runs eagerly and compiled (thin, full, ``fusion=None``) on equal copies for several steps: the same losses,
parameters (same objects), gradients and random state.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt

MODES = {"thin": dict(thin=True), "full": dict(), "nofuse": dict(fusion=None)}


def _attr_update(m, lr):
    m.weight -= lr * m.weight.grad
    m.bias -= lr * m.bias.grad


def _attr_scale(m, lr):
    m.weight *= 1 - lr
    m.bias /= 1 + lr


def _data_update(m, lr):
    for p in m.parameters():
        p.data -= lr * p.grad


def _data_update_then_read(m, lr):
    w = m.weight.data
    w -= lr * m.weight.grad
    m.weight.data = w
    m.bias.data = m.bias.data  # the unchanged memory assigned back


UPDATES = {"attr_isub": _attr_update, "attr_imul_idiv": _attr_scale, "data_isub": _data_update,
           "data_view_assigned_back": _data_update_then_read}


def _run(update, compiled_kw, steps=3):
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    objs = list(m.parameters())
    batches = [torch.randn(5, 4) for _ in range(steps)]

    def step(x):
        loss = m(x).square().mean()
        loss.backward()
        with torch.no_grad():
            update(m, 0.1)
        m.zero_grad()
        return loss

    f = step if compiled_kw is None else tt.compile(step, **compiled_kw)
    losses = [f(x) for x in batches]
    assert all(a is b for a, b in zip(objs, m.parameters()))  # the same Parameter objects, as eager
    return losses, m, torch.get_rng_state()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", UPDATES)
def test_hand_written_update_matches_eager(name, mode):
    losses, m, rng = _run(UPDATES[name], None)
    closses, cm, crng = _run(UPDATES[name], MODES[mode])
    torch.testing.assert_close(torch.stack(closses), torch.stack(losses))
    for (n, p), q in zip(m.named_parameters(), cm.parameters()):
        torch.testing.assert_close(q, p, msg=lambda s: f"{n}: {s}")
        assert q.grad is None and p.grad is None and type(q) is nn.Parameter
    assert torch.equal(crng, rng)


class _Branching(nn.Module):
    """Library code that asks whether an attribute is a Parameter (eager: True for a registered one)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        scale = 2.0 if isinstance(self.weight, nn.Parameter) else 0.5
        return (x @ self.weight.t()) * scale


@pytest.mark.parametrize("mode", [*MODES, "module"])
def test_isinstance_parameter_while_tracing_is_eager(mode):
    torch.manual_seed(0)
    m = _Branching()
    x = torch.randn(2, 4)
    ref = m(x)
    cm = copy.deepcopy(m)
    if mode == "module":
        out = tt.compile(cm)(x)
    else:
        out = tt.compile(lambda x: cm(x), **MODES[mode])(x)
    torch.testing.assert_close(out, ref)


def test_rebinding_a_parameter_to_another_is_still_refused():
    """A parameter proxy passes ``isinstance(_, nn.Parameter)`` now, so nn.Module accepts ``a.weight = b.weight``
    while tracing; the rebinding is refused afterwards (module_writes.py), with the module as it was."""
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    w = a.weight

    def step(x):
        a.weight = b.weight
        return a(x).sum()

    with pytest.raises(Exception, match="replaces, adds or removes the parameter"):
        tt.compile(step)(torch.randn(2, 4))
    assert a.weight is w and a._parameters["weight"] is w


@pytest.mark.parametrize("mode", MODES)
def test_parameter_and_plain_tensor_arguments_get_their_own_programs(mode):
    """A call passing a plain tensor where the program was traced for an ``nn.Parameter`` (same shape, dtype and
    flag) retraces: the Python type is part of the call's key (runtime/cache_keys.py), as the branch may differ."""
    torch.manual_seed(0)
    w, v = nn.Parameter(torch.randn(4, 4)), torch.randn(4, 4, requires_grad=True)
    xs = [torch.randn(3, 4) for _ in range(4)]

    def step(x, t):
        scale = 2.0 if isinstance(t, nn.Parameter) else 3.0
        return (x @ t).square().mean() * scale

    cf = tt.compile(step, **MODES[mode])
    for i, x in enumerate(xs):
        t = w if i % 2 == 0 else v
        torch.testing.assert_close(cf(x, t), step(x, t))
    assert any("type: Parameter → Tensor" in r for r in tt.compile_stats(cf).retrace_reasons)
