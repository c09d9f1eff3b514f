"""Per-call questions answered once from the traced layouts (executors/decided_layouts.py) and views of kept
buffers made once per buffer set (executors/buffers.py): the values stay eager's, the decisions are checked
against what the program meets (``VERIFY_DECIDED_LAYOUTS``), and a layout that changes under a thin binding
(``.data =`` on optimizer state) is caught before the program runs on it."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import _zoo
import thunder_train as tt
from thunder_train.compiler import pipeline
from thunder_train.compiler.executors import torch_impls


@pytest.fixture
def verify(monkeypatch):
    monkeypatch.setattr(torch_impls, "VERIFY_DECIDED_LAYOUTS", True)


def step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def source(cf) -> str:
    return tt.last_traces(cf)[-1].python_source()


def transposed_model():
    """A model with a column-major weight (dense, not contiguous: its gradient must be laid out like it, and the
    fused AdamW kernel walks all four of its tensors as one flat array)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    m[0].weight = nn.Parameter(m[0].weight.detach().t().contiguous().t())
    return m


def assert_same_training(model, make_opt, batches, monkeypatch):
    """Eager (within the tolerances of the other training tests: the program's kernels are not all eager's), and
    the program with its questions decided bitwise the same as the one that asks them every call."""
    eager, decided, asking = model, copy.deepcopy(model), copy.deepcopy(model)
    opts = [make_opt(m) for m in (eager, decided, asking)]
    cf = tt.compile(step, thin=True, fusion=None)
    with monkeypatch.context() as m:
        m.setattr(pipeline, "decide_layouts", lambda trc: trc)
        reference = tt.compile(step, thin=True, fusion=None)
        for x, y in batches[:3]:  # traced (and bound) without the decisions
            reference(asking, opts[2], x, y)
    for x, y in batches[:3]:
        want = step(eager, opts[0], x, y)
        got = cf(decided, opts[1], x, y)
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=1e-5)
    for x, y in batches[3:]:
        want = step(eager, opts[0], x, y)
        assert torch.equal(cf(decided, opts[1], x, y), reference(asking, opts[2], x, y))
    assert "grad_layout(" in source(reference) and "odd=" not in source(reference)
    for (k, a), b, c in zip(decided.state_dict().items(), asking.state_dict().values(), eager.state_dict().values()):
        assert torch.equal(a, b) and a.stride() == b.stride() == c.stride(), k
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)
    for pa, pb in zip(decided.parameters(), asking.parameters()):
        for (k, a), b in zip(opts[1].state[pa].items(), opts[2].state[pb].values()):
            assert torch.equal(a, b), k
    return cf


def batches(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("make_opt", [lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
                                      lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)],
                         ids=["adamw", "sgd"])
def test_decided_program_is_bitwise_the_asking_one_with_a_column_major_weight(verify, make_opt, monkeypatch):
    cf = assert_same_training(transposed_model(), make_opt, batches(), monkeypatch)
    src = source(cf)
    assert "ttex.grad_layout_decided(" in src  # verify mode keeps the decided lines as checking ones
    assert "odd=()" in src  # the transposed weight's gradient is laid out like it: every index is alike


