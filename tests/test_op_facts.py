"""Every fact about an op hangs off its Symbol and is declared where the op is defined (docs/architecture.md)."""
from __future__ import annotations

import contextlib

import inspect
import pathlib
import unittest.mock

import pytest
import torch
import torch.nn.functional as F

import thunder_train as tt
from thunder_train.compiler.torchlang import activations as tact, registry


def _file(obj) -> str:
    return pathlib.Path(inspect.getsourcefile(inspect.unwrap(obj))).as_posix().split("thunder_train/")[-1]


def test_gelus_story_is_in_two_files():
    gelu = registry.lookup(F.gelu)
    assert gelu is tact.gelu
    facts = [gelu.fn, gelu.grad_rule[0], gelu.torch_direct_vjp]
    assert {_file(f) for f in facts} == {"compiler/torchlang/activations.py", "compiler/executors/torch_impls.py"}
    assert {"fusible", "fused_backward"} <= gelu.tags and gelu.torch_impl is F.gelu and gelu.autocast is None


def test_declared_facts_drive_the_passes():
    # fused_backward: one gelu_vjp line, run by the declared direct kernel; fusible: Inductor takes the call.
    x = torch.randn(8, 8, requires_grad=True)
    cf = tt.compile(lambda x: F.gelu(x * 2 + 1).sum())
    cf(x).backward()
    bw = str(tt.last_backward_traces(cf)[-1])
    assert "ttex.gelu_vjp" in bw
    torch.testing.assert_close(x.grad, torch.autograd.grad(F.gelu(x * 2 + 1).sum(), x)[0])
    cf = tt.compile(lambda x: F.gelu(x * 2 + 1) - x, fusion="inductor")
    with torch.no_grad():
        torch.testing.assert_close(cf(x), F.gelu(x * 2 + 1) - x)
    assert "gelu" in str(tt.last_traces(cf)[-1]).split("fused by Inductor", 1)[-1].splitlines()[0]


def test_lowered_lines_keep_their_symbol():
    cf = tt.compile(lambda x: torch.sin(x) + 1)
    cf(torch.randn(3))
    sources = [b.source for b in tt.last_traces(cf)[-1].bound_symbols if b.source is not None]
    assert registry.lookup(torch.sin) in sources
    assert all(s.module in ("ltorch", "prims") for s in sources)


# ---------------------------------------------------------------------------
# Prims: every fact declared with the prim, and none missing
# ---------------------------------------------------------------------------
from thunder_train.compiler import grad_rules, prims  # noqa: E402
from thunder_train.compiler.executors import reinplace, torch_executor, torch_impls  # noqa: E402
from thunder_train.compiler.symbols import Symbol  # noqa: E402

PRIMS = prims.all_prims()
# Prims without a gradient rule that are not "non_differentiable" either: reaching one on a gradient path
# raises NoGradientRuleError (a write-back, a runtime check, a collective of the traced backward, and
# convolution's backward, which has no second derivative yet).
NO_RULE_BY_DESIGN = {"copy_", "check_finite", "all_reduce_mean", "convolution_backward"}


def test_the_prims_are_split_by_family_and_exported():
    families = {_file(s.fn).rsplit("/", 1)[-1] for s in PRIMS.values()}
    assert families == {"elementwise.py", "reductions.py", "shapes.py", "linalg.py", "factories.py", "memory.py",
                        "generators.py", "value_shaped.py"}
    assert all(getattr(prims, n) is s and s.module == "prims" and s.is_prim for n, s in PRIMS.items())
    assert len(PRIMS) >= 100


def test_every_prim_has_a_gradient_rule_or_is_declared_non_differentiable():
    missing = sorted(n for n, s in PRIMS.items()
                     if s.grad_rule is None and "non_differentiable" not in s.tags and n not in NO_RULE_BY_DESIGN)
    assert not missing, f"prims with neither a gradient rule nor the 'non_differentiable' tag: {missing}"
    both = sorted(n for n, s in PRIMS.items() if s.grad_rule is not None and "non_differentiable" in s.tags)
    assert not both, f"prims with a gradient rule that are also tagged non-differentiable: {both}"
    assert all(PRIMS[n].grad_rule is None for n in NO_RULE_BY_DESIGN)
    # The old hand-kept lists, now tags declared with the prims.
    for n in ("stop_gradient", "full", "empty", "iota", "uniform", "randn", "bernoulli", "floor", "ceil", "round",
              "trunc", "sign", "argmax", "argmin", "shape", "floor_divide", "eq", "lt", "isnan", "item"):
        assert "non_differentiable" in PRIMS[n].tags, n
    for n in ("broadcast_in_dim", "reshape", "transpose", "squeeze", "slice", "convert_element_type", "full", "iota"):
        assert "cheap_to_recompute" in PRIMS[n].tags, n


def test_each_prims_gradient_rule_is_declared_next_to_it():
    apart = sorted(n for n, s in PRIMS.items() if s.grad_rule is not None and _file(s.grad_rule[0]) != _file(s.fn))
    assert not apart, f"gradient rules declared in another file than their prim: {apart}"


def test_every_prim_has_a_torch_implementation_keyed_by_its_symbol():
    rules = torch_executor._prim_rules
    assert all(isinstance(k, Symbol) for k in rules), "the torch executor's prim table must be keyed by Symbol objects"
    missing = sorted(n for n, s in PRIMS.items() if s not in rules)
    assert not missing, f"prims the torch executor cannot run: {missing}"


def test_prims_run_outside_tracing_through_their_torch_implementation():
    # Every printed trace is runnable: a prim called on real tensors runs its registered torch implementation.
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(prims.atan2(x, y), torch.atan2(x, y))
    torch.testing.assert_close(prims.maximum(x, 0.5), torch.clamp_min(x, 0.5))
    torch.testing.assert_close(prims.sub(2.0, x), 2.0 - x)
    torch.testing.assert_close(prims.lt(2.0, x), x > 2.0)
    assert prims.add(2, 3) == 5
    w = torch.randn(2, 3, 3, 3)
    g = torch.randn(1, 2, 2, 2)
    a = torch.randn(1, 3, 4, 4)
    b = torch.randn(2)
    gi, gw, gb = prims.convolution_backward(g, a, w, (1, 1), (0, 0), (1, 1), 1, (True, True, True))
    a.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    ea, ew, eb = torch.autograd.grad(F.conv2d(a, w, b), (a, w, b), g)
    assert torch.equal(gi, ea) and torch.equal(gw, ew) and torch.equal(gb, eb)  # eager's kernel, eager's bits
    # ``output_mask``: the gradients asked for, the others None
    none, gw, no_bias = prims.convolution_backward(g, a.detach(), w.detach(), (1, 1), (0, 0), (1, 1), 1, (False, True, False))
    assert none is None and no_bias is None
    torch.testing.assert_close(gw, ew)


def test_each_torch_language_gradient_rule_is_declared_next_to_its_op():
    syms = registry.all_symbols.values()
    ruled = [s for s in syms if s.grad_rule is not None]
    assert len(ruled) >= 30  # gelu, layer_norm, sdpa, cross_entropy, softmax, split, ...
    apart = sorted(s.name for s in ruled if _file(s.grad_rule[0]) != _file(s.fn))
    assert not apart, f"gradient rules declared in another file than their torch-language op: {apart}"


