"""Eager's version-counter check on values autograd saved for the backward.

Eager autograd records, for every tensor an op saves for its backward, the version of the tensor's version
counter; a backward that finds the counter moved raises "one of the variables needed for gradient computation
has been modified by an inplace operation".  A base, its views and its ``.detach()`` share one counter; ``.data``
starts a counter of its own (writes through it are not seen by the base's, and the other way round).

The functional trace keeps old values, so it would compute where eager raises.  This module models the check:

* every in-place write (``inplace.write``) records which values it made stale: the written tensor's counter
  group (``functional.Buffers.counter_group``) and the values that group held, with the trace length when the
  in-place op began (lines recorded later read the new values, and the op's own line saves what it needs);
* the line making an in-place op's new value is asked as the in-place call (``_inplace_slots``): ``leaky_relu_``
  saves its result where the ``leaky_relu`` its line records saves its input;
* an in-place op that saves for its own backward an argument sharing its target's counter (``y.mul_(y)``) records
  its own lines (``own_saved_input``, asked of torch's in-place op on meta tensors);
* a traced backward (``traced_autograd.record_backward``) with stale values on record asks, only for the lines on
  the path to its outputs that read or produced a stale value before it went stale, what torch itself saves for
  that op: the op runs once on meta tensors under ``torch.autograd.graph.saved_tensors_hooks`` (cached per op and
  argument signature).  A stale value among them raises eager's error, naming the op and what to do.
* a saved value whose memory changed through ``.data`` (its counter unmoved) is what eager's backward reads then:
  the line runs with torch's autograd and its backward is given that memory's value
  (``opaque_grad.with_saved_from_memory``).  At a later backward that line is asked again as the line it replaced:
  a counter moved since raises, and a ``.data`` write since is followed (``follow``: each backward reads the memory
  as it is when that backward runs).

An op without a meta kernel (``ctc_loss``) whose tensors are on the CPU is asked on small real CPU tensors instead.
An op whose torch form is unknown here (a prim without a torch function of its name, or one that runs neither way)
is not checked: no error is ever raised where eager would not raise.
"""
from __future__ import annotations

import dataclasses

import torch

from ..proxies import NumberProxy, TensorProxy, size_value
from ..pytree import tree_flatten
from ..generators_kept import generators_untouched


@dataclasses.dataclass
class StaleValues:
    ids: frozenset  # ids of the values the write made stale (their version counter moved)
    shared: frozenset  # ids of values whose memory it changed without moving their counter (``.data``)
    before: int  # lines with a smaller index read them before the write
    op: str  # the in-place op
    target: str  # the tensor written
    keep: tuple = ()  # the values themselves: their ids stay theirs while tracing
    holders: dict = dataclasses.field(default_factory=dict)  # id(value in ``shared``) -> a tensor holding it then
    inputs_only: bool = False  # ``t.data = v``: only ops that saved t as an input see its new memory


@dataclasses.dataclass
class StaleOwnInput:
    """An in-place op saved for its own backward an argument sharing the written tensor's version counter
    (``y.mul_(y)``: ``mul_`` saves ``other``, which its own write then moves): its lines are ``[start, end)``."""
    start: int
    end: int
    op: str
    target: str
    position: int  # which tensor argument


def record_write(st, dst, op_name) -> None:
    """``dst`` is about to be written in place by ``op_name`` (before ``Buffers.write``)."""
    buffers = st.buffers
    counter = buffers.counter_of(dst)
    # what the counter's tensors hold, and what they held before a write through .data that left it unmoved
    stale = buffers.counter_values(dst) + st.unmoved.pop(id(counter), [])
    held = buffers.memory_buffers(dst)
    ids = frozenset(map(id, stale))
    shared = frozenset(id(v) for _, v in held) - ids
    for t, v in held:
        if id(v) in shared:
            st.unmoved.setdefault(id(buffers.counter_of(t)), []).append(v)
    start = st.inplace_start
    before = len(st.trace.bound_symbols) if start is None else start
    st.stale_values.append(StaleValues(ids, shared, before, op_name, getattr(dst, "_tt_name", "a tensor"),
                                       tuple(v for _, v in held) + tuple(stale), {id(v): t for t, v in held if id(v) in shared}))


