"""In-place writes into returned pieces of ``split``/``unbind``/``chunk`` and into returned views that may share
elements act as eager's (issue 25, trust10 item 2).

Eager refuses an in-place write into a piece of a call returning several views (``h.split(2)[0].mul_(2)``: "Output 0
of Split is a view ... returns multiple views"), also into a view of a piece, and allows one into views of a computed
value that share elements (``h[0]`` with ``h.t()``).  Before, one returned piece took the write and two pieces, or two
views sharing elements, got the custom Function's error.  Values, the caller's writes and gradients after them are
compared with eager, for ``tt.compile(model)``, ``tt.compile(f)``, thin mode and ``fusion=None``.
"""
import pytest
import torch
import torch.nn as nn

import thunder_train as tt

MODES = [dict(), dict(thin=True), dict(fusion=None), dict(thin=True, fusion=None)]

CASES = {
    "split_one": lambda h: (h.split(2, dim=1)[0],),
    "split_two": lambda h: h.split(2, dim=1)[:2],
    "split_rows": lambda h: h.split(2)[1:],
    "split_sizes": lambda h: (h.split([1, 5], dim=1)[1],),
    "unbind_one": lambda h: (h.unbind(0)[1],),
    "unbind_all": lambda h: h.unbind(1),
    "chunk_one": lambda h: (h.chunk(3, dim=1)[1],),
    "chunk_all": lambda h: h.chunk(3, dim=1),
    "tensor_split": lambda h: h.tensor_split([1, 3], dim=0),
    "view_of_piece": lambda h: (h.split(2, dim=1)[1][1:].t(),),
    "piece_and_sum": lambda h: (h.chunk(2)[0], h.sum()),
    "unsafe_split": lambda h: h.unsafe_split(2, dim=1),  # eager: not views, writes allowed
    # views that may share elements: eager allows the writes
    "row_and_t": lambda h: (h[0], h.t()),
    "rows_overlapping": lambda h: (h[1:], h[:-1]),
    "row_t_and_sum": lambda h: (h[0], h.t(), h.sum()),
    "col_and_row": lambda h: (h[:, 1], h[2], h[1:3, 2:5]),
}


class M(nn.Module):
    def __init__(self, which):
        super().__init__()
        self.lin = nn.Linear(4, 6)
        self.which = which

    def forward(self, x):
        return CASES[self.which](self.lin(x))


def writes_then_grads(m, f, x):
    f(x)
    outs = f(x)
    answers = []
    for k, o in enumerate(outs):
        try:
            o.mul_(2.0 + k)
            answers.append("written")
        except RuntimeError as e:
            answers.append(str(e).split(".")[0])
    weights = [torch.arange(o.numel(), dtype=o.dtype).view(o.shape) + 1 for o in outs]
    sum((o * w).sum() for o, w in zip(outs, weights)).backward()
    return answers, [o.detach().clone() for o in outs], [p.grad for p in m.parameters()]


@pytest.mark.parametrize("opts", MODES, ids=str)
@pytest.mark.parametrize("which", list(CASES))
def test_writes_into_returned_pieces_and_views_as_eager(which, opts):
    x = torch.randn(5, 4)
    torch.manual_seed(0)
    me = M(which)
    torch.manual_seed(0)
    mc = M(which)
    answers, values, grads = writes_then_grads(me, me, x)
    c_answers, c_values, c_grads = writes_then_grads(mc, tt.compile(mc, **opts), x)
    assert c_answers == answers
    for a, b in zip(c_values + c_grads, values + grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("opts", MODES[:2], ids=str)
@pytest.mark.parametrize("which", ["split_one", "chunk_all", "view_of_piece", "row_and_t", "unsafe_split"])
def test_a_compiled_function_returning_pieces_of_a_value_or_input_as_eager(which, opts):
    """``tt.compile(f)``; the pieces of a computed value, and of a non-leaf input (made again from the input)."""
    torch.manual_seed(0)
    w = torch.randn(5, 6, requires_grad=True)
    we = w.detach().clone().requires_grad_()

    def f(x):
        return CASES[which](x * 1.5) + CASES[which](x)

    # The input's pieces are views of the non-leaf input in eager: a write into one is refused as well.
    e_ans, e_vals, _ = writes_then_grads(nn.Module(), f, we * 1)
    e_grad = we.grad
    c_ans, c_vals, _ = writes_then_grads(nn.Module(), tt.compile(f, **opts), w * 1)
    assert c_ans == e_ans
    for a, b in zip(c_vals, e_vals):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(w.grad, e_grad)


def test_pieces_without_grad_take_writes_as_eager():
    lin = nn.Linear(4, 6)

    def f(x):
        return lin(x).split(2, dim=1)

    cf = tt.compile(f)
    with torch.no_grad():
        outs = cf(torch.randn(5, 4))
        for o in outs:
            o.mul_(2)  # eager allows it: no graph
    assert not any(o.requires_grad for o in outs)


@pytest.mark.parametrize("opts", MODES[:2], ids=str)
@pytest.mark.parametrize("which", ["split_one", "chunk_all", "view_of_piece", "piece_and_sum", "unsafe_split"])
def test_a_step_with_a_backward_inside_returns_pieces_as_eager(which, opts):
    """After ``loss.backward()`` inside, returned pieces: a write into one is eager's error for one of several views
    (before, the piece came back as a tensor of its own and took the write), values and node names as eager's."""
    def make():
        torch.manual_seed(0)
        return M(which)

    def step(m, x):
        h = m.lin(x)
        h.pow(2).sum().backward()
        return (h,) + CASES[which](h)

    x = torch.randn(5, 4)
    me, mc = make(), make()
    cf = tt.compile(step, **opts)
    for _ in range(2):
        e_outs, c_outs = step(me, x), cf(mc, x)
        for a, b in zip(c_outs, e_outs):
            torch.testing.assert_close(a, b)
            assert type(a.grad_fn).__name__ == type(b.grad_fn).__name__
        e_ans, c_ans = [], []
        for outs, ans in ((e_outs, e_ans), (c_outs, c_ans)):
            for o in outs[1:]:
                try:
                    o.mul_(2.0)
                    ans.append("written")
                except RuntimeError as e:
                    ans.append(str(e).split(".")[0])
        assert c_ans == e_ans
        for a, b in zip(c_outs, e_outs):
            torch.testing.assert_close(a, b)
