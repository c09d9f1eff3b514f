"""Every Python read of a runtime number follows eager: ``item()`` results, symbolic sizes (``dynamic=True``),
optimizer hyper-parameters and plain number arguments.

CPython reads the stored number of an ``int``/``float`` subclass directly in ``range(n)``, slicing, ``[0] * n``,
``math.sqrt(v)``, format specs, ``struct``, ... so number proxies are not such subclasses
(``compiler/proxies.py``): each of those reads becomes a decision the prologue recomputes (``item()``), a
recorded check (sizes, hyper-parameters) or recorded arithmetic. Each case runs on inputs whose values change
between calls, so a value baked in at trace time would fail the comparison with eager.
"""
from __future__ import annotations

import copy
import math
import struct

import numpy as np
import pytest
import torch

import thunder_train as tt
from thunder_train.compiler import proxies
from thunder_train.compiler.proxies import CheckedFloat, NumberProxy, SizeProxy


def positives(x):
    return (x > 0).sum()


def item_range(x):
    acc = x * 0
    for i in range(positives(x).item()):
        acc = acc + x * i
    return acc


# item() results: the value does not exist while tracing, so every plain read is a decision.
ITEM_CASES = {
    "range": item_range,
    "slice": lambda x: x[: positives(x).item()] * 2,
    "list_repeat": lambda x: x * len([0] * positives(x).item()),
    "list_index": lambda x: x * [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0][positives(x).item()],
    "math_sqrt": lambda x: x * math.sqrt(abs(x.sum().item())),
    "math_log": lambda x: x * math.log(abs(x.sum().item()) + 1),
    "math_floor": lambda x: x * math.floor(x.sum().item()),
    "math_ceil": lambda x: x * math.ceil(x.sum().item()),
    "round": lambda x: x * round(x.sum().item(), 1),
    "format_spec": lambda x: x * float(f"{x.sum().item():.2f}"),
    "percent_d": lambda x: x * int("%d" % positives(x).item()),
    "str": lambda x: x * len(str(positives(x).item())),
    "struct": lambda x: x * struct.unpack("f", struct.pack("f", x.sum().item()))[0],
    "numpy": lambda x: x * float(np.sqrt(np.abs(x.sum().item()))),
    "int": lambda x: x * int(x.sum().item()),
    "float": lambda x: x * float(x.sum().item()),
    "bool": lambda x: x * 2 if bool(positives(x).item() > 3) else x,
    "comparison": lambda x: x + 1 if x.sum().item() > 0 else x - 1,
    "divmod": lambda x: x * divmod(positives(x).item(), 3)[1],
    "bitwise": lambda x: x * (positives(x).item() & 1),
    "set_member": lambda x: x * 2 if positives(x).item() in {2, 4} else x,
    "isinstance": lambda x: x * positives(x).item() if isinstance(x.sum().item(), float) else x,
    "dict_key": lambda x: x * {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0, 5: 5.0}.get(positives(x).item(), 0.5),
    # torch calls taking the number: recorded as a runtime input, or decided where torch needs a plain int
    "alpha": lambda x: x.add(x, alpha=x.sum().item()),
    "torch_full": lambda x: torch.full((3,), x.sum().item()) + x[:3],
    "view": lambda x: x.view(positives(x).item() % 3 + 1, -1) * 1,
    "torch_zeros": lambda x: torch.zeros(positives(x).item()).sum() + x,
    "clamp_min": lambda x: x.clamp(min=x.mean().item()),
    "torch_tensor": lambda x: torch.tensor([x.sum().item(), 1.0]) * x[:2],
}
# The cases eager computes from the value of a tensor through Python: each value is a decision.
ITEM_DECIDED = set(ITEM_CASES) - {"alpha", "torch_full", "clamp_min", "torch_tensor", "isinstance"}


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("name", list(ITEM_CASES))
def test_reads_of_an_item_follow_eager_on_changing_values(name, thin):
    fn = ITEM_CASES[name]
    cf = tt.compile(fn, thin=thin)
    for seed in (0, 1, 1, 2, 3):
        x = torch.randn(6, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(cf(x), fn(x))
    stats = tt.compile_stats(cf)
    if name in ITEM_DECIDED:
        assert stats.entries >= 2, "the inputs decide differently: a single program means a baked-in value"
        # (in thin mode too: the bound program's decisions are re-evaluated on every call)
        assert stats.retrace_reasons and all("of the runtime number" in r and "test_number_reads.py" in r
                                             for r in stats.retrace_reasons)
    else:
        assert stats.entries == 1, stats.retrace_reasons  # a runtime input of the program, never specialised


def size_range(x):
    acc = x[0] * 0
    for i in range(x.shape[0]):
        acc = acc + x[i] * i
    return acc


# Symbolic sizes: plain reads specialise with a recorded check; shape arithmetic and torch calls stay symbolic.
SIZE_CASES = {
    "range": size_range,
    "slice": lambda x: x * len([1, 2, 3, 4, 5, 6, 7, 8][: x.shape[0]]),
    "list_repeat": lambda x: x * len([0] * x.shape[0]),
    "list_index": lambda x: x * [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0][x.shape[0]],
    "math_sqrt": lambda x: x / math.sqrt(x.shape[0]),
    "math_log": lambda x: x * math.log(x.size(0)),
    "math_floor": lambda x: x * math.floor(x.shape[0] / 2),
    "round": lambda x: x * round(x.shape[0] / 4),
    "format_spec": lambda x: x * float(f"{x.shape[0]:.1f}"),
    "percent_d": lambda x: x * int("%d" % x.shape[0]),
    "struct": lambda x: x * struct.unpack("i", struct.pack("i", x.shape[0]))[0],
    "numpy": lambda x: x * float(np.sqrt(x.shape[0])),
    "int": lambda x: x * int(x.shape[0]),
    "float": lambda x: x * float(x.shape[0]),
    "bool": lambda x: x * 2 if x.shape[0] > 4 else x,
    "set_member": lambda x: x * 2 if x.shape[0] in {3, 6} else x,
    "dict_key": lambda x: x * {3: 1.0, 5: 2.0}.get(x.shape[0], 0.5),
    "attention_scale": lambda x: (x.T @ x) / math.sqrt(x.size(0)),
    # symbolic: one program for every size
    "alpha": lambda x: x.add(x, alpha=x.shape[0]),
    "torch_full": lambda x: torch.full((x.shape[0], 1), x.shape[0] * 0.5) + x,
    "view": lambda x: x.view(x.shape[0], -1) * 1,
    "reshape": lambda x: x.reshape(-1, x.shape[0]) * 1,
    "torch_zeros": lambda x: torch.zeros(x.shape[0], 2) + x,
    "arange": lambda x: torch.arange(x.shape[0]).unsqueeze(1) * x,
    "clamp_min": lambda x: x.clamp(min=x.shape[0] / 10),
    "torch_tensor": lambda x: torch.tensor([x.shape[0], 1.0]).sum() * x,
    "mean": lambda x: x.mean(0) + x,
    "slices": lambda x: x[1:] * 2 + x[:-1],
    "sym_max": lambda x: x * torch.sym_max(x.shape[0], 4),
}
SIZE_SYMBOLIC = {"alpha", "torch_full", "view", "reshape", "torch_zeros", "arange", "clamp_min", "torch_tensor",
                 "mean", "slices", "sym_max"}


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("name", list(SIZE_CASES))
def test_reads_of_a_symbolic_size_follow_eager_across_sizes(name, thin):
    fn = SIZE_CASES[name]
    cf = tt.compile(fn, dynamic=True, thin=thin)
    for b in (3, 5, 5, 6):
        x = torch.randn(b, 2, generator=torch.Generator().manual_seed(b))
        got, want = cf(x), fn(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
    stats = tt.compile_stats(cf)
    if name in SIZE_SYMBOLIC:
        assert stats.entries == 1, stats.retrace_reasons
    else:
        assert stats.entries >= 2, "sizes 3, 5 and 6 decide differently: a single program means a baked-in size"
        assert all("x.shape[0]" in r for r in stats.retrace_reasons), stats.retrace_reasons


def adam_like_step(model, opt, x):
    """A hand-written update reading the hyper-parameters with Python math (as custom optimizers do)."""
    loss = model(x).square().mean()
    loss.backward()
    with torch.no_grad():
        for g in opt.param_groups:
            lr, (b1, b2) = g["lr"], g["betas"]
            scale = lr * math.sqrt(1 - b2) / (1 - b1)
            for p in g["params"]:
                p.add_(p.grad, alpha=-scale)
                p.mul_(1 - round(lr, 4) * 0.1)
    opt.zero_grad()
    return loss.detach()


def recorded_lr_step(model, opt, x):
    """The same update with only arithmetic on lr: a runtime input, so a new lr needs no new program."""
    loss = model(x).square().mean()
    loss.backward()
    with torch.no_grad():
        for g in opt.param_groups:
            for p in g["params"]:
                p.add_(p.grad, alpha=-g["lr"] * 2)
                p.clamp_(min=-g["lr"] * 100)
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
@pytest.mark.parametrize("step", [adam_like_step, recorded_lr_step], ids=["math_on_lr", "arithmetic_on_lr"])
def test_hyper_parameters_read_by_python_math_follow_a_changing_lr(step, thin):
    torch.manual_seed(0)
    m1 = torch.nn.Linear(3, 2)
    m2 = copy.deepcopy(m1)
    o1, o2 = (torch.optim.Adam(m.parameters(), lr=0.1) for m in (m1, m2))
    cf = tt.compile(step, thin=thin)
    g = torch.Generator().manual_seed(0)
    for lr in (0.1, 0.1, 0.05, 0.05, 0.1, 0.02):
        for o in (o1, o2):
            o.param_groups[0]["lr"] = lr  # a scheduler
        x = torch.randn(4, 3, generator=g)
        torch.testing.assert_close(cf(m2, o2, x), step(m1, o1, x))
        for a, b in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(b, a)
    stats = tt.compile_stats(cf)
    if step is adam_like_step:
        assert stats.entries == 3 and all("lr ==" in r for r in stats.retrace_reasons), stats.retrace_reasons
        if thin:
            assert stats.thin_invalidations
    else:
        assert stats.entries == 1, stats.retrace_reasons


def plain_number_arg(x, n, scale):
    acc = x * 0
    for i in range(n):
        acc = acc + x[i % x.shape[0]] * math.sqrt(scale)
    return acc[: n % 3 + 1] * f"{scale:.1f}".count("5")


def test_plain_number_arguments_are_specialised_and_checked():
    cf = tt.compile(plain_number_arg)
    x = torch.randn(3, 2)
    for n, scale in ((2, 0.5), (2, 0.5), (4, 0.5), (4, 2.5), (1, 1.5)):
        torch.testing.assert_close(cf(x, n, scale), plain_number_arg(x, n, scale))
    assert tt.compile_stats(cf).entries == 4


def test_thin_mode_runs_a_changed_plain_number_argument_through_the_full_path():
    cf = tt.compile(plain_number_arg, thin=True)
    x = torch.randn(3, 2)
    for _ in range(3):
        torch.testing.assert_close(cf(x, 2, 0.5), plain_number_arg(x, 2, 0.5))
    for n in (4, 4, 4, 2, 4):  # 4: the full path traces and binds it; then the per-call check switches bindings
        torch.testing.assert_close(cf(x, n, 0.5), plain_number_arg(x, n, 0.5))
    st = tt.compile_stats(cf)
    assert st.cache_misses == 2 and st.thin_binds == 2 and st.thin_fallbacks == 1 and st.retrace_reasons == ["args[1].value: 2 → 4"]
    assert st.calls == 8 and st.thin_calls == 4


def test_number_proxies_are_not_python_numbers_and_reach_no_symbolic_node():
    """Nothing torch.SymInt/SymFloat/SymBool defines is inherited (it would read the missing ``node``)."""
    for cls in (proxies._IntProxy, proxies._FloatProxy, proxies._BoolProxy, SizeProxy, CheckedFloat):
        assert not issubclass(cls, (int, float))
        sym = cls.__mro__[cls.__mro__.index(proxies.Proxy) + 1]
        assert sym in (torch.SymInt, torch.SymFloat, torch.SymBool)
        inherited = [n for n, v in vars(sym).items() if callable(v) and n not in ("__init__",)
                     and next(k for k in cls.__mro__ if n in vars(k)) is sym]
        assert not inherited, inherited
    n = NumberProxy(value=3)
    with pytest.raises(TypeError, match="torch.compile's symbolic"):
        n.node
    with pytest.raises(TypeError, match="cannot be interpreted as an integer"):
        range(NumberProxy(value=1.5))
    # ... while isinstance answers as for eager's number (the proxy's class is its Python type)
    assert isinstance(n, int) and isinstance(NumberProxy(value=1.5), float) and not isinstance(n, float)
    assert proxies.is_number(n) and proxies.is_int(n) and proxies.number_type(NumberProxy(value=1.5)) is float
    assert not proxies.is_number("3") and not proxies.is_int(2.0) and proxies.is_int(True)


def test_reading_an_item_derived_from_a_random_op_is_a_clear_error():
    def fn(x):
        return x[: int(torch.nn.functional.dropout(x, 0.5).sum().item() * 0) + 2]

    cf = tt.compile(fn)
    with pytest.raises(tt.DataDependentError if hasattr(tt, "DataDependentError") else Exception,
                       match="random op"):
        cf(torch.randn(4))


@pytest.mark.parametrize("thin", [False, True], ids=["full", "thin"])
def test_an_item_of_an_intermediate_used_as_sizes_and_indices_follows_eager(thin):
    """The value depends on a parameter: the program checks the decision where it computes it, also when torch
    needs the plain int inside an op (a slice bound, a factory size, a view)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)

    def fn(x):
        h = lin(x)
        n = (h > 0).sum().item()
        return h[:, :n] * 2, torch.zeros(n) + 1, h.view(-1, n % 2 + 1) * 1

    cf = tt.compile(fn, thin=thin)
    for seed in (0, 1, 1, 2, 3, 3):
        x = torch.randn(1, 6, generator=torch.Generator().manual_seed(seed))
        for got, want in zip(cf(x), fn(x)):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want)
    stats = tt.compile_stats(cf)
    assert stats.entries >= 2 and all("an integer index" in r for r in stats.retrace_reasons)


F = torch.nn.functional
# Ops dividing by an element count: with dynamic=True the count is a runtime number of every call (forward and
# the backward's rules), never the traced call's count.
COUNT_CASES = {
    "mse_loss": lambda x, y: F.mse_loss(x, y),
    "l1_loss": lambda x, y: F.l1_loss(x, y),
    "smooth_l1_loss": lambda x, y: F.smooth_l1_loss(x, y),
    "cross_entropy": lambda x, y: F.cross_entropy(x, y.argmax(-1)),
    "nll_loss": lambda x, y: F.nll_loss(x.log_softmax(-1), y.argmax(-1)),
    "bce_with_logits": lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid()),
    "kl_div_batchmean": lambda x, y: F.kl_div(x.log_softmax(-1), y.softmax(-1), reduction="batchmean"),
    "layer_norm": lambda x, y: F.layer_norm(x, (4,)).pow(3).sum(),
    "batch_norm": lambda x, y: F.batch_norm(x, None, None, training=True).pow(3).sum(),
    "group_norm": lambda x, y: (F.group_norm(x.unsqueeze(-1), 1).pow(3) * torch.arange(4.0).unsqueeze(-1)).sum(),
    "var": lambda x, y: x.var(0).sum(),
    "mean": lambda x, y: x.mean(0).pow(2).sum(),
}


@pytest.mark.parametrize("name", list(COUNT_CASES))
def test_means_over_a_symbolic_size_divide_by_each_calls_count(name):
    fn = COUNT_CASES[name]
    cf = tt.compile(fn, dynamic=True)
    for b in (3, 5, 6):
        g = torch.Generator().manual_seed(b)
        x = torch.randn(b, 4, generator=g, requires_grad=True)
        y = torch.randn(b, 4, generator=g)
        x2 = x.detach().clone().requires_grad_()
        got, want = cf(x, y), fn(x2, y)
        torch.testing.assert_close(got, want)
        got.backward()
        want.backward()
        torch.testing.assert_close(x.grad, x2.grad)
    assert tt.compile_stats(cf).entries == 1, tt.compile_stats(cf).retrace_reasons
