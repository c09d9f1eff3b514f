"""Process-wide torch state inside a compiled function: honoured or refused, never changed on the first call only.

Tracing runs the function's Python once; a reseed or a global setting changed there would not happen on later
calls (compiler/acquisition/global_state.py).  Each case is compared with eager and checks that a refused call
leaves the state as it was.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def _reseeding_steps():
    """Seeding a compiled program cannot reproduce: entropy from the operating system, and a generator object's own
    methods (not functions of torch the tracer can record; the seeding and state functions are, see
    tests/test_rng_state_ops.py)."""
    return {
        "torch.seed": lambda x: (torch.seed(), x * 2)[1],
        "torch.random.seed": lambda x: (torch.random.seed(), x * 2)[1],
        "torch.default_generator.manual_seed": lambda x: (torch.default_generator.manual_seed(0), x + torch.randn(3))[1],
    }


@pytest.mark.parametrize("name", list(_reseeding_steps()))
def test_reseeding_inside_is_refused_and_leaves_the_generator_alone(name):
    step = _reseeding_steps()[name]
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with pytest.raises(TracingError, match="torch.manual_seed|Seed outside the compiled function"):
        tt.compile(step)(torch.zeros(3))
    assert torch.equal(torch.get_rng_state(), state)
    # Outside tracing the real functions are back.
    torch.manual_seed(5)
    a = torch.randn(3)
    torch.manual_seed(5)
    assert torch.equal(a, torch.randn(3))


def test_seeding_outside_gives_eagers_numbers_on_every_call():
    def step(x):
        return x + torch.randn(3) + F.dropout(torch.ones(4), 0.5).sum()

    cf = tt.compile(step)
    x = torch.zeros(3)
    for _ in range(2):
        torch.manual_seed(7)
        expected = step(x)
        after_eager = torch.get_rng_state()
        torch.manual_seed(7)
        torch.testing.assert_close(cf(x), expected)
        assert torch.equal(torch.get_rng_state(), after_eager)  # tracing drew nothing of its own


def test_tracing_an_opaque_random_op_draws_nothing():
    def step(x):
        return x + torch.randint(0, 10, (3,)) + torch.randperm(3)

    cf = tt.compile(step)
    x = torch.zeros(3, dtype=torch.int64)
    for _ in range(2):
        torch.manual_seed(3)
        expected = step(x)
        torch.manual_seed(3)
        assert torch.equal(cf(x), expected)


def test_a_generator_argument_is_refused():
    def step(x):
        g = torch.Generator().manual_seed(1)
        return x + torch.randn(3, generator=g)

    with pytest.raises(TracingError, match="generator"):
        tt.compile(step)(torch.zeros(3))

    def opaque_step(x):
        return x + torch.randint(0, 5, (3,), generator=torch.Generator().manual_seed(1))

    with pytest.raises(TracingError, match="generator"):
        tt.compile(opaque_step)(torch.zeros(3, dtype=torch.int64))


_SETTINGS = [
    ("default dtype", lambda: torch.set_default_dtype(torch.float64), torch.get_default_dtype),
    ("grad mode", lambda: torch.set_grad_enabled(False), torch.is_grad_enabled),
    ("deterministic", lambda: torch.use_deterministic_algorithms(True), torch.are_deterministic_algorithms_enabled),
    ("anomaly", lambda: torch.autograd.set_detect_anomaly(True), torch.is_anomaly_enabled),
    ("matmul precision", lambda: torch.set_float32_matmul_precision("medium"), torch.get_float32_matmul_precision),
]


@pytest.mark.parametrize("what,change,get", _SETTINGS, ids=[s[0] for s in _SETTINGS])
def test_global_setting_left_changed_is_refused_and_restored(what, change, get):
    before = get()

    def step(x):
        change()
        return x * 2

    try:
        with pytest.raises(TracingError, match="changed when it returns"):
            tt.compile(step)(torch.ones(3))
        assert get() == before
    finally:  # never leave the process changed, even if the test fails
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)
        torch.set_float32_matmul_precision("highest")


def test_a_setting_undone_before_returning_is_traced():
    def step(x):
        torch.set_default_dtype(torch.float64)
        a = torch.ones(3)
        torch.set_default_dtype(torch.float32)
        with torch.set_grad_enabled(False):
            b = x * 3
        return a + x, b

    x = torch.ones(3, requires_grad=True)
    cf = tt.compile(step)
    for _ in range(2):
        (a, b), (ea, eb) = cf(x), step(x)
        assert a.dtype == ea.dtype == torch.float64 and a.requires_grad == ea.requires_grad
        assert b.requires_grad is eb.requires_grad is False
        torch.testing.assert_close(a, ea)
        assert torch.get_default_dtype() is torch.float32 and torch.is_grad_enabled()
