"""torch.autocast around (and inside) compiled functions, compared with eager autocast on the CPU.

The tracer records the conversions autocast would do as explicit trace lines
(``thunder_train/compiler/torchlang/autocast.py``); the computation then runs
with autocast disabled.  Outputs (values and dtypes) and gradients must match
eager PyTorch under the same autocast state.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from _models import Block, leaves  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from op_table import OPS  # noqa: E402

BF16 = torch.bfloat16


def autocast(enabled=True):
    return torch.autocast("cpu", dtype=BF16, enabled=enabled)


_leaves = leaves


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def assert_close_rel(actual, expected, tol=2e-2, what=""):
    """Same dtype and shape; relative error (in norm) below ``tol`` — bfloat16 rounds at every op."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, eager {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)}, eager {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    err = torch.linalg.vector_norm(a - e).item()
    scale = torch.linalg.vector_norm(e).item()
    assert err <= tol * scale + 1e-6, f"{what}: relative error {err / max(scale, 1e-30):.3g} > {tol}"


def check_autocast(fn, *args, tol=2e-2, exact_forward=True, decompose=False):
    """Compiled ``fn`` under CPU bf16 autocast: outputs and gradients of float inputs match eager under autocast."""
    eager_args, comp_args = _clone(args), _clone(args)
    with autocast():
        expected = fn(*eager_args)
    cf = tt.compile(fn, decompose=decompose)
    with autocast():
        actual = cf(*comp_args)
    outs_e, outs_a = _leaves(expected), _leaves(actual)
    assert len(outs_e) == len(outs_a)
    for i, (a, e) in enumerate(zip(outs_a, outs_e)):
        if exact_forward and not decompose:
            # The torch executor runs the same torch calls on the same (cast) inputs as eager autocast.
            assert a.dtype == e.dtype, f"output {i}: dtype {a.dtype}, eager {e.dtype}"
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m: f"output {i}: {m}")
        else:
            assert_close_rel(a, e, tol, f"output {i}")
    leaves_e = [x for x in _leaves(eager_args) if isinstance(x, torch.Tensor) and x.requires_grad]
    leaves_a = [x for x in _leaves(comp_args) if isinstance(x, torch.Tensor) and x.requires_grad]
    if leaves_e:
        torch.manual_seed(0)
        cots = [torch.randn_like(o) for o in outs_e]
        # Backward outside the autocast region, as PyTorch recommends.
        ge = torch.autograd.grad(outs_e, leaves_e, cots, allow_unused=True)
        ga = torch.autograd.grad(outs_a, leaves_a, cots, allow_unused=True)
        for i, (a, e) in enumerate(zip(ga, ge)):
            if e is None:
                assert a is None or not a.any()
                continue
            assert a is not None, f"no gradient for input {i}"
            assert a.dtype == leaves_a[i].dtype
            assert_close_rel(a, e, tol, f"gradient {i}")
    return cf


