"""``p.data = v`` inside a compiled step, ``p`` an input (compiler/acquisition/data_assignment.py).

Each case runs eagerly and compiled on equal copies: the same values, gradients, parameters and optimizer
state, or both raise; what is refused leaves every user object as it was.
"""
from __future__ import annotations

import copy

import pytest
import torch

import thunder_train as tt

MSG = "modified by an inplace operation"


def _model_and_opt(momentum=0.9):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    return m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum)


def _twins():
    m, opt = _model_and_opt()
    me, opte = _model_and_opt()
    return (m, opt), (me, opte)


def _assert_same(m, opt, me, opte):
    for p, pe in zip(m.parameters(), me.parameters()):
        torch.testing.assert_close(p, pe)
        assert p.stride() == pe.stride()
        assert (p.grad is None) == (pe.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, pe.grad)
        assert p.requires_grad == pe.requires_grad
    for p, pe in zip(m.parameters(), me.parameters()):
        s, se = opt.state.get(p, {}), opte.state.get(pe, {})
        assert s.keys() == se.keys()
        for k in s:
            torch.testing.assert_close(s[k], se[k])


def _batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 4, generator=g), torch.randn(2, 3, generator=g)


def _clip_after_step(model, opt, x, y):  # WGAN's weight clipping, written with .data =
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    for p in model.parameters():
        p.data = p.data.clamp(-0.2, 0.2)
    return loss


