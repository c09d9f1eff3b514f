"""A slice of a zero pad that reads only the padded tensor's elements reads that tensor (executors/slices_of_pads.py):
the gradient of a slice is a pad, which the gradient of the op before slices again.  Values and gradients bitwise
eager's; a slice reaching into the padding keeps its pad."""
from __future__ import annotations

import torch
import torch.nn.functional as F

import thunder_train as tt


def _pads(cf) -> int:
    return sum(1 for line in tt.last_traces(cf)[-1].python_source().splitlines()
               if not line.lstrip().startswith("#") and "pad(" in line)


def _step(cut):
    def step(q, w):
        q = q.detach().requires_grad_()
        k = F.pad(q, (0, 8, 1, 0))  # (2, 4, 13, 16): a row of zeros on top, 8 zero columns on the right
        loss = (k[..., 1:, cut] * w).sum()
        loss.backward()
        return loss.detach(), q.grad
    return step


def test_the_slice_of_a_pad_reads_the_padded_tensor_and_the_gradient_is_eagers():
    q, w = torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
    step = _step(slice(0, 8))
    cf = tt.compile(step, fusion=None)
    for _ in range(2):
        got, want = cf(q, w), step(q, w)
        assert all(torch.equal(g, e) and g.stride() == e.stride() for g, e in zip(got, want))
    assert _pads(cf) == 0, tt.last_traces(cf)[-1].python_source()


def test_a_slice_reaching_into_the_padding_keeps_its_pad():
    q, w = torch.randn(2, 4, 12, 8), torch.randn(2, 4, 12, 8)
    step = _step(slice(4, 12))  # half of it is padding
    cf = tt.compile(step, fusion=None)
    for _ in range(2):
        got, want = cf(q, w), step(q, w)
        assert all(torch.equal(g, e) for g, e in zip(got, want))
    assert _pads(cf) >= 1


def test_a_part_of_the_padded_tensor_is_a_slice_of_it():
    def step(q, w):
        q = q.detach().requires_grad_()
        k = F.pad(q, (0, 8))
        loss = (k[..., 2:6] * w).sum()
        loss.backward()
        return loss.detach(), q.grad

    q, w = torch.randn(3, 8), torch.randn(3, 4)
    cf = tt.compile(step, fusion=None)
    for _ in range(2):
        got, want = cf(q, w), step(q, w)
        assert all(torch.equal(g, e) for g, e in zip(got, want))
    src = tt.last_traces(cf)[-1].python_source()
    assert "slice(2, 6" in src and _pads(cf) == 1, src  # the forward's pad is gone; the gradient's (of the slice) stays
