"""Re-inplacing (torch executor): run an input's update chain in place instead of computing it aside and copying.

Functionalization (``compiler/acquisition/functional.py``) turns ``p.mul_(a); p.addcdiv_(m, d, value=s)``
into ``t1 = mul(p, a); t2 = addcdiv(t1, m, d, value=s); ...; copy_(t2, p)``: exact, but
for every updated tensor one extra allocation and one extra copy per step — for an
optimizer over many small parameters that is a third more kernel launches than eager.

On the executed (lowered) trace, a write-back ``copy_(v, inp)`` whose value comes from a
chain ``v = f_k(... f_1(inp, ...) ...)`` of elementwise ops, each taking the previous
value as its first argument, runs that chain in place on ``inp`` (``inp.mul_(a)``,
``inp.addcdiv_(...)``) and drops the copy, when that cannot change any value read:

* every op in the chain has an in-place form computing the same thing, keeps shape and dtype;
* no value of the chain (``inp``'s old value included) is read after the op that overwrites it,
  except the chain's final value, which the buffer holds until the program ends;
* no value of the chain is returned to the caller (a fresh output must not alias an input).

Multi-tensor updates (``ttex.adam_update``, ``sgd_update``, the step counters' ``_foreach_add``)
switch to their in-place forms the same way, all of a line's write-backs or none
(``_overwritten_in_place``).

A call must stay transactional: when it raises, its inputs are as they were. So an input is
only written in place after the last op that can raise on the values it reads (tag ``"fallible"``:
class indices out of range, ``clip_grad_norm_(error_if_nonfinite=True)``'s check, an op run
opaquely, ...).  A write-back that stays a copy (a BatchNorm's running statistics, computed in the forward) runs
right after that line, its value's line and the last read of the input's old value, not at the end of the program:
its value is freed there (``_early_write_backs``).

Only used for programs not connected to PyTorch autograd (saved tensors must not change).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, is_number, is_proxy
from ..pytree import tree_flatten
from . import torch_impls
from ..symbols import may_raise_on_values
from .torch_executor import impl_symbol, prim_inplace_form
from .out_forms import aliased_args, aliasing_results


# Whether a line may raise on its run-time values (compiler/symbols.py ``may_raise_on_values``).
_fallible = may_raise_on_values


def _fn(bsym):
    return getattr(bsym.sym, "fn", None)


def _multi_inplace_form(bsym):
    """(in-place function, ((output position or None for the whole output, argument position), ...))
    for updates of tensor lists: ``ttex.adam_update`` and friends, the step counters' ``_foreach_add``."""
    fn = _fn(bsym)
    if getattr(fn, "overwrites", None) is not None:
        return fn.inplace, fn.overwrites
    if fn is torch._foreach_add and len(bsym.args) == 2 and is_number(bsym.args[1]) and not bsym.kwargs:
        return torch_impls.foreach_add_, ((None, 0),)
    return None


def _inplace_form(bsym):
    """The in-place torch function computing what the line computes, with its arguments, or None.

    A torch-language op declares its in-place symbol (``Symbol.inplace_variant``, torchlang/inplace.py),
    valid when the line calls the op's own torch function or ``Tensor`` method (``torch.add``,
    ``Tensor.add``: ``Tensor.add_``); a prim's in-place form is the torch executor's
    (``prim_inplace_form``), valid for the torch function it chose."""
    src, fn = bsym.source, _fn(bsym)
    if src is None or fn is None:
        return None
    if src.module == "prims":
        return prim_inplace_form(src, fn)
    variant = src.inplace_variant
    if variant is None or variant.torch_impl is None:
        return None
    if fn is src.torch_impl or fn is getattr(torch.Tensor, src.name, None):
        return variant.torch_impl
    return None


def reinplace(trc, header="Write-backs run in place where nothing reads the old values"):
    """``trc``: a lowered trace.  Inputs that require grad are only updated in place when the
    program runs under ``torch.no_grad()`` (eager refuses in-place updates of such leaves otherwise)."""
    bsyms = list(trc.bound_symbols)
    producer = {}
    for i, b in enumerate(bsyms):
        for o in b.flat_outputs():
            if type(o) is TensorProxy:
                producer[id(o)] = i
    reads: dict = {}  # id(proxy) -> indices of the bound symbols that read it
    for i, b in enumerate(bsyms):
        for a in b.flat_args():
            if is_proxy(a):
                reads.setdefault(id(a), []).append(i)
    returned = {id(p) for p in tree_flatten(trc.output)[0] if is_proxy(p)}

    rewrite: dict = {}  # index -> in-place function
    drop = set()
    last_fallible = max((i for i, b in enumerate(bsyms) if _fallible(b)), default=-1)
    no_grad = "@torch.no_grad()" in trc.decorators
    write_backs = {}  # id(value) -> index of the copy_ writing it back into an input
    for ci, b in enumerate(bsyms):
        if _fn(b) is not torch_impls.copy_:  # a write-back
            continue
        write_backs[id(b.args[0])] = ci
        value, inp = b.args
        if inp._tt_requires_grad and not no_grad:
            continue
        chain = _chain(value, inp, bsyms, producer)
        if chain is None or chain[0] < last_fallible or any(id(bsyms[i].output) in returned for i in chain):
            continue
        if not _safe(chain, inp, ci, bsyms, reads):
            continue
        for i in chain:
            rewrite[i] = _inplace_form(bsyms[i])
        drop.add(ci)
    for i, b in enumerate(bsyms):
        plan = _multi_inplace_form(b)
        copies = plan and i > last_fallible and _overwritten_in_place(i, b, plan[1], bsyms, reads, write_backs, returned, no_grad)
        if copies:
            rewrite[i] = plan[0]
            drop.update(copies)
    after = _early_write_backs(bsyms, drop, last_fallible, producer, reads)
    if not drop and not after:
        return trc
    new = trc.derive(header)
    moved = {ci: [] for ci in after}
    for ci, at in after.items():
        moved.setdefault(at, []).append(ci)
    for i, b in enumerate(bsyms):
        if i in rewrite:
            note = f"{b.comment} (in place)" if b.comment else "in place"
            b = b.replace(sym=impl_symbol(rewrite[i], side_effect=True), comment=note)
        if i not in drop and i not in after:
            new.bound_symbols.append(b)
        new.bound_symbols.extend(bsyms[ci] for ci in sorted(moved.get(i, ())))
    return new


