"""Objects a module holds where no attribute read leads to them: the items of its lists, tuples and dicts, the
members of ``__slots__`` objects, a bound method's object, a ``functools.partial``'s arguments, and what a small
numpy array holds (acquisition/instance_reads.py ``_watch_value``).  A container or partial is checked by its
contents (its objects by identity), a ``__slots__`` object by every member, a method's object by what the function
read from it, an array by its bytes.  Before, every change below ran the program traced for the old value,
silently, in all three modes."""
from __future__ import annotations

import collections
import dataclasses
import functools

import numpy as np

import pytest
import torch
from torch import nn

import thunder_train as tt

from _module_modes import MODES, classes_left_as_they_were, compiled, each_change_matches_eager, retraced_for


class Cfg:
    def __init__(self, scale=2.0):
        self.scale = scale
        self.unread = 0


class Slotted:
    __slots__ = ("scale", "inner")

    def __init__(self):
        self.scale, self.inner = 2.0, Cfg(1.0)


@dataclasses.dataclass(slots=True)
class SlottedData:
    scale: float = 2.0


class Helper:
    def __init__(self, k=2.0):
        self.k = k

    def apply(self, y):
        return y * self.k


Pair = collections.namedtuple("Pair", "cfg shift")


def _scaled(cfg, y, power=1):
    return y * cfg.scale ** power


