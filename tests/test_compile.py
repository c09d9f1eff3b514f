"""compile(fn) end to end: values against eager, modules, containers, traces, guards, bad input."""
from __future__ import annotations

import collections.abc
import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.codegen import standard_namespace
from thunder_train.compiler.opaque import UnsupportedOpError
from thunder_train.compiler.torchlang.tensor_methods import DataDependentError
from thunder_train.compiler.errors import GuardFailure


def readme_fn(x, w):
    y = F.gelu(x @ w)
    return y.reshape(y.size(0), -1).softmax(-1)


@pytest.mark.parametrize("decompose", [False, True])
def test_readme_example_matches_eager(decompose):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    cf = tt.compile(readme_fn, decompose=decompose)
    torch.testing.assert_close(cf(x, w), readme_fn(x, w))
    traces = tt.last_traces(cf)
    assert traces[0].python_source().startswith("# Constructed by acquisition")
    assert "ltorch.gelu" in str(traces[0]) and "prims.erf" in str(traces[0])
    assert "def computation(x, w):" in str(traces[-1])


@pytest.mark.parametrize("which", [0, -1])
def test_printed_traces_run_as_python(which):
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    cf = tt.compile(readme_fn)
    cf(x, w)
    src = str(tt.last_traces(cf)[which])
    ns = standard_namespace()
    exec(compile(src, "<printed trace>", "exec"), ns)
    torch.testing.assert_close(ns["computation"](x, w), readme_fn(x, w))


def test_printed_decomposed_trace_runs_as_python():
    x, w = torch.randn(8, 16), torch.randn(16, 4)
    cf = tt.compile(readme_fn, decompose=True)
    cf(x, w)
    ns = standard_namespace()
    exec(compile(str(tt.last_traces(cf)[-1]), "<printed trace>", "exec"), ns)
    torch.testing.assert_close(ns["computation"](x, w), readme_fn(x, w))


def test_traces_have_type_comments_and_headers():
    cf = tt.compile(readme_fn)
    cf(torch.randn(8, 16), torch.randn(16, 4))
    for trc in tt.last_traces(cf):
        src = str(trc)
        assert src.startswith("# "), src
        assert '# x: "cpu f32[8, 16]"' in src
    extract, guard_key = (str(t) for t in tt.last_prologue_traces(cf)[:2])
    assert "x = args[0]" in extract and "w = args[1]" in extract
    assert "x.shape,  # args[0]: shape" in guard_key


