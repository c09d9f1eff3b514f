"""The global random generators' state as values of the program.

Inside a compiled function, ``torch.manual_seed``, ``torch.get_rng_state``/``set_rng_state`` and their
``torch.cuda`` forms (and so ``torch.random.fork_rng`` and checkpoint's ``preserve_rng_state``, which are built on
them) are lines of the program, run where eager runs them on every call: reading the state gives a uint8 tensor,
setting it takes one. Seeding and setting are ``"random"`` (they change a generator: DCE keeps them, and a program
abandoned by a decision check puts the state back); reading is ``"reads_generator"`` (an unread read is dropped;
decisions refuse values read from it, as from random values).  Which
generator: ``device`` (a ``devices.Device``, ``cpu`` or ``cuda:i``); ``manual_seed``'s ``scope`` is ``"all"``
(``torch.manual_seed``: every device), ``"cuda"`` (the current CUDA device) or ``"cuda_all"``."""
from __future__ import annotations

import torch

from .. import devices, dtypes
from ..proxies import TensorProxy, is_int
from .core import check, prim

SEED_SCOPES = ("all", "cuda", "cuda_all")


def state_size(device) -> int:
    """Bytes of ``device``'s generator state (a read: it draws nothing)."""
    # the generator objects' own methods: the module functions may be the traced forms while tracing
    if device.type == "cpu":
        return torch.default_generator.get_state().numel()
    mod = torch.get_device_module(device.type)
    mod.init()
    return mod.default_generators[device.index].get_state().numel()


@prim(tags=("reads_generator", "non_differentiable"))
def get_rng_state(device):
    """A copy of ``device``'s default generator state (a CPU uint8 tensor, as ``torch.get_rng_state()``)."""
    check(isinstance(device, devices.Device), "get_rng_state: expected a device")
    return TensorProxy(shape=(state_size(device),), dtype=dtypes.uint8, device=devices.cpu)


@prim(tags=("random", "side_effect", "non_differentiable"))
def set_rng_state(state, device):
    """Set ``device``'s default generator to ``state`` (a CPU uint8 tensor read by ``get_rng_state``)."""
    check(isinstance(device, devices.Device), "set_rng_state: expected a device")
    check(type(state) is TensorProxy and state._tt_dtype is dtypes.uint8 and state._tt_device == devices.cpu
          and len(state._tt_shape) == 1,
          lambda: "set_rng_state: the state must be a 1-d CPU uint8 tensor (one torch.get_rng_state() returned)")
    return None


@prim(tags=("random", "side_effect", "non_differentiable"))
def manual_seed(seed, scope):
    """Seed the generators of ``scope`` (one of ``SEED_SCOPES``) with the integer ``seed``."""
    check(scope in SEED_SCOPES, lambda: f"manual_seed: unknown scope {scope!r}")
    check(is_int(seed), lambda: f"manual_seed: the seed must be an integer, got {seed!r}")
    return None