def test_no_module_is_over_800_lines():
    root = pathlib.Path(tt.__file__).parent
    long = [str(p.relative_to(root)) for p in root.rglob("*.py") if len(p.read_text().splitlines()) > 800]
    assert not long, f"modules over 800 lines: {long}"


# ---------------------------------------------------------------------------
# Tags the passes read are declared with the ops
# ---------------------------------------------------------------------------
def _all_symbols():
    return list(PRIMS.values()) + list(registry.all_symbols.values())


# Ops whose run-time values can make them raise, by what they do (a guard that a new indexing op or loss
# declares "fallible": re-inplacing must not write an input before it).
_RAISING_WORDS = ("index", "gather", "scatter", "take", "embedding", "one_hot", "cross_entropy", "nll_loss",
                  "getitem", "setitem", "check_finite", "index_put")


def test_ops_that_can_raise_on_values_are_declared_fallible():
    missing = sorted(s.id for s in _all_symbols() if any(w in s.name for w in _RAISING_WORDS) and "fallible" not in s.tags)
    assert not missing, f"ops that raise on bad indices or values, not tagged 'fallible': {missing}"


# One eager call per torch-language view op: (arguments after the input, the input's shape).
_VIEW_CALLS = {
    "view": (((6, 4),), (2, 3, 4)), "view_as": ((torch.empty(6, 4),), (2, 3, 4)), "reshape": (((6, 4),), (2, 3, 4)),
    "reshape_as": ((torch.empty(6, 4),), (2, 3, 4)), "flatten": ((), (2, 3, 4)), "unflatten": ((2, (2, 2)), (2, 3, 4)),
    "squeeze": ((), (2, 1, 4)), "unsqueeze": ((0,), (2, 3, 4)), "permute": (((2, 0, 1),), (2, 3, 4)),
    "transpose": ((0, 1), (2, 3, 4)), "t": ((), (3, 4)), "movedim": ((0, 2), (2, 3, 4)),
    "expand": (((2, 2, 3, 4),), (2, 3, 4)), "expand_as": ((torch.empty(2, 2, 3, 4),), (2, 3, 4)),
    "broadcast_to": (((2, 2, 3, 4),), (2, 3, 4)), "split": ((1,), (2, 3, 4)), "chunk": ((2,), (2, 3, 4)),
    "tensor_split": ((2,), (2, 3, 4)), "unbind": ((), (2, 3, 4)), "narrow": ((0, 0, 1), (2, 3, 4)),
    "select": ((0, 1), (2, 3, 4)), "getitem": (((0, slice(1, 3)),), (2, 3, 4)), "detach": ((), (2, 3, 4)),
}


def test_view_ops_are_tagged_and_are_views_in_eager():
    # The tracer keeps a "view" op's result aliased to its input (acquisition/inplace.py is_view); a wrong tag
    # either way makes an in-place update through the result reach the input, or not, unlike eager.
    tagged = {s.name: s for s in registry.all_symbols.values() if "view" in s.tags}
    assert set(tagged) == set(_VIEW_CALLS), f"view tags differ from the checked list: {set(tagged) ^ set(_VIEW_CALLS)}"
    for name, s in tagged.items():
        args, shape = _VIEW_CALLS[name]
        x = torch.randn(shape)
        out = s.torch_impl(x, *args)
        for o in out if isinstance(out, (tuple, list)) else (out,):
            assert o.untyped_storage().data_ptr() == x.untyped_storage().data_ptr(), f"{name} is not a view in eager"
    assert "view" not in registry.lookup(torch.Tensor.contiguous).tags and "view" not in registry.lookup(torch.clone).tags


def test_reinplacing_reads_the_declared_inplace_forms():
    add = registry.lookup(torch.add)
    assert add.inplace_variant is registry.lookup(torch.Tensor.add_) and add.inplace_variant.torch_impl is torch.Tensor.add_
    # A line lowered from the op, calling its torch function, runs in place; another callable does not.
    from thunder_train.compiler.symbols import BoundSymbol

    line = BoundSymbol(torch_executor.impl_symbol(torch.add), (), {}, None, source=add)
    assert reinplace._inplace_form(line) is torch.Tensor.add_
    assert reinplace._inplace_form(line.replace(sym=torch_executor.impl_symbol(torch.sub))) is None
    prim_line = BoundSymbol(torch_executor.impl_symbol(torch.true_divide), (), {}, None, source=prims.div)
    assert reinplace._inplace_form(prim_line) is torch.Tensor.div_
    assert reinplace._inplace_form(prim_line.replace(sym=torch_executor.impl_symbol(torch.div))) is None


def test_a_failing_index_keeps_the_update_out_of_place():
    # The index comes after the update: run in place, the update would be done when the index raises.
    # "fallible" keeps the write-back at the end, so a failed call leaves p as it was (transactional).
    def step(p, idx):
        p.mul_(2.0)
        return p[idx].sum()

    p = torch.randn(4)
    before = p.clone()
    cf = tt.compile(step)
    cf(p, torch.tensor([1]))
    torch.testing.assert_close(p, before * 2)
    with pytest.raises(Exception):
        cf(p, torch.tensor([7]))
    torch.testing.assert_close(p, before * 2)


# ---------------------------------------------------------------------------
# Tags are a closed set, checked when a symbol is made
# ---------------------------------------------------------------------------
from thunder_train.compiler import symbols  # noqa: E402


def _every_symbol():
    """Every symbol the package made at import (prims, the torch language, executors' own), by object."""
    import gc
    import warnings

    with warnings.catch_warnings():  # isinstance on some of torch's lazy module attributes warns
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, Symbol)]


def test_every_tag_is_known_and_says_what_it_means():
    assert all(isinstance(meaning, str) and len(meaning) > 20 for meaning in symbols.TAGS.values())
    unknown = {s.id: sorted(s.tags - symbols.KNOWN_TAGS) for s in _every_symbol() if s.tags - symbols.KNOWN_TAGS}
    assert not unknown, unknown
    used = set().union(*(s.tags for s in _every_symbol()))
    assert used - {"opaque"} <= symbols.KNOWN_TAGS and len(used) >= 12  # ("opaque": made when an op first runs opaquely)


def test_an_unknown_tag_raises_when_the_symbol_is_made_or_tagged():
    with pytest.raises(ValueError, match=r"ltorch.my_op: unknown tag\(s\) \['fusable'\].*compiler/symbols.py TAGS"):
        Symbol("my_op", lambda x: x, module="ltorch", tags=("fusable",))
    with pytest.raises(TypeError, match="not the string 'fusible'"):
        Symbol("my_op", lambda x: x, module="ltorch", tags="fusible")
    s = Symbol("my_op", lambda x: x, module="ltorch", tags=("fusible",))
    with pytest.raises(ValueError, match="unknown tag"):
        prims.core.add_tags(s, "elementwize")
    assert s.tags == {"fusible"}
    from thunder_train.compiler.torchlang.registry import torchsymbol

    with pytest.raises(ValueError, match="unknown tag"):
        torchsymbol(name="tt_test_badly_tagged", tags=("viewish",))(lambda x: x)


