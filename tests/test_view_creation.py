"""Views eager forbids writing into in place (acquisition/view_creation.py): the outputs of ``unbind`` / ``split`` /
``chunk`` / ``split_with_sizes`` and iteration, views of them, and views made under ``torch.no_grad()``.  In grad
mode, where the write's result requires grad, eager raises; the compiled function raised nothing and returned a
result (each raising case below returned one before).  Where eager allows the write, the values are eager's."""
import pytest
import torch

import thunder_train as tt


def _writing(into, name):
    """``b = w * 1``; ``into(b)`` writes in place into a view of ``b``; ``b.sum()``."""
    def fn(w):
        b = w * 1
        into(b)
        return b.sum()

    fn.__name__ = name
    return fn


_multi_unbind = _writing(lambda b: b.unbind(0)[0].mul_(2), "_multi_unbind")
_multi_split = _writing(lambda b: b.split(2)[0].add_(1), "_multi_split")
_multi_chunk = _writing(lambda b: b.chunk(2)[1].add_(1), "_multi_chunk")
_multi_split_with_sizes = _writing(lambda b: b.split_with_sizes([1, 2])[0].add_(1), "_multi_split_with_sizes")
_multi_iterated = _writing(lambda b: list(b)[0].add_(1), "_multi_iterated")
_view_of_a_multi_view = _writing(lambda b: b.unbind(0)[0][1:].add_(1), "_view_of_a_multi_view")
_unsafe_split = _writing(lambda b: b.unsafe_split(2)[0].add_(1), "_unsafe_split")
_tensor_split = _writing(lambda b: b.tensor_split(2)[0].add_(1), "_tensor_split")


def _multi_view_of_a_plain_tensor_written_with_a_grad(w):
    b = torch.ones(3, 4)
    b.unbind(0)[0].add_(w[0])
    return b.sum()


def _no_grad_view(w):
    b = w * 1
    with torch.no_grad():
        x = b[0]
    x.mul_(2)
    return b.sum()


def _no_grad_view_of_a_parameter(w):
    with torch.no_grad():
        x = w[0]
    x.mul_(2)
    return w.sum()


def _view_of_a_no_grad_view(w):
    b = w * 1
    with torch.no_grad():
        x = b[0]
    x[1:].mul_(2)
    return b.sum()


RAISING = [_multi_unbind, _multi_split, _multi_chunk, _multi_split_with_sizes, _multi_iterated, _view_of_a_multi_view,
           _multi_view_of_a_plain_tensor_written_with_a_grad, _no_grad_view, _no_grad_view_of_a_parameter,
           _view_of_a_no_grad_view]


def _written_under_no_grad(w):
    b = w * 1
    x = b.unbind(0)[0]
    with torch.no_grad():
        x.mul_(2)
    return b.sum()


def _multi_view_of_a_plain_tensor(w):
    b = torch.ones(3, 4)
    b.unbind(0)[0].add_(1)
    return (b * w).sum()


def _no_grad_view_of_a_plain_tensor(w):
    b = torch.ones(3, 4)
    with torch.no_grad():
        x = b[0]
    x.mul_(2)
    return (b * w).sum()


ALLOWED = [_written_under_no_grad, _unsafe_split, _tensor_split, _multi_view_of_a_plain_tensor, _no_grad_view_of_a_plain_tensor]


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("fn", RAISING, ids=lambda f: f.__name__)
def test_writes_eager_refuses_raise(fn, thin):
    w = torch.randn(3, 4, requires_grad=True)
    with pytest.raises(RuntimeError) as eager:
        fn(w)
    with pytest.raises(RuntimeError, match="eager PyTorch raises this error too") as compiled:
        tt.compile(fn, thin=thin)(w)
    # the same kind of refusal as eager's (a multi-output view, or a view made in no_grad mode)
    assert ("returns multiple views" in str(eager.value)) == ("returns multiple views" in str(compiled.value)) or \
        fn is _multi_view_of_a_plain_tensor_written_with_a_grad
    assert w.grad is None


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("fn", ALLOWED, ids=lambda f: f.__name__)
def test_writes_eager_allows_give_eagers_values(fn, thin):
    w = torch.randn(3, 4, requires_grad=True)
    want = fn(w)
    want.backward()
    want_grad, w.grad = w.grad, None
    cf = tt.compile(fn, thin=thin)
    for _ in range(2):
        got = cf(w)
        got.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(w.grad, want_grad)
        w.grad = None
