"""Results that share memory with an input after the call, as eager's do (compiler/acquisition/output_aliases.py).

A step that writes an input in place and returns a view of it (``x.add_(1); return x[0]``, ``p.detach()`` after an
update under no_grad, ``v`` after ``p.data = v``) returned a fresh tensor: a later in-place write by the caller
reached the input in eager and not compiled.  Each case runs eagerly and compiled (full and thin mode, three
calls), then the caller writes the result in place; the input, the result and their memory sharing must match.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def _no_grad(f):
    def g(m, x):
        with torch.no_grad():
            return f(m, x)
    return g


def _data_assign(m, x):
    v = m.weight.detach() * 0.5 + x.sum()
    m.weight.data = v
    return v


def _data_assign_zeros(m, x):
    v = torch.zeros_like(m.weight)
    m.weight.data = v
    return v, m.weight.detach()


def _ema(m, x):  # an EMA buffer updated in place, its first half returned for logging
    m.avg.mul_(0.9).add_(x.mean(0), alpha=0.1)
    return m.avg[:2]


STEPS = {
    "x_add_then_row": lambda m, x: (x.add_(1), x[0])[1],
    "x_add_then_view": lambda m, x: (x.add_(1), x.view(-1))[1],
    "x_add_then_t": lambda m, x: (x.mul_(2), x.t())[1],
    "param_update_then_detach": _no_grad(lambda m, x: (m.weight.mul_(0.5), m.weight.detach())[1]),
    "param_data_update_then_t": lambda m, x: (m.weight.data.mul_(0.5), m.weight.data.t())[1],
    "param_update_then_param": _no_grad(lambda m, x: (m.weight.mul_(0.5), m.weight)[1]),
    "param_returned": lambda m, x: m.weight,
    "buffer_view": _ema,
    "data_assign_returned": _data_assign,
    "data_assign_two_results": _data_assign_zeros,
}


def _model():
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    m.register_buffer("avg", torch.zeros(3))
    return m


def _run(f, thin=None):
    m = _model()
    step = f if thin is None else tt.compile(f, thin=thin)
    for i in range(3):
        x = torch.full((2, 3), float(i + 1))
        out = step(m, x)
    outs = out if isinstance(out, tuple) else (out,)
    with torch.no_grad():
        outs[0].add_(100)  # the caller writes the result in place
    return m, x, outs


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("name", list(STEPS))
def test_result_sharing_an_input_written_in_place_matches_eager(name, thin):
    m, x, outs = _run(STEPS[name])
    mc, xc, outsc = _run(STEPS[name], thin)
    for t, tc in [(m.weight, mc.weight), (m.avg, mc.avg), (x, xc)] + list(zip(outs, outsc)):
        torch.testing.assert_close(tc, t)
    for o, oc in zip(outs, outsc):
        assert oc.requires_grad == o.requires_grad
        assert oc.shape == o.shape and oc.stride() == o.stride()
        for base, basec in [(m.weight, mc.weight), (m.avg, mc.avg), (x, xc)]:
            same = o.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
            assert (oc.untyped_storage().data_ptr() == basec.untyped_storage().data_ptr()) == same
        assert (oc is mc.weight) == (o is m.weight)


def test_data_assigned_result_keeps_a_version_counter_of_its_own():
    """Eager's ``v`` after ``p.data = v`` shares ``p``'s memory, not its version counter."""
    m = _model()
    v = tt.compile(_data_assign)(m, torch.ones(2, 3))
    before = m.weight._version
    with torch.no_grad():
        v.add_(1)
    assert m.weight._version == before


def _row_and_flat(x):
    x.add_(1)
    return x[:, 0], x.view(-1)


def _calls_with_sizes(step):
    sums = []
    for n in [2, 3, 4]:
        x = torch.zeros(n, 3)
        a, b = step(x)
        a.add_(10)
        b[-1] += 100
        sums.append(x.sum().item())
    return sums


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_views_of_a_written_input_with_varying_sizes_match_eager(thin):
    """Automatic dynamic sizes: the symbolic retrace refuses the views, the sizes are specialised again."""
    assert _calls_with_sizes(tt.compile(_row_and_flat, thin=thin)) == _calls_with_sizes(_row_and_flat)


def test_views_of_a_written_input_with_symbolic_sizes_match_eager():
    """Eager's view calls are replayed on the real input: symbolic sizes need no specialisation."""
    assert _calls_with_sizes(tt.compile(_row_and_flat, dynamic=True)) == _calls_with_sizes(_row_and_flat)


def _all_but_last_row(x):
    x.add_(1)
    return x[: x.shape[0] - 1]


def test_a_view_made_with_symbolic_sizes_is_refused_leaving_the_input_untouched():
    x = torch.zeros(3, 3)
    with pytest.raises(TracingError, match="returns a view of args"):
        tt.compile(_all_but_last_row, dynamic=True)(x)
    assert x.sum().item() == 0


def _detached(x):
    x.mul_(2)
    return x.detach()


def test_whole_input_view_with_symbolic_sizes_shares_memory_as_in_eager():
    step = tt.compile(_detached, dynamic=True)
    for n in [2, 3, 4]:
        x, xe = torch.ones(n, 3), torch.ones(n, 3)
        out, oute = step(x), _detached(xe)
        out.add_(1)
        oute.add_(1)
        torch.testing.assert_close(x, xe)
        assert out._version == x._version


@pytest.mark.parametrize("thin", [False, True])
def test_a_view_whose_traced_layout_is_not_eagers_keeps_eagers_values(thin):
    """``x.t().diagonal(1)`` runs opaquely on the computed ``x.t()``: its traced offset (1) is not eager's view of
    ``x`` (4), so the result must not be rebuilt from that layout (it read x[0, 1:] instead of the diagonal)."""
    fn = lambda x: x.t().diagonal(1).fill_(5)  # noqa: E731
    cf = tt.compile(fn, thin=thin)
    for _ in range(2):
        xe, xc = torch.arange(16.0).reshape(4, 4), torch.arange(16.0).reshape(4, 4)
        e, a = fn(xe), cf(xc)
        torch.testing.assert_close(a, e, rtol=0, atol=0)
        torch.testing.assert_close(xc, xe, rtol=0, atol=0)
