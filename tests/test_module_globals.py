"""What a model's own code reads from its file's globals and from closure cells: inputs like the step's
(acquisition/captured.py ``Scanner.module_class``): ``forward``, the methods and properties it names, the helpers
they call, the functions a module holds and the methods of the objects it holds, where they are the user's code.  Before, a change between calls of any
global below ran the program traced for the old value, silently, in all three modes; a forward assigning a global
did so once, while tracing."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import thunder_train as tt

from _module_modes import MODES, compiled, each_change_matches_eager, retraced_for

SCALE = 2.0
CFG = types.SimpleNamespace(shift=0.5, mode="a")
TABLE = {"gain": 1.5}
BIAS = 0.25
UNREAD = 0


def _helper(y):
    return y * TABLE["gain"]


def _make_act(cfg):
    return lambda y: y * cfg.k


class Helper:
    """A plain object the model holds, whose method reads a global."""

    def __init__(self, k=1.0):
        self.k = k

    def run(self, y):
        return y * self.k + BIAS


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act_cfg = types.SimpleNamespace(k=1.25)
        self.act = _make_act(self.act_cfg)
        self.helpers = [Helper(), Helper(0.5)]

    @property
    def offset(self):
        return CFG.shift

    def _scaled(self, y):
        return y * SCALE

    def forward(self, x):
        y = _helper(self._scaled(self.lin(x))) + self.offset
        if CFG.mode == "b":
            y = y.relu()
        return self.helpers[1].run(self.act(y))


def _set(name, value):
    globals()[name] = value


CHANGES = [
    ("a global float a method reads", lambda m: _set("SCALE", 3.0)),
    ("a global object's field a property reads", lambda m: setattr(CFG, "shift", -1.0)),
    ("a global object's field forward branches on", lambda m: setattr(CFG, "mode", "b")),
    ("a global dict's item a helper reads", lambda m: TABLE.__setitem__("gain", 0.5)),
    ("a global object replaced", lambda m: _set("CFG", types.SimpleNamespace(shift=0.25, mode="a"))),
    ("a closure cell's object a held function reads", lambda m: setattr(m.act_cfg, "k", 4.0)),
    ("a global a held object's method reads", lambda m: _set("BIAS", -0.5)),
    ("the held object's own field", lambda m: setattr(m.helpers[1], "k", 2.0)),
]


@pytest.fixture(autouse=True)
def _restore_globals():
    saved = dict(SCALE=SCALE, CFG=CFG, TABLE=TABLE, BIAS=BIAS, UNREAD=UNREAD)
    yield
    globals().update(saved)
    CFG.shift, CFG.mode, TABLE["gain"] = 0.5, "a", 1.5


@pytest.mark.parametrize("mode", MODES)
def test_each_global_the_models_code_reads_changed_between_calls(mode):
    m, x = Model(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    each_change_matches_eager(lambda: call(x), lambda: m(x), [(what, lambda c=c: c(m)) for what, c in CHANGES])
    retraced_for(cf, ("globals['SCALE']", "globals['CFG'].shift", "globals['TABLE']", "globals['BIAS']"))


@pytest.mark.parametrize("mode", MODES)
def test_a_global_the_model_does_not_read_retraces_nothing(mode):
    m, x = Model(), torch.randn(2, 4)
    cf, call = compiled(mode, m)
    for step in range(5):
        _set("UNREAD", step)
        torch.testing.assert_close(call(x), m(x), rtol=0, atol=0)
    assert tt.compile_stats(cf).cache_misses == 1, tt.compile_stats(cf).retrace_reasons


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        global UNREAD
        UNREAD += 1
        return self.lin(x)


def test_a_forward_assigning_a_global_is_an_error_that_names_it():
    m, x = Counting(), torch.randn(2, 4)
    with pytest.raises(tt.TracingError, match="Counting.forward assigns the global 'UNREAD'"):
        tt.compile(m, fusion=None)(x)
    assert UNREAD == 0
