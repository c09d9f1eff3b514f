"""Memory layout follows eager: strides, contiguity, view legality, as_strided, channels_last,
and the layouts of gradients and optimizer state (fused kernels included)."""
import copy

import pytest
import torch
from torch import nn

import thunder_train as tt


def _meta(t):
    return (tuple(t.shape), t.stride(), t.is_contiguous(), t.is_contiguous(memory_format=torch.channels_last))


LAYOUT_FUNCS = {
    "transpose": lambda x: x.transpose(0, 1),
    "t_then_mul": lambda x: x[0].t() * 2,
    "permute_add": lambda x: x.permute(2, 0, 1) + 1,
    "slice": lambda x: x[:, 1:],
    "step_slice": lambda x: x[::2],
    "expand": lambda x: x[:, :1].expand(-1, 5, -1),
    "narrow_contiguous": lambda x: x.narrow(1, 1, 2).contiguous(),
    "reshape_transposed": lambda x: x.transpose(0, 1).reshape(-1, 4),
    "matmul_t": lambda x: x[0] @ x[1].t(),
    "unsqueeze_select": lambda x: x.unsqueeze(1)[:, :, 2],
    "clone_preserve": lambda x: x.transpose(1, 2).clone(),
    "zeros_like_t": lambda x: torch.zeros_like(x.transpose(0, 2)),
    "softmax_t": lambda x: x.transpose(0, 1).softmax(-1),
    "to_channels_last": lambda x: x.unsqueeze(0).to(memory_format=torch.channels_last) * 3,
    "to_dtype_transposed": lambda x: x.transpose(0, 2).to(torch.float64),
    "to_contiguous_format": lambda x: x.transpose(0, 2).to(memory_format=torch.contiguous_format),
    "contiguous_channels_last": lambda x: x.unsqueeze(0).contiguous(memory_format=torch.channels_last),
    "clone_channels_last": lambda x: x.unsqueeze(0).clone(memory_format=torch.channels_last) + 1,
    "empty_like_channels_last": lambda x: torch.zeros_like(x.unsqueeze(0), memory_format=torch.channels_last),
    # the layouts known without a fake run (``Symbol.layout_rule``, declared by executors/layout_rules.py) and their neighbours
    "linear_row_major": lambda x: torch.nn.functional.linear(x, torch.ones(6, 4)),
    "linear_transposed_input": lambda x: torch.nn.functional.linear(x.transpose(0, 1), torch.ones(6, 4)),
    "matmul_2d_transposed_operands": lambda x: x[0].t() @ x[1],
    "matmul_batched_transposed": lambda x: x.transpose(1, 2) @ x,
    "foreach_add_row_major": lambda x: torch._foreach_add([x, x[0]], 1.0)[1],
    "foreach_add_transposed": lambda x: torch._foreach_add([x.transpose(0, 2), x], 1.0)[0],
    "zeros_like_row_major": lambda x: torch.zeros_like(x[1:]),
    # ops tagged "layout_on_meta" (their layout found on meta tensors) on inputs laid out otherwise
    "cat_transposed": lambda x: torch.cat([x.transpose(0, 2), x.transpose(0, 2) + 1], 1),
    "cat_channels_last": lambda x: torch.cat([x.unsqueeze(0).contiguous(memory_format=torch.channels_last)] * 2, 1),
    "pad_transposed": lambda x: torch.nn.functional.pad(x.transpose(1, 2), (1, 2)),
    "embedding_transposed_weight": lambda x: torch.nn.functional.embedding(torch.tensor([[0, 2], [1, 3]]), x[0].t()),
    "bmm_transposed": lambda x: torch.bmm(x.transpose(1, 2), x),
    "baddbmm_expanded": lambda x: torch.baddbmm(x[:, :1, :1].expand(-1, 4, 4), x.transpose(1, 2), x),
    "addmm_transposed": lambda x: torch.addmm(x[0, 0], x[0].t(), x[1]),
    "mm_sliced": lambda x: x[0, :, ::2].mm(x[1, :2]),
    "matmul_3d_by_transposed_2d": lambda x: x @ x[0, :4].t(),
    "matmul_broadcast_batch": lambda x: x[:1] @ x.transpose(1, 2),
    "clone_expanded": lambda x: x[:, :1].expand(-1, 5, -1).clone() * 1,
    "relu_transposed": lambda x: x.transpose(0, 2).relu(),
    "mean_keepdim_permuted": lambda x: x.permute(2, 0, 1).mean(1, keepdim=True),
    "min_dim_permuted": lambda x: x.permute(2, 0, 1).min(1)[0],
    "min_elementwise_transposed": lambda x: torch.min(x.transpose(0, 2), x.transpose(0, 2)[:1]),
    "masked_fill_transposed": lambda x: x.transpose(0, 2).masked_fill(x.transpose(0, 2) > 0, 0.5),
    "float_of_transposed_double": lambda x: x.double().transpose(0, 2).float(),
    "to_channels_last_dtype": lambda x: x.unsqueeze(0).to(torch.float64, memory_format=torch.channels_last) * 2,
}


