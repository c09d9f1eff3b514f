"""Flags act on the tensor they are set on, also after functionalized in-place updates (issue 25, item 1).

An in-place update inside a compiled step makes a new value proxy for the updated tensor; ``requires_grad_``,
``.requires_grad``, ``.grad`` and ``detach_`` set afterwards must still act on the user's tensor, as in eager,
and leave it as eager leaves it.  Every test runs the same code eagerly and compiled (thin and full) and
compares losses, parameters, ``.grad`` and flags after every step.
"""
import copy

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt

MODES = [pytest.param(dict(thin=True), id="thin"), pytest.param(dict(thin=False), id="full")]


def _same(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, f"{what}: {a} vs {b}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _same_modules(me, mc, step):
    for (n, pe), pc in zip(me.named_parameters(), mc.parameters()):
        _same(pe, pc, f"step {step} {n}")
        _same(pe.grad, pc.grad, f"step {step} {n}.grad")
        assert pe.requires_grad == pc.requires_grad, f"step {step} {n}.requires_grad"


@pytest.mark.parametrize("mode", MODES)
def test_freeze_after_no_grad_update(mode):
    """The smallest form: an update under no_grad, then requires_grad_(False), then a backward through it."""
    def step(g, d, x):
        with torch.no_grad():
            d.weight.mul_(0.5)
        d.requires_grad_(False)
        loss = d(g(x)).sum()
        loss.backward()
        return loss

    torch.manual_seed(0)
    ge, de = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    gc, dc = copy.deepcopy(ge), copy.deepcopy(de)
    cf = tt.compile(step, **mode)
    x = torch.randn(3, 4)
    for i in range(3):
        de.requires_grad_(True)
        dc.requires_grad_(True)
        _same(step(ge, de, x), cf(gc, dc, x), f"loss {i}")
        _same_modules(ge, gc, i)
        _same_modules(de, dc, i)
    assert dc.weight.grad is None and not dc.weight.requires_grad


@pytest.mark.parametrize("mode", MODES)
def test_flag_read_and_set_back_after_update(mode):
    """``.requires_grad`` after a no_grad update reads the leaf's flag; set back to True it differentiates again."""
    def step(d, x):
        with torch.no_grad():
            d.weight.add_(0.1)
        before = d.weight.requires_grad
        d.weight.requires_grad = False
        frozen = d.weight.requires_grad
        d(x).sum().backward()
        d.weight.requires_grad_(True)
        loss = d(x).pow(2).sum()
        loss.backward()
        return loss, torch.tensor([before, frozen])

    torch.manual_seed(0)
    de = torch.nn.Linear(4, 2)
    dc = copy.deepcopy(de)
    cf = tt.compile(step, **mode)
    x = torch.randn(3, 4)
    for i in range(3):
        le, fe = step(de, x)
        lc, fc = cf(dc, x)
        _same(le, lc, f"loss {i}")
        assert fe.tolist() == fc.tolist() == [True, False]
        _same_modules(de, dc, i)


@pytest.mark.parametrize("mode", MODES)
def test_grad_assignment_after_update(mode):
    """``.grad`` set or cleared after an in-place update of the parameter lands on the parameter."""
    def step(d, x):
        with torch.no_grad():
            d.weight.mul_(0.9)
        d.weight.grad = torch.ones_like(d.weight)
        d(x).sum().backward()
        with torch.no_grad():
            d.bias.sub_(0.1)
        d.bias.grad = None
        return d.weight.grad.sum()

    torch.manual_seed(0)
    de = torch.nn.Linear(4, 2)
    dc = copy.deepcopy(de)
    cf = tt.compile(step, **mode)
    x = torch.randn(3, 4)
    for i in range(3):
        _same(step(de, x), cf(dc, x), f"result {i}")
        _same_modules(de, dc, i)


@pytest.mark.parametrize("mode", MODES)
def test_data_assignment_between_steps_after_update(mode):
    """``p.data = ...`` between steps, the step updating ``p`` in place: each call trains the new values."""
    def step(d, x):
        with torch.no_grad():
            d.weight.mul_(0.5)
        d.requires_grad_(False)
        out = d(x).sum()
        d.requires_grad_(True)
        loss = d(x).pow(2).sum() + out
        loss.backward()
        return loss

    torch.manual_seed(0)
    de = torch.nn.Linear(4, 3)
    dc = copy.deepcopy(de)
    cf = tt.compile(step, **mode)
    x = torch.randn(3, 4)
    for i in range(4):
        if i == 2:
            w = torch.randn(3, 4)
            de.weight.data = w.clone()
            dc.weight.data = w.clone()
        _same(step(de, x), cf(dc, x), f"loss {i}")
        _same_modules(de, dc, i)
        de.zero_grad()
        dc.zero_grad()


def test_unfreeze_of_updated_non_leaf_raises_as_eager():
    """An input not requiring grad updated with a value that does is no leaf: requires_grad_(False) raises."""
    def step(t, w):
        t.add_(w)
        t.requires_grad_(False)
        return t

    w = torch.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf variables"):
        step(torch.zeros(3), w)
    t = torch.zeros(3)
    with pytest.raises(RuntimeError, match="leaf variables"):
        tt.compile(step)(t, w)
    assert torch.equal(t, torch.zeros(3)) and not t.requires_grad


class _G(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))

    def forward(self, z):
        return self.net(z)


