"""Returned views of an input, compared with eager over many view ops (compiler/acquisition/output_aliases.py).

Eager's view of an input shares its memory: a later in-place write by the caller through the result changes the
input.  A view of an input the step writes in place is rebuilt by the epilogue on the real input; where its traced
layout is not eager's (an op run opaquely on a computed value: ``x.t().diagonal(1)``; ``w[e]`` at a 0-d index
tensor, whose offset is a value of the call) it came back as eager's values in new memory, and the caller's write
reached the input in eager only.  Now eager's view calls are replayed on the real input.  Each case runs eagerly
and compiled (full, thin, fusion=None; three calls), then the caller writes every result in place: the input, the
results, their layouts and their memory sharing (storage, ``_base``, version counter) must match eager's.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt

E = torch.tensor(2)  # a 0-d integer index: eager's w[E] is a view of w

VIEWS = {
    "getitem_int": lambda x: x[2],
    "getitem_0d_tensor": lambda x: x[E],
    "getitem_0d_tensor_column": lambda x: x[1:, E],
    "slice": lambda x: x[1:, ::2],
    "t": lambda x: x.t(),
    "view": lambda x: x.view(2, 8),
    "narrow": lambda x: x.narrow(1, 1, 2),
    "select": lambda x: x.select(1, 2),
    "expand": lambda x: x[:1].expand(3, 4),
    "movedim": lambda x: x.movedim(0, 1),
    "diagonal": lambda x: x.diagonal(1),
    "unfold": lambda x: x.unfold(1, 2, 1),
    "t_diagonal": lambda x: x.t().diagonal(1),
    "t_unfold": lambda x: x.t().unfold(0, 2, 1),
    "slice_t_diagonal": lambda x: x[1:].t().diagonal(),
    "as_strided": lambda x: x.as_strided((2, 2), (1, 4), 1),
    "unbind": lambda x: x.unbind(1),
    "split": lambda x: x.split(3, 1),
    "t_split": lambda x: x.t().split(3),
    "chunk": lambda x: x.chunk(2),
    "view_as_real": lambda x: torch.view_as_real(torch.view_as_complex(x.view(4, 2, 2))),
    "view_dtype": lambda x: x.view(torch.int32),
    "detach_t": lambda x: x.detach().t(),
    "data_t": lambda x: x.data.t(),
    "mT": lambda x: x.mT,
    "reshape": lambda x: x.reshape(8, 2),
    "t_reshape": lambda x: x.t().reshape(-1),  # eager copies: a value of its own
    "t_flatten": lambda x: x.t().flatten(),
    "t_contiguous": lambda x: x.t().contiguous(),
}


def _written(view):
    def step(x):
        x.add_(1)
        return view(x)
    return step


def _written_after(view):
    def step(x):
        v = view(x)
        x.add_(1)
        return v
    return step


def _unwritten(view):
    return lambda x: view(x) if isinstance(view(x), torch.Tensor) else tuple(view(x))


def _caller_write(o):
    with torch.no_grad():
        if torch._debug_has_internal_overlap(o) == 1:  # expand: one memory location for several elements
            o.fill_(100)
        else:
            o.mul_(3).add_(100)


def _facts(o, x):
    return (o.shape, o.dtype, o.stride(), o.storage_offset(), o.requires_grad, o._base is x,
            o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), o._version == x._version)


def _run(step):
    for i in range(3):
        x = torch.arange(16.0).reshape(4, 4) * (i + 1)  # a tensor of its own (not a view of arange's)
        out = step(x)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    facts = [_facts(o, x) for o in outs]
    for o in outs:
        _caller_write(o)
    return x, outs, facts


MODES = {"full": {}, "thin": {"thin": True}, "fusion_none": {"fusion": None}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("make", [_written, _written_after, _unwritten], ids=["written", "written_after", "unwritten"])
@pytest.mark.parametrize("name", list(VIEWS))
def test_returned_view_of_an_input_matches_eager(name, make, mode):
    step = make(VIEWS[name])
    x, outs, facts = _run(step)
    xc, outsc, factsc = _run(tt.compile(step, **MODES[mode]))
    assert factsc == facts
    torch.testing.assert_close(xc, x, rtol=0, atol=0)
    for oc, o in zip(outsc, outs):
        torch.testing.assert_close(oc, o, rtol=0, atol=0)


METADATA_STEPS = {  # an input resized or restrided in place, then returned or viewed (the epilogue replays the method)
    "t_": lambda x: x.t_(),
    "t_then_row": lambda x: x.t_()[1],
    "t_then_diagonal": lambda x: x.t_().diagonal(1),
    "t_then_index_tensor": lambda x: x.t_()[E],
    "unsqueeze_then_row": lambda x: x.unsqueeze_(0)[0],
    "squeeze_then_t": lambda x: x.unsqueeze_(1).squeeze_(1).t(),
    "transpose_then_column": lambda x: x.transpose_(0, 1)[:, 1],
    "swapdims_then_unfold": lambda x: x.swapdims_(0, 1).unfold(0, 2, 1),
    "as_strided_then_row": lambda x: x.as_strided_((2, 2), (1, 4), 1)[0],
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", list(METADATA_STEPS))
def test_view_of_an_input_restrided_in_place_matches_eager(name, mode):
    step = METADATA_STEPS[name]
    x, outs, facts = _run(step)
    xc, outsc, factsc = _run(tt.compile(step, **MODES[mode]))
    assert factsc == facts
    assert (xc.shape, xc.stride(), xc.storage_offset()) == (x.shape, x.stride(), x.storage_offset())
    torch.testing.assert_close(xc, x, rtol=0, atol=0)
    for oc, o in zip(outsc, outs):
        torch.testing.assert_close(oc, o, rtol=0, atol=0)


class _Ema(torch.nn.Module):
    """A buffer updated in place, a view of it made by an opaque op on a computed view returned for logging."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(4, 4))

    def forward(self, x):
        self.avg.mul_(0.5).add_(x)
        return self.avg.t().diagonal(1), self.avg[E]


