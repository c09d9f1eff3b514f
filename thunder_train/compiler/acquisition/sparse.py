"""Sparse tensors (COO, CSR, CSC) inside a compiled function: opaque values.

A ``TensorProxy`` carries a strided tensor's metadata (shape, strides, storage offset) and every rule downstream
(guards, layout rules, native gradients, the optimizers' kernels) assumes one.  A sparse tensor has no
strides and its number of stored elements is data-dependent, so it gets a proxy kind of its own, ``SparseProxy``
(compiler/sparse_proxy.py: layout, shape, dtype, device), which no native symbol takes: every torch call that reads
or makes one (``sparse_call``) runs as an opaque line whose outputs' metadata come from torch's fake tensors (a
sparse fake stores nothing, so the calls that read what is stored, ``_STORED``, are refused).  When a gradient flows
through such a line it runs with torch's autograd (transforms/opaque_grad.py), and its gradients are made and read
by opaque lines only (transforms/sparse_grads.py): a sparse leaf's ``.grad`` is the layout torch's autograd gives, as
in eager.  A sparse input is guarded by layout, shape, sparse/dense dims, dtype, device and requires_grad
(prologue.py).  What cannot be followed is refused with what to do (``_WHAT_TO_DO``): in-place updates of a sparse
value (also accumulating into its existing ``.grad``), reading what it stores, blocked layouts, and strided ops
whose gradient would be sparse (``refuse_sparse_gradient``).  A refused call is transactional: nothing the
function changed stays changed.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from .. import context
from ..errors import TracingError, UnsupportedOpError
from .. import opaque
from ..opaque import callable_name, opaque_symbol
from ..proxies import TensorProxy, size_value
from ..sparse_proxy import SparseProxy
from ..pytree import tree_flatten, tree_map, tree_unflatten
from ..symbols import BoundSymbol

_MAKER_METHODS = ("to_sparse", "to_sparse_coo", "to_sparse_csr", "to_sparse_csc", "to_sparse_bsr", "to_sparse_bsc")
_MAKER_FUNCTIONS = ("sparse_coo_tensor", "sparse_csr_tensor", "sparse_csc_tensor", "sparse_bsr_tensor",
                    "sparse_bsc_tensor", "sparse_compressed_tensor", "_sparse_coo_tensor_unsafe",
                    "_sparse_csr_tensor_unsafe", "_sparse_compressed_tensor_unsafe")
# torch callables whose result is sparse whatever their (strided) arguments
SPARSE_MAKERS = frozenset([getattr(torch.Tensor, n) for n in _MAKER_METHODS if hasattr(torch.Tensor, n)]
                          + [getattr(torch, n) for n in _MAKER_FUNCTIONS if hasattr(torch, n)])

_WHAT_TO_DO = ("Inside a compiled function a sparse tensor (COO, CSR or CSC) is an opaque value: the ops that take "
               "it run as torch runs them (gradients by torch's autograd), never in place. Do this part outside the compiled function "
               "(pass its dense result in, e.g. torch.sparse.mm(s, x) computed before the call) or use the dense form "
               "(s.to_dense()).")


# Ops that run opaquely (their gradient from torch's autograd) and give a sparse gradient when a flag says so:
# op -> (position of the weight, position and keyword of the flag).  Behind a strided proxy that gradient would
# reach .grad and the optimizer's kernels (which refuse it, or treat it as dense only by luck).
_SPARSE_GRAD_FLAGS = {F.embedding_bag: (1, 7, "sparse"), torch.embedding_bag: (0, 5, "sparse")}


def refuse_sparse_gradient(func, args: tuple, kwargs: dict) -> None:
    """A strided call whose gradient would be sparse (``embedding_bag(sparse=True)`` on a weight that requires grad)."""
    flag = _SPARSE_GRAD_FLAGS.get(func)
    if flag is not None:
        w, pos, key = flag
        weight = args[w] if len(args) > w else kwargs.get("weight")
        sparse = args[pos] if len(args) > pos else kwargs.get(key, False)
        if sparse and getattr(weight, "_tt_requires_grad", False) and torch.is_grad_enabled():
            raise TracingError(
                f"{callable_name(func)}(sparse=True) on a weight that requires grad: its gradient is a sparse tensor, which "
                "thunder_train does not support (.grad, the optimizers' kernels and the backward program are strided); "
                "use sparse=False (a dense gradient, the same values), or run this embedding outside the compiled "
                "function. Nothing was changed.")


# ---------------------------------------------------------------------------
# Sparse values as opaque values (SparseProxy, compiler/sparse_proxy.py)
# ---------------------------------------------------------------------------
SUPPORTED_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc)
# Metadata a sparse proxy answers itself (everything else a function reads of one is a torch call, run opaquely).
_PROPERTIES = {"shape": lambda p: torch.Size(p._tt_shape), "dtype": lambda p: p._tt_dtype.torch,
               "device": lambda p: p._tt_device.torch, "layout": lambda p: p._tt_layout, "is_sparse": lambda p: p._tt_layout == torch.sparse_coo,
               "is_sparse_csr": lambda p: p._tt_layout == torch.sparse_csr, "requires_grad": lambda p: p._tt_requires_grad,
               "ndim": lambda p: len(p._tt_shape), "is_cuda": lambda p: p._tt_device.torch.type == "cuda",
               "is_cpu": lambda p: p._tt_device.torch.type == "cpu", "is_meta": lambda p: False,
               "is_quantized": lambda p: False, "is_nested": lambda p: False, "is_mkldnn": lambda p: False}


def sparse_proxy_of(t: torch.Tensor, where: str, name=None):
    """A ``SparseProxy`` for the sparse tensor (or fake tensor) ``t``; a form it cannot stand for is refused."""
    if t.layout not in SUPPORTED_LAYOUTS:
        raise TracingError(f"{where} is a sparse tensor of layout {t.layout}: thunder_train runs COO, CSR and CSC tensors "
                           f"(as opaque values), not blocked layouts. {_WHAT_TO_DO}")
    if t.layout != torch.sparse_coo and (t.ndim != 2 or t.dense_dim() != 0):
        raise TracingError(f"{where} is a batched or hybrid {t.layout} tensor: thunder_train runs 2-d CSR and CSC "
                           f"tensors only. {_WHAT_TO_DO}")
    p = SparseProxy(name, shape=tuple(t.shape), dtype=t.dtype, device=t.device, layout=t.layout,
                    requires_grad=t.requires_grad)
    p._tt_dims = (t.sparse_dim(), t.dense_dim())
    return p


def _empty_sparse(p):
    """A sparse tensor laid out as ``p`` with no stored elements, made into a fake tensor for metadata runs."""
    shape, dtype, device = p._tt_shape, p._tt_dtype.torch, p._tt_device.torch
    if p._tt_layout == torch.sparse_coo:
        sparse_dim, dense_dim = p._tt_dims
        return torch.sparse_coo_tensor(torch.empty((sparse_dim, 0), dtype=torch.long, device=device),
                                       torch.empty((0,) + shape[sparse_dim:], dtype=dtype, device=device), shape,
                                       check_invariants=True)  # valid, and explicit: torch warns when it is implicit
    compressed = shape[0] if p._tt_layout == torch.sparse_csr else shape[1]
    make = torch.sparse_csr_tensor if p._tt_layout == torch.sparse_csr else torch.sparse_csc_tensor
    return make(torch.zeros(compressed + 1, dtype=torch.long, device=device), torch.empty(0, dtype=torch.long, device=device),
                torch.empty(0, dtype=dtype, device=device), shape, check_invariants=True)


# What a sparse tensor stores, read directly: sizes and answers that depend on how many elements it stores, which
# its proxy does not know (torch's fake tensors answer as if it stored none).
_STORED = frozenset(getattr(torch.Tensor, n) for n in (
    "_nnz", "values", "_values", "indices", "_indices", "crow_indices", "col_indices", "ccol_indices", "row_indices",
    "is_coalesced") if hasattr(torch.Tensor, n))


def touches_sparse(func, args, kwargs) -> bool:
    """Whether this call reads a sparse proxy (an argument, or an item of a list or tuple argument) or makes a sparse
    tensor.  Asked of every torch call while tracing: a shallow look, no flattening."""
    if func in SPARSE_MAKERS:
        return True
    layout = kwargs.get("layout") if kwargs else None
    if isinstance(layout, torch.layout) and layout != torch.strided:
        return True
    for group in (args, kwargs.values() if kwargs else ()):
        for a in group:
            t = type(a)
            if t is SparseProxy or ((t is list or t is tuple) and any(type(b) is SparseProxy for b in a)):
                return True
    return False


def _refuse_sparse_gradient_of_strided(name, inputs, fout) -> None:
    """A line whose gradient for a strided input is sparse (``s * w``: eager's ``w.grad`` is sparse COO) is refused:
    that input's proxy, the native rules that read its gradient and ``.grad`` are strided.  Learned from torch's
    backward on the fake tensors, with each sparse output's cotangent sparse and strided (eager's engine may give
    either); an op whose fake backward fails is left to the check at run time (opaque_grad.opaque_vjp)."""
    outs = [o for o in tree_flatten(fout)[0] if isinstance(o, torch.Tensor) and o.requires_grad]
    strided = [t.layout == torch.strided for t in inputs]
    if not outs or not any(strided):
        return
    for sparse_ct in (True, False):
        try:
            cts = [o.detach() if sparse_ct and o.layout != torch.strided else torch.zeros(o.shape, dtype=o.dtype, device=o.device)
                   for o in outs]
            grads = torch.autograd.grad(outs, inputs, cts, allow_unused=True, retain_graph=True)
        except Exception:  # noqa: BLE001 - no fake backward: the run-time check decides
            return
        if any(s and g is not None and g.layout != torch.strided for s, g in zip(strided, grads)):
            raise TracingError(
                f"{name}: torch's autograd gives a strided operand of this op a sparse gradient (eager keeps it "
                "sparse, also in .grad), which thunder_train does not follow into a strided tensor (its proxy, gradient rules "
                f"and .grad are strided). Compute this part under torch.no_grad() or outside the compiled function, or "
                f"make the operand that requires grad sparse. Nothing was changed.")


def sparse_call(func, name: str, args, kwargs, *, strict: bool, grad_flows):
    """Run a call that reads or makes a sparse tensor as an opaque line; its outputs' metadata from fake tensors.

    ``grad_flows(flat)``: the positions of the arguments a gradient would flow into (opaque.gradient_positions)."""

    fname = getattr(func, "__name__", "")
    if fname in ("__get__", "__set__"):
        prop = getattr(func.__self__, "__name__", "?")
        getter = _PROPERTIES.get(prop)
        if fname == "__get__" and getter is not None:
            return getter(args[0])
        raise TracingError(f"Tensor.{prop} of a sparse tensor is not supported inside a compiled function "
                           f"(a sparse tensor runs as an opaque value). {_WHAT_TO_DO}")
    if strict:
        raise UnsupportedOpError(f"{name} with a sparse tensor runs opaquely, which strict=True forbids. {_WHAT_TO_DO}")
    if fname in ("backward", "grad") or func in (torch.autograd.backward, torch.autograd.grad):
        raise TracingError(f"{name} from a sparse output inside a compiled function is not supported: reduce it to a "
                           f"dense value first (torch.sparse.sum(s), s.to_dense().sum()) and differentiate that.")
    if kwargs.get("out") is not None or (fname.endswith("_") and not fname.endswith("__")) or fname == "copy_":
        raise TracingError(f"{name} on a sparse tensor changes it in place (or writes out=), which thunder_train does not "
                           f"support: a sparse tensor runs as an opaque value. Use the out-of-place form. {_WHAT_TO_DO}")
    flat, spec = tree_flatten((args, kwargs))
    # Inputs a gradient flows into (sparse ones included): the line runs with torch's autograd (opaque_grad.py).
    diff = tuple(grad_flows(flat)) if torch.is_grad_enabled() else ()

    if func in _STORED:
        raise TracingError(f"{name} of a sparse tensor reads what it stores (its number of stored elements decides "
                           f"the result), which the compiled program does not know. {_WHAT_TO_DO}")
    mode = FakeTensorMode()

    def fake(x):
        if type(x) is TensorProxy:
            return torch.empty_strided(tuple(size_value(s) for s in x._tt_shape), x._tt_strides,
                                       dtype=x._tt_dtype.torch, device=x._tt_device.torch)
        return x

    try:
        with torch._C.DisableTorchFunction():
            examples = [mode.from_tensor(_empty_sparse(x)) if type(x) is SparseProxy else x for x in flat]
        with torch._C.DisableTorchFunction(), mode, torch.enable_grad():
            fakes = [fake(x) for x in examples]
            for i in diff:  # the outputs' requires_grad are then eager's
                fakes[i] = fakes[i].detach().requires_grad_()
            fargs, fkwargs = tree_unflatten(fakes, spec)
            fout = func(*fargs, **fkwargs)
    except Exception as e:
        raise UnsupportedOpError(f"{name} (a sparse value): learning its output's metadata with fake tensors failed "
                                 f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}). {_WHAT_TO_DO}") from e
    if diff:
        with torch._C.DisableTorchFunction(), mode, torch.enable_grad():
            _refuse_sparse_gradient_of_strided(name, [fakes[i] for i in diff], fout)

    def to_proxy(x):
        if not isinstance(x, torch.Tensor):
            return x
        if x.layout != torch.strided:
            return sparse_proxy_of(x, f"the result of {name}")
        return TensorProxy(shape=tuple(x.shape), dtype=x.dtype, device=x.device, requires_grad=x.requires_grad,
                           strides=x.stride(), storage_offset=x.storage_offset())

    out = tree_map(to_proxy, fout)
    if not any(isinstance(v, torch.Tensor) for v in tree_flatten(out)[0]):
        return out  # metadata only (a size, a bool): no trace line
    if diff and any(getattr(v, "_tt_requires_grad", False) for v in tree_flatten(out)[0]):
        name = opaque.record_differentiable(func, args, kwargs, out, diff)
    else:
        context.get_trace().add(BoundSymbol(opaque_symbol(func), args, kwargs, out, ()))
    st = context.tracer_state()
    if st is not None and name not in st.opaque_ops:
        st.opaque_ops.append(name)
    return out
