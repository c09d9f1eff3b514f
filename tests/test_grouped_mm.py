"""``torch._grouped_mm`` on the gradient path: run as torch runs it, its gradient by eager's formula as trace lines
(torchlang/grouped_mm.py), not inside torch's autograd.  Compared bitwise with eager's autograd for every operand
layout (an operand column-major in its last two dims gets its gradient computed transposed) and every operand
rank the op takes, in the torch program and thin; and the gradients' layouts."""
import pytest
import torch

import thunder_train as tt

OFFS = torch.tensor([3, 7, 7, 12], dtype=torch.int32)  # an empty group too

# (mat1 shape, mat2 shape, offs): the ranks the op takes (its kernel wants strides of whole 16 bytes)
SHAPES = {
    "2d x 3d": ((12, 8), (4, 8, 4), OFFS),  # tokens sorted by expert, one weight per expert (transformers' MoE)
    "3d x 2d": ((4, 8, 8), (8, 12), OFFS),  # groups along the output's columns
    "2d x 2d": ((8, 12), (12, 4), OFFS),  # groups along the contracted dim: one product per group
    "3d x 3d": ((4, 8, 8), (4, 8, 4), None),  # a batched product
}


def _laid_out(shape, column_major):
    t = torch.randn(*shape)
    return t.transpose(-2, -1).contiguous().transpose(-2, -1) if column_major else t


def _step(a, b, offs):
    out = torch._grouped_mm(a, b, offs=offs)
    loss = (out * out.cos()).sum()
    loss.backward()
    return loss


def _leaves(a, b, which):
    a, b = a.detach().clone(memory_format=torch.preserve_format), b.detach().clone(memory_format=torch.preserve_format)
    return a.requires_grad_("a" in which), b.requires_grad_("b" in which)


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("which", ["ab", "b"])
@pytest.mark.parametrize("layouts", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("case", list(SHAPES))
def test_gradients_are_eagers_bitwise_without_torch_autograd(case, layouts, which, thin):
    sa, sb, offs = SHAPES[case]
    torch.manual_seed(0)
    a0, b0 = _laid_out(sa, layouts[0]), _laid_out(sb, layouts[1])
    ea, eb = _leaves(a0, b0, which)
    ca, cb = _leaves(a0, b0, which)
    expected = _step(ea, eb, offs)
    cf = tt.compile(_step, fusion=None, thin=thin)
    for _ in range(2):  # the second call: thin's bound program
        ca.grad = cb.grad = None
        got = cf(ca, cb, offs)
    assert torch.equal(got, expected)
    for e, c in ((ea, ca), (eb, cb)):
        if e.requires_grad:
            assert torch.equal(c.grad, e.grad) and c.grad.stride() == e.grad.stride()
        else:
            assert c.grad is None
    program = "\n".join(str(t) for t in (*tt.last_traces(cf), *tt.last_backward_traces(cf)))
    assert "torch._grouped_mm(" in program and "_op_autograd" not in program and "autograd.vjp" not in program, program
    assert "torch._grouped_mm (gradient by its backward formula)" in tt.compile_stats(cf).opaque_ops


def test_a_call_the_formula_does_not_cover_keeps_torch_autograd():
    """A bias (not differentiated by eager either) or an output dtype: the op runs inside torch's autograd, as
    before; values still eager's."""
    a, b = torch.randn(12, 8), torch.randn(4, 8, 4)

    def step(a, b):
        out = torch._grouped_mm(a, b, OFFS, out_dtype=torch.float32)
        loss = out.square().sum()
        loss.backward()
        return loss

    ea, eb = a.clone().requires_grad_(), b.clone().requires_grad_()
    ca, cb = a.clone().requires_grad_(), b.clone().requires_grad_()
    step(ea, eb)
    cf = tt.compile(step, fusion=None)
    cf(ca, cb)
    assert torch.equal(ca.grad, ea.grad) and torch.equal(cb.grad, eb.grad)
    assert any("gradient by torch autograd" in n for n in tt.compile_stats(cf).opaque_ops)


def test_a_gradient_penalty_through_the_products_is_eagers():
    """``create_graph=True``: the backward's products are differentiated again, as eager's are (a gradient penalty
    through an expert layer); the rule's lines carry gradients, not constants."""
    a0, b0 = torch.randn(12, 8), torch.randn(4, 8, 4)

    def step(a, b):
        out = torch._grouped_mm(a, b, offs=OFFS)
        loss = (out * out.cos()).sum()
        (gb,) = torch.autograd.grad(loss, [b], create_graph=True)
        total = loss + gb.square().sum()
        total.backward()
        return total

    ea, eb = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    ca, cb = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    expected = step(ea, eb)
    got = tt.compile(step, fusion=None)(ca, cb)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(ca.grad, ea.grad)
    torch.testing.assert_close(cb.grad, eb.grad)


def test_output_layout_is_eagers_where_its_rows_are_padded():
    """Every ``_grouped_mm`` kernel pads the output's rows to whole 16 bytes: with 5 columns of float32 its row stride
    is 8.  The trace records that layout (it was taken row-major, stride 5), so later lines and the kept buffers'
    plan see the memory eager's output has; values as eager's (no gradient: eager's backward refuses such strides)."""
    offs = torch.tensor([16, 32, 40, 48], dtype=torch.int32)
    a, b = torch.randn(48, 32), torch.randn(4, 5, 32).transpose(-2, -1)

    def step(a, b):
        out = torch._grouped_mm(a, b, offs=offs)
        return out, (out * out.cos()).sum()

    expected = step(a, b)
    assert expected[0].stride() == (8, 1)
    cf = tt.compile(step, fusion=None)
    got = cf(a, b)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[0].stride() == (8, 1)
    line = next(b for b in tt.last_traces(cf)[-1].bound_symbols if "_grouped_mm" in b.sym.name)
    assert line.output._tt_strides == (8, 1), line.output._tt_strides
