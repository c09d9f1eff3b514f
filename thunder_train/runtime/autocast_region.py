"""Eager autocast's weight-cast cache, seen from a step that updates its parameters.

Inside one ``torch.autocast`` region (cache on, the default), eager casts a leaf
parameter to the low-precision dtype once and reuses that copy until the
outermost region exits.  A step that updates the parameters in place and is
called twice inside one region therefore runs its second forward on the *old*
weights in eager (PyTorch recommends autocast around forward and loss only).
A compiled program converts the current weights on every call, so from the
second call in a region it would silently differ from eager.

What can be told cheaply is whether the cache was cleared since the previous
call: a one-element leaf ``sentinel`` goes through an autocast-eligible op; a
cached cast returns the same cast tensor, so its ``grad_fn`` is the same node
object as on the previous call.  The same node means "same region as the last
call": the call is refused before anything runs (calls are transactional).
Calls outside autocast, with ``cache_enabled=False``, or one per region (the
usual ``with autocast: step(...)`` inside the loop) run as usual.
"""
from __future__ import annotations

import torch


class AutocastCacheError(RuntimeError):
    """A parameter-updating step was called again inside one autocast region with the weight cache on."""


_MESSAGE = (
    "this compiled step updates parameters in place and was called a second time inside one "
    "torch.autocast region with the weight-cast cache on: eager PyTorch would reuse the low-precision "
    "copies of the parameters cast on the first call (stale weights), which the compiled program does not "
    "reproduce. Enter torch.autocast inside the loop (one region per step), or around the forward and loss "
    "inside the step, or pass cache_enabled=False to torch.autocast.")


class RegionProbe:
    """Per compiled function: remembers the cast node of the previous call's probe."""

    __slots__ = ("_sentinels", "_node")

    def __init__(self):
        self._sentinels: dict = {}
        self._node = None

    def check(self) -> None:
        if not torch._C._is_any_autocast_enabled() or not torch.is_autocast_cache_enabled():
            self._node = None
            return
        device = "cuda" if torch.is_autocast_enabled("cuda") else "cpu"
        if not torch.is_autocast_enabled(device):
            self._node = None
            return
        s = self._sentinels.get(device)
        if s is None:
            s = self._sentinels[device] = torch.ones(1, 1, device=device, requires_grad=True)
        with torch.enable_grad():
            node = torch.mm(s, s).grad_fn.next_functions[0][0]
        if node is not None and node is self._node:
            raise AutocastCacheError(_MESSAGE)
        self._node = node
