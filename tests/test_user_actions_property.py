"""Property: user actions between and inside steps give eager's result after every step (issue 25, item 9).

Between steps: forward hooks added and removed, parameters frozen and unfrozen, ``p.data`` replaced by a
contiguous or a transposed (non-contiguous) tensor, ``.grad`` set.  Inside the step (switched by a global
the step reads, so a change retraces): a ``torch.no_grad()`` update of a parameter, and freezing its layer
for the forward and backward after that update.  ``Twin.step`` compares the loss, parameters, buffers,
``.grad`` and the optimizer state after every step; ``requires_grad`` is compared here too.  Full path and
thin mode; the example count is bounded for CI (a few seconds).
"""
import types

import pytest
import torch
import torch.nn.functional as F

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from _thin_twin import Twin  # noqa: E402

IN_STEP = types.SimpleNamespace(shrink=False, freeze=False)


def step(model, opt, x, y):
    if IN_STEP.shrink:
        with torch.no_grad():
            model[3].weight.mul_(0.9)
    if IN_STEP.freeze:
        model[3].requires_grad_(False)  # after the in-place update: acts on the updated weight
    loss = F.mse_loss(model(x), y)
    loss.backward()
    if IN_STEP.freeze:
        model[3].requires_grad_(True)
    opt.step()
    opt.zero_grad()
    return loss


_HANDLES: dict = {}


def _add_hook(m, o):
    _HANDLES.setdefault(id(m), []).append(m[1].register_forward_hook(lambda mod, a, out: out * 0.5))


def _remove_hook(m, o):
    hs = _HANDLES.get(id(m))
    if hs:
        hs.pop().remove()


def _freeze(i, flag):
    return lambda m, o: list(m.parameters())[i].requires_grad_(flag)


def _data(transposed, seed):
    w = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed)) * 0.3

    def f(m, o):  # each model gets its own storage
        m[0].weight.data = w.clone().t() if transposed else w.t().contiguous()
    return f


def _set_grad(m, o):
    m[3].weight.grad = torch.full_like(m[3].weight, 0.1)


BETWEEN = st.one_of(
    st.sampled_from([("add hook", _add_hook), ("remove hook", _remove_hook), ("set .grad", _set_grad), ("nothing", None)]),
    st.tuples(st.sampled_from([0, 1, 4, 5]), st.booleans()).map(lambda a: (f"requires_grad {a}", _freeze(*a))),
    st.tuples(st.booleans(), st.integers(0, 3)).map(lambda a: (f"p.data transposed={a[0]}", _data(*a))),
)


@settings(max_examples=4, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(thin=st.booleans(),
       plan=st.lists(st.tuples(BETWEEN, st.booleans(), st.booleans()), min_size=1, max_size=3))
def test_user_actions_between_and_inside_steps_match_eager(thin, plan):
    IN_STEP.shrink = IN_STEP.freeze = False
    t = Twin(make_opt=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), step=step, thin=thin)
    try:
        t.steps(2)
        for (name, action), shrink, freeze in plan:
            if action is not None:
                t.hazard(action)
            IN_STEP.shrink, IN_STEP.freeze = shrink, freeze
            eager_err, compiled_err = t.step()
            assert eager_err is None and compiled_err is None, (name, eager_err, compiled_err)
            for (n, pe), pc in zip(t.eager_model.named_parameters(), t.model.parameters()):
                assert pe.requires_grad == pc.requires_grad, f"{name}: {n}.requires_grad"
    finally:
        IN_STEP.shrink = IN_STEP.freeze = False
        for m in (t.eager_model, t.model):
            for h in _HANDLES.pop(id(m), []):
                h.remove()