def _reinit_before_backward(model, opt, x, y):
    # the second Linear saved its weight (through a view: weight.t()) and the first its input; eager's backward reads
    # the old memory through the view
    loss = torch.nn.functional.mse_loss(model(x), y)
    model[2].weight.data = torch.full_like(model[2].weight, 0.05)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _saved_itself_then_assigned(model, opt, x, y):
    w = model[2].weight
    h = model[0](x).tanh()
    out = (h @ w.t()) * w.sum()  # mul saves w.sum(); sum saves nothing; w itself is saved by nothing here
    scaled = h * w[:, :4].sum(0)  # a view of w
    z = torch.mul(h.sum(0), model[0].bias)  # mul saves the bias itself: eager's backward reads its new memory
    model[0].bias.data = model[0].bias.data * 3
    loss = torch.nn.functional.mse_loss(out, y) + scaled.sum() + z.sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _assigned_then_step_then_fresh_value_read(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    w = model[0].weight
    new = w.data * 0.5
    w.data = new
    opt.step()  # writes w in place: eager's `new` shares that memory
    opt.zero_grad()
    return loss, new * 1


def _assigned_twice_and_used(model, opt, x, y):
    b = model[2].bias
    b.data = torch.zeros_like(b)
    first = model(x)  # uses the new bias, whose gradient reaches b as before
    b.data = b.data + 1
    loss = torch.nn.functional.mse_loss(first + model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _assigned_then_buffer_written(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    g = model[0].weight.grad
    g.data = g.data.clamp(-0.01, 0.01)  # a .grad tensor's memory replaced before the optimizer reads it
    opt.step()
    opt.zero_grad()
    return loss


def _assigned_a_view_then_step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    model[0].weight.data = (model[0].weight * 0.5).detach()  # a view of a temporary: shares memory with it
    model[2].weight.data = model[2].weight * 0.5  # carries a gradient history
    opt.step()  # writes both in place; the temporaries are not read again
    opt.zero_grad()
    return loss


STEPS = [_assigned_a_view_then_step, _clip_after_step, _reinit_before_backward, _saved_itself_then_assigned, _assigned_then_step_then_fresh_value_read,
         _assigned_twice_and_used, _assigned_then_buffer_written]


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("step", STEPS, ids=[s.__name__.strip("_") for s in STEPS])
def test_training_step_assigning_parameter_data_matches_eager(step, thin):
    (m, opt), (me, opte) = _twins()
    cstep = tt.compile(step, thin=thin)
    ptrs = [p.data_ptr() for p in m.parameters()]
    for i in range(4):  # the first step makes the momentum buffers: the steady state traces again
        x, y = _batch(i)
        torch.testing.assert_close(cstep(m, opt, x, y), step(me, opte, x, y))
        _assert_same(m, opt, me, opte)
    assert [p.data_ptr() for p in m.parameters()] == ptrs  # written in place: the binding's storage stays
    stats = tt.compile_stats(cstep)
    assert stats.cache_misses <= 2 and (not thin or stats.calls > stats.full_calls), stats


def test_assignment_then_backward_after_a_write_raises_as_eager():
    def step(model, opt, x, y):
        w = model[2].bias
        loss = (model(x) * w).sum()  # mul saves the bias itself
        w.data = w.data * 2  # its counter does not move ...
        with torch.no_grad():
            w.add_(1)  # ... until this write: the saved bias is stale
        loss.backward()
        return loss

    (m, opt), (me, opte) = _twins()
    x, y = _batch(0)
    with pytest.raises(RuntimeError, match=MSG):
        step(me, opte, x, y)
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(RuntimeError, match=MSG):
        tt.compile(step)(m, opt, x, y)
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert all(p.grad is None for p in m.parameters())


def _other_shape(model, opt, x, y):
    model[2].bias.data = torch.zeros(5)
    return model(x).sum()


def _other_input(model, opt, x, y):
    model[2].bias.data = model[0].bias.data[:3]
    return model(x).sum()


def _old_view_written(model, opt, x, y):
    b = model[2].bias
    row = b.data[:2]
    b.data = torch.zeros_like(b)
    row.mul_(2)  # eager writes the old memory
    return model(x).sum()


def _history_read_after_step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    v = model[2].bias * 2  # carries a gradient history: does not follow the bias
    model[2].bias.data = v
    opt.step()  # eager writes v's memory too
    return v.sum()


@pytest.mark.parametrize("step,match", [(_other_shape, "another shape"), (_other_input, "share memory"),
                                        (_old_view_written, "old memory"), (_history_read_after_step, "read afterwards")])
def test_refused_assignments_are_clear_and_leave_objects_untouched(step, match):
    (m, opt), _ = _twins()
    x, y = _batch(0)
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()  # momentum state exists
    before = copy.deepcopy((m.state_dict(), opt.state_dict(), [p.grad for p in m.parameters()]))
    ptrs = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(Exception, match=match):
        tt.compile(step)(m, opt, x, y)
    sd, osd, grads = before
    for k, v in m.state_dict().items():
        torch.testing.assert_close(v, sd[k], rtol=0, atol=0)
    for p, g in zip(m.parameters(), grads):
        torch.testing.assert_close(p.grad, g, rtol=0, atol=0)
    for k, st in opt.state_dict()["state"].items():
        torch.testing.assert_close(st["momentum_buffer"], osd["state"][k]["momentum_buffer"], rtol=0, atol=0)
    assert [p.data_ptr() for p in m.parameters()] == ptrs


class _UpdatesItsWeight(torch.nn.Module):
    """A forward that uses its weight, changes it without autograd seeing (``how``), and uses it again: eager's
    backward reaches the weight through both uses."""

    def __init__(self, how):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.how = how

    def forward(self, x):
        y = self.lin(x) * self.lin.weight.sum()
        w = self.lin.weight
        if self.how == "data":
            w.data = w.data.clamp(-0.1, 0.1)
        else:
            with torch.no_grad():
                w.mul_(0.5)
        return torch.tanh(self.lin(x)) + y


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("how", ["data", "no_grad"])
def test_compiled_module_updating_its_weight_in_forward_matches_eager(how, thin):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = _UpdatesItsWeight(how)
    torch.manual_seed(0)
    ref = _UpdatesItsWeight(how)
    cm = tt.compile(net, thin=thin)
    for i in range(3):
        out, want = cm(x), ref(x)
        torch.testing.assert_close(out, want)
        (out * (i + 1)).sum().backward()
        (want * (i + 1)).sum().backward()
        for p, pe in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p, pe)
            torch.testing.assert_close(p.grad, pe.grad)
    stats = tt.compile_stats(cm)
    assert stats.cache_misses == 1 and (not thin or stats.calls > stats.full_calls), stats


def _to_double(buf, x):
    buf.data = buf.data.double() * 2
    return x * buf.float().sum()


def _transposed_rows(buf, x):
    buf.data = buf.data.t().contiguous()[:2]
    return x * buf.sum(), buf.shape


def _transposed_view(buf, x):
    buf.data = (buf.data * 1).t()  # eager's tensor ends column-major
    return x * buf[0].sum(), buf.stride()


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("step", [_to_double, _transposed_rows, _transposed_view], ids=["dtype", "shape", "strides"])
def test_assigning_other_metadata_to_a_tensor_without_grad_matches_eager(step, thin):
    """A buffer (no grad) given another dtype, shape or layout through ``.data``: the caller's tensor ends as eager's."""
    buf, bufe = torch.arange(6.).reshape(2, 3), torch.arange(6.).reshape(2, 3)
    cstep = tt.compile(step, thin=thin)
    for i in range(3):
        x = torch.randn(3, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(cstep(buf, x), step(bufe, x))
        assert (buf.dtype, buf.shape, buf.stride()) == (bufe.dtype, bufe.shape, bufe.stride())
        torch.testing.assert_close(buf, bufe)
