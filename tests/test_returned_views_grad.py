"""Returned views that require grad take in-place writes as eager's do (issue 25, autograd9 item 3).

Eager lets the caller write in place into a returned view of a computed value (``h[0]``, ``h.t()``, ``h`` and
``h[0]`` both returned), and refuses it for a view of a parameter (``m.weight[0]``); gradients after the write follow
the write.  The compiled module's outputs come out of one autograd node, whose view outputs PyTorch would refuse to
write: views of computed values come out as tensors of their own, views of inputs or of other outputs are made again
outside the node.
"""
import pytest
import torch
import torch.nn as nn

import thunder_train as tt

MODES = [dict(), dict(thin=True), dict(fusion=None)]


class Views(nn.Module):
    def __init__(self, which):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.which = which

    def forward(self, x):
        h = self.lin(x)
        if self.which == "row_and_weight_row":
            return h[0], self.lin.weight[0]
        if self.which == "transposed":
            return h.t(), h.sum()
        if self.which == "base_and_row":
            return h, h[0]
        if self.which == "two_rows":  # two views of one value that is not returned
            return h[0], h[2:]
        return h.view(-1), self.lin.weight.t()


def writes_then_grads(m, f, x):
    f(x)
    outs = f(x)
    answers = []
    for o, k in zip(outs, (2.0, 3.0)):
        try:
            o.mul_(k)
            answers.append("written")
        except RuntimeError as e:
            answers.append(str(e).split(".")[0])
    weights = [torch.arange(o.numel(), dtype=o.dtype).view(o.shape) for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    return answers, [o.detach().clone() for o in outs], [p.grad for p in m.parameters()]


@pytest.mark.parametrize("opts", MODES)
@pytest.mark.parametrize("which", ["row_and_weight_row", "transposed", "base_and_row", "two_rows", "flat_and_weight_t"])
def test_in_place_writes_into_returned_views_as_eager(which, opts):
    x = torch.randn(5, 4)
    torch.manual_seed(0)
    me = Views(which)
    torch.manual_seed(0)
    mc = Views(which)
    answers, values, grads = writes_then_grads(me, me, x)
    c_answers, c_values, c_grads = writes_then_grads(mc, tt.compile(mc, **opts), x)
    assert c_answers == answers
    for a, b in zip(c_values + c_grads, values + grads):
        torch.testing.assert_close(a, b)


def test_a_returned_view_of_a_parameter_is_a_view_of_it():
    m = Views("row_and_weight_row")
    _, w0 = tt.compile(m)(torch.randn(5, 4))
    assert w0._base is m.lin.weight and w0.requires_grad and not w0.is_leaf
