"""A compiled function's first call imports nothing heavy (issue 30: a 20-op function's first call took 1.0 s
instead of ~4 ms once the kept-buffers planner's meta run imported torch._dynamo).

torch._dynamo and Inductor (about 1 s) load only when a fused build starts; sympy (about 0.5 s, through
torch.fx.experimental.symbolic_shapes) not at all.  Each case runs in a fresh interpreter, since the test process has
imported everything already.  No timing is asserted: benchmarks/overhead.py prints the first call's time."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import thunder_train as tt
from thunder_train.compiler.dense import is_non_overlapping_and_dense
from thunder_train.compiler.proxies import contiguous_strides
from _steps import squared_output_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch._dynamo", "torch._inductor", "sympy")

CHILD = r"""
import json, sys
import torch

import thunder_train as tt
import thunder_train as tt

fusion = {"none": None, "default": "default"}[sys.argv[1]]
kw = {} if fusion == "default" else {"fusion": None}

def tiny(x, y):
    a = x * y + 1.0
    b = torch.tanh(a) - y / 3.0
    return torch.sigmoid(b * a).sqrt() + torch.exp(-b)

x, y = torch.randn(8), torch.randn(8)
before = sorted(m for m in %(heavy)r if m in sys.modules)
with torch.no_grad():
    got = tt.compile(tiny, **kw)(x, y)
after_tiny = sorted(m for m in %(heavy)r + ("numpy.random",) if m in sys.modules)

# numpy.random first imported inside a compiled function: a draw or a seed there is still refused.
def draws(x):
    import numpy.random
    return x * float(numpy.random.rand())

def seeds(x):
    import numpy.random
    numpy.random.seed(3)
    return x * 2

refused = []
for f in (draws, seeds):
    try:
        tt.compile(f, **kw)(x)
    except tt.TracingError as e:
        refused.append("numpy.random" in str(e))
print(json.dumps({"before": before, "after_tiny": after_tiny, "equal": torch.equal(got, tiny(x, y)),
                  "refused": refused}))
""" % {"heavy": HEAVY}


@pytest.mark.parametrize("fusion", ["none", "default"])
def test_first_call_imports_neither_dynamo_nor_inductor_nor_sympy(fusion):
    """Nor numpy.random (~12 ms): numpy's global generator is checked without importing it (global_state.py)."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", CHILD, fusion], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] == [], f"importing thunder_train loaded {got['before']}"
    assert got["after_tiny"] == [], f"a tiny function's first call loaded {got['after_tiny']}"
    assert got["equal"], "the compiled result differs from eager's"
    assert got["refused"] == [True, True], "a draw from or a seed of numpy's generator imported while tracing passed"


def _c10_rule(t) -> bool:
    """The rule torch's runtime applies (c10's ``compute_non_overlapping_and_dense``, what ``empty_like`` keeps strides
    by).  torch._prims_common's Python rule differs from it on a size-1 dimension of stride 0 among others (sizes
    (2, 1, 2), strides (1, 0, 2): c10 True, the Python rule False), so it is not the oracle."""
    return bool(torch.ops.aten.is_non_overlapping_and_dense(t))


def _layouts():
    """(sizes, strides) of dense, sliced, expanded, permuted and size-0/1 tensors."""
    sizes = st.lists(st.integers(0, 4), min_size=0, max_size=4)

    @st.composite
    def layout(draw):
        shape = draw(sizes)
        t = torch.empty(shape, device="meta")
        if t.dim() and draw(st.booleans()):
            t = t.permute(*draw(st.permutations(range(t.dim()))))
        if t.dim() and draw(st.booleans()):
            d = draw(st.integers(0, t.dim() - 1))
            t = t.narrow(d, 0, draw(st.integers(0, t.shape[d])))
        if t.dim() and draw(st.booleans()):
            d = draw(st.integers(0, t.dim() - 1))
            if t.shape[d] == 1:
                t = t.expand(*[3 if i == d else -1 for i in range(t.dim())])
        if t.dim() and draw(st.booleans()):
            d = draw(st.integers(0, t.dim() - 1))
            t = t[(slice(None),) * d + (slice(None, None, 2),)]
        return t

    return layout()


@settings(max_examples=300, deadline=None)
@given(_layouts())
def test_non_overlapping_and_dense_is_torchs_rule(t):
    assert is_non_overlapping_and_dense(t) == _c10_rule(t), (tuple(t.shape), t.stride())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 7)), min_size=0, max_size=4))
@example([(2, 1), (1, 0), (2, 2)])  # c10 True, torch._prims_common's Python rule False (see _c10_rule)
def test_non_overlapping_and_dense_is_torchs_rule_on_any_strides(dims):
    t = torch.empty(0, device="meta").as_strided([n for n, _ in dims], [s for _, s in dims])
    assert is_non_overlapping_and_dense(t) == _c10_rule(t), dims


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=0, max_size=5))
def test_contiguous_strides_are_torchs(shape):
    assert contiguous_strides(shape) == torch.empty(shape).stride()


def test_a_whole_steps_first_call_finds_the_gradient_path_once(monkeypatch):
    # The path of values a backward reaches is found once, by the backward, then extended line by line: the
    # optimizer's writes into its new state and the outputs' rebuild once found it anew each (four times a step,
    # over every line: a tenth of T5's first call).
    from thunder_train.compiler.transforms import autograd

    built = []
    init = autograd.Forward.__init__
    monkeypatch.setattr(autograd.Forward, "__init__", lambda self, *a: (built.append(len(a[0])), init(self, *a))[1])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]

    cf = tt.compile(squared_output_step, thin=True)
    x = torch.randn(4, 8)
    torch.testing.assert_close(cf(model, opts[0], x), squared_output_step(eager, opts[1], x))
    assert len(built) == 1, built
    for a, b in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b)
