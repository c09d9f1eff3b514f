"""Lines that keep torch's autograd graph to a later line, and the memory that graph holds.

Attention eager runs with a kernel other than flash runs as eager's own call on the forward line, keeping the graph it
records for the backward line (``sdpa_keeping_graph``, ``sdpa_graph_backward``; executors/saved_statistics.py
chooses them).  The graph holds the tensors the call saved for its backward, memory no proxy shows: the kept buffers'
plan (executors/buffers.py) counts it with the line's result (``held_bytes``), or it gave the arena room that was not
there (DeepSeek-V3's torch program peaked at 1.07x eager's).
"""
from __future__ import annotations

import torch

from ..proxies import TensorProxy, meta_tensor
from ..pytree import tree_flatten, tree_map


def sdpa_keeping_graph(query, key, value, which, **kwargs):
    """Eager's ``scaled_dot_product_attention`` call (whatever kernel it picks: the math one for one key/value head
    broadcast over the query heads, or a mask it does not take to flash), run as eager runs it in training: on
    ``query``, ``key``, ``value`` (those at the positions ``which`` made to require grad).  The output comes back
    detached, carrying the autograd graph eager's call recorded, which ``sdpa_graph_backward`` runs: eager's own
    backward kernels, bitwise eager's gradients, without running the forward a second time."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(i in which) for i, t in enumerate((query, key, value))]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, **kwargs)
    result = out.detach()
    result._tt_graph = (out, [leaves[i] for i in which])
    return result


def sdpa_graph_backward(g, out, *reads):
    """The gradients of the call ``sdpa_keeping_graph`` made for ``g`` (torch's autograd; the graph is freed).
    ``reads``: the forward's inputs, which the graph saved (listed so that nothing writes over them before this)."""
    graph, leaves = out.__dict__.pop("_tt_graph")
    return torch.autograd.grad(graph, leaves, g)


def _saved_storages(fn, args, kwargs) -> tuple:
    """({storage: proxy} of the call's tensor arguments, {storage: bytes} of what ``fn(*args, **kwargs)`` saves for its
    backward): the same call made on meta tensors laid out as the proxies, its saved tensors seen by a
    ``saved_tensors_hooks`` pack hook and told apart by storage (a view of an argument is the argument's memory)."""
    proxies = [t for t in tree_flatten((args, kwargs))[0] if type(t) is TensorProxy]
    metas = {id(p): meta_tensor(p) for p in proxies}
    args, kwargs = tree_map(lambda t: metas[id(t)] if type(t) is TensorProxy else t, (args, kwargs))
    inputs = {metas[id(p)].untyped_storage()._cdata: p for p in proxies}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args, **kwargs)
    return inputs, saved


def graph_saved_bytes(fn, *args, **kwargs) -> int:
    """The bytes of the storages ``fn(*args, **kwargs)`` saves for its backward, its tensor arguments' own excepted."""
    inputs, saved = _saved_storages(fn, args, kwargs)
    return sum(n for s, n in saved.items() if s not in inputs)


def graph_saved_arguments(fn, *args, **kwargs) -> list:
    """The tensor arguments (proxies) whose memory ``fn(*args, **kwargs)`` saves for its backward: the math attention
    kernel saves the value and scaled copies of the query and key, not the query and key themselves."""
    inputs, saved = _saved_storages(fn, args, kwargs)
    return [p for s, p in inputs.items() if s in saved]


# The plan counts them alive from the forward line to the result's last read, ``sdpa_graph_backward``'s line, and as
# many bytes again inside that line: the backward's temporaries (measured: up to half of it; tests/test_memory.py).
# DeepSeek-V3's attention: 19,968 bytes a layer, as the allocator counts them on the CPU.
sdpa_keeping_graph.held_bytes = lambda *args, **kwargs: graph_saved_bytes(sdpa_keeping_graph, *args, **kwargs)
