"""Eager's version-counter check on saved values (compiler/acquisition/saved_versions.py, docs/state_audit.md).

Each case runs eagerly and compiled on equal inputs: either both raise "modified by an inplace operation", or
both run and give the same values and gradients.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt

MSG = "modified by an inplace operation"


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, generator=g)
    w = torch.randn(4, 4, generator=g, requires_grad=True)
    return x, w


def _run(fn, args):
    torch.manual_seed(0)  # the same dropout draws eagerly and compiled
    try:
        return fn(*args), None
    except RuntimeError as e:
        return None, e


def _same_as_eager(fn, raises):
    x, w = _inputs()
    xe, we = x.clone(), w.detach().clone().requires_grad_()
    ref, eager_err = _run(fn, (xe, we))
    out, err = _run(tt.compile(fn), (x, w))
    assert (eager_err is not None) == (raises is True), eager_err  # the case is what it claims to be
    if raises:
        assert err is not None and MSG in str(err), err
        assert "clone" in str(err)
        return
    assert err is None, err
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(w.grad, we.grad)


def _tanh_detach(x, w):
    y = torch.tanh(x @ w)
    y.detach().mul_(2)
    y.sum().backward()
    return y.detach()


def _sigmoid_no_grad(x, w):
    y = torch.sigmoid(x @ w)
    with torch.no_grad():
        y.add_(1)
    y.sum().backward()
    return y.detach()


def _exp_view(x, w):
    y = torch.exp(x @ w)
    with torch.no_grad():
        y[0].zero_()  # through a view of the saved output
    y.sum().backward()
    return y.detach()


def _relu_inplace_after_sigmoid(x, w):
    y = torch.sigmoid(x @ w)
    y.relu_()
    y.sum().backward()
    return y.detach()


def _relu_inplace_after_matmul(x, w):
    h = x @ w  # matmul saves its inputs, not its output
    h.relu_()
    h.sum().backward()
    return h.detach()


def _mul_input_written(x, w):
    h = torch.tanh(x @ w)
    z = (h * h).sum()  # mul saves both inputs
    h.detach().add_(1)
    z.backward()
    return z.detach()


def _data_write(x, w):
    y = torch.tanh(x @ w)
    y.data.mul_(2)  # .data has a counter of its own: eager runs on the new values
    y.sum().backward()
    return y.detach()


def _data_saved_then_base_written(x, w):
    y = torch.tanh(x @ w)
    d = y.data
    z = (d @ w).sum()  # matmul saves d (and w is not written)
    y.detach().mul_(2)  # y's counter, not d's
    z.backward()
    return z.detach()


def _data_row_written(x, w):
    y = torch.exp(x @ w)
    y.data[0] = 0  # through a view of .data: exp's backward reads the new memory
    y.sum().backward()
    return y.detach()


def _parameter_data_written(x, w):
    loss = (torch.tanh(x @ w) @ w).sum()  # the second matmul saves w
    w.data.mul_(0.5)  # eager's backward reads the halved w (no version bump through .data)
    loss.backward()
    return loss.detach()


def _parameter_data_written_twice(x, w):
    h = torch.sigmoid(x @ w)
    w.data.add_(1)
    loss = (h @ w).sum()  # saves the new w
    w.data.mul_(3)
    loss.backward()
    return loss.detach()


def _data_written_then_counter_moved(x, w):
    y = torch.tanh(x @ w)
    y.data.mul_(2)
    y.detach().add_(1)  # the counter moves: eager's error
    y.sum().backward()
    return y.detach()


def _output_data_assigned(x, w):
    y = torch.tanh(x @ w)
    y.data = torch.zeros_like(y)  # y keeps its graph; tanh saved its output's old memory
    y.sum().backward()
    return y.detach()


def _input_data_assigned(x, w):
    h = torch.tanh(x @ w)
    z = (h * h).sum()  # mul saves h itself: eager's backward reads the memory h points at then
    h.data = torch.ones_like(h)
    z.backward()
    return z.detach()


def _data_assigned_saved_through_a_view(x, w):
    h = torch.tanh(x @ w)
    t = w * 2
    z = torch.nn.functional.linear(h, t).sum()  # linear saves t.t(), a view of t's old memory: eager reads that
    t.data = torch.ones_like(t)
    z.backward()
    return z.detach()


def _ctc(lp):
    # ctc_loss has no meta kernel: what it saves is asked on small CPU tensors
    return torch.nn.functional.ctc_loss(lp, torch.tensor([[1, 2]]), torch.tensor([3]), torch.tensor([2]))


def _ctc_input_written(x, w):
    lp = (x @ w).log_softmax(-1).unsqueeze(1) * 1.0  # (T=3, N=1, C=4); multiplying by a number saves nothing
    loss = _ctc(lp)  # saves its log-probabilities
    lp.detach().mul_(2)
    loss.backward()
    return loss.detach()


def _ctc_input_written_after_backward(x, w):
    lp = (x @ w).log_softmax(-1).unsqueeze(1) * 1.0
    loss = _ctc(lp)
    loss.backward()
    lp.detach().mul_(2)
    return loss.detach()


def _data_written_between_backwards(x, w):
    y = torch.tanh(x @ w)  # saves its output
    z = y.sum()
    y.data.mul_(2)
    z.backward(retain_graph=True)  # reads the doubled memory
    y.data.mul_(3)
    z.backward()  # reads the memory as it is now
    return z.detach()


def _counter_moved_between_backwards(x, w):
    y = torch.tanh(x @ w)
    z = y.sum()
    y.data.mul_(2)
    z.backward(retain_graph=True)
    y.detach().mul_(3)  # moves y's counter: the saved output is stale for the second backward
    z.backward()
    return z.detach()


def _custom_op_backward_twice(x, w):
    y = _triple(torch.tanh(x @ w))  # its gradient by torch's autograd, twice through one graph
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    return y.detach()


def _data_assigned_then_used(x, w):
    h = torch.tanh(x @ w)
    h.data = torch.full_like(h, 0.5)
    (h * x).sum().backward()  # the new values, and gradients through h's old graph
    return h.detach()


def _leaf_written_before_backward(x, w):
    loss = (torch.tanh(x @ w) @ w).sum()  # the second matmul saves w (its other input requires grad)
    with torch.no_grad():
        w.sub_(0.1 * torch.ones_like(w))  # an optimizer step before the backward
    loss.backward()
    return loss.detach()


def _leaf_written_not_saved(x, w):
    loss = (w * 2).sum()  # mul by a number saves nothing of w
    with torch.no_grad():
        w.sub_(0.1)
    loss.backward()
    return loss.detach()


def _write_after_backward(x, w):
    y = torch.tanh(x @ w)
    y.sum().backward()
    y.detach().mul_(2)
    return y.detach()


def _write_after_use_of_new_value(x, w):
    y = torch.tanh(x @ w)
    z = y.clone()
    z.detach().mul_(2)  # z was saved by nothing
    (z * 3).sum().backward()
    return z.detach()


def _not_on_backward_path(x, w):
    y = torch.tanh(x @ w)
    other = (x @ w).sum()
    y.detach().mul_(2)  # tanh is not on other's backward
    other.backward()
    return y.detach()


def _data_write_not_saved(x, w):
    h = x @ w  # matmul saves its inputs only
    h.data.mul_(2)
    h.sum().backward()
    return h.detach()


def _mul_by_itself(x, w):
    y = x @ w * 2
    y.mul_(y)  # mul_ saves its other argument, which its own write then changes
    y.sum().backward()
    return y.detach()


def _mul_by_its_detached_self(x, w):
    y = x @ w * 2
    y.mul_(y.detach())  # the same version counter
    y.sum().backward()
    return y.detach()


def _written_then_mul_by_its_detached_self(x, w):
    y = x @ w * 2
    y.add_(1)
    y.mul_(y.detach())
    y.sum().backward()
    return y.detach()


def _mul_by_its_clone(x, w):
    y = x @ w * 2
    y.mul_(y.clone())
    y.sum().backward()
    return y.detach()


def _rows_multiplied(x, w):
    y = x @ w * 2
    y[0] *= y[1]  # two views of one base: one counter
    y.sum().backward()
    return y.detach()


def _addcmul_by_itself(x, w):
    y = x @ w * 2
    y.addcmul_(y, x)  # saves its first tensor argument when the second requires grad: not here
    y.addcmul_(y, y)
    y.sum().backward()
    return y.detach()


def _divided_by_itself(x, w):
    y = x @ w + 5
    y.div_(y)
    y.sum().backward()
    return y.detach()


def _added_to_itself(x, w):
    y = x @ w * 2
    y += y  # add_ saves nothing
    y.sum().backward()
    return y.detach()


def _squared_in_place(x, w):
    y = x @ w * 2
    y.pow_(2)  # pow_ saves a copy of the old value, not the tensor
    y.sum().backward()
    return y.detach()


def _mul_by_itself_under_no_grad(x, w):
    y = x @ w * 2
    with torch.no_grad():
        y.mul_(y)
    y.sum().backward()
    return y.detach()


def _mul_by_itself_not_on_path(x, w):
    y = x @ w * 2
    z = (y * 3).sum()
    y.mul_(y)
    z.backward()
    return z.detach()


def _second_backward_after_dropout(x, w):
    h = x @ w
    a = torch.nn.functional.dropout(h, 0.5, training=True).sum()  # its first backward expands it into more lines
    c = torch.tanh(h * 2)
    c.detach().mul_(2)
    a.backward(retain_graph=True)
    c.sum().backward()
    return c.detach()


def _second_backward_after_dropout_unwritten(x, w):
    h = x @ w
    a = torch.nn.functional.dropout(h, 0.5, training=True).sum()
    c = torch.tanh(h * 2)
    a.backward(retain_graph=True)
    c.sum().backward()
    return c.detach()


def _softmax_written(x, w):
    y = torch.nn.functional.softmax(x @ w, -1)  # saves its output (F.softmax's own arguments: _stacklevel)
    y.detach().mul_(2)
    y.sum().backward()
    return y.detach()


def _log_softmax_with_dtype_written(x, w):
    y = torch.nn.functional.log_softmax(x @ w, -1, dtype=torch.float32)
    y.detach().mul_(2)
    y.sum().backward()
    return y.detach()


def _slices_of_a_written_matmul(x, w):
    h = x @ w
    y = h[:, 1:3] * 2  # slicing and multiplying by a number save nothing of h
    h.detach().mul_(2)
    y.sum().backward()
    return y.detach()


@torch.library.custom_op("tt_saved_versions::triple", mutates_args=())
def _triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


_triple.register_fake(lambda x: torch.empty_like(x))
_triple.register_autograd(lambda ctx, g: g * 3 + ctx.saved_tensors[0] * 0,
                          setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


def _custom_op_input_written(x, w):
    h = torch.tanh(x @ w)
    y = _triple(h)  # run opaquely, its gradient by torch's autograd: it saves h
    h.detach().mul_(2)
    y.sum().backward()
    return y.detach()


# An in-place activation saves its result (eager's leaky_relu_, elu_ and their inplace=True forms differentiate
# from it; the out-of-place forms save their input): a later in-place write of that result raises at the backward.
# The check asked the out-of-place form the line records and ran where eager raises.
def _leaky_relu_inplace_then_mul(x, w):
    y = torch.nn.functional.leaky_relu(x @ w, 0.1, inplace=True)
    y.mul_(2)
    y.sum().backward()
    return y.detach()


def _leaky_relu_underscore_then_add(x, w):
    y = torch.nn.functional.leaky_relu_(x @ w, 0.2)
    y.add_(1)
    y.sum().backward()
    return y.detach()


def _modules_inplace_leaky_relu_then_dropout(x, w):
    y = torch.nn.Dropout(0.2, inplace=True)(torch.nn.LeakyReLU(0.1, inplace=True)(x @ w))
    y.sum().backward()
    return y.detach()


def _elu_inplace_then_dropout(x, w):
    y = torch.nn.functional.dropout(torch.nn.functional.elu(x @ w, inplace=True), 0.2, inplace=True)
    y.sum().backward()
    return y.detach()


def _leaky_relu_inplace_then_out_of_place(x, w):
    y = torch.nn.functional.leaky_relu(x @ w, 0.1, inplace=True)
    z = y * 2  # nothing written after the in-place op
    z.sum().backward()
    return z.detach()


def _add_inplace_then_mul_inplace(x, w):
    y = (x @ w).add_(1)  # add_ saves nothing
    y.mul_(2)
    y.sum().backward()
    return y.detach()


def _hardtanh_inplace_then_mul(x, w):
    y = torch.nn.functional.hardtanh(x @ w, inplace=True)
    y.mul_(2)
    y.sum().backward()
    return y.detach()


CASES = [(_softmax_written, True), (_log_softmax_with_dtype_written, True), (_slices_of_a_written_matmul, False),
    (_custom_op_input_written, True), (_mul_by_itself, True), (_mul_by_its_detached_self, True), (_written_then_mul_by_its_detached_self, True), (_mul_by_its_clone, False),
    (_rows_multiplied, True), (_addcmul_by_itself, True), (_divided_by_itself, True), (_added_to_itself, False),
    (_squared_in_place, False), (_mul_by_itself_under_no_grad, False), (_mul_by_itself_not_on_path, False),
    (_second_backward_after_dropout, True), (_second_backward_after_dropout_unwritten, False),
    (_data_write_not_saved, False),
    (_tanh_detach, True), (_sigmoid_no_grad, True), (_exp_view, True), (_relu_inplace_after_sigmoid, True),
    (_relu_inplace_after_matmul, False), (_mul_input_written, True), (_data_write, False),
    (_data_saved_then_base_written, False), (_data_row_written, False), (_parameter_data_written, False),
    (_parameter_data_written_twice, False), (_output_data_assigned, False), (_input_data_assigned, False), (_data_assigned_saved_through_a_view, False),
    (_data_written_between_backwards, False), (_counter_moved_between_backwards, True),
    (_custom_op_backward_twice, False), (_ctc_input_written, True), (_ctc_input_written_after_backward, False),
    (_data_assigned_then_used, False), (_data_written_then_counter_moved, True), (_leaf_written_before_backward, True), (_leaf_written_not_saved, False),
    (_write_after_backward, False), (_write_after_use_of_new_value, False), (_not_on_backward_path, False),
    (_leaky_relu_inplace_then_mul, True), (_leaky_relu_underscore_then_add, True), (_modules_inplace_leaky_relu_then_dropout, True),
    (_elu_inplace_then_dropout, True), (_leaky_relu_inplace_then_out_of_place, False), (_add_inplace_then_mul_inplace, False),
    (_hardtanh_inplace_then_mul, False),
]


@pytest.mark.parametrize("fn,raises", CASES, ids=[f.__name__.strip("_") for f, _ in CASES])
def test_backward_inside_matches_eager(fn, raises):
    _same_as_eager(fn, raises)


def test_optimizer_step_before_backward_in_a_training_step():
    def step(model, opt, x):
        loss = model(x).tanh().sum()
        opt.step()  # parameters written in place (version bump) before the backward that needs them
        loss.backward()
        return loss

    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))  # the second saves its weight
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=MSG):
        step(m, opt, torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=MSG):
        tt.compile(step)(m, opt, torch.randn(2, 4))


class _Net(torch.nn.Module):
    """``write``: what the forward does before returning ``y = tanh(lin(x))`` (and ``h = lin(x)`` for ``out="yh"``)."""

    def __init__(self, write=None, out="y"):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.write, self.out = write, out

    def forward(self, x):
        y = torch.tanh(self.lin(x))
        h = self.lin(x)
        if self.write == "detach":
            y.detach().mul_(2)
        elif self.write == "data_unsaved":
            h.data.mul_(2)  # linear saves its inputs, not its output
        elif self.write == "square":
            h.mul_(h)  # mul_ saves its other argument: h itself
        elif self.write == "rows":
            h[0] *= h[1]
        elif self.write == "data":
            y.data.mul_(2)  # tanh saved y, returned: PyTorch's backward reads its new memory
        elif self.write == "weight_data":
            y = y @ self.lin.weight  # saves the weight
            self.lin.weight.data.mul_(0.5)
        elif self.write == "hidden_data":
            e = torch.exp(h)  # saves e, which is not returned
            e.data.mul_(2)
            y = y + e
        return y if self.out == "y" else (y, h)


@pytest.mark.parametrize("write,out,outside,loss,raises", [
    ("detach", "y", False, "y", True),  # inside the forward
    (None, "y", True, "y", True),  # after it, on the returned output (the node saved it: torch's own check)
    (None, "y", False, "y", False),
    ("data_unsaved", "yh", False, "y+h", False),
    ("detach", "yh", False, "h", False),  # backward through the other output only: eager runs
    ("detach", "yh", False, "y", True),
    ("detach", "yh", False, "y+h", True),
    ("detach", "yh", False, "h+0y", True),  # a zero gradient still goes through y
    ("square", "yh", False, "h", True),
    ("square", "yh", False, "y", False),
    ("rows", "yh", False, "y+h", True),
    ("rows", "yh", False, "y", False),
    ("data", "y", False, "y", False),
    ("data", "yh", False, "y+h", False),
    ("weight_data", "yh", False, "y+h", False),
    ("weight_data", "y", False, "y", False),
])
def test_backward_outside_matches_eager(write, out, outside, loss, raises):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    results = []
    for make in (lambda m: m, tt.compile):
        torch.manual_seed(0)
        net = _Net(write, out)
        f = make(net)
        try:
            res = f(x)
            y, h = (res, None) if out == "y" else res
            if outside:
                y.detach().mul_(2)
            total = {"y": lambda: y.sum(), "h": lambda: h.sum(), "y+h": lambda: y.sum() + h.sum(),
                     "h+0y": lambda: h.sum() + 0 * y.sum()}[loss]()
            total.backward()
            results.append((None, net.lin.weight.grad.clone()))
        except RuntimeError as e:
            results.append((e, None))
    (e_eager, g_eager), (e_tt, g_tt) = results
    if raises:
        assert e_eager is not None and e_tt is not None and MSG in str(e_tt), (e_eager, e_tt)
    else:
        assert e_eager is None and e_tt is None, (e_eager, e_tt)
        torch.testing.assert_close(g_tt, g_eager)


@pytest.mark.parametrize("thin", [False, True])
def test_compiled_module_raises_only_for_the_output_whose_backward_raises_on_every_call(thin):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = _Net("detach", "yh")
    torch.manual_seed(0)
    ref = _Net("detach", "yh")
    cm = tt.compile(net, thin=thin)
    for step in range(3):
        y, h = cm(x)
        ye, he = ref(x)
        (h * (step + 1)).sum().backward()
        (he * (step + 1)).sum().backward()
        torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)
        with pytest.raises(RuntimeError, match=MSG):
            cm(x)[0].sum().backward()
        with pytest.raises(RuntimeError, match=MSG):
            ref(x)[0].sum().backward()
    stats = tt.compile_stats(cm)
    assert stats.cache_misses == 1 and (not thin or stats.calls > stats.full_calls), stats


@pytest.mark.parametrize("thin", [False, True])
def test_compiled_module_follows_memory_written_through_data_it_does_not_return(thin):
    """Eager's backward reads what a saved, unreturned tensor's memory holds after the forward wrote it through
    ``.data`` (``e = exp(h); e.data.mul_(2)``): the compiled forward keeps that value for PyTorch's backward."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = _Net("hidden_data")
    torch.manual_seed(0)
    ref = _Net("hidden_data")
    cm = tt.compile(net, thin=thin)
    for step in range(3):
        y, ye = cm(x), ref(x)
        torch.testing.assert_close(y, ye)
        (y * (step + 1)).sum().backward()
        (ye * (step + 1)).sum().backward()
        torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)
        torch.testing.assert_close(net.lin.bias.grad, ref.lin.bias.grad)
    stats = tt.compile_stats(cm)
    assert stats.cache_misses == 1 and (not thin or stats.calls > stats.full_calls), stats


