"""Runs the compiler makes for itself draw nothing from the process's random generators.

Fake and meta runs that ask torch about an op (its layout, what it saves, its ``grad_fn``'s name, which results
are views) can reach global generators: torch's meta kernels for collectives (``dist.all_reduce`` on meta tensors)
number their fake work with Python's ``random.randint``, and a probe on small real CPU tensors (or a fake run
falling back to the real kernel) may run a random op (``bernoulli_``).  A user's step never draws there in eager.
Saving the generators' state and putting it back afterwards is no answer: the generators are process-wide, and
another thread (the training loop beside the background fusion worker, a data loader) drawing meanwhile would
have its draws undone and see the same numbers again.  So inside ``generators_untouched()`` this thread

* draws Python's numbers in those meta kernels from a private ``random.Random`` (``_PerThreadRandom`` stands for
  the ``random`` module in ``torch.distributed._meta_registrations``; other threads reach the global one through
  it, as before);
* runs torch's random ops with a private generator where the op takes one (``generator=``), and refuses the
  others (``WouldDraw``, which the probes take as "not askable"), except on meta tensors and fake runs of ops with
  a meta kernel, which draw nothing.

numpy's generator is not touched by any torch kernel.  Nothing is put back, so nothing of another thread is undone.
"""
from __future__ import annotations

import contextlib
import random
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_local = threading.local()


class WouldDraw(Exception):
    """A compiler run reached a random op that would draw from a global generator: the probe is not askable."""


class _PerThreadRandom:
    """The ``random`` module as a torch module sees it: a private generator in a thread inside
    ``generators_untouched()``, Python's global one elsewhere."""

    def __getattr__(self, name):
        return getattr(_local.random if getattr(_local, "depth", 0) else random, name)


def _install_per_thread_random() -> None:
    meta_registrations = sys.modules.get("torch.distributed._meta_registrations")
    if meta_registrations is not None and getattr(meta_registrations, "random", None) is random:
        meta_registrations.random = _PerThreadRandom()


def _tensors(args, kwargs):
    return [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]


def _device(tensors, kwargs) -> torch.device:
    device = kwargs.get("device")
    if device is not None:  # where the results are made, and so the draws: randint_like(meta, device="cpu") draws
        return torch.device(device)
    if tensors:
        return tensors[0].device  # a fake tensor's fake device
    return torch.get_default_device()


class _PrivateGenerators(TorchDispatchMode):
    """Random ops get a private generator per device; ``reseed()`` makes the next run draw what the last one did."""

    def __init__(self):
        super().__init__()
        self.generators = {}

    def reseed(self) -> None:
        for g in self.generators.values():
            g.manual_seed(0)

    def _generator(self, device):
        g = self.generators.get(device)
        if g is None:
            g = self.generators[device] = torch.Generator(device).manual_seed(0)
        return g

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            func, args, kwargs = self._private(func, args, kwargs)
        return func(*args, **kwargs)

    def _private(self, func, args, kwargs):
        from torch._subclasses.fake_tensor import is_fake

        tensors = _tensors(args, kwargs)
        device = _device(tensors, kwargs)
        if device.type == "meta" or tensors and all(is_fake(t) for t in tensors) \
                and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "Meta"):
            return func, args, kwargs  # a meta kernel runs: it draws nothing
        names = [a.name for a in func._schema.arguments]
        if "generator" not in names:
            taking = _overload_with_generator(func)  # randperm(n) -> randperm(n, generator=)
            if taking is None:
                raise WouldDraw(f"{func} draws from the global generator of {device}")
            func, names = taking, [a.name for a in taking._schema.arguments]
        i = names.index("generator")
        if i < len(args):
            if args[i] is None:
                args = (*args[:i], self._generator(device), *args[i + 1:])
        elif kwargs.get("generator") is None:
            kwargs = {**kwargs, "generator": self._generator(device)}
        return func, args, kwargs


_WITH_GENERATOR: dict = {}


def _overload_with_generator(func):
    """The overload of ``func``'s op taking the same arguments and a ``generator`` (``rand.generator`` for
    ``rand.default``), or None."""
    if func not in _WITH_GENERATOR:
        names = {a.name for a in func._schema.arguments} | {"generator"}
        packet = func.overloadpacket
        found = [getattr(packet, o) for o in packet.overloads()]
        _WITH_GENERATOR[func] = next((f for f in found if {a.name for a in f._schema.arguments} == names), None)
    return _WITH_GENERATOR[func]


@contextlib.contextmanager
def generators_untouched():
    """The compiler's own runs inside draw from no global generator (module docstring); yields the private torch
    generators (``reseed()`` before running a probe again with the same draws)."""
    _install_per_thread_random()
    depth = getattr(_local, "depth", 0)
    if depth == 0:
        _local.random = random.Random(0)
    _local.depth = depth + 1
    try:
        with _PrivateGenerators() as private:
            yield private
    finally:
        _local.depth = depth
