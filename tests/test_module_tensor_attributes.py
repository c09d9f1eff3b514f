"""A module's plain tensor attribute (``self.mask = torch.ones(4)``: not a parameter or buffer) replaced between
steps, compared with eager in full mode, thin mode and ``tt.compile(model)``.

Before, the attribute was bound by reference to the tensor of the first call: a replaced tensor (another value, one
that requires grad) was silently ignored, so losses, parameters and ``.grad`` differed from eager's.  Now it is an
input like a buffer (compiler/acquisition/walker.py).  A backward inside the compiled function that reaches a
non-leaf input (an attribute or argument computed with grad outside) would have to go on into the graph that made
it: a clear error, with nothing changed (compiler/acquisition/traced_autograd.py)."""
import copy

import pytest
import torch
import torch.nn as nn

import thunder_train as tt
from _steps import squared_output_step
from thunder_train.compiler.errors import TracingError


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.mask = torch.ones(4)
        self.offset = torch.zeros(4, requires_grad=True)  # a leaf requiring grad, not registered

    def forward(self, x):
        return self.lin(x) * self.mask + self.offset


step = squared_output_step


def _compiled(mode, model):
    if mode == "module":
        cm = tt.compile(model)
        return lambda m, opt, x: step(cm, opt, x)
    return tt.compile(step, thin=mode == "thin")


def _same_grad(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


# Replacements made before each step, the same on the eager and the compiled model.
REPLACE = [
    None,
    lambda m: setattr(m, "mask", torch.full((4,), 2.0)),  # another value
    lambda m: setattr(m, "mask", torch.full((4,), 3.0, requires_grad=True)),  # now requires grad: gets a .grad
    lambda m: setattr(m, "offset", torch.full((4,), 0.5)),  # no longer requires grad
    lambda m: m.mask.data.mul_(0.5),  # changed in place
    lambda m: setattr(m, "mask", torch.full((4,), 1.5)),
]


@pytest.mark.parametrize("mode", ["full", "thin", "module"])
def test_replaced_tensor_attribute_is_read_as_eager(mode):
    torch.manual_seed(0)
    base = Masked()
    xs = [torch.randn(3, 4) for _ in REPLACE]
    want_m, got_m = copy.deepcopy(base), copy.deepcopy(base)
    want_opt, got_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (want_m, got_m))
    cstep = _compiled(mode, got_m)
    for i, (replace, x) in enumerate(zip(REPLACE, xs)):
        if replace is not None:
            replace(want_m), replace(got_m)
        want = step(want_m, want_opt, x)
        got = cstep(got_m, got_opt, x)
        assert torch.equal(got, want), i
        for (n, p), q in zip(want_m.named_parameters(), got_m.parameters()):
            assert torch.equal(q, p), (i, n)
        for name in ("mask", "offset"):
            assert _same_grad(getattr(got_m, name).grad, getattr(want_m, name).grad), (i, name)
            assert getattr(got_m, name).requires_grad == getattr(want_m, name).requires_grad, (i, name)


def test_attribute_computed_with_grad_outside_trains_as_eager_around_a_compiled_module():
    """tt.compile(model): PyTorch's backward runs after the call, so it goes on into the graph that computed the
    attribute, as eager's."""
    torch.manual_seed(0)
    base = Masked()
    x = torch.randn(3, 4)
    srcs = [torch.full((4,), 0.5, requires_grad=True) for _ in range(2)]
    models = [copy.deepcopy(base) for _ in range(2)]
    for m, src in zip(models, srcs):
        m.mask = src * 2
    models[0](x).sum().backward()
    tt.compile(models[1])(x).sum().backward()
    assert torch.equal(srcs[1].grad, srcs[0].grad)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(q.grad, p.grad)


@pytest.mark.parametrize("thin", [False, True])
def test_non_leaf_attribute_reached_by_a_backward_inside_is_a_clear_error(thin):
    torch.manual_seed(0)
    m = Masked()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    cstep = tt.compile(step, thin=thin)
    x = torch.randn(3, 4)
    for _ in range(3):  # traced (and bound) with leaves
        cstep(m, opt, x)
    src = torch.full((4,), 0.5, requires_grad=True)
    m.mask = src * 2
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(TracingError, match=r"args\[0\]\.mask is a non-leaf tensor .*tt\.compile\(model\)"):
        cstep(m, opt, x)
    assert src.grad is None
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), before))


@pytest.mark.parametrize("thin", [False, True])
def test_non_leaf_argument_after_leaves_is_a_clear_error(thin):
    def f(w, x):
        loss = (w * x).sum()
        loss.backward()
        return loss

    cf = tt.compile(f, thin=thin)
    w = torch.ones(4, requires_grad=True)
    for _ in range(3):
        cf(w, torch.full((4,), 0.5, requires_grad=True))
    src = torch.full((4,), 0.5, requires_grad=True)
    with pytest.raises(TracingError, match=r"args\[1\] is a non-leaf tensor"):
        cf(w, src * 2)
    assert src.grad is None
    assert torch.equal(w.grad, torch.full((4,), 1.5))
