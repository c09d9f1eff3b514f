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
* not the outputs of a line a selective-checkpoint policy saves (``Mark.save``), nor of lines with a side effect;
* random draws inside a region (dropout's mask) are drawn again, as eager's ``preserve_rng_state`` does: the
  forward reads the generator's state right before the region's first draw (a value of the program,
  prims/generators.py), and the backward sets it, draws the region's random lines again in their order, and sets
  the generator back to where it was (``_replay``).  The draws are the forward's, the generator ends where eager's
  does, and the mask is not held from the forward to the backward.  A region with a line that may use the
  generator otherwise (an op run opaquely, a seeding, draws on two devices) keeps its draws;
* values picked by ``choose`` (automatic rematerialization, transforms/remat_policy.py).

Recomputed lines carry the comment ``recomputed for the backward``, so every trace shows them.
"""
from __future__ import annotations

import dataclasses

from .. import devices, dtypes, prims
from ..prims.generators import state_size
from ..proxies import NumberProxy, TensorProxy, is_proxy
from ..pytree import tree_map
from ..symbols import BoundSymbol


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
    """Uses a generator: draws, sets or reads it (a read taken later reads another state), or may (opaque)."""
    return (b.sym.draws_random or b.sym.runs_opaquely or "reads_generator" in b.sym.tags
            or any(_random(s) for s in b.subsymbols))


def _opaque(b) -> bool:
    return b.sym.runs_opaquely or any(_opaque(s) for s in b.subsymbols)


def _draw_device(b):
    """The device whose generator the line draws from (its tensor results'), or None: not a plain draw (a line
    that also sets or reads a generator, runs opaquely, or makes results on two devices)."""
    outs = b.flat_outputs()
    if not b.draws_random or b.has_side_effect or _opaque(b) or not outs or not all(_is_tensor(o) for o in outs):
        return None
    devs = {o._tt_device for o in outs}
    return devs.pop() if len(devs) == 1 else None


def replayable_regions(lines, is_backward) -> dict:
    """region number -> device of the regions whose random lines a replay draws again: every line using a
    generator is a plain draw (``_draw_device``), all from one device's generator."""
    dev, bad = {}, set()
    for b in lines:
        if is_backward(b) or not in_region(b) or not _random(b):
            continue
        d, r = _draw_device(b), b.region.region
        if d is None or dev.setdefault(r, d) != d:
            bad.add(r)
    return {r: d for r, d in dev.items() if r not in bad}


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


def traced_size(s) -> int:
    """A size for the estimate: a symbolic size (dynamic shapes) counts at its traced value.  The plan only
    decides what is saved or recomputed, never a value, so no call is specialised on it."""
    return s.value if isinstance(s, NumberProxy) else int(s)


def nbytes(p) -> int:
    if type(p) is not TensorProxy:
        return 0
    n = 1
    for s in p._tt_shape:
        n *= traced_size(s)
    return n * p._tt_dtype.torch.itemsize


def in_region(b) -> bool:
    return isinstance(b.region, Mark) and b.region is not BACKWARD and b.region.region >= 0


def worth_replaying(lines, is_backward, regions: dict) -> dict:
    """The regions whose draws hold more bytes than the generator state a replay keeps instead (a CPU state is
    5 KB: a tiny region's mask is smaller, and kept)."""
    drawn: dict = {}
    for b in lines:
        if not is_backward(b) and in_region(b) and b.region.region in regions and b.draws_random:
            drawn[b.region.region] = drawn.get(b.region.region, 0) + sum(nbytes(o) for o in b.flat_outputs())
    return {r: d for r, d in regions.items() if drawn.get(r, 0) > state_size(d)}


def checkpointed_values(lines, is_backward, returned_ids, draws_again: bool = True) -> dict:
    """id -> proxy of the values computed inside checkpoint regions that only their own region reads in the
    forward (not returned): the values eager's checkpoint recomputes; with ``draws_again``, the draws of the
    regions ``replayable_regions`` finds too."""
    region_of, value = {}, {}
    replayable = worth_replaying(lines, is_backward, replayable_regions(lines, is_backward)) if draws_again else {}
    for b in lines:
        if is_backward(b) or not in_region(b) or b.region.save:
            continue
        if not recomputable(b) and not (b.region.region in replayable and _draw_device(b) is not None):
            continue
        for o in b.flat_outputs():
            if _is_tensor(o):
                region_of[id(o)] = b.region.region
                value[id(o)] = o
    escaped = set(returned_ids)
    for b in lines:
        if is_backward(b):
            continue
        here = b.region.region if in_region(b) else None
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


def recompute(lines, is_backward, candidates: dict, make_name, reasons: dict | None = None):
    """The lines with each backward read of a ``candidates`` value (id -> proxy) replaced by a recomputed copy,
    computed right before its first backward reader.  Returns (lines, Recomputed).  A candidate drawn by a random
    line (only checkpoint regions' draws are candidates) is drawn again by ``_replay``."""
    report = Recomputed()
    if not candidates:
        return list(lines), report
    producer = {}
    for b in lines:
        if not is_backward(b):
            for o in b.flat_outputs():
                if id(o) in candidates:
                    producer[id(o)] = b
    draws = _draws_to_replay(lines, is_backward, producer, make_name)
    mapping: dict = {}
    done: set = set()
    new: list = []

    def need(v):
        b = producer[id(v)]
        if id(b) in done:
            return
        if b.draws_random:
            _replay(draws[b.region.region], need_arg, clone, done, new)
            return
        done.add(id(b))
        for a in b.flat_args():
            if is_proxy(a) and id(a) in candidates and id(a) not in mapping:
                need(a)
        clone(b, v)

    def need_arg(a):
        if is_proxy(a) and id(a) in candidates and id(a) not in mapping:
            need(a)

    def clone(b, v):
        c = _clone(b, mapping, make_name, comment=COMMENT)
        new.append(c)
        report.lines.append((_text(c), (reasons or {}).get(id(v), "checkpoint region")))

    state_before = {id(d.lines[0]): d for d in draws.values()}
    for b in lines:
        if not is_backward(b):
            d = state_before.get(id(b))
            if d is not None:  # the generator's state the region's first draw starts from
                new.append(BoundSymbol(prims.get_rng_state, (d.device,), {}, d.state, comment=_STATE_COMMENT))
            new.append(b)
            continue
        for a in b.all_reads():
            if id(a) in candidates and id(a) not in mapping:
                need(a)
        new.append(b.renamed(mapping, inside=True) if any(id(a) in mapping for a in b.all_reads()) else b)
    return new, report


_STATE_COMMENT = "the random state a checkpoint region's draws start from (drawn again in the backward)"


@dataclasses.dataclass
class _Draws:
    """A checkpoint region's random lines, in the forward's order, up to the last one the backward may need."""

    lines: list
    device: object
    state: TensorProxy  # the generator's state before the first of them, read in the forward
    make_name: object


def _draws_to_replay(lines, is_backward, producer, make_name) -> dict:
    """region -> _Draws of the regions with a candidate drawn by a random line."""
    wanted = {b.region.region for b in producer.values() if b.draws_random}
    if not wanted:
        return {}
    per_region: dict = {}
    for b in lines:
        if not is_backward(b) and in_region(b) and b.region.region in wanted and _random(b):
            per_region.setdefault(b.region.region, []).append(b)
    out, producers = {}, {id(b) for b in producer.values()}
    for r, rl in per_region.items():
        last = max(i for i, b in enumerate(rl) if id(b) in producers)
        dev = _draw_device(rl[0])
        state = TensorProxy(make_name("rng"), shape=(state_size(dev),), dtype=dtypes.uint8, device=devices.cpu)
        out[r] = _Draws(rl[: last + 1], dev, state, make_name)
    return out


def _replay(d: _Draws, need_arg, clone, done, new) -> None:
    """The region's draws again, in their order, from the state before its first draw; the generator then set back
    to where it was, so the backward moves it no more than eager's recomputation (inside ``fork_rng``) does."""
    for b in d.lines:
        done.add(id(b))
    now = TensorProxy(d.make_name("rng"), shape=d.state._tt_shape, dtype=dtypes.uint8, device=devices.cpu)
    new.append(BoundSymbol(prims.get_rng_state, (d.device,), {}, now, comment=_STATE_COMMENT, region=BACKWARD))
    new.append(BoundSymbol(prims.set_rng_state, (d.state, d.device), {}, None, region=BACKWARD))
    for b in d.lines:
        for a in b.flat_args():
            need_arg(a)  # recomputed values a draw reads (deterministic: computed here all the same)
        clone(b, b.flat_outputs()[0])
    new.append(BoundSymbol(prims.set_rng_state, (now, d.device), {}, None, region=BACKWARD))


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
    report.regions = len({b.region.region for b in lines if in_region(b)})
    new = trc.derive(header)
    new.bound_symbols = new_lines
    return new, report