def record_data_assignment(st, t, old) -> None:
    """``t.data = v``, ``t`` holding ``old``: eager's ops that saved ``t`` as an input save the tensor itself, whose
    memory is now ``v``'s, and read it at the backward; those that saved it as their output keep the old memory."""
    st.stale_values.append(StaleValues(frozenset(), frozenset([id(old)]), len(st.trace.bound_symbols), "t.data = v",
                                       getattr(t, "_tt_name", "a tensor"), (old,), {id(old): t}, inputs_only=True))
    # t keeps its version counter: what saved the old value goes stale at its next move
    st.unmoved.setdefault(id(st.buffers.counter_of(t)), []).append(old)


def own_saved_input(st, fn, dst, args, kwargs, requires_grad):
    """Before the in-place op ``fn`` writes ``dst`` (``args``: current values): the position of a tensor argument after the
    first that shares its version counter and that torch's ``fn`` saves for its backward, or None.
    ``requires_grad(value)``: eager's flag of a value (``traced_autograd.computed_requires_grad`` for computed ones)."""
    if fn is None or not torch.is_grad_enabled():
        return None
    try:
        flat, spec = tree_flatten((args, kwargs))
    except Exception:  # noqa: BLE001 - arguments the pytree does not take: not checked
        return None
    tensors = [a for a in flat if type(a) is TensorProxy]
    if len(tensors) < 2 or type(dst) is not TensorProxy:
        return None
    group = {id(v) for v in st.buffers.counter_values(dst)} | {id(st.buffers.read(dst))}
    shared = [k for k, a in enumerate(tensors) if k and id(a) in group]
    if not shared:
        return None
    needs = {id(a) for a in tensors if a._tt_dtype.is_float and requires_grad(a)}
    if not needs:
        return None
    found = _saved_positions(fn, flat, spec, needs, inplace=True)
    if found is None:
        return None
    return next((k for k in shared if k in found[0]), None)


def check_saved(st, lines, needs_grad, outputs, follow_memory=None) -> bool:
    """Raise eager's error when a line the backward of ``outputs`` goes through saved a value written since.

    A saved value whose memory was written through ``.data`` (its counter unmoved): eager's backward reads the memory
    as it is then.  ``follow_memory(tensor)`` gives the value that tensor holds when the backward runs (None: not
    known); that line of ``lines`` is then replaced by torch's own op whose backward is given that value
    (``opaque_grad.with_saved_from_memory``), and True is returned (the caller finds the gradient path again).
    Where it is not known, ``NotImplementedError``."""
    own = [e for e in st.stale_values if type(e) is StaleOwnInput]
    if own:
        on_path = _on_path(lines, needs_grad, outputs)
        for e in own:
            if any(i in on_path for i in range(e.start, min(e.end, len(lines)))):
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"tensor argument {e.position} of {e.op}, which autograd saved for the backward, shares the version "
                    f"counter of {e.target}, which {e.op} itself writes (eager raises the same error at this backward). "
                    f"Pass a copy (e.g. {e.op}(y.clone()) for y.{e.op}(y)) or use the out-of-place form (y = y * y).")
    events = [e for e in st.stale_values if type(e) is StaleValues]
    if not events:
        return False
    horizon = max(e.before for e in events)
    by_id: dict = {}
    for e in events:
        for k in e.ids | e.shared:
            by_id.setdefault(k, []).append(e)
    candidates = []
    for i, b in enumerate(lines[:horizon]):
        ids = {id(a) for a in b.flat_args() if type(a) is TensorProxy} | {id(o) for o in b.flat_outputs()}
        touched = [e for k in ids & by_id.keys() for e in by_id[k] if i < e.before]
        if touched and any(type(o) is TensorProxy and id(o) in needs_grad for o in b.flat_outputs()):
            candidates.append((i, b, touched))
    if not candidates:
        return False
    on_path = _on_path(lines, needs_grad, outputs)
    rewrites = []
    for i, b, touched in candidates:
        if i not in on_path:
            continue
        # a line replaced at an earlier backward (it follows memory): asked as the line it replaced
        orig = getattr(b.sym, "original", b)
        slots = _saved_slots(orig, needs_grad, st.inplace_calls)
        if slots is None:
            continue
        saved = [v for _, v, _ in slots]
        from_memory = {}  # tag -> the tensor whose value the backward reads
        for e in touched:
            hit = next((v for v in saved if id(v) in e.ids), None)
            if hit is not None:
                raise RuntimeError(
                    f"one of the variables needed for gradient computation has been modified by an inplace operation: "
                    f"{_which(b, hit)} of {b.sym.name} ({hit.type_string()}), which autograd saved for the backward, "
                    f"was changed afterwards by {e.op} on {e.target} (eager raises the same error at this backward). "
                    "Write into a copy instead (e.g. y = y.clone() before the in-place op), or make the in-place "
                    "change before the op that reads the value.")
            for tag, v, itself in slots:
                # ``t.data = v``: a saved view of t (or t as an output) keeps t's old memory, t itself reads the new
                if id(v) in e.shared and tag not in from_memory and not (e.inputs_only and not itself):
                    now = follow_memory(e.holders[id(v)]) if follow_memory else None
                    if now is None:
                        raise NotImplementedError(
                            f"{_which(b, v)} of {b.sym.name} ({v.type_string()}), which autograd saved for the backward, "
                            f"shares memory with {e.target}, written afterwards by {e.op} through .data (or the tensor "
                            ".data was taken from): eager's backward then uses the new values, which the compiled "
                            "program cannot follow here (it does not know what that memory holds when the backward runs). Write into a copy (y = y.clone()), or make the change "
                            "before the op.")
                    from_memory[tag] = now
        if from_memory and orig is not b:
            b.sym.follow(from_memory)  # this backward reads what the memory holds now (a .data write since the last)
        elif from_memory:
            rewrites.append((i, b, slots, from_memory))
    for i, b, slots, from_memory in rewrites:
        from ..transforms.opaque_grad import with_saved_from_memory
        flat = tree_flatten((b.args, b.kwargs))[0]
        positions = tuple(k for k, a in enumerate(flat) if type(a) is TensorProxy and a._tt_dtype.is_float
                          and id(a) in needs_grad)
        # every saved tensor can be given another value at a later backward; the unchanged ones their own
        tags = tuple(tag for tag, _, _ in slots)
        lines[i] = with_saved_from_memory(b, torch_form(b), positions, tags, [from_memory.get(t, v) for t, v, _ in slots])
    return bool(rewrites)