def test_ops_run_opaquely_are_tagged_so():
    from thunder_train.compiler import opaque
    from thunder_train.compiler.transforms import opaque_grad

    assert opaque_grad.OPAQUE_VJP.runs_opaquely and opaque.OpaqueSymbol(torch.special.entr).runs_opaquely
    assert not any(s.runs_opaquely for s in _all_symbols())
    # re-inplacing writes no input before a line run opaquely (its values may make it raise)
    from thunder_train.compiler.symbols import BoundSymbol

    line = BoundSymbol(torch_executor.impl_symbol(torch.special.entr), (), {}, None, source=opaque.OpaqueSymbol(torch.special.entr))
    assert reinplace._fallible(line) and not reinplace._fallible(line.replace(source=registry.lookup(torch.exp)))


# ---------------------------------------------------------------------------
# Torch-executor facts keyed by the op: out forms and fresh results (kept buffers, executors/buffers.py)
# ---------------------------------------------------------------------------
from thunder_train.compiler.executors import buffers, layout_rules, nvfuser_fusion  # noqa: E402,F401  (declares them)

_G = torch.Generator().manual_seed(0)
_X, _Y = torch.rand(4, 3, generator=_G) + 0.5, torch.rand(4, 3, generator=_G) + 0.5  # positive: log, sqrt, pow
_CANDIDATES = [(_X,), (_X, _Y), (_X, torch.rand(3, 5, generator=_G)), ([_X, _Y],), (_X, (1,)),
               (torch.rand(5, generator=_G), _X, torch.rand(3, 5, generator=_G)),  # (addmm: bias, mat1, mat2)
               (torch.tensor([[0, 2], [1, 1]]), _X)]  # (embedding: indices, weight)


def _meta(args):
    return [[a.to("meta") for a in x] if isinstance(x, list) else x.to("meta") if isinstance(x, torch.Tensor) else x
            for x in args]


def _sample_call(fn, form=None):
    """The first candidate arguments ``fn`` accepts (and its out form ``form``, on meta tensors), and its result."""
    for args in _CANDIDATES:
        try:
            expected = fn(*args)
            if form is not None:
                form(*_meta(args), out=torch.empty_like(expected, device="meta"))
            return args, expected
        except (TypeError, RuntimeError):
            continue
    raise AssertionError(f"no sample arguments for {fn}" + ("" if form is None else f" that its out form {form} takes"))


def _runs(op, fn) -> bool:
    """Whether a line of ``op`` can run ``fn``: a torch callable routed to it, its torch implementation, or the
    function the torch executor runs for the prim (or its mirror's, with swapped operands)."""
    if op.is_prim:
        return fn in {torch_executor._ELEMENTWISE_TORCH.get(p) for p in (op, op.mirrored)} or \
            fn in {torch.true_divide, torch.matmul, torch.cat, torch.sum, torch.amax, torch.amin, torch.where, torch.full, torch.empty,
                   torch.clone, torch.index_select, torch.gather, torch.scatter, torch.scatter_add} or \
            (op is prims.matmul and fn is torch.mm) or \
            ("opaque" in op.tags and op.torch_impl is fn)  # (executors/mm_calls.py; an op run opaquely)
    return registry.lookup(fn) is op or op.torch_impl is fn or getattr(fn, "kernel_of", None) is op


def test_every_out_form_is_accepted_by_its_op_and_computes_the_same():
    declared = [(op, fn, form) for op in _every_symbol() if op.torch_out_forms for fn, form in op.torch_out_forms.items()]
    assert len(declared) >= 60
    for op, fn, form in declared:
        assert _runs(op, fn), f"{op.id} declares an out form for {fn}, which its lines do not run"
        args, expected = _sample_call(fn, form)  # (the out form accepted on meta tensors: what kept buffers check)
        out = torch.full_like(expected, float("nan")) if expected.is_floating_point() else torch.full_like(expected, 7)
        got = form(*args, out=out)
        assert got.data_ptr() == out.data_ptr() and torch.equal(out, expected), f"{op.id}: {form} for {fn}"


_FRESH_SAMPLES = {
    "where": (_X > 1, _X, _Y), "embedding": (torch.tensor([[0, 2], [1, 1]]), _X), "layer_norm": (_X, (3,)),
    "scaled_dot_product_attention": (torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4, 3)),
    "cross_entropy": (_X, torch.tensor([0, 2, 1, 1])), "full": ((2, 3), 1.5), "zeros": ((2, 3),), "ones": ((2, 3),),
    "empty": ((2, 3),), "arange": (5,), "softmax": (_X, 1), "log_softmax": (_X, 1),
    "index_select": (_X, 0, torch.tensor([1, 0])), "full_like": (_X, 2.0), "rsub": (_X, 2.0), "__rsub__": (_X, 2.0),
    "matmul": (_X, _X.t()), "bmm": (_X[None], _X.t()[None]), "baddbmm": (_X[None], _X[None], _X.t()[None] @ _X[None]),
    "pad": (_X, (1, 1)), "mm": (_X, _X.t()), "linear": (_X, _Y, torch.rand(4)), "gather": (_X, 1, torch.tensor([[0], [2], [1], [1]])),
    "scatter": (_X, 1, torch.tensor([[0], [2], [1], [1]]), _Y[:, :1]),
    "scatter_add": (_X, 1, torch.tensor([[0], [2], [1], [1]]), _Y[:, :1]),
    "_grouped_mm": (torch.rand(4, 8), torch.rand(2, 8, 4), torch.tensor([1, 4], dtype=torch.int32)),
    "sdpa_math": (torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4, 3), torch.rand(1, 2, 4, 3), torch.rand(4, 4)),
}


def test_every_fresh_result_shares_no_memory_with_its_arguments():
    declared = [(op, fn) for op in _every_symbol() for fn in op.torch_fresh]
    assert len(declared) >= 30
    for op, fn in declared:
        assert _runs(op, fn), f"{op.id} declares {fn} fresh, which its lines do not run"
        args = (_X, _X > 1, _Y) if fn is torch.Tensor.where else _FRESH_SAMPLES.get(fn.__name__, (_X,))
        out = fn(*args)
        ins = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        assert outs and not any(o.untyped_storage().data_ptr() in ins for o in outs), f"{op.id}: {fn} returned an input's memory"


# ---------------------------------------------------------------------------
# Layout rules keyed by the op (executors/layout_rules.py): what each decides is eager's layout
# ---------------------------------------------------------------------------
from thunder_train.compiler.proxies import TensorProxy  # noqa: E402
from thunder_train.compiler.symbols import BoundSymbol  # noqa: E402
from thunder_train.compiler.torchlang import foreach as tforeach  # noqa: E402


def _proxy(t):
    return TensorProxy(shape=t.shape, dtype=t.dtype, device=t.device, strides=t.stride(), storage_offset=t.storage_offset())


def _batch_norm_inputs(x, g):
    """(input, incoming gradient) pairs of batch norm in several layouts: row-major, channels_last, a permuted 4-d
    input, a transposed 3-d one (BatchNorm1d after a transpose), each with a row-major and a transposed gradient."""
    cl = lambda t: t.to(memory_format=torch.channels_last)  # noqa: E731
    perm = lambda t: t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)  # noqa: E731
    col = lambda t: t.flatten(2).transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    pairs = []
    for lay in (lambda t: t, cl, perm, col):
        x2, g2 = lay(x), lay(g)
        pairs += [(x2, g2), (x2, g2.contiguous().transpose(-1, -2).contiguous().transpose(-1, -2))]
    return pairs


