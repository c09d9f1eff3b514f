"""Collectives overlap the work around them: the next unit's all-gathers start early, each ``wait`` moves down.

``prefetch``: the all-gathers of a fully_shard unit start before the compute of the unit before it (FSDP2's
prefetch), in the forward and in the backward, for the parameters it gathers again (``reshard_after_forward=True``;
there each is its own run, gathered where the backward first reads it, so the next one starts one parameter
ahead).  Off on the CPU unless asked for (``_prefetching``).  A unit here is a run of all-gather starts with no compute
between them (only their preparation: casts and padding of the shards, and the waits and slices of what they
gathered); a unit's starts move up to its first one, and each run but the first moves up, with its preparation,
to just before the first compute of the run before it.  A gather of the backward (of shards an earlier start
gathered: the final trace carries no backward marks) never moves into the forward, nor above a run that gathers
the same shards, nor above a line that reads or writes its shards otherwise (the optimizer's in-place update).
The starts keep their order among themselves, and every decision reads the lines that are the same on every rank
(a shard's padding, which differs, is preparation).

``late_waits``:

A collective of the sharded step (``prims.all_gather``, ``prims.reduce_scatter``) starts where the program needs
it and runs while later lines compute.  Its ``wait`` moves down to the first line that reads the result, but no
further than just after the next collective of the same kind has started: a gradient's reduce-scatter runs while
the backward of the layer before computes, and at most two of them are in flight, so the full-size gradients they
read are freed as the backward goes (FSDP2 does the same).  The start lines stay where they are, so every rank
issues its collectives in the same order.  A wait reads the collective's input too (``prims.wait(result,
source)``), so lifetimes and kept buffers keep that memory intact until the wait.
"""
from __future__ import annotations

import os

from .. import prims
from ..proxies import is_proxy


def _kind(b):
    """``prims.wait``, ``prims.all_gather``, ``prims.reduce_scatter`` for their lines (claimed or not), else None."""
    for s in (b.sym, getattr(b, "source", None)):
        if s is prims.wait or s is prims.all_gather or s is prims.reduce_scatter:
            return s
    return None


def _prep_lines(lines, producer):
    """Per line index: whether the line computes from the program's inputs only (no collective, no wait)."""
    pure = []
    for b in lines:
        ok = _kind(b) is None and not b.has_side_effect
        if ok:
            for a in b.flat_args():
                j = producer.get(id(a))
                if j is not None and (j >= len(pure) or not pure[j]):  # made here or later: not from inputs
                    ok = False
                    break
        pure.append(ok)
    return pure


def _chain(i, lines, producer, pure):
    """The lines (indices, ascending) that start ``i`` needs and that compute from inputs only, ``i`` included;
    None when it needs a line that does not (then it stays where it is)."""
    seen, todo = {i}, [i]
    while todo:
        for a in lines[todo.pop()].flat_args():
            j = producer.get(id(a))
            if j is None or j in seen:
                continue
            if not pure[j]:
                return None
            seen.add(j)
            todo.append(j)
    return sorted(seen)


def _inputs_read(idx, lines, producer):
    return {id(a) for j in idx for a in lines[j].flat_args() if is_proxy(a) and id(a) not in producer}


def _prefetching(start) -> bool:
    """Whether to prefetch: ``THUNDER_TRAIN_PREFETCH`` (1 or 0) if set, else only off the CPU.  On CPU ranks (gloo)
    prefetching raised torch.profiler's peak of a step well above eager FSDP2's (benchmarks/fsdp2.py, GPT 4 x 256:
    73.6 against 48.2 MiB without it); that reading misses frees done by gloo's threads, and on torch's fake process
    group the peak does not change (docs/distributed.md), but until gloo's own memory is measured it stays off there."""
    flag = os.environ.get("THUNDER_TRAIN_PREFETCH")
    if flag is not None:
        return flag == "1"
    device = getattr(start.flat_args()[0], "_tt_device", None)
    return device is not None and getattr(device, "type", str(device)) != "cpu"


