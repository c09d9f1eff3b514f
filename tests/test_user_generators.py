"""Random generators the user's code owns (compiler/acquisition/user_generators.py): a draw from one while tracing
was replayed as the same number on every call (a layer-drop module's ``self.rng.random() < p``, an augmentation's
scale), silently. Now refused, the generator put back as it was; one reached but not drawn from changes nothing."""
from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import thunder_train as tt
from _steps import squared_output_step


def _state(g):
    if isinstance(g, random.Random):
        return pickle.dumps(g.getstate())
    if isinstance(g, np.random.Generator):
        return pickle.dumps(g.bit_generator.state)
    return pickle.dumps(g.get_state(legacy=False))


_GENERATORS = {
    "random.Random": lambda: random.Random(0),
    "numpy Generator": lambda: np.random.default_rng(0),
    "numpy RandomState": lambda: np.random.RandomState(0),
}


def _draw(g):
    return float(g.random()) if not isinstance(g, np.random.RandomState) else float(g.rand())


class _Held:
    pass


def _step_reaching(kind, how):
    """(a function drawing from a generator reached ``how``, its arguments, the generator)."""
    g = _GENERATORS[kind]()
    if how == "argument":
        return (lambda x, g: x * _draw(g)), (g,), g
    if how == "global":
        glob = {"g": g, "_draw": _draw}
        exec("def f(x):\n    return x * _draw(g)\n", glob)
        return glob["f"], (), g
    if how == "object attribute":
        holder = _Held()
        holder.g = g
        return (lambda x, holder: x * _draw(holder.g)), (holder,), g
    raise AssertionError(how)


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("how", ["argument", "global", "object attribute"])
@pytest.mark.parametrize("kind", sorted(_GENERATORS))
def test_a_draw_from_a_users_generator_is_refused_and_put_back(kind, how, thin):
    f, extra, g = _step_reaching(kind, how)
    before = _state(g)
    with pytest.raises(tt.TracingError, match="drew from .* while tracing"):
        tt.compile(f, thin=thin)(torch.ones(3), *extra)
    assert _state(g) == before


class _LayerDrop(nn.Module):
    """Skips its layer at random, drawing from a generator it holds (a layer-drop or stochastic-depth module)."""

    def __init__(self, p=0.5):
        super().__init__()
        self.layer = nn.Linear(4, 4)
        self.p = p
        self.rng = random.Random(0)

    def forward(self, x):
        return x if self.rng.random() < self.p else self.layer(x)


@pytest.mark.parametrize("mode", ["thin", "full", "module"])
def test_a_modules_own_generator_drawn_in_forward_is_refused(mode):
    model = nn.Sequential(nn.Linear(4, 4), _LayerDrop())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = squared_output_step
    before = _state(model[1].rng)
    weights = [p.detach().clone() for p in model.parameters()]
    if mode == "module":
        call = lambda: step(tt.compile(model), opt, torch.randn(2, 4))  # noqa: E731
    else:
        call = lambda: tt.compile(step, thin=mode == "thin")(model, opt, torch.randn(2, 4))  # noqa: E731
    with pytest.raises(tt.TracingError, match=r"drew from .*\.rng \(random\.Random\)"):
        call()
    assert _state(model[1].rng) == before
    assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))


def test_a_generator_reached_but_not_drawn_from_changes_nothing():
    g = random.Random(0)
    scale = {"g": g, "s": 2.0}

    def f(x, cfg):
        return x * cfg["s"] + (1.0 if cfg["g"] is not None else 0.0)

    cf = tt.compile(f, thin=True)
    for _ in range(3):
        assert torch.equal(cf(torch.ones(3), scale), f(torch.ones(3), scale))
    assert g.random() == random.Random(0).random()


def test_a_failed_trace_puts_a_drawn_generator_back():
    g = np.random.default_rng(0)
    before = _state(g)

    def f(x, g):
        x = x * float(g.random())
        return x.nonexistent_method()

    with pytest.raises(Exception):
        tt.compile(f)(torch.ones(3), g)
    assert _state(g) == before
