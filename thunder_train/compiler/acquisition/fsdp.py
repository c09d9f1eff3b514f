"""FSDP2 (``torch.distributed.fsdp.fully_shard``) modules inside a compiled function (a whole training step).

FSDP2 stays the engine of layout and state: parameters are DTensors sharded on dim 0, their gradients and the
optimizer's state too, and ``state_dict()`` / DCP work on them as in eager.  While tracing:

* every DTensor is read through its local shard (``p._local_tensor``, walker.py): the program's inputs are
  shards, and the optimizer updates shards (its update is elementwise, so the shard's update is the shard
  of eager's);
* FSDP2's forward hooks of each unit are replaced by ``_TracedUnit``: before the unit runs, each of its
  parameters becomes ``ltorch.fsdp_all_gather(shard)`` (the all-gather is a line of the program, its gradient
  rule the reduce-scatter, torchlang/distributed.py); after, the module holds its shards again.  FSDP2's own
  hooks do not run during a compiled call, and its state stays idle;
* the epilogue turns new gradients and new optimizer state back into DTensors with the parameter's spec
  (``as_sharded_like``), as FSDP2's reduce-scatter and the optimizer's ``zeros_like`` on a DTensor give them.

What this does not do is refused before anything runs (``unsupported``), never approximated.
"""
from __future__ import annotations

import sys

import torch

from .. import context, dtypes
from ..errors import TracingError


def _fsdp():
    """(FSDPModule, DTensor), each None while its module is not imported: an FSDP2 module or a DTensor exists only
    once it is, and importing ``torch.distributed.tensor`` loads sympy, which a first call must not pay
    (tests/test_first_call.py)."""
    fsdp_mod, tensor_mod = sys.modules.get("torch.distributed.fsdp"), sys.modules.get("torch.distributed.tensor")
    return getattr(fsdp_mod, "FSDPModule", None), getattr(tensor_mod, "DTensor", None)


def is_dtensor(t) -> bool:
    return _fsdp()[1] is not None and isinstance(t, _fsdp()[1])


def is_fsdp_module(m) -> bool:
    cls = _fsdp()[0]
    return cls is not None and isinstance(m, cls)


def as_sharded_like(local, param):
    """``local`` (a shard computed by the program) as a DTensor laid out like ``param`` (None stays None)."""
    if local is None:
        return None
    return _fsdp()[1](local, param._spec, requires_grad=False)


_ADVICE = "Compile the model without fully_shard, or run this step eagerly."


def check_dtensor(t, where: str):
    """A DTensor the program reads through its shard: only FSDP2's layout (dim 0 on a 1-D mesh) is supported."""
    from torch.distributed.tensor import Shard

    placements = tuple(t.placements)
    if t.device_mesh.ndim != 1 or placements != (Shard(0),):
        what = "a 2-D mesh (HSDP, or FSDP with tensor parallelism)" if t.device_mesh.ndim != 1 else \
            f"placements {placements} (tensor parallelism, or fully_shard with a shard_placement_fn)"
        raise TracingError(
            f"{where} is a DTensor with {what}: a compiled function supports DTensors laid out by fully_shard on a "
            f"1-D mesh only (placements (Shard(dim=0),)). {_ADVICE}")