def lines_rewritten(st, starts, new_n) -> None:
    """A traced backward replaced the forward's lines (composites expanded): line ``i`` of the old ``len(starts)`` now
    begins at ``starts[i]``, and there are ``new_n``.  The positions on record move with them."""
    n = len(starts)

    def at(i):
        return starts[i] if i < n else i - n + new_n

    for e in st.stale_values:
        if type(e) is StaleValues:
            e.before = at(e.before)
        else:
            e.start, e.end = at(e.start), at(e.end)


def errors_for_outside_backward(st, trc, grad_leaves, returned=()) -> dict:
    """For a function whose gradients PyTorch's backward asks for later (``tt.compile(model)``): the error eager's
    backward through each output would raise, by output name (outputs whose backward runs are absent).  The compiled
    region is one autograd node: it raises when a gradient reaches one of these outputs (``autograd_function.py``).
    ``grad_leaves``: the values standing for the tensors that require grad (``traced_autograd.grad_leaves``);
    ``returned``: (user-visible tensor, output value) pairs.  A saved value written through ``.data`` is followed to
    the value its memory holds at the end (an input's written-back value, a returned tensor, or an intermediate's last
    value)."""
    if not st.stale_values:
        return {}
    from ..pytree import tree_flatten as flatten
    from ..transforms.autograd import Forward, is_float_tensor
    lines = trc.bound_symbols  # lines that read memory written through .data are replaced (check_saved)
    needs = Forward(list(lines), grad_leaves).needs_grad
    flat_out = flatten(trc.output)[0]
    outs = {id(o): o for o in flat_out if type(o) is TensorProxy and is_float_tensor(o) and id(o) in needs}
    errors = {}
    for o in outs.values():
        try:
            check_saved(st, lines, needs, [o], follow_memory=lambda t: _value_at_the_end(st, trc, t, returned))
        except (RuntimeError, NotImplementedError) as e:
            errors[o.name] = e
    return errors


def _value_at_the_end(st, trc, t, returned):
    """The value tensor ``t`` holds when the function has returned: what its write-back copies into an input, a
    returned tensor, or else the value an unreturned intermediate holds at the end of the forward (the line that
    saved it reads that value in its backward, so the forward keeps it for PyTorch's backward as any residual).
    ``returned``: (user object, value) pairs."""
    if st.walker.is_input(t):
        src = next((b.args[0] for b in reversed(trc.bound_symbols) if b.sym.name == "copy_" and len(b.args) == 2
                    and b.args[1] is t), None)
        return t if src is None and not st.buffers.is_written(t) else src
    found = next((v for u, v in returned if u is t), None)
    return found if found is not None else st.buffers.read(t)


