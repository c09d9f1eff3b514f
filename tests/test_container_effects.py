"""Lists, dicts, dataclasses and objects a compiled step changes: the epilogue replays the change on every call
(compiler/acquisition/containers.py). Every case is compared with eager PyTorch doing the same calls.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.errors import TracingError
from _steps import assert_same_state, mlp, mlp_batches, twin

MODES = [dict(), dict(thin=True)]
MODE_IDS = ["full", "thin"]


def assert_same_tree(a, b):
    """Equal structure, equal Python values, tensors equal in value."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            assert_same_tree(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b), (a, b)
        for k in a:
            assert_same_tree(a[k], b[k])
    elif dataclasses.is_dataclass(a) or hasattr(a, "__dict__"):
        assert_same_tree(vars(a), vars(b))
    else:
        assert a == b, (a, b)


def append(x, log):
    log.append(x.sum())
    return x * 2


def counter(x, d):
    d["n"] = d["n"] + 1
    return x * d["n"]


def metrics(x, m):
    loss = (x * 2).sum()
    m["loss"] = loss
    m["max"] = x.max()
    return loss


def extend_insert_pop(x, log):
    log.extend([x.sum(), x.mean()])
    log.insert(0, x.max())
    last = log.pop()
    return x + last


def clear(x, log):
    n = len(log)
    log.clear()
    log.append(x * n)
    return x


def dict_ops(x, d):
    d.update(a=x.sum(), b=2)
    old = d.pop("old")
    d.setdefault("c", x.min())
    d.setdefault("a", None)  # present: no change
    return x + old


def reordered(x, d):
    v = d.pop("first")
    d["first"] = v * 2  # popped and re-inserted: now the last key, as in eager
    return x


def nested(x, d):
    d["hist"].append(x.sum())
    d["stats"]["count"] += 1
    d["new"] = {"pair": (x.max(), [x.min(), 3])}
    return x


def read_back(x, log):
    log.append(x * 2)
    log.append(x * 3)
    return sum(log)  # the function reads what it stored, in the same step


def replaced_item(x, log):
    log[0] = log[0] * 10
    del log[1]
    return x


def stores_inputs(x, d):
    d["x"] = x  # the input tensor itself: eager stores the same object
    x.mul_(2)
    d["y"] = x + 1
    return x


CASES = {
    "append": (append, lambda: []),
    "counter": (counter, lambda: {"n": 0}),
    "metrics": (metrics, lambda: {}),
    "extend_insert_pop": (extend_insert_pop, lambda: [torch.tensor(1.0)]),
    "clear": (clear, lambda: [1, 2]),
    "dict_ops": (dict_ops, lambda: {"old": torch.tensor(5.0), "keep": 1}),
    "reordered": (reordered, lambda: {"first": torch.tensor(1.0), "second": 2}),
    "nested": (nested, lambda: {"hist": [], "stats": {"count": 0}}),
    "read_back": (read_back, lambda: []),
    "replaced_item": (replaced_item, lambda: [torch.tensor(2.0), 3, torch.tensor(4.0)]),
    "stores_inputs": (stores_inputs, lambda: {}),
}


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_container_argument_changed_by_the_step_matches_eager_fresh_each_call(name, mode):
    fn, make = CASES[name]
    cf = tt.compile(fn, **mode)
    for i in range(4):
        x = torch.arange(3.0) + i
        ca, ea = make(), make()
        xa, xe = x.clone(), x.clone()
        assert_same_tree(cf(xa, ca), fn(xe, ea))
        assert_same_tree(ca, ea)
        assert_same_tree(xa, xe)
    if name == "stores_inputs":
        assert ca["x"] is xa  # the stored input is the caller's tensor object, as in eager
    if mode:
        assert cf.is_thin_bound


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name", ["append", "counter", "metrics", "nested", "dict_ops", "clear"])
def test_a_container_carried_across_calls_matches_eager(name, mode):
    fn, make = CASES[name]
    cf = tt.compile(fn, **mode)
    ca, ea = make(), make()
    if name == "dict_ops":
        ca, ea = [make() for _ in range(4)], [make() for _ in range(4)]  # pop('old') needs the key each call
    for i in range(4):
        x = torch.arange(3.0) + i
        a, e = (ca[i], ea[i]) if name == "dict_ops" else (ca, ea)
        assert_same_tree(cf(x, a), fn(x, e))
    assert_same_tree(ca, ea)


def test_the_epilogue_prints_the_replayed_changes():
    cf = tt.compile(metrics)
    cf(torch.ones(2), {})
    text = str(cf._last.epilogue)
    assert "m['loss'] = extras[" in text or "arg1['loss'] = extras[" in text, text


# ---------------------------------------------------------------------------
# Captured containers (globals and closure cells)
# ---------------------------------------------------------------------------
g_log: list = []
g_metrics: dict = {}


def global_logging_step(x):
    y = (x * 2).sum()
    g_log.append(y)
    g_metrics["last"] = y
    g_metrics["calls"] = g_metrics.get("calls", 0) + 1
    return y


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_captured_containers_changed_by_the_step_match_eager(mode):
    global g_log, g_metrics
    g_log, g_metrics = [], {}
    cf = tt.compile(global_logging_step, **mode)
    xs = [torch.randn(3) for _ in range(4)]
    for x in xs:
        cf(x)
    compiled = (g_log, g_metrics)
    g_log, g_metrics = [], {}
    for x in xs:
        global_logging_step(x)
    assert_same_tree(compiled, (g_log, g_metrics))
    # Rebinding the global to a new list: the next call appends to the new one.
    g_log = []
    cf(xs[0])
    assert len(g_log) == 1 and len(compiled[0]) == 4

    losses = []

    def closure_step(x):
        loss = (x ** 2).mean()
        losses.append(loss)
        return loss

    cs = tt.compile(closure_step, **mode)
    for x in xs:
        cs(x)
    assert_same_tree(losses, [(x ** 2).mean() for x in xs])


