"""Objects a module holds (a configuration object, an activation function, an enum member) are guarded by identity
where the compiled function reads them, and what it reads from them by value, at any depth
(acquisition/instance_reads.py): a change between calls runs eager's computation, in thin mode, on the full path and
through ``tt.compile(model)``.  Before, every change below ran the program traced for the old value, silently."""
from __future__ import annotations

import dataclasses
import enum
import os
import sys
import threading
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import thunder_train as tt

from _module_modes import MODES, classes_left_as_they_were, compiled, each_change_matches_eager, retraced_for


@dataclasses.dataclass
class Cfg:
    scale: float = 2.0
    mode: str = "a"
    unread: int = 0  # never read by forward


class Inner:
    def __init__(self):
        self.shift = 1.0


class Outer:
    def __init__(self):
        self.inner = Inner()
        self.flags = ["x"]


class Mode(enum.Enum):
    A = 1
    B = 2


class Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ns = types.SimpleNamespace(scale=2.0)
        self.cfg = Cfg()
        self.outer = Outer()
        self.act = F.gelu
        self.mode = Mode.A

    def forward(self, x):
        y = self.act(self.lin(x)) * self.ns.scale
        if self.cfg.mode == "a":
            y = y * self.cfg.scale
        if self.mode is Mode.B:
            y = y + 1
        return y + self.outer.inner.shift * len(self.outer.flags)


CHANGES = {
    "namespace attribute set": lambda m: setattr(m.ns, "scale", 3.0),
    "namespace replaced": lambda m: setattr(m, "ns", types.SimpleNamespace(scale=5.0)),
    "dataclass field set": lambda m: setattr(m.cfg, "mode", "b"),
    "dataclass replaced": lambda m: setattr(m, "cfg", Cfg(scale=7.0)),
    "function replaced": lambda m: setattr(m, "act", F.relu),
    "enum member replaced": lambda m: setattr(m, "mode", Mode.B),
    "object two levels down set": lambda m: setattr(m.outer.inner, "shift", 4.0),
    "object two levels down replaced": lambda m: setattr(m.outer, "inner", Inner()),
    "list in a held object appended": lambda m: m.outer.flags.append("y"),
}


