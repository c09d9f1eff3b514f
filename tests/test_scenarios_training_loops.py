"""Training-loop habits that matched eager when tried (session 18), kept as cheap guards: ``.item()`` logging into a
list, skipping a spike with ``if loss.item() > t``, skipping a non-finite gradient norm, a global counter and Adam's
step count read inside the step, schedulers stepped between steps with the learning rate read inside (OneCycleLR,
CosineAnnealingWarmRestarts, ReduceLROnPlateau), two optimizers over overlapping parameters, a saliency map from
``x.requires_grad_()`` then ``x.grad = None`` and ``x.detach_()``, integer and boolean buffers updated in forward,
DINO (teacher EMA inside the step with a momentum passed as a Python float, a centre buffer reassigned), pseudo-
labels with a confidence mask, boolean-mask losses, OHEM with ``topk``, gradient noise and manual weight decay on
``.grad``, and ``parameters_to_vector``/``vector_to_parameters``.  Each runs full, thin and ``tt.compile(model)``
and is compared with eager after every step (tests/_scenario_harness.py).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _scenario_harness import assert_matches_eager


def _mlp(i=4, o=3):
    return nn.Sequential(nn.Linear(i, 16), nn.Tanh(), nn.Linear(16, o))


def _batches(n=4, scale=lambda i: 1.0):
    return [(torch.randn(8, 4) * scale(i), torch.randint(0, 3, (8,))) for i in range(n)]


def _loop(body, make_opt=lambda m: torch.optim.Adam(m.parameters(), lr=0.01), calls=_batches, extra=None,
          between=None, mk=_mlp):
    def setup(wrap):
        m = mk()
        cm = wrap(m)
        opt = make_opt(m)
        ctx = {"log": [], "n": 0, "skips": 0}

        def step(x, y):
            return body(cm, m, opt, ctx, x, y)

        s = dict(step=step, calls=calls(), modules=[m], opts=[opt], extra=lambda: ctx)
        if between is not None:
            sched = between(opt)
            s["between"] = lambda i: sched(i)
        return s

    return setup


def _item_logging(cm, m, opt, ctx, x, y):
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    ctx["log"].append(loss.item())
    opt.step()
    opt.zero_grad()
    return {"loss": loss.detach(), "lr": opt.param_groups[0]["lr"]}


def _skip_spike(cm, m, opt, ctx, x, y):
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    if loss.item() > 1.2:
        ctx["skips"] += 1
    else:
        opt.step()
    opt.zero_grad()
    return ctx["skips"]


def _skip_nonfinite(cm, m, opt, ctx, x, y):
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    if torch.isfinite(norm):
        opt.step()
    else:
        ctx["skips"] += 1
    opt.zero_grad()
    return loss, norm


def _adam_count(cm, m, opt, ctx, x, y):
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    ctx["n"] += 1
    n = int(opt.state[opt.param_groups[0]["params"][0]]["step"].item())
    if n % 2 == 0:
        with torch.no_grad():
            for p in m.parameters():
                p.mul_(0.99)
    return loss, n, ctx["n"]


def _lr_read(cm, m, opt, ctx, x, y):
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    lr = opt.param_groups[0]["lr"]
    return loss, loss * lr, lr


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _sched(make):
    def between(opt):
        s = make(opt)
        plateau = isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau)
        return lambda i: s.step(float(i % 3 == 0) + 1.0) if plateau else s.step()

    return between


def _saliency(cm, m, opt, ctx, x, y):
    x.requires_grad_()
    loss = F.cross_entropy(cm(x), y)
    loss.backward()
    sal = x.grad.abs().sum(1)
    x.grad = None
    x.detach_()
    opt.step()
    opt.zero_grad()
    return loss, sal, x.requires_grad


def _pseudo_labels(cm, m, opt, ctx, x, y):
    sup = F.cross_entropy(cm(x[:4]), y[:4])
    xu = x[4:] * 2
    with torch.no_grad():
        conf, pl = cm(xu).softmax(-1).max(1)
        mask = (conf > 0.4).float()
    unsup = (F.cross_entropy(cm(xu + 0.1 * torch.randn_like(xu)), pl, reduction="none") * mask).sum() / mask.sum().clamp(min=1)
    loss = sup + unsup
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, mask.mean()


def _masked_ohem(cm, m, opt, ctx, x, y):
    y = torch.where(torch.arange(8) % 3 == 0, -1, y)
    out = cm(x)
    valid = y >= 0
    hard, idx = F.cross_entropy(out[valid], y[valid], reduction="none").topk(3)
    loss = hard.mean()
    loss.backward()
    for p in m.parameters():
        p.grad.add_(torch.randn_like(p.grad) * 0.01)
        if p.ndim > 1:
            p.grad.add_(p, alpha=0.1)
    opt.step()
    opt.zero_grad()
    return loss, idx, valid.sum()


def _flat_vector(cm, m, opt, ctx, x, y):
    loss = F.cross_entropy(cm(x), y)
    ps = list(m.parameters())
    g = torch.autograd.grad(loss, ps)
    vec = torch.nn.utils.parameters_to_vector(ps)
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(vec - 0.1 * torch.cat([t.flatten() for t in g]), ps)
    return loss


class _Counted(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int32))

    def forward(self, x, y):
        self.steps += 1
        self.seen.index_add_(0, y, torch.ones_like(y, dtype=torch.int32))
        return F.cross_entropy(self.lin(x), y, weight=1.0 / (self.seen.float() + 1)) * (1 + 0.1 * self.steps)


def _counted(cm, m, opt, ctx, x, y):
    loss = cm(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss, m.steps.clone()


def _two_optimizers(wrap):
    m = _mlp()
    cm = wrap(m)
    o1 = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    o2 = torch.optim.Adam(m[2].parameters(), lr=0.01)

    def step(x, y):
        loss = F.cross_entropy(cm(x), y)
        loss.backward()
        o1.step()
        o2.step()
        o1.zero_grad()
        o2.zero_grad()
        return loss

    return dict(step=step, calls=_batches(), modules=[m], opts=[o1, o2])


def _dino(wrap):
    student, teacher = _mlp(4, 6), _mlp(4, 6)
    teacher.load_state_dict(student.state_dict())
    teacher.requires_grad_(False)
    teacher.register_buffer("center", torch.zeros(1, 6))
    cs = wrap(student)
    opt = torch.optim.AdamW(student.parameters(), lr=0.01)

    def step(x1, x2, momentum):
        s1, s2 = cs(x1), cs(x2)
        with torch.no_grad():
            t1, t2 = teacher(x1), teacher(x2)
            q1, q2 = (F.softmax((t - teacher.center) / 0.04, -1) for t in (t1, t2))
        loss = -((q1 * F.log_softmax(s2 / 0.1, -1)).sum(-1).mean() + (q2 * F.log_softmax(s1 / 0.1, -1)).sum(-1).mean()) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.mul_(momentum).add_((1 - momentum) * ps.detach())
            teacher.center = teacher.center * 0.9 + torch.cat([t1, t2]).mean(0, keepdim=True) * 0.1
        return loss

    calls = [(torch.randn(6, 4), torch.randn(6, 4), 0.99 + 0.01 * (1 - math.cos(math.pi * i / 4)) / 2) for i in range(4)]
    return dict(step=step, calls=calls, modules=[student, teacher], opts=[opt])


SCENARIOS = {
    "item_logging": _loop(_item_logging),
    "skip_spike": _loop(_skip_spike, _sgd, calls=lambda: _batches(6, lambda i: 3.0 if i % 2 else 0.3)),
    "skip_nonfinite_norm": _loop(_skip_nonfinite, calls=lambda: _batches(5, lambda i: math.inf if i == 2 else 1.0)),
    "adam_step_count": _loop(_adam_count, calls=lambda: _batches(5)),
    "one_cycle": _loop(_lr_read, _sgd, calls=lambda: _batches(6),
                       between=_sched(lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.5, total_steps=10))),
    "warm_restarts": _loop(_lr_read, _sgd, calls=lambda: _batches(6), between=_sched(
        lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=2, T_mult=2))),
    "plateau": _loop(_lr_read, _sgd, calls=lambda: _batches(6), between=_sched(
        lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5))),
    "saliency": _loop(_saliency, _sgd),
    "pseudo_labels": _loop(_pseudo_labels, _sgd),
    "masked_ohem_grad_noise": _loop(_masked_ohem),
    "flat_vector_update": _loop(_flat_vector, lambda m: torch.optim.SGD(m.parameters(), lr=0.0)),
    "integer_buffers": _loop(_counted, _sgd, mk=_Counted),
    "two_optimizers": _two_optimizers,
    "dino": _dino,
}


@pytest.mark.parametrize("mode", ["full", "thin", "model"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_training_loop_habit_matches_eager(name, mode):
    assert_matches_eager(SCENARIOS[name], mode)
