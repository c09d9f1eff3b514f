"""``fusion=...``: which region executor fuses a trace (Inductor or nvFuser), chosen per trace.

``"inductor"`` (CPU and CUDA, ``inductor_fusion.py``), ``"nvfuser"`` (CUDA, ``nvfuser_fusion.py``; where
``nvfuser_direct`` cannot run, one note says why and the torch executor runs the ops), ``"auto"``: nvFuser
for a trace on CUDA tensors where it is available, Inductor otherwise.
"""
from __future__ import annotations

from ..proxies import TensorProxy
from ..pytree import tree_flatten
from . import inductor_fusion, nvfuser_fusion

_HEADERS = {"": "Fused by {}", "fw_": "Forward fused by {}", "bw_": "Backward fused by {}"}


def on_cuda(trc) -> bool:
    """Whether the trace computes on CUDA tensors (its inputs or any line's outputs)."""
    if any(type(p) is TensorProxy and p._tt_device.type == "cuda" for p in trc.args):
        return True
    return any(type(o) is TensorProxy and o._tt_device.type == "cuda" for b in trc.bound_symbols for o in tree_flatten(b.output)[0])


def choose(trc, fusion: str, notes: list) -> str:
    """The executor ``fusion`` ("inductor", "nvfuser" or "auto") means for this trace."""
    if fusion not in ("auto", "background"):  # "background": the same choice, made where the fused program is built
        return fusion
    if not on_cuda(trc):
        return "inductor"
    nvf, why = nvfuser_fusion.availability()
    if nvf is not None:
        return "nvfuser"
    note = f"fusion='auto': nvFuser not used: {why}; Inductor (Triton) fuses CUDA regions"
    if note not in notes:
        notes.append(note)
    return "inductor"


def fuse(trc, fusion: str, notes: list, part: str = "", as_written: bool = False):
    """``trc`` with its regions fused by the executor ``fusion`` chooses; ``part`` is "", "fw_" or "bw_";
    ``as_written``: the program may hold what the step as written holds (``inductor_fusion._walk``)."""
    kind = choose(trc, fusion, notes)
    if kind == "nvfuser" and not on_cuda(trc):
        note = f"nvfuser_{part}fusion: nvFuser not used: the program's tensors are not on a CUDA device (nvFuser fuses CUDA tensors)"
        why = nvfuser_fusion.availability()[1]
        notes.append(note + (f"; besides, {why}" if why else ""))
        return trc
    if kind == "nvfuser":
        return nvfuser_fusion.fuse_regions(trc, notes, prefix=f"nvfuser_{part}fusion", header=_HEADERS[part].format("nvFuser"))
    return inductor_fusion.fuse_regions(trc, notes, prefix=f"inductor_{part}fusion", header=_HEADERS[part].format("Inductor"),
                                        as_written=as_written)