def _r(*shape, grad=True, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


# ---------------------------------------------------------------------------
# Single ops
# ---------------------------------------------------------------------------
def test_linear_runs_in_bf16_with_explicit_casts():
    torch.manual_seed(0)
    cf = check_autocast(lambda x, w, b: F.linear(x, w, b), _r(4, 8), _r(6, 8), _r(6))
    src = str(tt.last_traces(cf)[0])
    assert "autocast(cpu, bfloat16): torch.nn.functional.linear runs in bfloat16" in src
    casts = [ln for ln in src.splitlines() if "prims.convert_element_type" in ln and not ln.lstrip().startswith("#")]
    assert len(casts) == 3  # x, weight and bias
    final = str(tt.last_traces(cf)[-1])
    assert '@torch.autocast("cpu", enabled=False)' in final
    # The gradients of float32 inputs are float32 (the cast is differentiable), like eager.
    bwd = str(tt.last_backward_traces(cf)[-1])
    assert "torch.float32" in bwd


@pytest.mark.parametrize(
    "name, fn, shapes",
    [
        ("matmul", lambda a, b: a @ b, [(3, 4, 5), (5, 2)]),
        ("mm", lambda a, b: torch.mm(a, b), [(3, 5), (5, 2)]),
        ("bmm", lambda a, b: torch.bmm(a, b), [(2, 3, 5), (2, 5, 4)]),
        ("baddbmm", lambda c, a, b: torch.baddbmm(c, a, b), [(2, 3, 4), (2, 3, 5), (2, 5, 4)]),
        ("addmm", lambda c, a, b: torch.addmm(c, a, b), [(3, 4), (3, 5), (5, 4)]),
        ("einsum", lambda a, b: torch.einsum("bij,bjk->bik", a, b), [(2, 3, 5), (2, 5, 4)]),
        ("conv1d", lambda x, w, b: F.conv1d(x, w, b, padding=1), [(2, 3, 9), (4, 3, 3), (4,)]),
        ("conv2d", lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=1), [(2, 3, 7, 7), (5, 3, 3, 3), (5,)]),
        ("softmax", lambda x: torch.softmax(x, -1), [(3, 7)]),
        ("log_softmax", lambda x: F.log_softmax(x, 1), [(3, 7)]),
        ("layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), [(2, 3, 8), (8,), (8,)]),
        ("gelu", lambda x: F.gelu(x), [(3, 7)]),
        ("mse_loss", lambda x, y: F.mse_loss(x, y), [(3, 7), (3, 7)]),
        # bf16 activations meeting float32 parameters in ops autocast does not touch (type promotion as usual)
        ("mixed", lambda x, w, g, b: (F.layer_norm(x @ w, (5,), g, b), F.gelu(x @ w) * g, torch.cat([x @ w, g[None]], 0)),
         [(3, 4), (4, 5), (5,), (5,)]),
    ],
)
def test_op_matches_eager_autocast(name, fn, shapes):
    torch.manual_seed(0)
    check_autocast(fn, *[_r(*s) for s in shapes])


@pytest.mark.parametrize("name, kwargs", [("plain", {}), ("causal", {"is_causal": True}), ("float_mask", "mask")])
def test_sdpa(name, kwargs):
    torch.manual_seed(0)
    q, k, v = _r(2, 2, 5, 8), _r(2, 2, 6, 8), _r(2, 2, 6, 8)
    if kwargs == "mask":
        m = _r(5, 6)
        # A mask that requires grad makes eager pick the math kernel; ours runs the fused one (rounds differently).
        check_autocast(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), q, k, v, m, exact_forward=False)
    else:
        if kwargs.get("is_causal"):
            k, v = _r(2, 2, 5, 8), _r(2, 2, 5, 8)
        check_autocast(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs), q, k, v)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_of_bf16_logits_runs_in_float32(smoothing):
    torch.manual_seed(0)
    target = torch.tensor([1, 0, 4, 2])

    def f(x, w):
        logits = x @ w  # bf16 under autocast
        return F.cross_entropy(logits, target, label_smoothing=smoothing)  # fp32 op: float32 loss

    cf = check_autocast(f, _r(4, 6), _r(6, 5))
    with autocast():
        assert cf(torch.randn(4, 6), torch.randn(6, 5)).dtype == torch.float32


def test_float64_and_integer_inputs_are_not_cast():
    cf = tt.compile(lambda a, b, i: (a @ b, F.embedding(i, b)))
    a, b, i = torch.randn(3, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64), torch.tensor([0, 2])
    with autocast():
        out = cf(a, b, i)
        ref = (a @ b, F.embedding(i, b))
    assert out[0].dtype == ref[0].dtype == torch.float64
    torch.testing.assert_close(out, ref)
    assert "convert_element_type" not in str(tt.last_traces(cf)[0])


def test_cat_promotes_like_autocast():
    def f(x, w, y):
        return torch.cat([x @ w, y], 1)  # bf16 and f32: float32, the widest

    check_autocast(f, _r(3, 4), _r(4, 2), _r(3, 5))


@pytest.mark.parametrize("eq, shapes", [("ij,jk->ik", [(3, 4), (4, 5)]), ("i,j->ij", [(3,), (4,)]), ("ij,ij->i", [(3, 4), (3, 4)]), ("ij->j", [(3, 4)])])
def test_einsum_casts_only_when_eager_contracts_with_bmm(eq, shapes):
    torch.manual_seed(0)
    check_autocast(lambda *ops: torch.einsum(eq, *ops), *[_r(*s) for s in shapes])


def test_decomposed_execution_matches_eager_autocast():
    """decompose=True runs prims; with autocast off inside the computation they keep the trace's dtypes."""
    torch.manual_seed(0)

    def f(x, w, q, k, v):
        h = torch.softmax(x @ w, -1)
        return h, F.scaled_dot_product_attention(q, k, v, is_causal=True)

    check_autocast(f, _r(3, 4), _r(4, 5), _r(1, 2, 4, 8), _r(1, 2, 4, 8), _r(1, 2, 4, 8), decompose=True)


