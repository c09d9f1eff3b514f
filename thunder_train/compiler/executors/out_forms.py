"""Out forms (torch executor): the call that computes what a line computes into given memory, ``out=``.

``f(*args, out=..., **kwargs)`` computes the line's result into ``out`` and returns it: a torch function's own
``out=`` overload, declared with the op (``Symbol.torch_out_forms``), or a ``ttex`` function's ``.out``; a form may
pick, from the line's traced arguments, the torch call it makes (``fn.for_line``).  Also declared here: which torch
calls return new memory (``Symbol.torch_fresh``; a reshape or ``.contiguous()`` that copies, from its input's traced
layout), which forms take any call of tensors, and which write any layout.
The kept buffers (buffers.py) write a line's value into the arena through its out form.
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, meta_tensor
from . import torch_impls
from .decided_layouts import _laid_out
from .regions import FusionSymbol
from .torch_executor import ImplSymbol


def _tensor(x) -> bool:
    return type(x) is TensorProxy


def _row_major(sizes, strides) -> bool:
    """``is_contiguous`` of int sizes and strides: torch's rule (sizes of 1 and empty tensors place no condition)."""
    if 0 in sizes:
        return True
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


# ``out`` has the line's output structure (the torch functions below have one tensor result); a ttex function's
# form also accepts None entries for results it allocates.
def out_form(bsym):
    """The out form of the line's function, or None: a ttex function's own ``.out``, else the one its op declares for
    the torch callable the line runs (``Symbol.torch_out_forms``), as the form picks it for the line's traced
    arguments (``fn.for_line``; None where no form is worth a kept buffer)."""
    if isinstance(bsym.sym, FusionSymbol):  # a fused region: its kernel writes into given buffers
        return None if bsym.sym.into else getattr(bsym.sym.runner, "out", None)
    op = bsym.source
    if not isinstance(bsym.sym, ImplSymbol) or (op is not None and op.runs_opaquely):
        return None
    if bsym.kwargs.get("inplace") is True:  # ``F.relu(x, inplace=True)``: the result is ``x``, written in place
        return None
    fn = bsym.sym.fn
    form = getattr(fn, "out", None)
    if form is not None and fn.__module__ != "torch":
        return form
    forms = op.torch_out_forms if op is not None else None
    try:
        form = forms.get(fn) if forms else None
    except TypeError:  # an unhashable callable
        return None
    return None if form is None else form_for_line(form, bsym)


def aliased_args(bsym):
    """Positions of the arguments whose memory the line's tensor results may share: () for new tensors (a function
    declared so: ``fn.aliases``, or a torch callable its op lists in ``Symbol.torch_fresh``; a line with an out form
    too), None when unknown (every argument)."""
    fn = getattr(bsym.sym, "fn", None) if isinstance(bsym.sym, (ImplSymbol, FusionSymbol)) else None
    if fn is None:
        return None
    aliases = getattr(fn, "aliases", None)
    if aliases is not None:
        return aliases
    opaque = bsym.source is not None and bsym.source.runs_opaquely
    if isinstance(fn, torch._ops.OpOverload) and not opaque and schema_says_fresh(fn):
        return ()  # (an overload the user called is run opaquely: its results are not trusted to be new)
    try:
        return () if bsym.source is not None and fn in bsym.source.torch_fresh else None
    except TypeError:
        return None


# ATen overloads whose schema annotates no alias although their result may be their argument's memory.
_UNANNOTATED_ALIASES = frozenset({"aten::_unsafe_view", "aten::lift", "aten::lift_fresh"})


def schema_says_fresh(op) -> bool:
    """An ATen overload (``torch.ops.aten.tanh_backward.default``, what several ops' lines call) whose schema gives no
    result an alias annotation and writes no argument: its results are new tensors, but for the few overloads whose
    schema leaves an alias unannotated (``_unsafe_view``).  (Taken for views of their arguments, such results counted
    no bytes in the kept buffers' plan: ``tanh_backward``'s 8 KiB put a step 16 % above its planned peak.)"""
    schema = op._schema
    return schema.name not in _UNANNOTATED_ALIASES and not any(r.alias_info is not None for r in schema.returns) and \
        not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def aliasing_results(bsym) -> list:
    """The line's flat results that may share the memory of its ``aliased_args``: the positions its function declares
    (``fn.aliasing_results``: cross-entropy writing the log-probabilities over the logits returns the loss too, new
    memory), else all of them."""
    outs = bsym.flat_outputs()
    fn = getattr(bsym.sym, "fn", None) if isinstance(bsym.sym, (ImplSymbol, FusionSymbol)) else None
    which = getattr(fn, "aliasing_results", None)
    return outs if which is None else [outs[i] for i in which]


