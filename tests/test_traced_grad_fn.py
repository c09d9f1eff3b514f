"""``t.grad_fn`` and ``t.is_leaf`` inside a compiled function answer as eager (issue 25, autograd9 item 2).

Code that branches on ``t.grad_fn is None`` takes eager's path: a computed value that requires grad has a grad_fn
(a stand-in: reading from it is a clear error), a detached value, one computed under ``no_grad`` and a parameter
have none, a non-leaf input has its own.  The full prologue guards an input's ``is_leaf`` when the function read it.
"""
import pytest
import torch
import torch.nn as nn

import thunder_train as tt

MODES = [dict(), dict(thin=True)]


def probe(m, record):
    def f(x, xi):
        h = m(x)
        with torch.no_grad():
            n = h * 2
        values = {"x": x, "xi": xi, "w": m.weight, "h": h, "n": n, "d": h.detach(), "row": h[0], "g": xi * 2}
        for k, t in values.items():
            record[k] = (t.requires_grad, t.is_leaf, t.grad_fn is None)
        # a branch on grad_fn, as library code writes it
        scale = 2.0 if h.grad_fn is not None else 3.0
        return (h * scale).sum() + (xi.grad_fn is None) * xi.sum()
    return f


@pytest.mark.parametrize("opts", MODES)
def test_grad_fn_and_is_leaf_inside_match_eager(opts):
    torch.manual_seed(0)
    m = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    xi = torch.randn(3, requires_grad=True) * 1  # a non-leaf input
    eager, traced = {}, {}
    expected = probe(m, eager)(x, xi)
    cf = tt.compile(probe(m, traced), **opts)
    for _ in range(2):
        got = cf(x, xi)
    assert traced == eager
    torch.testing.assert_close(got, expected)


def test_reading_the_stand_in_node_is_a_clear_error():
    m = nn.Linear(4, 3)

    def f(x):
        h = m(x)
        return h.sum() if h.grad_fn.next_functions else h

    with pytest.raises(tt.TracingError, match="records no PyTorch autograd node"):
        tt.compile(f)(torch.randn(2, 4))


# ---- the stand-in node is named as eager's (issue 25, trust10 item 3) ----
def _values(lin, x):
    """Values of the kinds whose node code logs or branches on; each (name, make)."""
    def written(op):
        def make():
            h = lin(x)
            op(h)
            return h
        return make

    def under_no_grad():
        h = lin(x)
        with torch.no_grad():
            h.mul_(2)
        return h

    def view_then_base_written():
        h = lin(x)
        r = h[0:2]
        h.add_(1)
        return h.t()  # a view made after the write: its own op's node

    def row_after(write):
        def make():
            h = lin(x)
            r = h[0]
            write(h)
            return r
        return make

    def under_no_grad_of(h):
        with torch.no_grad():
            h.mul_(2)

    idx = torch.tensor([0, 2])
    return {
        # a view whose version counter moved since it was made: eager makes its node again (as_strided's)
        "row_after_base_write": row_after(lambda h: h.mul_(2)),
        "row_after_own_write": row_after(lambda h: h[0].add_(1)),
        "row_after_other_row_write": row_after(lambda h: h[1].add_(1)),
        "row_after_no_grad_write": row_after(under_no_grad_of),
        "row_after_data_write": row_after(lambda h: h.data.mul_(2)),  # .data has a counter of its own: Select
        "linear": lambda: lin(x),
        "linear_3d": lambda: lin(x.unsqueeze(0)),
        "row": lambda: lin(x)[0],
        "t": lambda: lin(x).t(),
        "view": lambda: lin(x).view(-1),
        "relu": lambda: torch.relu(lin(x)),
        "softmax": lambda: lin(x).softmax(-1),
        "sum": lambda: lin(x).sum(),
        "mean_dim": lambda: lin(x).mean(0),
        "piece": lambda: lin(x).split(1)[1],
        "cat": lambda: torch.cat([lin(x), lin(x)]),
        "to_double": lambda: lin(x).double(),
        "mul_": written(lambda h: h.mul_(2)),
        "relu_": written(torch.relu_),
        "setitem": written(lambda h: h.__setitem__(1, 0.0)),
        "setitem_index_tensor": written(lambda h: h.__setitem__(idx, 0.0)),
        "copy_": written(lambda h: h.copy_(x[:, :3])),
        "zero_": written(lambda h: h.zero_()),
        "masked_fill_": written(lambda h: h.masked_fill_(h > 0, 0.0)),
        "view_written": written(lambda h: h[0].mul_(2)),
        "data_written": written(lambda h: h.data.mul_(2)),
        "no_grad_written": under_no_grad,
        "view_after_write": view_then_base_written,
    }