@pytest.mark.parametrize("name", sorted(LAYOUT_FUNCS))
def test_stride_and_contiguity_inside_the_trace_match_eager(name):
    f = LAYOUT_FUNCS[name]

    def g(x):
        y = f(x)
        return y, _meta(y)

    x = torch.randn(3, 5, 4)
    out, info = tt.compile(g)(x)
    ref, ref_info = g(x)
    assert info == ref_info
    torch.testing.assert_close(out, ref)
    assert out.stride() == ref.stride()  # the tensor that comes back is laid out as in eager


def test_hf_loss_shift_contiguous_view_runs_and_contiguous_is_in_the_trace():
    def loss(logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return nn.functional.cross_entropy(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))

    logits, labels = torch.randn(2, 6, 11), torch.randint(0, 11, (2, 6))
    cf = tt.compile(loss)
    torch.testing.assert_close(cf(logits, labels), loss(logits, labels))
    assert "contiguous" in str(tt.last_traces(cf)[-1])


def test_printed_traces_with_layout_changes_run_as_python():
    from thunder_train.compiler.codegen import standard_namespace

    def f(x, labels):
        y = x.transpose(1, 2).contiguous().view(-1)
        z = x.to(memory_format=torch.channels_last).contiguous()
        return y * 2, z, labels[..., 1:].contiguous().view(-1)

    x, labels = torch.randn(2, 3, 4, 5), torch.randint(0, 9, (2, 6))
    cf = tt.compile(f)
    cf(x, labels)
    for trc in (tt.last_traces(cf)[0], tt.last_traces(cf)[-1]):
        ns = standard_namespace()
        exec(str(trc), ns)
        for a, b in zip(ns["computation"](x, labels), f(x, labels)):
            torch.testing.assert_close(a, b)


def test_contiguous_is_recorded_only_when_it_changes_the_layout():
    cf = tt.compile(lambda x: x.contiguous() * 2)
    cf(torch.randn(3, 4))
    assert "contiguous" not in str(tt.last_traces(cf)[0])
    cf2 = tt.compile(lambda x: x.t().contiguous() * 2)
    x = torch.randn(3, 4)
    torch.testing.assert_close(cf2(x), x.t().contiguous() * 2)
    assert "contiguous" in str(tt.last_traces(cf2)[0])
    # As in eager, contiguous() of a contiguous tensor is the tensor itself.
    assert tt.compile(lambda x: x.contiguous() is x)(x) is True


def _bad_view(x):
    return x.t().view(-1)  # the user's line named by the error


def test_illegal_view_raises_at_trace_time_like_eager_naming_the_users_line():
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="view size is not compatible") as eager:
        _bad_view(x)
    with pytest.raises(RuntimeError, match="view size is not compatible") as traced:
        tt.compile(_bad_view)(x)
    assert any(e.name == "_bad_view" for e in traced.traceback)
    assert "thunder_train computation" not in str(traced.value) and eager.value is not None


def test_as_strided_with_the_tensors_own_strides():
    def f(x):
        y = x.t()
        return torch.as_strided(y, (2, 2), y.stride()) + 0, y.as_strided((3,), (y.stride(0) + y.stride(1),))

    x = torch.randn(4, 5)
    for a, b in zip(tt.compile(f)(x), f(x)):
        torch.testing.assert_close(a, b)


def test_channels_last_conv():
    conv = nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 9, 9).to(memory_format=torch.channels_last)

    def f(conv, x):
        y = conv(x)
        return y, y.is_contiguous(memory_format=torch.channels_last), y.is_contiguous(), y.contiguous().view(-1)[:3]

    out, ref = tt.compile(f)(conv, x), f(conv, x)
    assert out[1:3] == ref[1:3] == (True, False)
    assert out[0].stride() == ref[0].stride()
    torch.testing.assert_close(out[0], ref[0])
    torch.testing.assert_close(out[3], ref[3])


@pytest.mark.parametrize("thin", [False, True])
def test_an_input_with_another_layout_gets_its_own_program(thin):
    def f(x):
        return x.view(-1) if x.is_contiguous() else x.reshape(-1) * 10

    cf = tt.compile(f, thin=thin)
    a = torch.randn(4, 3)
    for _ in range(3):
        torch.testing.assert_close(cf(a), f(a))
    b = torch.randn(3, 4).t()  # same shape, transposed layout
    # Thin mode: the per-call check refuses the other layout, and the full path traces its program (issue 26).
    torch.testing.assert_close(cf(b), f(b))
    torch.testing.assert_close(cf(a), f(a))
    assert any("stride" in r for r in tt.compile_stats(cf).retrace_reasons)
    assert tt.compile_stats(cf).thin_fallbacks == (1 if thin else 0)


