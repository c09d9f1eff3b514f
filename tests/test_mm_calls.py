"""A matmul of two matrices is called as ``torch.mm`` (executors/mm_calls.py): eager's bits, in whole steps and
in ``tt.compile(model)``'s autograd forward and backward; other ranks keep ``torch.matmul``."""
import copy

import torch

import thunder_train as tt
from _steps import loss_step


class _Projections(torch.nn.Module):
    """``x @ W`` on a batch of rows (matrices) and a batched product of 3-d tensors."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(16, 32, generator=g) / 4)
        self.w2 = torch.nn.Parameter(torch.randn(32, 8, generator=g) / 6)
        self.w3 = torch.nn.Parameter(torch.randn(3, 8, 8, generator=g) / 3)

    def forward(self, x, seq):
        h = torch.tanh(x @ self.w1) @ self.w2
        return h.square().mean() + (seq @ self.w3).sin().mean()


def _inputs(g):
    return torch.randn(12, 16, generator=g), torch.randn(3, 5, 8, generator=g)


def _lines(trc, callable_name):
    return [line for line in str(trc).splitlines() if f"= {callable_name}(" in line and not line.lstrip().startswith("#")]


def test_a_step_of_matrix_products_calls_mm_with_eagers_bits():
    model, twin = _Projections(), _Projections()
    step = loss_step
    # SGD: its update is eager's bits too (AdamW runs torch's fused kernel, within an ulp of eager's loop)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9) for m in (model, twin)]
    cf = tt.compile(step, fusion=None)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, seq = _inputs(g)
        assert torch.equal(cf(model, opts[0], x, seq), step(twin, opts[1], x, seq))
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    final = tt.last_traces(cf)[-1]
    # the gradients' products of x @ w1 and h @ w2 are of matrices; the batched 3-d products keep matmul
    assert len(_lines(final, "torch.mm")) >= 4, final
    assert _lines(final, "torch.matmul"), final


def test_a_compiled_module_calls_mm_forward_and_backward_with_eagers_bits():
    model = _Projections()
    twin = copy.deepcopy(model)
    cm = tt.compile(model, fusion=None)
    g = torch.Generator().manual_seed(2)
    x, seq = _inputs(g)
    cm(x, seq).backward()
    twin(x, seq).backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a.grad, b.grad)
    assert _lines(tt.last_traces(cm)[-1], "torch.mm") and _lines(tt.last_backward_traces(cm)[-1], "torch.mm")
