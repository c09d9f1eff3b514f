"""Default arguments and attributes of plain Python objects are inputs: walked, guarded and bound
(compiler/acquisition/captured.py default_roots/self_root, walker.py InputWalker.namespace).

Every case changes the value after the first calls and compares with eager PyTorch.
"""
from __future__ import annotations

import argparse
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _steps import assert_same_state, mlp, mlp_batches, twin

MODES = [dict(), dict(thin=True)]
MODE_IDS = ["full", "thin"]


def calls(cf, fn, make_args, n=3):
    for _ in range(n):
        args = make_args()
        torch.testing.assert_close(cf(*args), fn(*args))


# ---------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_replaced_positional_defaults_are_seen(mode):
    w = torch.ones(3)

    def f(x, w=w, s=2.0):
        return x * w * s

    cf = tt.compile(f, **mode)
    x = torch.randn(3)
    calls(cf, f, lambda: (x,))
    f.__defaults__ = (torch.full((3,), 5.0), 3.0)
    calls(cf, f, lambda: (x,))
    assert any("defaults['s']" in r or "defaults['w']" in r for r in tt.compile_stats(cf).retrace_reasons), \
        tt.compile_stats(cf).retrace_reasons
    # Passing the argument: the default is not read (and not an input). (Thin mode: another argument count
    # breaks the bound contract; revalidate first.)
    if mode:
        cf.revalidate()
    calls(cf, f, lambda: (x, torch.full((3,), 7.0), 0.5))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_replaced_keyword_only_defaults_are_seen(mode):
    def g(x, *, s=2.0, bias=None):
        return x * s if bias is None else x * s + bias

    cf = tt.compile(g, **mode)
    x = torch.randn(3)
    calls(cf, g, lambda: (x,))
    g.__kwdefaults__ = {"s": 7.0, "bias": torch.ones(3)}
    calls(cf, g, lambda: (x,))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_tensor_default_changed_in_place_is_read_on_every_call(mode):
    buf = torch.zeros(3)

    def f(x, acc=buf):
        acc.add_(x)  # updates the default in place, as eager does
        return acc * 2

    cf = tt.compile(f, **mode)
    ref = torch.zeros(3)
    for _ in range(4):
        x = torch.randn(3)
        ref.add_(x)
        torch.testing.assert_close(cf(x), ref * 2)
    torch.testing.assert_close(buf, ref)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_model_and_optimizer_given_as_defaults_train_like_arguments(mode):
    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6))
    m, o = compiled

    def step(x, y, model=m, opt=o):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    def eager_step(x, y, model=eager[0], opt=eager[1]):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    cf = tt.compile(step, **mode)
    for x, y in mlp_batches(5):
        torch.testing.assert_close(cf(x, y), eager_step(x, y))
    assert_same_state(eager, compiled)
    assert "defaults['model']" in str(tt.last_prologue_traces(cf)[1])


# ---------------------------------------------------------------------------
# Attributes of plain objects
# ---------------------------------------------------------------------------
class Cfg:
    def __init__(self):
        self.scale = 1.0
        self.w = torch.ones(3)
        self.use_bias = False


def scaled(x, c):
    y = x * c.scale * c.w
    if c.use_bias:
        y = y + 1
    return y


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("change", ["float", "tensor", "tensor_in_place", "flag", "new_object", "added_attr"])
def test_an_attribute_of_a_plain_object_argument_changed_between_calls_is_seen(change, mode):
    cfg = Cfg()
    cf = tt.compile(scaled, **mode)
    x = torch.randn(3)
    calls(cf, scaled, lambda: (x, cfg))
    if change == "float":
        cfg.scale = 0.5
    elif change == "tensor":
        cfg.w = torch.full((3,), 3.0)
    elif change == "tensor_in_place":
        cfg.w.mul_(4)
    elif change == "flag":
        cfg.use_bias = True
    elif change == "new_object":
        cfg = Cfg()
        cfg.scale = 9.0
    else:
        cfg.extra = 1
    calls(cf, scaled, lambda: (x, cfg))
    if change == "float":
        assert any("args[1].scale.value: 1.0 → 0.5" in r for r in tt.compile_stats(cf).retrace_reasons + tt.compile_stats(cf).thin_invalidations)


g_cfg = Cfg()


