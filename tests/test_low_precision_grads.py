"""Gradients of half and bfloat16 ops whose derivative reads their result (tanh, sigmoid, exp, sqrt, ...).

A low-precision op computes in float32 and rounds; eager's derivative reads the rounded result.  Differentiating
the decomposition read the float32 result before rounding: fp16 tanh's gradient differed from eager's in ~40 % of
elements by an ulp, and a half-precision MLP's parameters drifted from eager's (torchlang/elementwise.py,
``_ROUNDED_RESULT_VJP``).  Compared bitwise with eager."""
import copy

import pytest
import torch

import thunder_train as tt
from _steps import squared_output_step

OPS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
       "sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tan": torch.tan, "reciprocal": torch.reciprocal,
       "erfinv": torch.erfinv}


def _input(name, dtype):
    x = torch.rand(1000, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05
    if name == "tan":
        x = x - 0.5
    if name == "erfinv":
        x = x * 2 - 1
    return x.to(dtype)


@pytest.mark.parametrize("fusion", [None, "background"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(OPS))
def test_gradient_reads_the_rounded_result_as_eager(name, dtype, fusion):
    op = OPS[name]
    g = torch.randn(1000, generator=torch.Generator().manual_seed(1)).to(dtype)

    def f(x, g):
        y = op(x)
        (y * g).sum().backward()
        return y

    want_x, got_x = (_input(name, dtype).requires_grad_() for _ in range(2))
    want = f(want_x, g)
    got = tt.compile(f, fusion=fusion)(got_x, g)
    assert torch.equal(got, want)
    assert torch.equal(got_x.grad, want_x.grad), (got_x.grad != want_x.grad).sum()


def _assert_trains_as_eager(cstep, models, opts, xs):
    """The compiled step on ``models[1]`` gives eager's loss and parameters, bit for bit, after every step."""
    for x in xs:
        want = squared_output_step(models[0], opts[0], x)
        got = cstep(models[1], opts[1], x)
        assert torch.equal(got, want)
        for (n, p), q in zip(models[0].named_parameters(), models[1].parameters()):
            assert torch.equal(q, p), n


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_mlp_trains_as_eager(dtype, thin):
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8), torch.nn.Sigmoid()).to(dtype)
    xs = [torch.randn(4, 16).to(dtype) for _ in range(3)]

    models = [copy.deepcopy(base) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    cstep = tt.compile(squared_output_step, thin=thin, fusion=None)
    _assert_trains_as_eager(cstep, models, opts, xs)


# Ops whose eager derivative formula rounds after each op (compiler/torchlang/low_precision_grads.py) and whose
# forward eager computes in a way a single float32 rounding does not reproduce (prod multiplies in its dtype,
# logaddexp rounds once, ``1 / x`` is ``x.reciprocal() * 1``).  Each failed on the old code (ulps in 5-45 % of
# the elements).
def _uniform(lo, hi, seed):
    return torch.rand(600, generator=torch.Generator().manual_seed(seed)) * (hi - lo) + lo


ROUNDED_PER_OP = {
    "div": (lambda a, b: a / b, [(0.2, 2.0), (0.2, 2.0)]),
    "div_broadcast": (lambda a, b: a.view(20, 30) / b.view(20, 30)[:1], [(0.2, 2.0), (0.2, 2.0)]),
    "pow": (torch.pow, [(0.2, 2.0), (-2.0, 2.0)]),
    "pow_number_exponent": (lambda a: a ** 1.7, [(0.2, 2.0)]),
    "pow_number_base": (lambda b: 1.7 ** b, [(-2.0, 2.0)]),
    "rdiv": (lambda a: 3.0 / a, [(0.2, 2.0)]),
    "atan2": (torch.atan2, [(-2.0, 2.0), (-2.0, 2.0)]),
    "hypot": (torch.hypot, [(-2.0, 2.0), (-2.0, 2.0)]),
    "logaddexp": (torch.logaddexp, [(-3.0, 3.0), (-3.0, 3.0)]),
    "logaddexp2": (torch.logaddexp2, [(-3.0, 3.0), (-3.0, 3.0)]),
    "sinh": (torch.sinh, [(-3.0, 3.0)]),
    "cosh": (torch.cosh, [(-3.0, 3.0)]),
    "sin": (torch.sin, [(-3.0, 3.0)]),
    "cos": (torch.cos, [(-3.0, 3.0)]),
    "asin": (torch.asin, [(-0.9, 0.9)]),
    "acos": (torch.acos, [(-0.9, 0.9)]),
    "atan": (torch.atan, [(-3.0, 3.0)]),
    "asinh": (torch.asinh, [(-3.0, 3.0)]),
    "acosh": (torch.acosh, [(1.1, 3.0)]),
    "atanh": (torch.atanh, [(-0.9, 0.9)]),
    "log1p": (torch.log1p, [(-0.5, 3.0)]),
    "log2": (torch.log2, [(0.1, 3.0)]),
    "log10": (torch.log10, [(0.1, 3.0)]),
    "erf": (torch.erf, [(-2.0, 2.0)]),
    "erfc": (torch.erfc, [(-2.0, 2.0)]),
    "lgamma": (torch.lgamma, [(0.1, 3.0)]),
    "logsigmoid": (torch.nn.functional.logsigmoid, [(-4.0, 4.0)]),
    "softsign": (torch.nn.functional.softsign, [(-3.0, 3.0)]),
    "vector_norm": (lambda a: torch.linalg.vector_norm(a.view(20, 30), dim=1), [(-2.0, 2.0)]),
    "vector_norm_3": (lambda a: torch.linalg.vector_norm(a.view(20, 30), 3, dim=0, keepdim=True), [(-2.0, 2.0)]),
    "norm_1_5": (lambda a: a.view(20, 30).norm(1.5, dim=1), [(-2.0, 2.0)]),
    "norm_0_5": (lambda a: torch.norm(a.view(20, 30), 0.5, dim=1), [(-2.0, 2.0)]),
    "prod": (lambda a: a.view(120, 5).prod(1), [(0.5, 1.5)]),
    "prod_all": (lambda a: a[:30].prod(), [(0.5, 1.5)]),
}


@pytest.mark.parametrize("fusion", [None, "background"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(ROUNDED_PER_OP))
def test_formula_rounds_per_op_as_eager(name, dtype, fusion):
    op, ranges = ROUNDED_PER_OP[name]

    def f(*args):
        y = op(*args[:-1])
        (y * args[-1]).sum().backward()
        return y

    def inputs():
        return [_uniform(lo, hi, i).to(dtype).requires_grad_() for i, (lo, hi) in enumerate(ranges)]

    shape = op(*[x.detach() for x in inputs()]).shape
    g = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    want_in, got_in = inputs(), inputs()
    want = f(*want_in, g)
    got = tt.compile(f, fusion=fusion)(*got_in, g)
    assert torch.equal(got, want), (got != want).sum()
    for i, (a, b) in enumerate(zip(got_in, want_in)):
        assert torch.equal(a.grad, b.grad), (i, (a.grad != b.grad).sum())


class _Mixed(torch.nn.Module):
    """Half-precision layers through the ops above: a norm, logsigmoid, atan2, a division by a learned scale."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.scale = torch.nn.Parameter(torch.full((16,), 1.5))

    def forward(self, x):
        h = self.a(x)
        h = torch.atan2(h, self.scale) + torch.nn.functional.logsigmoid(h) / self.scale
        h = h / torch.linalg.vector_norm(h, dim=-1, keepdim=True)
        return torch.logaddexp(self.b(torch.sinh(h)), torch.log1p(h.square())[:, :4])


@pytest.mark.parametrize("mode", ["full", "thin", "module"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_model_with_rounded_formulas_trains_as_eager(dtype, mode):
    torch.manual_seed(0)
    base = _Mixed().to(dtype)
    xs = [torch.randn(6, 8).to(dtype) for _ in range(3)]

    models = [copy.deepcopy(base) for _ in range(2)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in models]
    if mode == "module":
        cm = tt.compile(models[1], fusion=None)
        cstep = lambda model, opt, x: squared_output_step(cm, opt, x)  # noqa: E731
    else:
        cstep = tt.compile(squared_output_step, thin=mode == "thin", fusion=None)
    _assert_trains_as_eager(cstep, models, opts, xs)