def _layout_samples(op):
    """Arguments on which ``op``'s layout rule decides, one of them laid out other than row-major where it may be."""
    col = torch.rand(5, 4).t()  # (4, 5), column-major
    lists = [torch.rand(3, 4) + 0.5, torch.rand(5) + 0.5]
    if op is prims.copy_:
        return [((torch.rand(4, 3), torch.rand(3, 4).t()), {})]
    if op is prims.unseen_write:  # the written values' layout
        return [((torch.rand(3, 4).t(), torch.rand(4, 3)), {}), ((torch.rand(4, 3), torch.rand(3, 4).t()), {})]
    if op is prims.grad_layout:
        return [((torch.rand(4, 3), torch.rand(3, 4).t()), {}), ((torch.rand(4, 3), torch.rand(4, 6)[:, :3]), {})]
    if op.name == "matmul":
        return [((col, torch.rand(5, 3)), {}), ((torch.rand(5), col.t()), {})]
    if op.name == "linear":
        return [((torch.rand(2, 6, 4), torch.rand(3, 4), torch.rand(3)), {})]
    if op.name.endswith("_like"):
        return [((torch.rand(3, 4),) + ((2.0,) if op.name == "full_like" else ()), {})]
    if op in (prims.all_gather, prims.reduce_scatter, prims.wait):  # on a one-rank gloo group (_one_rank_group)
        import torch.distributed as dist

        name = dist.group.WORLD.group_name
        return [((torch.rand(3, 4),) + ((1, name) if op is prims.all_gather else ("sum", 1, name) if op is prims.reduce_scatter
                                        else (torch.rand(3, 4),)), {})]
    if op is prims.nonzero:  # sizes the values decide: eager's layout of the result (nonzero's is column-major)
        return [((torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 4.0]]),), {})]
    if op is prims.unique:
        return [((torch.tensor([3, 1, 3, 2]), True, True, True), {})]
    if op is prims.unique_consecutive:
        return [((torch.tensor([3, 3, 1, 2, 2]), True, True), {})]
    if op is prims.unique_dim:
        x = torch.randint(0, 2, (3, 4, 5), generator=torch.Generator().manual_seed(0))
        return [((x, d, c, True, True), {}) for d in range(3) for c in (False, True)]
    if op is prims.bincount:
        return [((torch.tensor([0, 2, 2]), None, 5), {}), ((torch.tensor([0, 2, 2]), torch.rand(3), 0), {})]
    if op is prims.repeat_index:
        return [((torch.tensor([1, 0, 3]),), {})]
    if op.name in ("softplus_backward", "elu_backward", "logit_backward"):  # the gradient's layout, not the input's
        cl = lambda t: t.to(memory_format=torch.channels_last)  # noqa: E731
        pairs = [(g, x) for g in (torch.rand(2, 3, 4, 5), cl(torch.rand(2, 3, 4, 5))) for x in (torch.rand(2, 3, 4, 5) * 0.5 + 0.2, cl(torch.rand(2, 3, 4, 5) * 0.5 + 0.2))]
        extra = {"softplus_backward": lambda g, x: (g, x, 1.0, 20.0), "elu_backward": lambda g, x: (g, 1.0, 1.0, 1.0, False, x),
                 "logit_backward": lambda g, x: (g, x)}[op.name]
        return [(extra(g, x), {}) for g, x in pairs]
    if op.name in ("scaled_dot_product_attention", "scaled_dot_product_attention_vjp"):
        # calls eager runs by its math kernel on the CPU: narrow value heads (q and k transposed from (batch, seq,
        # heads, dim), k's gradient then not row-major), every other element of the last dimension
        q, k, v = (torch.rand(2, 6, 3, 8).transpose(1, 2) for _ in range(3))
        calls = [((q, k, v[..., :4]), {"is_causal": True}), ((q[..., ::2], k[..., ::2], v[..., ::2]), {}),
                 ((q, k, v[..., :4], torch.rand(6, 6)), {"scale": 0.5})]
        if op.module != "vjp":  # and calls eager runs by its CPU flash kernel (the forward's rule): its output's layout
            qf, kf, vf = (torch.rand(2, 6, 3, 8).transpose(1, 2) for _ in range(3))
            return calls + [((qf, kf, vf), {"is_causal": True}), ((qf, kf, vf, torch.rand(2, 3, 6, 6)), {"scale": 1.0}),
                            ((qf[:, :, :1], kf, vf, torch.rand(2, 1, 1, 6) > 0.3), {})]
        return [((torch.rand(*a[0].shape[:-1], a[2].shape[-1]), (), *a), kw) for a, kw in calls]
    if op.name in ("new_zeros", "new_ones", "new_empty", "new_full"):  # row-major whatever the input's layout
        return [((col, (2, 3), 1.5) if op.name == "new_full" else (col, 2, 3), {})]
    if op is prims.index_put:  # into a clone of a dense input: its strides (column-major, channels_last, row-major)
        cl = torch.rand(2, 3, 4, 5).to(memory_format=torch.channels_last)
        return [((col, (torch.tensor([0, 2]),), torch.tensor(1.0), False), {}),
                ((cl, (torch.tensor([1]), torch.tensor([0, 2])), torch.rand(2, 4, 5), True), {}),
                ((torch.rand(3, 4), (torch.tensor([2, 0]),), torch.rand(2, 4), False), {})]
    if op.name in ("copysign", "floor_divide", "xlogy"):  # operands of different orders (their meta kernels lie there)
        t = (torch.rand(2, 4, 5, 6) + 0.5).transpose(1, 2)
        pairs = [(t, torch.rand(1, 5, 1, 6) + 0.5), (t, torch.rand(2, 5, 4, 6) + 0.5), (col + 0.5, torch.rand(4, 1) + 0.5)]
        return [(p, {}) for p in pairs] + ([((t, 2.0), {})] if op.module == "ltorch" else [])
    if op.name == "batch_norm":  # the kernel's memory format, not the input's strides (a transposed input: row-major)
        w, b = torch.rand(4), torch.rand(4)
        return [((x2, torch.rand(4), torch.rand(4) + 0.5, w, b, training, 0.1, 1e-5), {}) for training in (True, False)
                for x2, _ in _batch_norm_inputs(torch.rand(2, 4, 3, 5), torch.rand(2, 4, 3, 5))]
    if op.module == "vjp":  # a backward line: (incoming gradient, reads, the op's arguments)
        cl = lambda t: t.to(memory_format=torch.channels_last)  # noqa: E731
        x, g = torch.rand(2, 4, 3, 5), torch.rand(2, 4, 3, 5)
        if op.name == "gelu_vjp":  # every layout: the kernel's TensorIterator
            tr = lambda t: t.transpose(1, 3).contiguous().transpose(1, 3)  # noqa: E731
            return [((g2, (), x2), {}) for g2 in (g, cl(g), tr(g)) for x2 in (x, cl(x), tr(x))]
        w, b = torch.rand(4), torch.rand(4)
        if op.name == "group_norm_vjp":  # row-major operands
            return [((g, (), x, 2, w, b, 1e-5), {})]
        if op.name == "batch_norm_vjp":  # the input's suggested memory format, whatever the incoming gradient's
            return [((g2, (), x2, torch.rand(4), torch.rand(4) + 0.5, w, b, training, 0.1, 1e-5), {}) for training in (True, False)
                    for x2, g2 in _batch_norm_inputs(x, g)]
    if op in tforeach.OUT_OF_PLACE:
        if op.name == "_foreach_norm":
            return [(([torch.rand(()), torch.rand(())],), {})]
        n = {"_foreach_lerp": 1, "_foreach_addcmul": 2, "_foreach_addcdiv": 2}.get(op.name)
        if n is not None:
            return [((lists, [t + 1 for t in lists], *(([t * 2 for t in lists],) if n == 2 else (0.5,))), {})]
        unary = op.name in ("_foreach_abs", "_foreach_exp", "_foreach_neg", "_foreach_reciprocal", "_foreach_sign", "_foreach_sqrt")
        return [((lists,) if unary else (lists, [t + 1 for t in lists]), {})]
    return None


