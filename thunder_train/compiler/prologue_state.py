"""Global state the prologue reads."""
from __future__ import annotations

import torch


def autocast_state():
    """(cpu, cuda) autocast: each None when off, else the autocast dtype."""
    cpu = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    cuda = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
    return cpu, cuda