def global_cfg_step(x):
    return x * g_cfg.scale + g_cfg.w


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_attribute_of_a_captured_plain_object_changed_between_calls_is_seen(mode):
    cf = tt.compile(global_cfg_step, **mode)
    x = torch.randn(3)
    calls(cf, global_cfg_step, lambda: (x,))
    g_cfg.scale = 0.25
    calls(cf, global_cfg_step, lambda: (x,))
    g_cfg.w = torch.zeros(3)
    calls(cf, global_cfg_step, lambda: (x,))
    args = argparse.Namespace(lr_scale=2.0)

    def ns_step(x):
        return x * args.lr_scale

    cn = tt.compile(ns_step, **mode)
    calls(cn, ns_step, lambda: (x,))
    args.lr_scale = 3.0
    calls(cn, ns_step, lambda: (x,))


class Sampler:
    def __init__(self):
        self.temperature = 1.0
        self.counter = 0

    def step(self, logits):
        self.counter += 1
        return F.softmax(logits / self.temperature, -1)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_bound_method_of_a_plain_object_reads_and_writes_its_attributes_like_eager(mode):
    a, e = Sampler(), Sampler()
    cf = tt.compile(a.step, **mode)
    x = torch.randn(2, 5)
    for i in range(5):
        if i == 3:
            a.temperature = e.temperature = 2.0
        torch.testing.assert_close(cf(x), e.step(x))
    assert a.counter == e.counter == 5


class Trainer:
    """A plain object holding the model and the optimizer: its step method is compiled."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt
        self.steps = 0
        self.last_loss = None

    def step(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1
        self.last_loss = loss.detach()
        return loss.detach()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_trainer_object_holding_model_and_optimizer_trains_like_eager(mode):
    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
    te, tc = Trainer(*eager), Trainer(*compiled)
    cf = tt.compile(tc.step, **mode)
    for x, y in mlp_batches(5):
        torch.testing.assert_close(cf(x, y), te.step(x, y))
    assert_same_state(eager, compiled)
    assert tc.steps == te.steps == 5
    torch.testing.assert_close(tc.last_loss, te.last_loss)
    assert "self.model" in str(tt.last_prologue_traces(cf)[1])


class Inner:
    def __init__(self):
        self.gain = 2.0


class Outer:
    def __init__(self):
        self.inner = Inner()


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_attributes_of_nested_plain_objects_are_seen(mode):
    o = Outer()

    def f(x, o):
        return x * o.inner.gain

    cf = tt.compile(f, **mode)
    x = torch.randn(3)
    calls(cf, f, lambda: (x, o))
    o.inner.gain = 5.0
    calls(cf, f, lambda: (x, o))
    o.inner = Inner()
    calls(cf, f, lambda: (x, o))


def test_an_iterator_held_by_a_plain_object_is_fine_unless_the_step_steps_it():
    from thunder_train.compiler.errors import TracingError

    class Loop:
        def __init__(self):
            self.it = iter([torch.ones(2)] * 3)
            self.scale = 2.0

        def scaled(self, x):
            return x * self.scale

        def pull(self, x):
            return x * next(self.it)

    loop = Loop()
    x = torch.randn(2)
    torch.testing.assert_close(tt.compile(loop.scaled)(x), x * 2)
    with pytest.raises(TracingError, match=r"self\.it is an iterator.*next\(\) inside it would return the same"):
        tt.compile(loop.pull)(x)
    assert len(list(loop.it)) == 3  # nothing was consumed


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_compiled_bound_forward_of_a_module_gives_eager_gradients(mode):
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    cf = tt.compile(model.forward, **mode)
    for x, y in mlp_batches(3):
        F.cross_entropy(cf(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
    for (n, a), b in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)


class Node:
    def __init__(self):
        self.me = self  # a cycle: the object reached again is checked by identity
        self.w = torch.ones(3)
        self.calls = 0


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_plain_object_that_refers_to_itself_is_walked_once(mode):
    def f(x, n):
        n.me.calls += 1
        return x * n.me.w * n.calls

    a, e = Node(), Node()
    cf = tt.compile(f, **mode)
    for i in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(cf(x, a), f(x, e))
    a.w = torch.full((3,), 2.0)
    e.w = torch.full((3,), 2.0)
    x = torch.randn(3)
    torch.testing.assert_close(cf(x, a), f(x, e))
    assert a.calls == e.calls == 4


class Scale:
    def __init__(self):
        self.k = 2.0
        self.calls = 0

    def __call__(self, x):
        self.calls += 1
        return x * self.k


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_compiled_callable_object_reads_and_writes_its_attributes_like_eager(mode):
    a, e = Scale(), Scale()
    cf = tt.compile(a, **mode)
    x = torch.randn(3)
    for i in range(4):
        if i == 3:
            a.k = e.k = 5.0
        torch.testing.assert_close(cf(x), e(x))
    assert a.calls == e.calls == 4