@contextlib.contextmanager
def _one_rank_group():
    """A gloo process group of this process alone (the collectives' samples), unless one exists."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_every_layout_rule_agrees_with_eager():
    with _one_rank_group():
        _every_layout_rule_agrees_with_eager()


def _every_layout_rule_agrees_with_eager():
    from thunder_train.compiler.transforms.autograd import vjp_symbol

    ruled = [op for op in _every_symbol() if op.layout_rule is not None]
    assert len(ruled) >= 30
    ruled += [vjp_symbol(op) for op in _every_symbol() if op.vjp_layout_rule is not None]
    for op in ruled:
        samples = _layout_samples(op)
        if samples is None:
            assert op.torch_impl is not None and getattr(op.torch_impl, "overwrites", None), f"no layout sample for {op.id}"
            continue  # the optimizer updates: test_optimizer_update_layouts_agree_with_eager
        for args, kwargs in samples:
            torch_fn = None
            if op.module == "vjp":  # eager's backward kernels, through autograd, for the gradients eager computes
                wanted = {"gelu_vjp": ((0,),), "group_norm_vjp": ((0,), (2,), (3,)), "batch_norm_vjp": ((0,), (3,), (4,)),
                          "scaled_dot_product_attention_vjp": ((0,), (1,), (2,))}[op.name]
                expected = torch_impls.TorchVJP(op.forward_symbol.torch_impl, wanted)(*args, **kwargs)
                torch_fn = (op.forward_symbol.torch_impl, wanted)  # what tracing records (the rule runs it)
            else:
                expected = torch_executor.torch_executor.eager_impl(op, args, kwargs)
            pargs = tuple([_proxy(t) for t in a] if isinstance(a, list) else _proxy(a) if isinstance(a, torch.Tensor) else a for a in args)
            pout = [_proxy(e.contiguous()) for e in expected] if isinstance(expected, (list, tuple)) else _proxy(expected.contiguous())
            b = BoundSymbol(op, pargs, kwargs, pout, torch_fn=torch_fn)
            tensors = [x for x in b.flat_args() if type(x) is TensorProxy]
            outs = [o for o in b.flat_outputs() if type(o) is TensorProxy]
            rule = op.layout_rule or op.forward_symbol.vjp_layout_rule
            assert rule(b, tensors, outs), f"{op.id}'s layout rule did not decide on its sample"
            for o, e in zip(outs, expected if isinstance(expected, (list, tuple)) else [expected]):
                assert (o._tt_strides, o._tt_storage_offset) == (e.stride(), e.storage_offset()), f"{op.id}: {o._tt_strides} vs eager {e.stride()}"


@pytest.mark.parametrize("make", [lambda ps: torch.optim.AdamW(ps, lr=0.1), lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.1)], ids=["adamw", "sgd", "adagrad"])
def test_optimizer_update_layouts_agree_with_eager(make):
    # The fused update's outputs mirror the lists it overwrites: parameters and state keep eager's layouts.
    ps = [torch.nn.Parameter(torch.rand(3, 4).t().contiguous().t()), torch.nn.Parameter(torch.rand(5))]
    for p in ps:
        p.grad = torch.rand_like(p)
    eager_ps = [torch.nn.Parameter(p.detach().clone(memory_format=torch.preserve_format)) for p in ps]
    for e, p in zip(eager_ps, ps):
        e.grad = p.grad.clone(memory_format=torch.preserve_format)
    opt, eager = make(ps), make(eager_ps)
    eager.step()
    cf = tt.compile(lambda: opt.step(), fusion=None)
    cf()
    (b,) = [b for b in tt.last_traces(cf)[0].bound_symbols if b.sym.layout_rule is layout_rules._like_overwritten_lists]
    state = [next(v for v in eager.state[e].values() if isinstance(v, torch.Tensor) and v.shape == e.shape) for e in eager_ps]
    for o, e in zip(b.output[0] + b.output[1], eager_ps + state):
        assert o._tt_strides == e.stride(), (b.sym.id, o._tt_strides, e.stride())


# ---------------------------------------------------------------------------
# nvFuser translations keyed by the op (executors/nvfuser_fusion.py)
# ---------------------------------------------------------------------------
def test_nvfuser_translations_are_declared_on_fusible_ops_of_known_kinds():
    translated = [op for op in _every_symbol() if op.nvfuser_translation is not None]
    assert len(translated) >= 100
    for op in translated:
        kind, nvf_op = op.nvfuser_translation
        assert "fusible" in op.tags, f"{op.id} is translated but never reaches a fused region"
        assert kind in ("unary", "binary", "ternary", "reduction", "cast") and (kind == "cast") == (nvf_op is None), op.id
        if op.is_prim:  # translated when the line runs the prim's own torch function
            assert op in nvfuser_fusion._PRIM_TORCH_FN, op.id
    # The same op in both languages translates the same way.
    for op in translated:
        if not op.is_prim and op.name in PRIMS and PRIMS[op.name].nvfuser_translation is not None:
            assert PRIMS[op.name].nvfuser_translation == op.nvfuser_translation, op.name


# ---------------------------------------------------------------------------
# The older slots: numbers, gradients PyTorch does not compute, forward statistics, fusion forms
# ---------------------------------------------------------------------------
def test_python_number_forms_agree_with_the_prims_torch_functions():
    checked = 0
    for p in PRIMS.values():
        if p.python_op is None or p not in torch_executor._ELEMENTWISE_TORCH:
            continue
        torch_fn = torch_executor._ELEMENTWISE_TORCH[p]
        for args in ((2.5,), (2.5, 1.5), (0.75, 2.0)):
            try:
                expected = torch_fn(*(torch.tensor(a, dtype=torch.float64) for a in args)).item()
                got = p.python_op(*args)
            except (TypeError, RuntimeError, ValueError):
                continue
            assert got == pytest.approx(expected, rel=1e-12, nan_ok=True), (p.name, args)
            if p.infix and len(args) == 2:
                assert eval(f"a {p.infix} b", {"a": args[0], "b": args[1]}) == got, p.name
            if p.mirrored is not None:
                assert p.mirrored.python_op(*reversed(args)) == got, p.name
            checked += 1
    assert checked >= 30


def test_arguments_torch_does_not_differentiate_are_so_in_eager():
    samples = {"cross_entropy": lambda w: F.cross_entropy(_X.requires_grad_(False), torch.tensor([0, 2, 1, 1]), weight=w)}
    declared = [op for op in _all_symbols() if op.not_differentiated_by_torch]
    assert declared and all(op.name in samples for op in declared)
    for op in declared:
        assert op.not_differentiated_by_torch <= set(inspect.signature(op.fn).parameters), op.id
        w = torch.rand(3, requires_grad=True)
        with pytest.raises(RuntimeError, match="not differentiable with respect to argument"):
            samples[op.name](w).backward()


def test_forward_statistics_are_declared_on_ops_with_a_fused_backward():
    # The rewrite pairs the op's forward line with its <name>_vjp line, which only "fused_backward" ops record.
    declared = {op.name for op in _all_symbols() if op.torch_saved_statistics is not None}
    assert declared == {"scaled_dot_product_attention", "cross_entropy", "layer_norm", "batch_norm", "group_norm"}
    assert all("fused_backward" in op.tags and callable(op.torch_saved_statistics)
               for op in _all_symbols() if op.torch_saved_statistics is not None)
    # The forward that keeps eager's autograd graph for its backward line: attention's math kernel alone.
    kept = [op.name for op in _all_symbols() if op.torch_kept_graph is not None]
    assert kept == ["scaled_dot_product_attention"]
    # Fused programs only: attention with value heads narrower than the key's, on flash with the value padded.
    other = [op.name for op in _all_symbols() if op.torch_fused_program_pair is not None]
    assert other == ["scaled_dot_product_attention"] and all(
        "fused_backward" in op.tags for op in _all_symbols() if op.torch_fused_program_pair is not None)


def test_direct_vjps_that_apply_to_some_calls_say_which():
    # softmax_vjp runs _softmax_backward_data, the kernel eager's autograd runs for softmax without a dtype conversion.
    from thunder_train.compiler.torchlang import reductions as tred

    for op in (tred.softmax, tred.log_softmax):
        assert op.torch_direct_vjp is not None and callable(op.torch_direct_vjp.applies), op.name


def test_ops_that_split_by_index_are_list_ops_whose_kernels_update_each_entry_alone():
    # transforms/early_updates.py runs a splits_by_index line as one line per index: the torch kernel called per entry
    # must give what it gives for the whole list, bitwise.
    from thunder_train.compiler.torchlang import optim as toptim

    declared = {op.name for op in _all_symbols() if op.splits_by_index}
    assert declared == {"adam_update", "sgd_update", "adagrad_update"} | {op.name for op in tforeach.OUT_OF_PLACE}
    g = torch.Generator().manual_seed(0)
    shapes = [(64, 32), (7,), (3, 5, 2)]
    lists = [[torch.randn(s, generator=g) for s in shapes] for _ in range(4)]
    steps = [torch.tensor(3.0) for _ in shapes]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
                 decoupled_weight_decay=True)
    p, gr, m, v = lists
    v = [t.abs() for t in v]
    whole = toptim.adam_update.torch_impl(p, gr, m, v, [], steps, **hyper)
    for i in range(len(shapes)):
        one = toptim.adam_update.torch_impl([p[i]], [gr[i]], [m[i]], [v[i]], [], [steps[i]], **hyper)
        assert all(torch.equal(a[0], b[i]) for a, b in zip(one[:3], whole[:3]))
    whole = torch._foreach_add(p, gr)
    assert all(torch.equal(torch._foreach_add([p[i]], [gr[i]])[0], whole[i]) for i in range(len(shapes)))


@pytest.mark.parametrize("make", [lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), lambda ps: torch.optim.AdamW(ps, lr=0.1),
                                  lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=0.1),
                                  lambda ps: torch.optim.Adagrad(ps, lr=0.1)], ids=["adam-amsgrad", "adamw", "sgd-momentum", "sgd", "adagrad"])
def test_results_without_decomposition_are_the_decompositions(make):
    # Symbol.results_without_decomposition (recorded so unless decompose=True): the results it makes are the ones the
    # decomposition makes, list by list (shape, dtype, device, layout).
    declared = {op.name for op in _all_symbols() if op.results_without_decomposition is not None}
    assert declared == {"adam_update", "sgd_update", "adagrad_update"}
    lines = {}
    for decompose in (False, True):
        ps = [torch.nn.Parameter(torch.rand(3, 4).t().contiguous().t()), torch.nn.Parameter(torch.rand(5))]
        for p in ps:
            p.grad = torch.rand_like(p)
        opt = make(ps)
        opt.step()  # eager's state (its layouts), which the traced step updates
        cf = tt.compile(lambda: opt.step(), fusion=None, decompose=decompose)
        cf()
        (lines[decompose],) = [b for b in tt.last_traces(cf)[0].bound_symbols if b.sym.name in declared]
    direct, traced = lines[False], lines[True]
    assert not direct.subsymbols and traced.subsymbols
    facts = lambda line: [[(o._tt_shape, o._tt_dtype, o._tt_device, o._tt_strides) for o in out] for out in line.output]  # noqa: E731
    assert facts(direct) == facts(traced)


def test_fusion_forms_compute_the_op():
    x, g = torch.randn(64, 32, dtype=torch.float64), torch.randn(64, 32, dtype=torch.float64)
    declared = [op for op in _all_symbols() if op.fusion_form is not None or op.fusion_vjp_form is not None]
    assert [op.name for op in declared] == ["gelu", "cross_entropy"]
    big = torch.randn(2, 16384, dtype=torch.float64)
    gelu, cross_entropy = declared
    for op in [gelu]:
        for kw in ({"approximate": "tanh"}, {"approximate": "none"}):
            form = op.fusion_form(_proxy(x), **kw)
            torch.testing.assert_close(form(x, **kw), op.torch_impl(x, **kw))
            xg = x.clone().requires_grad_()
            (expected,) = torch.autograd.grad(op.torch_impl(xg, **kw), xg, g)
            vjp_form = op.fusion_vjp_form(_proxy(g), None, _proxy(x), **kw)
            torch.testing.assert_close(vjp_form(g, None, x, **kw)[0], expected)
        # only where it is faster: exact GELU on small tensors (eager's kernels are as fast from ~64 Ki elements)
        assert op.fusion_form(_proxy(big), approximate="none") is None
        assert op.fusion_vjp_form(_proxy(big), None, _proxy(big), approximate="none") is None
    # cross-entropy over class indices: on CUDA only (torchlang/cross_entropy_fusion_form.py); here on the CPU as if
    t = torch.randint(0, 32, (64,))
    t[5] = -100
    assert cross_entropy.fusion_form(_proxy(x), _proxy(t)) is None
    from thunder_train.compiler.torchlang import cross_entropy_fusion_form

    with unittest.mock.patch.object(cross_entropy_fusion_form, "DEVICES", {"cpu"}):
        for kw in ({}, {"reduction": "sum"}):
            form = cross_entropy.fusion_form(_proxy(x), _proxy(t), **kw)
            torch.testing.assert_close(form(x, t, **kw), cross_entropy.torch_impl(x, t, **kw))
            xg = x.clone().requires_grad_()
            (expected,) = torch.autograd.grad(cross_entropy.torch_impl(xg, t, **kw), xg, g[0, 0])
            vjp_form = cross_entropy.fusion_vjp_form(_proxy(g[0, 0]), (), _proxy(x), _proxy(t), **kw)
            torch.testing.assert_close(vjp_form(g[0, 0], (), x, t, **kw)[0], expected)
        assert cross_entropy.fusion_form(_proxy(x), _proxy(t), label_smoothing=0.1) is None
        assert cross_entropy.fusion_form(_proxy(x), _proxy(t), weight=_proxy(g[0])) is None


def test_kernel_switches_are_declared_with_the_op_that_reads_them():
    """SDPA's kernel comes from process-wide backend switches: the reader and the runner that replays a setting
    hang off its symbol, in its file; the matmul-family ops declare the precision switches; no other op does."""
    sdpa = registry.lookup(F.scaled_dot_product_attention)
    reader, runner = sdpa.kernel_switches()
    assert _file(reader) == _file(runner) == "compiler/torchlang/attention.py"
    assert reader() == reader() and runner(reader()) is runner(reader())  # one runner per setting
    from thunder_train.compiler.torchlang import linalg, matmul_precision, nn as ltorch_nn

    # The float32 matmul precision / TF32 switches: one reader and runner factory (matmul_precision.py), declared
    # next to each op that reads them.
    precision_ops = {linalg.matmul, linalg.mm, linalg.bmm, linalg.addmm, linalg.baddbmm, linalg.einsum,
                     ltorch_nn.linear, ltorch_nn.conv1d, ltorch_nn.conv2d}
    for op in precision_ops:
        reader, runner = op.kernel_switches()
        assert reader is matmul_precision._read and runner(reader()) is runner(reader())
        assert runner(reader()).__name__.startswith(op.name) or op.name in runner(reader()).__name__
    declared = {s for s in registry.all_symbols.values() if s.kernel_switches is not None}
    assert declared == {sdpa} | precision_ops
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_by_requires_grad_runs_eagers_kernel(dtype):
    """SDPA on the CPU with a float mask that requires grad: eager's selector rules flash out, whatever the grad mode,
    and runs its math kernel.  The fact, declared with the op (the only one), names a callable whose values and
    layout are eager's call's bitwise (flash's layout differs: a line recording the call's own would be laid out
    otherwise than eager); where the mask does not require grad, the call's own callable stays."""
    from thunder_train.compiler.torchlang import attention

    sdpa = registry.lookup(F.scaled_dot_product_attention)
    matmul = registry.lookup(torch.matmul)
    assert {op for op in _every_symbol() if op.kernel_by_requires_grad is not None} == {sdpa, matmul}
    assert _file(sdpa.kernel_by_requires_grad) == "compiler/torchlang/attention.py"
    assert _file(matmul.kernel_by_requires_grad) == "compiler/torchlang/linalg.py"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 3, 8, generator=gen, dtype=dtype).transpose(1, 2) for _ in range(3))
    for mask in (torch.randn(1, 3, 5, 5, generator=gen, dtype=dtype), torch.randn(5, 5, generator=gen, dtype=dtype)):
        args = [_proxy(t) for t in (q, k, v, mask)]
        assert sdpa.kernel_by_requires_grad(lambda t: False, *args[:3], attn_mask=args[3]) is None
        kernel = sdpa.kernel_by_requires_grad(lambda t: t is args[3], *args[:3], attn_mask=args[3], scale=0.5)
        assert kernel is attention.sdpa_math and kernel.kernel_of is sdpa
        with torch.no_grad():
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.clone().requires_grad_(), scale=0.5)
            got = kernel(q, k, v, attn_mask=mask, scale=0.5)
            flash = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
        assert torch.equal(got, want) and got.stride() == want.stride() != flash.stride()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), pytest.raises(RuntimeError, match="No available kernel"):
        attention.sdpa_math(q, k, v, attn_mask=mask)  # switched off after tracing: eager's own error


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_of_a_matrix_requiring_grad_by_a_batch_runs_eagers_folded_product(dtype):
    """``W @ h`` with ``W`` (2-d) requiring grad and ``h`` a batch: eager folds the batch into one mm (ATen's
    ``should_fold``), whose values differ from the batch-by-batch product eager runs without grad; the fact names a
    callable giving the folded values and eager's (contiguous) layout under ``no_grad``, where the program runs."""
    matmul = registry.lookup(torch.matmul)
    gen = torch.Generator().manual_seed(0)
    w, h = torch.randn(8, 12, generator=gen, dtype=dtype), torch.randn(3, 12, 5, generator=gen, dtype=dtype)
    pw, ph = _proxy(w), _proxy(h)
    assert matmul.kernel_by_requires_grad(lambda t: False, pw, ph) is None
    # a batch times a matrix: the call's own callable (eager folds that one whatever requires grad)
    assert matmul.kernel_by_requires_grad(lambda t: True, ph, _proxy(torch.randn(5, 4, dtype=dtype))) is None
    kernel = matmul.kernel_by_requires_grad(lambda t: t is pw, pw, ph)
    want = w.clone().requires_grad_() @ h
    with torch.no_grad():
        got = kernel(w, h)
    # The values tell the folded product from the batched one (``w @ h`` under no_grad) where the CPU's kernels round
    # the two otherwise: float32 on the CPUs of earlier sessions; on an AVX-512 CPU both give the same bits.
    assert torch.equal(got, want.detach()) and got.stride() == want.stride()