def prefetch(trc, header=None, enabled=None):
    """``trc`` with each unit's all-gathers started during the unit before it (see the module's text); ``enabled``
    (None: ``_prefetching``) decides whether at all."""
    lines = list(trc.bound_symbols)
    starts = [i for i, b in enumerate(lines) if _kind(b) is prims.all_gather]
    if not starts or not (enabled if enabled is not None else _prefetching(lines[starts[0]])):
        return trc
    producer: dict = {}
    for i, b in enumerate(lines):  # the first line that makes a value (a size a later line also names)
        for o in b.flat_outputs():
            if is_proxy(o):
                producer.setdefault(id(o), i)
    pure = _prep_lines(lines, producer)
    chains = {i: _chain(i, lines, producer, pure) for i in starts}
    moving = {j for c in chains.values() if c for j in c}
    # Lines that do not separate two runs: collectives, waits, the moving preparation, and what computes from
    # gathered values alone (the slice of a padded gather, a transpose of the weight).
    gathered, plumbing = set(), set(moving)
    for i, b in enumerate(lines):
        kind = _kind(b)
        if kind is not None:
            plumbing.add(i)
            src = producer.get(id(b.args[0]))
            if kind is prims.wait and src is not None and _kind(lines[src]) is prims.all_gather:
                gathered.update(id(o) for o in b.flat_outputs())
            continue
        args = [id(a) for a in b.flat_args() if is_proxy(a)]
        if i not in moving and args and all(a in gathered for a in args):
            plumbing.add(i)
            gathered.update(id(o) for o in b.flat_outputs() if is_proxy(o))
    runs = []  # runs of starts with no compute between them
    for i in starts:
        if runs and all(j in plumbing for j in range(runs[-1][-1] + 1, i)):
            runs[-1].append(i)
        else:
            runs.append([i])
    # A start is a gather again (in the backward) when an earlier start gathered the same shards (the forward's).
    regather, seen = set(), set()
    for i in starts:
        shards = _inputs_read(chains[i] or (i,), lines, producer)
        if shards & seen:
            regather.add(i)
        seen |= shards
    again = regather.__contains__
    place: dict = {}  # index of a line -> the lines (moved up) to put just after it
    moved = set()

    def move(run, target):
        idx = sorted({j for i in run for j in chains[i] if j > target and j not in moved})
        place.setdefault(target, []).extend(idx)
        moved.update(idx)

    for k, run in enumerate(runs):
        if all(chains[i] is not None for i in run[1:]):
            move(run[1:], run[0])  # a unit's all-gathers start together (FSDP2's one all-gather per unit)
        if k == 0 or chains[run[0]] is None:
            continue
        prev, lead = runs[k - 1], [i for i in run if chains[i] is not None]
        # just before the previous unit's first compute (its own place, wherever its gathers moved)
        compute = next(j for j in range(prev[-1] + 1, run[0] + 1) if j not in plumbing or j == run[0])
        target = max(j for j in range(prev[-1], compute) if j not in moved or j == prev[-1])
        if again(run[0]) and not again(prev[-1]):
            continue  # (a gather of the backward never moves into the forward)
        idx = [j for i in lead for j in chains[i]]
        shards = _inputs_read(idx, lines, producer)
        if shards & _inputs_read([j for i in prev for j in chains[i] or (i,)], lines, producer):
            continue  # the same unit gathered again (the backward's first unit)
        between = [j for j in range(target + 1, run[0]) if j not in moving and _kind(lines[j]) is None]
        if any(shards & _inputs_read([j], lines, producer) for j in between):
            continue
        move([run[0]], target)
    if not moved:
        return trc
    new = []

    def emit(i):
        new.append(lines[i])
        for j in place.get(i, ()):
            emit(j)

    for i in range(len(lines)):
        if i not in moved:
            emit(i)
    out = trc.derive(header or trc.header)
    out.bound_symbols = new
    return out


def late_waits(trc, header=None):
    """``trc`` with every wait moved down as described above (at the end if only returned)."""
    lines = trc.bound_symbols
    if not any(_kind(b) is prims.wait for b in lines):
        return trc
    index = {id(b): i for i, b in enumerate(lines)}
    producer = {id(o): b for b in lines for o in b.flat_outputs()}
    waits = {id(b) for b in lines if _kind(b) is prims.wait}
    before: dict = {}  # index of a line -> the waits to put before it, in program order
    tail = []
    for i, w in enumerate(lines):
        if id(w) not in waits:
            continue
        out = id(w.output)
        target = next((j for j in range(i + 1, len(lines)) if id(lines[j]) not in waits
                       and any(id(a) == out for a in lines[j].flat_args())), None)
        start = producer.get(id(w.args[0]))
        if start is not None:
            kind = _kind(start)
            nxt = next((j for j in range(index[id(start)] + 1, len(lines)) if _kind(lines[j]) is kind), None)
            if nxt is not None:  # just after the next collective of this kind started
                after = next((j for j in range(nxt + 1, len(lines)) if id(lines[j]) not in waits), None)
                if after is not None and after > i and (target is None or after < target):
                    target = after
        if target is None or target <= i:
            (tail if target is None else before.setdefault(i + 1, [])).append(w)  # (never above its own line)
        else:
            before.setdefault(target, []).append(w)
    new = []
    for j, b in enumerate(lines):
        new.extend(before.get(j, ()))
        if id(b) not in waits:
            new.append(b)
    new.extend(before.get(len(lines), ()))
    new.extend(tail)
    out = trc.derive(header or trc.header)
    out.bound_symbols = new
    return out
