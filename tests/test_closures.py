"""Globals and closure cells are inputs: walked, guarded and bound like arguments (compiler/acquisition/captured.py).

Every test compares with eager PyTorch doing the same thing.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.errors import TracingError
from _steps import assert_same_state, gpt, gpt_batches, mlp, mlp_batches, twin

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
}


def eager_step(model, opt, x, y):
    loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def closure_step(model, opt):
    """The nanoGPT / tutorial style: the step closes over model and optimizer."""

    def step(x, y):
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return step


# Module globals the global-style step reads (set by the tests).
g_model = g_opt = None
g_scale = 1.0
g_offset = torch.zeros(4)


def global_step(x, y):
    loss = F.cross_entropy(g_model(x) * g_scale + g_offset, y)
    loss.backward()
    g_opt.step()
    g_opt.zero_grad()
    return loss


def eager_global_step(model, opt, x, y, scale, offset):
    loss = F.cross_entropy(model(x) * scale + offset, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("make_model,batches", [(mlp, mlp_batches), (gpt, gpt_batches)], ids=["mlp", "gpt"])
def test_closure_step_trains_like_the_argument_step(make_model, batches, opt_name, thin):
    eager, compiled = twin(make_model, OPTIMIZERS[opt_name])
    step = tt.compile(closure_step(*compiled), thin=thin)
    for x, y in batches(5):
        torch.testing.assert_close(step(x, y), eager_step(*eager, x, y), atol=1e-6, rtol=1e-5)
    assert_same_state(eager, compiled)
    if thin:
        assert step.is_thin_bound
    # Provenance of closure inputs, as the prologue prints it.
    source = str(tt.last_prologue_traces(step)[1])  # guard_key: one comment per check, naming its input
    assert "closure['model']" in source and "closure['opt'].state[" in source


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_global_step_trains_and_sees_rebinding_of_every_global(thin):
    global g_model, g_opt, g_scale, g_offset
    eager, compiled = twin(mlp, OPTIMIZERS["adamw"])
    g_model, g_opt = compiled
    g_scale, g_offset = 1.0, torch.zeros(4)
    step = tt.compile(global_step, thin=thin)
    data = mlp_batches(16)

    def both(i):
        x, y = data[i]
        torch.testing.assert_close(step(x, y), eager_global_step(*eager, x, y, g_scale, g_offset), atol=1e-6, rtol=1e-5)

    for i in range(3):
        both(i)
    assert_same_state(eager, compiled)
    if thin:
        assert step.is_thin_bound
    # A Python float rebound: a new program (full: retrace; thin: the binding drops and rebinds).
    g_scale = 0.5
    both(3)
    assert any("globals['g_scale']" in r for r in tt.compile_stats(step).retrace_reasons)
    # A tensor rebound (same shape): the new tensor is read, nothing is baked in.
    g_offset = torch.linspace(-1, 1, 4)
    both(4)
    both(5)
    # A tensor updated in place: seen too.
    g_offset.mul_(2)
    both(6)
    # A new model and optimizer under the same names.
    eager = twin(mlp, OPTIMIZERS["adamw"], seed=1)[0]
    g_model, g_opt = copy.deepcopy(eager[0]), None
    g_opt = torch.optim.AdamW(g_model.parameters(), lr=1e-2)
    for i in range(7, 11):
        both(i)
    assert_same_state(eager, (g_model, g_opt))
    assert any("globals['g_model']" in r for r in tt.compile_stats(step).retrace_reasons)
    if thin:
        assert len(tt.compile_stats(step).thin_invalidations) == 2  # g_scale, then g_model
        assert step.is_thin_bound


def test_closure_cell_rebinding_is_seen():
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    w = 2.0

    def fn(x):
        return lin(x) * w

    cf = tt.compile(fn, thin=True)
    x = torch.randn(2, 3)
    for _ in range(3):
        torch.testing.assert_close(cf(x), fn(x))
    assert cf.is_thin_bound
    w = 3.0  # noqa: F841 — rebinds the cell fn reads
    torch.testing.assert_close(cf(x), lin(x) * 3.0)
    lin = nn.Linear(3, 3)  # noqa: F841
    torch.testing.assert_close(cf(x), fn(x))
    reasons = tt.compile_stats(cf).retrace_reasons
    assert any("closure['w']" in r for r in reasons) and any("closure['lin']" in r for r in reasons)


@pytest.mark.parametrize("source", ["global", "closure"])
def test_replaced_parameter_of_a_captured_model_is_detected_in_thin_mode(source):
    global g_model, g_opt
    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    if source == "global":
        g_model, g_opt = compiled
        step = tt.compile(lambda x, y: eager_step(g_model, g_opt, x, y), thin=True)
    else:
        step = tt.compile(closure_step(*compiled), thin=True)
    data = mlp_batches(6)
    for x, y in data[:3]:
        torch.testing.assert_close(step(x, y), eager_step(*eager, x, y))
    assert step.is_thin_bound
    # Replace a parameter on both models (and the optimizers' references to it).
    for model, opt in (eager, compiled):
        new = nn.Parameter(torch.full_like(model[0].weight, 0.01))
        model[0].weight = new
        opt.param_groups[0]["params"][0] = new
    for x, y in data[3:]:
        torch.testing.assert_close(step(x, y), eager_step(*eager, x, y))
    assert_same_state(eager, compiled)


def helper_loss(out, y):
    return F.cross_entropy(out, y) * g_scale  # a helper in the step's module: its globals are inputs too


def test_globals_read_by_a_helper_in_the_steps_module_are_inputs():
    global g_scale
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    g_scale = 1.0

    def fn(x, y):
        return helper_loss(model(x), y)

    cf = tt.compile(fn)
    x, y = mlp_batches(1)[0]
    torch.testing.assert_close(cf(x, y), fn(x, y))
    g_scale = 4.0
    torch.testing.assert_close(cf(x, y), fn(x, y))
    assert any("globals['g_scale']" in r for r in tt.compile_stats(cf).retrace_reasons)


def test_an_optimizer_held_by_a_plain_object_trains_like_eager():
    class Holder:  # a plain object: its attributes are walked (tests/test_defaults_and_objects.py)
        pass

    eager, compiled = twin(mlp, lambda ps: torch.optim.SGD(ps, lr=0.1))
    h = Holder()
    h.model, h.opt = compiled
    cf = tt.compile(lambda x, y: eager_step(h.model, h.opt, x, y))
    for x, y in mlp_batches(3):
        torch.testing.assert_close(cf(x, y), eager_step(*eager, x, y))
    assert_same_state(eager, compiled)


def test_an_optimizer_the_walker_cannot_reach_is_a_clear_error():
    class Holder:
        pass

    h = Holder()
    h.inner = Holder()
    h.inner.inner = Holder()
    h.inner.inner.inner = Holder()  # plain objects are walked 3 deep; deeper ones are checked by identity only
    deepest = h.inner.inner.inner
    deepest.model = nn.Linear(6, 4)
    deepest.opt = torch.optim.SGD(deepest.model.parameters(), lr=0.1)
    del deepest
    with pytest.raises(TracingError, match="SGD.step.*not an input of the function.*Pass it as an argument"):
        tt.compile(lambda x, y: eager_step(h.inner.inner.inner.model, h.inner.inner.inner.opt, x, y))(*mlp_batches(1)[0])


@pytest.mark.parametrize("make", [lambda: iter([torch.ones(2)] * 3), lambda: (t for t in [torch.ones(2)] * 3)],
                         ids=["iterator", "generator"])
def test_an_iterator_argument_or_global_is_a_clear_error(make):
    with pytest.raises(TracingError, match=r"args\[0\] is an iterator.*next\(\) inside it would return the same"):
        tt.compile(lambda it: next(it) * 2)(make())
    it = make()
    with pytest.raises(TracingError, match=r"closure\['it'\] is an iterator"):
        tt.compile(lambda: next(it) * 2)()


g_counter = 0


def counting_step(x):
    global g_counter
    g_counter += 1
    return x * 2


def test_assigning_a_global_or_nonlocal_inside_the_function_is_a_clear_error():
    with pytest.raises(TracingError, match="counting_step assigns the global 'g_counter'.*once, while tracing"):
        tt.compile(counting_step)(torch.ones(2))
    n = 0

    def fn(x):
        nonlocal n
        n += 1
        return x * n

    with pytest.raises(TracingError, match="assigns the nonlocal 'n'"):
        tt.compile(fn)(torch.ones(2))


def test_a_captured_list_the_function_appends_to_gets_the_values_of_every_call():
    losses = []

    def fn(x):
        y = (x * 2).sum()
        losses.append(y)
        return y

    cf = tt.compile(fn)
    xs = [torch.randn(2) for _ in range(3)]
    for x in xs:
        cf(x)
    assert len(losses) == 3  # tests/test_container_effects.py has the whole class
    for got, x in zip(losses, xs):
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, (x * 2).sum())


def test_a_model_passed_and_also_read_from_a_closure_is_one_input():
    torch.manual_seed(0)
    model = nn.Linear(3, 3)

    def fn(m, x):
        return m(x) + model(x)

    cf = tt.compile(fn, thin=True)
    x = torch.randn(2, 3)
    for _ in range(3):
        torch.testing.assert_close(cf(model, x), fn(model, x))
    other = nn.Linear(3, 3)
    torch.testing.assert_close(cf(other, x), fn(other, x))
    model = nn.Linear(3, 3)  # noqa: F841 — rebinding the captured name is still seen
    torch.testing.assert_close(cf(other, x), fn(other, x))


# ---------------------------------------------------------------------------
# ThunderCallback: a training_step that reads globals of its module
# ---------------------------------------------------------------------------
g_criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5, 1.5]))
g_temperature = 1.0


def scaled_logits(logits):
    return logits / g_temperature


def _lightning_fit(callbacks, max_steps=8):
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    class GlobalReader(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return g_criterion(scaled_logits(self.net(x)), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Anneal(L.Callback):  # rebinds the global the step reads, halfway through
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            global g_temperature
            g_temperature = 1.0 if trainer.global_step < max_steps // 2 else 2.0

    from _lightning_losses import Losses

    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(64, 6, generator=g), torch.randint(0, 4, (64,), generator=g))
    torch.manual_seed(0)
    model, losses = GlobalReader(), Losses()
    trainer = L.Trainer(callbacks=[*callbacks, Anneal(), losses], max_steps=max_steps, enable_progress_bar=False, logger=False,
                        enable_checkpointing=False, enable_model_summary=False, accelerator="cpu", devices=1,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(ds, batch_size=8))
    return model, torch.stack(losses.losses)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
@pytest.mark.parametrize("thin,fuse", [(False, False), (True, False), (True, True)], ids=["full", "thin", "thin-fused"])
def test_thunder_callback_step_reading_globals_matches_plain_trainer(thin, fuse):
    from thunder_train.callbacks import ThunderCallback

    eager_model, eager_losses = _lightning_fit([])
    cb = ThunderCallback(thin=thin, fuse_optimizer=fuse)
    model, losses = _lightning_fit([cb])
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(eager_model.named_parameters(), model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    reasons = tt.compile_stats(cb.compiled("training_step")).retrace_reasons
    assert any("globals['g_temperature']" in r for r in reasons), reasons
