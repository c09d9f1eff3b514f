"""Attributes a compiled function assigns on its modules (compiler/acquisition/module_writes.py), against eager.

A reassigned buffer (an EMA, custom running statistics) is updated on every call, full and thin; any other
assignment of a traced tensor, or a replaced parameter, is a clear error that leaves the module as it was.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.errors import TracingError


class EMANet(nn.Module):
    """A classifier that keeps an exponential moving average of its mean logit as a reassigned buffer."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.register_buffer("ema", torch.zeros(3))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        y = self.fc(x)
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        self.seen = self.seen + x.shape[0]
        return y


def _step(model, opt, x, t):
    loss = F.cross_entropy(model(x), t)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _batches(n):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 5, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("thin", [False, True])
def test_reassigned_buffers_follow_eager_over_training_steps(thin):
    torch.manual_seed(0)
    ref = EMANet()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    buffer_ids = {k: id(v) for k, v in model.named_buffers()}
    step = tt.compile(_step, thin=thin)
    for x, t in _batches(5):
        torch.testing.assert_close(step(model, opt, x, t), _step(ref, ref_opt, x, t))
    for (k, v), (_, r) in zip(model.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(v, r, msg=k)
    assert model.seen.item() == 20
    # The program writes into the buffers: the module keeps its tensors (eager binds new ones).
    assert {k: id(v) for k, v in model.named_buffers()} == buffer_ids


def test_compiled_module_forward_updates_its_reassigned_buffer():
    torch.manual_seed(0)
    ref = EMANet()
    model = copy.deepcopy(ref)
    cm = tt.compile(model)
    for x, _ in _batches(3):
        torch.testing.assert_close(cm(x), ref(x))
    torch.testing.assert_close(model.ema, ref.ema)
    assert model.seen.item() == ref.seen.item() == 12


class Stores(nn.Module):
    def __init__(self, what):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.register_buffer("ema", torch.zeros(3))
        self.what = what
        self.note = "kept"

    def forward(self, x):
        y = self.fc(x)
        if self.what == "attr":
            self.last = y.detach()
        elif self.what == "private":
            self._cache = [y]
        elif self.what == "item":
            self.last_loss = y.sum().item()
        elif self.what == "overwrite":
            self.note = y.sum()
        elif self.what == "shape":
            self.ema = y.detach()
        elif self.what == "grad":
            self.ema = y.mean(0)
        elif self.what == "param":
            self.fc.weight = nn.Parameter(self.fc.weight.detach() * 2)
        elif self.what == "new_buffer":
            self.register_buffer("extra", y.detach())
        return y


@pytest.mark.parametrize("what,needle", [
    ("attr", "args[0].last"), ("item", "args[0].last_loss"), ("private", "args[0]._cache"), ("overwrite", "args[0].note"),
    ("shape", "buffer args[0].ema"), ("grad", "requires grad"), ("param", "parameter args[0].fc.weight"),
    ("new_buffer", "buffer args[0].extra"),
])
def test_other_assignments_are_clear_errors_that_leave_the_module_unchanged(what, needle):
    torch.manual_seed(0)
    m = Stores(what)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = [id(p) for p in m.parameters()]
    attrs = dict(m.__dict__)
    with pytest.raises(TracingError, match=needle.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        tt.compile(lambda mod, x: mod(x))(m, torch.randn(2, 5))
    assert m.__dict__.keys() == attrs.keys() and m.note == "kept"
    assert [id(p) for p in m.parameters()] == params
    assert m.state_dict().keys() == before.keys()
    for k, v in m.state_dict().items():
        assert type(v) is torch.Tensor, k
        torch.testing.assert_close(v, before[k], msg=k)
    # Eager runs the same module fine: only the compiled form refuses.
    m(torch.randn(2, 5))