def unsupported(state) -> list:
    """What of one fully_shard unit's configuration the compiled step does not do (empty: all supported)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    problems = []
    if len(state._modules) != 1:
        problems.append("fully_shard of a list of modules (one unit for several modules)")
    for pg in state._fsdp_param_groups:
        if isinstance(pg.mesh_info, HSDPMeshInfo) or isinstance(pg.post_forward_mesh_info, HSDPMeshInfo):
            problems.append("a 2-D (HSDP) mesh, or reshard_after_forward given as an int")
        if not pg.reduce_grads or not pg.all_reduce_grads or not pg.reshard_after_backward:
            problems.append("set_requires_gradient_sync(False) / set_requires_all_reduce(False) / "
                            "set_reshard_after_backward(False) (gradient accumulation without reduction)")
        if pg.gradient_divide_factor is not None or pg.force_sum_reduction_for_comms:
            problems.append("a gradient divide factor or forced sum reduction")
        if pg._all_reduce_hook is not None:
            problems.append("an all-reduce hook (set_all_reduce_hook)")
        if type(pg._all_gather_comm).__name__ not in ("DefaultAllGather", "ProcessGroupAllocAllGather") or \
                type(pg._reduce_scatter_comm).__name__ not in ("DefaultReduceScatter", "ProcessGroupAllocReduceScatter"):
            problems.append("a custom all-gather or reduce-scatter (set_custom_all_gather / _reduce_scatter)")
        mp = pg.mp_policy
        if mp.output_dtype is not None or not mp.cast_forward_inputs and mp.param_dtype is not None:
            problems.append("MixedPrecisionPolicy with output_dtype or cast_forward_inputs=False")
        for fp in pg.fsdp_params:
            if fp.fsdp_placement.dim != 0:
                problems.append(f"sharding on dim {fp.fsdp_placement.dim} (shard_placement_fn)")
            if fp.reduce_dtype not in (None, torch.float32, torch.bfloat16) or \
                    fp.reduce_dtype is None and fp.param_dtype not in (None, torch.float32, torch.bfloat16) or \
                    fp.reduce_dtype is None and fp.param_dtype is None and fp.orig_dtype not in (torch.float32, torch.bfloat16):
                problems.append("gradients reduced in float16 or float64 (FSDP2 divides them before and after the "
                                "reduction there; use reduce_dtype=torch.float32)")
            if fp.offload_to_cpu:
                problems.append("CPU offloading (offload_policy=CPUOffloadPolicy())")
            if type(fp.sharded_param._local_tensor) is not torch.Tensor:
                problems.append("parameters whose shards are tensor subclasses (float8 all-gather)")
    return sorted(set(problems))


def config_key(m) -> tuple:
    """What of fully_shard unit ``m``'s configuration a traced program depends on, comparable: the switches FSDP2's
    ``set_*`` methods change after ``fully_shard`` (gradient sync, resharding, divide factors, hooks, custom
    collectives).  The runtime guards it (runtime/hook_guard.py), so a switch flipped after compiling retraces, and
    the retrace refuses what ``unsupported`` names, instead of running the program traced before."""
    groups = m._get_fsdp_state()._fsdp_param_groups
    return ("fully_shard",) + tuple(
        (pg.reduce_grads, pg.all_reduce_grads, pg.reshard_after_backward, pg.post_forward_mesh_info is not None,
         pg.gradient_divide_factor, pg.force_sum_reduction_for_comms, pg._all_reduce_hook,
         type(pg._all_gather_comm), type(pg._reduce_scatter_comm)) for pg in groups)


class _TracedUnit:
    """Stands in for one fully_shard unit's forward hooks while tracing (restored by the walker afterwards)."""

    def __init__(self, walker, state):
        self.walker, self.state = walker, state
        self.params = [fp for pg in state._fsdp_param_groups for fp in pg.fsdp_params]
        # FSDP2 reshards after forward when the group has a post-forward mesh (its reshard_after_forward=True)
        self.reshard = any(pg.post_forward_mesh_info is not None for pg in state._fsdp_param_groups)
        mp = state._mp_policy
        self.input_dtype = mp.param_dtype if mp.cast_forward_inputs else None
        self.ran_with_grad = False  # a forward of this unit ran with grad enabled (check_finished)

    def _shard(self, fp):
        leaf = self.walker.by_id.get(id(fp.sharded_param))
        if leaf is None:
            raise TracingError(f"the parameter {fp._module_info.param_name} of a fully_shard unit was "
                               "not found among the function's inputs. Pass the model as an argument.")
        return leaf.proxy

    def pre(self, module, args, kwargs):
        from ..torchlang.distributed import fsdp_all_gather

        st = context.tracer_state()
        self.ran_with_grad = self.ran_with_grad or torch.is_grad_enabled()
        for fp in self.params:
            shard = st.buffers.read(self._shard(fp))
            mi = fp.mesh_info
            group = mi.shard_process_group
            full = fsdp_all_gather(
                shard, full_rows=fp._orig_size[0], padded_rows=fp.padded_sharded_param_size[0],
                group_size=mi.shard_mesh_size, group_name=group.group_name,
                param_dtype=None if fp.param_dtype is None else dtypes.from_torch(fp.param_dtype),
                reduce_dtype=None if fp.reduce_dtype is None else dtypes.from_torch(fp.reduce_dtype),
                reshard_after_forward=self.reshard)
            full = _reshape(full, fp._orig_size)
            _set_on_modules(fp, full)
        if self.input_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), self.input_dtype)
        return args, kwargs

    def post(self, module, args, output):
        for fp in self.params:
            shard = self._shard(fp)
            _set_on_modules(fp, shard)
        return output


def _set_on_modules(fp, value):
    """What FSDP2's ``_setattr_on_modules`` does, with a proxy: the module (and those sharing the parameter) hold it."""
    info = fp._module_info
    for module, name in [(info.module, info.param_name)] + list(zip(info.shared_modules, info.shared_param_names)):
        module._parameters[name] = value


def _reshape(x, shape):
    return x if tuple(x._tt_shape) == tuple(shape) else x.reshape(tuple(shape))


def _cast_floats(tree, dtype):
    from ..pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, tree)


def prepare_module(walker, m, where: str):
    """Before a fully_shard module's parameters are swapped for proxies: FSDP2's lazy initialisation (what its first
    forward does), the checks, and its forward hooks replaced by ``_TracedUnit`` for the time of tracing."""
    state = m._get_fsdp_state()
    if state._is_root is None:
        state._lazy_init()
    problems = unsupported(state)
    if problems:
        raise TracingError(f"fully_shard unit {where} ({type(m).__name__}) inside a compiled function: "
                           f"{'; '.join(problems)} is not supported yet. {_ADVICE}")
    unit = _TracedUnit(walker, state)
    for fp in unit.params:
        walker.fsdp_params[id(fp.sharded_param)] = fp
    pre, post = state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id
    if pre not in m._forward_pre_hooks or post not in m._forward_hooks:
        raise TracingError(f"fully_shard unit {where}: its forward hooks were removed. {_ADVICE}")
    walker.swapped.append((m._forward_pre_hooks, pre, m._forward_pre_hooks[pre]))
    walker.swapped.append((m._forward_hooks, post, m._forward_hooks[post]))
    m._forward_pre_hooks[pre] = unit.pre
    m._forward_hooks[post] = unit.post
    walker.fsdp_units.append(unit)


