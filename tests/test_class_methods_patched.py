"""A method of the user's model class replaced after the first call (``Block.helper = f``): eager runs the new one.

The trace ran the old method's code, and replacing a class attribute bumps no module epoch, so every mode kept running
the traced method, silently (only ``forward`` was guarded).  The guard now holds the user's methods and properties of
each module class that the traced code may call (acquisition/captured.py ``Scanner.methods``): a replaced one
retraces (full mode) or re-validates (thin mode).  Each case patches a class of its own, for the eager and the
compiled model alike, and compares parameters, gradients and optimizer state with eager over the steps.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import thunder_train as tt
from _thin_twin import MODES, Twin, checks_of_the_mode  # noqa: F401 (an autouse fixture)


def _classes():
    """A fresh model class per test (patches stay inside the test): forward calls ``helper``, which calls
    ``_inner``, and reads the property ``gain``; ``act`` is a static method, ``bias_of`` a class method."""

    class Base(nn.Module):
        def helper(self, h):
            return self._inner(h) * 2

        def _inner(self, h):
            return torch.tanh(h)

    class Block(Base):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(4, 6)
            self.out = nn.Linear(6, 3)

        @property
        def gain(self):
            return 1.0

        @staticmethod
        def act(h):
            return F.relu(h)

        @classmethod
        def bias_of(cls, h):
            return h + 0.5

        def forward(self, x):
            h = self.helper(self.lin(x)) * self.gain
            return self.out(self.bias_of(self.act(h)))

    return Base, Block


def _twin(mode, step=None):
    _, block = _classes()
    kw = {} if step is None else {"step": step}
    return Twin(make_model=block, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1), **kw, **mode), block


def _patched(cls, name, value):
    return lambda m, o: setattr(cls, name, value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("what", ["method", "method of a method", "property", "staticmethod", "classmethod",
                                  "overridden on the subclass"])
def test_a_method_of_the_model_class_replaced_after_the_first_call(mode, what):
    t, block = _twin(mode)
    base = block.__mro__[1]
    t.steps(2)
    new = {
        "method": (block, "helper", lambda self, h: torch.sigmoid(h) * 3),
        "method of a method": (base, "_inner", lambda self, h: torch.sin(h)),
        "property": (block, "gain", property(lambda self: 0.25)),
        "staticmethod": (block, "act", staticmethod(lambda h: F.gelu(h))),
        "classmethod": (block, "bias_of", classmethod(lambda cls, h: h - 1.0)),
        # (``helper`` came from Base; a definition on Block now shadows it)
        "overridden on the subclass": (block, "_inner", lambda self, h: h * 0.5),
    }[what]
    t.hazard(_patched(*new))
    t.steps(2)
    if what == "overridden on the subclass":  # (the hazard runs for each model: delete once)
        t.hazard(lambda m, o: new[1] in vars(new[0]) and delattr(new[0], new[1]))
    t.steps(2)


@pytest.mark.parametrize("mode", MODES)
def test_a_method_the_step_calls_itself_replaced(mode):
    def step(model, opt, x, y):
        loss = F.mse_loss(model.out(model.helper(model.lin(x))), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    t, block = _twin(mode, step)
    t.steps(2)
    t.hazard(_patched(block, "helper", lambda self, h: h * 0.1))
    t.steps(2)


def test_the_compiled_module_follows_a_replaced_method():
    # tt.compile(model): its forward program, PyTorch's autograd and eager's optimizer around it.
    _, block = _classes()
    eager, model = block(), block()
    cm = tt.compile(model)
    x = torch.randn(5, 4)
    for i in range(4):
        if i == 2:
            block.helper = lambda self, h: torch.sigmoid(h) * 3
        want, got = eager(x), cm(x)
        torch.testing.assert_close(got, want)
        want.sum().backward()
        got.sum().backward()
        for p, q in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad)
            p.grad = q.grad = None


def test_the_retrace_says_which_method_changed():
    _, block = _classes()
    model = block()
    cf = tt.compile(lambda x: model(x).sum())
    cf(torch.randn(2, 4))
    block._inner = lambda self, h: h * 3
    torch.testing.assert_close(cf(torch.ones(2, 4)), model(torch.ones(2, 4)).sum())
    reasons = " ".join(map(str, tt.compile_stats(cf).retrace_reasons))
    assert "_inner was replaced after compiling" in reasons, reasons


class _Scale:
    """An object of the user's class a module holds (``self.post.run(h)``)."""

    def run(self, h):
        return h * 2


SCALE = 1.0


class _Trainer:
    """The object of a compiled bound method (``tt.compile(trainer.step)``) or a compiled callable object."""

    def __init__(self, model):
        self.model = model

    def loss(self, x):
        return self.model(x).sum() * SCALE

    def step(self, x):
        return self.loss(x)

    def __call__(self, x):
        return self.loss(x)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.post = _Scale()

    def forward(self, x):
        return self.post.run(self.lin(x))


def _holder(instance_forward=False):
    if not instance_forward:
        return _Holder()
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    model.post = _Scale()
    model.forward = lambda x: model.post.run(nn.Linear.forward(model, x))  # (a forward set on the instance)
    return model


@pytest.mark.parametrize("thin", [True, False], ids=["thin", "full"])
@pytest.mark.parametrize("how", ["held object's method", "held object's method, instance forward", "bound method's class",
                                 "callable object's class", "a global its class's method reads"])
