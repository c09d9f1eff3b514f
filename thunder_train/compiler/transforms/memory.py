"""The memory plan of a whole step: what the backward recomputes instead of keeping, and the report of it.

Three steps, all carried out by ``transforms/remat.py`` ``recompute``: checkpoint regions first (the user asked
for them), then cheap values (``transforms/remat_policy.py``, by default), then, under ``memory_budget=f``,
more values until the bytes kept for the backward are at most ``f`` of what the default keeps.  ``MemoryPlan``
reports it (``tt.compile_stats(cf).memory``); recomputed lines carry the comment ``recomputed for the
backward`` in every trace.
"""
from __future__ import annotations

import dataclasses

from .. import dtypes
from ..proxies import TensorProxy, is_proxy
from ..pytree import tree_flatten
from .remat import BACKWARD, checkpointed_values, in_region, recompute, recompute_checkpointed
from .remat_policy import Saved, budget_values, cheap_values, costly_alone, costly_even_fused, is_view, nbytes
from .early_updates import HOLD_BACK_BYTES
from .sinking import sink
from .recompute_again import recompute_again


@dataclasses.dataclass
class MemoryPlan:
    """What the memory planner chose for one compiled program (``tt.compile_stats(cf).memory``).

    ``saved_bytes``: the forward values the backward reads, in bytes (one count per memory they share; the
    program's inputs, such as parameters, not counted); ``saved_bytes_default``: the same with the default plan
    (the budget's reference); ``saved_bytes_without_remat``: with nothing recomputed; ``planned_peak_bytes``: the
    most bytes the planned program holds at once above its inputs, counted on the trace before executors run
    (kernel temporaries, kept buffers and executor rewrites aside); ``recomputed``: ``(line, reason)`` of each
    forward line the backward computes again, reason ``"checkpoint region"``, ``"cheap"`` or ``"budget"``;
    ``head_logits_bytes``: the logits of a language model's head that the program computes by blocks of rows
    (executors/blocked_head.py, where it asks for memory): counted by the plan, never kept whole, so not in
    ``saved_bytes``; ``traced_peak_bytes``: the same count on the step as traced, before anything is recomputed or
    moved, each gradient held to the optimizer (the program eager runs, as eager holds ``.grad``; a default step's
    kept buffers may fill towards it, executors/buffers.py ``_room``).
    """

    saved_bytes: int = 0
    saved_bytes_default: int = 0
    saved_bytes_without_remat: int = 0
    planned_peak_bytes: int = 0
    recomputed: list = dataclasses.field(default_factory=list)
    checkpoint_regions: int = 0
    memory_budget: float | None = None
    budget_met: bool | None = None  # None without a budget; False: nothing more could be recomputed (see docs/memory.md)
    head_logits_bytes: int = 0
    traced_peak_bytes: int = 0
    costly_kept: int = 0  # cheap values kept, not recomputed, as costly in a program of torch kernels (``fewest_costly``)

    def head_by_blocks(self, logits_bytes: int) -> None:
        """The head's logits, which the plan counted as saved, run by blocks of rows after it (executors/blocked_head.py):
        nothing logits-sized is kept for the backward."""
        if logits_bytes <= 0:
            return
        self.head_logits_bytes = min(logits_bytes, self.saved_bytes)
        self.saved_bytes -= self.head_logits_bytes
        if self.memory_budget is not None:
            self.budget_met = self.saved_bytes <= self.memory_budget * self.saved_bytes_default

    def replaced_by(self, plan: "MemoryPlan") -> None:
        """The program this plan described is replaced by one planned as ``plan`` (the default's fused program,
        planned again once built: compiler/pipeline.py): the report, ``compile_stats(cf).memory``, follows the
        program that runs."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(plan, field.name))

    def summary(self) -> str:
        mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
        why: dict = {}
        for _, reason in self.recomputed:
            why[reason] = why.get(reason, 0) + 1
        recomputed = ", ".join(f"{n} {r}" for r, n in why.items()) or "none"
        budget = ""
        if self.memory_budget is not None:
            budget = (f", budget {self.memory_budget} of the default's {mib(self.saved_bytes_default)}"
                      f"{'' if self.budget_met else ' NOT reached: what is left is kept by backward kernels reading their forward statistics, or not recomputable'}")
        head = f", the head's {mib(self.head_logits_bytes)} of logits by blocks of rows" if self.head_logits_bytes else ""
        return (f"saved for the backward {mib(self.saved_bytes)} (without recomputation {mib(self.saved_bytes_without_remat)}"
                f"{budget}{head}); planned peak {mib(self.planned_peak_bytes)} (the step as traced: "
                f"{mib(self.traced_peak_bytes)}); recomputed lines: {recomputed}; "
                f"checkpoint regions: {self.checkpoint_regions}"
                + (f"; {self.costly_kept} costly to recompute kept" if self.costly_kept else ""))


def planned_peak(lines, returned_ids=()) -> int:
    """Most bytes alive at once: each non-view line allocates its tensors, freed after the last read of them or
    of a view of them; inputs of the program are not counted."""
    return max(alive_bytes(lines, returned_ids), default=0)


def alive_bytes(lines, returned_ids=()) -> list:
    """The bytes alive at each line (``planned_peak``'s count): its results included, what it reads last freed after it."""
    root, size, last, first = {}, {}, {}, {}
    for i, b in enumerate(lines):
        args = [a for a in b.flat_args() if type(a) is TensorProxy]
        for a in b.all_reads():
            r = root.get(id(a))
            if r is not None:
                last[r] = i
        for o in b.flat_outputs():
            if type(o) is TensorProxy and id(o) not in root:
                if is_view(b) and args:
                    root[id(o)] = root.get(id(args[0]), id(args[0]))
                else:
                    root[id(o)] = id(o)
                    size[id(o)] = nbytes(o)
                    first.setdefault(id(o), i)
                    last.setdefault(id(o), i)
    for k in returned_ids:
        if k in root:
            last[root[k]] = len(lines)
    delta = [0] * (len(lines) + 2)
    for r, n in size.items():
        delta[first[r]] += n  # the line that allocated it (recorded above: a search per value was quadratic)
        delta[last[r] + 1] -= n
    curve, cur = [], 0
    for d in delta[: len(lines)]:
        cur += d
        curve.append(cur)
    return curve


# The plan does not see kernels' temporaries (flash attention's per-thread blocks, aten's blocked copies) nor what
# executors rewrite; a planned peak higher by less than this fraction is within its error (ViT's second GELU output,
# kept: planned peak +0.2 %, measured -0.8 %).
PLAN_RESOLUTION = 0.005


def where_recomputing_lowers_the_peak(trc, chosen: dict, cache: dict) -> dict:
    """The cheap values (``chosen``, id -> proxy) worth recomputing in ``trc``: those whose copies lower its planned
    peak.

    A value kept instead of recomputed holds its bytes from its last forward read to the line that would recompute
    it.  Counted on the program recomputing them all, as the plan goes on to order it (``_settled``: its backward
    lines sunk where that lowers the peak), a value whose bytes fit under that program's peak (within
    ``PLAN_RESOLUTION``) over that stretch is kept: its recomputation would cost a kernel a step, cold inside the
    backward, for no memory (ViT's second GELU: 2 % of its fused step, 7 % of its torch program).  Greedy, in the
    order of the copies; each kept value raises the count for the next.  Should the kept values' program still plan
    a higher peak (sinking orders it otherwise), all of them are recomputed, as before.  ``cache``: the programs
    probed (``_settled``)."""
    if not chosen:
        return chosen
    every = _settled(trc, chosen, cache).final()
    lines, curve = _probe_curve(every, cache)
    peak = max(curve, default=0) * (1 + PLAN_RESOLUTION)
    copy_at, last_read = {}, {}
    for i, b in enumerate(lines):
        if _is_backward(b):
            for o in b.flat_outputs():
                of = getattr(o, "_tt_recomputed_of", None)
                if of is not None and id(of) in chosen:
                    copy_at.setdefault(id(of), i)
            continue
        for x in b.all_reads():
            last_read[id(x)] = i
        for o in b.flat_outputs():
            last_read.setdefault(id(o), i)
    # Values an op asks to have computed again (an FSDP2 unit's gathered parameters, resharded after the forward)
    # are recomputed whatever the peak.
    asked = {id(o) for b in trc.bound_symbols if not _is_backward(b) and b.sym.recompute_in_backward is not None
             and b.sym.recompute_in_backward(b) for o in b.flat_outputs()}
    keep = set()
    for k in sorted(chosen, key=lambda k: copy_at.get(k, len(lines))):
        if k in asked:
            continue
        at, since = copy_at.get(k), last_read.get(k)
        n = nbytes(chosen[k])
        if at is None or since is None or since >= at or max(curve[since + 1: at], default=0) + n > peak:
            continue
        keep.add(k)
        for i in range(since + 1, at):
            curve[i] += n
    if not keep:
        return chosen
    fewer = {k: p for k, p in chosen.items() if k not in keep}
    return fewer if max(_probe_curve(_settled(trc, fewer, cache).final(), cache)[1], default=0) <= peak else chosen


# Where the program runs its lines as torch kernels one by one (``fusion=None``, the default's torch program), values
# costly to recompute (``remat_policy.costly_alone``; in a fused program ``costly_even_fused``) are recomputed only
# as far as keeping the planned peak this much under the step as written needs (the plan's error on steps with such
# values: the zoo's models at batch 16-32, every torch program measured at most eager's peak with it; docs/memory.md).
COSTLY_MARGIN = 0.02


def fewest_costly(trc, chosen: dict, producer: dict, cache: dict, traced, alone=costly_alone) -> tuple:
    """(``chosen`` less the values costly to recompute that the peak does not need, how many were left out): the
    fewest of them, largest first, with which the planned peak is at most ``1 - COSTLY_MARGIN`` of the step as
    traced (``traced``: what eager runs), both counted as ``_probe_curve`` counts (attention's kept statistics
    included), or all of them where even that is above it, a line holds memory the plan does not count
    (``_holds_unplanned``) or a line's kernel scratch is unknown (``_unknown_scratch``); then fewer, where fewer reach
    the same peak as the program holds its gradients (``_held_curve``).  Bisections over how many: the planned peak
    falls as more are recomputed.  ``cache``: the programs probed (``_settled``); ``alone``: which
    values are costly in this program (``remat_policy.costly_alone``, ``costly_even_fused``)."""
    costly = sorted((k for k in chosen if alone(producer[k])), key=lambda k: -nbytes(chosen[k]))
    if not costly or any(_holds_unplanned(b) for b in trc.bound_symbols if not _is_backward(b)) \
            or any(_unknown_scratch(b) for b in trc.bound_symbols):
        return chosen, 0
    limit = max(_probe_curve(traced, cache)[1], default=0) * (1 - COSTLY_MARGIN)
    out = set(costly)
    with_first = lambda n: {k: p for k, p in chosen.items() if k not in out or k in costly[:n]}  # noqa: E731
    peak = lambda n, held=False: max(_probe_curve(_settled(trc, with_first(n), cache).final(), cache, held)[1], default=0)  # noqa: E731
    if peak(len(costly)) > limit:
        return chosen, 0
    n = _fewest(len(costly), lambda n: peak(n) <= limit)
    # Fewer where they reach the same peak as the program holds its gradients (``_held_curve``): a recomputation
    # that lowers only the count, where each gradient goes when made, buys no memory where the program peaks holding
    # the smallest gradients for the update after the backward (nn.TransformerEncoder's torch program recomputed one
    # GELU output of two for nothing: measured 640 bytes above keeping both, and its step 1.7-2.3 % slower).
    reached = peak(n, held=True)
    n = _fewest(n, lambda m: peak(m, held=True) <= reached)
    return with_first(n), len(costly) - n


def _fewest(most: int, enough) -> int:
    """The least ``n`` in ``0..most`` with ``enough(n)`` (true for ``most``), by bisection: fewer recomputed values
    never lower a peak."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi) // 2
        if enough(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _holds_unplanned(b) -> bool:
    """A line whose kernel keeps memory the plan does not count (``Symbol.torch_holds_unplanned``): a program with one
    peaks above its plan by more than any margin (the zoo's DeepSeek-V3 at batch 32 and 128 tokens, its attention's
    probabilities: 1.02x eager's measured with every cheap value recomputed, 1.04x with its costly ones kept)."""
    holds = b.sym.torch_holds_unplanned
    return holds is not None and bool(holds(b))


def _unknown_scratch(b) -> bool:
    """A line (or a line of its decomposition) whose kernel allocates scratch memory of unknown size
    (``Symbol.kernel_scratch``: a CPU convolution's backward, an op run opaquely without a rule): the call may peak
    inside it, where no plan sees, so no margin on the plan holds the peak (the zoo's ViT, its patch embedding's
    convolution backward: 1.002x eager's measured with its GELU output kept, the plan 6 % under the step as traced)."""
    if b.sym.kernel_scratch(*b.args, **b.kwargs) is None:
        return True
    return any(_unknown_scratch(s) for s in b.subsymbols)


def _probe_curve(trc, cache, held: bool = False) -> tuple:
    """(lines up to the backward's last, the bytes alive at each): ``alive_bytes`` (``held``: ``_held_curve``'s),
    plus what a forward/backward kernel pair keeps between its two lines that the trace before executors does not
    show (``Symbol.torch_saved_statistics_bytes``: attention's output and log-sum-exp, which moved ViT's measured
    peak into its first attention backward)."""
    lines = _through_backward(trc)
    curve = list(_held_curve(trc, cache) if held else _curve(trc, cache))
    forward_at: dict = {}
    for i, b in enumerate(lines):
        op = getattr(b.sym, "forward_symbol", None) if _is_backward(b) else b.sym
        kept = getattr(op, "torch_saved_statistics_bytes", None)
        if kept is None:
            continue
        key = (id(op), tuple(id(getattr(a, "_tt_recomputed_of", a)) for a in b.flat_args() if type(a) is TensorProxy))
        if not _is_backward(b):
            forward_at[key[0], key[1]] = (i, kept(b))
            continue
        for (k, args), (start, n) in forward_at.items():  # the forward line of the same op on the same tensors
            if k == key[0] and set(args) <= set(key[1]):
                for j in range(start + 1, i):
                    curve[j] += n
                break
    return lines, curve


_CHEAP_HEADER = "Cheap values recomputed in the backward (transforms/remat_policy.py)"


@dataclasses.dataclass
class _Settled:
    """``trc`` with ``chosen`` recomputed (``recomputed``, ``report``) and that program with its backward sunk where
    that lowers the planned peak (``sunk``; None where it does not): what ``plan_memory`` does next in a default
    step, so its probes' work is reused there."""

    recomputed: object
    report: object
    sunk: object

    def final(self):
        return self.sunk or self.recomputed


def _settled(trc, chosen: dict, cache: dict) -> _Settled:
    key = frozenset(chosen)
    if key not in cache:
        new = trc.derive(_CHEAP_HEADER)  # its own names: ``trc`` names nothing after a probe
        new.bound_symbols, report = recompute(trc.bound_symbols, _is_backward, chosen, new.make_name,
                                              reasons={k: "cheap" for k in chosen})
        sunk = sink(new)
        cache[key] = _Settled(new, report, sunk if sunk is not new and _peak_of(sunk, cache) < _peak_of(new, cache) else None)
    return cache[key]


def _is_backward(b) -> bool:
    return b.region is BACKWARD


def head_logits(lines) -> tuple:
    """(bytes, the head's input) of a language model's logits that a program asking for memory computes by blocks of rows later
    (executors/blocked_head.py, which has the exact conditions): a CPU float32/float64 ``linear`` whose result the
    forward reads only through views into ``cross_entropy``.  The largest such one (one head per program), or
    ``(0, None)``."""
    readers: dict = {}
    for b in lines:
        if not _is_backward(b):
            for a in b.flat_args():
                if type(a) is TensorProxy:
                    readers.setdefault(id(a), []).append(b)
    best = (0, None)
    for b in lines:
        out = b.output
        if _is_backward(b) or b.sym.name != "linear" or type(out) is not TensorProxy or out._tt_device.type != "cpu" \
                or out._tt_dtype not in (dtypes.float32, dtypes.float64):
            continue
        todo, to_loss, only = [out], False, True
        while todo and only:
            for r in readers.get(id(todo.pop()), ()):
                if r.sym.name == "cross_entropy":
                    to_loss = True
                elif is_view(r):
                    todo.extend(o for o in r.flat_outputs() if type(o) is TensorProxy)
                else:
                    only = False
        if to_loss and only and nbytes(out) > best[0]:
            best = (nbytes(out), b.args[0])
    return best


def _saved_of(trc) -> Saved:
    returned = {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}
    return Saved(trc.bound_symbols, _is_backward, returned, {id(a) for a in trc.args})


def plan_memory(trc, traces: list, memory_budget: float | None = None, kernels_alone: bool = False):
    """The whole step's plan: (trace, MemoryPlan); each new trace is appended to ``traces``.  ``kernels_alone``: the
    program runs its lines as torch kernels one by one (``fusion=None``, the default's torch program), where values
    costly to recompute are recomputed only as far as the peak needs (``fewest_costly``); otherwise only those no
    fused kernel takes are."""
    plan = MemoryPlan(memory_budget=memory_budget)
    memo: dict = {}  # trace -> Saved: a step that recomputes nothing keeps its trace, whose analysis is reused

    def _saved(t) -> Saved:
        if id(t) not in memo:
            memo[id(t)] = (t, _saved_of(t))  # the trace is kept with it, so its id is not reused meanwhile
        return memo[id(t)][1]

    plan.saved_bytes_without_remat = _saved(trc).stored_bytes()
    probes: dict = {}  # the programs probed (``_settled``) and their curves (``_curve``)
    plan.traced_peak_bytes = _peak_as_written(trc)
    new, report = recompute_checkpointed(trc)
    plan.recomputed += report.lines
    plan.checkpoint_regions = report.regions
    cheap_found = False
    if new is not trc:
        traces.append(new)
    settled = probed = None  # the cheap step's program as its probe left it (``_settled``), and what it probed
    for reason, header in (("cheap", _CHEAP_HEADER),
                           ("budget", f"Values recomputed to fit memory_budget={memory_budget} (transforms/remat_policy.py)")):
        saved = _saved(new)
        if reason == "cheap":
            chosen = cheap_values(saved)
            cheap_found = bool(chosen)
            if cheap_found:
                chosen = where_recomputing_lowers_the_peak(new, chosen, probes)
                # Not where the step asks for memory: there every cheap value is recomputed (a budget's reference,
                # what the default saves, is then the smaller count, as in a fused program)
                if not plan.checkpoint_regions and memory_budget is None:
                    alone = costly_alone if kernels_alone else costly_even_fused
                    chosen, plan.costly_kept = fewest_costly(new, chosen, saved.producer, probes, trc, alone)
                settled = _settled(new, chosen, probes)
                if settled.report.lines:
                    traces.append(settled.recomputed)
                    new = settled.recomputed
                    plan.recomputed += settled.report.lines
                probed = new  # (where nothing is recomputed, the probe's program has ``new``'s lines)
            continue
        else:
            plan.saved_bytes_default = saved.stored_bytes()
            if memory_budget is None:
                break
            # The head's logits, where it will run by blocks of rows, are not kept whatever the plan: the budget is
            # met that much earlier (else it recomputes around them for nothing, and its chains break the head's form).
            # Its input stays kept (the blocked head reads it for every block; recomputed, the head's form is lost).
            head_bytes, head_input = head_logits(new.bound_symbols)
            if head_input is not None:
                saved.alive.add(id(head_input))
            chosen = budget_values(saved, memory_budget * plan.saved_bytes_default + head_bytes)
        lines, more = recompute(new.bound_symbols, _is_backward, chosen, new.make_name, reasons={k: reason for k in chosen})
        if more.lines:
            step = new.derive(header)
            step.bound_symbols = lines
            traces.append(step)
            new = step
            plan.recomputed += more.lines
    asks = plan.checkpoint_regions or memory_budget is not None
    if plan.recomputed or asks or cheap_found:  # (cheap values kept where their bytes fit the sunk program's peak)
        # Backward lines as late as their readers allow (transforms/sinking.py): a recomputed value lands right
        # before its first reader, beside gradients made earlier that nothing reads yet.  In a default step only
        # where that lowers the planned peak (the llama zoo step's measured peak rose 304 bytes where it did not).
        if new is probed and not asks:
            sunk = settled.sunk  # the probe sank it already
        else:
            sunk = sink(new)
            sunk = sunk if sunk is not new and (asks or _peak_of(sunk, probes) < _peak_of(new, probes)) else None
        if sunk is not None:
            traces.append(sunk)
            new = sunk
    if asks:
        # Where the program asks for memory: recomputed values held across the planned peak recomputed once more after it.
        again = recompute_again(new, _is_backward, {id(p) for p in tree_flatten(new.output)[0] if is_proxy(p)})
        if again is not new:
            traces.append(again)
            new = again
    plan.saved_bytes = _saved(new).stored_bytes()
    if memory_budget is not None:
        plan.budget_met = plan.saved_bytes <= memory_budget * plan.saved_bytes_default
    plan.planned_peak_bytes = _peak_of(new, probes)
    return new, plan


def _returned(trc) -> set:
    return {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}


def _peak_of(trc, cache: dict) -> int:
    """The planned peak up to the backward's last line (the optimizer's functional updates become in-place writes).
    ``cache``: as ``_curve``'s."""
    return max(_curve(trc, cache), default=0)


def _curve(trc, cache: dict) -> list:
    """``alive_bytes`` of the lines up to the backward's last: found once per program in ``cache`` (the plan's probes
    ask it of the same programs up to three times), which keeps the trace so that its id is not reused."""
    key = ("curve", id(trc))
    if key not in cache:
        cache[key] = (trc, alive_bytes(_through_backward(trc), _returned(trc)))
    return cache[key][1]


def _held_curve(trc, cache: dict) -> list:
    """``_curve`` with the gradients the program holds for the update after the backward alive to the backward's end:
    of the values the lines after it read, the smallest, up to ``HOLD_BACK_BYTES`` in all (transforms/early_updates.py
    moves the other updates up to where each gradient is final; a small model's every gradient stays)."""
    key = ("held curve", id(trc))
    if key not in cache:
        lines = _through_backward(trc)
        held, total = set(), 0
        for k, a in sorted(_read_after_backward(trc, lines).items(), key=lambda kv: nbytes(kv[1])):
            total += nbytes(a)
            if total > HOLD_BACK_BYTES:
                break
            held.add(k)
        cache[key] = (trc, alive_bytes(lines, _returned(trc) | held))
    return cache[key][1]


def _peak_as_written(trc) -> int:
    """``_peak_of`` the step as traced, counted as eager runs it: a value the lines after the backward read (the
    optimizer's, every gradient) is held to the backward's end, as eager's ``.grad`` is until ``opt.step()``.  The
    plan's own count lets a gradient go where it is made, as the program's updates of large gradients, placed as
    soon as each is final (transforms/early_updates.py), nearly do.  Counted that way for eager too, ModernBERT's
    step held 16 KiB less than eager at eager's measured peak (its MLP's backward; the count's own peak 4.4 % under
    eager's), and the kept buffers, bound to this count, gave up values its program kept without the cheap
    recomputation (its fused step 2.6-3.5 % slower for it)."""
    lines = _through_backward(trc)
    return max(alive_bytes(lines, _returned(trc) | _read_after_backward(trc, lines).keys()), default=0)


def _read_after_backward(trc, lines) -> dict:
    """id -> value of what the lines after the backward (after ``lines``) read of the values ``lines`` make: the
    gradients the optimizer's lines read."""
    made = {id(o): o for b in lines for o in b.flat_outputs() if type(o) is TensorProxy}
    return {id(a): a for b in trc.bound_symbols[len(lines):] for a in b.all_reads() if id(a) in made}


def _through_backward(trc) -> list:
    """The lines up to the backward's last (all of them without a backward): what the plans count."""
    lines = trc.bound_symbols
    last = max((i for i, b in enumerate(lines) if _is_backward(b)), default=len(lines) - 1)
    return lines[: last + 1]


def plan_split(fwd_part, bwd_part, outputs, input_ids, make_name, memory_budget: float | None = None):
    """The plan of a forward/backward split (``transforms/autograd.py``, ``tt.compile(model)``): the same three
    steps as a whole step's (checkpoint regions, cheap values, ``memory_budget``) over the joint forward and
    backward, so what the forward saves for the backward is what the planner chose.  Returns (backward lines,
    MemoryPlan); ``planned_peak_bytes`` is filled in once the split is final (``split_memory_plan``)."""
    fwd_ids = {id(b) for b in fwd_part}
    is_backward = lambda b: id(b) not in fwd_ids  # noqa: E731 (recomputed lines are new: backward lines)
    returned = {id(o) for o in outputs}
    saved_of = lambda lines: Saved(lines, is_backward, returned, input_ids)  # noqa: E731
    plan = MemoryPlan(memory_budget=memory_budget)
    lines = list(fwd_part) + list(bwd_part)
    plan.saved_bytes_without_remat = saved_of(lines).stored_bytes()
    plan.checkpoint_regions = len({b.region.region for b in fwd_part if in_region(b)})
    # The regions' draws are kept here: the forward program is emitted from the computation, not from these lines,
    # so it could not read the generator's state for a replay (docs/memory.md).
    steps = (("checkpoint region", lambda s: checkpointed_values(lines, is_backward, returned, draws_again=False)),
             ("cheap", cheap_values),
             ("budget", lambda s: budget_values(s, memory_budget * plan.saved_bytes_default)))
    for reason, choose in steps:
        saved = saved_of(lines)
        if reason == "budget":
            plan.saved_bytes_default = saved.stored_bytes()
            if memory_budget is None:
                break
        chosen = choose(saved)
        lines, more = recompute(lines, is_backward, chosen, make_name, reasons={k: reason for k in chosen})
        plan.recomputed += more.lines
    plan.saved_bytes = saved_of(lines).stored_bytes()
    if memory_budget is not None:
        plan.budget_met = plan.saved_bytes <= memory_budget * plan.saved_bytes_default
    return [b for b in lines if is_backward(b)], plan


def split_memory_plan(fb) -> MemoryPlan:
    """The split's plan (``plan_split``) with its planned peak: the forward, then the backward."""
    plan = fb.plan
    plan.planned_peak_bytes = planned_peak(list(fb.forward.bound_symbols) + list(fb.backward.bound_symbols))
    return plan