@pytest.mark.parametrize("thin", [False, True])
def test_training_step_writing_a_saved_weight_through_data_matches_eager(thin):
    def step(model, opt, x):
        loss = model(x).tanh().sum()  # the second Linear saves its weight
        model[2].weight.data.mul_(0.9)  # written through .data before the backward: eager's backward reads it
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def make():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    (m, opt), (me, opte) = make(), make()
    cstep = tt.compile(step, thin=thin)
    for i in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(i))
        torch.testing.assert_close(cstep(m, opt, x), step(me, opte, x))
        for p, pe in zip(m.parameters(), me.parameters()):
            torch.testing.assert_close(p, pe)
    stats = tt.compile_stats(cstep)
    assert stats.cache_misses == 1 and (not thin or stats.calls > stats.full_calls), stats


@pytest.mark.parametrize("thin", [False, True])
def test_compiled_module_weight_written_through_data_over_calls(thin):
    """The forward saves the weight, then halves it through ``.data``: PyTorch's backward reads the halved weight."""
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    net = _Net("weight_data")
    torch.manual_seed(0)
    ref = _Net("weight_data")
    cm = tt.compile(net, thin=thin)
    for _ in range(3):
        cm(x).sum().backward()
        ref(x).sum().backward()
        torch.testing.assert_close(net.lin.weight, ref.lin.weight)
        torch.testing.assert_close(net.lin.weight.grad, ref.lin.weight.grad)
        torch.testing.assert_close(net.lin.bias.grad, ref.lin.bias.grad)
    stats = tt.compile_stats(cm)
    assert stats.cache_misses == 1 and (not thin or stats.calls > stats.full_calls), stats


