"""``DistributedDataParallel`` inside a compiled function (a whole training step).

Eager DDP averages gradients over the ranks from autograd hooks that fire while
``loss.backward()`` runs.  A backward traced into the program runs no hooks, so
while tracing, ``DistributedDataParallel.forward`` is replaced (``ddp_while_tracing``):

* it checks what is supported (the default process group, no communication hook, no
  mixed precision, no buffers to broadcast) and raises a clear error otherwise;
* it runs the wrapped module and notes whether this forward's gradients are to be
  synchronised (``require_backward_grad_sync``: False inside ``no_sync()``);
* the traced ``backward()`` then averages the accumulated ``.grad`` of that module's
  parameters with one ``prims.all_reduce_mean`` (``reduce_gradients``): what eager's
  reducer writes, each gradient divided by the world size and summed over the ranks.

A DDP forward with grad enabled whose backward is not in the same function is an error:
its gradients would reach PyTorch autograd without DDP's reducer having been prepared,
and the ranks would drift apart silently.  Wrap the compiled module instead:
``DDP(tt.compile(model))`` (see docs/autograd.md).
"""
from __future__ import annotations

import contextlib

import torch

from .. import context, prims
from ..errors import TracingError
from ..proxies import TensorProxy


def _ddp_class():
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # torch built without distributed support
        return None
    return DistributedDataParallel


def is_ddp(module) -> bool:
    cls = _ddp_class()
    return cls is not None and isinstance(module, cls)


_ADVICE = ("Wrap the compiled module instead — DDP(tt.compile(model)) — and call backward() and the optimizer "
           "outside the compiled function.")


@contextlib.contextmanager
def ddp_while_tracing():
    cls = _ddp_class()
    if cls is None:
        yield
        return
    original = cls.forward

    def forward(self, *inputs, **kwargs):
        trc = context.get_trace()
        if trc is None:  # an eager DDP elsewhere (another thread) while this traces
            return original(self, *inputs, **kwargs)
        return _traced_forward(trc, self, inputs, kwargs)

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original


def _traced_forward(trc, ddp, inputs, kwargs):
    _check_supported(ddp)
    if torch.is_grad_enabled() and ddp.require_backward_grad_sync:
        average_gradients_at_backward(ddp.module, ddp.parameters_to_ignore)
    return ddp.module(*inputs, **kwargs)


def average_gradients_at_backward(module, ignore=()):
    """Inside a compiled function: the next ``backward()`` averages the ``.grad`` of ``module``'s
    parameters (except the names in ``ignore``) over the ranks, as DDP would.

    A traced DDP forward calls it; so do ThunderCallback's whole-step programs under
    ``DDPStrategy``, where DDP's own forward runs outside the program (with its reducer idle).
    """
    st = context.tracer_state()
    if st is None:
        raise RuntimeError("average_gradients_at_backward must be called inside a function compiled by thunder_train")
    pending = st.ddp_pending
    if not any(m is module for m, _ in pending):
        pending.append((module, frozenset(ignore)))


def _check_supported(ddp):
    problems = unsupported(ddp)
    if problems:
        raise TracingError(f"DistributedDataParallel inside a compiled function: {'; '.join(problems)} is not supported yet. {_ADVICE}")


def unsupported(ddp) -> list:
    """What of this DDP's configuration gradient averaging in the trace does not do (empty: all supported)."""
    import torch.distributed as dist

    problems = []
    if ddp.process_group is not dist.distributed_c10d._get_default_group():
        problems.append("a process group other than the default one")
    if getattr(ddp, "_comm_hooks", None):
        problems.append("a communication hook (register_comm_hook)")
    if getattr(ddp, "mixed_precision", None) is not None:
        problems.append("mixed_precision")
    if getattr(ddp, "_delay_all_reduce_all_params", False) or getattr(ddp, "_use_python_reducer", False):
        problems.append("delayed or Python-reducer all-reduce")
    if getattr(ddp, "broadcast_buffers", False) and next(ddp.module.buffers(), None) is not None:
        problems.append("broadcasting buffers before each forward (pass broadcast_buffers=False, or use a model without buffers)")
    return problems


def reduce_gradients(st, got_grad: set):
    """After a traced ``backward()``: average the ``.grad`` of the modules whose (DDP) forward asked for it.

    ``got_grad``: ids of the parameters this backward produced a gradient for.
    """
    pending = st.ddp_pending
    if not pending:
        return
    st.ddp_pending = []
    for module, ignore in pending:
        named = [(n, _proxy_of(st, p)) for n, p in module.named_parameters() if n not in ignore]
        named = [(n, p) for n, p in named if p._tt_requires_grad]
        missing = [n for n, p in named if id(p) not in got_grad]
        if missing:
            raise TracingError(
                f"DistributedDataParallel inside a compiled function: parameter(s) {', '.join(missing[:3])} got no gradient "
                "in this backward; parameters unused by the loss (find_unused_parameters) are not supported inside a "
                f"compiled function yet. {_ADVICE}"
            )
        st.grads.replace([p for _, p in named], prims.all_reduce_mean)


def _proxy_of(st, p):
    """The proxy of a parameter: swapped in when the module was an argument, captured when it is a global."""
    return p if type(p) is TensorProxy else st.walker.captured_tensor(p)


def check_finished(st):
    """At the end of tracing: every synchronising DDP forward had its backward in the function."""
    if st.ddp_pending:
        raise TracingError(
            "DistributedDataParallel inside a compiled function ran its forward with grad enabled, but the backward "
            "is not in the same function: DDP's gradient averaging would not run. Call loss.backward() (and the "
            f"optimizer) inside the compiled function, run the forward under torch.no_grad() for evaluation, or: {_ADVICE}"
        )
