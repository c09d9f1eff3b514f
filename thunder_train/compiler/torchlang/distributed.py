"""The sharded parameter of a fully sharded (FSDP2) unit: gathered in the program, its gradient reduce-scattered.

``fsdp_all_gather(shard, ...)`` is what FSDP2's pre-forward all-gather gives the module: the whole parameter,
built from every rank's shard of dim 0 (``fully_shard`` pads the shards of dim 0 to one size, so the gather
pads this rank's shard, gathers, and keeps the parameter's rows).  Its gradient rule is FSDP2's
reduce-scatter: the gradient in the reduce dtype, averaged over the ranks (``ReduceOp.AVG``, FSDP2's default
for float32 and bfloat16), this rank's rows kept, in the shard's dtype.  The acquisition side (which modules,
which parameters, what is refused) is ``acquisition/fsdp.py``.
"""
from __future__ import annotations

from .. import clang, prims
from ..grad_rules import register_vjp
from ..prims.core import slice_in_dim
from .registry import torchsymbol


def _pad_rows(x, rows):
    """``x`` with zero rows appended up to ``rows`` rows (FSDP2's padded shard)."""
    extra = rows - x._tt_shape[0]
    if extra == 0:
        return x
    return prims.pad(x, 0.0, ((0, extra, 0),) + ((0, 0, 0),) * (x.ndim_ - 1))


@torchsymbol(name="fsdp_all_gather", torch_impl=None, tags=("fallible",))
def fsdp_all_gather(shard, *, full_rows, padded_rows, group_size, group_name, param_dtype=None, reduce_dtype=None,
                    reshard_after_forward=True):
    """The unsharded parameter (``full_rows`` rows) from this rank's ``shard`` of it; in ``param_dtype`` if given.

    ``reduce_dtype`` is used by the gradient only (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``);
    ``reshard_after_forward``: the backward gathers the parameter again rather than keeping it from the forward.
    """
    x = shard if param_dtype is None else clang.maybe_convert(shard, param_dtype)
    padded = _pad_rows(x, padded_rows)
    gathered = prims.wait(prims.all_gather(padded, group_size, group_name), padded)
    return slice_in_dim(gathered, 0, full_rows, 0)


@register_vjp(fsdp_all_gather)
def _fsdp_all_gather_vjp(g, out, /, shard, *, full_rows, padded_rows, group_size, group_name, param_dtype=None,
                         reduce_dtype=None, reshard_after_forward=True):
    x = g if reduce_dtype is None else clang.maybe_convert(g, reduce_dtype)
    padded = _pad_rows(x, padded_rows * group_size)
    mine = prims.wait(prims.reduce_scatter(padded, "avg", group_size, group_name), padded)
    mine = slice_in_dim(mine, 0, shard._tt_shape[0], 0)
    return {"shard": clang.maybe_convert(mine, shard._tt_dtype)}



# FSDP2 frees a unit's gathered parameters after its forward when ``reshard_after_forward`` and gathers them again for
# its backward: the memory planner recomputes such a line in the backward instead of keeping its result.
fsdp_all_gather.recompute_in_backward = lambda bsym: bool(bsym.kwargs.get("reshard_after_forward", True))
