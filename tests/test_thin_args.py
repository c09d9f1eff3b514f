"""thin_call passes bound inputs as defaults of a reordered computation (runtime/thin_args.py): same results."""
import copy

import pytest
import torch
from torch import nn

import thunder_train as tt
from thunder_train.runtime import thin_args
from thunder_train.runtime.thin import _packed_args


def _generated(n_bound_first: int, n_bound_last: int):
    """A generated-looking computation with bound arguments around two per-call ones, and its call names."""
    params = [f"p{i}" for i in range(n_bound_first)] + ["lr", "x"] + [f"q{i}" for i in range(n_bound_last)]
    body = " + ".join(f"{p} * {k + 1}" for k, p in enumerate(params))
    src = f"# a header\ndef computation({', '.join(params)}):\n  # p0: a comment\n  return {body}\n"
    ns = {}
    exec(compile(src, "<test>", "exec"), ns)
    fn = ns["computation"]
    fn.__thunder_source__ = src
    names = [f"_s{i}" for i in range(n_bound_first)] + ["lr", "x"] + [f"_s{100 + i}" for i in range(n_bound_last)]
    bound = {n: torch.randn(3) for n in names if n.startswith("_s")}
    return fn, names, bound


def _interleaved(fn, names, bound, lr, x):
    env = {**bound, "lr": lr, "x": x}
    return fn(*[env[n] for n in names])


def test_reordered_computation_gives_the_interleaved_result():
    fn, names, bound = _generated(6, 7)
    made = thin_args.computation_call(fn, names, bound, {})
    assert made is not None
    new, per_call = made
    assert per_call == ["lr", "x"] and len(new.__defaults__) == 13
    lr, x = 0.5, torch.randn(3)
    torch.testing.assert_close(new(lr, x), _interleaved(fn, names, bound, lr, x), rtol=0, atol=0)
    assert "def computation(lr, x, p0" in new.__thunder_source__


@pytest.mark.parametrize("why", ["few bound", "decorated", "wrapper"])
def test_other_callables_keep_the_interleaved_call(why):
    fn, names, bound = _generated(3, 2) if why == "few bound" else _generated(6, 7)
    if why == "decorated":
        fn.__thunder_source__ = "@torch.no_grad()\n" + fn.__thunder_source__
    if why == "wrapper":
        inner = fn

        def fn(*a):
            return inner(*a)
    assert thin_args.computation_call(fn, names, bound, {}) is None


def test_adapter_calls_a_replacement_program_with_the_per_call_values():
    """A fused program replacing the computation after binding: reordered again, or wrapped when it cannot be."""
    fn, names, bound = _generated(6, 7)
    adapt = thin_args.adapter(names, dict(bound), {}, _packed_args)
    lr, x = 2.0, torch.randn(3)
    expected = _interleaved(fn, names, bound, lr, x)
    torch.testing.assert_close(adapt(fn)(lr, x), expected, rtol=0, atol=0)

    def wrapper(*a):  # e.g. an epilogue wrapper: not reorderable
        return fn(*a)
    torch.testing.assert_close(adapt(wrapper)(lr, x), expected, rtol=0, atol=0)


def _step(model, opt, x, y):
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@pytest.mark.parametrize("fusion", [None, "background"])
def test_thin_step_with_bound_defaults_matches_eager(fusion):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = tt.compile(_step, thin=True, fusion=fusion)
    for i in range(6):
        x, y = torch.randn(8, 4), torch.randn(8, 4)
        if i == 3:
            for g, rg in zip(opt.param_groups, ref_opt.param_groups):
                g["lr"] = rg["lr"] = 3e-3  # a hyper-parameter read per call, passed with the per-call values
        torch.testing.assert_close(step(model, opt, x, y), _step(ref, ref_opt, x, y))
        if i == 4 and fusion == "background":
            tt.wait_for_fusion(step)
    assert step.is_thin_bound
    slot = step._binding.fn.fn.__globals__["_slot"]
    computation = slot.thin
    while getattr(computation, "inner", None) is not None:  # behind the epilogue that gives the loss eager's grad_fn
        computation = computation.inner
    assert slot is step._binding.entry.slot and slot.thin is not slot.run and computation.__defaults__, \
        "the bound inputs were not passed as defaults"
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)
    sd, rsd = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    for k in rsd:
        for name in rsd[k]:
            torch.testing.assert_close(sd[k][name], rsd[k][name])
