"""Compiler devices: a (type, index) pair with its torch counterpart."""
from __future__ import annotations

import torch


class Device:
    __slots__ = ("type", "index", "torch")

    def __init__(self, type: str, index: int | None = None):
        if type == "cuda" and index is None:
            index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        self.type = type
        self.index = index
        self.torch = torch.device(type, index) if index is not None else torch.device(type)

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and self.type == other.type and self.index == other.index

    def __hash__(self) -> int:
        return hash((self.type, self.index))

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    def __repr__(self) -> str:
        return f"devices.Device({str(self)!r})"


_cache: dict = {}


def from_torch(d) -> Device:
    """Accepts a torch.device, a string like 'cuda:0', or a Device."""
    if isinstance(d, Device):
        return d
    if d is None:
        d = torch.get_default_device() if hasattr(torch, "get_default_device") else "cpu"
    key = d
    try:
        return _cache[key]
    except (KeyError, TypeError):
        pass
    td = torch.device(d) if not isinstance(d, torch.device) else d
    if td.type == "cpu":
        dev = Device("cpu")
    else:
        dev = Device(td.type, td.index)
    try:
        _cache[key] = dev
    except TypeError:
        pass
    return dev


def to_torch(d):
    return d.torch if isinstance(d, Device) else d


cpu = Device("cpu")