class _D(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.LeakyReLU(0.2), torch.nn.Linear(8, 1))

    def forward(self, x):
        return self.net(x)


def gan_step(G, D, opt_g, opt_d, z, real):
    # D update
    fake = G(z)
    d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(real.shape[0], 1)) + \
        F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(z.shape[0], 1))
    d_loss.backward()
    opt_d.step()
    opt_d.zero_grad()
    # G update with D frozen: D's parameters were just updated in place
    D.requires_grad_(False)
    g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(z.shape[0], 1))
    g_loss.backward()
    opt_g.step()
    opt_g.zero_grad()
    D.requires_grad_(True)
    return d_loss, g_loss


def gan_step_frozen_end(G, D, opt_g, opt_d, z, real):
    """The same, but leaves D frozen and never zeroes D's gradients (the next call unfreezes it first)."""
    D.requires_grad_(True)
    fake = G(z)
    d_loss = F.binary_cross_entropy_with_logits(D(real), torch.ones(real.shape[0], 1)) + \
        F.binary_cross_entropy_with_logits(D(fake.detach()), torch.zeros(z.shape[0], 1))
    d_loss.backward()
    opt_d.step()
    D.requires_grad_(False)
    g_loss = F.binary_cross_entropy_with_logits(D(fake), torch.ones(z.shape[0], 1))
    g_loss.backward()
    opt_g.step()
    opt_g.zero_grad()
    return d_loss, g_loss


def _gan():
    torch.manual_seed(0)
    G, D = _G(), _D()
    return G, D, torch.optim.Adam(G.parameters(), lr=1e-2), torch.optim.SGD(D.parameters(), lr=5e-2, momentum=0.9)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("step", [gan_step, gan_step_frozen_end])
def test_gan_step_matches_eager(mode, step):
    e = _gan()
    c = _gan()
    cf = tt.compile(step, **mode)
    gen = torch.Generator().manual_seed(1)
    for i in range(5):
        z, real = torch.randn(6, 4, generator=gen), torch.randn(5, 3, generator=gen)
        le = step(*e, z, real)
        lc = cf(*c, z, real)
        for a, b in zip(le, lc):
            _same(a, b, f"loss {i}")
        _same_modules(e[0], c[0], i)
        _same_modules(e[1], c[1], i)
        for oe, oc in zip(e[2:], c[2:]):
            for pe, pc in zip(oe.state.values(), oc.state.values()):
                for k in pe:
                    _same(pe[k], pc[k], f"step {i} optimizer state {k}")


def test_gan_loss_on_detached_fake_raises_as_eager():
    """A G loss wrongly built on ``fake.detach()`` with D frozen reaches nothing that requires grad: eager raises."""
    def step(G, D, opt_d, z, real):
        fake = G(z)
        d_loss = D(real).mean() - D(fake.detach()).mean()
        d_loss.backward()
        opt_d.step()
        D.requires_grad_(False)
        g_loss = -D(fake.detach()).mean()
        g_loss.backward()
        return g_loss

    G, D, _, opt_d = _gan()
    z, real = torch.randn(6, 4), torch.randn(5, 3)
    with pytest.raises(RuntimeError, match="does not require grad"):
        step(G, D, opt_d, z, real)
    G, D, _, opt_d = _gan()
    before = [p.detach().clone() for p in D.parameters()]
    with pytest.raises(RuntimeError, match="does not require grad"):
        tt.compile(step)(G, D, opt_d, z, real)
    assert all(torch.equal(a, b) for a, b in zip(before, D.parameters()))
    assert all(p.requires_grad and p.grad is None for p in D.parameters())