def _on_path(lines, needs_grad, outputs) -> set:
    """Indices of the lines a backward from ``outputs`` goes through (they reach an output and require grad)."""
    wanted = {id(o) for o in outputs if type(o) is TensorProxy}
    out = set()
    for i in range(len(lines) - 1, -1, -1):
        b = lines[i]
        if any(id(o) in wanted for o in b.flat_outputs()) and any(id(o) in needs_grad for o in b.flat_outputs()):
            out.add(i)
            wanted.update(id(a) for a in b.flat_args() if type(a) is TensorProxy and id(a) in needs_grad)
    return out


def _which(b, v) -> str:
    args = [a for a in b.flat_args() if type(a) is TensorProxy]
    for k, a in enumerate(args):
        if a is v:
            return f"input {k}"
    return "the output"


# ---- what torch saves, asked on meta tensors ----
_saved_cache: dict = {}


def torch_form(b):
    # the callable the user called (F.softmax takes _stacklevel, torch.softmax does not), else the symbol's
    fn = getattr(b, "torch_fn", None) or getattr(b.sym, "torch_impl", None)
    if fn is None and b.sym.is_prim:
        fn = getattr(torch, b.sym.name, None)
    return fn if callable(fn) else None


def _saved_slots(b, needs_grad, inplace_calls=None):
    """``(("in", flat argument index) or ("out", flat tensor output index), proxy, saved as the argument itself)`` of
    what torch saves for ``b`` (an argument saved through a view of it, as ``linear`` saves ``weight.t()``, is not
    itself); None when it cannot be asked (no torch form, or it runs neither on meta nor on CPU tensors).  A line
    making the new value of an in-place call (``inplace_calls``, acquisition state) is asked as that call."""
    flat_out = [o for o in b.flat_outputs() if type(o) is TensorProxy]
    for o in flat_out if inplace_calls else ():
        call = inplace_calls.get(id(o))
        if call is not None and call[3] is o:
            return _inplace_slots(b, call, flat_out, needs_grad)
    fn = torch_form(b)
    if fn is None:
        return None
    try:
        flat, spec = tree_flatten((b.args, b.kwargs))
    except Exception:  # noqa: BLE001 - arguments the pytree does not take: not checked
        return None
    found = _saved_positions(fn, flat, spec, needs_grad)
    if found is None:
        return None
    at = [k for k, a in enumerate(flat) if type(a) is TensorProxy]
    ins, outs, itself = found
    return ([(("in", at[k]), flat[at[k]], k in itself) for k in ins]
            + [(("out", k), flat_out[k], False) for k in outs if k < len(flat_out)])


def _inplace_slots(b, call, flat_out, needs_grad):
    """``_saved_slots`` of the line making the new value of the in-place call ``(fn, args, kwargs, new)``.  The call
    writes its first argument and returns it, so what it saves of either is its result: the line's new value.  Its
    other saved arguments count where the line reads them too."""
    fn, args, kwargs, new = call
    try:
        flat, spec = tree_flatten((args, kwargs))
    except Exception:  # noqa: BLE001 - arguments the pytree does not take: not checked
        return None
    found = _saved_positions(fn, flat, spec, needs_grad, inplace=True)
    if found is None:
        return None
    ins, outs, itself = found
    tensors = [a for a in flat if type(a) is TensorProxy]
    line_flat = tree_flatten((b.args, b.kwargs))[0]
    slots = [(("out", k), o, False) for k, o in enumerate(flat_out) if o is new] if 0 in ins or 0 in outs else []
    for k in ins:
        j = next((j for j, a in enumerate(line_flat) if a is tensors[k]), None) if k else None
        if j is not None:
            slots.append((("in", j), tensors[k], k in itself))
    return slots


def probe_signature(flat, needs_grad):
    """The probe's description of a line's flattened arguments (sizes, strides, dtype, requires_grad and device of
    each tensor; plain values as they are), or None where an argument cannot be described."""
    sig = []
    for a in flat:
        if type(a) is TensorProxy:
            rg = a._tt_dtype.is_float and id(a) in needs_grad
            sig.append((tuple(map(size_value, a._tt_shape)), tuple(map(size_value, a._tt_strides)), a._tt_dtype.torch, rg,
                        a._tt_device.type))
        elif isinstance(a, NumberProxy):  # its example value: no size check (hashing a proxy would decide on it)
            sig.append(size_value(a))
        elif a is None or isinstance(a, (bool, int, float, str)):
            sig.append(a)
        elif hasattr(a, "torch") and not callable(a):  # a compiler dtype
            sig.append(("dtype", a.torch))
        elif a is Ellipsis:
            sig.append(("ellipsis",))
        elif type(a) is slice and all(x is None or type(x) is int for x in (a.start, a.stop, a.step)):
            sig.append(("slice", a.start, a.stop, a.step))
        elif isinstance(a, torch.dtype):
            sig.append(("dtype", a))
        else:
            return None
    return tuple(sig)