def _names(lin, x, which):
    t = _values(lin, x)[which]()
    return type(t.grad_fn).__name__, t.grad_fn.name(), str(t.grad_fn is None)


@pytest.mark.parametrize("opts", [dict(), dict(thin=True), dict(fusion=None)], ids=str)
@pytest.mark.parametrize("which", list(_values(None, None)))
def test_the_node_of_a_computed_value_is_named_as_eager(which, opts):
    """``type(t.grad_fn).__name__`` and ``t.grad_fn.name()`` of a value computed inside, as eager's: a branch on the
    name takes eager's path (before, ``name()`` raised and the type was ``TracedGradFn``)."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(3, 4)
    expected = _names(lin, x, which)

    def f(x):
        names = _names(lin, x, which)
        return lin(x).sum() * (2.0 if names == expected else 3.0), names

    cf = tt.compile(f, **opts)
    for _ in range(3):
        loss, names = cf(x)
        assert names == expected
        torch.testing.assert_close(loss, f(x)[0])


def test_the_node_name_torch_cannot_be_asked_for_is_a_clear_error():
    """An op without a meta kernel (``ctc_loss``; the name is asked on meta tensors only): not answered, said so."""
    lin = nn.Linear(4, 3)

    def f(x):
        h = lin(x)
        logp = torch.zeros(6, 2, 3).add(h.sum()).log_softmax(-1)
        loss = nn.functional.ctc_loss(logp, torch.ones(2, 2, dtype=torch.long), torch.full((2,), 6), torch.full((2,), 2))
        return loss * (2.0 if type(loss.grad_fn).__name__ == "CtcLossBackward0" else 3.0)

    with pytest.raises(tt.TracingError, match="could not be asked"):
        tt.compile(f)(torch.randn(2, 4))


def test_a_module_forward_branching_on_its_nodes_name_takes_eagers_path():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            h = self.lin(x)
            return h * (2.0 if h.grad_fn.name() == "AddmmBackward0" else 3.0)

    torch.manual_seed(0)
    m = M()
    x = torch.randn(2, 4)
    got, exp = tt.compile(m)(x), m(x)
    torch.testing.assert_close(got, exp)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), m.lin.weight), torch.autograd.grad(exp.sum(), m.lin.weight))


def test_an_input_read_as_leaf_then_passed_as_non_leaf_retraces():
    """The trace specialised on ``xi.is_leaf``: a call with a non-leaf tensor there takes eager's other branch."""
    def f(xi):
        return xi * (2.0 if xi.is_leaf else 5.0)

    cf = tt.compile(f)
    leaf = torch.randn(3, requires_grad=True)
    torch.testing.assert_close(cf(leaf), f(leaf))
    non_leaf = leaf * 1
    torch.testing.assert_close(cf(non_leaf), f(non_leaf))
    torch.testing.assert_close(cf(leaf), f(leaf))


# ---- thin mode checks the flags the trace read (issue 25, trust10 item 1) ----
LEAFNESS_MODES = [dict(), dict(thin=True), dict(thin=True, fusion=None), dict(fusion=None)]
BRANCHES = {
    "is_leaf": lambda x: 2.0 if x.is_leaf else 5.0,
    "grad_fn is None": lambda x: 2.0 if x.grad_fn is None else 5.0,
    # the node's kind, as library code logs or branches on it: read from a real non-leaf input
    "type(grad_fn)": lambda x: {"NoneType": 2.0, "MulBackward0": 5.0}.get(type(x.grad_fn).__name__, 7.0),
    "grad_fn.name()": lambda x: 2.0 if x.grad_fn is None else (5.0 if x.grad_fn.name() == "MulBackward0" else 7.0),
}


def _inputs():
    w = torch.randn(3, requires_grad=True)
    return {"leaf": w, "mul": w * 2, "add": w + 1, "leaf2": torch.randn(3, requires_grad=True)}