# The torch executor's facts about the torch callables an op's lines run, declared per op (keyed by its Symbol).
_T, _F = torch.Tensor, torch.nn.functional


def _function_and_method(*names) -> dict:
    """``torch.f`` and the ``Tensor`` method of the same name (the same call), each with ``torch.f`` as its out form:
    elementwise torch functions (TensorIterator kernels) run the functional call's kernel with ``out=o`` of the
    result's shape, dtype and strides."""
    return {f: getattr(torch, n) for n in names for f in (getattr(torch, n), getattr(_T, n))}


# Out forms whose ``out=`` overloads take any call whose arguments are all tensors (``_accepts_out`` asks torch about
# the others; tests/test_kept_buffers.py checks torch says yes for every form here).
TAKES_TENSORS: set = set()
# Out forms that write the right values into an ``out`` of any dense layout (TensorIterator kernels and the structured
# kernels that copy through a buffer of their own layout when ``out``'s differs).  The other forms get a kept buffer
# only for a row-major value (the layout every out form writes correctly): some kernels write row-major whatever
# ``out``'s strides (``_log_softmax_backward_data.out``, ``_softmax_backward_data.out``) or write nothing into a
# non-contiguous ``out`` (CPU ``gelu`` of a contiguous input, through oneDNN) or raise (``matmul`` of a 3-d and a 2-d
# tensor, ``linear_out``), and a recorded layout is not always the
# one the kernel gives (a fake run's layout of log-softmax's backward is its incoming gradient's, the CPU kernel's is
# row-major): such a buffer got the values in the wrong places, silently (issue #25).
# tests/test_kept_buffers.py checks each form here against its functional call into outs of every dim order.
ANY_LAYOUT: set = set()


def _declare_out_forms() -> None:
    from .. import prims
    from ..torchlang import activations, elementwise as ew, linalg, nn, reductions as red, shapes
    from .torch_executor import _ELEMENTWISE_TORCH

    # Reductions: ``sum.out``/``mean.out`` are the structured kernels the functional calls run (bitwise the same).
    forms = {red.sum: _function_and_method("sum"), red.mean: _function_and_method("mean"), prims.sum: {torch.sum: torch.sum},
             ew.div: _function_and_method("div", "true_divide"), prims.div: {torch.true_divide: torch.true_divide},
             nn.linear: {_F.linear: torch_impls.linear_out}, linalg.addmm: _function_and_method("addmm"), activations.gelu: {_F.gelu: torch._C._nn.gelu},
             linalg.matmul: {torch.matmul: torch.matmul}, prims.matmul: {torch.matmul: torch.matmul},
             shapes.cat: {torch.cat: torch.cat}, prims.cat: {torch.cat: torch.cat},
             activations.relu: {f: torch_impls.relu_out for f in (torch.relu, _F.relu, _T.relu)},
             activations.silu: {_F.silu: torch_impls.silu_out}, nn.embedding: {_F.embedding: torch_impls.embedding_out}}
    for op, prim in ((ew.add, prims.add), (ew.sub, prims.sub), (ew.mul, prims.mul), (ew.neg, prims.neg),
                     (ew.rsqrt, prims.rsqrt), (ew.sqrt, prims.sqrt), (ew.exp, prims.exp), (ew.log, prims.log),
                     (ew.tanh, prims.tanh), (ew.sigmoid, prims.sigmoid), (ew.cos, prims.cos), (ew.sin, prims.sin), (ew.pow, prims.pow), (ew.le, prims.le),
                     (ew.lt, prims.lt), (ew.ge, prims.ge), (ew.gt, prims.gt), (ew.eq, prims.eq), (ew.ne, prims.ne)):
        forms[op] = _function_and_method(prim.name)
        # the prim's torch function, and its mirror's (lt(2, t) runs gt(t, 2): torch_executor.py)
        fns = [_ELEMENTWISE_TORCH[p] for p in (prim, prim.mirrored) if p is not None]
        forms[prim] = {f: f for f in fns}
    for op, declared in forms.items():
        op.torch_out_forms = declared
    # The elementwise forms (TensorIterator kernels): their ``out=`` overloads take every call of tensors alone.
    elementwise = [f for op, declared in forms.items() if op not in (red.sum, red.mean, prims.sum, nn.linear, linalg.addmm,
                                                                     activations.gelu, linalg.matmul, prims.matmul,
                                                                     shapes.cat, prims.cat, activations.relu,
                                                                     activations.silu, nn.embedding)
                   for f in declared.values()]
    TAKES_TENSORS.update(elementwise)
    ANY_LAYOUT.update(elementwise, (torch.sum, torch.mean, torch.cat, torch.addmm, torch_impls.gelu_vjp_out,
                       torch_impls.silu_vjp_out, torch_impls.silu_out, torch_impls.relu_out))


