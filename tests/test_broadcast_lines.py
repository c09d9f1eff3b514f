"""A broadcast that only adds leading dims runs as one ``expand`` (executors/torch_executor.py's lowering of
``prims.broadcast_in_dim``), with the strides of the ``reshape`` + ``expand`` it replaces, in programs whose values
are eager's (a layer norm's weight over the batch's rows)."""
import torch
from hypothesis import given, settings, strategies as st

import thunder_train as tt
from thunder_train.compiler.executors.torch_impls import broadcast_in_dim


@st.composite
def _operand_and_shape(draw):
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    order = draw(st.permutations(range(len(sizes))))  # any dim order in memory
    a = torch.randn(*[sizes[i] for i in order]).permute(*[order.index(i) for i in range(len(sizes))])
    lead = draw(st.lists(st.integers(2, 4), min_size=1, max_size=2))
    return a, tuple(lead) + tuple(n if n != 1 else draw(st.integers(2, 3)) for n in sizes)


@settings(max_examples=200, deadline=None)
@given(_operand_and_shape())
def test_expand_adds_leading_dims_with_the_strides_of_reshape_and_expand(case):
    a, shape = case
    view = (1,) * (len(shape) - a.dim()) + tuple(a.shape)
    x, y = broadcast_in_dim(a, view, shape), a.expand(shape)
    assert (x.shape, x.stride(), x.storage_offset()) == (y.shape, y.stride(), y.storage_offset())
    assert torch.equal(x, y)


def test_a_layer_norm_weight_broadcast_is_one_expand_line_and_the_step_is_eagers():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(16) + 0.5)
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.lin(self.w * h)

    def step(m, x):
        loss = m(x).square().mean()
        loss.backward()
        return loss

    torch.manual_seed(0)
    eager, compiled = Block(), Block()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(3, 5, 16)
    cf = tt.compile(step, fusion=None)
    assert torch.equal(cf(compiled, x), step(eager, x))
    for a, b in zip(eager.parameters(), compiled.parameters()):
        assert torch.equal(a.grad, b.grad)
    program = str(tt.last_traces(cf)[-1])
    assert "torch.Tensor.expand(arg0_w, (3, 5, 16))" in program and "ttex.broadcast_in_dim(" not in program, program