def test_methods_of_the_users_other_classes_replaced(thin, how, monkeypatch):
    # Each was run as traced, silently: only module classes' methods were scanned and guarded.
    x = torch.randn(3, 4)
    held = how.startswith("held object's method")
    model = _holder(instance_forward="instance" in how) if held else nn.Linear(4, 4)
    trainer = _Trainer(model)
    if held:
        run = lambda: model(x).sum()  # noqa: E731
        compiled = call = tt.compile(lambda: model(x).sum(), thin=thin)
    else:
        run = (lambda: trainer(x)) if how == "callable object's class" else (lambda: trainer.step(x))
        compiled = tt.compile(trainer if how == "callable object's class" else trainer.step, thin=thin)
        call = lambda: compiled(x)  # noqa: E731
    torch.testing.assert_close(call(), run())
    if held:
        monkeypatch.setattr(_Scale, "run", lambda self, h: h * 5)
    elif how == "a global its class's method reads":
        monkeypatch.setitem(globals(), "SCALE", 3.0)
    else:
        monkeypatch.setattr(_Trainer, "loss", lambda self, x: self.model(x).sum() * -2)
    for _ in range(3):
        torch.testing.assert_close(call(), run())
    stats = tt.compile_stats(compiled)
    assert stats.cache_misses == 2, stats  # (one retrace for the patch; the calls after it take the new entry)


@pytest.mark.parametrize("mode", MODES)
def test_calls_after_a_patch_stay_on_the_thin_path(mode):
    t, block = _twin(mode)
    t.steps(2)
    t.hazard(_patched(block, "helper", lambda self, h: torch.sigmoid(h) * 3))
    t.steps(2)
    before = tt.compile_stats(t.compiled).thin_calls
    t.steps(3)
    stats = tt.compile_stats(t.compiled)
    assert stats.cache_misses == 2, stats
    if mode["thin"]:  # (the new entry bound: not re-validated on every call, as it would be against the old key)
        assert stats.thin_calls == before + 3, stats


def test_a_lightning_modules_method_replaced_between_epochs():
    # ThunderCallback compiles training_step, which calls ``self.compute_loss``; a callback replaces that method on
    # the class after the first epoch.  It had trained on with the traced loss: other weights than eager's.
    L = pytest.importorskip("lightning")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def compute_loss(self, x):
            return self.lin(x).pow(2).mean()

        def training_step(self, batch, i):
            return self.compute_loss(batch)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Patch(L.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == 1:
                Module.compute_loss = lambda self, x: self.lin(x).abs().mean() * 10

    original = Module.compute_loss
    data = torch.utils.data.DataLoader(torch.randn(16, 4, generator=torch.Generator().manual_seed(0)), batch_size=4)
    weights = []
    for callbacks in ([tt.ThunderCallback()], []):
        Module.compute_loss = original
        torch.manual_seed(0)
        module = Module()
        L.Trainer(max_epochs=2, callbacks=callbacks + [Patch()], enable_progress_bar=False, logger=False,
                  enable_checkpointing=False, enable_model_summary=False, accelerator="cpu").fit(module, data)
        weights.append(module.lin.weight.detach().clone())
    torch.testing.assert_close(weights[0], weights[1])


class _Inner:
    def run(self, h):
        return h * SCALE


class _Outer:
    def __init__(self):
        self.inner = _Inner()


@pytest.mark.parametrize("thin", [True, False], ids=["thin", "full"])
@pytest.mark.parametrize("how", ["captured object", "argument object", "object two deep in a module"])
@pytest.mark.parametrize("change", ["global", "method"])
def test_objects_the_step_reaches_read_their_classes_as_eager(thin, how, change, monkeypatch):
    # A global ``trainer`` (or one passed in) whose ``loss`` reads the module's ``SCALE``; a module holding
    # ``self.a.inner.run(h)``: the methods of those objects' classes had not been scanned, so a changed global or a
    # replaced method ran the traced code, silently.
    torch.manual_seed(0)
    x = torch.randn(3, 4)
    if how == "object two deep in a module":
        model = nn.Linear(4, 4)
        model.a = _Outer()
        model.forward = lambda v: model.a.inner.run(nn.Linear.forward(model, v))
        run = lambda: model(x).sum()  # noqa: E731
        cls, name = _Inner, "run"
        compiled = tt.compile(lambda: model(x).sum(), thin=thin)
        call = compiled
    else:
        trainer = _Trainer(nn.Linear(4, 4))
        monkeypatch.setitem(globals(), "_captured_trainer", trainer)
        run = lambda: trainer.loss(x)  # noqa: E731
        cls, name = _Trainer, "loss"
        if how == "captured object":
            compiled = tt.compile(lambda v: _captured_trainer.loss(v), thin=thin)  # noqa: F821
            call = lambda: compiled(x)  # noqa: E731
        else:
            compiled = tt.compile(lambda t, v: t.loss(v), thin=thin)
            call = lambda: compiled(trainer, x)  # noqa: E731
    torch.testing.assert_close(call(), run())
    if change == "global":
        monkeypatch.setitem(globals(), "SCALE", 3.0)
    else:
        monkeypatch.setattr(cls, name, (lambda self, v: self.model(v).sum() * -2) if cls is _Trainer else
                            (lambda self, h: h * -2))
    for _ in range(3):
        torch.testing.assert_close(call(), run())
    assert tt.compile_stats(compiled).cache_misses == 2
