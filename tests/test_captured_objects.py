"""Class attributes, ``__slots__`` objects, C-implemented objects (``types.SimpleNamespace``, ``functools.partial``),
bound methods and helpers that capture the model: all inputs, never a value frozen at the first call
(compiler/acquisition/class_attrs.py, walker.py).

Every case changes the value after the first calls and compares with eager PyTorch running the same code,
in full and thin mode.
"""
from __future__ import annotations

import argparse
import copy
import functools
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.errors import TracingError
import _captured_helpers
from _captured_helpers import loss_fn as other_module_loss
from _steps import assert_same_state, mlp, mlp_batches, twin

MODES = [dict(), dict(thin=True)]
MODE_IDS = ["full", "thin"]


def calls(cf, fn, *args, n=3):
    for _ in range(n):
        torch.testing.assert_close(cf(*args), fn(*args))


def reasons(cf) -> str:
    return " | ".join(tt.compile_stats(cf).retrace_reasons)


# ---------------------------------------------------------------------------
# Class attributes
# ---------------------------------------------------------------------------
class Cfg:
    scale = 2.0
    bias = torch.ones(3)
    opts = {"shift": 1.0}


class SubCfg(Cfg):
    pass


class Holder:
    k = 3.0

    def __init__(self):
        self.w = torch.ones(3)

    @property
    def eff(self):
        return self.w * self.k

    @classmethod
    def factor(cls):
        return cls.k * 2


@pytest.fixture
def restore_classes():
    saved = {c: {k: dict(v) if type(v) is dict else v for k, v in vars(c).items()} for c in (Cfg, SubCfg, Holder)}
    yield
    for c, d in saved.items():
        for k in list(vars(c)):
            if k not in d and not k.startswith("__"):
                delattr(c, k)
        for k, v in d.items():
            if not k.startswith("__"):
                setattr(c, k, v)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_class_attribute_read_through_an_instance_is_an_input(mode, restore_classes):
    cfg = Cfg()

    def f(x):
        return x * cfg.scale

    cf = tt.compile(f, **mode)
    x = torch.randn(3)
    calls(cf, f, x)
    Cfg.scale = 5.0
    calls(cf, f, x)
    assert "Cfg.scale" in reasons(cf)
    # An instance attribute added later shadows the class attribute, as in eager.
    cfg.scale = -1.0
    calls(cf, f, x)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_inherited_class_attribute_changed_on_the_base_or_shadowed_on_the_subclass(mode, restore_classes):
    cfg = SubCfg()

    def f(x):
        return x * cfg.scale + cfg.opts["shift"]

    cf = tt.compile(f, **mode)
    x = torch.randn(3)
    calls(cf, f, x)
    Cfg.scale = 4.0  # on the base class
    calls(cf, f, x)
    SubCfg.scale = 7.0  # shadowed on the subclass
    calls(cf, f, x)
    Cfg.opts["shift"] = -2.0  # a class-level dict changed in place
    calls(cf, f, x)
    assert "SubCfg.scale" in reasons(cf) and "SubCfg.opts" in reasons(cf)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_class_level_tensor_rebound_or_changed_in_place(mode, restore_classes):
    cfg = Cfg()

    def f(x):
        return x + cfg.bias

    cf = tt.compile(f, **mode)
    x = torch.randn(3)
    calls(cf, f, x)
    Cfg.bias = torch.full((3,), 4.0)  # same metadata: no retrace, the new tensor is read
    calls(cf, f, x)
    Cfg.bias.mul_(3)
    calls(cf, f, x)
    Cfg.bias = torch.ones(2, 3)  # new shape: retrace
    calls(cf, f, x)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_class_read_through_the_class_a_property_and_a_classmethod(mode, restore_classes):
    h = Holder()

    def f(x):
        return x * h.eff + Cfg.scale + Holder.factor()

    cf = tt.compile(f, **mode)
    x = torch.randn(3)
    calls(cf, f, x)
    Holder.k = 7.0  # read by the property and by the classmethod
    calls(cf, f, x)
    Cfg.scale = -3.0  # read through the captured class
    calls(cf, f, x)
    h.w = torch.full((3,), 2.0)  # read by the property
    calls(cf, f, x)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_class_level_config_object(mode):
    class Conf:
        def __init__(self):
            self.scale = 2.0

    class Net(nn.Module):
        conf = Conf()

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 4)

        def forward(self, x):
            return self.fc(x) * self.conf.scale

    net = Net()
    cf = tt.compile(net, **mode)
    x = torch.randn(2, 6)
    calls(cf, net, x)
    Net.conf.scale = 0.25
    calls(cf, net, x)
    Net.conf = Conf()
    Net.conf.scale = 3.0
    calls(cf, net, x)