# ---------------------------------------------------------------------------
# Training steps with a metrics dict
# ---------------------------------------------------------------------------
def step_with_metrics(model, opt, x, y, metrics):
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    metrics["loss"] = loss.detach()
    metrics["grad_norm"] = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    metrics.setdefault("history", []).append(loss.detach())
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_whole_training_step_filling_a_metrics_dict_matches_eager(mode):
    eager, compiled = twin(mlp, lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-6))
    cf = tt.compile(step_with_metrics, **mode)
    for x, y in mlp_batches(5):
        me, mc = {}, {}
        torch.testing.assert_close(cf(*compiled, x, y, mc), step_with_metrics(*eager, x, y, me))
        assert_same_tree(mc, me)
    assert_same_state(eager, compiled)


def test_a_forward_storing_an_activation_keeps_its_gradient():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)

    def fwd(x, cache):
        h = model(x)
        cache["h"] = h
        return h.relu().sum()

    cf = tt.compile(fwd)
    x = torch.randn(2, 4)
    ce, cc = {}, {}
    le = fwd(x, ce)
    lc = cf(x, cc)
    (le + ce["h"].sum()).backward()
    ge = model.weight.grad.clone()
    model.zero_grad()
    (lc + cc["h"].sum()).backward()
    torch.testing.assert_close(model.weight.grad, ge)


# ---------------------------------------------------------------------------
# Dataclasses and plain objects
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class TrainState:
    step: int
    ema: torch.Tensor
    losses: list = dataclasses.field(default_factory=list)


def dataclass_step(x, state):
    state.step += 1
    state.ema = state.ema * 0.9 + x.mean() * 0.1
    state.losses.append(x.sum())
    return x * state.step


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_a_dataclass_changed_by_the_step_matches_eager(mode):
    cf = tt.compile(dataclass_step, **mode)
    sa, se = TrainState(0, torch.zeros(())), TrainState(0, torch.zeros(()))
    for i in range(4):
        x = torch.randn(3)
        assert_same_tree(cf(x, sa), dataclass_step(x, se))
    assert_same_tree(sa, se)
    # fresh state each call: the cache entry is reused
    for i in range(3):
        x = torch.randn(3)
        a, e = TrainState(7, torch.ones(())), TrainState(7, torch.ones(()))
        assert_same_tree(cf(x, a), dataclass_step(x, e))
        assert_same_tree(a, e)


def test_a_container_reached_twice_and_changed_is_a_clear_error():
    def fn(x, a, b):
        a.append(x)
        return x

    shared = []
    with pytest.raises(TracingError, match=r"changed args\[1\], which is the same list as args\[2\]"):
        tt.compile(fn)(torch.ones(2), shared, shared)
    assert shared == []


def test_storing_an_unsupported_object_holding_a_tensor_is_a_clear_error():
    class Box:
        def __init__(self, v):
            self.v = v

    def fn(x, d):
        d["box"] = Box(x * 2)
        return x

    with pytest.raises(TracingError, match=r"args\[1\]\['box'\]: the function stored a Box holding a tensor"):
        tt.compile(fn)(torch.ones(2), {})


class Counter:
    def __init__(self):
        self.calls = 0
        self.last = None


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_an_attribute_set_on_a_plain_object_is_replayed_on_every_call(mode):
    def fn(x, c):
        c.calls = c.calls + 1
        c.last = x.sum()
        return x * c.calls

    ca, ce = Counter(), Counter()
    cf = tt.compile(fn, **mode)
    for i in range(4):
        x = torch.randn(3)
        assert_same_tree(cf(x, ca), fn(x, ce))
    assert_same_tree(ca, ce)
    assert ca.calls == 4


def test_a_large_list_held_by_a_plain_object_changed_inside_is_a_clear_error():
    class Holder:
        def __init__(self):
            self.history = list(range(300))

    def fn(x, h):
        h.history.append(x.sum())
        return x

    h = Holder()
    with pytest.raises(TracingError, match=r"changed args\[1\]\.history, a list of more than 256 items"):
        tt.compile(fn)(torch.ones(2), h)
    assert h.history == list(range(300))


def test_a_list_that_grows_on_every_call_is_right_and_warns_that_every_call_retraces():
    log_c, log_e = [], []
    cf = tt.compile(append)
    with pytest.warns(UserWarning, match=r"append: the last 8 calls each traced a new program\..*the function changes args\[1\]"):
        for i in range(9):
            x = torch.full((2,), float(i))
            assert_same_tree(cf(x, log_c), append(x, log_e))
    assert_same_tree(log_c, log_e)


def test_a_list_held_by_a_module_changed_inside_is_a_clear_error_and_left_as_it_was():
    class WithHistory(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.history = [1]

    m = WithHistory()

    def fn(m, x):
        y = m.fc(x).sum()
        m.history.append(y)
        return y

    with pytest.raises(TracingError, match=r"changed args\[0\]\.history, a list held by the module WithHistory"):
        tt.compile(fn)(m, torch.ones(2))
    assert m.history == [1]
