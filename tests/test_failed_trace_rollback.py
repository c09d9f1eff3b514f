"""A call that fails while tracing leaves every user object exactly as before (issue 25, autograd9 item 4).

The function runs on the real module, optimizer, LR scheduler and GradScaler objects while it is traced.  What it
or library code sets on them before the failure (``self.calls += 1`` in a forward, the ``_opt_called`` flag an LR
scheduler's wrapper of ``optimizer.step`` sets, a scheduler's ``_last_lr``, a GradScaler's lazily made scale) must be
put back: these tests compare every attribute, recursively through containers, before and after.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _steps import cross_entropy_step


def state_of(obj, seen=None, depth=0):
    """Every attribute of ``obj``, recursively through containers and objects with a ``__dict__``: tensors by
    identity, version, flags and ``.grad`` identity; other values by value or, if not comparable, by identity."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        return ("tensor", id(obj), obj._version, obj.requires_grad, id(obj.grad) if obj.grad is not None else None)
    if isinstance(obj, (int, float, str, bool, type(None), torch.device, torch.dtype)):
        return ("value", type(obj).__name__, obj)
    if id(obj) in seen or depth > 6:
        return ("seen", id(obj))
    seen.add(id(obj))
    if isinstance(obj, dict):
        return ("dict", type(obj).__name__, id(obj), {repr(k) if not isinstance(k, torch.Tensor) else ("key", id(k)):
                                                      state_of(v, seen, depth + 1) for k, v in obj.items()})
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, id(obj) if isinstance(obj, list) else None, [state_of(v, seen, depth + 1) for v in obj])
    d = getattr(obj, "__dict__", None)
    if type(d) is dict and not callable(obj) or isinstance(obj, nn.Module):
        return ("object", type(obj).__name__, id(obj), {k: state_of(v, seen, depth + 1) for k, v in d.items()})
    return ("identity", type(obj).__name__, id(obj))


class Counting(nn.Module):
    """Writes Python attributes on itself and a submodule in forward, as user models do."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        self.last_shape = tuple(x.shape)
        self.head.seen = True
        return self.head(self.norm(self.lin(x)).relu())


def objects():
    torch.manual_seed(0)
    m = Counting()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu")
    return m, opt, sched, scaler


def failing_step(kind, m, opt, sched, scaler):
    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        if kind == "scaler":  # refused: scaler.step's skip decision reads gradient values
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss
        scaler.get_scale()
        loss.backward()
        opt.step()  # through the scheduler's wrapper: sets opt._opt_called
        if kind == "user":
            raise ValueError("the user's own error")
        if kind == "data":
            loss.numpy()  # DataDependentError
        if kind == "scheduler":
            sched.step()  # refused: the scheduler stores a value computed in the trace
        opt.zero_grad()
        return loss
    return step


ERRORS = {"user": ValueError, "data": tt.DataDependentError, "scheduler": tt.TracingError, "scaler": tt.TracingError}


@pytest.mark.parametrize("thin", [False, True])
@pytest.mark.parametrize("kind", sorted(ERRORS))
def test_a_failed_trace_leaves_model_optimizer_scheduler_and_scaler_as_before(kind, thin):
    m, opt, sched, scaler = objects()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    everything = [m, opt, sched, scaler]
    before = state_of(everything)
    with pytest.raises(ERRORS[kind]):
        tt.compile(failing_step(kind, m, opt, sched, scaler), thin=thin)(x, y)
    assert state_of(everything) == before
    assert not hasattr(opt, "_opt_called") and m.calls == 0 and not hasattr(m, "last_shape")


def test_a_failed_compiled_module_call_puts_back_its_attribute_writes():
    """``tt.compile(model)``: a forward that writes attributes and then fails leaves the module as before."""
    class Fails(Counting):
        def forward(self, x):
            out = super().forward(x)
            out.numpy()  # DataDependentError
            return out

    torch.manual_seed(0)
    m = Fails()
    before = state_of(m)
    with pytest.raises(tt.DataDependentError):
        tt.compile(m)(torch.randn(5, 4))
    assert state_of(m) == before


def test_a_successful_step_keeps_what_eager_sets():
    """On success the flag eager's ``optimizer.step`` sets through the scheduler's wrapper is set, as in eager."""
    m, opt, sched, scaler = objects()

    tt.compile(cross_entropy_step(m, opt))(torch.randn(5, 4), torch.randint(0, 3, (5,)))
    assert opt._opt_called is True and m.calls == 1