# ---------------------------------------------------------------------------
# Every op of the op table, compiled under autocast, has eager autocast's dtypes and values
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS, ids=[o.name for o in OPS])
def test_op_table_under_autocast(op):
    for src in (torch.float32, BF16):
        if src not in op.dtypes:
            continue
        torch.manual_seed(0)
        sample = op.samples(src)[0]
        with autocast():
            expected = op.fn(*_clone(sample.args), **_clone(sample.kwargs))
            actual = tt.compile(op.fn)(*_clone(sample.args), **_clone(sample.kwargs))
        for i, (a, e) in enumerate(zip(_leaves(actual), _leaves(expected))):
            if not isinstance(e, torch.Tensor):
                continue
            assert a.dtype == e.dtype, f"{op.name} ({src}) output {i}: dtype {a.dtype}, eager autocast {e.dtype}"
            assert a.shape == e.shape
            if not op.random:
                torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2, equal_nan=True)


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def _train_steps(make_model, make_batch, loss_fn, steps=2, tol=3e-2):
    torch.manual_seed(0)
    model = make_model()
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    cm = tt.compile(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    for step in range(steps):
        x, y = make_batch()
        with autocast():
            out, out_ref = cm(x), ref(x)
            loss, loss_ref = loss_fn(out, y), loss_fn(out_ref, y)
        assert out.dtype == out_ref.dtype and loss.dtype == loss_ref.dtype
        assert_close_rel(out, out_ref, tol, f"step {step} output")
        loss.backward()
        loss_ref.backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == torch.float32
            assert_close_rel(p.grad, q.grad, tol, f"step {step} {name}.grad")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    assert tt.compile_stats(cm).cache_misses == 1
    return cm


def test_mlp_training_steps_match_eager_autocast():
    _train_steps(
        lambda: nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 5)),
        lambda: (torch.randn(16, 8), torch.randint(0, 5, (16,))),
        F.cross_entropy,
    )


def test_transformer_block_training_steps_match_eager_autocast():
    cm = _train_steps(Block, lambda: (torch.randn(2, 5, 16), torch.randn(2, 5, 16)), lambda o, y: F.mse_loss(o.float(), y))
    fwd = str(tt.last_traces(cm)[-1])
    assert "torch.nn.functional.scaled_dot_product_attention" in fwd and "torch.bfloat16" in fwd


# ---------------------------------------------------------------------------
# Cache and nested regions
# ---------------------------------------------------------------------------
def test_calling_without_autocast_retraces():
    cf = tt.compile(lambda x, w: x @ w)
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    with autocast():
        assert cf(x, w).dtype == BF16
    out = cf(x, w)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x @ w)
    stats = tt.compile_stats(cf)
    assert stats.cache_misses == 2
    assert any("autocast" in r for r in stats.retrace_reasons), stats.retrace_reasons
    assert "convert_element_type" not in str(tt.last_traces(cf)[0])
    assert "autocast" not in str(tt.last_traces(cf)[-1])  # no decorator when autocast is off
    with autocast():
        assert cf(x, w).dtype == BF16
    assert tt.compile_stats(cf).cache_hits == 1


def test_nested_autocast_disabled_region():
    def f(x, w):
        y = x @ w  # bf16
        with torch.autocast("cpu", enabled=False):
            z = y.float() @ w.t()  # float32 even though the caller enabled autocast
        return y, z

    torch.manual_seed(0)
    cf = check_autocast(f, _r(3, 4), _r(4, 4))
    with autocast():
        y, z = cf(torch.randn(3, 4), torch.randn(4, 4))
    assert (y.dtype, z.dtype) == (BF16, torch.float32)
    assert '@torch.autocast("cpu", enabled=False)' in str(tt.last_traces(cf)[-1])


def test_function_whose_whole_body_disables_autocast():
    """Only the outer state knows autocast is on; the computation must not be autocast at run time."""

    def f(x, w):
        with torch.autocast("cpu", enabled=False):
            return F.linear(x, w)

    cf = tt.compile(f)
    x, w = torch.randn(3, 4), torch.randn(5, 4)
    with autocast():
        out = cf(x, w)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, f(x, w), rtol=0, atol=0)


def test_autocast_entered_inside_the_function():
    def f(x, w):
        with torch.autocast("cpu", dtype=BF16):
            y = x @ w
        return y, y.float() @ w.t()

    cf = tt.compile(f)
    x, w = torch.randn(3, 4), torch.randn(4, 4)
    out, ref = cf(x, w), f(x, w)
    assert [o.dtype for o in out] == [o.dtype for o in ref] == [BF16, torch.float32]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_thin_mode_under_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    cm = tt.compile(model, thin=True)
    for _ in range(4):
        x = torch.randn(4, 8)
        with autocast():
            out, ref = cm(x), model(x)
        assert out.dtype == ref.dtype == BF16
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert tt.compile_stats(cm).cache_misses == 1


