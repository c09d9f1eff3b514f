"""Every fact about an op hangs off its Symbol and is declared where the op is defined (docs/architecture.md)."""
from __future__ import annotations

import inspect
import pathlib

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
from thunder_train.compiler.executors import reinplace, torch_executor  # noqa: E402
from thunder_train.compiler.symbols import Symbol  # noqa: E402

PRIMS = prims.all_prims()
# Prims without a gradient rule that are not "non_differentiable" either: reaching one on a gradient path
# raises NoGradientRuleError (a write-back, a runtime check, a collective of the traced backward, and
# convolution's backward, which has no second derivative yet).
NO_RULE_BY_DESIGN = {"copy_", "check_finite", "all_reduce_mean", "convolution_backward"}


def test_the_prims_are_split_by_family_and_exported():
    families = {_file(s.fn).rsplit("/", 1)[-1] for s in PRIMS.values()}
    assert families == {"elementwise.py", "reductions.py", "shapes.py", "linalg.py", "factories.py", "memory.py",
                        "generators.py"}
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
    gi, gw = prims.convolution_backward(g, a, w, (1, 1), (0, 0), (1, 1), 1)
    a.requires_grad_(), w.requires_grad_()
    ea, ew = torch.autograd.grad(F.conv2d(a, w), (a, w), g)
    torch.testing.assert_close(gi, ea), torch.testing.assert_close(gw, ew)


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
