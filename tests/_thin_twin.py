"""Run a training step eagerly and compiled side by side, applying the same hazards between steps.

``Twin`` holds an eager (model, optimizer) pair and a compiled copy; ``hazard(fn)`` applies ``fn`` to both;
``step(batch)`` runs both and compares parameters, buffers, ``.grad`` and the optimizer's ``state_dict``.
When eager raises, the compiled step must raise too; when the compiled step raises, it must be a
``ThinModeError`` (a clear error) unless eager raised, and the call must leave every input unchanged.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import thunder_train as tt
from thunder_train.compiler import bulk


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.BatchNorm1d(6), nn.Linear(6, 3))


def train_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


@contextlib.contextmanager
def forced_checks(kind):
    """Bind thin mode with its per-parameter checks in Python (``"python"``) or with torch's C++ guards where this
    torch has them (``"c++"``, the default; compiler/bulk.py)."""
    if kind == "c++" and not bulk.supported():
        pytest.skip("this torch has no usable C++ guards (thin mode checks in Python)")
    saved = bulk.ENABLED
    bulk.ENABLED = kind == "c++"
    try:
        yield
    finally:
        bulk.ENABLED = saved


# "thin-c++": thin mode with its per-parameter checks in torch's C++ guards (the default, compiler/bulk.py); "thin": in Python.
MODES = [pytest.param(dict(thin=True), id="thin"), pytest.param(dict(thin=True), id="thin-c++"),
         pytest.param(dict(thin=False), id="full")]


@pytest.fixture(autouse=True)
def checks_of_the_mode(request):
    """Autouse where imported: a test's ``thin-c++`` case binds with torch's C++ guards, the others in Python."""
    spec = getattr(request.node, "callspec", None)
    with forced_checks("c++" if spec is not None and "thin-c++" in spec.id else "python"):
        yield


def snapshot(model, opt):
    """Everything a step may change, as detached clones (values, dtypes, ``.grad`` presence)."""
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()},
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "opt": copy.deepcopy(opt.state_dict()),
    }


def assert_same(a, b, atol=1e-5, rtol=1e-4, what=""):
    """``a``/``b``: snapshots; the eager one first."""
    assert a["params"].keys() == b["params"].keys(), what
    for k in ("params", "buffers"):
        for n, v in a[k].items():
            torch.testing.assert_close(b[k][n], v, atol=atol, rtol=rtol, msg=lambda m: f"{what} {k} {n}: {m}")
    for n, g in a["grads"].items():
        h = b["grads"][n]
        assert (g is None) == (h is None), f"{what} .grad of {n}: eager {'None' if g is None else 'set'}, compiled {'None' if h is None else 'set'}"
        if g is not None:
            torch.testing.assert_close(h, g, atol=atol, rtol=rtol, msg=lambda m: f"{what} .grad {n}: {m}")
    sa, sb = a["opt"], b["opt"]
    assert sa["param_groups"] == sb["param_groups"], f"{what} param_groups differ"
    assert sa["state"].keys() == sb["state"].keys(), f"{what} optimizer state keys: eager {sorted(sa['state'])}, compiled {sorted(sb['state'])}"
    for i, st in sa["state"].items():
        assert st.keys() == sb["state"][i].keys(), f"{what} optimizer state {i} keys"
        for k, v in st.items():
            torch.testing.assert_close(torch.as_tensor(sb["state"][i][k]), torch.as_tensor(v), atol=atol, rtol=rtol,
                                       msg=lambda m: f"{what} optimizer state {i} {k}: {m}")


def assert_same_inputs(before, after, what):
    """A call that raised must leave every input exactly as it was."""
    assert_same(before, after, atol=0, rtol=0, what=what + " (a raising call changed its inputs)")


class Twin:
    def __init__(self, make_model=small_model, make_opt=lambda ps: torch.optim.AdamW(ps, lr=0.05), step=train_step, **options):
        self.eager_model = make_model()
        self.model = copy.deepcopy(self.eager_model)
        self.eager_opt = make_opt(self.eager_model.parameters())
        self.opt = make_opt(self.model.parameters())
        self.fn = step
        self.compiled = tt.compile(step, **options)
        self.g = torch.Generator().manual_seed(0)
        self.n = 0

    def batch(self, n=8):
        return torch.randn(n, 4, generator=self.g), torch.randn(n, 3, generator=self.g)

    def hazard(self, fn):
        """Apply ``fn(model, opt)`` to the eager and the compiled pair alike."""
        fn(self.eager_model, self.eager_opt)
        fn(self.model, self.opt)

    def step(self, batch=None, *, expect_thin_error=False, tolerance=(1e-5, 1e-4)):
        """One step of each; returns ``(eager_error, compiled_error)``."""
        self.n += 1
        x, y = batch if batch is not None else self.batch()
        eager_err = compiled_err = None
        try:
            ref = self.fn(self.eager_model, self.eager_opt, x, y)
        except Exception as e:  # noqa: BLE001 - compared with the compiled outcome below
            eager_err = e
        before = snapshot(self.model, self.opt)
        try:
            out = self.compiled(self.model, self.opt, x, y)
        except Exception as e:  # noqa: BLE001
            compiled_err = e
        what = f"step {self.n}"
        if eager_err is not None:
            assert compiled_err is not None, f"{what}: eager raised {eager_err!r} but the compiled step ran"
        if compiled_err is not None:
            if eager_err is None:
                assert isinstance(compiled_err, tt.ThinModeError) or expect_thin_error, f"{what}: compiled raised {compiled_err!r} where eager ran"
            assert_same_inputs(before, snapshot(self.model, self.opt), what)
            self.resync()  # eager raised part-way, or ran where thin mode refused the call: start from the same state
            return eager_err, compiled_err
        atol, rtol = tolerance
        torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
        assert_same(snapshot(self.eager_model, self.eager_opt), snapshot(self.model, self.opt), atol=atol, rtol=rtol, what=what)
        return eager_err, compiled_err

    def resync(self):
        """After eager raised part-way through a step, give it the compiled pair's (untouched) state again."""
        with torch.no_grad():
            for a, b in zip(self.eager_model.parameters(), self.model.parameters()):
                a.copy_(b)
                a.grad = None if b.grad is None else b.grad.clone()
            for a, b in zip(self.eager_model.buffers(), self.model.buffers()):
                a.copy_(b)
        self.eager_opt.load_state_dict(copy.deepcopy(self.opt.state_dict()))

    def steps(self, n):
        for _ in range(n):
            e, c = self.step()
            assert e is None and c is None, (e, c)