@pytest.mark.parametrize("opts", LEAFNESS_MODES, ids=str)
@pytest.mark.parametrize("branch", list(BRANCHES))
def test_a_read_leafness_is_checked_on_every_call(opts, branch):
    """Called (thin: bound) with a leaf, then with non-leaf tensors of two kinds and back: every call takes eager's
    branch.  Before, thin mode kept the traced branch (no check of ``is_leaf`` once bound)."""
    decide = BRANCHES[branch]

    def f(x):
        return (x * decide(x)).sum()

    torch.manual_seed(0)
    xs = _inputs()
    cf = tt.compile(f, **opts)
    order = ["leaf"] * 3 + ["mul", "mul", "mul", "leaf", "leaf2", "add", "add", "mul", "leaf"]
    for k in order:
        x = xs[k]
        torch.testing.assert_close(cf(x), f(x), msg=f"{branch}, input {k}")
        gx, = torch.autograd.grad(cf(x), x)
        ex, = torch.autograd.grad(f(x), x)
        torch.testing.assert_close(gx, ex, msg=f"{branch}, grad, input {k}")


@pytest.mark.parametrize("thin", [False, True])
def test_a_compiled_module_reading_its_input_leafness_takes_eagers_branch(thin):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * (1.0 if x.grad_fn is None else -1.0)

    torch.manual_seed(0)
    m = M()
    cm = tt.compile(m, thin=thin)
    xs = _inputs()
    for k in ["leaf"] * 3 + ["mul"] * 3 + ["leaf"] * 2:
        x = xs[k]
        got, exp = cm(x), m(x)
        torch.testing.assert_close(got, exp, msg=k)
        g = torch.autograd.grad(got.sum(), [x, m.lin.weight])
        e = torch.autograd.grad(exp.sum(), [x, m.lin.weight])
        torch.testing.assert_close(g, e, msg=k)


def test_a_bound_tensor_whose_node_changed_between_calls_rebinds():
    """A static (module-held) non-leaf whose ``grad_fn`` the step read, changed in place between calls (its node
    changes, its metadata does not)."""
    torch.manual_seed(0)
    holder = nn.Module()
    w = torch.randn(3, requires_grad=True)
    holder.register_buffer("h", w * 2)  # a non-leaf the step reads

    def f(holder, x):
        return (x * (2.0 if type(holder.h.grad_fn).__name__ == "MulBackward0" else 5.0)).sum()

    cf = tt.compile(f, thin=True)
    x = torch.randn(3)
    for _ in range(3):
        torch.testing.assert_close(cf(holder, x), f(holder, x))
    holder.h.add_(1)  # now AddBackward0, same object, same metadata
    torch.testing.assert_close(cf(holder, x), f(holder, x))


def _returned_names(outs):
    return [(type(t.grad_fn).__name__, t.grad_fn.name()) if t.grad_fn is not None else None for t in outs]


@pytest.mark.parametrize("opts", [dict(), dict(thin=True), dict(fusion=None)], ids=str)
@pytest.mark.parametrize("backward_inside", [False, True])
def test_returned_nodes_are_named_as_eager(backward_inside, opts):
    """Returned values carry eager's node names: views made again outside the compiled node (``h[0]``, ``m.weight[1]``,
    a piece: before ``AsStridedBackward0``) and, for a step that calls ``backward()`` inside, the loss and values
    computed after it (before ``FreedGraphBackward``).  (A value computed inside and returned by a step without a
    backward inside comes out of the one compiled node: ``ThunderFunctionBackward``.)"""
    def run(f_or_compiled, m, opt, x, y):
        out = m(x)
        loss = nn.functional.cross_entropy(out, y)
        if backward_inside:
            loss.backward()
            opt.step()
            opt.zero_grad()
        return (loss, out, out[0], out.t(), m.weight[1], out.split(2, 1)[1], loss * 2)

    def make():
        torch.manual_seed(0)
        m = nn.Linear(4, 6)
        return m, torch.optim.SGD(m.parameters(), lr=0.1)

    x, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    me, oe = make()
    mc, oc = make()
    cf = tt.compile(lambda x, y: run(None, mc, oc, x, y), **opts)
    for _ in range(3):
        expected = _returned_names(run(None, me, oe, x, y))
        got = _returned_names(cf(x, y))
        if backward_inside:
            assert got == expected
        else:  # the views and pieces of the output and of the parameter
            assert got[2:6] == expected[2:6]