def test_recompute_in_backward_is_declared_where_the_op_is():
    # Symbol.recompute_in_backward: only FSDP2's gather asks the backward to gather again, and only for units that
    # reshard after their forward (its line's reshard_after_forward).
    from thunder_train.compiler.symbols import BoundSymbol
    from thunder_train.compiler.torchlang import distributed as tdist

    asking = [op for op in _every_symbol() if op.recompute_in_backward is not None]
    assert asking == [tdist.fsdp_all_gather]
    line = lambda flag: BoundSymbol(tdist.fsdp_all_gather, (), {"reshard_after_forward": flag}, None)  # noqa: E731
    assert tdist.fsdp_all_gather.recompute_in_backward(line(True)) is True
    assert tdist.fsdp_all_gather.recompute_in_backward(line(False)) is False



def test_narrowed_lines_compute_only_the_results_read():
    # Symbol.narrowed: dead-code elimination keeps the convolution's backward for the weight's gradient alone when
    # nobody reads the input's; both unread: the line goes.
    from thunder_train.compiler import devices, dtypes
    from thunder_train.compiler.transforms.dce import dce

    assert [s for s in PRIMS.values() if s.narrowed is not None] == [prims.convolution_backward]
    # (its kernel's scratch memory, which kept buffers plan around: tests/test_memory.py)
    assert [s for s in PRIMS.values() if s.torch_unknown_scratch] == [prims.convolution_backward]
    # (the collectives, whose backends allocate their buffers unseen: no kept-buffer room, tests/test_fsdp.py)
    assert {s for s in PRIMS.values() if s.torch_unseen_memory} == {prims.all_gather, prims.reduce_scatter, prims.all_reduce_mean}
    g, a, w = (TensorProxy(shape=s, dtype=dtypes.float32, device=devices.Device("cpu")) for s in ((1, 2, 2, 2), (1, 3, 4, 4), (2, 3, 3, 3)))
    ga, gw = (TensorProxy(shape=t._tt_shape, dtype=dtypes.float32, device=devices.Device("cpu")) for t in (a, w))
    line = BoundSymbol(prims.convolution_backward, (g, a, w, (1, 1), (0, 0), (1, 1), 1, (True, True, False)), {}, (ga, gw, None))

    class Trace:
        def __init__(self, output):
            self.bound_symbols, self.output = [line], output

        def derive(self, header):
            return Trace(self.output)

    (kept,) = dce(Trace((gw,))).bound_symbols
    assert kept.args[-1] == (False, True, False) and kept.output == (None, gw, None)
    (kept,) = dce(Trace((ga, gw))).bound_symbols
    assert kept is line
    assert dce(Trace(())).bound_symbols == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 4, 17, 8), (1, 2, 40, 16)])