def fsdp_hook_ids(m) -> tuple:
    """The ids of fully_shard's forward hooks on ``m`` (none when it is not a unit)."""
    if not is_fsdp_module(m):
        return ()
    state = m._get_fsdp_state()
    return state._pre_forward_hook_handle.id, state._post_forward_hook_handle.id


def lazy_init_roots(values):
    """FSDP2 decides its root module on the first forward; the modules given to the function decide it here,
    before any parameter is swapped (lazy initialisation re-reads the parameters from the modules)."""
    for v in values:
        if isinstance(v, torch.nn.Module):
            for m in v.modules():
                if is_fsdp_module(m) and m._get_fsdp_state()._is_root is None:
                    m._get_fsdp_state()._lazy_init()


def check_walked(walker):
    """Every DTensor parameter the function reads belongs to a fully_shard unit it was given: a DTensor reached
    otherwise would be computed on as its shard."""
    for leaf in walker.leaves:
        if leaf.kind == "dtensor" and isinstance(leaf.value, torch.nn.Parameter) and id(leaf.value) not in walker.fsdp_params:
            raise TracingError(
                f"{leaf.where} is a DTensor parameter of no fully_shard unit among the function's inputs: a compiled "
                "function supports DTensor parameters managed by fully_shard (FSDP2) only; pass the fully_shard "
                f"model itself to the function. {_ADVICE}")


# What a step may do with a shard besides gathering it: the optimizer's updates, elementwise arithmetic and the
# gradient's bookkeeping, all of which give eager's rows of the whole result.  Anything else (a norm for
# gradient clipping, a matmul with a tied weight outside its unit) would see this rank's rows only.
_ROW_WISE = frozenset({"fsdp_all_gather", "adam_update", "sgd_update", "adagrad_update", "_fused_adam_", "_fused_adamw_",
                       "_fused_sgd_", "_fused_adagrad_", "copy_", "grad_layout", "stop_gradient", "convert_element_type",
                       "clone", "detach", "zeros_like", "ones_like", "empty_like", "full_like", "to", "type_as"})


def check_shard_uses(st):
    """Every line that reads a shard (of a sharded parameter, its gradient or optimizer state, or a value computed
    from them) computes rows from rows; otherwise a clear error instead of a result on this rank's part alone."""
    walker = st.walker
    if not walker.dtensor_of:
        return
    shards = set(walker.dtensor_of)
    for b in st.trace.bound_symbols:
        name = b.sym.name
        read = [a for a in b.flat_args() if id(a) in shards]
        if not read:
            continue
        if name == "grad_layout":  # the gradient of a sharded parameter (its reduce-scattered rows)
            shards.update(id(o) for o in b.flat_outputs())
            continue
        if name == "fsdp_all_gather":
            continue
        if name in _ROW_WISE or "elementwise" in b.sym.tags or name.startswith("_foreach_") and name != "_foreach_norm":
            shards.update(id(o) for o in b.flat_outputs())
            continue
        leaf = walker.dtensor_of.get(id(read[0]))
        what = f"the sharded {leaf.where}" if leaf is not None else "a value computed from a sharded (FSDP2) tensor"
        raise TracingError(
            f"{b.sym.id} reads {what} outside its fully_shard unit's forward and the "
            "optimizer's update: inside a compiled step that value is this rank's shard, so the result would be "
            "computed on part of the tensor (eager computes on the whole DTensor). Not supported yet: do this between "
            "two compiled functions, eagerly on the DTensors; e.g. for gradient clipping by total norm compile "
            "forward and loss.backward() as one function, the optimizer's step and zero_grad as another (given the "
            "model and the optimizer), and call clip_grad_norm_ between them. Or run the step eagerly.")


def check_finished(st):
    """At the end of tracing: a fully_shard forward with grad enabled had its backward in the function.  Grad mode
    is read where each unit ran: an evaluation step that runs the model under ``torch.no_grad()`` inside the
    function needs no backward, whatever the mode it was called in."""
    walker = st.walker
    if not st.has_backward and any(u.ran_with_grad for u in walker.fsdp_units) and any(
            leaf.kind == "dtensor" and leaf.value.requires_grad for leaf in walker.leaves):
        raise TracingError(
            "a fully_shard (FSDP2) model inside a compiled function ran its forward with grad enabled, but the "
            "backward is not in the same function: its gradients would not be reduce-scattered into the sharded "
            ".grad. Call loss.backward() (and the optimizer) inside the compiled function, or run the forward "
            "under torch.no_grad() for evaluation.")