@pytest.mark.parametrize("mode", MODES)
def test_each_change_of_a_held_object_runs_eagers_computation(mode):
    m, x = Holder(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    each_change_matches_eager(lambda: call(x), lambda: m(x), [(what, lambda c=c: c(m)) for what, c in CHANGES.items()])
    retraced_for(cf, ("ns.scale.value: 2.0 → 3.0", "].ns: a different object", "cfg.mode", "].act: a different object",
                      "outer.inner.shift", "outer.flags"))


@pytest.mark.parametrize("mode", MODES)
def test_an_unread_field_and_an_unchanged_object_retrace_nothing(mode):
    m, x = Holder(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    for step in range(6):
        m.cfg.unread = step  # a field the forward never reads
        m.act = F.gelu  # the same function assigned again
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    stats = tt.compile_stats(cf)
    assert stats.cache_misses == 1 and not stats.retrace_reasons, stats.retrace_reasons
    if mode == "thin":
        assert stats.thin_calls >= 3 and not stats.thin_invalidations, stats.thin_invalidations


class Shared(nn.Module):
    """Layers sharing one config object, as transformers' layers share ``config``."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.lin = cfg, nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * self.cfg.scale


@pytest.mark.parametrize("mode", MODES)
def test_a_shared_object_is_checked_under_every_holder(mode):
    cfg = Cfg()
    m, x = nn.Sequential(Shared(cfg), Shared(cfg), Shared(cfg)), torch.randn(2, 4)
    _, call = compiled(mode, m)
    each_change_matches_eager(lambda: call(x), lambda: m(x), [
        ("the shared object's field set", lambda: setattr(cfg, "scale", 3.0)),
        ("one holder's object replaced", lambda: setattr(m[2], "cfg", Cfg(scale=5.0))),
        ("the new object's field set", lambda: setattr(m[2].cfg, "scale", 6.0)),
        ("another holder given the new object", lambda: setattr(m[0], "cfg", m[2].cfg))])


class OwnCache(nn.Module):
    """Puts a fresh object on itself in forward and reads it back: the function's own, never a guard."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.state = Inner()

    def forward(self, x):
        self.state = Inner()
        return self.lin(x) * self.state.shift


@pytest.mark.parametrize("mode", MODES)
def test_an_object_the_function_puts_there_itself_is_not_guarded(mode):
    m, x = OwnCache(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    for _ in range(5):
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    assert tt.compile_stats(cf).cache_misses == 1, tt.compile_stats(cf).retrace_reasons


def test_the_watch_leaves_classes_as_they_were_also_when_tracing_fails():
    m, x = Holder(), torch.randn(2, 4)
    classes_left_as_they_were(m, x, (Holder, Cfg, Outer, Inner, types.SimpleNamespace))
    assert Cfg.scale == 2.0 and Cfg().mode == "a" and m.cfg.scale == 2.0


def test_reads_in_another_thread_while_tracing_guard_nothing():
    """Eager code in another thread reads a watched object through its class's stand-in while the trace runs: it
    gets its values, and the trace records none of its reads."""
    m, x = Holder(), torch.randn(2, 4)
    seen = []
    started, release = threading.Event(), threading.Event()

    def read_in_another_thread():
        started.wait(10)
        seen.append((m.cfg.unread, m.cfg.scale))
        release.set()

    def step(mod, x):
        out = mod(x)  # m.cfg is watched from here on
        started.set()
        release.wait(10)
        return out

    t = threading.Thread(target=read_in_another_thread)
    t.start()
    cf = tt.compile(step, fusion=None)
    torch.testing.assert_close(cf(m, x), m(x), rtol=0, atol=0)
    t.join()
    assert seen == [(0, 2.0)]
    m.cfg.unread = 5
    cf(m, x)
    assert not any("unread" in r for r in tt.compile_stats(cf).retrace_reasons)


class HeldTensors(nn.Module):
    """Tensors that are not parameters or buffers: a private attribute and one inside a held object.  The program
    reads them as constants, by reference: changed in place they are seen; replaced, the program is traced again."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self._mask = torch.ones(4)
        self.cfg = types.SimpleNamespace(bias=torch.zeros(4))
        self.p = 1.0

    def forward(self, x):
        return self.lin(x) * self._mask * self.p + self.cfg.bias


@pytest.mark.parametrize("mode", MODES)
def test_tensors_held_outside_parameters_and_buffers_replaced_or_changed(mode):
    m, x = HeldTensors(), torch.randn(2, 4)
    _, call = compiled(mode, m)
    each_change_matches_eager(lambda: call(x), lambda: m(x), [
        ("private tensor changed in place", lambda: m._mask.fill_(2.0)),
        ("private tensor replaced", lambda: setattr(m, "_mask", torch.full((4,), 3.0))),
        ("held object's tensor replaced", lambda: setattr(m.cfg, "bias", torch.ones(4))),
        ("held object's tensor changed in place", lambda: m.cfg.bias.add_(1.0)),
        # a retrace for another reason (a public scalar) with a replaced tensor: the program traced for the new
        # tensor once ran with the old one (the two shared a prologue that passes captured tensors by reference)
        ("private tensor replaced and a public scalar set",
         lambda: (setattr(m, "_mask", torch.full((4,), 5.0)), setattr(m, "p", 2.0)))])


class Records(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stats = types.SimpleNamespace(last=None, calls=0)

    def forward(self, x):
        y = self.lin(x)
        self.stats.last = y.detach()
        return y.sum()


@pytest.mark.parametrize("thin", (False, True))
def test_a_traced_tensor_put_on_a_held_object_is_refused_and_the_object_left_as_it_was(thin):
    """Before, the object kept a placeholder of the trace (a TensorProxy) and later calls never updated it."""
    m, x = Records(), torch.randn(2, 4)
    cf = tt.compile(lambda mod, x: mod(x), thin=thin, fusion=None)
    with pytest.raises(tt.TracingError, match=r"args\[0\]\.stats\.last .*Return the tensor"):
        cf(m, x)
    assert m.stats.last is None and vars(m.stats) == {"last": None, "calls": 0}


class CountsThenFails(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.stats = Outer()

    def forward(self, x):
        y = self.lin(x)
        self.stats.flags = ["changed"]
        self.stats.inner.shift += 1.0  # an object two levels down
        self.stats.last = y
        raise ValueError("the user's error")


def test_a_failed_trace_leaves_held_objects_as_they_were():
    """What the function changed on objects a module holds is put back when tracing fails, as on a walked module
    (library_objects.rollback): a list replaced, a number added to, a traced tensor stored."""
    m, x = CountsThenFails(), torch.randn(2, 4)
    inner = m.stats.inner
    with pytest.raises(ValueError, match="the user's error"):
        tt.compile(lambda mod, x: mod(x), fusion=None)(m, x)
    assert vars(m.stats) == {"inner": inner, "flags": ["x"]} and vars(inner) == {"shift": 1.0}


# ---------------------------------------------------------------------------
# transformers: the config every layer holds
# ---------------------------------------------------------------------------
def _zoo():
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _zoo

    return _zoo


@pytest.mark.parametrize("mode", MODES)
def test_a_transformers_config_changed_between_calls(mode):
    """GPT-2 for sequence classification pools each row's last token that is not ``config.pad_token_id``; the
    compiled forward kept pooling with the old id."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, num_labels=3,
                                  pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2ForSequenceClassification(cfg)
    ids = torch.tensor([[5, 6, 7, 0, 0, 0], [8, 9, 3, 3, 4, 3]])
    fwd = lambda m, i: m(input_ids=i).logits  # noqa: E731
    _, call = compiled(mode, model, fwd)
    each_change_matches_eager(lambda: call(ids), lambda: fwd(model, ids), [
        ("config.pad_token_id", lambda: setattr(model.config, "pad_token_id", 3)),
        ("config.output_hidden_states", lambda: setattr(model.config, "output_hidden_states", True))])


def test_a_transformers_step_guards_only_the_config_fields_it_reads():
    """Fields with class defaults (transformers' configs are dataclasses) are watched like the others: a field the
    step does not read (``initializer_range``) changes nothing."""
    _z = _zoo()
    torch.manual_seed(0)
    model = _z.build("llama")
    batch = _z.batches("llama", 1)[0]
    cf = tt.compile(lambda m, b: m(**b).loss, fusion=None)
    for step in range(3):
        model.config.initializer_range = 0.01 * (step + 1)
        torch.testing.assert_close(cf(model, batch), model(**batch).loss, rtol=0, atol=0)
    assert tt.compile_stats(cf).cache_misses == 1, tt.compile_stats(cf).retrace_reasons
