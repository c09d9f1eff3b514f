"""Rematerialization: the backward recomputes values instead of keeping them from the forward.

A joint forward + backward program (a whole training step with ``loss.backward()`` inside, or the joint
trace of ``transforms/autograd.py``) keeps every forward value the backward reads alive from the forward
to its use in the backward.  ``recompute`` rewrites the backward lines so that they read *recomputed*
copies of some forward values instead: the copies are computed right before the first backward line that
reads them, from the forward values they depend on, and the forward's own values die after their last
forward use (``transforms/lifetimes.py`` frees them).

Which values are recomputed:

* values computed inside an activation-checkpoint region (``bsym.region`` holds a ``Mark``;
  acquisition/checkpoint_regions.py marks them while tracing), as eager's checkpoint does: the region's
  inputs are kept, everything the region computed from them is recomputed.  A value the region hands out
  (read after the region by forward code, or returned) is kept, as eager's next op keeps it;
* not the outputs of a line a selective-checkpoint policy saves (``Mark.save``), nor of random ops (their
  draws are kept: a recomputation would draw again), nor of lines with a side effect;
* values picked by ``choose`` (automatic rematerialization, transforms/remat_policy.py).

Recomputed lines carry the comment ``recomputed for the backward``, so every trace shows them.
"""
from __future__ import annotations

import dataclasses

from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_map


@dataclasses.dataclass(frozen=True)
class Mark:
    """Where a line sits for the memory planner (``BoundSymbol.region``)."""

    region: int  # one number per checkpoint call; -1: a line a traced backward recorded
    save: bool = False  # a selective-checkpoint policy saves the line's outputs


BACKWARD = Mark(-1)
COMMENT = "recomputed for the backward"


def _is_tensor(x) -> bool:
    return type(x) is TensorProxy


def _random(b) -> bool:
    return b.sym.draws_random or b.sym.runs_opaquely or any(_random(s) for s in b.subsymbols)


def recomputable(b) -> bool:
    """A forward line whose outputs the backward may compute again with the same values."""
    outs = [o for o in b.flat_outputs() if is_proxy(o)]
    return bool(outs) and all(_is_tensor(o) for o in outs) and not b.has_side_effect and not _random(b)


@dataclasses.dataclass
class Recomputed:
    """What ``recompute`` did: the forward lines computed again, by the reason they were."""

    lines: list = dataclasses.field(default_factory=list)  # (line text, reason) of each recomputed forward line
    regions: int = 0  # checkpoint regions seen

    def names(self) -> list:
        return [text for text, _ in self.lines]


def in_checkpoint_region(b) -> bool:
    return isinstance(b.region, Mark) and b.region is not BACKWARD and b.region.region >= 0


def checkpointed_values(lines, is_backward, returned_ids) -> dict:
    """id -> proxy of the values computed inside checkpoint regions that only their own region reads in the
    forward (not returned): the values eager's checkpoint recomputes."""
    region_of, value = {}, {}
    for b in lines:
        if is_backward(b) or not in_checkpoint_region(b) or b.region.save or not recomputable(b):
            continue
        for o in b.flat_outputs():
            if _is_tensor(o):
                region_of[id(o)] = b.region.region
                value[id(o)] = o
    escaped = set(returned_ids)
    for b in lines:
        if is_backward(b):
            continue
        here = b.region.region if in_checkpoint_region(b) else None
        for a in b.flat_args():
            r = region_of.get(id(a)) if is_proxy(a) else None
            if r is not None and r != here:
                escaped.add(id(a))
    return {k: v for k, v in value.items() if k not in escaped}


def _fresh_like(p, make_name) -> TensorProxy:
    return TensorProxy(make_name("r"), shape=p._tt_shape, dtype=p._tt_dtype, device=p._tt_device,
                       requires_grad=p._tt_requires_grad, strides=p._tt_strides, storage_offset=p._tt_storage_offset)


