"""Smaller eager-parity cases of issue 25 (items 8 and 10): each against eager, or eager's error."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def test_int_copy_from_float_casts_as_eager():
    def f(a, b, c):
        a.copy_(b)
        c.copy_(b > 0)
        return a, c

    args = (torch.zeros(3, dtype=torch.int64), torch.tensor([1.7, -2.5, 3.2]), torch.zeros(3))
    expected = f(*copy.deepcopy(args))
    actual = tt.compile(f)(*args)
    for a, e in zip(actual, expected):
        assert a.dtype == e.dtype and torch.equal(a, e)
    assert torch.equal(args[0], expected[0])


def test_inplace_arithmetic_still_refuses_float_into_int():
    def f(a, b):
        a.add_(b)
        return a

    with pytest.raises(RuntimeError, match="can't be cast"):
        f(torch.zeros(2, dtype=torch.int64), torch.ones(2))
    with pytest.raises(RuntimeError, match="can't be cast"):
        tt.compile(f)(torch.zeros(2, dtype=torch.int64), torch.ones(2))


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("thin", [False, True])
def test_ema_with_buffers_and_swa_on_batchnorm(thin):
    """AveragedModel(use_buffers=True) copies num_batches_tracked (int64) from the model's buffers."""
    def make():
        m = _bn_model()
        return (m, AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True), AveragedModel(m),
                torch.optim.SGD(m.parameters(), lr=0.1))

    def step(m, ema, swa, opt, x):
        loss = m(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(m)
        swa.update_parameters(m)
        return loss

    e, c = make(), make()
    cf = tt.compile(step, thin=thin)
    gen = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randn(6, 4, generator=gen)
        torch.testing.assert_close(cf(*c, x), step(*e, x))
        for me, mc in ((e[1], c[1]), (e[2], c[2])):
            for (k, a), b in zip(me.state_dict().items(), mc.state_dict().values()):
                assert a.dtype == b.dtype, k
                torch.testing.assert_close(b, a, msg=lambda m: f"step {i} {k}: {m}")


@pytest.mark.parametrize("thin", [False, True])
def test_empty_batch_through_batchnorm(thin):
    """Eager returns an empty output and leaves the running statistics (num_batches_tracked still counts)."""
    def step(m, opt, x):
        loss = m(x).sum() + sum(p.sum() for p in m.parameters())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    me = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))
    cf = tt.compile(step, thin=thin)
    gen = torch.Generator().manual_seed(0)
    for n in (5, 0, 5, 0):
        x = torch.randn(n, 3, generator=gen)
        torch.testing.assert_close(cf(mc, oc, x), step(me, oe, x))
        for (k, a), b in zip(me.state_dict().items(), mc.state_dict().values()):
            torch.testing.assert_close(b, a, msg=lambda m: f"batch of {n}, {k}: {m}")


@pytest.mark.parametrize("labels", [torch.tensor([0., 1, 2, 1, 0]), torch.tensor([0, 1, 2, 1, 0], dtype=torch.int32)])
@pytest.mark.parametrize("loss_fn", [F.cross_entropy, F.nll_loss])
def test_class_labels_of_the_wrong_dtype_give_eagers_error(labels, loss_fn):
    def f(x, y):
        return loss_fn(x, y)

    x = torch.randn(5, 3)
    with pytest.raises(RuntimeError) as eager:
        f(x, labels)
    with pytest.raises(RuntimeError) as compiled:
        tt.compile(f)(x, labels)
    assert str(compiled.value) == str(eager.value)


def test_class_probabilities_still_work():
    x, p = torch.randn(4, 3), torch.softmax(torch.randn(4, 3), -1)
    torch.testing.assert_close(tt.compile(F.cross_entropy)(x, p), F.cross_entropy(x, p))


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_deprecated_weight_norm_gets_the_right_advice_and_the_replacement_works():
    def step(m, opt, x):
        loss = m(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for name in ("weight_norm", "spectral_norm"):
        old = getattr(torch.nn.utils, name)(torch.nn.Linear(4, 3))
        with pytest.raises(TracingError, match=f"parametrizations.{name}"):
            tt.compile(step)(old, torch.optim.SGD(old.parameters(), lr=0.1), torch.randn(2, 4))
        old(torch.randn(2, 4)).sum().backward()  # still works eagerly

    torch.manual_seed(0)
    me = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3))
    mc = copy.deepcopy(me)
    oe, oc = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (me, mc))
    cf = tt.compile(step)
    for i in range(3):
        x = torch.randn(2, 4)
        torch.testing.assert_close(cf(mc, oc, x), step(me, oe, x))
        for a, b in zip(me.parameters(), mc.parameters()):
            torch.testing.assert_close(b, a)


@pytest.mark.parametrize("thin", [False, True])
def test_toggling_amsgrad(thin):
    """On -> off trains as eager; off -> on raises eager's KeyError and changes nothing."""
    def step(m, opt, x):
        loss = m(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for start in (True, False):
        torch.manual_seed(0)
        me = torch.nn.Linear(4, 3)
        mc = copy.deepcopy(me)
        oe, oc = (torch.optim.Adam(m.parameters(), lr=0.1, amsgrad=start) for m in (me, mc))
        cf = tt.compile(step, thin=thin)
        gen = torch.Generator().manual_seed(1)
        for i in range(3):
            x = torch.randn(2, 4, generator=gen)
            step(me, oe, x)
            cf(mc, oc, x)
        oe.param_groups[0]["amsgrad"] = oc.param_groups[0]["amsgrad"] = not start
        x = torch.randn(2, 4, generator=gen)
        if start:
            torch.testing.assert_close(cf(mc, oc, x), step(me, oe, x))
            for a, b in zip(me.parameters(), mc.parameters()):
                torch.testing.assert_close(b, a)
            continue
        state = {k: v.clone() for k, v in oc.state[mc.weight].items()}
        params = [p.detach().clone() for p in mc.parameters()]
        with pytest.raises(KeyError, match="max_exp_avg_sq"):
            step(me, oe, x)
        with pytest.raises(KeyError, match="max_exp_avg_sq"):
            cf(mc, oc, x)
        assert oc.state[mc.weight].keys() == state.keys()
        assert all(torch.equal(oc.state[mc.weight][k], v) for k, v in state.items())
        assert all(torch.equal(a, b) for a, b in zip(params, mc.parameters()))
        assert all(p.grad is None for p in mc.parameters())


@pytest.mark.parametrize("target", [lambda x: x, torch.nn.Linear(2, 2)])
def test_unknown_fusion_is_refused(target):
    with pytest.raises(ValueError, match="fusion must be one of"):
        tt.compile(target, fusion="bad")