def _early_write_backs(bsyms, drop, last_fallible, producer, reads) -> dict:
    """{index of a write-back ``copy_(value, inp)`` that stays: the line it runs right after}, for those that can run
    earlier: after the last line that may raise (a call that raises leaves its inputs as they were), the line
    computing ``value`` and the last read of ``inp``'s old value, or of a value that may share its memory.  Its value
    is then freed there, not held to the end (a BatchNorm's new running statistics, computed in the forward)."""
    out, passes_on = {}, {}
    for ci, b in enumerate(bsyms):
        if ci in drop or _fn(b) is not torch_impls.copy_ or type(b.args[1]) is not TensorProxy:
            continue
        value, inp = b.args
        at = max(last_fallible, producer.get(id(value), -1))
        for r in _alias_reads(inp, bsyms, reads, passes_on):
            if r != ci:
                at = max(at, r)
        if at < ci - 1:
            out[ci] = at
    return out


def _alias_reads(inp, bsyms, reads, passes_on):
    """Indices of the lines reading ``inp`` or a value that may share its memory (a view of it, a result whose
    memory is not declared new: executors/out_forms.py ``aliased_args``).  ``passes_on``: line index -> (the argument
    positions its results may alias, None for all; those results), found once per line for every write-back (a
    first call's step writes back each parameter, whose readers overlap)."""
    seen, todo, out = {id(inp)}, [inp], set()
    while todo:
        x = todo.pop()
        for r in reads.get(id(x), ()):
            out.add(r)
            facts = passes_on.get(r)
            if facts is None:
                b = bsyms[r]
                aliased = aliased_args(b)
                facts = passes_on[r] = ((), ()) if _fn(b) is torch_impls.copy_ or aliased == () else \
                    (aliased, [o for o in aliasing_results(b) if type(o) is TensorProxy])
            aliased, results = facts
            if not results:
                continue
            b = bsyms[r]
            if aliased is not None and not any(b.args[k] is x for k in aliased if k < len(b.args)):
                continue
            for o in results:
                if id(o) not in seen:
                    seen.add(id(o))
                    todo.append(o)
    return out


def _chain(value, inp, bsyms, producer):
    """Indices of ``f_1 .. f_k`` producing ``value`` from ``inp`` through first arguments, or None."""
    chain = []
    cur = value
    while cur is not inp:
        i = producer.get(id(cur))
        if i is None:
            return None
        b = bsyms[i]
        if _inplace_form(b) is None or not b.args or type(b.args[0]) is not TensorProxy:
            return None
        out, first = b.output, b.args[0]
        if type(out) is not TensorProxy or out._tt_shape != first._tt_shape or out._tt_dtype is not first._tt_dtype:
            return None
        if any(a is first for a in b.flat_args()[1:]):
            return None  # x.mul_(x): reads the buffer it writes
        chain.append(i)
        cur = first
    return list(reversed(chain))


def _safe(chain, inp, copy_index, bsyms, reads):
    """No value the chain overwrites is read after it is overwritten (other than by the chain itself)."""
    values = [inp] + [bsyms[i].output for i in chain]
    for k, v in enumerate(values[:-1]):
        overwritten_at = chain[k]
        if any(r > overwritten_at and r != copy_index for r in reads.get(id(v), ())):
            return False
    # The final value stays in the buffer until the program ends: reading it later is fine.
    return True


def _overwritten_in_place(i, b, overwrites, bsyms, reads, write_backs, returned, no_grad):
    """For a multi-tensor update (``ttex.adam_update``; ``overwrites``: pairs of output and argument
    positions, from ``_multi_inplace_form``): the write-back copies its in-place form makes unnecessary, or None.

    All or nothing: every overwritten argument must be an input that gets exactly this output written
    back, whose old value nothing reads after the update, and whose new value is not returned.
    """
    arg_ids = [id(a) for a in b.flat_args() if is_proxy(a)]
    copies = []
    for out_pos, arg_pos in overwrites:
        outputs = b.output if out_pos is None else b.output[out_pos]
        for value, inp in zip(outputs, b.args[arg_pos]):
            ci = write_backs.get(id(value))
            if ci is None or bsyms[ci].args[1] is not inp or id(value) in returned or arg_ids.count(id(inp)) != 1:
                return None
            if inp._tt_requires_grad and not no_grad:
                return None
            if any(r > i and r != ci for r in reads.get(id(inp), ())):
                return None
            copies.append(ci)
    return copies