def test_tracebacks_point_into_generated_source():
    def f(x):
        return x.reshape(3, 5)  # valid while tracing with 15 elements

    cf = tt.compile(f)
    entry_fn = None
    cf(torch.randn(15))
    entry_fn = cf._last.computation
    import traceback

    with pytest.raises(RuntimeError) as info:
        entry_fn(torch.randn(16))
    text = "".join(traceback.format_exception(info.value))
    assert "<thunder_train computation" in text and ".reshape(x, 3, 5)" in text


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 16)
        self.ln = nn.LayerNorm(16)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x):
        assert isinstance(x, torch.Tensor)
        return self.ln(self.fc2(torch.relu(self.fc1(x))) * self.scale + x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_module_with_submodules_and_buffers():
    m = Net()
    cm = tt.compile(m)
    x = torch.randn(4, 16)
    torch.testing.assert_close(cm(x), m(x))
    # The module's own parameters and state_dict keys: no wrapper prefix.
    assert list(cm.state_dict().keys()) == list(m.state_dict().keys())
    assert [id(p) for p in cm.parameters()] == [id(p) for p in m.parameters()]
    # Module state is real tensors again after tracing.
    assert all(type(p) is nn.Parameter for p in m.parameters())
    assert type(m.blocks[0].scale) is torch.Tensor
    # A buffer updated outside is read at the next call (no stale constant).
    m.blocks[0].scale.fill_(3.0)
    torch.testing.assert_close(cm(x), m(x))
    assert tt.compile_stats(cm).cache_misses == 1


def test_a_compiled_container_module_indexes_iterates_and_counts_as_the_original():
    # Dunder methods are looked up on the class, so the attribute forwarding did not reach them: ``cm[0]`` raised
    # "'ThunderModule' object is not subscriptable" where the step indexed an nn.Sequential (``model[0](x)``).
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    cm = tt.compile(m)
    x = torch.randn(5, 4)
    assert cm[0] is m[0] and list(cm) == list(m) and len(cm) == 3 and m[1] in cm and bool(cm)
    assert isinstance(cm[1:], nn.Sequential)
    torch.testing.assert_close(cm[2](cm[1](cm[0](x))), cm(x))
    cm[1] = nn.ReLU()  # the original's submodule replaced: the compiled module follows it (a retrace)
    assert m[1] is cm[1]
    torch.testing.assert_close(cm(x), m(x))
    del cm[2]
    assert len(m) == 2 and cm(x).shape == (5, 6)
    assert not tt.compile(nn.Sequential())  # an empty container is falsy, as in eager
    d = tt.compile(nn.ModuleDict({"a": nn.Linear(2, 2)}))
    assert "a" in d and list(d) == ["a"]
    assert isinstance(cm, tt.ThunderModule) and tt.compile_stats(cm).calls == 3
    lin = tt.compile(nn.Linear(2, 2))  # no container: not iterable, as the module is not
    with pytest.raises(TypeError, match="not subscriptable"):
        lin[0]
    assert bool(lin) and not isinstance(lin, collections.abc.Iterable)


def test_module_train_eval_switch_retraces():
    class D(nn.Module):
        def forward(self, x):
            return F.dropout(x, 0.5, self.training)

    m = D()
    cm = tt.compile(m)
    x = torch.ones(100)
    out = cm(x)
    assert ((out == 0) | (out == 2)).all() and (out == 0).any()
    m.eval()
    torch.testing.assert_close(cm(x), x)
    assert any("training" in r for r in tt.compile_stats(cm).retrace_reasons)


def test_module_state_restored_when_tracing_raises():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = torch.nn.functional.dropout(self.fc(x), 0.5, training=True)
            if y.sum() > 0:  # a decision on a random value: the prologue cannot recompute it
                return y
            return -y

    m = Bad()
    with pytest.raises(DataDependentError, match="control flow"):
        tt.compile(m)(torch.randn(2, 4))
    assert type(m.fc.weight) is nn.Parameter
    m(torch.randn(2, 4))  # still usable eagerly


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    scale: float = 2.0


def containers_fn(d, lst, b):
    return d["a"] * lst[0] + b.x.sum() * b.scale - b.y * lst[1]


def test_dicts_lists_dataclasses():
    args = ({"a": torch.randn(3)}, [torch.randn(3), 2], Batch(torch.randn(3), torch.randn(3)))
    cf = tt.compile(containers_fn)
    torch.testing.assert_close(cf(*args), containers_fn(*args))
    prologue = str(tt.last_prologue_traces(cf)[-1])
    assert "args[0]['a']" in prologue and "args[2].x" in prologue
    # A changed Python scalar inside a container retraces; the result follows it.
    args2 = (args[0], [args[1][0], 5], Batch(args[2].x, args[2].y, 0.5))
    torch.testing.assert_close(cf(*args2), containers_fn(*args2))
    assert tt.compile_stats(cf).cache_misses == 2


def test_new_shape_and_dtype_make_new_entries_with_reasons():
    cf = tt.compile(lambda x: x * 2 + 1)
    for shape, dtype in [((4,), torch.float32), ((5,), torch.float32), ((4,), torch.float64), ((4,), torch.float32)]:
        x = torch.randn(shape, dtype=dtype)
        out = cf(x)
        torch.testing.assert_close(out, x * 2 + 1)
        assert out.dtype == dtype
    stats = tt.compile_stats(cf)
    assert stats.cache_misses == 3 and stats.cache_hits == 1 and stats.entries == 3
    assert len(stats.retrace_reasons) == 2
    assert "(4,)" in stats.retrace_reasons[0] and "(5,)" in stats.retrace_reasons[0]


def test_tensor_where_scalar_was_traced_retraces_correctly():
    def f(x, s):
        return x * s

    cf = tt.compile(f)
    x = torch.randn(3)
    torch.testing.assert_close(cf(x, 2.0), x * 2.0)
    s = torch.randn(3)
    torch.testing.assert_close(cf(x, s), x * s)
    torch.testing.assert_close(cf(x, 3), x * 3)
    assert tt.compile_stats(cf).cache_misses == 3


def test_retrace_reasons_name_input_and_values():
    cf = tt.compile(lambda x, w: x @ w)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    cf(x, w)
    cf(x, torch.randn(3, 5))
    cf(x, torch.randn(3, 4, requires_grad=True))
    cf(torch.empty(2, 3, device="meta"), torch.empty(3, 4, device="meta"))
    reasons = tt.compile_stats(cf).retrace_reasons
    assert len(reasons) == 3
    assert "args[1]" in reasons[0] and "shape" in reasons[0] and "(3, 4)" in reasons[0] and "(3, 5)" in reasons[0]
    assert "requires_grad" in reasons[1]
    assert "device" in reasons[2] and "meta" in reasons[2] and "args[0]" in reasons[2]


def test_thin_mode_names_a_new_batch_shape_in_the_retrace_reason():
    cf = tt.compile(lambda x, w: x @ w, thin=True)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    for _ in range(3):
        torch.testing.assert_close(cf(x, w), x @ w)
    w2 = torch.randn(3, 5)
    torch.testing.assert_close(cf(x, w2), x @ w2)  # issue 26: the full path, not a ThinModeError
    msg = tt.compile_stats(cf).retrace_reasons[-1]
    assert "args[1]" in msg and "shape" in msg and "(3, 4)" in msg and "(3, 5)" in msg


def test_grad_mode_is_part_of_the_guard():
    cf = tt.compile(lambda x: x * 2)
    x = torch.randn(3, requires_grad=True)
    assert cf(x).requires_grad
    with torch.no_grad():
        assert not cf(x).requires_grad
    assert any("grad_enabled" in r for r in tt.compile_stats(cf).retrace_reasons)


def test_wrong_number_of_arguments_is_a_clear_error():
    def f(x, y):
        return x + y

    cf = tt.compile(f)
    cf(torch.randn(2), torch.randn(2))
    with pytest.raises(TypeError, match="missing a required argument"):
        cf(torch.randn(2))
    with pytest.raises(TypeError, match="too many positional arguments"):
        cf(torch.randn(2), torch.randn(2), torch.randn(2))


def test_device_change_makes_a_new_entry():
    cf = tt.compile(lambda x: x + 1)
    cf(torch.randn(2))
    out = cf(torch.empty(2, device="meta"))
    assert out.device.type == "meta" and out.shape == (2,)
    assert "meta" in tt.compile_stats(cf).retrace_reasons[-1]


def test_data_dependent_control_flow_is_specialised_or_a_clear_error():
    # A decision on a value computed with parameters is checked by the program (test_decision_checks.py);
    # one on a random value cannot be specialised on, and is an error naming the line.
    lin = nn.Linear(3, 3)

    def f(x):
        if lin(x).sum() > 0:
            return x
        return -x

    cf = tt.compile(f)
    for _ in range(4):
        x = torch.randn(3)
        torch.testing.assert_close(cf(x), f(x))

    def g(x):
        if torch.nn.functional.dropout(lin(x), 0.5).sum() > 0:
            return x
        return -x

    with pytest.raises(DataDependentError, match=r"test_compile.py:\d+ \(if torch.nn.functional.dropout\(lin\(x\), 0.5\).sum\(\) > 0:\).*torch.where"):
        tt.compile(g)(torch.randn(3))
    # .item() is a runtime number: arithmetic with it is recorded, branching on it is a decision like bool(tensor).
    x = torch.randn(3)
    torch.testing.assert_close(tt.compile(lambda x: x * (x.max().item() * 2 + 1))(x), x * (x.max().item() * 2 + 1))

    def h(x):
        return x if lin(x).max().item() > 0 else -x

    ch = tt.compile(h)
    for x in (torch.randn(3), torch.randn(3) - 5, torch.randn(3) + 5):
        torch.testing.assert_close(ch(x), h(x))


def test_bool_mask_indexing_follows_eager():
    # a data-dependent size the program reads when the mask is applied (tests/test_data_dependent.py)
    x = torch.randn(4)
    torch.testing.assert_close(tt.compile(lambda x: x[x > 0])(x), x[x > 0])


def test_unknown_ops_run_opaquely_and_strict_rejects_them():
    def f(x):
        return torch.special.erfcx(x) + 1

    cf = tt.compile(f)
    x = torch.randn(5)
    torch.testing.assert_close(cf(x), f(x))
    assert tt.compile_stats(cf).opaque_ops == ["torch._C._special.special_erfcx"]
    with pytest.raises(UnsupportedOpError, match="erfcx.*strict=True"):
        tt.compile(f, strict=True)(x)


def test_returning_an_input_returns_the_same_object():
    cf = tt.compile(lambda x, y: (x, y + 1))
    x, y = torch.randn(2), torch.randn(2)
    a, b = cf(x, y)
    assert a is x and b.data_ptr() != y.data_ptr()


def test_closure_constants_and_python_outputs():
    table = torch.randn(4)

    def f(x):
        return {"out": x + table, "n": x.shape[0], "name": "ok"}

    cf = tt.compile(f)
    x = torch.randn(4)
    res = cf(x)
    torch.testing.assert_close(res["out"], x + table)
    assert res["n"] == 4 and res["name"] == "ok"


class HFStyleAttention(nn.Module):
    """Patterns common in HuggingFace-style model code."""

    def __init__(self, hidden=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        if not isinstance(hidden_states, torch.Tensor) or not torch.is_tensor(hidden_states):
            raise TypeError("expected a tensor")
        bsz, q_len, _ = hidden_states.size()
        head_dim = hidden_states.shape[-1] // self.heads

        def split(t):
            return t.view(bsz, q_len, self.heads, head_dim).transpose(1, 2)

        q, k, v = split(self.q(hidden_states)), split(self.k(hidden_states)), split(self.v(hidden_states))
        scores = torch.matmul(q, k.transpose(2, 3)) / (head_dim**0.5)
        if attention_mask is not None:
            mask = (1.0 - attention_mask[:, None, None, :].to(scores.dtype)) * torch.finfo(scores.dtype).min
            scores = scores + mask
        probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).contiguous().reshape(bsz, q_len, -1)
        return (out, probs) if output_attentions else (out, None)


def test_hf_style_model_code():
    m = HFStyleAttention()
    x = torch.randn(2, 5, 16)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    cm = tt.compile(m)
    out, probs = cm(x, mask, output_attentions=True)
    ref_out, ref_probs = m(x, mask, output_attentions=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(probs, ref_probs)
    out, none = cm(x)
    torch.testing.assert_close(out, m(x)[0])
    assert none is None
    assert not tt.compile_stats(cm).opaque_ops


def test_inplace_ops_execute_in_order():
    def f(x, y):
        z = x * 2
        z.add_(y)
        z[0] = 7.0
        return z * 3

    x, y = torch.randn(4), torch.randn(4)
    for decompose in (False, True):
        torch.testing.assert_close(tt.compile(f, decompose=decompose)(x, y), f(x, y))


def test_compile_rejects_non_callables():
    with pytest.raises(TypeError, match="function or an nn.Module"):
        tt.compile(3)


def test_traces_before_first_call_is_a_clear_error():
    with pytest.raises(RuntimeError, match="not been called"):
        tt.last_traces(tt.compile(lambda x: x))


def test_opaque_op_returning_a_named_tuple():
    x = torch.randn(6)
    out = tt.compile(lambda t: torch.cummax(t, 0))(x)
    ref = torch.cummax(x, 0)
    assert type(out) is type(ref) and out.values.device == x.device
    torch.testing.assert_close(out.values, ref.values)
    torch.testing.assert_close(out.indices, ref.indices)


@pytest.mark.parametrize("names", [("x", "_b"), ("ttex", "y"), ("_pool", "y"), ("x", "_c0"), ("inf", "y"),
                                   ("numbers", "y"), ("x", "_op_foo")])
def test_arguments_named_like_generated_names_are_renamed(names):
    # A parameter called ``_b`` shadowed the kept buffers inside the program (add(): argument 'other' must be Tensor,
    # not list), one called ``ttex`` the kernels' namespace.
    ns = {"torch": torch}
    a, b = names
    for body in (f"({a} * 2 + {b}).sum()", f"(({a} * 2 + {b}) * 3.0).sum()"):  # with kept buffers; with a number
        exec(f"def f({a}, {b}):\n    return {body}", ns)
        x, y = torch.randn(3), torch.randn(3)
        cf = tt.compile(ns["f"])
        for _ in range(2):
            assert torch.equal(cf(x, y), ns["f"](x, y))


@pytest.mark.parametrize("thin", [False, True])
def test_a_compiled_module_deep_copies_and_pickles_as_the_compiled_copy_of_its_module(thin):
    """copy.deepcopy (an EMA or teacher model, also of a model holding a compiled submodule) raised "copy.deepcopy
    of a tensor while tracing"; torch.save(model) raised a PicklingError. Both give tt.compile of the copied module."""
    import copy
    import io

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    compiled = tt.compile(model, thin=thin)
    x = torch.randn(5, 3)
    for _ in range(2):
        compiled(x)
    twin = copy.deepcopy(compiled)
    assert type(twin) is type(compiled) and twin[0] is not model[0]
    assert torch.equal(twin(x), model(x))
    with torch.no_grad():
        twin[0].weight.add_(1.0)
    assert torch.equal(compiled(x), model(x)) and not torch.equal(twin(x), model(x))  # independent
    buf = io.BytesIO()
    torch.save(compiled, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert type(loaded) is type(compiled) and torch.equal(loaded(x), model(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = tt.compile(nn.Linear(3, 3), thin=thin)
            self.head = nn.Linear(3, 1)

        def forward(self, x):
            return self.head(self.encoder(x))

    net = Net()
    net(x)
    ema = copy.deepcopy(net)
    assert torch.equal(ema(x), net(x)) and ema.encoder.weight is not net.encoder.weight


@pytest.mark.parametrize("thin", [False, True])
def test_changes_made_through_a_compiled_module_reach_the_module_it_runs(thin):
    """half()/double()/apply(init)/register_buffer/``cm.weight = p`` on a compiled module that holds parameters itself
    acted on the wrapper's empty registries: the original, which the compiled forward runs, kept float32 weights
    (silently), apply's function never saw it, and ``cm.weight = nn.Parameter(...)`` raised a KeyError."""
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(3, 3))
            self.inner = nn.Linear(3, 3)

        def forward(self, x):
            out = self.inner(x @ self.weight)
            return out * self.extra if hasattr(self, "extra") else out

    torch.manual_seed(0)
    eager = Scaled()
    model = Scaled()
    model.load_state_dict(eager.state_dict())
    compiled = tt.compile(model, thin=thin)
    x = torch.randn(2, 3)
    for _ in range(2):
        assert torch.equal(compiled(x), eager(x))
    for m in (eager, compiled):
        assert m.double() is m
    assert model.weight.dtype == torch.float64 and model.inner.weight.dtype == torch.float64
    assert torch.equal(compiled(x.double()), eager(x.double()))
    for m in (eager, compiled):
        m.float()

    def init(m):
        if isinstance(m, Scaled):
            nn.init.constant_(m.weight, 0.5)

    for m in (eager, compiled):
        m.apply(init)
        m.register_buffer("extra", torch.full((3,), 2.0))
    assert torch.equal(model.weight, eager.weight) and "extra" in dict(model.named_buffers())
    assert torch.equal(compiled(x), eager(x))
    for m in (eager, compiled):
        m.weight = nn.Parameter(torch.ones(3, 3))
        m.training = False
    assert model.weight is compiled.weight and not model.training
    assert torch.equal(compiled(x), eager(x))
    for m in (eager, compiled):
        del m.extra
    assert not hasattr(model, "extra") and torch.equal(compiled(x), eager(x))
    assert [n for n, _ in compiled.named_children()] == ["inner"]
