"""Writes, metadata and collectives: prims with side effects or runtime-number results.

``"side_effect"``: a call must run even when nobody reads its outputs (DCE keeps it).  ``copy_`` and
``all_reduce_mean`` have no gradient rule: ``copy_`` is the program's final write-back and DDP's average runs in
the traced backward, so reaching one on a gradient path raises ``NoGradientRuleError``; the sharded step's
collectives (``all_gather``, ``reduce_scatter``, ``wait``) are each other's gradients; ``item`` and ``shape``
are numbers (``"non_differentiable"``, as eager's ``item()`` is)."""
from __future__ import annotations

from ..grad_rules import register_vjp
from ..proxies import NumberProxy, TensorProxy, size_value
from .core import check, prim, prims


@prim(tags=("side_effect",))
def copy_(src, dst):
    """Write ``src`` into the buffer ``dst``; returns ``dst`` (the only mutating prim)."""
    check(src._tt_shape == dst._tt_shape, lambda: f"copy_: shapes differ: {src._tt_shape} vs {dst._tt_shape}")
    return TensorProxy(shape=dst._tt_shape, dtype=dst._tt_dtype, device=dst._tt_device)


@prim(tags=("non_differentiable",))
def shape(a):
    """The sizes of ``a`` as runtime numbers (symbolic-shape mode)."""
    return tuple(NumberProxy(value=size_value(s), python_type=int) for s in a._tt_shape)


@prim(tags=("non_differentiable",))
def item(a):
    """The Python number in a one-element tensor (``Tensor.item()``): a runtime number of the program.

    Its value does not exist while tracing (``value=None``): arithmetic with it is recorded as
    scalar prims, and any other use of the number (``if``, ``range()``, ``math.sqrt``, ...) is a
    decision checked on every call (``NumberProxy._concrete``, acquisition/decisions.py).
    """
    check(a.numel_() == 1, lambda: f"a Tensor with {a.numel_()} elements cannot be converted to Scalar")
    dt = a._tt_dtype
    return NumberProxy(value=None, python_type=float if dt.is_float else bool if dt.is_bool else complex if dt.is_complex else int)


@prim(tags=("side_effect", "fallible"))
def check_finite(a, message):
    """Raise ``RuntimeError(message)`` when ``a`` holds a NaN or an infinity (a check on values, at run time)."""
    check(type(a) is TensorProxy and isinstance(message, str), "check_finite: expected a tensor and a message")
    return None


@prim(tags=("side_effect", "fallible", "non_differentiable"))
def check_decision(value, convert, expected, index, text):
    """Raise ``DecisionMismatch(index, got)`` when ``convert(value)`` (``bool``, ``int``, ...) is not ``expected``.

    A Python decision on an intermediate value (``if loss.item() > 10:``), checked where the program computes
    the value (``acquisition/decisions.py``); ``text`` names the decision and its line.  It must come before
    every write (``"fallible"``) and stay a line of its own (a side effect: fusion keeps it a barrier)."""
    check(isinstance(convert, str) and isinstance(index, int) and isinstance(text, str),
          "check_decision: expected a conversion name, an index and a description")
    return None


@prim(tags=("side_effect",))
def all_reduce_mean(tensors):
    """The mean of each tensor over the ranks of the default process group (DDP's gradient average).

    A side effect for DCE: every rank must run the same collectives, used or not.
    """
    check(isinstance(tensors, (list, tuple)) and all(type(t) is TensorProxy and t._tt_dtype.is_float for t in tensors),
          "all_reduce_mean: expected a list of floating-point tensors")
    return [TensorProxy(shape=t._tt_shape, dtype=t._tt_dtype, device=t._tt_device) for t in tensors]


all_reduce_mean.torch_unseen_memory = True  # (as the collectives below)


# Collectives of a sharded step (FSDP2, acquisition/fsdp.py): torch's functional collectives, each split in a
# start (the result is in flight) and a ``wait``, so a scheduling pass (transforms/collectives.py) can start a
# collective early and wait for it late.  Every rank runs the same program, so DCE may drop one on all ranks
# alike: they are not side effects.  They can raise (a peer failed, a size differs): "fallible".  Their gradients are the sharded op's rule (torchlang/distributed.py).
@prim(tags=("fallible",))
def all_gather(a, group_size, group_name):
    """Start gathering ``a`` from every rank of the group, concatenated along dim 0 in rank order (in flight)."""
    check(type(a) is TensorProxy and a.ndim_ >= 1 and isinstance(group_size, int) and isinstance(group_name, str),
          "all_gather: expected a tensor of at least one dimension, a group size and a group name")
    return TensorProxy(shape=(a._tt_shape[0] * group_size,) + tuple(a._tt_shape[1:]), dtype=a._tt_dtype,
                       device=a._tt_device)


REDUCE_OPS = ("sum", "avg")


@prim(tags=("fallible",))
def reduce_scatter(a, op, group_size, group_name):
    """Start reducing ``a`` over the ranks (``op``: "sum" or "avg") and keeping this rank's part of dim 0 (in flight)."""
    check(type(a) is TensorProxy and a.ndim_ >= 1 and op in REDUCE_OPS and isinstance(group_size, int)
          and isinstance(group_name, str) and a._tt_shape[0] % group_size == 0,
          lambda: f"reduce_scatter: expected a tensor whose dim 0 divides into {group_size}, op in {REDUCE_OPS}")
    return TensorProxy(shape=(a._tt_shape[0] // group_size,) + tuple(a._tt_shape[1:]), dtype=a._tt_dtype,
                       device=a._tt_device)


# A collective's backend allocates its buffers on its own threads, unseen by the kept buffers' plan (with room, an
# FSDP2 step on gloo peaked above eager FSDP2's; executors/buffers.py ``_room``).
all_gather.torch_unseen_memory = reduce_scatter.torch_unseen_memory = True


@prim
def wait(a, source):
    """The result ``a`` of a collective started earlier on ``source`` (``all_gather``/``reduce_scatter``), once it
    has arrived.  ``source`` is read here so that no pass frees or reuses its memory while the collective runs
    (transforms/collectives.py moves waits down to their first use)."""
    check(type(a) is TensorProxy and type(source) is TensorProxy, "wait: expected the collective's result and input")
    return TensorProxy(shape=a._tt_shape, dtype=a._tt_dtype, device=a._tt_device)


@register_vjp(all_gather)
def _all_gather_vjp(g, out, /, a, group_size, group_name):
    return {"a": prims.wait(prims.reduce_scatter(g, "sum", group_size, group_name), g)}


@register_vjp(reduce_scatter)
def _reduce_scatter_vjp(g, out, /, a, op, group_size, group_name):
    full = prims.wait(prims.all_gather(g, group_size, group_name), g)
    return {"a": full if op == "sum" else prims.div(full, float(group_size))}


@register_vjp(wait)
def _wait_vjp(g, out, /, a, source):
    return {"a": g}
