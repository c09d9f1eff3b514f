"""``p.data = v`` inside a compiled function, ``p`` an input (a parameter, a buffer, an optimizer-state tensor, an
argument): weight clipping written ``p.data = p.data.clamp(-c, c)``, a re-initialisation, an EMA update.

Eager points ``p`` at ``v``'s memory and keeps everything else of ``p``: its identity, ``requires_grad``, ``.grad``,
its version counter (which does not move).  Modelled here as:

* ``p`` holds ``v``'s values from now on, without ``v``'s history; a gradient through ops after it reaches ``p``
  as before (the new value stands for the leaf, ``leaf_values.py``), and the write-back copies ``p``'s final value
  into the caller's tensor, so its storage object stays (thin mode's binding holds);
* the views of ``p`` made before keep the old memory (``Buffers.pin_views``); an in-place write to one afterwards
  is refused (``check_old_memory_write``): the other old views would see it, which is not followed;
* ``v`` shares ``p``'s memory afterwards: when ``v`` is a fresh value (no view, no views of it, no gradient
  history) it becomes a view of ``p`` with a version counter of its own, so writes through either show in both,
  as in eager; otherwise an in-place write to ``v`` afterwards, or to ``p`` with ``v``'s memory read after it, is
  refused (``check_input_data_shares``);
* what autograd saved before: an op that saved ``p`` itself reads the new memory at a backward, one that saved a
  view of it (``linear``'s ``weight.t()``) the old one, and both go stale at ``p``'s next in-place write
  (``saved_versions.record_data_assignment``).

Another shape, dtype or layout, ``p`` not requiring grad (a buffer, optimizer state, an argument): ``p`` names the
new value from then on and the epilogue points the caller's tensor at the program's result (``p.data = result``),
so it ends with eager's metadata (``_assign_other_metadata``).  Refused, with what to do: that for a tensor that
requires grad, was updated in place before, or was read by an op autograd recorded; another device; a ``v``
sharing memory with another input (two inputs would share memory).
"""
from __future__ import annotations

import dataclasses

from .. import prims
from ..errors import TracingError
from ..proxies import TensorProxy
from .saved_versions import record_data_assignment


def _identity(x):
    return x


def assign_input_data(st, t, v, requires_grad):
    """``t.data = v``, ``t`` an input that is no view (``requires_grad(value)``: eager's flag of a computed value)."""
    buffers = st.buffers
    value = buffers.read(v)
    if value._tt_device != t._tt_device:
        _refuse_other_metadata(t, value, "it moves the tensor to another device")
    vbase = buffers.base_of(v)
    vbase = v if vbase is None else vbase
    if st.walker.leaf_of(vbase) is not None:
        if vbase is t and (v is t or value is buffers.read(t) or _whole_view(st, v, t)):
            return  # p.data = p.data, p.data = p.detach(), p.data -= d: p keeps its memory
        raise TracingError(
            f"{t._tt_name}.data = v inside the compiled function, v sharing memory with an input of the function "
            f"({vbase._tt_name}), is not supported: the two inputs would share memory afterwards. Assign a copy "
            "(t.data = v.clone()), or make the inputs share memory between calls.")
    if ((value._tt_shape, value._tt_dtype, value._tt_strides) != (t._tt_shape, t._tt_dtype, t._tt_strides)
            or id(t) in st.metadata_inputs):
        return _assign_other_metadata(st, t, v, value, requires_grad)
    old = buffers.read(t)
    record_data_assignment(st, t, old)
    for view in buffers.pin_views(t):
        st.old_memory_views[id(view)] = view
    st.data_assignments[:] = [a for a in st.data_assignments if a[0] is not t]
    buffers.write(t, prims.stop_gradient(value))
    if st.leaf_values is not None:
        st.leaf_values.written(t)
    st.input_data_shares[:] = [a for a in st.input_data_shares if a.t is not t]
    if v is vbase and not buffers.has_views(v) and not requires_grad(value) and type(v) is TensorProxy:
        buffers.add_view(v, t, _identity, _identity, steps=())  # v's memory is t's now, with its own counter (as t.data's)
        buffers.own_counter(v)
    else:
        st.input_data_shares.append(_Shared(t, v, buffers.version(t), buffers.version(v), len(st.trace.bound_symbols),
                                            frozenset(map(id, buffers.memory_values(v)))))


