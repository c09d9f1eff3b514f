"""Reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` and
``checkpoint_sequential(..., use_reentrant=True)``) inside a compiled function.

Eager's reentrant form is a ``torch.autograd.Function`` (``CheckpointFunction``): its forward runs the function
under ``no_grad`` (after saving the generator state when ``preserve_rng_state``); its backward sets that state
back, runs the function again with grad and differentiates that run, inside ``fork_rng`` so the generator ends
where it was. So, seen from outside:

* the values are the function's, and the gradients are those of a run that draws the forward's random numbers;
  the generator moves only by the forward's draws. Tracing the function once, differentiably, gives exactly
  that: same values, same gradients (to rounding in the order of accumulation), same generator state.
* with ``preserve_rng_state=False`` eager's recomputation draws new numbers at backward time, so its gradients
  belong to other random numbers than its outputs. Without random ops in the function that is the same as
  above; with them it is refused with a clear error (use ``preserve_rng_state=True`` or ``use_reentrant=False``).
* when no tensor argument requires grad (or grad is off) eager's outputs carry no gradient at all, and the
  parameters used inside get none: the function runs under ``no_grad``, as eager's forward does.

This decides values and gradients only; whether the region's activations are saved or recomputed in the
backward is the memory planner's business (a checkpoint region is marked the same way for every form).
"""
from __future__ import annotations

import warnings

import torch

from .. import context
from ..errors import TracingError
from .checkpoint_regions import reentrant as checkpoint_region


def is_reentrant_checkpoint(cls) -> bool:
    return cls is getattr(torch.utils.checkpoint, "CheckpointFunction", None)


def _region_draws(lines) -> list:
    return [b.sym.name for b in lines if b.draws_random]


def reentrant_checkpoint(args, any_input_needs_grad: bool):
    """``CheckpointFunction.apply(*args)`` while tracing; ``args`` = (run_function, preserve_rng_state, *inputs)."""
    run_function, preserve_rng_state, *inputs = args
    if not (torch.is_grad_enabled() and any_input_needs_grad):
        if torch.is_grad_enabled():
            warnings.warn("None of the inputs have requires_grad=True. Gradients will be None", stacklevel=3)
        with torch.no_grad():
            return run_function(*inputs)
    scope = context.get_trace()._scopes[-1]
    start = len(scope)
    with checkpoint_region():  # its lines are recomputed in the backward (checkpoint_regions.py)
        out = run_function(*inputs)
    drawn = _region_draws(scope[start:])
    if not preserve_rng_state and drawn:
        raise TracingError(
            f"torch.utils.checkpoint.checkpoint(use_reentrant=True, preserve_rng_state=False) around random ops "
            f"({', '.join(sorted(set(drawn))[:3])}): eager recomputes them in the backward with other random numbers "
            "than its forward drew, so its gradients belong to other values than its outputs; thunder_train does not "
            "reproduce that. Use preserve_rng_state=True (the default) or use_reentrant=False.")
    return out
