"""Python numbers in float tensor arithmetic are passed as shared 0-d tensors (executors/numbers_as_tensors.py): the
same values as eager's calls with the number, bit for bit, in the torch program (``fusion=None``)."""
import pytest
import torch

import thunder_train as tt

NUMBERS = (0.5, 0.7978845608028654, 0.044715, 1e-7, 1 / 3, -3.0, 3, -0.0, 1e30, 2 ** 24, 7)
CALLS = {
    "mul": lambda x, n: torch.mul(x, n), "add": lambda x, n: torch.add(x, n), "sub": lambda x, n: torch.sub(x, n),
    "div": lambda x, n: torch.div(x, n), "true_divide": lambda x, n: torch.true_divide(x, n),
    "operator *": lambda x, n: x * n, "operator +": lambda x, n: x + n, "operator -": lambda x, n: x - n,
    "operator /": lambda x, n: x / n, "method mul": lambda x, n: x.mul(n), "method div": lambda x, n: x.div(n),
    "where, number second": lambda x, n: torch.where(x > 0, n, x), "where, number last": lambda x, n: torch.where(x > 1, x, n),
}


def _program(fn, *args, **options):
    cf = tt.compile(fn, fusion=None, **options)
    return cf, cf(*args), str(tt.last_traces(cf)[-1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_numbers_passed_as_tensors_give_eagers_bits(call, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 33, generator=g, dtype=dtype) * 5
    x[0, :3] = torch.tensor([0.0, -0.0, 1e-40])  # a zero of each sign, a float32 subnormal
    tag = {torch.float32: "numbers.f32_", torch.float64: "numbers.f64_"}[dtype]
    for n in NUMBERS:
        fn = lambda t, n=n: CALLS[call](t.cos() + t, n).sin()  # noqa: E731  (between two ops: not an input or output)
        _, got, source = _program(fn, x)
        want = fn(x)
        bits = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]  # NaNs (x / -0.0) and signed zeros too
        assert got.dtype == want.dtype and torch.equal(got.view(bits), want.view(bits)), (call, n)
        assert tag in source, source  # the number was passed as a tensor


def test_the_numbers_are_eagers_in_a_training_step():
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 4))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(32, 4))
    twin.load_state_dict(model.state_dict())

    def step(m, opt, x):
        h = m(x)
        loss = (0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * h ** 3)))).sum() / 3.0
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    cf = tt.compile(step, fusion=None)
    for _ in range(3):
        x = torch.randn(8, 16, generator=g)
        assert torch.equal(cf(model, opts[0], x), step(twin, opts[1], x))
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    assert "numbers.f32_0_044715" in str(tt.last_traces(cf)[-1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_other_dtypes_keep_the_number(dtype):
    # a 0-d float16 tensor would round the number to float16 first; an integer tensor times a float is promoted
    x = (torch.arange(12) - 5).to(dtype)
    fn = lambda t: torch.mul(t + 1, 0.7978845608028654) + 3  # noqa: E731
    _, got, source = _program(fn, x)
    want = fn(x)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert "0.7978845608028654" in source  # kept; for int64 the float32 result's ``+ 3`` is passed as a tensor
    assert ("numbers.f32_" in source) == (dtype == torch.int64)


def test_a_tensor_requiring_grad_outside_no_grad_keeps_the_number():
    x = torch.randn(5, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    cf = tt.compile(lambda t: (t.exp() * 0.25).sum(), fusion=None)
    cf(x).backward()
    (y.exp() * 0.25).sum().backward()
    assert torch.equal(x.grad, y.grad)


def test_a_printed_program_with_numbers_runs_by_hand_in_a_new_process():
    # ``numbers.f64_m0_0`` is made from its name on first use: the printed source needs only the standard namespace
    import subprocess
    import sys

    fn = lambda t: (t.exp() * -0.0 + 0.7978845608028654) / 3  # noqa: E731
    x = torch.randn(6, dtype=torch.float64)
    # (no kept buffers: a program keeping them takes them from the process that compiled it, docs/performance.md)
    _, got, source = _program(fn, x, keep_buffers=False)
    assert "numbers.f64_m0_0" in source and "numbers.f64_0_7978845608028654" in source
    script = ("import torch, sys\nfrom thunder_train.compiler.codegen import standard_namespace\n"
              f"ns = standard_namespace()\nexec(compile(sys.stdin.read(), '<printed trace>', 'exec'), ns)\n"
              f"x = torch.tensor({x.tolist()!r}, dtype=torch.float64)\n"
              "print(repr(ns['computation'](x).tolist()))")
    out = subprocess.run([sys.executable, "-c", script], input=source, capture_output=True, text=True, check=True).stdout
    assert eval(out) == fn(x).tolist() == got.tolist()