def test_the_plan_counts_what_the_flash_pair_keeps(shape, dtype):
    """What the memory plan's probe counts as kept from an attention's forward line to its backward line
    (``Symbol.torch_saved_statistics_bytes``) is what the CPU flash forward returns for its backward: the output
    and the log-sum-exp."""
    from thunder_train.compiler.proxies import TensorProxy
    from thunder_train.compiler.symbols import BoundSymbol
    from thunder_train.compiler.torchlang import attention
    from thunder_train.compiler import dtypes, devices

    q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
    out, lse = torch._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False)[:2]
    proxy = TensorProxy("o", shape=out.shape, dtype=dtypes.from_torch(dtype), device=devices.from_torch(torch.device("cpu")))
    line = BoundSymbol(attention.scaled_dot_product_attention, (), {}, proxy)
    kept = attention.scaled_dot_product_attention.torch_saved_statistics_bytes(line)
    assert kept == out.nbytes + lse.nbytes, (kept, out.nbytes, lse.nbytes)


def test_the_plan_knows_which_attention_keeps_memory_it_does_not_count():
    """``Symbol.torch_holds_unplanned``: an attention eager runs with its math kernel (value heads narrower than the
    key's) keeps its graph, holding the attention probabilities, which the plan's probe counts as the flash pair's
    output and log-sum-exp; costly values stay recomputed in such a program (transforms/memory.py ``fewest_costly``).
    The flash pair's operands, and one key/value head over several query heads (run by the flash pair as one group),
    are counted."""
    from thunder_train.compiler.proxies import TensorProxy
    from thunder_train.compiler.symbols import BoundSymbol
    from thunder_train.compiler.torchlang import attention

    def line(*shapes):
        q, k, v = (TensorProxy(shape=s, dtype=torch.float32, device=torch.device("cpu")) for s in shapes)
        out = TensorProxy(shape=shapes[0][:-1] + shapes[2][-1:], dtype=torch.float32, device=torch.device("cpu"))
        return BoundSymbol(attention.scaled_dot_product_attention, (q, k, v), {}, out)

    holds = attention.scaled_dot_product_attention.torch_holds_unplanned
    q = (2, 4, 17, 8)
    assert not holds(line(q, q, q)) and not holds(line(q, (2, 1, 17, 8), (2, 1, 17, 8)))
    narrow = line(q, q, (2, 4, 17, 4))
    assert holds(narrow)
    # what eager's call keeps there is more than the flash count
    qt, kt, vt = (torch.randn(s, requires_grad=True) for s in (q, q, (2, 4, 17, 4)))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)
    inputs = {t.untyped_storage().data_ptr() for t in (qt, kt, vt)}
    kept = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                if t.untyped_storage().data_ptr() not in inputs}.values())
    assert kept > attention.scaled_dot_product_attention.torch_saved_statistics_bytes(narrow), kept