class Paths(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.cfgs = [Cfg(), Cfg(3.0)]
        self.table = {"a": Cfg()}
        self.ordered = collections.OrderedDict(b=Cfg(0.5))
        self.nested = ([Cfg(1.5)],)
        self.pair = Pair(Cfg(1.0), 0.5)
        self.slotted = Slotted()
        self.data = SlottedData()
        self.fn = Helper().apply
        self.weights = np.array([1.5, 2.0])
        self.post = functools.partial(_scaled, Cfg(1.25), power=1)

    def forward(self, x):
        y = self.fn(self.lin(x)) * self.cfgs[0].scale * len(self.cfgs)
        y = y * self.table["a"].scale * self.ordered["b"].scale * self.nested[0][0].scale
        y = y * self.pair.cfg.scale + self.pair.shift
        y = self.post(y) * float(self.weights[1])
        return y * self.slotted.scale * self.slotted.inner.scale * self.data.scale


CHANGES = {
    "a list item's field set": lambda m: setattr(m.cfgs[0], "scale", 5.0),
    "a list item replaced": lambda m: m.cfgs.__setitem__(0, Cfg(6.0)),
    "a list appended": lambda m: m.cfgs.append(Cfg()),
    "a dict item's field set": lambda m: setattr(m.table["a"], "scale", 7.0),
    "a dict item replaced": lambda m: m.table.__setitem__("a", Cfg(8.0)),
    "an OrderedDict item's field set": lambda m: setattr(m.ordered["b"], "scale", 9.0),
    "an object in a list in a tuple set": lambda m: setattr(m.nested[0][0], "scale", 2.5),
    "an object in a named tuple set": lambda m: setattr(m.pair.cfg, "scale", 3.5),
    "a __slots__ member set": lambda m: setattr(m.slotted, "scale", 4.0),
    "an object in a __slots__ member set": lambda m: setattr(m.slotted.inner, "scale", 4.5),
    "a slots dataclass field set": lambda m: setattr(m.data, "scale", 1.25),
    "a bound method's object's field set": lambda m: setattr(m.fn.__self__, "k", 3.0),
    "the bound method replaced": lambda m: setattr(m, "fn", Helper(0.25).apply),
    "a numpy array changed in place": lambda m: m.weights.__setitem__(1, 3.0),
    "a partial's object argument's field set": lambda m: setattr(m.post.args[0], "scale", 0.75),
    "a partial's keyword changed in place": lambda m: m.post.keywords.__setitem__("power", 2),
}


@pytest.mark.parametrize("mode", MODES)
def test_each_change_behind_a_container_a_slot_or_a_method_runs_eagers_computation(mode):
    m, x = Paths(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    each_change_matches_eager(lambda: call(x), lambda: m(x), [(what, lambda c=c: c(m)) for what, c in CHANGES.items()])
    retraced_for(cf, ("].cfgs[0].scale.value: 2.0 → 5.0", "].cfgs.value", "].table['a'].scale", "].slotted.scale",
                      "].slotted.inner.scale", "].fn.__self__.k.value: 2.0 → 3.0", "].fn: a different object",
                      "].weights.value", "].post.args[0].scale.value: 1.25 → 0.75", "].post.value"))


@pytest.mark.parametrize("mode", MODES)
def test_containers_rebuilt_with_the_same_items_and_unread_fields_retrace_nothing(mode):
    m, x = Paths(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    for step in range(6):
        m.cfgs = list(m.cfgs)  # a new list, the same objects
        m.table = dict(m.table)
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    for step in range(6):
        m.cfgs[0].unread = step  # a field the forward never reads
        m.cfgs[:] = list(m.cfgs)
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    stats = tt.compile_stats(cf)
    assert stats.cache_misses == 1 and not stats.retrace_reasons, stats.retrace_reasons
    if mode == "thin":  # (assigning a module's attribute validates the binding again: the first loop's only)
        assert stats.thin_calls >= 5, stats.thin_invalidations
        assert all("was assigned" in r for r in stats.thin_invalidations), stats.thin_invalidations


def test_the_watch_leaves_the_items_classes_as_they_were():
    m, x = Paths(), torch.randn(2, 4)
    classes_left_as_they_were(m, x, (Cfg, Helper, Slotted, SlottedData, Pair))


@pytest.mark.parametrize("thin", [True, False])
def test_an_rnn_step_does_not_retrace_on_its_weight_references(thin):
    """torch's RNNs keep weak references to their weights and point them at what the forward finds (the trace's
    own values while it runs): bookkeeping, not guarded."""
    torch.manual_seed(0)
    m = nn.LSTM(4, 8, num_layers=2, batch_first=True)
    ref = nn.LSTM(4, 8, num_layers=2, batch_first=True)
    ref.load_state_dict(m.state_dict())
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1) for mod in (m, ref)]

    def step(mod, opt, x):
        loss = mod(x)[0].square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    cf = tt.compile(step, thin=thin, fusion=None)
    for _ in range(5):
        x = torch.randn(2, 3, 4)
        torch.testing.assert_close(cf(m, opts[0], x), step(ref, opts[1], x))
    for p, q in zip(m.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    stats = tt.compile_stats(cf)
    assert stats.cache_misses <= 2, stats.retrace_reasons  # (the optimizer's state created at the first step)


@pytest.mark.parametrize("mode", MODES)
def test_a_rebuilt_container_is_checked_against_the_traced_contents_not_the_old_list(mode):
    """Thin mode binds a container by its contents: its checks come from the trace's key, not from the list the
    trace read, which the module may no longer hold (here changed after it was replaced).  Before, the binding made
    after the replacement checked the new list against the old one's items and ran the old program once they
    matched."""
    m, x = Paths(), torch.randn(2, 4)
    _, call = compiled(mode, m)
    for _ in range(3):
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    old = m.cfgs
    m.cfgs = list(old)  # the same items in a new list: the same program
    old.append(Cfg())  # the list the trace read, no longer the module's
    for _ in range(4):  # (validated again, then bound)
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    m.cfgs.append(old[2])  # the new list appended to, as the old one was
    for _ in range(3):
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)


class Tally:
    __slots__ = ("scale", "calls", "last")

    def __init__(self):
        self.scale, self.calls = 2.0, 0


class WritesSlots(nn.Module):
    def __init__(self, fails):
        super().__init__()
        self.lin, self.tally, self.fails = nn.Linear(4, 4), Tally(), fails

    def forward(self, x):
        y = self.lin(x) * self.tally.scale
        self.tally.calls += 1
        if self.fails:
            raise ValueError("the user's error")
        self.tally.last = y.detach()
        return y


@pytest.mark.parametrize("fails", [False, True])
def test_a_slots_object_written_by_the_function_is_left_as_it_was(fails):
    """A ``__slots__`` object a module holds is put back as a ``__dict__`` one is: after a failed trace, and when
    the function stored a traced tensor on it (refused: it would keep a placeholder).  Before, the object kept the
    TensorProxy and the count the failed trace added."""
    m, x = WritesSlots(fails), torch.randn(2, 4)
    match = "the user's error" if fails else r"args\[0\]\.tally\.last .*Return the tensor"
    with pytest.raises(ValueError if fails else tt.TracingError, match=match):
        tt.compile(lambda mod, x: mod(x), fusion=None)(m, x)
    assert m.tally.calls == 0 and m.tally.scale == 2.0 and not hasattr(m.tally, "last")