def _run_module(compiled):
    m = _Ema()
    step = tt.compile(m) if compiled else m
    for i in range(3):
        outs = step(torch.full((4, 4), float(i + 1)) + torch.arange(16.0).reshape(4, 4))
    facts = [_facts(o, m.avg) for o in outs]
    for o in outs:
        _caller_write(o)
    return m.avg, facts


def test_compiled_module_returning_a_view_of_its_buffer_matches_eager():
    avg, facts = _run_module(False)
    avgc, factsc = _run_module(True)
    assert factsc == facts
    torch.testing.assert_close(avgc, avg, rtol=0, atol=0)


def _write_through_view_dtype(x):
    x.view(torch.int32).add_(1)
    return x * 1


def test_write_through_a_view_in_another_dtype_is_refused():
    """``x.view(torch.int32)`` shares ``x``'s memory though torch marks no view: a write through it was lost."""
    x = torch.ones(2, 3)
    with pytest.raises(tt.TracingError, match="int32 view of a float32 tensor"):
        tt.compile(_write_through_view_dtype)(x)
    assert torch.equal(x, torch.ones(2, 3))


def _view_of_a_written_index(x):
    i = E * 1
    v = x[i]
    i.add_(1)
    x.add_(1)
    return v


def test_view_at_an_index_tensor_written_afterwards_is_refused_leaving_the_input_untouched():
    """The replay would read the index's value after its update, not the one eager's view was made at."""
    x = torch.arange(16.0).reshape(4, 4) + 0
    with pytest.raises(tt.TracingError, match="an index.* is updated in place after the view was made"):
        tt.compile(_view_of_a_written_index)(x)
    assert torch.equal(x, torch.arange(16.0).reshape(4, 4))


def _write_through_reshape(x):
    y = x.t().reshape(-1)  # eager copies (the transposed layout has no flat view)
    y.add_(1)
    z = x.reshape(-1)  # a view
    z.mul_(2)
    return y * 1


@pytest.mark.parametrize("mode", list(MODES))
def test_write_through_a_reshape_that_copies_stays_in_the_copy(mode):
    """It was recorded as a view of ``x``: the write reached ``x`` (and ``y`` followed later writes to ``x``)."""
    x, xc = torch.arange(6.0).reshape(2, 3) + 0, torch.arange(6.0).reshape(2, 3) + 0
    y, yc = _write_through_reshape(x), tt.compile(_write_through_reshape, **MODES[mode])(xc)
    torch.testing.assert_close(yc, y, rtol=0, atol=0)
    torch.testing.assert_close(xc, x, rtol=0, atol=0)


def _rows_at(x, e):
    x.add_(1)
    return x[e], x[:, e]


@pytest.mark.parametrize("mode", list(MODES))
def test_views_at_an_index_argument_follow_each_calls_index(mode):
    """``w[e]``'s position is a value of the call: each call's view sits where that call's ``e`` says."""
    step = tt.compile(_rows_at, **MODES[mode])
    for i in [0, 2, 1, 2]:
        e = torch.tensor(i)
        x, xc = torch.arange(16.0).reshape(4, 4) + 0, torch.arange(16.0).reshape(4, 4) + 0
        outs, outsc = _rows_at(x, e), step(xc, e)
        assert [_facts(o, x) for o in outs] == [_facts(o, xc) for o in outsc]
        for o in (*outs, *outsc):
            _caller_write(o)
        torch.testing.assert_close(xc, x, rtol=0, atol=0)
