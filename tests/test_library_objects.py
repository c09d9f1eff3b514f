"""Attributes library code sets lazily on its own objects while we trace (issue 25, item 7).

A fresh ``torch.amp.GradScaler`` creates its scale on the first ``scaler.scale(loss)``; a torch distribution
caches a ``lazy_property`` on first access.  Inside a compiled function those values would be placeholders:
the scaler is initialised for real before tracing (what eager's first call does), other cases are refused
with a clear error, and a failed trace leaves every such object exactly as before, still usable eagerly.
"""
import copy

import pytest
import torch

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


def scaled_step(m, scaler, x):
    loss = m(x).pow(2).mean()
    scaler.scale(loss).backward()
    return loss


@pytest.mark.parametrize("thin", [False, True])
def test_fresh_grad_scaler_matches_eager(thin):
    """scale(loss).backward() inside, unscale/step/update outside, with an overflow step: eager's values."""
    torch.manual_seed(0)
    me = torch.nn.Linear(4, 2)
    mc = copy.deepcopy(me)
    runs = []
    for m, f in ((me, scaled_step), (mc, tt.compile(scaled_step, thin=thin))):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 4, growth_interval=1)
        gen = torch.Generator().manual_seed(1)
        seen = []
        for i in range(5):
            x = torch.randn(3, 4, generator=gen)
            if i == 2:
                x[0, 0] = float("inf")  # the step is skipped and the scale backs off
            loss = f(m, scaler, x)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            seen.append((loss.detach().clone(), scaler.get_scale(), [p.detach().clone() for p in m.parameters()]))
        runs.append(seen)
    for i, ((le, se, pe), (lc, sc, pc)) in enumerate(zip(*runs)):
        torch.testing.assert_close(lc, le, equal_nan=True, msg=lambda m: f"loss {i}: {m}")
        assert se == sc, i
        for a, b in zip(pe, pc):
            torch.testing.assert_close(b, a, msg=lambda m: f"step {i}: {m}")


def test_failed_trace_leaves_a_fresh_scaler_fresh():
    def step(m, scaler, x):
        loss = m(x).pow(2).mean()
        scaler.scale(loss).backward()
        raise ValueError("user error after the scaler was used")

    m = torch.nn.Linear(4, 2)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="user error"):
        tt.compile(step)(m, scaler, torch.randn(3, 4))
    assert scaler._scale is None and scaler._growth_tracker is None
    scaled_step(m, scaler, torch.randn(3, 4))  # still works eagerly
    assert scaler.get_scale() == 2.0 ** 16


def test_lazy_property_of_a_distribution_is_refused_and_put_back():
    """``Categorical.probs`` is computed from the logits on first access and cached on the instance."""
    def step(dist, w):
        return (dist.probs * w).sum()

    d = torch.distributions.Categorical(logits=torch.randn(5))
    w = torch.randn(5)
    assert "probs" not in vars(d)
    with pytest.raises(TracingError, match="probs was set inside the compiled function"):
        tt.compile(step)(d, w)
    assert "probs" not in vars(d)  # put back: eager use still works
    torch.testing.assert_close(step(d, w), (torch.softmax(d.logits, -1) * w).sum())


def test_a_failed_trace_puts_back_attributes_of_other_library_objects():
    """Any attribute a traced call set on a library object is put back when the call fails."""
    def step(m, opt, sched, x):
        loss = m(x).sum()
        loss.backward()
        opt.step()
        sched.base_lrs = [0.5]  # library-object attribute written while tracing
        raise RuntimeError("fails later")

    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    before = dict(vars(sched))
    with pytest.raises(RuntimeError, match="fails later"):
        tt.compile(step)(m, opt, sched, torch.randn(3, 2))
    assert vars(sched) == before


def test_a_refused_scaler_step_leaves_its_per_optimizer_states_as_before():
    """``scaler.step(opt)`` inside a step is refused (its skip decision reads gradient values); the entry that
    ``unscale_`` adds to the scaler's ``_per_optimizer_states`` defaultdict while tracing is taken out again."""
    def step(m, opt, scaler, x):
        scaler.scale(m(x).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()

    m = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(TracingError, match="GradScaler"):
        tt.compile(step)(m, opt, scaler, torch.randn(3, 4))
    assert dict(scaler._per_optimizer_states) == {} and scaler._scale is None
    step(m, opt, scaler, torch.randn(3, 4))  # eager still works on it
    assert scaler.get_scale() == 2.0 ** 16


def test_traced_values_in_containers_a_library_object_holds_are_refused_and_put_back():
    """A traced tensor stored in a dict or list inside a library object is named, put back and refused;
    a failed call puts back the containers' entries (added, replaced and removed keys; list contents)."""
    def stores(sched, x):
        sched.__dict__.setdefault("_cache", {})
        sched.state_dict()  # library code runs on the real object
        sched._last_lr[0] = x.sum()  # a traced value inside a list it holds
        return x * 2

    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    last_lr = sched._last_lr
    with pytest.raises(TracingError, match="an entry of a container it holds"):
        tt.compile(stores)(sched, torch.randn(3))
    assert sched._last_lr is last_lr and sched._last_lr == [0.1] and "_cache" not in vars(sched)

    sched.extra = {"a": {"b": 1.0, "c": [1, 2]}}
    nested, inner = sched.extra["a"], sched.extra["a"]["c"]

    def edits_then_fails(sched, x):
        sched.extra["a"]["b"] = 2.0
        sched.extra["a"]["new"] = 3.0
        sched.extra["a"]["c"].append(3)
        del sched.extra["a"]["c"][0]
        raise RuntimeError("fails after editing")

    with pytest.raises(RuntimeError, match="fails after editing"):
        tt.compile(edits_then_fails)(sched, torch.randn(3))
    assert sched.extra["a"] is nested and nested == {"b": 1.0, "c": [1, 2]} and nested["c"] is inner
