"""Complex tensors have gradients equal to eager's: the fft family, stft/istft, view_as_real/view_as_complex,
polar, complex casts, ``.real``/``.imag``/``.H``, in-place ops on complex values, complex inputs and outputs, and a
whole step (backward inside the compiled function), thin and full.

Calls that read or make a complex tensor on the gradient path run through torch's autograd (the torch language's
rules are written for real tensors); each case compares the compiled function's values and gradients with eager's.
"""
from __future__ import annotations

import pytest
import torch

import thunder_train as tt

C = torch.randn(8, dtype=torch.cfloat, generator=torch.Generator().manual_seed(3))
W = torch.hann_window(8)


def _inplace(x):
    z = torch.fft.fft(x)
    z.mul_(2j)
    z += C
    return z.real.sum()


def _stft(x):
    s = torch.stft(x.reshape(-1), 8, hop_length=2, window=W, return_complex=True)
    y = torch.istft(s * 0.5, 8, hop_length=2, window=W, length=32)
    return y.pow(2).sum() + s.abs().sum()


def _setitem(x):
    z = torch.fft.fft(x)
    z[0] = 0
    z[:, 1] *= 2j  # an update through an indexed view: written back into z
    return z.abs().sum()


CASES = {
    "setitem_and_view_update": _setitem,
    "rfft_abs": lambda x: torch.fft.rfft(x).abs().sum(),
    "fft_view_as_real": lambda x: torch.view_as_real(torch.fft.fft(x)).pow(2).sum(),
    "fft_times_complex_real": lambda x: (torch.fft.fft(x) * (1 + 2j)).real.sum(),
    "rfft_irfft_product": lambda x: torch.fft.irfft(torch.fft.rfft(x) * torch.fft.rfft(x.flip(-1))).sum(),
    "fft2_ifft2_hfft": lambda x: torch.fft.ifft2(torch.fft.fft2(x) ** 2).real.sum() + torch.fft.hfft(x[:, :5]).sum(),
    "fftn_ihfft": lambda x: torch.fft.fftn(x).imag.pow(2).sum() + torch.fft.ihfft(x).angle().sum(),
    "polar_imag": lambda x: torch.polar(x.abs(), x).imag.sum(),
    "cfloat_exp": lambda x: (x.cfloat() * 1j).exp().real.sum(),
    "to_cdouble": lambda x: x.to(torch.cdouble).mul(C.to(torch.cdouble)).abs().sum().float(),
    "complex_constant_mul": lambda x: torch.complex(x, x * 2).mul(C).angle().sum(),
    "view_as_complex_angle": lambda x: torch.view_as_complex(x.reshape(4, 4, 2)).angle().sum(),
    "conj_and_H": lambda x: (torch.fft.fft(x)[:, :4].H @ torch.fft.fft(x)[:, :4]).abs().sum()
    + (torch.fft.rfft(x) * torch.fft.rfft(x).conj()).real.sum() + torch.fft.fft(x).mH.imag.pow(2).sum(),
    "inplace_on_complex": _inplace,
    "stft_istft": _stft,
}


def _grads(f, x):
    a = x.detach().clone().requires_grad_()
    out = f(a)
    (g,) = torch.autograd.grad(out, a)
    return out.detach(), g


@pytest.mark.parametrize("name", list(CASES))
def test_complex_gradient_equals_eager(name):
    f = CASES[name]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    expected, g_expected = _grads(f, x)
    cf = tt.compile(f)
    for _ in range(2):  # the second call runs the cached program
        actual, g_actual = _grads(cf, x)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g_actual, g_expected, rtol=1e-4, atol=1e-4)