def _declare_fresh() -> None:
    """Torch callables whose results never share memory with their inputs, besides those with an out form (a line
    whose callable is not known to return new tensors is taken to alias its inputs: views, ``contiguous``, ``to``,
    ``dropout``, any ``inplace=True`` activation, ...)."""
    from .. import prims
    from ..torchlang import attention, elementwise as ew, factories, losses, nn, normalization, reductions as red

    def both(name):
        return {getattr(torch, name), getattr(_T, name)}

    fresh = {red.sum: both("sum"), red.mean: both("mean"), red.amax: both("amax"), red.amin: both("amin"),
             red.softmax: both("softmax") | {_F.softmax}, red.log_softmax: both("log_softmax") | {_F.log_softmax},
             ew.where: both("where"), nn.embedding: {_F.embedding}, nn.linear: {_F.linear}, normalization.layer_norm: {_F.layer_norm},
             attention.scaled_dot_product_attention: {_F.scaled_dot_product_attention, attention.sdpa_math},
             losses.cross_entropy: {_F.cross_entropy},
             **{op: {getattr(torch, op.name)} for op in (factories.full, factories.zeros, factories.ones,
                                                         factories.empty, factories.arange)},
             prims.sum: {torch.sum}, prims.amax: {torch.amax}, prims.amin: {torch.amin}, prims.where: {torch.where},
             prims.full: {torch.full}, prims.empty: {torch.empty}}
    # Results the plan had taken for their arguments' memory, so it counted none of their bytes, although they are
    # always new: the arena then grew past the peak it was allowed (BLOOM's torch program held 35 KiB more with kept
    # buffers than without: its GELU backward's ``__rsub__``, the attention's ``baddbmm``/``bmm`` and matmuls).
    from ..torchlang import indexing, linalg, padding, tensor_methods

    fresh |= {ew.rsub: {torch.rsub, _T.__rsub__}, linalg.matmul: both("matmul"), linalg.bmm: both("bmm"),
              linalg.baddbmm: both("baddbmm"), padding.pad: {_F.pad}, prims.clone: {torch.clone},
              tensor_methods.clone: both("clone"), prims.take: {torch.index_select},
              # (DeepSeek-V3's torch program: 36 products and its routing's gathers and scatters uncounted, 1.07x
              # eager's peak once its kept buffers had room)
              prims.matmul: {torch.matmul, torch.mm}, indexing.gather: both("gather"),
              indexing.scatter: both("scatter"), indexing.scatter_add: both("scatter_add"),
              **{op: {getattr(torch, op.name)} for op in (prims.gather, prims.scatter, prims.scatter_add)},
              **{op: {getattr(torch, op.name)} for op in (factories.zeros_like, factories.ones_like,
                                                          factories.empty_like, factories.full_like)}}
    for op, fns in fresh.items():
        op.torch_fresh = frozenset(fns)
    for fn in (torch_impls.pad, torch_impls.rsub, torch_impls.rdiv):  # the torch executor's own calls: new tensors
        fn.aliases = ()