def _whole_view(st, v, t) -> bool:
    """``v`` (a view of the input ``t``) covers ``t``'s memory exactly as ``t`` does: ``p.data``, ``p.detach()``,
    also after writes through it (``p.data -= lr * p.grad`` assigns ``p.data`` back to ``p``)."""
    meta = lambda x: (x._tt_shape, x._tt_strides, x._tt_storage_offset, x._tt_dtype)  # noqa: E731
    return id(t) not in st.metadata_inputs and type(v) is TensorProxy and meta(v) == meta(t)


def _refuse_other_metadata(t, value, why):
    raise TracingError(
        f"{t._tt_name}.data = v inside the compiled function with another shape, dtype, device or layout "
        f"({value.type_string()} for {t.type_string()}) is not supported here: {why}. Make that assignment between "
        "calls (the guards see the new metadata and compile for it), or keep the metadata "
        "(t.data = v.reshape(t.shape).to(t.dtype).contiguous()).")


def _assign_other_metadata(st, t, v, value, requires_grad):
    """``t.data = v`` with another shape, dtype or layout, ``t`` an input that does not require grad (a buffer,
    optimizer state, an argument): ``t`` names the new value from here on (its shape and strides are read from it),
    and the epilogue points the caller's tensor at the program's result, as eager's assignment does."""
    buffers = st.buffers
    if t._tt_requires_grad:
        _refuse_other_metadata(t, value, "the tensor requires grad (its gradient keeps the old metadata)")
    if buffers.is_written(t) and id(t) not in st.metadata_inputs:
        _refuse_other_metadata(t, value, "the tensor was updated in place before, in its old memory")
    if any(any(a is t for a in b.flat_args()) and any(type(o) is TensorProxy and requires_grad(o) for o in b.flat_outputs())
           for b in st.trace.bound_symbols):
        _refuse_other_metadata(t, value, "autograd recorded an op that read the tensor before")
    for view in buffers.pin_views(t):
        st.old_memory_views[id(view)] = view
    new = prims.stop_gradient(value)
    buffers.rebind(t, new)
    st.metadata_inputs[id(t)] = t  # updating it in place afterwards is refused (metadata_inplace.check_data_write)
    st.metadata_replays[:] = [r for r in st.metadata_replays if not (r[0] is t and r[1][0] == "data=")]
    st.metadata_replays.append((t, ("data=", (new,), {})))
    st.input_data_shares[:] = [a for a in st.input_data_shares if a.t is not t]
    st.input_data_shares.append(_Shared(t, v, buffers.version(t), buffers.version(v), len(st.trace.bound_symbols),
                                        frozenset(map(id, buffers.memory_values(v)))))


@dataclasses.dataclass
class _Shared:
    """``t.data = v`` where ``v`` does not follow ``t`` (a view, viewed, or with a gradient history): ``v``'s memory
    as it was (``values``) is stale once ``t`` is written, and ``t`` is stale once ``v`` is."""
    t: TensorProxy
    v: TensorProxy
    t_version: int
    v_version: int
    after: int  # lines from here on were recorded after the assignment
    values: frozenset  # ids of the values v's memory held


def check_input_data_shares(st, output) -> None:
    """At the end of tracing: refuse where ``t.data = v`` (``v`` not following ``t``) then an in-place write to
    ``v``, or to ``t`` with ``v``'s memory read afterwards (a later line or the function's result), would differ."""
    from ..pytree import tree_flatten

    buffers = st.buffers
    for a in st.input_data_shares:
        if buffers.version(a.v) != a.v_version:
            side = "v"
        elif buffers.version(a.t) != a.t_version:
            read = any(id(x) in a.values for b in st.trace.bound_symbols[a.after:] for x in b.flat_args())
            if not read and not any(id(x) in a.values for x in tree_flatten(output)[0]):
                continue
            side = "t"
        else:
            continue
        raise TracingError(
            f"after {a.t._tt_name}.data = v inside the compiled function, {side} was written in place and v is read "
            "afterwards (or returned): eager's t and v share memory, which the compiled program does not follow when v "
            "is a view, has views or carries a gradient history. Assign a fresh tensor without history (t.data = "
            "v.detach().clone()), or write t itself in place (t.copy_(v) under no_grad).")


def check_old_memory_write(st, dst):
    """An in-place write to a view of an input made before ``input.data = v`` (it holds the old memory)."""
    old = st.old_memory_views
    if not old:
        return
    base = st.buffers.base_of(dst)
    if id(dst) in old or (base is not None and id(base) in old):
        raise TracingError(
            "an in-place write to a view of an input made before that input's .data was assigned inside the compiled "
            "function: eager writes the old memory, which the compiled program does not follow. Take the view after "
            "the assignment, or write a copy.")