def _declared_scratch_cases():
    offs = torch.tensor([3, 7, 7, 12], dtype=torch.int32)
    col = lambda *shape: torch.randn(*shape[:-2], shape[-1], shape[-2]).transpose(-2, -1)  # noqa: E731
    grouped = [((torch.randn(12, 8), torch.randn(4, 8, 4)), {"offs": offs}),  # the op's four ranks, both layouts
               ((torch.randn(12, 8), col(4, 8, 4)), {"offs": offs}),
               ((col(4, 8, 8), torch.randn(8, 12)), {"offs": offs}),
               ((torch.randn(8, 12), col(12, 4)), {"offs": offs}),
               ((col(4, 8, 8), col(4, 8, 4)), {}),
               ((torch.randn(48, 32), col(4, 32, 5)), {"offs": torch.tensor([16, 32, 40, 48], dtype=torch.int32)})]
    counts = torch.randint(0, 4, (1000,)).float()
    histc = [((counts,), {"bins": 4, "min": 0, "max": 3}), ((counts,), {"bins": 64}), ((counts[:7],), {"bins": 300})]
    return [(torch._grouped_mm, a, k) for a, k in grouped] + [(torch.histc, a, k) for a, k in histc]


@pytest.mark.parametrize("threads", [1, 2])
def test_declared_scratch_is_what_the_kernel_allocates(threads):
    # Symbol.scratch_bytes (opaque ops: opaque.scratch_rule): an op whose kernel's temporaries are declared is planned
    # around by kept buffers as a line without unknown memory (executors/buffers.py), so the declaration must cover
    # what the kernel allocates inside the call beyond its output: measured in the allocator's order.
    import sys

    from thunder_train.compiler import opaque

    def proxy_for(t):
        return TensorProxy(shape=t.shape, dtype=t.dtype, device=t.device, strides=t.stride(), storage_offset=t.storage_offset())

    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from _peak import peak_call_bytes_all_threads

    assert [s for s in PRIMS.values() if s.scratch_bytes is not None] == []
    assert set(opaque.scratch_rules) == {torch._grouped_mm, torch.histc}
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for func, args, kwargs in _declared_scratch_cases():
            declared = opaque.opaque_symbol(func).scratch_bytes(*[proxy_for(a) for a in args], **kwargs)
            out = func(*args, **kwargs)
            inside = peak_call_bytes_all_threads(lambda: func(*args, **kwargs)) - out.untyped_storage().nbytes()
            assert declared is not None and 0 <= inside <= declared, (func, [a.shape for a in args], kwargs, inside, declared)
        strided = torch.randn(64, 16).t()  # copied first: unknown
        assert opaque.opaque_symbol(torch.histc).scratch_bytes(proxy_for(strided), bins=4) is None
    finally:
        torch.set_num_threads(before)


def test_every_fact_slot_of_symbol_is_checked_here():
    # A new fact slot on Symbol needs a check in this file (its name appears in a test above).
    slots = [n for n, v in vars(Symbol).items() if not n.startswith("_") and not callable(v) and not isinstance(v, property)]
    text = pathlib.Path(__file__).read_text().split("def test_every_fact_slot_of_symbol_is_checked_here")[0]
    unchecked = [n for n in slots if n not in text]
    assert not unchecked, f"Symbol fact slots no test in tests/test_op_facts.py reads: {unchecked}"