# ---------------------------------------------------------------------------
# Gradient and optimizer-state layouts
# ---------------------------------------------------------------------------
def _model(kind):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 6), nn.Tanh(), nn.Linear(6, 5))
    if kind == "transposed":
        m[2].weight = nn.Parameter(torch.randn(64, 6).t() * 0.1)
    elif kind == "strided_slice":
        m[2].weight = nn.Parameter(torch.randn(6, 128)[:, ::2] * 0.1)
    elif kind == "channels_last":
        m[0].weight = nn.Parameter(m[0].weight.detach().to(memory_format=torch.channels_last))
    return m


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, eps=1e-6),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-2),
}


def _step(model, opt, x):
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    return loss


def _assert_same_tensor(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=what)
    assert a.stride() == b.stride(), f"{what}: strides {a.stride()} != eager's {b.stride()}"


def _compare(model, ref, opt, ref_opt):
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        _assert_same_tensor(p, q, n)
        _assert_same_tensor(p.grad, q.grad, f"{n}.grad")
        st, ref_st = opt.state[p], ref_opt.state[q]
        assert st.keys() == ref_st.keys()
        for k in st:
            if isinstance(st[k], torch.Tensor) and st[k].ndim:
                _assert_same_tensor(st[k], ref_st[k], f"state[{n}][{k}]")