class ScaledMLP(nn.Module):
    temperature = 1.0

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return self.net(x) / self.temperature


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_module_class_attribute_changed_between_training_steps(mode):
    saved = ScaledMLP.temperature
    try:
        eager, compiled = twin(ScaledMLP, lambda ps: torch.optim.AdamW(ps, lr=1e-2))

        def step(model, opt, x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        cf = tt.compile(step, **mode)
        for i, (x, y) in enumerate(mlp_batches(6)):
            if i == 3:
                ScaledMLP.temperature = 0.5
            torch.testing.assert_close(cf(*compiled, x, y), step(*eager, x, y), atol=1e-6, rtol=1e-5)
        assert_same_state(eager, compiled)
        assert "ScaledMLP.temperature" in reasons(cf)
    finally:
        ScaledMLP.temperature = saved


def test_assigning_a_class_attribute_inside_is_an_error(restore_classes):
    cfg = Cfg()

    def f(x):
        type(cfg).scale = 9.0
        return x * cfg.scale

    with pytest.raises(TracingError, match="class attribute Cfg.scale"):
        tt.compile(f)(torch.randn(3))
    assert Cfg.scale == 2.0 and isinstance(vars(Cfg)["scale"], float)


def test_classes_are_left_as_they_were_after_tracing_and_after_an_error(restore_classes):
    cfg = Cfg()

    def f(x):
        return x * cfg.scale + cfg.bias

    def g(x):
        _ = cfg.scale
        raise ValueError("boom")

    before = dict(vars(Cfg))
    tt.compile(f)(torch.randn(3))
    assert dict(vars(Cfg)) == before
    with pytest.raises(ValueError, match="boom"):
        tt.compile(g)(torch.randn(3))
    assert dict(vars(Cfg)) == before


# ---------------------------------------------------------------------------
# __slots__, SimpleNamespace, argparse.Namespace, functools.partial
# ---------------------------------------------------------------------------
class Slotted:
    __slots__ = ("a", "t", "extra")

    def __init__(self):
        self.a = 2.0
        self.t = torch.ones(3)


class SlottedWithDict(Slotted):
    def __init__(self):
        super().__init__()
        self.b = 1.5


def _objects():
    return {
        "slots": Slotted(),
        "slots_and_dict": SlottedWithDict(),
        "simple_namespace": types.SimpleNamespace(a=2.0, t=torch.ones(3)),
        "argparse": argparse.Namespace(a=2.0, t=torch.ones(3)),
    }


@pytest.mark.parametrize("kind", sorted(_objects()))
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_attributes_of_slotted_and_c_objects_are_inputs(kind, mode):
    obj = _objects()[kind]

    def f(x):
        out = x * obj.a + obj.t
        return out + obj.extra if getattr(obj, "extra", None) is not None else out

    cf = tt.compile(f, **mode)
    x = torch.randn(3)
    calls(cf, f, x)
    obj.a = 5.0
    calls(cf, f, x)
    obj.t = torch.full((3,), -1.0)  # same metadata: the new tensor is read
    calls(cf, f, x)
    obj.t.add_(1)
    calls(cf, f, x)
    obj.extra = torch.full((3,), 10.0)  # a slot (attribute) filled later
    calls(cf, f, x)
    del obj.extra
    calls(cf, f, x)


@pytest.mark.parametrize("kind", ["slots", "simple_namespace"])
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_attributes_set_inside_on_slotted_and_c_objects_are_replayed(kind, mode):
    objs = [_objects()[kind], _objects()[kind]]  # eager's and the compiled function's

    def make(obj):
        def f(x):
            y = (x * obj.a).sum()
            obj.extra = y.detach()
            obj.t = obj.t * 2
            return y

        return f

    f_eager, cf = make(objs[0]), tt.compile(make(objs[1]), **mode)
    for _ in range(3):
        x = torch.randn(3)
        torch.testing.assert_close(cf(x), f_eager(x))
        torch.testing.assert_close(objs[1].extra, objs[0].extra)
        torch.testing.assert_close(objs[1].t, objs[0].t)


def scaled(x, w, s=1.0):
    return x * w * s


g_partial = functools.partial(scaled, w=torch.ones(3), s=2.0)
g_partial_pos = functools.partial(scaled, torch.ones(3))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_partial_args_and_keywords_are_inputs(mode):
    global g_partial
    saved = g_partial

    def f(x):
        return g_partial(x) + g_partial_pos(x)

    try:
        cf = tt.compile(f, **mode)
        x = torch.randn(3)
        calls(cf, f, x)
        g_partial.keywords["s"] = 5.0
        calls(cf, f, x)
        g_partial.keywords["w"] = torch.full((3,), 3.0)
        calls(cf, f, x)
        g_partial = functools.partial(scaled, w=torch.ones(3), s=-1.0)
        calls(cf, f, x)
        assert "keywords" in reasons(cf)
    finally:
        g_partial = saved


# ---------------------------------------------------------------------------
# The model captured by a helper the step calls (docs/captured_inputs.md, rule 2)
# ---------------------------------------------------------------------------
h_model = h_opt = None


def h_loss(x, y):
    return F.cross_entropy(h_model(x), y)


h_lambda = lambda x, y: F.cross_entropy(h_model(x), y)  # noqa: E731


def loss_of(model, x, y):
    return F.cross_entropy(model(x), y)


class Trainer:
    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def loss(self, x, y):
        return F.cross_entropy(self.model(x), y)


h_partial = None
h_trainer = None
h_method = None  # h_trainer.loss, captured as a bound method
h_namespace = None


def _step_with(loss_fn):
    def step(x, y):
        loss = loss_fn()(x, y)
        loss.backward()
        h_opt.step()
        h_opt.zero_grad()
        return loss.detach()

    return step


def step_helper(x, y):
    loss = h_loss(x, y)
    loss.backward()
    h_opt.step()
    h_opt.zero_grad()
    return loss.detach()


def step_lambda(x, y):
    loss = h_lambda(x, y)
    loss.backward()
    h_opt.step()
    h_opt.zero_grad()
    return loss.detach()


def step_partial(x, y):
    loss = h_partial(x, y)
    loss.backward()
    h_opt.step()
    h_opt.zero_grad()
    return loss.detach()


def step_trainer(x, y):
    loss = h_trainer.loss(x, y)
    loss.backward()
    h_trainer.opt.step()
    h_trainer.opt.zero_grad()
    return loss.detach()


def step_method(x, y):
    loss = h_method(x, y)
    loss.backward()
    h_opt.step()
    h_opt.zero_grad()
    return loss.detach()


def step_namespace(x, y):
    loss = F.cross_entropy(h_namespace.model(x), y)
    loss.backward()
    h_namespace.opt.step()
    h_namespace.opt.zero_grad()
    return loss.detach()


def step_other_module(x, y):
    loss = other_module_loss(x, y)  # reads _captured_helpers.model
    loss.backward()
    h_opt.step()
    h_opt.zero_grad()
    return loss.detach()


def _bind(shape, model, opt):
    """Point the globals ``shape``'s step reads at ``model`` and ``opt`` (as user code rebinding them would)."""
    global h_model, h_opt, h_partial, h_trainer, h_method, h_namespace
    h_model, h_opt = model, opt
    _captured_helpers.model = model
    if shape == "partial":
        h_partial = functools.partial(loss_of, model)
    elif shape == "trainer":
        if h_trainer is None:
            h_trainer = Trainer(model, opt)
        h_trainer.model, h_trainer.opt = model, opt  # attributes of the same global object replaced
    elif shape == "method":
        if h_trainer is None:
            h_trainer = Trainer(model, opt)
            h_method = h_trainer.loss
        h_trainer.model = model  # the object the captured bound method is bound to, changed
    elif shape == "namespace":
        if h_namespace is None:
            h_namespace = types.SimpleNamespace(model=model, opt=opt)
        h_namespace.model, h_namespace.opt = model, opt


SHAPES = {"helper": step_helper, "lambda": step_lambda, "partial": step_partial, "trainer": step_trainer,
          "method": step_method, "namespace": step_namespace, "other_module": step_other_module}


@pytest.fixture
def clean_globals():
    yield
    global h_model, h_opt, h_partial, h_trainer, h_method, h_namespace
    h_model = h_opt = h_partial = h_trainer = h_method = h_namespace = None
    _captured_helpers.model = None


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_model_captured_by_a_helper_is_seen_when_replaced(shape, mode, clean_globals):
    make_opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2)  # noqa: E731
    first_e, first_c = twin(mlp, make_opt, seed=0)
    second_e, second_c = twin(mlp, make_opt, seed=1)
    cf = tt.compile(SHAPES[shape], **mode)
    batches = mlp_batches(6)
    for i, (x, y) in enumerate(batches):
        eager, compiled = (first_e, first_c) if i < 3 else (second_e, second_c)
        _bind(shape, *compiled)
        got = cf(x, y)
        want = loss_of(eager[0], x, y)
        want.backward()
        eager[1].step()
        eager[1].zero_grad()
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5)
    assert_same_state(first_e, first_c)
    assert_same_state(second_e, second_c)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_model_passed_as_an_argument_and_held_by_an_object_replaced_there(mode):
    """The same model reached twice: as an argument and as ``trainer.model``; replacing the attribute is seen."""
    first, second = mlp(), mlp()
    trainer = types.SimpleNamespace(model=first)

    def f(model, x):
        return model(x) + trainer.model(x)

    cf = tt.compile(f, **mode)
    x = torch.randn(2, 6)
    calls(cf, f, first, x)
    trainer.model = second
    calls(cf, f, first, x)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_dataclass_class_variable_and_module_held_by_a_class(mode):
    import dataclasses
    from typing import ClassVar

    @dataclasses.dataclass
    class Opts:
        scale: float = 2.0
        shift: ClassVar[float] = 1.0

    class Registry:
        model = mlp()

    opts = Opts()

    def f(x):
        return Registry.model(x) * opts.scale + opts.shift

    cf = tt.compile(f, **mode)
    x = torch.randn(2, 6)
    calls(cf, f, x)
    Opts.shift = -4.0
    calls(cf, f, x)
    Registry.model = mlp()
    calls(cf, f, x)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_globals_of_a_helper_in_another_user_module_are_inputs(mode, clean_globals):
    """``from utils import predict``: the helper's own module globals (a model, a float) rebound are seen."""

    def f(x):
        return _captured_helpers.predict(x)

    def g(x):
        return other_module_predict(x)

    x = torch.randn(2, 6)
    for fn in (f, g):
        _captured_helpers.model, _captured_helpers.scale = mlp(), 2.0
        cf = tt.compile(fn, **mode)
        calls(cf, fn, x)
        _captured_helpers.model = mlp()
        calls(cf, fn, x)
        _captured_helpers.scale = -0.5
        calls(cf, fn, x)


from _captured_helpers import predict as other_module_predict  # noqa: E402
