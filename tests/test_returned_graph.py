"""A step with ``loss.backward()`` inside returns tensors with eager's autograd flags (issue 25, autograd9 item 1).

Eager's returned loss requires grad and has a ``grad_fn``; a second ``loss.backward()`` raises eager's error for a
freed graph.  Logits computed before the backward, views of them, views of parameters, detached values, values
computed under ``no_grad`` and returned parameters are compared with eager: ``requires_grad``, ``is_leaf``,
``grad_fn is None``, ``_base`` sharing, what a later in-place write and a later backward do.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt

MODES = [dict(), dict(thin=True), dict(fusion=None)]


def flags(t):
    return (t.requires_grad, t.is_leaf, t.grad_fn is None)


def make():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def whole_step(m, opt):
    def step(x, y):
        logits = m(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            doubled = logits * 2
        after = m(x).sum()  # computed after the backward: eager could still differentiate it
        return {"loss": loss, "logits": logits, "row": logits[0], "detached": loss.detach(), "no_grad": doubled,
                "weight": m[0].weight, "weight_row": m[0].weight[1], "after": after}
    return step


def run(fn, calls=3):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g), torch.randint(0, 3, (5,), generator=g)
    for _ in range(calls):
        out = fn(x, y)
    return out


@pytest.mark.parametrize("opts", MODES)
def test_whole_step_returns_eager_flags(opts):
    me, oe = make()
    mc, oc = make()
    eager = run(whole_step(me, oe))
    compiled = run(tt.compile(whole_step(mc, oc), **opts))
    for k in eager:
        assert flags(compiled[k]) == flags(eager[k]), k
        torch.testing.assert_close(compiled[k], eager[k])
    assert compiled["weight"] is mc[0].weight
    # a view of a parameter is a view of it, as eager's
    assert compiled["weight_row"]._base is mc[0].weight and eager["weight_row"]._base is me[0].weight


@pytest.mark.parametrize("opts", MODES)
def test_second_backward_raises_eagers_error(opts):
    for fn in (whole_step(*make()), tt.compile(whole_step(*make()), **opts)):
        out = run(fn)
        with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
            out["loss"].backward()
        with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
            out["row"].sum().backward()


def test_backward_through_a_value_computed_after_the_inside_backward_is_refused_clearly():
    """Eager could differentiate it (its graph is new); the compiled program kept none: a clear error, not a wrong
    gradient."""
    out = run(tt.compile(whole_step(*make())))
    with pytest.raises(RuntimeError, match="keeps no autograd graph"):
        out["after"].backward()


@pytest.mark.parametrize("opts", MODES)
def test_backward_through_a_returned_view_of_a_parameter_reaches_its_grad(opts):
    (me, oe), (mc, oc) = make(), make()
    eager, compiled = run(whole_step(me, oe)), run(tt.compile(whole_step(mc, oc), **opts))
    eager["weight_row"].sum().backward()
    compiled["weight_row"].sum().backward()
    torch.testing.assert_close(mc[0].weight.grad, me[0].weight.grad)


@pytest.mark.parametrize("opts", MODES)
def test_in_place_writes_to_returned_views_as_eager(opts):
    """A view of a computed value may be written in place (the base sees it); a view of a parameter may not."""
    (me, oe), (mc, oc) = make(), make()
    eager, compiled = run(whole_step(me, oe)), run(tt.compile(whole_step(mc, oc), **opts))
    for out in (eager, compiled):
        out["row"].mul_(10)
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            out["weight_row"].add_(1)
        with pytest.raises(RuntimeError, match="a leaf Variable that requires grad"):
            out["weight"].add_(1)
    torch.testing.assert_close(compiled["logits"], eager["logits"])
    assert compiled["logits"]._version == eager["logits"]._version


def test_loss_returned_twice_is_one_object():
    m, opt = make()

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        return loss, loss

    a, b = run(tt.compile(step))
    assert a is b and a.requires_grad


def test_retain_graph_inside_refuses_a_later_backward_clearly():
    """Eager keeps the graph (retain_graph=True): a later backward would work there, the compiled one says why not."""
    m, opt = make()

    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward(retain_graph=True)
        return loss

    loss = run(tt.compile(step))
    assert flags(loss) == (True, False, False)
    with pytest.raises(RuntimeError, match="keeps no autograd graph"):
        loss.backward()


def test_autograd_grad_inside_returns_eager_flags():
    """torch.autograd.grad inside: the differentiated value has a grad_fn, the gradient none."""
    w = torch.randn(3, requires_grad=True)

    def f(x):
        with torch.enable_grad():
            y = (w * x).sum()
            (g,) = torch.autograd.grad(y, w)
        return y, g

    cf = tt.compile(f)
    x = torch.randn(3)
    y, g = cf(x)
    ye, ge = f(x)
    assert flags(y) == flags(ye) and flags(g) == flags(ge)


def test_forward_only_function_keeps_a_real_graph():
    """Without a backward inside, outputs still connect to PyTorch autograd and a backward outside works."""
    (me, _), (mc, _) = make(), make()
    x = torch.randn(5, 4)
    cm = tt.compile(mc)
    for _ in range(2):
        ye, yc = me(x), cm(x)
    assert flags(yc) == flags(ye)
    ye.sum().backward()
    yc.sum().backward()
    for pe, pc in zip(me.parameters(), mc.parameters()):
        torch.testing.assert_close(pc.grad, pe.grad)


def test_freed_graphs_gives_each_value_its_node_in_place():
    """The epilogue's prepared ``FreedGraphs`` (grouping found once): every value in its own position, through a node
    named as eager's, raising its own message; one object given twice comes back once, as eager returns it."""
    from thunder_train.compiler.acquisition.returned_graph import FreedGraphs

    a, b, c = torch.tensor(1.0), torch.tensor([2.0, 3.0]), torch.tensor(4.0)
    made = FreedGraphs(("first", "second", "third"), (("NllLossBackward0", "NllLossBackward0"), None,
                                                       ("NllLossBackward0", "NllLossBackward0")))
    for values in ((a, b, c), (a, b, a)):
        got = made(values)
        assert [type(t.grad_fn).__name__ for t in got] == ["NllLossBackward0", "FreedGraphBackward", "NllLossBackward0"]
        assert all(t.requires_grad and torch.equal(t, v) for t, v in zip(got, values))
        assert (got[0] is got[2]) == (values[0] is values[2])
        for t, message in zip(got, ("first", "second", "third")):
            with pytest.raises(RuntimeError, match="first" if t is got[0] else message):
                t.sum().backward()
    with torch.no_grad():  # grad mode is the caller's again afterwards
        made((a, b, c))
        assert not torch.is_grad_enabled()