@pytest.mark.parametrize("kernels", ["fused", "traced"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["transposed", "strided_slice", "channels_last"])
@pytest.mark.parametrize("thin", [False, True])
def test_non_row_major_parameters_train_like_eager(kind, opt_name, kernels, thin):
    model = _model(kind)
    ref = copy.deepcopy(model)
    opt, ref_opt = OPTIMIZERS[opt_name](model.parameters()), OPTIMIZERS[opt_name](ref.parameters())
    step = tt.compile(_step, thin=thin, optimizer_kernels=kernels)
    torch.manual_seed(1)
    for _ in range(4):
        x = torch.randn(2, 3, 6, 6)
        torch.testing.assert_close(step(model, opt, x), _step(ref, ref_opt, x), rtol=1e-5, atol=1e-6)
    _compare(model, ref, opt, ref_opt)
    if thin:
        assert tt.compile_stats(step).thin_calls >= 1


@pytest.mark.parametrize("kind", ["transposed", "channels_last"])
def test_grad_strides_after_a_compiled_backward_match_eager(kind):
    def fb(model, x):
        model(x).sum().backward()

    model = _model(kind)
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    tt.compile(fb)(model, x)
    fb(ref, x)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        _assert_same_tensor(p.grad, q.grad, f"{n}.grad")
    # tt.compile(module): the gradients reach .grad through eager's AccumulateGrad.
    model2 = _model(kind)
    tt.compile(model2)(x).sum().backward()
    for (n, p), q in zip(model2.named_parameters(), ref.parameters()):
        _assert_same_tensor(p.grad, q.grad, f"{n}.grad (compiled module)")


@pytest.mark.parametrize("change", ["data", "load_state_dict_assign"])
def test_thin_mode_sees_a_bound_parameter_change_layout(change):
    model = _model("plain")
    ref = copy.deepcopy(model)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    step = tt.compile(_step, thin=True)
    torch.manual_seed(1)
    xs = [torch.randn(2, 3, 6, 6) for _ in range(6)]
    for x in xs[:3]:
        step(model, opt, x)
        _step(ref, ref_opt, x)
    assert step.is_thin_bound
    for m in (model, ref):
        if change == "data":
            w = m[2].weight
            w.data = w.data.t().contiguous().t()  # same values, transposed layout
        else:
            sd = {k: (v.t().contiguous().t() if v.ndim == 2 else v) for k, v in m.state_dict().items()}
            m.load_state_dict(sd, assign=True)
    if change == "load_state_dict_assign":  # new parameter objects: a new optimizer, as eager needs too
        opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for x in xs[3:]:
        torch.testing.assert_close(step(model, opt, x), _step(ref, ref_opt, x), rtol=1e-5, atol=1e-6)
    _compare(model, ref, opt, ref_opt)


def test_layouts_found_once_are_reused_only_for_inputs_laid_out_alike():
    """The layout of a call is cached by its inputs' layouts: the same op on a transposed and on a row-major
    input (in one trace, and across traces) gets each its own eager layout."""
    from thunder_train.compiler.executors import layout_rules

    def g(x, y):
        outs = (x.transpose(0, 2) * 2, y * 2, x.transpose(0, 2).softmax(-1), y.softmax(-1), x.transpose(0, 2) * 2)
        return outs, tuple(_meta(o) for o in outs)

    x, y = torch.randn(4, 3, 4), torch.randn(4, 3, 4)
    before = len(layout_rules._layouts)
    for _ in range(2):  # the second trace finds every layout in the cache
        out, info = tt.compile(g)(x, y)
        ref, ref_info = g(x, y)
        assert info == ref_info and [o.stride() for o in out] == [r.stride() for r in ref]
        torch.testing.assert_close(out, ref)
    assert len(layout_rules._layouts) > before
    # A key names every input's layout and every other argument: not a tensor object it would keep alive.
    assert layout_rules._key(torch.add, (torch.ones(2), 1), {}) is None


def _slice_gradients(x):  # the backward of slices pads their gradients (prims.pad)
    x = x.detach().requires_grad_()
    (x.transpose(1, 2)[:, 1:3] * 2).sum().backward()
    return x.grad


LAYOUT_FUNCS_ON_META = {**LAYOUT_FUNCS, "slice_gradients": _slice_gradients}


@pytest.mark.parametrize("name", ["cat_transposed", "cat_channels_last", "slice_gradients", "embedding_transposed_weight",
                                  "bmm_transposed", "baddbmm_expanded", "addmm_transposed", "mm_sliced",
                                  "matmul_3d_by_transposed_2d", "matmul_broadcast_batch", "clone_expanded",
                                  "relu_transposed", "mean_keepdim_permuted", "min_dim_permuted",
                                  "min_elementwise_transposed", "masked_fill_transposed", "float_of_transposed_double",
                                  "to_dtype_transposed", "contiguous_channels_last", "to_channels_last_dtype",
                                  "narrow_contiguous"])
def test_ops_whose_layout_is_found_on_meta_tensors_give_the_fake_runs_layout(name):
    """An op tagged "layout_on_meta" gets its layout from meta tensors (no fake run of the device): on the CPU,
    every line of these functions gets the same strides either way."""
    from thunder_train.compiler import symbols
    from thunder_train.compiler.executors import layout_rules

    tagged, seen = [], []
    real_set_layout = layout_rules.set_layout

    def both_ways(bsym):
        real_set_layout(bsym)
        if "layout_on_meta" not in bsym.sym.tags:
            return
        tagged.append(bsym.sym.id)
        c = layout_rules._callable(bsym)
        with torch._C.DisableTorchFunction(), torch.no_grad(), layout_rules._mode():
            args, kwargs = layout_rules.tree_map(layout_rules._to_fake, (tuple(c[1]), dict(c[2])))
            fake = c[0](*args, **kwargs)
        meta = layout_rules._on_meta(*c)
        with torch._C.DisableTorchFunction():
            seen.append(([(m.shape, m.stride()) for m in layout_rules.tree_flatten(meta)[0]],
                         [(f.shape, f.stride()) for f in layout_rules.tree_flatten(fake)[0]]))

    symbols.layout_hook = both_ways
    try:
        tt.compile(LAYOUT_FUNCS_ON_META[name])(torch.randn(3, 5, 4))
    finally:
        symbols.layout_hook = real_set_layout
    assert tagged, "no line of the function carries the tag"
    for meta, fake in seen:
        assert meta == fake


@pytest.mark.parametrize("op", ["softplus", "elu", "selu", "logit", "mish"])
def test_backward_kernel_gradient_layout_of_a_channels_last_input_is_eagers(op):
    """softplus_backward, elu_backward and logit_backward lay their result out after the incoming gradient (the
    kernel's TensorIterator), where their meta kernels follow the input: a channels_last input's gradient of a
    row-major incoming gradient is row-major in the kernel, and eager's .grad is the input's layout
    (AccumulateGrad clones it so); the compiled .grad was row-major when the trace took the meta layout."""
    f = {"softplus": torch.nn.functional.softplus, "elu": torch.nn.functional.elu, "selu": torch.nn.functional.selu,
         "logit": lambda x: torch.logit(x * 0.1 + 0.5), "mish": torch.nn.functional.mish}[op]

    def step(x):
        y = f(x)
        (y * 0.5).sum().backward()
        return y

    x0 = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    xe, xc = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    ye, yc = step(xe), tt.compile(step, fusion=None)(xc)
    assert _meta(yc) == _meta(ye) and torch.equal(yc, ye)
    assert _meta(xc.grad) == _meta(xe.grad) and torch.equal(xc.grad, xe.grad)