def _saved_positions(fn, flat, spec, needs_grad, inplace=False):
    """(tensor-argument positions, output positions) that torch's ``fn`` saves, asked on meta tensors and cached per
    op and argument signature; None when it cannot be asked.  ``inplace``: ``fn`` writes its first argument, which
    is then a non-leaf (an in-place op on a leaf that requires grad is an error)."""
    sig = probe_signature(flat, needs_grad)
    if sig is None:
        return None
    key = (fn, repr(spec), sig, inplace)
    found = _saved_cache.get(key, ...)
    if found is ...:
        found = _saved_cache[key] = _ask_torch(fn, spec, sig, inplace)
    return found


def _ask_torch(fn, spec, sig, inplace=False):
    """What ``fn`` saves, asked on meta tensors; for an op without a meta kernel (``ctc_loss``) whose tensors are all
    on the CPU, on small real CPU tensors of the same sizes, strides and dtypes (what an op saves does not depend
    on the values; a call that fails or would be large is not asked).  None when neither can be asked."""
    with generators_untouched():  # torch's meta kernels of collectives draw from Python's random
        found = _ask_on(fn, spec, sig, inplace, "meta")
    if found is None and all(s[4] == "cpu" for s in sig if _is_tensor_sig(s)):
        numel = sum(_extent(s[0], s[1]) for s in sig if _is_tensor_sig(s))
        if numel <= _REAL_PROBE_LIMIT:
            with generators_untouched():
                found = _ask_on(fn, spec, sig, inplace, "cpu")
    return found


_REAL_PROBE_LIMIT = 1 << 20  # elements, all tensors together: the real probe allocates them


def _is_tensor_sig(s) -> bool:
    return type(s) is tuple and len(s) == 5 and isinstance(s[2], torch.dtype)


def _extent(shape, strides) -> int:
    """Elements of memory a tensor of these sizes and strides spans."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * abs(st) for n, st in zip(shape, strides))


def _probe_tensor(s, device):
    shape, strides, dtype, rg, _ = s
    t = torch.empty_strided(shape, strides, dtype=dtype, device=device)
    if device != "meta":
        with torch.no_grad():
            t.fill_(True if dtype is torch.bool else 1 if not (dtype.is_floating_point or dtype.is_complex) else 0.5)
    return t.requires_grad_(rg)


def probe_args(spec, sig, inplace, device):
    """``(tensors, args, kwargs)`` of a probe call on ``device`` made from ``sig`` (``_signature``)."""
    from ..pytree import tree_unflatten

    metas, flat = [], []
    for s in sig:
        if _is_tensor_sig(s):
            m = _probe_tensor(s, device)
            if inplace and not metas and s[3]:
                m = m.clone()  # written in place: not a leaf
            metas.append(m)
            flat.append(m)
        elif type(s) is tuple and s and s[0] == "dtype":
            flat.append(s[1])
        elif type(s) is tuple and s and s[0] == "ellipsis":
            flat.append(Ellipsis)
        elif type(s) is tuple and s and s[0] == "slice":
            flat.append(slice(*s[1:]))
        else:
            flat.append(s)
    args, kwargs = tree_unflatten(flat, spec)
    return metas, args, kwargs


def _ask_on(fn, spec, sig, inplace, device):
    """``(tensor-argument positions saved, output positions saved, tensor-argument positions saved as the argument
    itself rather than a view of it)`` of ``fn`` run on tensors of ``sig`` on ``device``; None when it fails."""
    try:
        metas, args, kwargs = probe_args(spec, sig, inplace, device)
        packed = []
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            out = fn(*args, **kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    except Exception:  # noqa: BLE001 - not runnable here: not checked
        return None
    ins_saved, outs_saved, ins_itself = set(), set(), set()
    for t in packed:
        for k, m in enumerate(metas):
            if t is m:
                ins_itself.add(k)
            if t is m or torch._C._is_alias_of(t, m):
                ins_saved.add(k)
        for k, o in enumerate(outs):
            if t is o or torch._C._is_alias_of(t, o):
                outs_saved.add(k)
    return tuple(sorted(ins_saved)), tuple(sorted(outs_saved)), tuple(sorted(ins_itself))