def test_complex_input_and_complex_output():
    z = torch.randn(3, 4, dtype=torch.cfloat, generator=torch.Generator().manual_seed(1))

    def f(z):
        return (z * z.conj() * (1 + 1j)).real.sum() + torch.fft.fft(z).abs().sum(), torch.fft.fft(z) * 2j

    def loss(out):
        return out[0] + torch.view_as_real(out[1]).pow(2).sum()

    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    out_c, out_e = tt.compile(f)(a), f(b)
    assert out_c[1].dtype == torch.cfloat and out_c[1].requires_grad
    loss(out_c).backward()
    loss(out_e).backward()
    torch.testing.assert_close(out_c[1], out_e[1])
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("thin", [False, True])
def test_whole_step_with_spectral_loss(thin):
    """A training step whose loss goes through the frequency domain: parameter updates equal eager's."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    twin = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16))
    twin.load_state_dict(model.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin)]
    target = torch.fft.rfft(torch.randn(4, 16))

    def step(m, opt, x):
        spec = torch.fft.rfft(m(x))
        loss = (spec - target).abs().pow(2).mean() + torch.stft(m(x).reshape(-1), 16, window=torch.hann_window(16),
                                                               return_complex=True).abs().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cstep = tt.compile(step, thin=thin)
    for i in range(3):
        x = torch.randn(4, 16)
        torch.testing.assert_close(cstep(model, opts[0], x), step(twin, opts[1], x), rtol=1e-5, atol=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_complex_dtypes_follow_eager():
    """half times a complex number is complex32 in eager; complex32 (chalf) is a supported dtype."""
    f = lambda x: (x.half() * 1j, x.chalf())  # noqa: E731
    x = torch.randn(3)
    for a, e in zip(tt.compile(f)(x), f(x)):
        assert a.dtype == e.dtype == torch.complex32
        torch.testing.assert_close(torch.view_as_real(a).float(), torch.view_as_real(e).float())


def test_update_through_a_view_of_another_dtype_is_refused():
    """``z.real.mul_(3)`` would update ``z`` in eager; thunder_train writes views back by value, which a view of
    another dtype cannot be: refused with an error, never a silently different ``z``."""
    def f(x):
        z = torch.fft.fft(x)
        z.real.mul_(3)
        return z.abs().sum()

    with pytest.raises(tt.TracingError, match="view of a complex64"):
        tt.compile(f)(torch.randn(4, 8))


class _Spectral(torch.nn.Module):
    """A complex parameter (a learned filter in the frequency domain) next to real ones."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.filt = torch.nn.Parameter(torch.randn(8, dtype=torch.cfloat))

    def forward(self, x):
        return torch.fft.ifft(torch.fft.fft(self.lin(x)) * self.filt).real.pow(2).mean()


@pytest.mark.parametrize("opt,thin", [("sgd", False), ("adamw", False), ("adamw", True), ("adamw_foreach", True)])
def test_complex_parameter_trains_like_eager(opt, thin):
    """torch.optim updates a complex parameter through ``view_as_real``: the update reaches the parameter."""
    import copy

    torch.manual_seed(0)
    model = _Spectral()
    twin = copy.deepcopy(model)

    def make(m):
        if opt == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(m.parameters(), lr=0.01, foreach=opt == "adamw_foreach")

    opts = make(model), make(twin)

    def step(m, o, x):
        loss = m(x)
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    cstep = tt.compile(step, thin=thin)
    for _ in range(3):
        x = torch.randn(4, 8)
        torch.testing.assert_close(cstep(model, opts[0], x), step(twin, opts[1], x))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)
    for k, v in opts[1].state_dict()["state"].items():
        for key, t in v.items():
            torch.testing.assert_close(opts[0].state_dict()["state"][k][key], t)


def test_update_through_view_as_real_reaches_the_complex_tensor():
    def f(z, g):
        with torch.no_grad():
            r = torch.view_as_real(z)
            r.mul_(2)
            r.add_(torch.view_as_real(g))
        return z * 1

    z, g = torch.randn(3, dtype=torch.cfloat), torch.randn(3, dtype=torch.cfloat)
    a, b = z.clone(), z.clone()
    torch.testing.assert_close(tt.compile(f)(a, g), f(b, g))
    torch.testing.assert_close(a, b)
