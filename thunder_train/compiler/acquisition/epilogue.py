"""The end of acquisition: write-backs, returned values and the epilogue.

Three kinds of effect outlive a traced call:

1. **Buffer updates** (``p.add_(...)``, BatchNorm running stats, optimizer state,
   ``.grad += g``): exactly one ``prims.copy_(new_value, input)`` per input
   whose value changed, at the end of the computation (``functional.py``).
2. **Returned values** keep eager semantics: a returned input buffer (the result
   of ``x.add_(1)``) is the input object itself; a view of an input the program
   writes (``x[0]`` after ``x.add_(1)``, ``v`` after ``p.data = v``) is rebuilt on
   the input's memory by the epilogue (``output_aliases.py``); any other returned
   tensor is a fresh value.
3. **Python side effects** the computation cannot perform — a new ``.grad``
   tensor, ``p.grad = None``, new ``optimizer.state`` entries — are replayed by
   the **epilogue**, generated Python that runs after the computation with the
   values it returned (``print(entry.epilogue)`` on a cache entry shows it).
"""
from __future__ import annotations

import re

import itertools
import linecache

import torch

from .. import prims
from . import fsdp, output_aliases, returned_graph
from ..proxies import TensorProxy, is_proxy
from ..memory_overlap import overlapping_pairs
from ..pytree import tree_map

_counter = itertools.count()


class Epilogue:
    """``epilogue(extras)``: assigns what the computation returned to Python objects; returns None, or a dict of
    results to replace (flat index -> the real tensor: ``output_aliases.py``)."""

    def __init__(self, lines: list, globals_: dict, targets: dict | None = None, returns: list = ()):
        # Globals naming an input of the call (a parameter whose .grad is set, the key of an optimizer-state
        # entry): name -> its Leaf. The caller rebinds them to this call's objects before every run
        # (compiler/pipeline.py), so a later call with other tensor objects writes to those, never to the
        # objects of the traced call.
        self.targets = dict(targets or {})
        self.returns = bool(returns)
        lines = list(lines) + ([f"  return {{{', '.join(f'{i}: {e}' for i, e in returns)}}}"] if returns else [])
        self.source = "\n".join(["# Epilogue: Python side effects of the traced call, replayed after the computation",
                                 "def epilogue(extras):"] + (lines or ["  pass"])) + "\n"
        filename = f"<thunder_train epilogue {next(_counter)}>"
        linecache.cache[filename] = (len(self.source), None, self.source.splitlines(True), filename)
        ns = dict(globals_)
        exec(compile(self.source, filename, "exec"), ns)
        self.fn = ns["epilogue"]
        self.globals = ns

    def __str__(self):
        return self.source

    __repr__ = __str__


class _Names:
    """Globals of the epilogue source: real objects named by where they came from."""

    def __init__(self):
        self.globals: dict = {}
        self._by_id: dict = {}
        self.targets: dict = {}  # name -> Leaf, for objects that are inputs of the call

    def __call__(self, obj, hint: str, leaf=None) -> str:
        name = self._by_id.get(id(obj))
        if name is not None and leaf is not None:
            self.targets.setdefault(name, leaf)
        if name is None:
            base = "".join(c if c.isalnum() or c == "_" else "_" for c in hint) or "obj"
            name, i = base, 1
            while name in self.globals:
                name, i = f"{base}_{i}", i + 1
            self.globals[name] = obj
            self._by_id[id(obj)] = name
            if leaf is not None:
                self.targets[name] = leaf
        return name


def _reject_aliased_inputs(walker, written):
    """Two inputs that share memory, one of them updated: the functional program would read stale values.
    (Slices of one storage that touch disjoint bytes are independent: memory_overlap.py.)"""
    if not written:
        return
    # A sparse input (an opaque value, sparse.py) is never updated in place and has no strided storage to compare.
    leaves = [leaf for leaf in walker.leaves if leaf.kind == "tensor" and leaf.alias_of is None
              and leaf.value.layout == torch.strided]
    dsts = [walker.leaf_of(dst) for dst in written]
    pairs = overlapping_pairs([leaf.value for leaf in dsts], [leaf.value for leaf in leaves])
    if pairs:
        leaf, other = dsts[pairs[0][0]], leaves[pairs[0][1]]
        raise NotImplementedError(
            f"{leaf.where} is updated in place and shares its storage with the input {other.where} "
            "(one is a view of the other). thunder_train cannot compile in-place updates of inputs that alias "
            "each other; pass separate tensors (e.g. .clone() one of them) or update through a single input."
        )


