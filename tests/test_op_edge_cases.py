"""Ops at the edges OpInfo's later samples reach, compiled and compared with eager: values, dtypes, shapes and
gradients.

Each case was silently different from eager once (or failed where eager runs): ``meshgrid(indexing="xy")``,
circular padding with negative pads, ``local_response_norm`` of integers, ``index_fill``'s value gradient with a
repeated index, ``linalg.lstsq``'s drivers, reductions of 0-d tensors, the gradient of ``std`` / ``norm`` at a
zero spread; with their neighbours (the other pad modes, other integer dtypes, the other drivers, ...).
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

import thunder_train as tt


def _leaves(x):
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _same(actual, expected, rtol, atol):
    a, e = _leaves(actual), _leaves(expected)
    assert len(a) == len(e)
    for x, y in zip(a, e):
        assert (x.shape, x.dtype, x.requires_grad) == (y.shape, y.dtype, y.requires_grad)
        torch.testing.assert_close(x.detach(), y.detach(), rtol=rtol, atol=atol, equal_nan=True)


def check(fn, *args, rtol=1e-6, atol=1e-6, grad=True):
    """``fn(*args)`` compiled equals eager; with ``grad``, so do the gradients of a weighted sum of its float
    outputs with respect to the float inputs."""
    def run(f):
        a = [t.detach().clone().requires_grad_(grad and t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in args]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = f(*a)
        ins = [t for t in a if isinstance(t, torch.Tensor) and t.requires_grad]
        outs = [o for o in _leaves(out) if o.requires_grad]
        if not (grad and ins and outs):
            return out, []
        g = torch.Generator().manual_seed(3)
        loss = sum((o * torch.rand(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
        return out, [torch.zeros_like(t) if d is None else d for t, d in zip(ins, torch.autograd.grad(loss, ins, allow_unused=True))]

    expected, e_grads = run(fn)
    actual, c_grads = run(tt.compile(fn))
    _same(actual, expected, rtol, atol)
    _same(c_grads, e_grads, rtol, atol)


# ---- meshgrid ----
@pytest.mark.parametrize("indexing", ["ij", "xy", None])
@pytest.mark.parametrize("sizes", [(3, 1), (3, 4), (3, 0), (2, 3, 4), (3, 1, 2, 1)])
def test_meshgrid(indexing, sizes):
    ts = [torch.randn(n, dtype=torch.float64) for n in sizes]
    kw = {} if indexing is None else {"indexing": indexing}
    check(lambda *t: torch.meshgrid(*t, **kw), *ts)
    check(lambda *t: torch.meshgrid(list(t), **kw), *ts)


def test_meshgrid_of_scalars_and_cartesian_prod():
    a, b = torch.randn(3, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)
    check(lambda x, y: torch.meshgrid(x, y, indexing="xy"), a, b)
    check(lambda x, y: torch.cartesian_prod(x, y), a, torch.randn(2, dtype=torch.float64))


# ---- F.pad: every mode with negative (cropping) and positive pads ----
PADS_1D = [(1, 1), (-1, 1), (1, -1), (-1, 2), (2, -1), (-2, 1), (-1, -1), (0, -2), (3, 3), (-3, 3)]


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate", "constant"])
@pytest.mark.parametrize("pad", PADS_1D)
def test_pad_1d(mode, pad):
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    try:
        F.pad(x, pad, mode=mode)
    except Exception:  # eager rejects it: the compiled call raises too
        with pytest.raises(Exception):
            tt.compile(lambda t: F.pad(t, pad, mode=mode))(x)
        return
    check(lambda t: F.pad(t, pad, mode=mode), x)


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
@pytest.mark.parametrize("pad", [(-1, 1, -2, 1), (1, -1, 2, 0), (-1, 0, 1, -1, 1, 1)])
def test_pad_nd_negative(mode, pad):
    for x in (torch.randn(*(3, 4, 4, 5)[: len(pad) // 2 + 1], dtype=torch.float64),
              torch.randn(*(2, 3, 4, 4, 5)[: len(pad) // 2 + 2], dtype=torch.float64)):
        check(lambda t: F.pad(t, pad, mode=mode), x)


@pytest.mark.parametrize("mode", ["circular", "reflect", "replicate"])
def test_pad_forms_eager_rejects_are_rejected(mode):
    x = torch.randn(1, 3, 4, 4, 5)
    with pytest.raises(NotImplementedError):
        F.pad(x, (1, 1, 1, 1), mode=mode)
    with pytest.raises(NotImplementedError):
        tt.compile(lambda t: F.pad(t, (1, 1, 1, 1), mode=mode))(x)


# ---- integer inputs where eager computes in integers ----
@pytest.mark.parametrize("shape", [(2, 5, 4), (2, 5, 3, 4)])
def test_local_response_norm_of_integers(shape):
    x = torch.randint(-9, 10, shape)  # eager averages the int64 squares with truncation (avg_pool's)
    for size in (2, 3, 4):
        check(lambda t: F.local_response_norm(t, size, alpha=0.5, beta=0.75, k=1.0), x, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_local_response_norm_of_other_integers_raises_as_eager(dtype):
    x = torch.randint(0, 10, (2, 5, 4)).to(dtype)
    with pytest.raises(NotImplementedError):
        F.local_response_norm(x, 2)
    with pytest.raises(NotImplementedError):
        tt.compile(lambda t: F.local_response_norm(t, 2))(x)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_xlog1py_and_xlogy_of_integers(dtype):
    x = torch.tensor([0, 0, 3, -2, 5, 1]).to(dtype)
    y = torch.tensor([-1, 4, 0, 2, -1, 7]).to(dtype)
    check(torch.special.xlog1py, x, y, grad=False)
    check(torch.xlogy, x, y, grad=False)
    check(torch.special.xlog1py, x, y.double())
    check(torch.xlogy, x.double(), y)


# ---- index_fill and its neighbours with a repeated index ----
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_index_fill_value_gradient_counts_each_position_once(dim):
    x = torch.randn(4, 5, dtype=torch.float64)
    index = torch.tensor([1, 3, 1, 0, 3])  # (eager's backward rejects negative positions)
    value = torch.tensor(2.5, dtype=torch.float64)
    check(lambda t, i, v: t.index_fill(dim, i, v), x, index, value)
    check(lambda t, i: t.index_fill(dim, i, -1.5), x, index)
    check(lambda t, i, v: torch.index_fill(t, dim, i, v), x.to(torch.int64), index, value, grad=False)
    check(lambda t, i, v: t.index_fill(dim, i, v), x, torch.tensor([1, -1, 1]), value, grad=False)


def test_index_fill_of_a_scalar_and_in_place():
    check(lambda t, i, v: t.index_fill(0, i, v), torch.tensor(1.0, dtype=torch.float64), torch.tensor([0, 0]), torch.tensor(3.0, dtype=torch.float64))
    check(lambda t, i, v: t.clone().index_fill_(1, i, v), torch.randn(3, 4, dtype=torch.float64), torch.tensor([2, 2, 0]), torch.tensor(7.0, dtype=torch.float64))


def test_index_put_and_copy_with_repeated_indices_keep_eager_gradients():
    x, i = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 2, 4])
    check(lambda t, s: t.index_copy(0, i, s), x, torch.randn(3, 3, dtype=torch.float64))
    check(lambda t, v: t.index_put((torch.tensor([1, 1, 3]),), v, accumulate=True), x, torch.randn(3, dtype=torch.float64))


# ---- linalg.lstsq: every driver, rcond, rank-deficient problems ----
@pytest.mark.parametrize("driver", ["gels", "gelsy", "gelsd", "gelss", None])
@pytest.mark.parametrize("shape", [(5, 3), (3, 5), (2, 4, 3), (3, 3)])
def test_lstsq_drivers(driver, shape):
    torch.manual_seed(0)
    A = torch.randn(*shape, dtype=torch.float64)
    B = torch.randn(*shape[:-1], 2, dtype=torch.float64)
    check(lambda a, b: torch.linalg.lstsq(a, b, driver=driver), A, B)
    check(lambda a, b: torch.linalg.lstsq(a, b[..., 0], driver=driver), A, B)


@pytest.mark.parametrize("driver", ["gelsd", "gelss"])
def test_lstsq_rcond_and_rank_deficient_residuals(driver):
    torch.manual_seed(0)
    A = torch.randn(5, 3, dtype=torch.float64)
    low_rank = torch.randn(5, 2, dtype=torch.float64) @ torch.randn(2, 3, dtype=torch.float64)
    B = torch.randn(5, 2, dtype=torch.float64)
    check(lambda a, b: torch.linalg.lstsq(a, b, rcond=0.5, driver=driver), A, B)
    # residuals exist only at full column rank: the same compiled function follows the rank
    f = tt.compile(lambda a, b: torch.linalg.lstsq(a, b, driver=driver))
    for a in (A, low_rank, A):
        _same(f(a, B), torch.linalg.lstsq(a, B, driver=driver), 1e-6, 1e-6)


# ---- reductions of 0-d tensors (dims 0 and -1 name the scalar) ----
ZERO_D = {
    "softmax": lambda x: F.softmax(x, 0),
    "softmax-1": lambda x: torch.softmax(x, -1),
    "softmax_dtype": lambda x: F.softmax(x, 0, dtype=torch.float64),
    "log_softmax": lambda x: F.log_softmax(x, -1),
    "softmin": lambda x: F.softmin(x, 0),
    "implicit_dim": lambda x: F.log_softmax(x),
    "sum": lambda x: x.sum(0),
    "mean_list": lambda x: x.mean([-1]),
    "logsumexp": lambda x: torch.logsumexp(x, 0),
    "std0": lambda x: x.std(0, correction=0),
    "var_mean": lambda x: torch.var_mean(x, 0, correction=0),
    "std_mean": lambda x: torch.std_mean(x, -1, correction=0),
    "norm": lambda x: x.norm(dim=0),
    "cumsum": lambda x: x.cumsum(0),
    "logcumsumexp": lambda x: x.logcumsumexp(-1),
    "max": lambda x: x.max(0),
    "argmax": lambda x: x.argmax(-1),
    "topk1": lambda x: x.topk(1, 0),
    "topk0": lambda x: x.topk(0),
    "sort": lambda x: x.sort(0),
    "movedim": lambda x: x.movedim(0, -1),
    "moveaxis_list": lambda x: torch.moveaxis(x, [0], [0]),
}


@pytest.mark.parametrize("name", list(ZERO_D))
def test_zero_d_reductions(name):
    check(ZERO_D[name], torch.tensor(1.5, dtype=torch.float64))


def test_implicit_softmax_dim_follows_eager():
    for shape in [(3,), (2, 3), (2, 3, 4), (2, 3, 4, 5)]:
        x = torch.randn(shape, dtype=torch.float64)
        check(lambda t: F.softmax(t), x)
        check(lambda t: F.softmin(t), x)


# ---- gradients at a zero spread: eager's are 0, a square root's rule gives NaN ----
@pytest.mark.parametrize("name,fn", [
    ("std", lambda x: x.std()),
    ("std_dim", lambda x: x.std(1, keepdim=True)),
    ("std_mean", lambda x: torch.std_mean(x, 0)),
    ("std_correction0", lambda x: x.std(dim=(0, 1), correction=0)),
    ("norm", lambda x: (x - 1).norm()),
    ("norm_fro_dim", lambda x: (x - 1).norm(p="fro", dim=1)),
    ("dist", lambda x: torch.dist(x, torch.ones(2, 3, dtype=torch.float64))),
    ("vector_norm", lambda x: torch.linalg.vector_norm(x - 1, dim=0)),
])
def test_zero_spread_gradients(name, fn):
    x = torch.ones(2, 3, dtype=torch.float64)
    x[1] = torch.tensor([1.0, 2.0, 4.0])  # one constant row and one that is not
    check(fn, x)
    check(fn, torch.ones(2, 3, dtype=torch.float64))


def test_std_low_precision():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    check(lambda t: t.std(1), x, rtol=2e-2, atol=2e-2)


# ---- ctc_loss: run by torch (no meta kernel; its output metadata from a rule), eager's backward ----
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("zero_infinity", [False, True])
def test_ctc_loss(reduction, zero_infinity):
    torch.manual_seed(0)
    T, N, C = 12, 3, 6
    x = torch.randn(T, N, C, dtype=torch.float64)
    targets = torch.randint(1, C, (N, 5))
    il, tl = torch.tensor([12, 10, 3]), torch.tensor([4, 2, 5])  # the last is impossible: an infinite loss
    check(lambda t, y, a, b: F.ctc_loss(t.log_softmax(2), y, a, b, reduction=reduction, zero_infinity=zero_infinity),
          x, targets, il, tl)
    check(lambda t: F.ctc_loss(t.log_softmax(2), targets, [12, 10, 3], [4, 2, 5], blank=C - 1, reduction=reduction,
                               zero_infinity=zero_infinity), x)
    # unbatched, and concatenated 1-d targets
    check(lambda t: F.ctc_loss(t[:, 0].log_softmax(1), targets[0, :4], [12], [4], reduction=reduction), x)
    check(lambda t: F.ctc_loss(t.log_softmax(2), targets[:, :3].reshape(-1), il.clamp(min=8), torch.tensor([3, 3, 3]),
                               reduction=reduction), x)


def test_ctc_loss_module_in_a_training_step_full_and_thin():
    torch.manual_seed(0)
    for thin in (False, True):
        models = [torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LogSoftmax(-1)) for _ in range(2)]
        models[1].load_state_dict(models[0].state_dict())
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        ctc = torch.nn.CTCLoss(blank=0)

        def step(m, opt, x, y, il, tl):
            loss = ctc(m(x), y, il, tl)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        cs = tt.compile(step, thin=thin)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            batch = (torch.randn(10, 2, 4, generator=g), torch.randint(1, 6, (2, 4), generator=g),
                     torch.tensor([10, 8]), torch.tensor([4, 3]))
            torch.testing.assert_close(cs(models[1], opts[1], *batch), step(models[0], opts[0], *batch))
        for a, b in zip(models[1].parameters(), models[0].parameters()):
            torch.testing.assert_close(a, b)
        assert any("ctc_loss" in o for o in tt.compile_stats(cs).opaque_ops)


@pytest.mark.parametrize("fn", [torch.xlogy, torch.special.xlog1py])
@pytest.mark.parametrize("a,b", [("t", -1), ("t", 2.5), ("t", float("nan")), (0, "t"), (2, "t"), ("i", 3), (1.5, "i")])
def test_xlogy_family_with_a_number(fn, a, b):
    vals = {"t": torch.tensor([0.0, 0.0, 2.0, -1.0, 3.0], dtype=torch.float64), "i": torch.tensor([0, 1, -2, 3, 0])}
    check(lambda *ts: fn(*[vals_or(ts, v) for v in (a, b)]), *[vals[v] for v in (a, b) if isinstance(v, str)])


def vals_or(ts, v):
    """The tensor argument (there is one) in place of its name; a number as is."""
    return ts[0] if isinstance(v, str) else v


# ---- cumulative ops' gradients ----
@pytest.mark.parametrize("name,fn", [
    ("logcumsumexp", lambda x: torch.logcumsumexp(x, 1)),
    ("cumsum", lambda x: torch.cumsum(x, 0)),
    ("cumprod", lambda x: torch.cumprod(x, 1)),
    ("cummax", lambda x: torch.cummax(x, 1)),
    ("cummin", lambda x: torch.cummin(x, 0)),
])
def test_cumulative_gradients(name, fn):
    x = torch.randn(4, 6, dtype=torch.float64) * 3
    x[1, 2] = 0.0  # cumprod through a zero
    if name == "logcumsumexp":
        x[2, 3:] = -torch.inf
        x[3] = -torch.inf
    check(fn, x)


def test_logcumsumexp_gradient_is_eagers():
    """Eager's formula (reverse scans of ``log|g| - out``, the scan accumulated in double on the CPU): its float32
    gradient to rounding, NaN where the output is -inf (an all -inf prefix), and the decomposition's forward."""
    torch.manual_seed(0)
    x = torch.randn(5, 6, 5) * 3
    x[0, :2] = -torch.inf
    x[1, :, 0] = -torch.inf
    f = lambda t: torch.logcumsumexp(t, 1)  # noqa: E731
    check(f, x, rtol=1e-6, atol=1e-6)
    check(lambda t: torch.logcumsumexp(t, -1), x.double(), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(tt.compile(f, decompose=True)(x), f(x), rtol=1e-5, atol=1e-5)


def test_sum_to_size_of_its_own_shape_is_the_input():
    x = torch.randn(2, 3)
    for size in [(2, 3), ((2, 3),), (torch.Size([2, 3]),)]:
        f = tt.compile(lambda t: (t, t.sum_to_size(*size)))
        a, b = f(x)
        assert b is a is x
    check(lambda t: t.sum_to_size(1, 3), x.double())
    check(lambda t: t.sum_to_size(2, 3) * 2, x.double())


@pytest.mark.parametrize("fn", [
    lambda t: F.avg_pool2d(t, (2, 2), (), (0,), False, True, -2),
    lambda t: F.avg_pool2d(t, [3], [1], [1]),
    lambda t: F.max_pool2d(t, [2], [2], [1]),
    lambda t: F.conv2d(t, torch.ones(2, 1, 3, 3, dtype=t.dtype), stride=[2], padding=[1]),
])
def test_one_element_pool_and_conv_parameters_repeat(fn):
    check(fn, torch.randn(1, 1, 5, 5, dtype=torch.float64))


# Ops without a meta kernel in torch, run through torch with their outputs' metadata from a rule declared with
# the op (torchlang/linalg.py, statistics.py): values, types and memory layout are eager's, so what follows them
# (a view that needs a contiguous input) behaves as in eager.
@pytest.mark.parametrize("shape", [(3, 4), (4, 3), (2, 3, 4), (0, 3, 2)])
def test_geqrf_layout_and_values(shape):
    x = torch.randn(*shape, dtype=torch.float64)
    got, want = tt.compile(torch.geqrf)(x), torch.geqrf(x)
    assert type(got) is type(want)
    for a, e in zip(got, want):
        assert a.stride() == e.stride()
        torch.testing.assert_close(a, e)
    with pytest.raises(RuntimeError, match="view size is not compatible"):  # column-major, as eager's
        tt.compile(lambda t: torch.geqrf(t).a.view(-1))(torch.randn(3, 4))


@pytest.mark.parametrize("bins", [4, "edges"])
@pytest.mark.parametrize("weighted", [False, True])
def test_histogram(bins, weighted):
    x = torch.randn(20, dtype=torch.float64)
    b = torch.tensor([-1.0, 0.0, 0.5, 2.0], dtype=torch.float64) if bins == "edges" else bins
    kw = {"weight": torch.rand(20, dtype=torch.float64)} if weighted else {}
    got, want = tt.compile(lambda t: torch.histogram(t, b, **kw))(x), torch.histogram(x, b, **kw)
    assert type(got) is type(want)
    _same(got, want, 0, 0)
    _same(tt.compile(lambda t: t.histogram(b, density=True))(x), x.histogram(b, density=True), 0, 0)


@pytest.mark.parametrize("bins", [3, [2, 5], "edges"])
def test_histogramdd(bins):
    x = torch.randn(4, 10, 2)
    b = [torch.tensor([-1.0, 0.0, 1.0]), torch.tensor([-2.0, 2.0])] if bins == "edges" else bins
    got, want = tt.compile(lambda t: torch.histogramdd(t, b))(x), torch.histogramdd(x, b)
    assert type(got) is type(want) and type(got.bin_edges) is type(want.bin_edges)
    _same(got, want, 0, 0)


@torch.library.custom_op("tt_edge_cases::picky_on_meta", mutates_args=())
def _picky_on_meta(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_picky_on_meta.register_fake
def _(x):
    raise RuntimeError("this op's fake kernel rejects these arguments")


def test_an_op_rejecting_its_arguments_on_meta_tensors_does_not_blame_data_dependent_shapes():
    """(``addbmm_`` resizing its destination was this test's op until it ran as eager: test_metadata_inplace.py.)"""
    with pytest.raises(Exception) as info:
        tt.compile(lambda x: _picky_on_meta(x) * 2)(torch.randn(3))
    assert "depends on tensor values" not in str(info.value) and "rejected these arguments" in str(info.value)


def _value_and_grad(fn, x, *args):
    x = x.detach().clone().requires_grad_()
    out = fn(x, *args)
    (g,) = torch.autograd.grad(out.sum(), x, allow_unused=True)
    return out.detach(), g


@pytest.mark.parametrize("dim", [None, 0, 1, -1])
def test_take_along_dim_counts_negative_indices_from_the_end_in_its_gradient(dim):
    x = torch.randn(4, 5)
    n = x.numel() if dim is None else x.shape[dim]
    idx = torch.randint(0, n, (4 * 5,)) if dim is None else torch.randint(-n, n, (4, 5))  # (eager wraps with a dim)
    fn = lambda t, i: torch.take_along_dim(t, i, dim)  # noqa: E731
    _same(tt.compile(_value_and_grad)(fn, x, idx), _value_and_grad(fn, x, idx), 0, 0)


@pytest.mark.parametrize("case", ["empty_index_of_higher_rank", "zero_dim_input", "zero_dim_both"])
def test_gather_edges(case):
    x, idx = {"empty_index_of_higher_rank": (torch.randn(5), torch.zeros(2, 0, dtype=torch.uint8)),
              "zero_dim_input": (torch.tensor(3.0), torch.tensor([0, 0])),
              "zero_dim_both": (torch.tensor(3.0), torch.tensor(0))}[case]
    fn = lambda t, i: torch.gather(t, 0, i)  # noqa: E731
    _same(tt.compile(_value_and_grad)(fn, x, idx), _value_and_grad(fn, x, idx), 0, 0)


def test_batch_norm_of_an_empty_1d_input_and_its_error_otherwise():
    stats = (torch.zeros(0), torch.zeros(0))
    fn = lambda t, m, v: F.batch_norm(t, m, v, training=True)  # noqa: E731
    _same(tt.compile(_value_and_grad)(fn, torch.randn(0), *stats), _value_and_grad(fn, torch.randn(0), *stats), 0, 0)
    with pytest.raises(RuntimeError):
        fn(torch.randn(3), torch.zeros(3), torch.ones(3))  # eager's error ...
    with pytest.raises(RuntimeError, match="at least 2 dimensions"):
        tt.compile(fn)(torch.randn(3), torch.zeros(3), torch.ones(3))  # ... and ours says why


def test_updated_empty_tensors_do_not_alias_each_other():
    """Every storage without bytes has data pointer 0: two empty inputs, one updated, share nothing."""
    def fn(a, b):
        a.add_(1)
        return b * 2

    a, b = torch.zeros(0), torch.zeros(0)
    torch.testing.assert_close(tt.compile(fn)(a, b), fn(a.clone(), b.clone()))


_UNBATCHED = [("cross_entropy", dict(reduction="none")), ("cross_entropy", dict(reduction="none", weight=torch.rand(4))),
              ("cross_entropy", dict(reduction="none", label_smoothing=0.15)), ("cross_entropy", dict(reduction="sum")),
              ("cross_entropy", dict(reduction="mean", ignore_index=1)), ("nll_loss", dict(reduction="none")),
              ("nll_loss", dict(reduction="none", weight=torch.rand(4))), ("nll_loss", dict(reduction="mean"))]


@pytest.mark.parametrize("loss, kwargs", _UNBATCHED, ids=[n + "".join(f"-{k}" if isinstance(v, torch.Tensor) else f"-{k}={v}" for k, v in kw.items()) for n, kw in _UNBATCHED])
def test_class_index_losses_of_one_unbatched_sample(loss, kwargs):
    # Found by the ModuleInfo sweep (tests/moduleinfo_check.py): a (C,) input with a 0-d target and
    # reduction="none" gave a [1]-shaped loss (eager's is 0-d), and cross_entropy's gradient failed on it.
    fn = getattr(F, loss)
    check(lambda x, t: fn(x, t, **kwargs), torch.randn(4), torch.tensor(2))


# Found by the OpInfo sweep with 8 samples (session 40): matmul's gradient divided by a zero inner size when
# folding a batch of first operands into rows, and cosine_similarity's gradient of two 0-d tensors failed.
@pytest.mark.parametrize("a,b", [((5, 5, 0), (0, 5)), ((5, 0, 3), (3, 4)), ((2, 3, 4), (4, 0)), ((0, 3, 4), (4, 2)),
                                 ((3, 0), (0, 2)), ((0,), (0, 4)), ((2, 0, 3, 0), (0, 2))])
def test_matmul_gradients_with_a_zero_size(a, b):
    check(torch.matmul, torch.randn(*a), torch.randn(*b), rtol=0, atol=0)


@pytest.mark.parametrize("x1,x2", [((), ()), ((1,), ()), ((), (3,)), ((3,), (3,))])
@pytest.mark.parametrize("value", [1.5, 0.0, 1e-9])
def test_cosine_similarity_of_scalars_and_vectors_over_dim_0(x1, x2, value):
    check(lambda a, b: F.cosine_similarity(a, b, dim=0), torch.full(x1, value), torch.randn(x2))


@pytest.mark.parametrize("shape", [(2, 0, 3), (2, 4, 3)])
def test_unflatten_with_a_zero_size_beside_minus_one_raises_as_eager(shape):
    fn = lambda x: x.unflatten(1, (0, -1))  # noqa: E731
    with pytest.raises(RuntimeError):
        fn(torch.randn(*shape))
    with pytest.raises(RuntimeError, match="ambiguous"):  # (it was a ZeroDivisionError)
        tt.compile(fn)(torch.randn(*shape))


# Found by the OpInfo sweep with 25 samples: diff(n=0) with prepend/append was traced as their concatenation
# (f32[8, 5]) while torch ran eager's copy of the input (f32[5, 5]): the trace's shapes were not the program's,
# and the gradient had the traced shape.
@pytest.mark.parametrize("prepend,append", [(None, None), ((1, 5), None), ((1, 5), (2, 5))])
@pytest.mark.parametrize("n", [0, 1, 2])
def test_diff_orders_with_prepend_and_append(n, prepend, append):
    args = [torch.randn(5, 5), torch.randn(*prepend) if prepend else None, torch.randn(*append) if append else None]
    check(lambda x, p, a: torch.diff(x, n, 0, p, a), *args, rtol=0, atol=0)


@pytest.mark.parametrize("n", [3, 4, 6])
def test_diff_of_an_order_at_or_above_the_size(n):
    check(lambda x: torch.diff(x, n, 1), torch.randn(3, 3, 3), rtol=0, atol=0)
    check(lambda x: torch.diff(x, n, 1), torch.randn(3, 3, 3) > 0, grad=False)


def test_diff_of_a_negative_order_raises_as_eager():
    with pytest.raises(RuntimeError, match="order must be non-negative"):
        tt.compile(lambda x: torch.diff(x, -1))(torch.randn(4))


# Found by the OpInfo sweep with 25 samples: group norm of an empty batch reshaped with -1, ambiguous at 0 elements.
@pytest.mark.parametrize("shape", [(0, 2), (0, 4, 3), (0, 4, 2, 2), (2, 4, 3)])
def test_group_norm_of_an_empty_batch(shape):
    C = shape[1]
    check(lambda x, w, b: F.group_norm(x, 2 if C % 2 == 0 else 1, w, b), torch.randn(*shape), torch.randn(C), torch.randn(C))
    hw = 1
    for d in shape[2:]:
        hw *= d
    check(lambda x, w, b: torch.native_group_norm(x, w, b, shape[0], C, hw, 1, 1e-5), torch.randn(*shape), torch.randn(C), torch.randn(C))