class _ColumnMajorScale(nn.Module):
    """A column-major parameter multiplied elementwise by a row-major input: its gradient comes out row-major."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.rand(6, 8).t() + 0.5)

    def forward(self, x):
        return x * self.s


def test_identity_grad_layout_lines_are_dropped_and_the_layout_comparison_is_decided(monkeypatch):
    model = transposed_model()
    model.insert(0, _ColumnMajorScale())
    cf = assert_same_training(model, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), batches(), monkeypatch)
    src = source(cf)
    # Only the scale's gradient (computed row-major) is copied, by a copy decided from the traced layouts
    # (ttex.grad_copy: no layout questions on each call); the column-major linear weight's gradient is made
    # column-major, as eager's mm backward makes it, and the others are their gradients.
    assert "ttex.grad_layout(" not in src and src.count("ttex.grad_copy(") == 1 and "odd=()" in src
    assert "ttex.foreach_add_same_(" in src  # the step counters: CPU float32, + 1


def test_an_unlike_gradient_is_copied_and_decided_odd(verify):
    """A gradient assigned by hand in another layout than its parameter's: the parameter's tensors run on
    row-major copies, decided from the traced layouts."""
    def hand_grad(model, opt, x):
        w = model.weight
        w.grad = (x.t() @ x)[: w.shape[1], : w.shape[0]].t()  # a transposed view: not the weight's layout
        model.bias.grad = x.sum(0)[: w.shape[0]]
        opt.step()
        return w.sum()

    torch.manual_seed(0)
    eager = nn.Linear(4, 4)
    compiled = copy.deepcopy(eager)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    cf = tt.compile(hand_grad, thin=True, fusion=None)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(8, 4, generator=g)
        torch.testing.assert_close(cf(compiled, opts[1], x), hand_grad(eager, opts[0], x).detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager.weight, compiled.weight, atol=1e-5, rtol=1e-5)
    assert "odd=(0,)" in source(cf)


def test_optimizer_state_given_another_layout_under_a_thin_binding_is_caught():
    """``exp_avg.data = t`` keeps the bound object but changes its layout, which the decided fused-kernel call
    assumed: thin mode's metadata check sees it and re-validates, and the step stays eager's."""
    model = transposed_model()
    eager, compiled = model, copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
    cf = tt.compile(step, thin=True, fusion=None)
    data = batches(6)
    for x, y in data[:3]:
        step(eager, opts[0], x, y)
        cf(compiled, opts[1], x, y)
    assert cf.is_thin_bound
    for m, opt in zip((eager, compiled), opts):
        st = opt.state[m[2].weight]["exp_avg"]
        st.data = st.detach().t().contiguous().t()  # same values, column-major
    for x, y in data[3:]:
        torch.testing.assert_close(cf(compiled, opts[1], x, y), step(eager, opts[0], x, y).detach(), atol=1e-5, rtol=1e-5)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert tt.compile_stats(cf).thin_invalidations


def test_views_of_kept_buffers_are_made_once_per_set_and_values_stay_eager(verify, monkeypatch):
    """Transposes, reshapes and slices of intermediates (attention heads, the backward's transposed matmul
    operands) become ``t = _b[k]``; a reshape that has to copy stays a line."""
    from thunder_train.compiler.executors import buffers

    monkeypatch.setattr(buffers, "_slack", lambda natural: buffers.PEAK_SLACK)  # a step this tiny keeps its buffers
    def attn_step(w, x):
        h = (x @ w).view(2, 6, 2, 4).transpose(1, 2)  # a view of a kept buffer
        flat = h.reshape(2, 2, 24)  # not viewable: copies
        s = (h[..., :2] * h[..., 2:]).sum() + flat.sin().sum()
        s.backward()
        return s, w.grad

    torch.manual_seed(0)
    w = torch.randn(5, 8, requires_grad=True)
    x = torch.randn(2, 6, 5)
    cf = tt.compile(attn_step, thin=True, fusion=None)
    for _ in range(3):
        w.grad = None
        want = attn_step(w, x)
        w.grad = None
        got = cf(w, x)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    src = source(cf)
    assert "made with the buffers" in src
    assert "torch.reshape(" in src or "Tensor.reshape(" in src  # the copying reshape runs every call


@pytest.mark.parametrize("name", ["llama", "gpt2", "resnet", "falcon"])
def test_zoo_steps_with_checked_decisions(verify, name):
    eager = _zoo.build(name)
    compiled = copy.deepcopy(eager)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, compiled)]
    cf = tt.compile(_zoo.train_step, thin=True, fusion=None)
    for b in _zoo.batches(name, 4):
        torch.testing.assert_close(cf(compiled, opts[1], b), _zoo.train_step(eager, opts[0], b), rtol=1e-4, atol=1e-5)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # GPT-2's tiny step keeps no buffers: each would raise its planned peak (buffers.PEAK_SLACK); nor does ResNet's
    # since its batch norms' running statistics are written back before the backward (reinplace._early_write_backs)
    if name not in ("gpt2", "resnet"):
        assert "made with the buffers" in source(cf)
    if name == "falcon":  # its weights are used as W.T: their gradients made row-major as eager's mm backward makes them
        src = source(cf)
        assert "ttex.grad_layout(" not in src and "ttex.grad_copy(" not in src


FUSED_OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-1, fused=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-1, fused=True),
}


def _replace_with_transposed(model):
    g = torch.Generator().manual_seed(7)
    w = model[0].weight
    model[0].weight.data = torch.randn(w.shape[1], w.shape[0], generator=g).t()  # column-major, new values


@pytest.mark.parametrize("thin", [True, False], ids=["thin", "full"])
@pytest.mark.parametrize("name", sorted(FUSED_OPTIMIZERS))
def test_fused_kernel_on_a_parameter_replaced_by_a_transposed_tensor_is_refused(name, thin):
    """``p.data = w.t()`` after the optimizer's state exists (issue 25, item 4): the state stays row-major while the
    parameter (and its gradient) are column-major.  Eager's fused kernel walks them as flat arrays of memory and
    pairs unrelated elements; the compiled step refuses instead of computing another update than eager's, names
    what to do, and leaves the model and the optimizer as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    opt = FUSED_OPTIMIZERS[name](model.parameters())
    cf = tt.compile(step, thin=thin)
    data = batches(3)
    cf(model, opt, *data[0])
    _replace_with_transposed(model)
    params = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for p in model.parameters() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    with pytest.raises(NotImplementedError, match=r"fused=True.*do not share one dense layout.*contiguous\(\).*fused=False"):
        cf(model, opt, *data[1])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    assert all(p.grad is None for p in model.parameters())
    after = {k: v for p in model.parameters() for k, v in opt.state[p].items() if torch.is_tensor(v)}
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    model[0].weight.data = model[0].weight.detach().contiguous()  # the remedy the error names
    eager, eager_opt = copy.deepcopy((model, opt))  # one memo: the copied optimizer holds the copied parameters
    for x, y in data[1:]:
        torch.testing.assert_close(cf(model, opt, x, y), step(eager, eager_opt, x, y).detach(), atol=1e-6, rtol=1e-6)
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("thin", [True, False], ids=["thin", "full"])
@pytest.mark.parametrize("name", ["adamw", "sgd", "adam_for_loop"])
def test_default_optimizer_on_a_parameter_replaced_by_a_transposed_tensor_trains_as_eager(name, thin):
    """The same replacement with the optimizers' default (per-op) implementations, which the program runs on torch's
    fused kernels with the unlike parameter on row-major copies: eager's values."""
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-1), "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-1, momentum=0.9),
            "adam_for_loop": lambda ps: torch.optim.Adam(ps, lr=1e-1, foreach=False)}[name]
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    compiled = copy.deepcopy(eager)
    opts = [make(m.parameters()) for m in (eager, compiled)]
    cf = tt.compile(step, thin=thin)
    for i, (x, y) in enumerate(batches(5)):
        if i == 2:
            _replace_with_transposed(eager)
            _replace_with_transposed(compiled)
        torch.testing.assert_close(cf(compiled, opts[1], x, y), step(eager, opts[0], x, y).detach(), atol=1e-6, rtol=1e-6)
    for a, b in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert a.stride() == b.stride()
