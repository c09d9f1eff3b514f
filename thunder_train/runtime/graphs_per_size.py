"""CUDA graphs for a thin binding whose program has symbolic sizes: one graph per size.

A CUDA graph replays fixed kernels on fixed buffers, so a program whose batch size or sequence length is
symbolic (automatic dynamic shapes, ``dynamic=True``) cannot replay one graph for every size.
``GraphsPerSize`` is the computation thin mode calls in that case: it keys the call by the shapes of its
per-call tensors and runs the ``GraphedProgram`` (``cuda_graphs.py``: warm-up, capture, replay) made for that
key, creating one on a new key.  At most ``limit`` graphs are kept (the compiled function's ``cache_limit``);
the least recently used one is released (its graph and static buffers freed) when another size needs room.
Tensors bound by thin mode (parameters, optimizer state) are the same for every size and are not part of the
key.  The logic runs on the CPU with any factory (``tests/test_graphs_per_size.py``); captures need a device.
"""
from __future__ import annotations

import collections

import torch


class GraphsPerSize:
    """``make()`` -> a new per-size program (a ``GraphedProgram``); calls dispatch on the per-call shapes."""

    def __init__(self, make, static_positions, limit: int | None, note):
        self.make = make
        self._static_positions = static_positions  # () -> argument positions bound by thin mode (known once bound)
        self.static = None
        self.limit = limit
        self.note = note
        self.by_size: collections.OrderedDict = collections.OrderedDict()

    def key(self, inputs) -> tuple:
        if self.static is None:
            self.static = frozenset(self._static_positions())
        return tuple(tuple(v.shape) for j, v in enumerate(inputs) if j not in self.static and isinstance(v, torch.Tensor))

    def __call__(self, *inputs):
        k = self.key(inputs)
        prog = self.by_size.get(k)
        if prog is None:
            if self.limit is not None and len(self.by_size) >= self.limit:
                old_key, old = self.by_size.popitem(last=False)
                old.release()
                self.note(f"cuda_graphs: graph for sizes {old_key} released: more than {self.limit} sizes (cache_limit)")
            prog = self.by_size[k] = self.make()
        else:
            self.by_size.move_to_end(k)
        return prog(*inputs)

    @property
    def graph(self):
        """A captured graph of any size (``binding.py`` notes a dropped graph when there is one)."""
        return next((p.graph for p in self.by_size.values() if p.graph is not None), None)

    def release(self) -> None:
        for p in self.by_size.values():
            p.release()
        self.by_size.clear()