def _linear_for_line(b):
    """The out form a line of ``F.linear`` calls, picked from the traced ranks and layout, or None (no out form):
    aten's ``linear.out`` directly, without a Python function between (and its ``weight.t()`` call: ~2.4 us a
    call), where it runs functional ``linear``'s kernel: for a 2-d input and a 1-d bias (``addmm``), and without a
    bias for a 2-d or row-major input (``matmul(input, weight.t(), out=)``); ``linear_rows_out`` for a 1-d bias and a
    row-major input of more dims (aten's ``linear.out`` would add the bias after the product; functional ``linear``
    folds the rows into one ``addmm``).  None for an input of 3 or more dims that is not row-major: ``linear_out``
    would run functional ``linear`` and copy its result into the buffer, an allocation all the same (which the plan
    would not count) and a copy more."""
    args = list(b.args) + [b.kwargs.get("bias")] * (3 - len(b.args))
    x, bias = args[0], args[2]
    if not _tensor(x) or len(x._tt_shape) < 2:
        return torch_impls.linear_out
    one_d_bias = _tensor(bias) and len(bias._tt_shape) == 1
    if one_d_bias and len(x._tt_shape) == 2:
        return torch._C._nn.linear
    row_major = _laid_out_row_major(x)
    if bias is None and (len(x._tt_shape) == 2 or row_major):
        return torch._C._nn.linear
    if one_d_bias and row_major:
        return torch_impls.linear_rows_out
    if len(x._tt_shape) >= 3 and not row_major:
        return None
    return torch_impls.linear_out


def _laid_out_row_major(p) -> bool:
    sizes, strides = p._tt_shape, p._tt_strides
    return all(type(n) is int for n in (*sizes, *strides)) and _row_major(sizes, strides)


torch_impls.linear_out.for_line = _linear_for_line


def form_for_line(form, b):
    """The out form a line calls: a form may pick, from the line's traced arguments, the torch call it would make."""
    pick = getattr(form, "for_line", None)
    return form if pick is None else pick(b)


_declare_out_forms()
_declare_fresh()


_RESHAPES = {torch.reshape, torch.Tensor.reshape, torch.flatten, torch.Tensor.flatten}


def reshape_copies(bsym) -> bool:
    """A ``reshape``/``flatten`` line whose input's layout no view of the result's shape has: it copies (a new
    storage the plan counts).  Decided as torch decides it: ``view`` of a meta tensor with the input's layout."""
    fn = getattr(bsym.sym, "fn", None) if isinstance(bsym.sym, ImplSymbol) else None
    try:
        if fn not in _RESHAPES:
            return False
    except TypeError:
        return False
    a, o = bsym.args[0] if bsym.args else None, bsym.output
    if not (_tensor(a) and _tensor(o)):
        return False
    sizes = (*a._tt_shape, *a._tt_strides, *o._tt_shape)
    if not all(type(n) is int for n in sizes):
        return False
    try:
        torch.empty_strided(a._tt_shape, a._tt_strides, dtype=a._tt_dtype.torch, device="meta").view(o._tt_shape)
    except RuntimeError:
        return True
    return False


def contiguous_copies(bsym) -> bool:
    """A ``Tensor.contiguous`` line whose input's traced layout is not row-major: it copies (a new storage the plan
    counts; otherwise it returns its input).  nn.MultiheadAttention's packed in-projection takes ``.contiguous()`` of
    a transposed view: counted as maybe new memory only, it put the plan's peak a copy below the call's
    (nn.TransformerEncoder's zoo step: 18 KiB of ~100), and the arena had that much less room."""
    fn = getattr(bsym.sym, "fn", None) if isinstance(bsym.sym, ImplSymbol) else None
    if fn is not torch.Tensor.contiguous or \
            bsym.kwargs.get("memory_format", torch.contiguous_format) is not torch.contiguous_format:
        return False
    a = bsym.args[0] if len(bsym.args) == 1 else None
    return _laid_out(a) and not meta_tensor(a).is_contiguous()