def _clone(b, mapping, make_name, comment=None):
    """``b`` computing fresh outputs from ``mapping``'s values (its decomposition too)."""
    sub = lambda x: mapping.get(id(x), x) if is_proxy(x) else x  # noqa: E731
    args, kwargs = tree_map(sub, b.args), tree_map(sub, b.kwargs)
    subs = tuple(_clone(s, mapping, make_name) for s in b.subsymbols)
    inputs = {id(a) for a in b.flat_args()}

    def out(x):
        if not _is_tensor(x) or id(x) in mapping or id(x) in inputs:
            return sub(x)
        mapping[id(x)] = y = _fresh_like(x, make_name)
        # The value it recomputes: a backward kernel pairing with its forward line by their arguments
        # (executors/saved_statistics.py) may take the copy for the original (same ops on the same values).
        y._tt_recomputed_of = getattr(x, "_tt_recomputed_of", x)
        return y

    # A recomputed line is a backward line (a later planning step must not take it for a forward one).
    return b.replace(args=args, kwargs=kwargs, output=tree_map(out, b.output), subsymbols=subs,
                     comment=comment if comment is not None else b.comment,
                     region=BACKWARD if comment is not None else b.region)


def _substitute(b, mapping):
    sub = lambda x: mapping.get(id(x), x) if is_proxy(x) else x  # noqa: E731
    return b.replace(args=tree_map(sub, b.args), kwargs=tree_map(sub, b.kwargs),
                     subsymbols=tuple(_substitute(s, mapping) for s in b.subsymbols))


def _reads(b) -> list:
    """Proxies a line reads, its decomposition's reads of outside values included."""
    out = [a for a in b.flat_args() if is_proxy(a)]
    for s in b.subsymbols:
        out.extend(_reads(s))
    return out


def recompute(lines, is_backward, candidates: dict, make_name, reasons: dict | None = None):
    """The lines with each backward read of a ``candidates`` value (id -> proxy) replaced by a recomputed copy,
    computed right before its first backward reader.  Returns (lines, Recomputed)."""
    report = Recomputed()
    if not candidates:
        return list(lines), report
    producer = {}
    for b in lines:
        if not is_backward(b):
            for o in b.flat_outputs():
                if id(o) in candidates:
                    producer[id(o)] = b
    mapping: dict = {}
    done: set = set()
    new: list = []

    def need(v):
        b = producer[id(v)]
        if id(b) in done:
            return
        done.add(id(b))
        for a in b.flat_args():
            if is_proxy(a) and id(a) in candidates and id(a) not in mapping:
                need(a)
        c = _clone(b, mapping, make_name, comment=COMMENT)
        new.append(c)
        report.lines.append((_text(c), (reasons or {}).get(id(v), "checkpoint region")))

    for b in lines:
        if not is_backward(b):
            new.append(b)
            continue
        for a in _reads(b):
            if id(a) in candidates and id(a) not in mapping:
                need(a)
        new.append(_substitute(b, mapping) if any(id(a) in mapping for a in _reads(b)) else b)
    return new, report


def _text(b) -> str:
    outs = ", ".join(o._tt_name for o in b.flat_outputs() if _is_tensor(o))
    return f"{outs} = {b.sym.id}"


def recompute_checkpointed(trc, header="Checkpoint regions recomputed in the backward (transforms/remat.py)"):
    """A whole step (backward lines marked ``BACKWARD``): checkpointed values recomputed in the backward.
    Returns (trace, Recomputed); the trace is ``trc`` itself when there is nothing to recompute."""
    from ..pytree import tree_flatten

    is_backward = lambda b: b.region is BACKWARD  # noqa: E731
    lines = trc.bound_symbols
    returned = {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}
    candidates = checkpointed_values(lines, is_backward, returned)
    new_lines, report = recompute(lines, is_backward, candidates, trc.make_name)
    if not report.lines:
        return trc, report
    report.regions = len({b.region.region for b in lines if in_checkpoint_region(b)})
    new = trc.derive(header)
    new.bound_symbols = new_lines
    return new, report


def recompute_split(fwd_part, bwd_part, outputs, make_name):
    """The backward part of a joint trace (``transforms/autograd.py``) reading recomputed copies of the
    checkpointed values; returns (backward lines, Recomputed)."""
    fwd_ids = {id(b) for b in fwd_part}
    is_backward = lambda b: id(b) not in fwd_ids  # noqa: E731
    lines = list(fwd_part) + list(bwd_part)
    candidates = checkpointed_values(lines, is_backward, {id(o) for o in outputs})
    new_lines, report = recompute(lines, is_backward, candidates, make_name)
    report.regions = len({b.region.region for b in fwd_part if in_checkpoint_region(b)})
    return [b for b in new_lines if id(b) not in fwd_ids], report