# ---------------------------------------------------------------------------
# The CUDA policies (torch 2.13's autocast_mode.h lists), checked on proxies without a GPU
# ---------------------------------------------------------------------------
@pytest.fixture
def cuda_autocast_state():
    """CUDA autocast switched on in the thread-local state (possible without a GPU); restored afterwards."""
    prev = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    yield
    torch.set_autocast_enabled("cuda", prev[0])
    torch.set_autocast_dtype("cuda", prev[1])


@pytest.mark.parametrize(
    "name, call, expected",
    [
        ("matmul", lambda x, w: ((x, w), {}), [torch.float16, torch.float16]),
        ("softmax", lambda x, w: ((w, -1), {}), [torch.float32]),
        ("softmax", lambda x, w: ((x, -1), {}), [torch.float32]),  # fp32_set_opt_dtype: f16 input runs in f32
        ("softmax", lambda x, w: ((x, -1), {"dtype": torch.float16}), [torch.float16]),  # explicit dtype respected
        ("sum", lambda x, w: ((x,), {}), [torch.float32]),
        ("exp", lambda x, w: ((x,), {}), [torch.float32]),
        ("layer_norm", lambda x, w: ((x, (3,)), {}), [torch.float32]),
        ("atan2", lambda x, w: ((x, w), {}), [torch.float32, torch.float32]),  # promote: widest is f32
        ("atan2", lambda x, w: ((x, x), {}), [torch.float16, torch.float16]),
        ("gelu", lambda x, w: ((x,), {}), [torch.float16]),  # not autocast
        ("cross_entropy", lambda x, w: ((x, w), {}), [torch.float32, torch.float32]),
    ],
)
def test_cuda_policies_on_proxies(cuda_autocast_state, name, call, expected):
    from thunder_train.compiler import context, torchlang
    from thunder_train.compiler.proxies import TensorProxy
    from thunder_train.compiler.torchlang.autocast import cast_inputs
    from thunder_train.compiler.trace import Trace

    trc = Trace()
    with context.tracing(trc):
        x = TensorProxy("x", shape=(3, 3), dtype=torch.float16, device="cuda")
        w = TensorProxy("w", shape=(3, 3), dtype=torch.float32, device="cuda")
        args, kwargs = call(x, w)
        sym = torchlang.all_symbols[name]
        args, _ = cast_inputs(sym, getattr(torch, name, None), args, kwargs)
    assert [a._tt_dtype.torch for a in args if isinstance(a, torch.Tensor)] == expected
    assert trc.decorators == ['@torch.autocast("cuda", enabled=False)']


def test_binary_cross_entropy_is_refused_under_cuda_autocast(cuda_autocast_state):
    from thunder_train.compiler import context, torchlang
    from thunder_train.compiler.proxies import TensorProxy
    from thunder_train.compiler.torchlang.autocast import cast_inputs
    from thunder_train.compiler.trace import Trace

    with context.tracing(Trace()):
        x = TensorProxy("x", shape=(4,), dtype=torch.float32, device="cuda")
        with pytest.raises(RuntimeError, match="unsafe to autocast"):
            cast_inputs(torchlang.all_symbols["binary_cross_entropy"], F.binary_cross_entropy, (x, x), {})


def _to_cuda(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cuda").requires_grad_(x.requires_grad)
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cuda(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_cuda(v) for k, v in x.items()}
    return x


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, BF16])
def test_op_table_under_cuda_autocast(dtype):
    failures = []
    for op in OPS:
        if torch.float32 not in op.dtypes or op.name.startswith("binary_cross_entropy") and "logits" not in op.name:
            continue
        torch.manual_seed(0)
        sample = op.samples(torch.float32)[0]
        args, kwargs = _to_cuda(sample.args), _to_cuda(sample.kwargs)
        with torch.autocast("cuda", dtype=dtype):
            try:
                expected = op.fn(*_clone(args), **_clone(kwargs))
            except Exception:
                continue
            actual = tt.compile(op.fn)(*_clone(args), **_clone(kwargs))
        for a, e in zip(_leaves(actual), _leaves(expected)):
            if isinstance(e, torch.Tensor) and a.dtype != e.dtype:
                failures.append(f"{op.name}: {a.dtype} vs eager {e.dtype}")
    assert not failures, failures
