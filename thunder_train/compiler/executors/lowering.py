"""Lowering a trace to executors: each bound symbol is claimed or decomposed."""
from __future__ import annotations

from ..symbols import set_inner_layout


class NoExecutorError(NotImplementedError):
    pass


def lower_to_executors(trc, executors, header: str):
    new = trc.derive(header)
    out = new.bound_symbols
    for bsym in trc.bound_symbols:
        _lower(bsym, executors, out)
    return new


def _lower(bsym, executors, out):
    for ex in executors:
        claimed = ex.claim(bsym)
        if claimed is not None:
            out.append(claimed)
            return
    if not bsym.subsymbols:
        if bsym.sym.is_prim or not _has_outputs(bsym):
            names = ", ".join(ex.name for ex in executors)
            raise NoExecutorError(f"no executor ({names}) can run {bsym.sym.id}")
    for sub in bsym.subsymbols:
        set_inner_layout(sub, bsym)  # the decomposition runs: its values have the layouts its lines give them
        _lower(sub, executors, out)


def _has_outputs(bsym):
    from .. import proxies

    return any(proxies.is_proxy(o) for o in bsym.flat_outputs())