def _row_times_itself(y):
    y.mul_(y[0])  # y[0] partly overlaps y: eager refuses the op itself


def _shifted_add(y):
    y[1:].add_(y[:-1])


def _copy_partial(y):
    y[:, :2].copy_(y[:, 1:3])  # copy_ does not refuse


def _disjoint_rows(y):
    y[0].add_(y[1])


def _full_overlap(y):
    y.add_(y.detach())


def _where_out(y):
    with torch.no_grad():  # (with grad, eager refuses out= for a tensor that requires grad first)
        torch.where(y > 0, y[0], y, out=y)


def _lerp_to_a_row(y):
    y.lerp_(y[0], 0.5)


def _shifted_setitem(y):
    y[1:] = y[:-1]


def _masked_fill(y):
    y.masked_fill_(y > 0, 0.0)


OVERLAPS = [(_row_times_itself, True), (_shifted_add, True), (_copy_partial, False), (_disjoint_rows, False),
            (_full_overlap, False), (_where_out, True), (_lerp_to_a_row, True), (_shifted_setitem, True),
            (_masked_fill, False)]


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("op,raises", OVERLAPS, ids=[f.__name__.strip("_") for f, _ in OVERLAPS])
def test_inplace_op_on_a_partly_overlapping_argument_raises_at_the_op_as_eager(op, raises, grad):
    """Eager raises "refer to a single memory location" at the op, before anything after it: a step that catches it
    and takes another path computes as eager does, and the error names what to do."""
    def step(x, w):
        y = x @ w if grad else x.clone()
        try:
            op(y)
            path = 1
        except RuntimeError as e:
            assert "single memory location" in str(e) and "clone()" in str(e)
            y = y * 2
            path = 2
        if grad:
            y.sum().backward()
        return y.detach(), path

    x, w = _inputs()
    we = w.detach().clone().requires_grad_()
    (ref, path_e), (out, path_c) = step(x, we), tt.compile(step)(x, w)
    assert path_e == path_c == (2 if raises else 1)
    torch.testing.assert_close(out, ref)
    if grad:
        torch.testing.assert_close(w.grad, we.grad)


def test_a_kernel_reading_what_it_wrote_is_refused_and_the_generator_kept():
    """``y.bernoulli_(y[0])``: torch runs it (no overlap check) and its later rows read the probabilities it already
    wrote; a compiled program reads the old ones.  Refused with what to do, nothing changed; the probe that learns
    this draws nothing from the CPU generator.  With ``y[0].clone()`` both compute the same."""
    def overlapping(y):
        y.bernoulli_(y[0])
        return y * 1

    def cloned(y):
        y.bernoulli_(y[0].clone())
        return y * 1

    torch.manual_seed(0)
    y = torch.rand(3, 4)
    before, state = y.clone(), torch.get_rng_state()
    with pytest.raises(RuntimeError, match=r"partly overlaps.*Clone the argument first"):
        tt.compile(overlapping)(y)
    assert torch.equal(y, before) and torch.equal(torch.get_rng_state(), state)
    results = []
    for fn in (cloned, tt.compile(cloned)):
        torch.manual_seed(0)
        y = torch.rand(3, 4)
        results.append((fn(y), y.clone(), torch.get_rng_state()))
    (a, ya, sa), (b, yb, sb) = results
    assert torch.equal(a, b) and torch.equal(ya, yb) and torch.equal(sa, sb)