def finish(st, out, python_effects=None):
    """Emit the write-backs; return ``(trace output, Epilogue or None)`` (``st``: the TracerState).

    ``python_effects(names, extra)``: more epilogue lines (containers and objects the function changed).
    """
    buffers, walker, trc = st.buffers, st.walker, st.trace

    def final_value(p):
        if type(p) is not TensorProxy:
            return p
        return p if walker.is_input(p) else buffers.read(p)

    extras: list = []
    lines: list = []
    names = _Names()

    def extra(value) -> str:
        if value is None or not is_proxy(value):
            return repr(value) if value is None or type(value) in (int, float, bool, str) else names(value, "value")
        extras.append(final_value(value))
        return f"extras[{len(extras) - 1}]"

    def sharded(value: str, leaf) -> str:
        """A shard the program computed, as a DTensor like ``leaf``'s (FSDP2: fsdp.py); other values unchanged."""
        if leaf is None or leaf.kind != "dtensor" or value == "None":
            return value
        return f"{names(fsdp.as_sharded_like, 'as_sharded_like')}({value}, {names(leaf.value, 'dtensor', leaf)})"

    # .grad of parameters: new tensors, None.
    for p, g in st.grads.changes():
        leaf = walker.target_leaf(p)
        if leaf is None:
            continue  # a tensor created inside the function
        target = names(leaf.value, p._tt_name, leaf)
        lines.append(f"  {target}.grad = {sharded(extra(g), leaf)}")
    # requires_grad flags of inputs the function changed and did not restore.
    for p, before in st.requires_grad_changes.values():
        leaf = walker.leaf_of(p)
        if leaf is not None and p._tt_requires_grad != before:
            lines.append(f"  {names(leaf.value, p._tt_name, leaf)}.requires_grad_({p._tt_requires_grad})")
    # Optimizer state: new entries and replaced values.
    for traced in walker.optimizers:
        opt = names(traced.opt, "optimizer")
        for proxy, entry in traced.state.items():
            real = traced.real_param.get(id(proxy))
            if real is None:
                continue
            pleaf = walker.target_leaf(proxy)
            param = names(real, getattr(proxy, "_tt_name", "param"), pleaf)

            def value(v):  # a sharded parameter's state shaped like its shard is a DTensor like it (eager's zeros_like)
                like = pleaf if type(v) is TensorProxy and v._tt_shape == proxy._tt_shape else None
                return sharded(extra(v), like)

            before = traced.initial.get(id(proxy))
            if before is None:
                items = ", ".join(f"{k!r}: {value(v)}" for k, v in entry.items())
                lines.append(f"  {opt}.state[{param}] = {{{items}}}")
                continue
            for k, v in entry.items():
                if k not in before or before[k] is not v:
                    lines.append(f"  {opt}.state[{param}][{k!r}] = {value(v)}")
            for k in before:
                if k not in entry:
                    lines.append(f"  del {opt}.state[{param}][{k!r}]")

    if python_effects is not None:
        lines += python_effects(names, extra)

    # One copy_ per changed input; a source that is itself an overwritten input is read first.  An input whose
    # metadata only changed (t_(), squeeze_()) keeps its data: the epilogue replays the method on it instead.
    writes = [(v, dst) for v, dst in buffers.final_writes(walker.input_proxies()) if id(dst) not in st.metadata_inputs]
    for dst, (method, args, kwargs) in st.metadata_replays:
        leaf = walker.leaf_of(dst)
        # a computed value (the data a resizing in-place op wrote: metadata_inplace.resizing_inplace) comes from extras
        call = ", ".join([extra(a) if is_proxy(a) else repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        if method == "data=":  # ``t.data = v`` with other metadata (data_assignment.py): t points at the result
            lines.append(f"  {names(leaf.value, dst._tt_name, leaf)}.data = {call}")
            continue
        lines.append(f"  {names(leaf.value, dst._tt_name, leaf)}.{method}({call})")
    _reject_aliased_inputs(walker, [dst for _, dst in writes])
    st.written_inputs = [dst for _, dst in writes]
    written = {id(dst) for _, dst in writes}
    writes = [(prims.clone(v) if id(v) in written else v, dst) for v, dst in writes]
    for v, dst in writes:
        prims.copy_(v, dst)
        trc.bound_symbols[-1].comment = f"write-back: {dst._tt_name} updated in place"

    result = tree_map(final_value, out)
    # Results sharing an input's memory in eager are rebuilt from the real input after the write-backs.
    returns = output_aliases.rebuild_lines(st, out, names, extra)
    if st.has_backward:  # eager's grad_fn on what the function returns (returned_graph.py)
        more_lines, more = returned_graph.rebuild(st, out, names, extra, {i for i, _ in returns})
        lines += more_lines
        returns += more
    if not lines and not returns:
        return result, None
    # Only the objects its lines name are passed to the epilogue: an epilogue with none lets thin mode keep the
    # bound inputs as the computation's defaults (runtime/thin_args.py).
    used = set(re.findall(r"\w+", "\n".join(lines + [e for _, e in returns])))
    targets = {k: v for k, v in names.targets.items() if k in used}
    return (result, tuple(extras)), Epilogue(lines, names.globals, targets, returns)
